// A state-machine fuzzer of the coordinator on the host backend (issue 19).
// One seed drives a random interleaving of trainer and engine actions
// (register, control stream open/close, Init, Start streaming or staged,
// chunks, Finish, Abort, a stream that ends early, Pause/Resume, Check,
// Unregister, an engine that stops acknowledging, an engine whose shared
// memory shrinks under the daemon) against the real Coordinator, real
// shared memory and the host data plane. After every step it checks:
//   * the daemon answers (GetStatus within a second);
//   * each registered engine's memory equals exactly the version the daemon
//     reports for it (clean engines, when no update is in flight);
//   * versions only rise;
//   * at the end, after the trainer ends its update and one full update,
//     no engine is paused or dirty, and every survivor holds that update;
//   * open fds and resident memory stay bounded over the whole run.
// The actions of a seed are a pure function of the seed (std::mt19937_64),
// so a failing seed replays the same sequence:
//   bazel test //tests:state_machine_test --test_env=WS_SM_SEED=<seed>
// CI runs seeds 1..WS_SM_SEEDS (default 60) of WS_SM_STEPS (default 80)
// steps; longer: --test_env=WS_SM_SEEDS=2000 --test_env=WS_SM_STEPS=200.
#include <dirent.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/random/random.h"
#include "absl/strings/str_cat.h"
#include "client/host_arena.h"
#include "common/chunk_planner.h"
#include "daemon/backends.h"
#include "daemon/core/coordinator.h"
#include "gtest/gtest.h"
#include "tools/synthetic/synthetic_model.h"

namespace weightsync {
namespace {

int64_t EnvInt(const char* name, int64_t fallback) {
  const char* v = std::getenv(name);
  return v != nullptr ? std::atoll(v) : fallback;
}

int OpenFds() {
  int n = 0;
  if (DIR* d = opendir("/proc/self/fd")) {
    while (readdir(d) != nullptr) ++n;
    closedir(d);
  }
  return n;
}

int64_t RssKb() {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line)) {
    if (line.rfind("VmRSS:", 0) == 0) return std::stoll(line.substr(6));
  }
  return 0;
}

// An engine's control stream that acknowledges at once, unless frozen.
class SimChannel : public ControlChannel {
 public:
  SimChannel(Coordinator* core, std::string id)
      : core_(core), id_(std::move(id)) {}
  bool Send(const v1::DaemonMessage& m) override {
    if (frozen) return true;  // never acknowledged: the deadline decides
    v1::EngineMessage::Ack ack;
    ack.set_notice_id(m.notice_id());
    ack.set_ok(true);
    core_->OnAck(id_, ack);  // the hub sends outside its lock
    return true;
  }
  bool frozen = false;

 private:
  Coordinator* const core_;
  const std::string id_;
};

struct SimEngine {
  std::string id;
  std::unique_ptr<HostArena> arena;
  std::shared_ptr<SimChannel> channel;  // null: no stream open
  bool shrunk = false;                  // its memory can't be read any more
  int64_t last_version = 0;             // the highest the daemon reported
};

class Sim {
 public:
  explicit Sim(uint64_t seed) : rng_(seed), seed_(seed) {
    model_ = *synthetic::ModelByName("tiny");
    manifest_ = synthetic::Checkpoint(model_, v1::FLOAT32);
    CoordinatorOptions o;
    o.notice_timeout = absl::Milliseconds(30);
    o.finish_timeout = absl::Seconds(5);
    o.update_idle_timeout = absl::ZeroDuration();  // no wall clock: replays
    HostDataPlane::Options host;
    host.staging_buffers = 2;
    host.staging_budget = 1 << 20;
    core_ = std::make_unique<Coordinator>(o, MakeMemoryMapper(),
                                          MakeDataPlaneFactory(host));
  }
  ~Sim() {
    core_->Shutdown();
    core_.reset();
    for (SimEngine& e : engines_) e.arena->region().Unlink();
  }

  void Step(int step);
  void CheckInvariants(const std::string& where);
  void FinalUpdate();
  std::string trace() const { return trace_; }

 private:
  int Pick(int n) { return std::uniform_int_distribution<int>(0, n - 1)(rng_); }
  bool Chance(int percent) { return Pick(100) < percent; }
  SimEngine* RandomEngine() {
    return engines_.empty() ? nullptr : &engines_[Pick(engines_.size())];
  }
  void Note(const std::string& what) { absl::StrAppend(&trace_, what, "\n"); }

  void Register();
  void CloseStream(SimEngine& e);
  void Shrink(SimEngine& e);
  // The trainer's moves; `hostile`: now and then a refused version, an
  // abort instead of a finish.
  void Start(bool hostile = true);
  void Push(int64_t chunks);
  void Finish(bool hostile = true);
  void PauseOrResume();
  const synthetic::CheckpointData& Data(int64_t version);
  std::string PackChunk(int64_t index, int64_t version);

  std::mt19937_64 rng_;
  const uint64_t seed_;
  const uint32_t run_ = absl::Uniform<uint32_t>(absl::BitGen());
  synthetic::ModelConfig model_;
  std::vector<v1::TensorSpec> manifest_;
  std::unique_ptr<Coordinator> core_;
  std::vector<SimEngine> engines_;
  int next_engine_ = 0;
  bool group_ = false;
  // The trainer's open update, if any.
  std::string update_;
  int64_t update_version_ = 0, next_chunk_ = 0;
  ChunkPlan plan_;
  int64_t next_version_ = 1;
  std::map<int64_t, synthetic::CheckpointData> data_;
  std::string trace_;
};

void Sim::Register() {
  if (engines_.size() >= 4) return;
  SimEngine e;
  e.id = absl::StrCat("e", next_engine_++);
  // Unique beyond this process (sandboxes share /dev/shm and reuse pids);
  // the name plays no part in the seed's actions.
  const std::string shm =
      absl::StrCat("/wssm-", getpid(), "-", run_, "-", seed_, "-", e.id);
  auto arena = HostArena::Create(
      shm, synthetic::EngineParameters(model_, synthetic::Layout::kPlain, 0, 1,
                                       v1::BFLOAT16));
  ASSERT_TRUE(arena.ok()) << arena.status();
  e.arena = *std::move(arena);
  v1::RegisterEngineRequest r = e.arena->Registration();
  r.set_engine_id(e.id);
  const bool ok = core_->RegisterEngine(r).ok();
  Note(absl::StrCat("register ", e.id, ok ? "" : " (refused)"));
  ASSERT_TRUE(ok);
  e.channel = std::make_shared<SimChannel>(core_.get(), e.id);
  ASSERT_TRUE(core_->AttachControl(e.id, e.channel).ok());
  // A second stream for it is refused, never takes it over.
  auto intruder = std::make_shared<SimChannel>(core_.get(), e.id);
  ASSERT_EQ(core_->AttachControl(e.id, intruder).code(),
            absl::StatusCode::kAlreadyExists);
  EXPECT_FALSE(core_->DetachControl(e.id, intruder.get()));
  engines_.push_back(std::move(e));
}

// The engine's process dies: its stream closes, the daemon forgets it.
void Sim::CloseStream(SimEngine& e) {
  Note(absl::StrCat("close stream ", e.id));
  core_->DetachControl(e.id, e.channel.get());
  e.arena->region().Unlink();
  const std::string id = e.id;
  engines_.erase(std::find_if(engines_.begin(), engines_.end(),
                              [&](const SimEngine& x) { return x.id == id; }));
}

// ftruncate(0) under the daemon: its next access to the engine must fail
// that engine, not the daemon.
void Sim::Shrink(SimEngine& e) {
  Note(absl::StrCat("shrink ", e.id));
  const int fd = shm_open(e.arena->region().name().c_str(), O_RDWR, 0);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(ftruncate(fd, 0), 0);
  close(fd);
  e.shrunk = true;
}

const synthetic::CheckpointData& Sim::Data(int64_t version) {
  auto it = data_.find(version);
  if (it != data_.end()) return it->second;
  synthetic::CheckpointData& d = data_[version];
  for (const v1::TensorSpec& t : manifest_) {
    d[t.name()] = {t, synthetic::Contents(t, version)};
  }
  return d;
}

std::string Sim::PackChunk(int64_t index, int64_t version) {
  const Chunk& c = plan_.chunks[index];
  std::string bytes(c.size, '\0');
  const synthetic::CheckpointData& d = Data(version);
  for (const Piece& p : c.pieces) {
    const auto& payload = d.at(manifest_[p.tensor].name()).second;
    std::memcpy(&bytes[p.chunk_offset], payload.data() + p.tensor_offset,
                p.length);
  }
  return bytes;
}

void Sim::Start(bool hostile) {
  v1::StartWeightUpdateRequest r;
  // Now and then a version that does not rise: refused.
  const int64_t version = hostile && Chance(10) ? 1 : next_version_++;
  r.set_update_id(absl::StrCat("u", version, "-", Pick(1000)));
  r.set_target_version(version);
  r.set_mode(Chance(50) ? v1::UPDATE_MODE_STAGED : v1::UPDATE_MODE_STREAMING);
  r.set_verify(Chance(50) ? v1::VERIFY_ON : v1::VERIFY_OFF);
  r.set_chunk_bytes(int64_t{1} << (14 + Pick(4)));
  for (const v1::TensorSpec& t : manifest_) *r.add_tensors() = t;
  auto started = core_->StartWeightUpdate(r);
  Note(absl::StrCat("start v", version, " ", v1::UpdateMode_Name(r.mode()),
                    ": ", started.status().ToString()));
  if (!started.ok()) return;
  Manifest m(r.tensors().begin(), r.tensors().end());
  plan_ = *PlanChunks(m, started->chunk_bytes());
  update_ = r.update_id();
  update_version_ = version;
  next_chunk_ = 0;
  ASSERT_TRUE(core_->BeginPushStream(update_).ok());
}

void Sim::Push(int64_t chunks) {
  if (update_.empty()) return;
  const absl::Time deadline = absl::Now() + absl::Seconds(5);
  int64_t sent = 0;
  for (; sent < chunks && next_chunk_ < int64_t(plan_.chunks.size()); ++sent) {
    if (!core_
             ->PushChunk(update_, next_chunk_,
                         PackChunk(next_chunk_, update_version_), deadline)
             .ok()) {
      break;
    }
    ++next_chunk_;
  }
  Note(absl::StrCat("push ", sent, " -> ", next_chunk_, "/",
                    plan_.chunks.size()));
}

void Sim::Finish(bool hostile) {
  if (update_.empty()) return;
  absl::Status ended = core_->PushStreamEnded(update_, false);
  if (hostile && Chance(20)) {
    v1::AbortWeightUpdateRequest a;
    a.set_update_id(update_);
    Note(absl::StrCat("abort: ",
                      core_->AbortWeightUpdate(a).status().ToString()));
  } else {
    v1::FinishWeightUpdateRequest f;
    f.set_update_id(update_);
    auto done = core_->FinishWeightUpdate(f);
    Note(absl::StrCat("finish (stream: ", ended.ToString(),
                      "): ", done.status().ToString()));
  }
  update_.clear();
}

void Sim::PauseOrResume() {
  if (Chance(50)) {
    v1::PauseRequest p;
    p.set_mode(static_cast<v1::PauseMode>(Pick(4)));
    Note(absl::StrCat("pause: ", core_->Pause(p).status().ToString()));
  } else {
    v1::ResumeRequest r;
    r.set_allow_dirty(Chance(30));
    Note(absl::StrCat("resume: ", core_->Resume(r).status().ToString()));
  }
}

void Sim::Step(int step) {
  Note(absl::StrCat("step ", step));
  SimEngine* e = RandomEngine();
  switch (Pick(12)) {
    case 0:
    case 1:
      return Register();
    case 2:
      if (e != nullptr && Chance(50)) CloseStream(*e);
      return;
    case 3:
      if (e != nullptr) {
        Note(absl::StrCat("unregister ", e->id, ": ",
                          core_->UnregisterEngine(e->id).ToString()));
        CloseStream(*e);  // its process then goes away
      }
      return;
    case 4:
      if (e != nullptr) e->channel->frozen = !e->channel->frozen;
      return;
    case 5:
      if (e != nullptr && !e->shrunk && Chance(30)) Shrink(*e);
      return;
    case 6:
      if (!group_) {
        v1::InitWeightTransferRequest init;
        init.set_backend(v1::BACKEND_HOST);
        group_ = core_->InitWeightTransfer(init).ok();
      }
      if (update_.empty()) Start();
      return;
    case 7:
    case 8:
      return Push(Chance(70) ? 1000 : Pick(8));
    case 9:
      return Finish();
    case 10:
      return PauseOrResume();
    case 11:
      if (e != nullptr) {
        v1::CheckEngineRequest c;
        c.set_engine_id(e->id);
        Note(absl::StrCat("check ", e->id, ": ",
                          core_->CheckEngine(c).status().ToString()));
      }
      return;
  }
}

void Sim::CheckInvariants(const std::string& where) {
  const absl::Time t0 = absl::Now();
  const v1::GetStatusResponse status = core_->GetStatus();
  ASSERT_LT(absl::Now() - t0, absl::Seconds(1)) << where << ": GetStatus";
  const bool in_flight = status.has_update() &&
                         status.update().phase() != "committed" &&
                         !update_.empty();
  for (const v1::EngineStatus& s : status.engines()) {
    auto it =
        std::find_if(engines_.begin(), engines_.end(),
                     [&](const SimEngine& e) { return e.id == s.engine_id(); });
    ASSERT_NE(it, engines_.end()) << where << ": unknown " << s.engine_id();
    EXPECT_GE(s.version(), it->last_version)
        << where << ": " << s.engine_id() << "'s version went down";
    it->last_version = s.version();
    if (in_flight || it->shrunk || s.state() == v1::ENGINE_DIRTY ||
        s.version() == 0) {
      continue;
    }
    // Clean: exactly the version it reports, every parameter.
    const uint8_t* base = it->arena->region().data();
    for (const v1::Parameter& p : it->arena->parameters()) {
      const auto want = synthetic::ExpectedParameter(p, Data(s.version()));
      ASSERT_EQ(std::memcmp(base + p.offset(), want.data(), want.size()), 0)
          << where << ": " << s.engine_id() << " parameter " << p.name()
          << " is not version " << s.version();
    }
  }
}

// The trainer ends whatever it left open, sends one full update and
// resumes the engines: every engine still registered commits it and is
// READY (neither paused nor dirty).
void Sim::FinalUpdate() {
  Note("final");
  if (!update_.empty()) {
    v1::AbortWeightUpdateRequest a;
    a.set_update_id(update_);
    core_->AbortWeightUpdate(a).IgnoreError();
    update_.clear();
  }
  for (SimEngine& e : engines_) e.channel->frozen = false;
  if (!group_) {
    v1::InitWeightTransferRequest init;
    init.set_backend(v1::BACKEND_HOST);
    ASSERT_TRUE(core_->InitWeightTransfer(init).ok());
    group_ = true;
  }
  // Engines whose memory shrank go away (the daemon dropped those it
  // touched already).
  for (size_t i = engines_.size(); i-- > 0;) {
    if (engines_[i].shrunk) CloseStream(engines_[i]);
  }
  if (core_->GetStatus().engines().empty()) return;
  Start(/*hostile=*/false);
  ASSERT_FALSE(update_.empty()) << "the final update did not start";
  const int64_t version = update_version_;
  Push(1 << 20);
  Finish(/*hostile=*/false);
  // Engines the trainer paused itself stay paused until it resumes them
  // (a trainer that vanished instead is resumed by the idle watchdog).
  const absl::Status resumed = core_->Resume(v1::ResumeRequest()).status();
  Note(absl::StrCat("resume: ", resumed.ToString()));
  EXPECT_TRUE(resumed.ok()) << resumed;
  CheckInvariants("after the final update");
  const v1::GetStatusResponse status = core_->GetStatus();
  for (const v1::EngineStatus& s : status.engines()) {
    EXPECT_EQ(s.state(), v1::ENGINE_READY) << s.engine_id() << " not ready";
    EXPECT_EQ(s.version(), version) << s.engine_id();
  }
}

TEST(StateMachineTest, RandomInterleavingsKeepTheInvariants) {
  const int64_t only = EnvInt("WS_SM_SEED", 0);
  const int64_t seeds = EnvInt("WS_SM_SEEDS", 60);
  const int64_t steps = EnvInt("WS_SM_STEPS", 80);
  const int fds0 = OpenFds();
  const int64_t rss0 = RssKb();
  const absl::Time t0 = absl::Now();
  for (int64_t seed = only != 0 ? only : 1; seed <= (only != 0 ? only : seeds);
       ++seed) {
    Sim sim(seed);
    for (int step = 0; step < steps && !::testing::Test::HasFailure(); ++step) {
      sim.Step(step);
      sim.CheckInvariants(absl::StrCat("seed ", seed, " step ", step));
    }
    if (!::testing::Test::HasFailure()) sim.FinalUpdate();
    if (::testing::Test::HasFailure()) {
      FAIL() << "seed " << seed << " failed; replay with "
             << "--test_env=WS_SM_SEED=" << seed << "\n"
             << sim.trace();
    }
  }
  std::cout << "state machine: " << (only != 0 ? 1 : seeds) << " seeds x "
            << steps << " steps in " << absl::FormatDuration(absl::Now() - t0)
            << "; fds " << fds0 << " -> " << OpenFds() << ", RSS " << rss0
            << " -> " << RssKb() << " KiB" << std::endl;
  EXPECT_LE(OpenFds(), fds0 + 8) << "descriptors leaked";
#if !defined(__SANITIZE_ADDRESS__)  // ASan's quarantine holds freed memory
  EXPECT_LT(RssKb() - rss0, 256 << 10) << "KiB of resident memory grown";
#endif
}

}  // namespace
}  // namespace weightsync

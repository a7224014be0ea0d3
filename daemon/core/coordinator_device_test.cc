// The coordinator's side of issue 5 on the GPU backends, without a GPU: a
// fake data plane that receives its own bytes (as NCCL does), stages on the
// device and computes device receipts, and a fake engine that acknowledges
// every notice. Checks the order of events (nothing paused before every
// chunk is staged; the commit copy under the pause), the staging budget,
// a staged update that fails before its commit (engines untouched), the
// receipts' defaults and failures, and transfer plans (registration, the
// plans kept, the linked-plan cache). Since issue 33's sweeps also the
// rest of the core a peer or a clock meets: the idle watchdog and a
// trainer's going (short update_idle_timeout), chunk streams and IPC
// rings, engines lost, re-registered or faulted mid-update, Init, Pause,
// Resume, CheckEngine and trainer uids.
#include <sys/resource.h>

#include <algorithm>
#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/transfer_plan.h"
#include "daemon/core/coordinator.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/heap_memory.h"

namespace weightsync {
namespace {

using ::testing::Contains;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::Not;

// What happened, in order: data plane calls and notices engines received.
struct Log {
  absl::Mutex mu;
  std::vector<std::string> events;
  void Add(std::string e) {
    absl::MutexLock lock(&mu);
    events.push_back(std::move(e));
  }
  std::vector<std::string> Get() {
    absl::MutexLock lock(&mu);
    return events;
  }
};

class FakeDevicePlane : public DataPlane {
 public:
  explicit FakeDevicePlane(Log* log) : log_(log) {}
  // Called where the coordinator wakes the plane: after the engines are
  // selected, before the plan is made.
  void Warm() override {
    if (on_warm) on_warm();
  }
  absl::Status Begin(std::shared_ptr<const CopyPlan> plan,
                     const v1::StartWeightUpdateRequest&) override {
    log_->Add("Begin");
    begun = std::move(plan);
    return absl::OkStatus();
  }
  // Only an IPC ring's chunks come this way (announced, not carried).
  absl::Status SubmitChunk(int64_t index, std::string, absl::Time) override {
    log_->Add(absl::StrCat("SubmitChunk ", index));
    absl::SleepFor(submit_takes);
    return submit_status;
  }
  // An IPC ring's pacing: chunks [0, n) are in engine memory.
  absl::Status WaitChunks(int64_t n, absl::Time) override {
    log_->Add(absl::StrCat("WaitChunks ", n));
    return wait_chunks_status;
  }
  absl::Status Drain(absl::Time) override {
    log_->Add("Drain");
    if (on_drain) on_drain();
    return drain_status;
  }
  void Abort() override { log_->Add("Abort"); }
  void MarkEngineLost(int engine) override {
    absl::MutexLock lock(&lost_mu_);
    lost_.push_back(engine);
  }
  std::vector<int> marked_lost() {
    absl::MutexLock lock(&lost_mu_);
    return lost_;
  }
  int64_t chunks_written() const override { return written; }
  bool ReceivesOwnBytes() const override { return receives_own_bytes; }
  bool TakesPlanFp8AndPatches() const override { return takes_patches; }
  std::string name() const override { return plane_name; }
  absl::StatusOr<std::vector<v1::Receipt>> DeviceReceipts(
      const CopyPlan& plan, const std::vector<bool>& skip,
      absl::Time) override {
    log_->Add("DeviceReceipts");
    if (!receipts_status.ok()) return receipts_status;
    std::vector<v1::Receipt> out(plan.engines.size());
    for (v1::Receipt& r : out) r.set_checksum(42);
    return out;
  }
  int64_t DeviceStagingBudget() const override { return budget; }
  absl::Status BeginStaged(std::shared_ptr<const CopyPlan>,
                           const v1::StartWeightUpdateRequest&) override {
    log_->Add("BeginStaged");
    return absl::OkStatus();
  }
  absl::Status WaitStaged(absl::Time) override {
    log_->Add("WaitStaged");
    return wait_status;
  }
  absl::Status CommitStaged(absl::Time) override {
    log_->Add("CommitStaged");
    return absl::OkStatus();
  }

  // M->N: NCCL takes a transfer plan's chunks from their senders; other
  // planes (the base class) refuse.
  absl::Status SetChunkSources(std::shared_ptr<const CopyPlan> plan,
                               ChunkSources sources) override {
    if (plane_name != "nccl") {
      return DataPlane::SetChunkSources(std::move(plan), std::move(sources));
    }
    log_->Add(absl::StrCat("SetChunkSources ", sources.sender.size()));
    chunk_sources = std::move(sources);
    sources_plan = std::move(plan);
    return absl::OkStatus();
  }

  std::shared_ptr<const CopyPlan> begun;  // the last Begin's plan
  std::atomic<int64_t> written{0};        // chunks it wrote by itself
  ChunkSources chunk_sources;
  std::shared_ptr<const CopyPlan> sources_plan;  // of the last chunk_sources
  std::function<void()> on_warm;
  std::function<void()> on_drain;
  absl::Duration submit_takes;  // how long each SubmitChunk writes
  int64_t budget = int64_t{1} << 30;
  std::string plane_name = "nccl";
  // As NCCL's: bytes may land from Begin on, so a failed update is dirty
  // even before its first chunk (false: only once a chunk was written).
  bool receives_own_bytes = true;
  // As the host backend's: applies the sparse patches of many senders.
  bool takes_patches = false;
  absl::Status wait_status;
  absl::Status wait_chunks_status;
  absl::Status submit_status;
  absl::Status receipts_status;
  absl::Status drain_status;

 private:
  Log* log_;
  absl::Mutex lost_mu_;
  std::vector<int> lost_ ABSL_GUARDED_BY(lost_mu_);
};

class Factory : public DataPlaneFactory {
 public:
  explicit Factory(std::shared_ptr<DataPlane> plane)
      : plane_(std::move(plane)) {}
  absl::StatusOr<std::shared_ptr<DataPlane>> Create(
      const v1::InitWeightTransferRequest&) override {
    return plane_;
  }
  int LocalWorldSize(v1::Backend) const override { return 1; }

 private:
  std::shared_ptr<DataPlane> plane_;
};

// An engine that acknowledges every notice, from its own thread (a pause
// with ok = false while refuse_pause is set).
class AckingEngine : public ControlChannel {
 public:
  AckingEngine(Coordinator* c, Log* log, std::string id = "e")
      : c_(c), log_(log), id_(std::move(id)) {}
  std::atomic<bool> refuse_pause{false}, refuse_resume{false};
  std::atomic<bool> leave_on_pause{false};  // its stream closes instead
  std::atomic<int> refuse_pauses{0};  // refuses this many pauses, then acks
  std::atomic<int> ack_delay_ms{0};   // how long each ack takes
  ~AckingEngine() override {
    absl::MutexLock lock(&mu_);
    for (std::thread& t : threads_) t.join();
  }
  bool Send(const v1::DaemonMessage& m) override {
    const std::string kind = m.has_pause()         ? "pause"
                             : m.has_resume()      ? "resume"
                             : m.has_new_version() ? "new_version"
                                                   : "dirty";
    log_->Add(id_ == "e" ? kind : absl::StrCat(kind, " ", id_));
    v1::EngineMessage::Ack ack;
    ack.set_notice_id(m.notice_id());
    const bool refused_once = m.has_pause() && refuse_pauses.fetch_sub(1) > 0;
    ack.set_ok(!(m.has_pause() && refuse_pause) && !refused_once &&
               !(m.has_resume() && refuse_resume));
    if (!ack.ok()) ack.set_message("the engine is mid-request");
    absl::MutexLock lock(&mu_);
    if (m.has_dirty()) dirty_reasons_.push_back(m.dirty().reason());
    if (m.has_pause() && leave_on_pause) {
      threads_.emplace_back([this] { c_->DetachControl(id_, this); });
    } else {
      threads_.emplace_back([this, ack] {
        absl::SleepFor(absl::Milliseconds(ack_delay_ms.load()));
        c_->OnAck(id_, ack);
      });
    }
    return true;
  }
  // The reasons of the dirty notices it was sent, in order.
  std::vector<std::string> dirty_reasons() {
    absl::MutexLock lock(&mu_);
    return dirty_reasons_;
  }

 private:
  Coordinator* c_;
  Log* log_;
  const std::string id_;
  absl::Mutex mu_;
  std::vector<std::thread> threads_;
  std::vector<std::string> dirty_reasons_;
};

class CoordinatorDeviceTest : public ::testing::Test {
 protected:
  void SetUp() override { Make(CoordinatorOptions()); }

  // The coordinator (engine "e" attached, an nccl group) under `options`.
  void Make(const CoordinatorOptions& options) {
    if (coordinator_ != nullptr) TearDown();
    plane_ = std::make_shared<FakeDevicePlane>(&log_);
    mapper_ = std::make_shared<testing::HeapMapper>();
    coordinator_ = std::make_unique<Coordinator>(
        options, mapper_, std::make_shared<Factory>(plane_));
    RegisterE(0);
    engine_ = std::make_shared<AckingEngine>(coordinator_.get(), &log_);
    ASSERT_TRUE(coordinator_->AttachControl("e", engine_).ok());
    v1::InitWeightTransferRequest init;
    init.set_backend(v1::BACKEND_NCCL);
    auto group = coordinator_->InitWeightTransfer(init);
    ASSERT_TRUE(group.ok()) << group.status();
    group_ = group->group_id();
  }

  // Engine `id` ("e"): "w" (float32 [16], or [16, cols]) at `offset` of
  // its one allocation of 4 KiB per column, registered with `c` (the
  // fixture's coordinator).
  void RegisterE(int64_t offset, int cols = 1, const std::string& id = "e",
                 Coordinator* c = nullptr) {
    ASSERT_TRUE((c != nullptr ? c : coordinator_.get())
                    ->RegisterEngine(RegisterRequest(offset, cols, id))
                    .ok());
  }
  // RegisterE's request.
  static v1::RegisterEngineRequest RegisterRequest(int64_t offset, int cols,
                                                   const std::string& id) {
    v1::RegisterEngineRequest r;
    r.set_engine_id(id);
    v1::Allocation* a = r.add_allocations();
    a->set_kind(v1::MEMORY_HOST_SHM);
    a->set_handle("/x");
    a->set_size(4096 * cols);
    v1::Parameter* p = r.add_parameters();
    p->set_name("w");
    p->set_dtype(v1::FLOAT32);
    p->add_shape(16);
    if (cols > 1) p->add_shape(cols);
    p->set_offset(offset);
    return r;
  }

  // StartWeightUpdate of Request(version, mode, VERIFY_OFF).
  absl::Status Start(int64_t version, v1::UpdateMode mode) {
    return coordinator_
        ->StartWeightUpdate(Request(version, mode, v1::VERIFY_OFF))
        .status();
  }
  // Start(version, STREAMING) of engine `id` only.
  absl::Status StartOn(int64_t version, const std::string& id) {
    v1::StartWeightUpdateRequest r =
        Request(version, v1::UPDATE_MODE_STREAMING, v1::VERIFY_OFF);
    r.add_engine_ids(id);
    return coordinator_->StartWeightUpdate(r).status();
  }
  // The trainer pauses `ids` (all engines if none).
  void PauseByTrainer(const std::vector<std::string>& ids) {
    v1::PauseRequest pause;
    pause.set_timeout_ms(5000);
    for (const std::string& id : ids) pause.add_engine_ids(id);
    ASSERT_TRUE(coordinator_->Pause(pause).ok());
  }

  // Engine `id` registered as RegisterE(0, 1, id) and attached, acking.
  std::shared_ptr<AckingEngine> AddEngine(const std::string& id) {
    RegisterE(0, 1, id);
    auto engine = std::make_shared<AckingEngine>(coordinator_.get(), &log_, id);
    EXPECT_TRUE(coordinator_->AttachControl(id, engine).ok());
    return engine;
  }

  void TearDown() override {
    coordinator_->Shutdown();
    coordinator_.reset();
    engine_.reset();
  }

  v1::StartWeightUpdateRequest Request(int64_t version, v1::UpdateMode mode,
                                       v1::VerifyMode verify) {
    v1::StartWeightUpdateRequest req;
    req.set_update_id(absl::StrCat("u", version));
    req.set_target_version(version);
    req.set_mode(mode);
    req.set_verify(verify);
    v1::TensorSpec* t = req.add_tensors();
    t->set_name("w");
    t->set_dtype(v1::FLOAT32);
    t->add_shape(16);
    return req;
  }

  absl::StatusOr<v1::FinishWeightUpdateResponse> Finish(const std::string& id) {
    v1::FinishWeightUpdateRequest f;
    f.set_update_id(id);
    f.set_timeout_ms(5000);
    return coordinator_->FinishWeightUpdate(f);
  }

  absl::StatusOr<v1::PrepareWeightUpdateResponse> Prepare(
      const std::string& id) {
    v1::PrepareWeightUpdateRequest p;
    p.set_update_id(id);
    p.set_timeout_ms(5000);
    return coordinator_->PrepareWeightUpdate(p);
  }

  v1::EngineStatus Engine() {
    return coordinator_->GetStatus(false).engines(0);
  }
  // Engine `id`'s status (empty if it is not registered).
  v1::EngineStatus StatusOf(const std::string& id) {
    const v1::GetStatusResponse status = coordinator_->GetStatus(false);
    for (const v1::EngineStatus& e : status.engines()) {
      if (e.engine_id() == id) return e;
    }
    return v1::EngineStatus();
  }
  // The engine results of an update's end (Finish, Abort), by engine id.
  template <typename Response>
  static std::map<std::string, v1::EngineResult> ResultsById(
      const Response& response) {
    std::map<std::string, v1::EngineResult> out;
    for (const v1::EngineResult& r : response.engines()) out[r.engine_id()] = r;
    return out;
  }
  // A hold of the group formed now; then update `abort_id` is aborted and
  // a new group formed, so the hold returned is of an earlier group.
  absl::StatusOr<int64_t> HoldThenFormAnother(const std::string& abort_id) {
    auto hold = coordinator_->HoldGroup(group_);
    v1::AbortWeightUpdateRequest abort;
    abort.set_update_id(abort_id);
    EXPECT_TRUE(coordinator_->AbortWeightUpdate(abort).ok());
    v1::InitWeightTransferRequest init;
    init.set_backend(v1::BACKEND_NCCL);
    EXPECT_TRUE(coordinator_->InitWeightTransfer(init).ok());
    return hold;
  }
  // On a plane sent its chunks (the host backend's), update "u1" of two
  // senders' plan (RegisterTwoSenders, 256-byte chunks: one per link),
  // started; `req` is its request.
  void StartPlanOverChunks(v1::StartWeightUpdateRequest* req);
  // The update's status once it failed (the watchdog ended it), or after
  // 10 s.
  v1::UpdateStatus WaitUntilFailed() {
    const absl::Time give_up = absl::Now() + absl::Seconds(10);
    v1::UpdateStatus u;
    do {
      absl::SleepFor(absl::Milliseconds(20));
      u = coordinator_->GetStatus(false).update();
    } while (u.phase() != "failed" && absl::Now() < give_up);
    return u;
  }
  // Options of a watchdog that ends what is idle for 1 s.
  static CoordinatorOptions IdleOptions() {
    CoordinatorOptions options;
    options.update_idle_timeout = absl::Seconds(1);
    return options;
  }
  // Every engine's state, by id.
  std::map<std::string, v1::EngineState> States() {
    const v1::GetStatusResponse status = coordinator_->GetStatus(false);
    std::map<std::string, v1::EngineState> out;
    for (const v1::EngineStatus& e : status.engines()) {
      out[e.engine_id()] = e.state();
    }
    return out;
  }

  Log log_;
  std::string group_;  // the transfer group Make formed
  std::shared_ptr<FakeDevicePlane> plane_;
  std::shared_ptr<testing::HeapMapper> mapper_;
  std::unique_ptr<Coordinator> coordinator_;
  std::shared_ptr<AckingEngine> engine_;
};

TEST_F(CoordinatorDeviceTest, StagedCommitsUnderThePauseOnlyOnceAllIsStaged) {
  auto started = coordinator_->StartWeightUpdate(
      Request(1, v1::UPDATE_MODE_STAGED, v1::VERIFY_ON));
  ASSERT_TRUE(started.ok()) << started.status();
  EXPECT_EQ(started->mode(), v1::UPDATE_MODE_STAGED);
  // Receiving: the engine serves on, nothing paused.
  EXPECT_THAT(log_.Get(), ElementsAre("BeginStaged"));
  EXPECT_EQ(Engine().state(), v1::ENGINE_READY);
  auto done = Finish("u1");
  ASSERT_TRUE(done.ok()) << done.status();
  EXPECT_THAT(log_.Get(),
              ElementsAre("BeginStaged", "WaitStaged", "pause", "CommitStaged",
                          "Drain", "DeviceReceipts", "new_version", "resume"));
  ASSERT_EQ(done->engines_size(), 1);
  EXPECT_EQ(done->engines(0).receipt().checksum(), 42u);
  EXPECT_EQ(done->version(), 1);
  EXPECT_GT(done->pause_seconds(), 0);
  EXPECT_EQ(Engine().version(), 1);
  EXPECT_EQ(Engine().state(), v1::ENGINE_READY);
}

TEST_F(CoordinatorDeviceTest, StagedThatFailsBeforeItsCommitLeavesEngines) {
  ASSERT_TRUE(Start(1, v1::UPDATE_MODE_STAGED).ok());
  plane_->wait_status = absl::DeadlineExceededError("trainer gone");
  auto done = Finish("u1");
  ASSERT_FALSE(done.ok());
  EXPECT_EQ(done.status().code(), absl::StatusCode::kAborted);
  EXPECT_THAT(done.status().message(), HasSubstr("engines untouched"));
  // Never paused, never written.
  EXPECT_THAT(log_.Get(), ElementsAre("BeginStaged", "WaitStaged", "Abort"));
  EXPECT_EQ(Engine().version(), 0);
  EXPECT_EQ(Engine().state(), v1::ENGINE_READY);
}

// Two trainer ranks each hold half of "w" (rows of its [16, 1] view) and
// this daemon (receiver 0) needs all of it: 256-byte chunks, one per link.
// The spec of RegisterTwoSenders, naming `receivers`; sender 0 holds rows
// [0, split) and sender 1 the rest, for `spec_receivers` daemons that each
// need all of "w" (a different split is a different plan); "w" is [16] or
// [16, cols].
v1::RegisterTransferPlanRequest TwoSendersRequest(
    std::vector<int32_t> receivers, int split = 8, int spec_receivers = 1,
    int cols = 1);

absl::StatusOr<std::string> RegisterTwoSenders(Coordinator* c) {
  absl::StatusOr<v1::RegisterTransferPlanResponse> resp =
      c->RegisterTransferPlan(TwoSendersRequest({0}));
  if (!resp.ok()) return resp.status();
  return resp->plan_id();
}

v1::RegisterTransferPlanRequest TwoSendersRequest(
    std::vector<int32_t> receivers, int split, int spec_receivers, int cols) {
  v1::RegisterTransferPlanRequest r;
  v1::TransferPlanSpec* spec = r.mutable_spec();
  v1::TensorSpec* t = spec->add_tensors();
  t->set_name("w");
  t->set_dtype(v1::FLOAT32);
  t->add_shape(16);
  if (cols > 1) t->add_shape(cols);
  for (int s = 0; s < 2; ++s) {
    v1::TensorBlock* b = spec->add_senders()->add_holds();
    b->set_tensor("w");
    b->set_row_begin(s == 0 ? 0 : split);
    b->set_row_count(s == 0 ? split : 16 - split);
    b->set_col_count(cols);
  }
  for (int i = 0; i < spec_receivers; ++i) {
    v1::ReceiverLayout* d = spec->add_receivers();
    d->set_name(absl::StrCat("daemon ", i));
    v1::TensorBlock* n = d->add_needs();
    n->set_tensor("w");
    n->set_row_count(16);
    n->set_col_count(cols);
  }
  for (int32_t i : receivers) r.add_receivers(i);
  return r;
}

// Update "u1" to version 1 by transfer plan `id`.
v1::StartWeightUpdateRequest PlanUpdate(const std::string& id) {
  v1::StartWeightUpdateRequest req;
  req.set_update_id("u1");
  req.set_target_version(1);
  req.set_transfer_plan_id(id);
  return req;
}

// A plan_only Start of plan `id` at `chunk_bytes`: planned (the data plane
// handed its chunk sources), nothing paused, no update opened.
absl::StatusOr<v1::StartWeightUpdateResponse> PlanOnly(Coordinator* c,
                                                       const std::string& id,
                                                       int64_t chunk_bytes) {
  v1::StartWeightUpdateRequest req = PlanUpdate(id);
  req.set_plan_only(true);
  req.set_chunk_bytes(chunk_bytes);
  return c->StartWeightUpdate(req);
}

// Where a copy plan writes first: bytes into the engine's memory.
int64_t FirstWrite(const CopyPlan& plan) {
  int64_t first = -1;
  for (const std::vector<CopyOp>& ops : plan.ops_by_chunk) {
    for (const CopyOp& op : ops) {
      if (first < 0 || op.dst_offset < first) first = op.dst_offset;
    }
  }
  return first;
}

// A group of the two trainer ranks (0, 1) and this daemon (rank_offset).
void InitGroup(Coordinator* c, int rank_offset, bool senders_local = false) {
  v1::InitWeightTransferRequest init;
  init.set_backend(v1::BACKEND_NCCL);
  init.set_world_size(3);
  init.set_rank_offset(rank_offset);
  init.set_senders_on_this_host(senders_local);
  ASSERT_TRUE(c->InitWeightTransfer(init).ok());
}

void CoordinatorDeviceTest::StartPlanOverChunks(
    v1::StartWeightUpdateRequest* req) {
  plane_->plane_name = "host";
  plane_->receives_own_bytes = false;
  InitGroup(coordinator_.get(), 0);
  absl::StatusOr<std::string> id = RegisterTwoSenders(coordinator_.get());
  ASSERT_TRUE(id.ok()) << id.status();
  *req = PlanUpdate(*id);
  req->set_chunk_bytes(256);
  auto started = coordinator_->StartWeightUpdate(*req);
  ASSERT_TRUE(started.ok()) << started.status();
}

TEST_F(CoordinatorDeviceTest, TransferPlanOnNcclTakesEachChunkFromItsSender) {
  InitGroup(coordinator_.get(), 2);
  absl::StatusOr<std::string> id = RegisterTwoSenders(coordinator_.get());
  ASSERT_TRUE(id.ok()) << id.status();
  v1::StartWeightUpdateRequest req = PlanUpdate(*id);
  req.set_chunk_bytes(256);
  auto started = coordinator_->StartWeightUpdate(req);
  ASSERT_TRUE(started.ok()) << started.status();
  // Planned before anything paused: link (sender 0) then (sender 1), each
  // one chunk, both in round 0 (issue 32's rounds: chunk r of every link).
  EXPECT_THAT(log_.Get(), ElementsAre("SetChunkSources 2", "pause", "Begin"));
  EXPECT_THAT(plane_->chunk_sources.sender, ElementsAre(0, 1));
  EXPECT_THAT(plane_->chunk_sources.round, ElementsAre(0, 0));
  ASSERT_TRUE(Finish("u1").ok());
}

// A plan update that asks no chunk size gets the nccl default (64 MiB), or
// where the trainer said its senders are on this host the plan default
// (256 MiB, above the 64 MiB of --max_chunk_bytes: the daemon's own
// receives), lowered until its staging (the buffers, or two chunks per
// linked sender) fits the device budget: 256 senders at 256 MiB would want
// 128 GiB of staging.
TEST_F(CoordinatorDeviceTest, TransferPlanChunksFitTheStagingBudget) {
  struct Case {
    int64_t budget;
    bool senders_local;
    int64_t want;
  };
  for (const Case& c : std::vector<Case>{
           {int64_t{4} << 30, false, int64_t{64} << 20},
           {int64_t{4} << 30, true, int64_t{256} << 20},
           {int64_t{1} << 30, true, int64_t{256} << 20},
           {(int64_t{1} << 30) - 256, true, (int64_t{256} << 20) - 256},
           {int64_t{512} << 20, true, int64_t{128} << 20},
           {int64_t{128} << 20, false, int64_t{32} << 20},
           {6000, false, 1280},
           {6000, true, 1280}}) {
    const int64_t budget = c.budget, want = c.want;
    CoordinatorOptions o;
    o.device_staging_buffers = 2;  // two senders: 4 buffers, not 2
    o.device_staging_budget_bytes = budget;
    Make(o);
    InitGroup(coordinator_.get(), 2, c.senders_local);
    absl::StatusOr<std::string> id = RegisterTwoSenders(coordinator_.get());
    ASSERT_TRUE(id.ok()) << id.status();
    v1::StartWeightUpdateRequest req = PlanUpdate(*id);
    auto started = coordinator_->StartWeightUpdate(req);
    ASSERT_TRUE(started.ok()) << started.status();
    EXPECT_EQ(started->chunk_bytes(), want)
        << "budget " << budget << ", senders on this host " << c.senders_local;
    ASSERT_TRUE(Finish("u1").ok());
  }
}

TEST_F(CoordinatorDeviceTest, TransferPlanRefusedWhereTheDaemonIsASendersRank) {
  InitGroup(coordinator_.get(), 1);
  absl::StatusOr<std::string> id = RegisterTwoSenders(coordinator_.get());
  ASSERT_TRUE(id.ok()) << id.status();
  v1::StartWeightUpdateRequest req = PlanUpdate(*id);
  auto started = coordinator_->StartWeightUpdate(req);
  EXPECT_EQ(started.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(started.status().message(),
              HasSubstr("has 2 senders, NCCL ranks 0..1; this daemon's "
                        "rank_offset is 1: InitWeightTransfer with "
                        "rank_offset >= 2"));
  // Planned (the sources handed over, bound to that plan), nothing paused.
  EXPECT_THAT(log_.Get(), ElementsAre("SetChunkSources 2"));
  EXPECT_EQ(Engine().state(), v1::ENGINE_READY);
}

// RegisterTransferPlan's refusals (issue 33's sweep of transfer_plans.cc
// found each of these checks unpinned): no group, a daemon shutting down,
// no receivers named, a receiver the spec does not have (first or last of
// the list), one named twice. Nothing is registered.
TEST_F(CoordinatorDeviceTest, TransferPlanRegistrationRefusals) {
  Coordinator no_group(CoordinatorOptions(),
                       std::make_shared<testing::HeapMapper>(),
                       std::make_shared<Factory>(plane_));
  auto r = no_group.RegisterTransferPlan(TwoSendersRequest({0}));
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(r.status().message(), HasSubstr("no transfer group"));
  no_group.Shutdown();

  InitGroup(coordinator_.get(), 2);
  const std::vector<std::pair<std::vector<int32_t>, std::string>> bad = {
      {{}, "name the receivers"},
      {{1}, "receiver 1 is repeated or not one of the spec's 1"},
      {{-1}, "receiver -1 is repeated or not one of the spec's 1"},
      {{0, 7}, "receiver 7 is repeated"},
      {{0, 0}, "receiver 0 is repeated"},
  };
  for (const auto& [receivers, why] : bad) {
    r = coordinator_->RegisterTransferPlan(TwoSendersRequest(receivers));
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << why;
    EXPECT_THAT(r.status().message(), HasSubstr(why));
  }
  // Nothing was kept: a Start by the plan's id finds none.
  auto id = TransferPlanId(TwoSendersRequest({0}).spec());
  auto started = coordinator_->StartWeightUpdate(PlanUpdate(id));
  EXPECT_EQ(started.status().code(), absl::StatusCode::kNotFound);

  coordinator_->Shutdown();
  r = coordinator_->RegisterTransferPlan(TwoSendersRequest({0}));
  EXPECT_EQ(r.status().code(), absl::StatusCode::kUnavailable);
}

// What a registration answers is what this daemon will be sent: the bytes
// its receivers need and how many of the senders send them (both ranks
// here), for one receiver and for two (a daemon of two GPU ranks: the
// answer a trainer sizes its sends by).
TEST_F(CoordinatorDeviceTest, TransferPlanRegistrationCountsSendersAndBytes) {
  InitGroup(coordinator_.get(), 2);
  auto r = coordinator_->RegisterTransferPlan(TwoSendersRequest({0}));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->plan_id(), TransferPlanId(TwoSendersRequest({0}).spec()));
  EXPECT_EQ(r->senders(), 2);
  EXPECT_EQ(r->bytes(), 64);
  r = coordinator_->RegisterTransferPlan(TwoSendersRequest({1, 0}, 4, 2));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->senders(), 2);
  EXPECT_EQ(r->bytes(), 128);
}

// A daemon keeps the last 8 plans registered (docs/protocol.md), by id as
// a Start names them: a ninth drops the oldest, and a plan registered
// again, as another receiver, takes its one place (the entry it replaces
// could never be reached again, so it must not crowd out a live plan).
TEST_F(CoordinatorDeviceTest, TransferPlansKeptAreTheLastEightById) {
  InitGroup(coordinator_.get(), 2);
  auto reg = [&](std::vector<int32_t> receivers, int split,
                 int spec_receivers) -> std::string {
    auto r = coordinator_->RegisterTransferPlan(
        TwoSendersRequest(std::move(receivers), split, spec_receivers));
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? r->plan_id() : "";
  };
  auto kept = [&](const std::string& id) {
    return PlanOnly(coordinator_.get(), id, 256).status();
  };
  std::vector<std::string> ids;
  for (int split = 1; split <= 9; ++split) ids.push_back(reg({0}, split, 1));
  absl::Status gone = kept(ids[0]);
  EXPECT_EQ(gone.code(), absl::StatusCode::kNotFound) << gone;
  EXPECT_THAT(gone.message(), HasSubstr("register it again"));
  for (int i = 1; i < 9; ++i) EXPECT_TRUE(kept(ids[i]).ok()) << i;

  InitGroup(coordinator_.get(), 2);  // a new group: no plan kept
  EXPECT_EQ(kept(ids[8]).code(), absl::StatusCode::kNotFound);
  const std::string first = reg({0}, 10, 1);
  const std::string both = reg({0}, 8, 2);
  for (int split = 1; split <= 6; ++split) reg({0}, split, 1);
  EXPECT_EQ(reg({1}, 8, 2), both);  // the same plan, as its receiver 1
  EXPECT_TRUE(kept(first).ok()) << "8 plans, not 9: " << kept(first);
  EXPECT_TRUE(kept(both).ok());
  EXPECT_THAT(log_.Get(), Not(Contains("pause")));
}

// A plan update reuses the copy plan of the one before while nothing it
// was built from changed, and plans anew for another chunk size, another
// plan, or the engine registered again elsewhere in its memory: a stale
// plan would take chunks from the wrong senders or write where the
// parameter no longer is.
TEST_F(CoordinatorDeviceTest, ALinkedPlanIsReusedOnlyWhileNothingChanged) {
  // "w" of [16, 64]: a sender's 8 rows are 2 KiB, two 1 KiB chunks.
  ASSERT_TRUE(coordinator_->UnregisterEngine("e").ok());
  RegisterE(0, 64);
  ASSERT_TRUE(coordinator_->AttachControl("e", engine_).ok());
  InitGroup(coordinator_.get(), 2);
  auto halves =
      coordinator_->RegisterTransferPlan(TwoSendersRequest({0}, 8, 1, 64));
  auto quarter =
      coordinator_->RegisterTransferPlan(TwoSendersRequest({0}, 4, 1, 64));
  ASSERT_TRUE(halves.ok() && quarter.ok());
  auto plan = [&](const std::string& id, int64_t chunk_bytes) {
    auto started = PlanOnly(coordinator_.get(), id, chunk_bytes);
    EXPECT_TRUE(started.ok()) << started.status();
    EXPECT_NE(plane_->sources_plan, nullptr);
    return started.ok() && plane_->sources_plan != nullptr;
  };
  ASSERT_TRUE(plan(halves->plan_id(), 1024));
  std::shared_ptr<const CopyPlan> planned = plane_->sources_plan;
  EXPECT_THAT(plane_->chunk_sources.sender, ElementsAre(0, 0, 1, 1));
  ASSERT_TRUE(plan(halves->plan_id(), 1024));
  EXPECT_EQ(plane_->sources_plan, planned) << "planned again";
  // Another chunk size: one 2 KiB chunk per sender.
  ASSERT_TRUE(plan(halves->plan_id(), 2048));
  EXPECT_EQ(plane_->sources_plan->chunks.chunk_bytes, 2048);
  EXPECT_THAT(plane_->chunk_sources.sender, ElementsAre(0, 1));
  // The same chunk size, another plan: sender 0 holds 4 rows, 1 twelve.
  ASSERT_TRUE(plan(quarter->plan_id(), 2048));
  EXPECT_THAT(plane_->chunk_sources.sender, ElementsAre(0, 1, 1));
  EXPECT_EQ(FirstWrite(*plane_->sources_plan), 0);
  // "e" registered again with "w" 8 KiB into its memory.
  ASSERT_TRUE(coordinator_->UnregisterEngine("e").ok());
  RegisterE(8192, 64);
  ASSERT_TRUE(coordinator_->AttachControl("e", engine_).ok());
  ASSERT_TRUE(plan(quarter->plan_id(), 2048));
  EXPECT_EQ(FirstWrite(*plane_->sources_plan), 8192);
}

// An engine that goes away while an update is planned (its stream closed
// mid-Start) is not kept by the plan cache: its memory is let go when the
// Start is over, not held until some later plan replaces the cached one.
TEST_F(CoordinatorDeviceTest, AnEngineGoneWhilePlanningLeavesNoMemoryHeld) {
  InitGroup(coordinator_.get(), 2);
  absl::StatusOr<std::string> id = RegisterTwoSenders(coordinator_.get());
  ASSERT_TRUE(id.ok()) << id.status();
  plane_->on_warm = [this] {
    EXPECT_TRUE(coordinator_->UnregisterEngine("e").ok());
  };
  auto planned = PlanOnly(coordinator_.get(), *id, 256);
  plane_->on_warm = nullptr;
  plane_->sources_plan.reset();  // the fake's own reference
  ASSERT_EQ(mapper_->opened.size(), 1u);
  EXPECT_EQ(mapper_->opened[0].use_count(), 1)
      << "the gone engine's memory is still mapped (" << planned.status()
      << ")";
}

TEST_F(CoordinatorDeviceTest, TransferPlanOnIpcRefusedBeforeAnythingPauses) {
  plane_->plane_name = "ipc";
  absl::StatusOr<std::string> id = RegisterTwoSenders(coordinator_.get());
  ASSERT_TRUE(id.ok()) << id.status();
  v1::StartWeightUpdateRequest req = PlanUpdate(*id);
  auto started = coordinator_->StartWeightUpdate(req);
  EXPECT_EQ(started.status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(started.status().message(), HasSubstr("the nccl backend"));
  EXPECT_THAT(log_.Get(), IsEmpty());
  EXPECT_EQ(Engine().state(), v1::ENGINE_READY);
}

// An FP8 target fed by a plan's links: the host backend gathers its rows
// of blocks (link_plan.h); a GPU data plane does not yet, so the Start is
// refused naming the target, planned but before anything pauses.
TEST_F(CoordinatorDeviceTest,
       TransferPlanIntoAnFp8TargetOnNcclRefusedUnpaused) {
  v1::RegisterEngineRequest r;
  r.set_engine_id("f");
  v1::Allocation* a = r.add_allocations();
  a->set_kind(v1::MEMORY_HOST_SHM);
  a->set_handle("/x");
  a->set_size(4096 * 16);
  v1::Parameter* w = r.add_parameters();
  w->set_name("w");
  w->set_dtype(v1::FLOAT8_E4M3FN);
  w->add_shape(16);
  w->add_shape(16);
  v1::Quantization* q = w->mutable_quantization();
  q->set_format(v1::FLOAT8_E4M3FN);
  q->set_scale_parameter("w_scale");
  q->set_scheme(v1::QUANT_SCHEME_BLOCK);
  q->set_block_rows(16);
  q->set_block_cols(16);
  v1::Parameter* scale = r.add_parameters();
  scale->set_name("w_scale");
  scale->set_dtype(v1::FLOAT32);
  scale->add_shape(1);
  scale->add_shape(1);
  scale->set_offset(1024);
  const auto registered = coordinator_->RegisterEngine(r);
  ASSERT_TRUE(registered.ok()) << registered.status();
  auto control = std::make_shared<AckingEngine>(coordinator_.get(), &log_);
  ASSERT_TRUE(coordinator_->AttachControl("f", control).ok());
  InitGroup(coordinator_.get(), 2);
  absl::StatusOr<v1::RegisterTransferPlanResponse> plan =
      coordinator_->RegisterTransferPlan(TwoSendersRequest({0}, 8, 1, 16));
  ASSERT_TRUE(plan.ok()) << plan.status();
  v1::StartWeightUpdateRequest req = PlanUpdate(plan->plan_id());
  req.add_engine_ids("f");
  auto started = coordinator_->StartWeightUpdate(req);
  EXPECT_EQ(started.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(started.status().message(),
              HasSubstr("engine 'f' parameter 'w' is an FP8 target: the nccl "
                        "backend does not quantise"));
  EXPECT_THAT(log_.Get(), IsEmpty());  // nothing paused
  // Its pieces sent quantised instead (plan_wire): refused as well, before
  // the plan is made, and nothing paused.
  v1::PlanWireTensor* wire = req.add_plan_wire();
  wire->set_tensor("w");
  wire->mutable_quantization()->set_format(v1::FLOAT8_E4M3FN);
  wire->mutable_quantization()->set_block_rows(16);
  wire->mutable_quantization()->set_block_cols(16);
  started = coordinator_->StartWeightUpdate(req);
  EXPECT_EQ(started.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(started.status().message(),
              HasSubstr("sends 1 tensors quantised through a transfer plan "
                        "(plan_wire): the nccl backend does not take them"));
  EXPECT_THAT(log_.Get(), IsEmpty());
  const v1::GetStatusResponse status = coordinator_->GetStatus();
  for (const v1::EngineStatus& e : status.engines()) {
    EXPECT_EQ(e.state(), v1::ENGINE_READY) << e.engine_id();
  }
}

TEST_F(CoordinatorDeviceTest, StagedOverTheDeviceBudget) {
  plane_->budget = 16;  // bytes: less than one chunk
  auto started = coordinator_->StartWeightUpdate(
      Request(1, v1::UPDATE_MODE_STAGED, v1::VERIFY_OFF));
  EXPECT_EQ(started.status().code(), absl::StatusCode::kResourceExhausted)
      << started.status();
  EXPECT_THAT(log_.Get(), IsEmpty());
  v1::StartWeightUpdateRequest req =
      Request(1, v1::UPDATE_MODE_STAGED, v1::VERIFY_OFF);
  req.set_allow_streaming_fallback(true);
  started = coordinator_->StartWeightUpdate(req);
  ASSERT_TRUE(started.ok()) << started.status();
  EXPECT_EQ(started->mode(), v1::UPDATE_MODE_STREAMING);
  EXPECT_THAT(log_.Get(), ElementsAre("pause", "Begin"));
  ASSERT_TRUE(Finish("u1").ok());
}

// The device staging budget is inclusive: an update that needs exactly
// the budget (one 256-byte chunk) stages; one byte less refuses it, as does
// a budget of none (0, not a backend without staging: that is -1).
TEST_F(CoordinatorDeviceTest, StagedAtTheDeviceBudgetsEdge) {
  v1::StartWeightUpdateRequest req =
      Request(1, v1::UPDATE_MODE_STAGED, v1::VERIFY_OFF);
  req.set_chunk_bytes(256);
  for (int64_t budget : {int64_t{0}, int64_t{255}}) {
    plane_->budget = budget;
    const absl::Status s = coordinator_->StartWeightUpdate(req).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << budget << s;
    EXPECT_THAT(s.message(),
                HasSubstr(absl::StrCat("needs 256 bytes of GPU staging; the "
                                       "budget is ",
                                       budget)));
  }
  EXPECT_THAT(log_.Get(), IsEmpty());
  plane_->budget = 256;
  auto started = coordinator_->StartWeightUpdate(req);
  ASSERT_TRUE(started.ok()) << started.status();
  EXPECT_EQ(started->mode(), v1::UPDATE_MODE_STAGED);
  ASSERT_TRUE(Finish("u1").ok());
  EXPECT_EQ(Engine().version(), 1);
}

TEST_F(CoordinatorDeviceTest, StagedOverAnIpcRingStagesEachAnnouncedChunk) {
  plane_->plane_name = "ipc";
  v1::StartWeightUpdateRequest req =
      Request(1, v1::UPDATE_MODE_STAGED, v1::VERIFY_OFF);
  req.set_ipc_ring_slots(2);
  req.set_chunk_bytes(256);  // one chunk: the 64 bytes of "w"
  auto started = coordinator_->StartWeightUpdate(req);
  ASSERT_TRUE(started.ok()) << started.status();
  EXPECT_EQ(started->mode(), v1::UPDATE_MODE_STAGED);
  const absl::Time deadline = absl::Now() + absl::Seconds(5);
  ASSERT_TRUE(coordinator_->PushChunk("u1", 0, "", deadline).ok());
  // The engine serves on while the chunks go into (device) staging.
  EXPECT_EQ(Engine().state(), v1::ENGINE_READY);
  ASSERT_TRUE(Finish("u1").ok());
  EXPECT_THAT(log_.Get(),
              ElementsAre("BeginStaged", "SubmitChunk 0", "WaitStaged", "pause",
                          "CommitStaged", "Drain", "new_version", "resume"));
  EXPECT_EQ(Engine().version(), 1);
}

// Issue 33's sweep of update_commit.cc: Prepare's own checks.

// An update (staged unless `mode` says otherwise, to `version`) over an
// IPC ring of `slots` (one 256-byte chunk, "w"), started.
void StartRingUpdate(Coordinator* c, FakeDevicePlane* plane,
                     const std::string& id = "u1",
                     v1::UpdateMode mode = v1::UPDATE_MODE_STAGED,
                     int64_t version = 1, int slots = 2) {
  plane->plane_name = "ipc";
  v1::StartWeightUpdateRequest req;
  req.set_update_id(id);
  req.set_target_version(version);
  req.set_mode(mode);
  req.set_verify(v1::VERIFY_OFF);
  req.set_ipc_ring_slots(slots);
  req.set_chunk_bytes(256);
  v1::TensorSpec* t = req.add_tensors();
  t->set_name("w");
  t->set_dtype(v1::FLOAT32);
  t->add_shape(16);
  auto started = c->StartWeightUpdate(req);
  ASSERT_TRUE(started.ok()) << started.status();
}

// A Prepare asked again (a trainer retrying after a lost reply) answers
// what was prepared: the staged bytes are committed, drained and read back
// once, and the Commit after it commits them.
TEST_F(CoordinatorDeviceTest, APreparedUpdateIsNotPreparedAgain) {
  ASSERT_TRUE(
      coordinator_
          ->StartWeightUpdate(Request(1, v1::UPDATE_MODE_STAGED, v1::VERIFY_ON))
          .ok());
  auto first = Prepare("u1");
  ASSERT_TRUE(first.ok()) << first.status();
  auto again = Prepare("u1");
  ASSERT_TRUE(again.ok()) << again.status();
  ASSERT_EQ(again->engines_size(), 1);
  EXPECT_EQ(again->engines(0).receipt().checksum(), 42u);
  EXPECT_EQ(Engine().version(), 0);  // prepared, not committed
  v1::CommitWeightUpdateRequest commit;
  commit.set_update_id("u1");
  auto done = coordinator_->CommitWeightUpdate(commit);
  ASSERT_TRUE(done.ok()) << done.status();
  EXPECT_THAT(log_.Get(),
              ElementsAre("BeginStaged", "WaitStaged", "pause", "CommitStaged",
                          "Drain", "DeviceReceipts", "new_version", "resume"));
  EXPECT_EQ(Engine().version(), 1);
}

// A Finish whose deadline passes while a chunk is still being written
// (its PushChunk inside the data plane) fails: nothing is committed while
// bytes may still be landing.
TEST_F(CoordinatorDeviceTest, FinishWhileAChunkIsStillBeingWrittenFails) {
  StartRingUpdate(coordinator_.get(), plane_.get());
  plane_->submit_takes = absl::Seconds(1);
  std::thread push([&] {
    coordinator_->PushChunk("u1", 0, "", absl::Now() + absl::Seconds(10))
        .IgnoreError();
  });
  auto submitting = [&] {
    std::vector<std::string> e = log_.Get();
    return std::find(e.begin(), e.end(), "SubmitChunk 0") != e.end();
  };
  for (int i = 0; i < 500 && !submitting(); ++i) {
    absl::SleepFor(absl::Milliseconds(2));
  }
  v1::FinishWeightUpdateRequest f;
  f.set_update_id("u1");
  f.set_timeout_ms(100);
  auto done = coordinator_->FinishWeightUpdate(f);
  push.join();
  ASSERT_FALSE(done.ok());
  EXPECT_THAT(done.status().message(), HasSubstr("still being received"));
  EXPECT_THAT(log_.Get(), Not(Contains("new_version")));
  EXPECT_EQ(Engine().version(), 0);
}

// An update that fails while its bytes drain (here a chunk out of step
// with the plan arrives; a trainer whose Liveness stream ends does the
// same) is not committed: the Finish reports why.
TEST_F(CoordinatorDeviceTest, AnUpdateThatFailsWhileDrainingIsNotCommitted) {
  StartRingUpdate(coordinator_.get(), plane_.get());
  const absl::Time deadline = absl::Now() + absl::Seconds(5);
  ASSERT_TRUE(coordinator_->PushChunk("u1", 0, "", deadline).ok());
  plane_->on_drain = [&] {
    EXPECT_FALSE(coordinator_->PushChunk("u1", 7, "", deadline).ok());
  };
  v1::FinishWeightUpdateRequest f;
  f.set_update_id("u1");
  f.set_timeout_ms(5000);
  auto done = coordinator_->FinishWeightUpdate(f);
  plane_->on_drain = nullptr;
  ASSERT_FALSE(done.ok());
  EXPECT_THAT(done.status().message(), HasSubstr("chunk 7 arrived"));
  EXPECT_THAT(log_.Get(), Not(Contains("new_version")));
  EXPECT_EQ(Engine().version(), 0);
}

// A drain that fails fails the update with its own reason; where the
// update failed as well while it drained (a bad chunk here; its trainer
// gone, in production, whose departure is what stops the bytes), the
// update's reason is the one told: it came first.
TEST_F(CoordinatorDeviceTest,
       AFailedDrainTellsTheUpdatesReasonWhereItFailedFirst) {
  const absl::Time deadline = absl::Now() + absl::Seconds(5);
  v1::FinishWeightUpdateRequest f;
  f.set_timeout_ms(5000);
  plane_->drain_status = absl::InternalError("the copy engine stopped");
  for (bool update_fails : {false, true}) {
    const std::string id = update_fails ? "u2" : "u1";
    StartRingUpdate(coordinator_.get(), plane_.get(), id);
    ASSERT_TRUE(coordinator_->PushChunk(id, 0, "", deadline).ok());
    plane_->on_drain = [&] {
      if (update_fails) {
        EXPECT_FALSE(coordinator_->PushChunk(id, 7, "", deadline).ok());
      }
    };
    f.set_update_id(id);
    auto done = coordinator_->FinishWeightUpdate(f);
    plane_->on_drain = nullptr;
    ASSERT_FALSE(done.ok()) << id;
    EXPECT_EQ(done.status().code(), absl::StatusCode::kAborted) << id;
    EXPECT_THAT(
        done.status().message(),
        HasSubstr(update_fails ? "chunk 7 arrived" : "the copy engine stopped"))
        << done.status();
    EXPECT_EQ(Engine().version(), 0) << id;
  }
  EXPECT_THAT(log_.Get(), Not(Contains("new_version")));
}

// A Commit of an update not in progress says why: "already committed" (and
// at which version) only for the update that was committed, not for an id
// never seen nor for one that failed (its engines are DIRTY).
TEST_F(CoordinatorDeviceTest, ACommitOfNoUpdateInProgressSaysWhy) {
  auto commit = [&](const std::string& id) {
    v1::CommitWeightUpdateRequest c;
    c.set_update_id(id);
    absl::Status s = coordinator_->CommitWeightUpdate(c).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << id;
    return std::string(s.message());
  };
  ASSERT_TRUE(Start(1, v1::UPDATE_MODE_STREAMING).ok());
  ASSERT_TRUE(Finish("u1").ok());
  EXPECT_THAT(commit("u1"), HasSubstr("already committed (version 1)"));
  EXPECT_THAT(commit("u7"), HasSubstr("never prepared here"));
  ASSERT_TRUE(Start(2, v1::UPDATE_MODE_STREAMING).ok());
  v1::AbortWeightUpdateRequest abort;
  abort.set_update_id("u2");
  ASSERT_TRUE(coordinator_->AbortWeightUpdate(abort).ok());
  EXPECT_THAT(commit("u2"), HasSubstr("never prepared here"));
  EXPECT_EQ(Engine().version(), 1);
}

// An update without receipts (verify off) prepares and answers none.
TEST_F(CoordinatorDeviceTest, APrepareWithoutReceiptsAnswersNone) {
  ASSERT_TRUE(Start(1, v1::UPDATE_MODE_STREAMING).ok());
  auto prepared = Prepare("u1");
  ASSERT_TRUE(prepared.ok()) << prepared.status();
  ASSERT_EQ(prepared->engines_size(), 1);
  EXPECT_FALSE(prepared->engines(0).has_receipt());
  EXPECT_FALSE(prepared->engines(0).lost());
  EXPECT_EQ(prepared->engines(0).version(), 0);
  v1::CommitWeightUpdateRequest commit;
  commit.set_update_id("u1");
  ASSERT_TRUE(coordinator_->CommitWeightUpdate(commit).ok());
  EXPECT_EQ(Engine().version(), 1);
}

// The engine unregistered between the Start and the Prepare: the Prepare
// reports it lost (no version, layout or receipt of a gone engine), and the
// Commit of an update whose every engine left fails: nothing was updated.
TEST_F(CoordinatorDeviceTest, AnUpdateWhoseEnginesAllLeftCommitsNothing) {
  ASSERT_TRUE(coordinator_
                  ->StartWeightUpdate(
                      Request(1, v1::UPDATE_MODE_STREAMING, v1::VERIFY_ON))
                  .ok());
  ASSERT_TRUE(coordinator_->UnregisterEngine("e").ok());
  auto prepared = Prepare("u1");
  ASSERT_TRUE(prepared.ok()) << prepared.status();
  ASSERT_EQ(prepared->engines_size(), 1);
  EXPECT_TRUE(prepared->engines(0).lost());
  EXPECT_EQ(prepared->engines(0).version(), 0);
  EXPECT_THAT(prepared->engines(0).layout_id(), IsEmpty());
  EXPECT_FALSE(prepared->engines(0).has_receipt());
  v1::CommitWeightUpdateRequest commit;
  commit.set_update_id("u1");
  auto done = coordinator_->CommitWeightUpdate(commit);
  EXPECT_EQ(done.status().code(), absl::StatusCode::kAborted);
  EXPECT_THAT(done.status().message(),
              HasSubstr("every engine disconnected during the update"));
  EXPECT_THAT(log_.Get(), Not(Contains("new_version")));
}

TEST_F(CoordinatorDeviceTest, StagedWhereTheDataPlaneCantStage) {
  plane_->budget = -1;  // a backend without device staging
  auto started = coordinator_->StartWeightUpdate(
      Request(1, v1::UPDATE_MODE_STAGED, v1::VERIFY_OFF));
  EXPECT_EQ(started.status().code(), absl::StatusCode::kUnimplemented)
      << started.status();
  EXPECT_THAT(log_.Get(), IsEmpty());
}

TEST_F(CoordinatorDeviceTest, ReceiptsAreOnByDefaultOnGpuBackends) {
  ASSERT_TRUE(coordinator_
                  ->StartWeightUpdate(
                      Request(1, v1::UPDATE_MODE_STREAMING, v1::VERIFY_DEFAULT))
                  .ok());
  auto done = Finish("u1");
  ASSERT_TRUE(done.ok()) << done.status();
  EXPECT_EQ(done->engines(0).receipt().checksum(), 42u);
  EXPECT_THAT(log_.Get(),
              ElementsAre("pause", "Begin", "Drain", "DeviceReceipts",
                          "new_version", "resume"));
}

// A Start that asks for no chunk size gets the nccl backend's default
// (64 MiB: 8 MiB messages ran at a third of the speed over NVLink), and
// one that asks gets what it asked for.
TEST_F(CoordinatorDeviceTest, NcclUpdatesDefaultToTheirOwnChunkSize) {
  auto started = coordinator_->StartWeightUpdate(
      Request(1, v1::UPDATE_MODE_STREAMING, v1::VERIFY_OFF));
  ASSERT_TRUE(started.ok()) << started.status();
  EXPECT_EQ(started->chunk_bytes(),
            CoordinatorOptions().default_nccl_chunk_bytes);
  EXPECT_NE(started->chunk_bytes(), CoordinatorOptions().default_chunk_bytes);
  ASSERT_TRUE(Finish("u1").ok());
  v1::StartWeightUpdateRequest asked =
      Request(2, v1::UPDATE_MODE_STREAMING, v1::VERIFY_OFF);
  asked.set_chunk_bytes(4096);
  started = coordinator_->StartWeightUpdate(asked);
  ASSERT_TRUE(started.ok()) << started.status();
  EXPECT_EQ(started->chunk_bytes(), 4096);
  ASSERT_TRUE(Finish("u2").ok());
}

TEST_F(CoordinatorDeviceTest, ReceiptsCanBeTurnedOff) {
  ASSERT_TRUE(Start(1, v1::UPDATE_MODE_STREAMING).ok());
  auto done = Finish("u1");
  ASSERT_TRUE(done.ok()) << done.status();
  EXPECT_FALSE(done->engines(0).has_receipt());
  EXPECT_THAT(log_.Get(),
              ElementsAre("pause", "Begin", "Drain", "new_version", "resume"));
}

TEST_F(CoordinatorDeviceTest, ReceiptsThatCantBeComputedFailTheUpdate) {
  ASSERT_TRUE(coordinator_
                  ->StartWeightUpdate(
                      Request(1, v1::UPDATE_MODE_STREAMING, v1::VERIFY_ON))
                  .ok());
  plane_->receipts_status = absl::InternalError("kernel failed");
  auto done = Finish("u1");
  ASSERT_FALSE(done.ok());
  EXPECT_EQ(done.status().code(), absl::StatusCode::kAborted);
  EXPECT_THAT(done.status().message(), HasSubstr("receipts: kernel failed"));
  EXPECT_EQ(Engine().state(), v1::ENGINE_DIRTY);
  EXPECT_EQ(Engine().version(), 0);
}

// The core checks a Start itself (an in-process caller has no gRPC front
// to check it first), each limit at its edge: refused with its words
// before anything pauses or begins, and accepted at the limit.
TEST_F(CoordinatorDeviceTest, TheCoreRefusesABadStartItselfAtEachLimitsEdge) {
  CoordinatorOptions o;
  o.max_manifest_tensors = 2;
  o.limits.max_name_length = 8;
  o.max_chunk_bytes = 1 << 20;
  Make(o);
  auto add = [](v1::StartWeightUpdateRequest& r, const std::string& name,
                int rank) {
    v1::TensorSpec* t = r.add_tensors();
    t->set_name(name);
    t->set_dtype(v1::FLOAT32);
    for (int d = 0; d < rank; ++d) t->add_shape(1);
  };
  using Edit = std::function<void(v1::StartWeightUpdateRequest&)>;
  const std::vector<std::pair<Edit, std::string>> refused = {
      {[](auto& r) { r.set_update_id(""); },
       "update_id must be 1-256 characters"},
      {[](auto& r) { r.set_update_id(std::string(257, 'u')); },
       "update_id must be 1-256 characters"},
      {[](auto& r) { r.set_target_version(0); },
       "target_version 0 is outside [1, 4611686018427387903]"},
      {[](auto& r) { r.set_target_version(kMaxVersion + 1); },
       "target_version 4611686018427387904 is outside"},
      {[&](auto& r) {
         add(r, "a", 1);
         add(r, "b", 1);
       },
       "manifest has 3 tensors; the limit is 2"},
      {[](auto& r) { r.mutable_tensors(0)->set_name("wwwwwwwww"); },
       "tensor 0 ('wwwwwwwww'): a name of 9 bytes and 1 dimensions; the "
       "limits are 8 and 16"},
      {[&](auto& r) { add(r, "x", 17); },
       "tensor 1 ('x'): a name of 1 bytes and 17 dimensions"},
      {[](auto& r) { r.set_chunk_bytes((1 << 20) + 1); },
       "chunk_bytes 1048577 is above the daemon's limit of 1048576"},
      {[](auto& r) { r.clear_tensors(); }, "' sends no tensors"},
  };
  for (const auto& [edit, words] : refused) {
    v1::StartWeightUpdateRequest r =
        Request(1, v1::UPDATE_MODE_STREAMING, v1::VERIFY_OFF);
    r.set_chunk_bytes(4096);  // NCCL's default is past this daemon's limit
    edit(r);
    absl::Status s = coordinator_->StartWeightUpdate(r).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << words;
    EXPECT_THAT(s.message(), HasSubstr(words));
  }
  EXPECT_THAT(log_.Get(), Not(Contains("Begin")));
  EXPECT_EQ(Engine().state(), v1::ENGINE_READY);
  // At the limits: a second tensor of an 8-byte name and 16 dimensions
  // passes these checks (then is refused as unused, in other words).
  v1::StartWeightUpdateRequest at_limits =
      Request(1, v1::UPDATE_MODE_STREAMING, v1::VERIFY_OFF);
  at_limits.set_chunk_bytes(4096);
  add(at_limits, "x2345678", CoordinatorOptions::kMaxTensorRank);
  absl::Status unused = coordinator_->StartWeightUpdate(at_limits).status();
  EXPECT_FALSE(unused.ok());
  EXPECT_THAT(unused.message(), Not(HasSubstr("the limits are")));
  EXPECT_THAT(unused.message(), Not(HasSubstr("the limit is")));
  // And an update at every edge at once goes through.
  v1::StartWeightUpdateRequest edge =
      Request(kMaxVersion, v1::UPDATE_MODE_STREAMING, v1::VERIFY_OFF);
  edge.set_update_id(std::string(256, 'u'));
  edge.set_chunk_bytes(1 << 20);
  ASSERT_TRUE(coordinator_->StartWeightUpdate(edge).ok());
  ASSERT_TRUE(Finish(std::string(256, 'u')).ok());
  EXPECT_EQ(Engine().version(), kMaxVersion);
}

// Pause and Resume in the core: a pause of several engines is all or
// nothing (one refuses: the others are resumed, and the error says so),
// an engine already paused gets no second notice and one not paused no
// resume, the time paused is counted, and Resume refuses an engine that
// is receiving an update or is dirty (unless allow_dirty).
TEST_F(CoordinatorDeviceTest, PauseIsAllOrNothingAndResumeRefusesWhatItMust) {
  auto f = AddEngine("f");
  auto state = [&](const std::string& id) {
    const v1::GetStatusResponse status = coordinator_->GetStatus(false);
    for (const v1::EngineStatus& e : status.engines()) {
      if (e.engine_id() == id) return e.state();
    }
    return v1::ENGINE_STATE_UNSPECIFIED;
  };
  auto count = [&](const std::string& event) {
    const std::vector<std::string> all = log_.Get();
    return std::count(all.begin(), all.end(), event);
  };
  f->refuse_pause = true;
  v1::PauseRequest pause;
  pause.set_timeout_ms(5000);
  absl::Status refused = coordinator_->Pause(pause).status();
  EXPECT_FALSE(refused.ok());
  EXPECT_THAT(refused.message(),
              HasSubstr("Pause: pause failed for engine(s) f: "));
  EXPECT_THAT(refused.message(), HasSubstr("the engine is mid-request"));
  EXPECT_THAT(refused.message(), HasSubstr("; no engine was left paused"));
  EXPECT_EQ(count("resume"), 1);  // e, which had acknowledged
  EXPECT_EQ(state("e"), v1::ENGINE_READY);
  EXPECT_EQ(state("f"), v1::ENGINE_READY);

  f->refuse_pause = false;
  auto paused = coordinator_->Pause(pause);
  ASSERT_TRUE(paused.ok()) << paused.status();
  EXPECT_EQ(paused->engines_size(), 2);
  EXPECT_EQ(state("e"), v1::ENGINE_PAUSED);
  EXPECT_EQ(state("f"), v1::ENGINE_PAUSED);
  const int64_t pauses = count("pause");
  absl::SleepFor(absl::Milliseconds(20));
  ASSERT_TRUE(coordinator_->Pause(pause).ok());  // already paused
  EXPECT_EQ(count("pause"), pauses);
  v1::ResumeRequest resume;
  resume.set_timeout_ms(5000);
  // f refuses to resume: the error is the caller's, f stays paused, and e,
  // which resumed, is not.
  f->refuse_resume = true;
  absl::Status stuck = coordinator_->Resume(resume).status();
  EXPECT_FALSE(stuck.ok());
  EXPECT_THAT(stuck.message(), HasSubstr("the engine is mid-request"));
  EXPECT_EQ(state("f"), v1::ENGINE_PAUSED);
  EXPECT_EQ(state("e"), v1::ENGINE_READY);
  f->refuse_resume = false;
  ASSERT_TRUE(coordinator_->Pause(pause).ok());
  resume.add_engine_ids("e");
  ASSERT_TRUE(coordinator_->Resume(resume).ok());
  EXPECT_EQ(state("e"), v1::ENGINE_READY);
  EXPECT_EQ(state("f"), v1::ENGINE_PAUSED);
  EXPECT_GE(Engine().paused_seconds(), 0.02);
  const double after = Engine().paused_seconds();
  const int64_t resumes = count("resume");
  ASSERT_TRUE(coordinator_->Resume(resume).ok());  // not paused: no notice
  EXPECT_EQ(count("resume"), resumes);
  EXPECT_EQ(Engine().paused_seconds(), after);  // no longer counting

  // Receiving an update: Resume is refused, naming it.
  ASSERT_TRUE(coordinator_
                  ->StartWeightUpdate(
                      Request(1, v1::UPDATE_MODE_STREAMING, v1::VERIFY_ON))
                  .ok());
  absl::Status updating = coordinator_->Resume(resume).status();
  EXPECT_EQ(updating.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(updating.message(),
              HasSubstr("engine 'e' is receiving update 'u1'; finish or abort "
                        "it before Resume"));
  // Failed after its bytes landed: dirty, and resumed only with
  // allow_dirty.
  plane_->receipts_status = absl::InternalError("kernel failed");
  ASSERT_FALSE(Finish("u1").ok());
  ASSERT_EQ(Engine().state(), v1::ENGINE_DIRTY);
  absl::Status dirty = coordinator_->Resume(resume).status();
  EXPECT_EQ(dirty.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(dirty.message(),
              HasSubstr("engine 'e' is dirty (an update failed half way)"));
  resume.set_allow_dirty(true);
  EXPECT_TRUE(coordinator_->Resume(resume).ok());

  // An engine whose stream closes while it is being paused has left: the
  // pause succeeds without it, and does not list it, even before the
  // engine's removal (which follows its stream's close) has happened.
  RegisterE(0, 1, "h");
  auto h = std::make_shared<AckingEngine>(coordinator_.get(), &log_, "h");
  h->leave_on_pause = true;
  ASSERT_TRUE(coordinator_->AttachControl("h", h).ok());
  v1::PauseRequest others = pause;
  others.add_engine_ids("f");
  others.add_engine_ids("h");
  auto without_h = coordinator_->Pause(others);
  ASSERT_TRUE(without_h.ok()) << without_h.status();
  ASSERT_EQ(without_h->engines_size(), 1);
  EXPECT_EQ(without_h->engines(0).engine_id(), "f");
  v1::ResumeRequest resume_f;
  resume_f.set_timeout_ms(5000);
  resume_f.add_engine_ids("f");
  resume_f.set_allow_dirty(true);  // f took part in the failed u1
  EXPECT_TRUE(coordinator_->Resume(resume_f).ok());
}

// Engines registered without a control stream (issue 30) in the core: a
// pause of all leaves them out, one that names one is refused at once
// saying why (and when it expires, if it does), and with no engine
// reachable at all the refusal counts the others.
TEST_F(CoordinatorDeviceTest, EnginesWithoutAStreamAreLeftOutOrRefusedByName) {
  RegisterE(0, 1, "g");  // never attaches a stream
  v1::PauseRequest all;
  all.set_timeout_ms(5000);
  auto paused = coordinator_->Pause(all);
  ASSERT_TRUE(paused.ok()) << paused.status();
  ASSERT_EQ(paused->engines_size(), 1);
  EXPECT_EQ(paused->engines(0).engine_id(), "e");
  v1::PauseRequest named = all;
  named.add_engine_ids("g");
  absl::Status g = coordinator_->Pause(named).status();
  EXPECT_EQ(g.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(g.message(), HasSubstr("engine 'g' is registered but has no "
                                     "open control stream"));
  EXPECT_THAT(g.message(), HasSubstr("; it is unregistered 5s after "
                                     "registering without one "
                                     "(--engine_start_grace_ms)"));
  // No expiry (a grace of 0): the refusal does not promise one.
  CoordinatorOptions never;
  never.engine_start_grace = absl::ZeroDuration();
  Make(never);
  RegisterE(0, 1, "g");
  g = coordinator_->Pause(named).status();
  EXPECT_EQ(g.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(g.message(), Not(HasSubstr("it is unregistered")));
  // ... and none comes: g outlives the watchdog's ticks (200 ms apart).
  absl::SleepFor(absl::Milliseconds(500));
  EXPECT_EQ(States().count("g"), 1u);
  // Nothing reachable: one engine's reason and how many more.
  Coordinator alone(CoordinatorOptions(), mapper_,
                    std::make_shared<Factory>(plane_));
  for (const char* id : {"g", "h", "i"}) {
    RegisterE(0, 1, id, &alone);
    absl::Status none = alone.Pause(all).status();
    EXPECT_EQ(none.code(), absl::StatusCode::kFailedPrecondition) << id;
    EXPECT_THAT(none.message(), HasSubstr("engine 'g' is registered but has "
                                          "no open control stream"));
    if (std::string(id) == "g") {
      EXPECT_THAT(none.message(), Not(HasSubstr("no registered engine")));
    } else {
      EXPECT_THAT(none.message(),
                  HasSubstr(absl::StrCat(
                      "no registered engine has an open control stream; ")));
      EXPECT_THAT(none.message(),
                  HasSubstr(std::string(id) == "h" ? " (and 1 more)"
                                                   : " (and 2 more)"));
    }
  }
  alone.Shutdown();
}

// An update that ends failed resumes only the engines it paused itself,
// leaves an engine the trainer had paused paused, tells a dirty engine
// why (and leaves it paused), and reports an engine gone meanwhile lost.
TEST_F(CoordinatorDeviceTest, AFailedUpdateResumesOnlyWhatItPaused) {
  auto results = [&](const v1::AbortWeightUpdateResponse& r) {
    std::map<std::string, v1::EngineResult> out;
    for (const v1::EngineResult& e : r.engines()) out[e.engine_id()] = e;
    return out;
  };
  auto last = [&]() { return log_.Get().back(); };
  auto f = AddEngine("f");
  // e paused by the trainer, f by the update, and no byte written yet (a
  // plane whose chunks come to it): the Abort resumes f alone.
  plane_->receives_own_bytes = false;
  PauseByTrainer({"e"});
  ASSERT_TRUE(Start(1, v1::UPDATE_MODE_STREAMING).ok());
  v1::AbortWeightUpdateRequest abort;
  abort.set_update_id("u1");
  auto aborted = coordinator_->AbortWeightUpdate(abort);
  ASSERT_TRUE(aborted.ok()) << aborted.status();
  auto by_id = results(*aborted);
  EXPECT_EQ(by_id["e"].state(), v1::ENGINE_PAUSED);
  EXPECT_EQ(by_id["f"].state(), v1::ENGINE_READY);
  EXPECT_FALSE(by_id["e"].lost() || by_id["f"].lost());
  EXPECT_EQ(last(), "resume f");
  EXPECT_EQ(Engine().state(), v1::ENGINE_PAUSED);
  // Failed after its bytes landed (receipts that can't be computed): both
  // dirty, told so, and neither resumed.
  plane_->receives_own_bytes = true;
  ASSERT_TRUE(coordinator_
                  ->StartWeightUpdate(
                      Request(2, v1::UPDATE_MODE_STREAMING, v1::VERIFY_ON))
                  .ok());
  plane_->receipts_status = absl::InternalError("kernel failed");
  const size_t before = log_.Get().size();
  ASSERT_FALSE(Finish("u2").ok());
  std::vector<std::string> after = log_.Get();
  after.erase(after.begin(), after.begin() + before);
  EXPECT_THAT(after, Contains("dirty"));
  EXPECT_THAT(after, Contains("dirty f"));
  EXPECT_THAT(after, Not(Contains("resume")));
  EXPECT_THAT(after, Not(Contains("resume f")));
  // An engine gone while its update runs is reported lost by the Abort.
  plane_->receipts_status = absl::OkStatus();
  v1::StartWeightUpdateRequest third =
      Request(3, v1::UPDATE_MODE_STREAMING, v1::VERIFY_OFF);
  auto started = coordinator_->StartWeightUpdate(third);
  ASSERT_TRUE(started.ok()) << started.status();
  ASSERT_TRUE(coordinator_->UnregisterEngine("f").ok());
  abort.set_update_id("u3");
  aborted = coordinator_->AbortWeightUpdate(abort);
  ASSERT_TRUE(aborted.ok()) << aborted.status();
  by_id = results(*aborted);
  EXPECT_TRUE(by_id["f"].lost());
  EXPECT_FALSE(by_id["e"].lost());
}

// Finish names the update it ends: another id, or no update at all, is
// refused and leaves the update in progress as it was; a Finish before
// every chunk arrived (chunks that come to the plane) fails the update,
// counting what arrived.
TEST_F(CoordinatorDeviceTest, FinishEndsOnlyTheUpdateItNamesAndOnlyWhole) {
  absl::Status none = Finish("u1").status();
  EXPECT_EQ(none.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(none.message(), HasSubstr("no update 'u1' in progress"));
  plane_->receives_own_bytes = false;
  ASSERT_TRUE(Start(1, v1::UPDATE_MODE_STREAMING).ok());
  absl::Status other = Finish("u7").status();
  EXPECT_EQ(other.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(other.message(), HasSubstr("no update 'u7' in progress"));
  EXPECT_EQ(Engine().state(), v1::ENGINE_UPDATING);  // u1 goes on
  absl::Status early = Finish("u1").status();
  EXPECT_FALSE(early.ok());
  EXPECT_THAT(early.message(), HasSubstr("finish after 0 of 1 chunks (0 of "
                                         "64 bytes)"));
  EXPECT_EQ(Engine().version(), 0);
}

}  // namespace
}  // namespace weightsync

namespace weightsync {
namespace {

// A staged update's commit pauses its engines only for the copy: one that
// leaves while being paused for it (its stream closes) is lost to the
// update, as in a streaming one, and the others are paused again and
// committed under their pause; the one that left is neither written nor
// left marked as receiving.
TEST_F(CoordinatorDeviceTest, AStagedCommitGoesOnWithoutAnEngineThatLeft) {
  auto f = AddEngine("f");
  // g, paused by its trainer beforehand, is not paused again, and stays.
  auto g = AddEngine("g");
  v1::PauseRequest pause;
  pause.set_timeout_ms(5000);
  pause.add_engine_ids("g");
  ASSERT_TRUE(coordinator_->Pause(pause).ok());
  ASSERT_TRUE(Start(1, v1::UPDATE_MODE_STAGED).ok());
  f->leave_on_pause = true;
  const size_t before = log_.Get().size();
  auto done = Finish("u1");
  ASSERT_TRUE(done.ok()) << done.status();
  std::vector<std::string> events = log_.Get();
  events.erase(events.begin(), events.begin() + before);
  // e paused once, with f, and not resumed before the copy: the copy runs
  // under that pause (f's leaving is no failed pause).
  const auto commit = std::find(events.begin(), events.end(), "CommitStaged");
  ASSERT_NE(commit, events.end());
  EXPECT_EQ(std::count(events.begin(), commit, "pause"), 1);
  EXPECT_EQ(std::count(events.begin(), commit, "resume"), 0);
  EXPECT_THAT(std::vector<std::string>(events.begin(), commit),
              Not(Contains("pause g")));
  std::map<std::string, v1::EngineResult> by_id;
  for (const v1::EngineResult& r : done->engines()) by_id[r.engine_id()] = r;
  EXPECT_TRUE(by_id["f"].lost());
  EXPECT_FALSE(by_id["e"].lost());
  EXPECT_FALSE(by_id["g"].lost());
  // The data plane was told which engine not to write: f's index.
  const v1::GetStatusResponse status = coordinator_->GetStatus(false);
  std::map<std::string, v1::EngineStatus> engines;
  for (const v1::EngineStatus& e : status.engines()) engines[e.engine_id()] = e;
  EXPECT_THAT(plane_->marked_lost(), ElementsAre(1));
  EXPECT_EQ(engines["e"].version(), 1);
  EXPECT_EQ(engines["e"].state(), v1::ENGINE_READY);
  EXPECT_EQ(engines["g"].version(), 1);
  EXPECT_EQ(engines["g"].state(), v1::ENGINE_PAUSED);  // its trainer's pause
  if (engines.count("f") > 0) {
    EXPECT_EQ(engines["f"].version(), 0);
    EXPECT_NE(engines["f"].state(), v1::ENGINE_UPDATING);
  }
}

// An engine that refuses the commit's pause fails the update before any
// byte moves from staging: nothing copied, every engine serving its old
// version, even though a second pause would have been acknowledged.
TEST_F(CoordinatorDeviceTest, AStagedCommitAnEngineRefusesCopiesNothing) {
  auto f = AddEngine("f");
  ASSERT_TRUE(Start(1, v1::UPDATE_MODE_STAGED).ok());
  f->refuse_pauses = 1;
  auto done = Finish("u1");
  ASSERT_FALSE(done.ok());
  EXPECT_THAT(done.status().message(),
              HasSubstr("could not pause for the commit"));
  EXPECT_THAT(log_.Get(), Not(Contains("CommitStaged")));
  EXPECT_THAT(plane_->marked_lost(), IsEmpty());
  const v1::GetStatusResponse status = coordinator_->GetStatus(false);
  for (const v1::EngineStatus& e : status.engines()) {
    EXPECT_EQ(e.version(), 0) << e.engine_id();
    EXPECT_EQ(e.state(), v1::ENGINE_READY) << e.engine_id();
  }
}

}  // namespace
}  // namespace weightsync

namespace weightsync {
namespace {

// Trainer liveness on the coordinator itself (docs/protocol.md, "Trainer
// liveness"): which holds may be opened, and what a hold's end does.
TEST_F(CoordinatorDeviceTest, OnlyTheGroupFormedNowOrNoneCanBeHeld) {
  auto other = coordinator_->HoldGroup("g-old");
  EXPECT_EQ(other.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(other.status().message(),
              HasSubstr("group 'g-old' is not the transfer group formed now "
                        "('" +
                        group_ + "')"));
  std::vector<int64_t> holds;
  auto held = coordinator_->HoldGroup(group_);
  ASSERT_TRUE(held.ok()) << held.status();
  holds.push_back(*held);
  auto pauses = coordinator_->HoldGroup("");  // a trainer without a group
  ASSERT_TRUE(pauses.ok()) << pauses.status();
  holds.push_back(*pauses);
  EXPECT_NE(holds[0], holds[1]);
  // kMaxHolds at once, the next refused; one closed, one more may open.
  while (holds.size() < Coordinator::kMaxHolds) {
    auto h = coordinator_->HoldGroup(group_);
    ASSERT_TRUE(h.ok()) << holds.size() << ": " << h.status();
    holds.push_back(*h);
  }
  auto past = coordinator_->HoldGroup(group_);
  EXPECT_EQ(past.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(past.status().message(), HasSubstr("64 streams are open"));
  coordinator_->ReleaseGroup(holds.back(), "closed", /*trainer_gone=*/false);
  holds.pop_back();
  EXPECT_TRUE(coordinator_->HoldGroup(group_).ok());
  // A stopping daemon opens none.
  coordinator_->Shutdown();
  EXPECT_EQ(coordinator_->HoldGroup(group_).status().code(),
            absl::StatusCode::kUnavailable);
}

TEST_F(CoordinatorDeviceTest, NoGroupFormedYetIsSaid) {
  auto plane = std::make_shared<FakeDevicePlane>(&log_);
  Coordinator fresh(CoordinatorOptions(), mapper_,
                    std::make_shared<Factory>(plane));
  auto h = fresh.HoldGroup("g1");
  EXPECT_EQ(h.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(h.status().message(), HasSubstr("(none is formed)"));
  EXPECT_TRUE(fresh.HoldGroup("").ok());
  fresh.Shutdown();
}

// The trainer holding the group goes: its update fails and ends at once,
// and the engine it paused is resumed (no byte had landed). A hold that
// ends because the server stops, a hold unknown or of an earlier group,
// end nothing.
TEST_F(CoordinatorDeviceTest, ATrainerGoneEndsItsUpdateOnlyItsOwnHold) {
  plane_->receives_own_bytes = false;
  auto hold = coordinator_->HoldGroup(group_);
  ASSERT_TRUE(hold.ok());
  ASSERT_TRUE(Start(1, v1::UPDATE_MODE_STREAMING).ok());
  auto phase = [&] { return coordinator_->GetStatus(false).update().phase(); };
  ASSERT_EQ(phase(), "receiving");
  coordinator_->ReleaseGroup(*hold + 1000, "no such hold");
  coordinator_->ReleaseGroup(*hold, "server stopping", /*trainer_gone=*/false);
  EXPECT_EQ(phase(), "receiving");
  EXPECT_EQ(Engine().state(), v1::ENGINE_UPDATING);
  // The same trainer holds again (a new stream), and goes.
  hold = coordinator_->HoldGroup(group_);
  ASSERT_TRUE(hold.ok());
  coordinator_->ReleaseGroup(*hold, "stream reset");
  const v1::GetStatusResponse status = coordinator_->GetStatus(false);
  EXPECT_EQ(status.update().phase(), "failed");
  EXPECT_THAT(status.update().error(),
              HasSubstr("the trainer of update 'u1' is gone (its Liveness "
                        "stream ended: stream reset)"));
  EXPECT_THAT(log_.Get(), Contains("Abort"));
  EXPECT_EQ(log_.Get().back(), "resume");
  EXPECT_EQ(Engine().state(), v1::ENGINE_READY);
  EXPECT_EQ(Engine().version(), 0);
  // The update is over: a new one may start without taking it over.
  ASSERT_TRUE(Start(2, v1::UPDATE_MODE_STREAMING).ok());
  // A hold of the group before a re-Init is of an earlier group: its end
  // fails nothing of the new one.
  auto old_hold = HoldThenFormAnother("u2");
  ASSERT_TRUE(old_hold.ok());
  ASSERT_TRUE(Start(3, v1::UPDATE_MODE_STREAMING).ok());
  coordinator_->ReleaseGroup(*old_hold, "old trainer gone");
  EXPECT_EQ(phase(), "receiving");
  EXPECT_EQ(coordinator_->GetStatus(false).update().update_id(), "u3");
}

// A prepared update whose trainer goes is never committed: it ends, its
// engines paused and DIRTY, and the reason says so.
TEST_F(CoordinatorDeviceTest, ATrainerGoneAfterPrepareLeavesItDirty) {
  auto hold = coordinator_->HoldGroup(group_);
  ASSERT_TRUE(hold.ok());
  ASSERT_TRUE(Start(1, v1::UPDATE_MODE_STREAMING).ok());
  ASSERT_TRUE(Prepare("u1").ok());
  coordinator_->ReleaseGroup(*hold, "killed");
  const v1::GetStatusResponse status = coordinator_->GetStatus(false);
  EXPECT_EQ(status.update().phase(), "failed");
  EXPECT_THAT(status.update().error(),
              HasSubstr("prepared, never committed: its engines stay paused "
                        "and DIRTY"));
  EXPECT_EQ(Engine().state(), v1::ENGINE_DIRTY);
}

// A trainer that paused engines without a group holds its pauses: when it
// goes, and no other trainer holds anything, the engines it paused are
// resumed; a dirty engine and one paused while a hold is still open stay.
TEST_F(CoordinatorDeviceTest, ATrainerGoneResumesOnlyItsPausesWhenAlone) {
  auto f = AddEngine("f");
  auto pauses = coordinator_->HoldGroup("");
  auto other = coordinator_->HoldGroup("");
  ASSERT_TRUE(pauses.ok() && other.ok());
  v1::PauseRequest pause;
  pause.set_timeout_ms(5000);
  pause.add_engine_ids("e");
  ASSERT_TRUE(coordinator_->Pause(pause).ok());
  // Another trainer still holds its pauses: nothing is resumed.
  coordinator_->ReleaseGroup(*pauses, "first gone");
  EXPECT_EQ(Engine().state(), v1::ENGINE_PAUSED);
  // A clean end of the last hold (the server stopping) resumes nothing.
  coordinator_->ReleaseGroup(*other, "server stopping", false);
  EXPECT_EQ(Engine().state(), v1::ENGINE_PAUSED);
  // The last trainer goes: e resumes; f, never paused, is not told.
  auto last = coordinator_->HoldGroup("");
  ASSERT_TRUE(last.ok());
  const size_t before = log_.Get().size();
  coordinator_->ReleaseGroup(*last, "gone");
  EXPECT_EQ(Engine().state(), v1::ENGINE_READY);
  std::vector<std::string> after = log_.Get();
  after.erase(after.begin(), after.begin() + before);
  EXPECT_THAT(after, ElementsAre("resume"));
  // A group trainer that goes resumes the pauses of trainers too, but not
  // a dirty engine's (it waits for an update to clean it).
  auto hold = coordinator_->HoldGroup(group_);
  ASSERT_TRUE(hold.ok());
  ASSERT_TRUE(Start(1, v1::UPDATE_MODE_STREAMING).ok());
  v1::AbortWeightUpdateRequest abort;
  abort.set_update_id("u1");
  ASSERT_TRUE(coordinator_->AbortWeightUpdate(abort).ok());  // both dirty
  pause.clear_engine_ids();
  ASSERT_EQ(Engine().state(), v1::ENGINE_DIRTY);
  const size_t before_gone = log_.Get().size();
  coordinator_->ReleaseGroup(*hold, "gone");
  after = log_.Get();
  after.erase(after.begin(), after.begin() + before_gone);
  EXPECT_THAT(after, Not(Contains("resume")));
  EXPECT_EQ(Engine().state(), v1::ENGINE_DIRTY);
}

// Start's take_over_update_id ends an update whose trainer holds no
// Liveness stream of the group, never one whose trainer does; an id of no
// update in progress takes nothing over.
TEST_F(CoordinatorDeviceTest, TakeOverOnlyOfAnUpdateNobodyHolds) {
  plane_->receives_own_bytes = false;
  auto hold = coordinator_->HoldGroup(group_);
  auto pauses = coordinator_->HoldGroup("");  // holds no group
  ASSERT_TRUE(hold.ok() && pauses.ok());
  ASSERT_TRUE(Start(1, v1::UPDATE_MODE_STREAMING).ok());
  v1::StartWeightUpdateRequest next =
      Request(2, v1::UPDATE_MODE_STREAMING, v1::VERIFY_OFF);
  next.set_take_over_update_id("u1");
  auto refused = coordinator_->StartWeightUpdate(next);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(refused.status().message(),
              HasSubstr("update 'u1' belongs to a live trainer (it holds "
                        "group " +
                        group_));
  EXPECT_EQ(coordinator_->GetStatus(false).update().update_id(), "u1");
  // Another id takes nothing over: u1 goes on, and u2 can't start beside it.
  next.set_take_over_update_id("u0");
  EXPECT_EQ(coordinator_->StartWeightUpdate(next).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(coordinator_->GetStatus(false).update().phase(), "receiving");
  // Its trainer's stream ended as the server stopped (not gone): now nobody
  // holds the group, and u1 is taken over.
  coordinator_->ReleaseGroup(*hold, "server stopping", false);
  next.set_take_over_update_id("u1");
  auto taken = coordinator_->StartWeightUpdate(next);
  ASSERT_TRUE(taken.ok()) << taken.status();
  EXPECT_EQ(coordinator_->GetStatus(false).update().update_id(), "u2");
}

}  // namespace
}  // namespace weightsync

namespace weightsync {
namespace {

// A Start that names a transfer plan takes its tensors from the plan and
// nothing else; its sparse pieces name receivers of the plan, apply only
// against the engines' version, and only this daemon's are its own (the
// fake plane, as NCCL's today, then refuses patches of many senders).
TEST_F(CoordinatorDeviceTest, AStartNamingATransferPlanIsCheckedWhole) {
  InitGroup(coordinator_.get(), 2);
  auto registered =
      coordinator_->RegisterTransferPlan(TwoSendersRequest({0}, 8, 2));
  ASSERT_TRUE(registered.ok()) << registered.status();
  const std::string id = registered->plan_id();
  const std::string unset =
      "its tensors are the plan's; leave tensors, source_id, ipc_source and "
      "finish unset";
  std::vector<v1::StartWeightUpdateRequest> extra(4, PlanUpdate(id));
  *extra[0].add_tensors() =
      Request(1, v1::UPDATE_MODE_STREAMING, v1::VERIFY_OFF).tensors(0);
  extra[1].set_source_id("src-1");
  extra[2].mutable_ipc_source();
  extra[3].set_finish(true);
  for (const v1::StartWeightUpdateRequest& req : extra) {
    auto s = coordinator_->StartWeightUpdate(req).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_THAT(s.message(), HasSubstr("names transfer plan '" + id + "'"));
    EXPECT_THAT(s.message(), HasSubstr(unset));
  }
  auto sparse = [&](int32_t receiver, int64_t base) {
    v1::StartWeightUpdateRequest req = PlanUpdate(id);
    req.set_chunk_bytes(256);
    req.set_sparse_base_version(base);
    v1::PlanSparsePiece* p = req.add_plan_sparse();
    p->set_sender(0);
    p->set_receiver(receiver);
    p->set_piece(0);
    p->set_nnz(1);
    return coordinator_->StartWeightUpdate(req).status();
  };
  for (int32_t r : {-1, 2, 3}) {
    const absl::Status s = sparse(r, 0);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << r << ": " << s;
    EXPECT_THAT(s.message(),
                HasSubstr(absl::StrCat("a plan_sparse entry names receiver ", r,
                                       "; transfer plan '", id, "' has 2")));
  }
  // One piece is a sparse update: it applies only at its base version.
  absl::Status s = sparse(0, 5);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_THAT(s.message(),
              HasSubstr("holds sparse patches against version 5, but engine "
                        "'e' is at version 0"));
  // Receiver 0 is this daemon's: its patch is planned, and refused by a
  // plane that can't apply it; receiver 1's is another daemon's.
  s = sparse(0, 0);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_THAT(s.message(), HasSubstr("1 pieces as sparse patches"));
  EXPECT_TRUE(sparse(1, 0).ok());
  ASSERT_TRUE(Finish("u1").ok());
  // A plane that applies the patches of many senders (the host backend's)
  // plans this daemon's patch against the engines' version, now 1.
  plane_->takes_patches = true;
  v1::StartWeightUpdateRequest patched = PlanUpdate(id);
  patched.set_update_id("u2");
  patched.set_target_version(2);
  patched.set_chunk_bytes(256);
  patched.set_sparse_base_version(1);
  patched.set_plan_only(true);
  v1::PlanSparsePiece* p = patched.add_plan_sparse();
  p->set_receiver(0);
  p->set_nnz(1);
  auto planned = coordinator_->StartWeightUpdate(patched);
  EXPECT_TRUE(planned.ok()) << planned.status();
}

// plan_only opens no update: it can't finish one, and it takes no update
// over (the update in progress goes on).
TEST_F(CoordinatorDeviceTest, PlanOnlyNeitherFinishesNorTakesOver) {
  v1::StartWeightUpdateRequest both =
      Request(1, v1::UPDATE_MODE_STREAMING, v1::VERIFY_OFF);
  both.set_plan_only(true);
  both.set_finish(true);
  both.clear_tensors();
  both.set_source_id("src-1");
  auto s = coordinator_->StartWeightUpdate(both).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(s.message(), HasSubstr("plan_only opens no update, so it can't "
                                     "finish one"));
  ASSERT_TRUE(Start(1, v1::UPDATE_MODE_STREAMING).ok());
  v1::StartWeightUpdateRequest plan =
      Request(2, v1::UPDATE_MODE_STREAMING, v1::VERIFY_OFF);
  plan.set_plan_only(true);
  plan.set_take_over_update_id("u1");
  coordinator_->StartWeightUpdate(plan).IgnoreError();
  EXPECT_EQ(coordinator_->GetStatus(false).update().update_id(), "u1");
  EXPECT_EQ(coordinator_->GetStatus(false).update().phase(), "receiving");
}

// An engine its trainer paused is not paused again by an update.
TEST_F(CoordinatorDeviceTest, AnUpdateDoesNotPauseAPausedEngineAgain) {
  v1::PauseRequest pause;
  pause.set_timeout_ms(5000);
  ASSERT_TRUE(coordinator_->Pause(pause).ok());
  const size_t before = log_.Get().size();
  ASSERT_TRUE(Start(1, v1::UPDATE_MODE_STREAMING).ok());
  std::vector<std::string> after = log_.Get();
  after.erase(after.begin(), after.begin() + before);
  EXPECT_THAT(after, ElementsAre("Begin"));
  ASSERT_TRUE(Finish("u1").ok());
  EXPECT_EQ(Engine().state(), v1::ENGINE_PAUSED);  // still its trainer's
}

}  // namespace
}  // namespace weightsync

namespace weightsync {
namespace {

// Starts update `version` over an IPC ring (its chunks are announced), and
// fails it with a chunk the plan does not have: the update is left failed,
// its engines dirty (bytes may have landed), for somebody to end.
void FailOverARing(Coordinator* c, FakeDevicePlane* plane, int64_t version) {
  const std::string id = absl::StrCat("u", version);
  StartRingUpdate(c, plane, id, v1::UPDATE_MODE_STREAMING, version);
  const absl::Time deadline = absl::Now() + absl::Seconds(5);
  ASSERT_TRUE(c->PushChunk(id, 0, "", deadline).ok());
  ASSERT_FALSE(c->PushChunk(id, 7, "", deadline).ok());
  ASSERT_EQ(c->GetStatus(false).update().phase(), "failed");
  plane->plane_name = "nccl";
}

// The next Start ends an update its trainer left failed, or prepared and
// never committed, and the dirty engines hear which of the two it was:
// the failure's own reason, or that the prepared update was superseded.
TEST_F(CoordinatorDeviceTest, AStartEndsAnUpdateLeftBehindAndSaysWhatItWas) {
  FailOverARing(coordinator_.get(), plane_.get(), 1);
  ASSERT_TRUE(Start(2, v1::UPDATE_MODE_STREAMING).ok());
  ASSERT_EQ(engine_->dirty_reasons().size(), 1u);
  EXPECT_THAT(engine_->dirty_reasons()[0],
              HasSubstr("update 'u1' failed: update 'u1': chunk 7 arrived, "
                        "but the plan has 1 chunks; StartWeightUpdate ended it "
                        "(its trainer did not)"));
  ASSERT_TRUE(Prepare("u2").ok());
  ASSERT_TRUE(Start(3, v1::UPDATE_MODE_STREAMING).ok());
  ASSERT_EQ(engine_->dirty_reasons().size(), 2u);
  EXPECT_EQ(engine_->dirty_reasons()[1],
            "prepared update 'u2' was never committed; StartWeightUpdate "
            "superseded it");
  EXPECT_EQ(coordinator_->GetStatus(false).update().update_id(), "u3");
  EXPECT_EQ(Engine().version(), 0);
}

// Engines in each state a pause can be in when the trainer goes quiet:
// e paused by its trainer and then made DIRTY by an update that failed
// after its bytes landed; f paused by its trainer; g never paused; h paused
// by an update that committed it but whose resume it refused. Only f's
// pause is the trainer's and clean: it alone may be resumed for it.
class PauseStatesTest : public CoordinatorDeviceTest {
 protected:
  void SetUpStates() {
    f_ = AddEngine("f");
    g_ = AddEngine("g");
    h_ = AddEngine("h");
    PauseByTrainer({"e"});
    ASSERT_TRUE(StartOn(1, "e").ok());
    v1::AbortWeightUpdateRequest abort;
    abort.set_update_id("u1");
    ASSERT_TRUE(coordinator_->AbortWeightUpdate(abort).ok());
    h_->refuse_resume = true;
    ASSERT_TRUE(StartOn(2, "h").ok());
    ASSERT_TRUE(Finish("u2").ok());
    PauseByTrainer({"f"});
  }
  // The notices sent from log entry `from` on.
  std::vector<std::string> Since(size_t from) {
    std::vector<std::string> after = log_.Get();
    after.erase(after.begin(), after.begin() + from);
    return after;
  }
  void ExpectOnlyFResumed(size_t from) {
    EXPECT_THAT(Since(from), ElementsAre("resume f"));
    const auto states = States();
    EXPECT_EQ(states.at("e"), v1::ENGINE_DIRTY);
    EXPECT_EQ(states.at("f"), v1::ENGINE_READY);
    EXPECT_EQ(states.at("g"), v1::ENGINE_READY);
    EXPECT_EQ(states.at("h"), v1::ENGINE_PAUSED);
  }
  std::shared_ptr<AckingEngine> f_, g_, h_;
};

// A trainer that went quiet past --update_idle_timeout_ms has its pauses
// resumed by the watchdog, and only those.
TEST_F(PauseStatesTest, TheWatchdogResumesOnlyTheQuietTrainersCleanPauses) {
  Make(IdleOptions());
  SetUpStates();
  const size_t before = log_.Get().size();
  const absl::Time give_up = absl::Now() + absl::Seconds(10);
  while (States().at("f") != v1::ENGINE_READY && absl::Now() < give_up) {
    absl::SleepFor(absl::Milliseconds(20));
  }
  absl::SleepFor(absl::Milliseconds(300));  // anything else it would resume
  ExpectOnlyFResumed(before);
}

// A trainer gone (its pause hold ended, no other hold) has its pauses
// resumed at once, and only those.
TEST_F(PauseStatesTest, ATrainerGoneResumesOnlyItsCleanPauses) {
  auto hold = coordinator_->HoldGroup("");
  ASSERT_TRUE(hold.ok());
  SetUpStates();
  const size_t before = log_.Get().size();
  coordinator_->ReleaseGroup(*hold, "gone");
  ExpectOnlyFResumed(before);
}

// An update its trainer abandoned is ended by the watchdog, saying how it
// was left: prepared and never committed, or failed and never ended (after
// a short grace). An engine the same trainer paused outside the update
// does not keep the update from ending (it is resumed after).
TEST_F(CoordinatorDeviceTest, TheWatchdogEndsAnAbandonedUpdateSayingHow) {
  CoordinatorOptions options = IdleOptions();
  options.engine_start_grace = absl::ZeroDuration();  // the idle timeout alone
  Make(options);
  auto f = AddEngine("f");
  PauseByTrainer({"f"});
  auto ended = [&](const std::string& id) {
    const v1::UpdateStatus u = WaitUntilFailed();
    EXPECT_EQ(u.update_id(), id);
    return u;
  };
  ASSERT_TRUE(StartOn(1, "e").ok());
  ASSERT_TRUE(Prepare("u1").ok());
  v1::UpdateStatus u = ended("u1");
  EXPECT_THAT(u.error(), HasSubstr("update 'u1' abandoned: prepared but not "
                                   "committed, no call from its trainer for"));
  EXPECT_EQ(Engine().state(), v1::ENGINE_DIRTY);
  ASSERT_EQ(engine_->dirty_reasons().size(), 1u);
  EXPECT_EQ(engine_->dirty_reasons()[0], u.error());
  FailOverARing(coordinator_.get(), plane_.get(), 2);
  const absl::Time failed = absl::Now();
  absl::SleepFor(absl::Milliseconds(100));
  // Failed, not yet ended: its trainer may still call Finish or Abort.
  EXPECT_EQ(coordinator_->GetStatus(false).update().update_id(), "u2");
  while (engine_->dirty_reasons().size() < 2 &&
         absl::Now() < failed + absl::Seconds(10)) {
    absl::SleepFor(absl::Milliseconds(20));
  }
  ASSERT_EQ(engine_->dirty_reasons().size(), 2u);
  EXPECT_THAT(engine_->dirty_reasons()[1],
              HasSubstr("update 'u2' failed: update 'u2': chunk 7 arrived, "
                        "but the plan has 1 chunks; its trainer did not end "
                        "it, so the daemon did"));
  // A new update starts without anything to take over.
  ASSERT_TRUE(Start(3, v1::UPDATE_MODE_STREAMING).ok());
}

// take_over_update_id ends only the update it names, when no trainer
// holds the group formed now: a hold of an earlier group holds nothing,
// and an id of no update (none in progress, or another one) takes nothing
// over.
TEST_F(CoordinatorDeviceTest, TakeOverEndsOnlyTheUpdateItNamesUnheldNow) {
  auto take_over = [&](int64_t version, const std::string& id) {
    v1::StartWeightUpdateRequest r =
        Request(version, v1::UPDATE_MODE_STREAMING, v1::VERIFY_OFF);
    r.set_take_over_update_id(id);
    return coordinator_->StartWeightUpdate(r).status();
  };
  auto update = [&] { return coordinator_->GetStatus(false).update(); };
  ASSERT_TRUE(take_over(1, "u0").ok());  // nothing in progress to take
  EXPECT_EQ(update().update_id(), "u1");
  // Another id than the update's: u1 goes on, and u2 can't start beside it.
  absl::Status other = take_over(2, "u0");
  EXPECT_EQ(other.code(), absl::StatusCode::kFailedPrecondition) << other;
  EXPECT_THAT(other.message(), Not(HasSubstr("belongs to a live trainer")));
  EXPECT_EQ(update().update_id(), "u1");
  EXPECT_EQ(update().phase(), "receiving");
  // A hold of the group before a re-Init does not hold the one formed now.
  ASSERT_TRUE(HoldThenFormAnother("u1").ok());
  ASSERT_TRUE(Start(3, v1::UPDATE_MODE_STREAMING).ok());
  absl::Status taken = take_over(4, "u3");
  ASSERT_TRUE(taken.ok()) << taken;
  EXPECT_EQ(update().update_id(), "u4");
}

// A trainer holding only its pauses that goes while another's update runs
// (a trainer without a Liveness stream) resumes nothing then: the update's
// end decides its engines' pauses.
TEST_F(CoordinatorDeviceTest, ATrainerGoneMidUpdateResumesNothingYet) {
  auto f = AddEngine("f");
  auto pauses = coordinator_->HoldGroup("");
  ASSERT_TRUE(pauses.ok());
  PauseByTrainer({"f"});
  ASSERT_TRUE(StartOn(1, "e").ok());
  const size_t before = log_.Get().size();
  coordinator_->ReleaseGroup(*pauses, "gone");
  std::vector<std::string> after = log_.Get();
  after.erase(after.begin(), after.begin() + before);
  EXPECT_THAT(after, Not(Contains("resume f")));
  EXPECT_EQ(coordinator_->GetStatus(false).update().phase(), "receiving");
  EXPECT_EQ(States().at("f"), v1::ENGINE_PAUSED);
}

// An engine whose stream closes mid-update (so it is unregistered) and
// that registers again is lost to the update: its new registration is
// neither paused, written, versioned nor left marked as receiving by it,
// whether the update commits (streaming or staged) or is aborted.
TEST_F(CoordinatorDeviceTest, AnEngineRegisteredAgainMidUpdateIsNotItsAnymore) {
  auto f = AddEngine("f");
  int64_t version = 0;
  for (const char* how : {"streaming", "staged", "aborted"}) {
    SCOPED_TRACE(how);
    const std::string id = absl::StrCat("u", ++version);
    const bool staged = std::string(how) == "staged";
    ASSERT_TRUE(Start(version, staged ? v1::UPDATE_MODE_STAGED
                                      : v1::UPDATE_MODE_STREAMING)
                    .ok());
    ASSERT_TRUE(coordinator_->DetachControl("f", f.get()));
    RegisterE(0, 1, "f");
    f = std::make_shared<AckingEngine>(coordinator_.get(), &log_, "f");
    ASSERT_TRUE(coordinator_->AttachControl("f", f).ok());
    const size_t before = log_.Get().size();
    std::map<std::string, v1::EngineResult> results;
    if (std::string(how) == "aborted") {
      v1::AbortWeightUpdateRequest abort;
      abort.set_update_id(id);
      auto aborted = coordinator_->AbortWeightUpdate(abort);
      ASSERT_TRUE(aborted.ok()) << aborted.status();
      results = ResultsById(*aborted);
    } else {
      auto done = Finish(id);
      ASSERT_TRUE(done.ok()) << done.status();
      results = ResultsById(*done);
    }
    EXPECT_TRUE(results["f"].lost());
    EXPECT_FALSE(results["e"].lost());
    std::vector<std::string> after = log_.Get();
    after.erase(after.begin(), after.begin() + before);
    for (const char* notice :
         {"pause f", "new_version f", "resume f", "dirty f"}) {
      EXPECT_THAT(after, Not(Contains(std::string(notice))));
    }
    EXPECT_EQ(StatusOf("f").version(), 0);
    EXPECT_EQ(StatusOf("f").state(), v1::ENGINE_READY);
  }
}

// Abort names the update it ends: another id is refused and the update
// in progress goes on.
TEST_F(CoordinatorDeviceTest, AbortEndsOnlyTheUpdateItNames) {
  ASSERT_TRUE(Start(1, v1::UPDATE_MODE_STREAMING).ok());
  v1::AbortWeightUpdateRequest abort;
  abort.set_update_id("u7");
  absl::Status other = coordinator_->AbortWeightUpdate(abort).status();
  EXPECT_EQ(other.code(), absl::StatusCode::kFailedPrecondition) << other;
  EXPECT_THAT(other.message(), HasSubstr("no update 'u7' in progress"));
  EXPECT_EQ(coordinator_->GetStatus(false).update().phase(), "receiving");
  EXPECT_EQ(Engine().state(), v1::ENGINE_UPDATING);
  ASSERT_TRUE(Finish("u1").ok());
  EXPECT_EQ(Engine().version(), 1);
}

// A committed update is told to the update listener (the daemon's
// metrics): its id, version and bytes.
TEST_F(CoordinatorDeviceTest, ACommitIsToldToTheUpdateListener) {
  std::vector<UpdateOutcome> outcomes;
  coordinator_->set_update_listener(
      [&](const UpdateOutcome& o) { outcomes.push_back(o); });
  ASSERT_TRUE(Start(1, v1::UPDATE_MODE_STREAMING).ok());
  ASSERT_TRUE(Finish("u1").ok());
  ASSERT_EQ(outcomes.size(), 1u);
  EXPECT_EQ(outcomes[0].update_id, "u1");
  EXPECT_EQ(outcomes[0].code, absl::StatusCode::kOk);
  EXPECT_EQ(outcomes[0].version, 1);
  EXPECT_EQ(outcomes[0].bytes, 64);
}

// An update that names an engine without a control stream is refused
// saying why. Past the grace the engine is unregistered, and the daemon's
// listener (its metrics), where there is one, hears which.
TEST_F(CoordinatorDeviceTest, AStreamlessEngineIsRefusedByNameThenExpires) {
  CoordinatorOptions options;
  options.engine_start_grace = absl::Milliseconds(400);
  options.update_idle_timeout = absl::ZeroDuration();  // the grace alone
  absl::Mutex mu;
  std::vector<std::string> expired;
  for (bool listen : {false, true}) {
    SCOPED_TRACE(listen ? "a listener" : "no listener");
    Make(options);
    if (listen) {
      coordinator_->set_engine_expired_listener([&](const std::string& id) {
        absl::MutexLock lock(&mu);
        expired.push_back(id);
      });
    }
    RegisterE(0, 1, "g");  // never attaches a stream
    // Named alone or beside an engine that has its stream: refused, and
    // nothing starts (the other engine is not updated without it).
    v1::StartWeightUpdateRequest both =
        Request(1, v1::UPDATE_MODE_STREAMING, v1::VERIFY_OFF);
    both.add_engine_ids("e");
    both.add_engine_ids("g");
    for (const absl::Status& named :
         {StartOn(1, "g"), coordinator_->StartWeightUpdate(both).status()}) {
      EXPECT_EQ(named.code(), absl::StatusCode::kFailedPrecondition) << named;
      EXPECT_THAT(named.message(), HasSubstr("engine 'g' is registered but "
                                             "has no open control stream"));
    }
    EXPECT_EQ(Engine().state(), v1::ENGINE_READY);
    EXPECT_THAT(log_.Get(), Not(Contains("Begin")));
    const absl::Time give_up = absl::Now() + absl::Seconds(10);
    while (States().count("g") > 0 && absl::Now() < give_up) {
      absl::SleepFor(absl::Milliseconds(20));
    }
    EXPECT_EQ(States().count("g"), 0u);
    EXPECT_EQ(States().count("e"), 1u);  // its stream is open
  }
  absl::MutexLock lock(&mu);
  EXPECT_THAT(expired, ElementsAre("g"));
}

// Pause and Resume answer with the engines they name, in their new state.
TEST_F(CoordinatorDeviceTest, PauseAndResumeAnswerWithTheEnginesNewState) {
  auto f = AddEngine("f");
  v1::PauseRequest pause;
  pause.set_timeout_ms(5000);
  pause.add_engine_ids("f");
  pause.add_engine_ids("f");  // named twice: one engine
  auto paused = coordinator_->Pause(pause);
  ASSERT_TRUE(paused.ok()) << paused.status();
  ASSERT_EQ(paused->engines_size(), 1);
  EXPECT_EQ(paused->engines(0).engine_id(), "f");
  EXPECT_EQ(paused->engines(0).state(), v1::ENGINE_PAUSED);
  // Its paused time counts the pause in progress, and stops with it.
  absl::SleepFor(absl::Milliseconds(60));
  EXPECT_GE(StatusOf("f").paused_seconds(), 0.05);
  v1::ResumeRequest resume;
  resume.set_timeout_ms(5000);
  auto resumed = coordinator_->Resume(resume);  // all: e was not paused
  ASSERT_TRUE(resumed.ok()) << resumed.status();
  std::map<std::string, v1::EngineState> states;
  for (const v1::EngineStatus& e : resumed->engines()) {
    states[e.engine_id()] = e.state();
  }
  EXPECT_THAT(states, ElementsAre(std::make_pair("e", v1::ENGINE_READY),
                                  std::make_pair("f", v1::ENGINE_READY)));
  EXPECT_EQ(log_.Get().back(), "resume f");
  const double total = StatusOf("f").paused_seconds();
  EXPECT_GE(total, 0.05);
  absl::SleepFor(absl::Milliseconds(30));
  EXPECT_EQ(StatusOf("f").paused_seconds(), total);
  EXPECT_EQ(StatusOf("e").paused_seconds(), 0);
}

// An RL loop sends the same manifest to the same engines every step: the
// copy plan is made once and reused by every update, until an engine
// registers again (a new layout) or the manifest changes.
TEST_F(CoordinatorDeviceTest, OnePlanServesEveryUpdateUntilSomethingChanges) {
  ASSERT_TRUE(Start(1, v1::UPDATE_MODE_STREAMING).ok());
  ASSERT_TRUE(Finish("u1").ok());
  const std::shared_ptr<const CopyPlan> first = plane_->begun;
  ASSERT_NE(first, nullptr);
  ASSERT_TRUE(Start(2, v1::UPDATE_MODE_STREAMING).ok());
  ASSERT_TRUE(Finish("u2").ok());
  EXPECT_EQ(plane_->begun, first);
  v1::StartWeightUpdateRequest other =
      Request(3, v1::UPDATE_MODE_STREAMING, v1::VERIFY_OFF);
  other.set_chunk_bytes(256);
  ASSERT_TRUE(coordinator_->StartWeightUpdate(other).ok());
  ASSERT_TRUE(Finish("u3").ok());
  EXPECT_NE(plane_->begun, first);
  const std::shared_ptr<const CopyPlan> third = plane_->begun;
  ASSERT_TRUE(coordinator_->DetachControl("e", engine_.get()));
  RegisterE(0);
  engine_ = std::make_shared<AckingEngine>(coordinator_.get(), &log_);
  ASSERT_TRUE(coordinator_->AttachControl("e", engine_).ok());
  other.set_update_id("u4");
  other.set_target_version(4);
  ASSERT_TRUE(coordinator_->StartWeightUpdate(other).ok());
  ASSERT_TRUE(Finish("u4").ok());
  EXPECT_NE(plane_->begun, third);
  EXPECT_EQ(Engine().version(), 4);
}

// Over an IPC ring the chunks are announced, even where the plane receives
// its own bytes, whatever the ring's size: a Finish before the last one was
// announced fails the update, counting them; one after it commits.
TEST_F(CoordinatorDeviceTest, AFinishBeforeARingsLastChunkFails) {
  plane_->plane_name = "ipc";
  int64_t version = 0;
  for (int slots : {1, 2}) {
    for (bool announced : {false, true}) {
      v1::StartWeightUpdateRequest req =
          Request(++version, v1::UPDATE_MODE_STREAMING, v1::VERIFY_OFF);
      req.set_ipc_ring_slots(slots);
      req.set_chunk_bytes(256);
      auto started = coordinator_->StartWeightUpdate(req);
      ASSERT_TRUE(started.ok()) << started.status();
      if (announced) {
        const absl::Status pushed = coordinator_->PushChunk(
            req.update_id(), 0, "", absl::Now() + absl::Seconds(5));
        ASSERT_TRUE(pushed.ok()) << slots << ": " << pushed;
        ASSERT_TRUE(Finish(req.update_id()).ok());
        EXPECT_EQ(Engine().version(), version);
        continue;
      }
      auto early = Finish(req.update_id());
      EXPECT_FALSE(early.ok()) << slots;
      EXPECT_THAT(early.status().message(),
                  HasSubstr("finish after 0 of 1 chunks (0 of 64 bytes)"));
    }
  }
}

// skip_unused: a tensor no engine uses is planned but copied nowhere where
// the bytes reach the daemon anyway (NCCL broadcasts: the stream keeps
// it), and left out of the stream only where the daemon is sent chunks.
TEST_F(CoordinatorDeviceTest, SkipUnusedOmitsATensorOnlyFromAChunkStream) {
  for (bool chunks : {false, true}) {
    SCOPED_TRACE(chunks ? "chunks" : "nccl");
    plane_->receives_own_bytes = !chunks;
    const int64_t version = chunks ? 2 : 1;
    v1::StartWeightUpdateRequest req =
        Request(version, v1::UPDATE_MODE_STREAMING, v1::VERIFY_OFF);
    req.set_chunk_bytes(256);
    req.set_skip_unused(true);
    v1::TensorSpec* x = req.add_tensors();
    x->set_name("x");
    x->set_dtype(v1::FLOAT32);
    x->add_shape(64);  // 256 bytes no engine has
    auto started = coordinator_->StartWeightUpdate(req);
    ASSERT_TRUE(started.ok()) << started.status();
    EXPECT_THAT(started->unused_tensors(), ElementsAre("x"));
    EXPECT_EQ(started->stream_omits_unused(), chunks);
    // x starts a chunk of its own: two chunks where it is kept.
    EXPECT_EQ(started->num_chunks(), chunks ? 1 : 2);
    EXPECT_EQ(started->total_bytes(), chunks ? 64 : 256 + 256);
    v1::AbortWeightUpdateRequest abort;
    abort.set_update_id(req.update_id());
    ASSERT_TRUE(coordinator_->AbortWeightUpdate(abort).ok());
  }
}

// A source registered as a manifest only (no memory) serves updates of
// its manifest however their bytes come: staged, or over an IPC ring.
TEST_F(CoordinatorDeviceTest, AManifestOnlySourceServesStagedAndRingUpdates) {
  v1::RegisterSourceRequest src;
  *src.add_tensors() =
      Request(1, v1::UPDATE_MODE_STREAMING, v1::VERIFY_OFF).tensors(0);
  auto registered = coordinator_->RegisterSource(src);
  ASSERT_TRUE(registered.ok()) << registered.status();
  EXPECT_FALSE(registered->memory());
  auto from_source = [&](int64_t version, v1::UpdateMode mode) {
    v1::StartWeightUpdateRequest req = Request(version, mode, v1::VERIFY_OFF);
    req.clear_tensors();
    req.set_source_id(registered->source_id());
    req.set_chunk_bytes(256);
    return req;
  };
  auto staged =
      coordinator_->StartWeightUpdate(from_source(1, v1::UPDATE_MODE_STAGED));
  ASSERT_TRUE(staged.ok()) << staged.status();
  EXPECT_EQ(staged->mode(), v1::UPDATE_MODE_STAGED);
  ASSERT_TRUE(Finish("u1").ok());
  EXPECT_EQ(Engine().version(), 1);
  plane_->plane_name = "ipc";
  v1::StartWeightUpdateRequest ring = from_source(2, v1::UPDATE_MODE_STREAMING);
  ring.set_ipc_ring_slots(2);
  auto started = coordinator_->StartWeightUpdate(ring);
  ASSERT_TRUE(started.ok()) << started.status();
  ASSERT_TRUE(
      coordinator_->PushChunk("u2", 0, "", absl::Now() + absl::Seconds(5))
          .ok());
  ASSERT_TRUE(Finish("u2").ok());
  EXPECT_EQ(Engine().version(), 2);
}

// A receiver's staging holds two rounds of chunks from each sender with a
// link to it, not from every sender of the plan: a sender that sends this
// daemon nothing takes none of its budget (2 buffers of 6000 bytes: 2816-byte
// chunks, where counting both senders would make 4 buffers of 1280).
TEST_F(CoordinatorDeviceTest, OnlySendersLinkedToThisDaemonShareItsStaging) {
  CoordinatorOptions o;
  o.device_staging_buffers = 2;
  o.device_staging_budget_bytes = 6000;
  Make(o);
  InitGroup(coordinator_.get(), 2);
  // Sender 0 holds all of "w", which this daemon (receiver 0) needs; sender
  // 1 holds "y", which only receiver 1 (another daemon) needs.
  v1::RegisterTransferPlanRequest r = TwoSendersRequest({0}, 8, 2);
  v1::TransferPlanSpec* spec = r.mutable_spec();
  v1::TensorSpec* y = spec->add_tensors();
  y->set_name("y");
  y->set_dtype(v1::FLOAT32);
  y->add_shape(16);
  spec->mutable_senders(0)->mutable_holds(0)->set_row_count(16);
  v1::TensorBlock* held = spec->mutable_senders(1)->mutable_holds(0);
  held->set_tensor("y");
  held->set_row_begin(0);
  held->set_row_count(16);
  spec->mutable_receivers(1)->mutable_needs(0)->set_tensor("y");
  auto registered = coordinator_->RegisterTransferPlan(r);
  ASSERT_TRUE(registered.ok()) << registered.status();
  auto started =
      coordinator_->StartWeightUpdate(PlanUpdate(registered->plan_id()));
  ASSERT_TRUE(started.ok()) << started.status();
  EXPECT_EQ(started->chunk_bytes(), 2816);
  ASSERT_TRUE(Finish("u1").ok());
}

// On a plane that is sent its chunks (the host backend's), a transfer-plan
// update takes each link's chunks through its own stream: the plane is
// handed no chunk sources and the daemon's NCCL rank does not matter.
TEST_F(CoordinatorDeviceTest, TransferPlanOverChunksTakesEachLinksStream) {
  v1::StartWeightUpdateRequest req;
  ASSERT_NO_FATAL_FAILURE(StartPlanOverChunks(&req));
  // A link the plan does not have, or one already streaming, is refused.
  const absl::Status stranger = coordinator_->BeginPushStream("u1", {5, 0});
  EXPECT_EQ(stranger.code(), absl::StatusCode::kInvalidArgument) << stranger;
  EXPECT_THAT(stranger.message(),
              HasSubstr("the transfer plan has no link from sender 5 to "
                        "receiver 0 on this daemon"));
  const absl::Time deadline = absl::Now() + absl::Seconds(5);
  for (int32_t sender : {1, 0}) {  // links in any order: each has its own
    const StreamLink link{sender, 0};
    ASSERT_TRUE(coordinator_->BeginPushStream("u1", link).ok());
    const absl::Status twice = coordinator_->BeginPushStream("u1", link);
    EXPECT_EQ(twice.code(), absl::StatusCode::kFailedPrecondition) << twice;
    EXPECT_THAT(twice.message(),
                HasSubstr(absl::StrCat("already has the stream of sender ",
                                       sender, " to receiver 0 open")));
    const absl::Status pushed = coordinator_->PushChunk(
        "u1", 0, std::string(32, 'w'), deadline, link);  // 8 rows of 4 bytes
    ASSERT_TRUE(pushed.ok()) << sender << ": " << pushed;
  }
  auto done = Finish("u1");
  ASSERT_TRUE(done.ok()) << done.status();
  EXPECT_EQ(Engine().version(), 1);
  // Each link's chunk 0 is its own plan chunk: sender 0's is chunk 0,
  // sender 1's chunk 1.
  EXPECT_THAT(log_.Get(), Contains("SubmitChunk 0"));
  EXPECT_THAT(log_.Get(), Contains("SubmitChunk 1"));
  EXPECT_THAT(log_.Get(), Not(Contains("SetChunkSources 2")));
  // A chunk on a link the plan does not have fails the update, written
  // nowhere.
  req.set_update_id("u2");
  req.set_target_version(2);
  ASSERT_TRUE(coordinator_->StartWeightUpdate(req).ok());
  const size_t before = log_.Get().size();
  const absl::Status stray =
      coordinator_->PushChunk("u2", 0, std::string(32, 'w'), deadline, {5, 0});
  EXPECT_EQ(stray.code(), absl::StatusCode::kInvalidArgument) << stray;
  EXPECT_THAT(stray.message(),
              HasSubstr("update 'u2': no link from sender 5 to receiver 0"));
  std::vector<std::string> after = log_.Get();
  after.erase(after.begin(), after.begin() + before);
  EXPECT_THAT(after, Not(Contains(::testing::StartsWith("SubmitChunk"))));
  EXPECT_EQ(coordinator_->GetStatus(false).update().phase(), "failed");
  // On a link of the plan, its chunks count from 0, in order, up to its own
  // number of chunks (one each here).
  struct Bad {
    std::vector<int64_t> pushes;  // the last one is refused
    std::string says;
  };
  int64_t version = 2;
  for (const Bad& b : std::vector<Bad>{
           {{-1}, "chunk -1 of sender 0 arrived, but its link has 1 chunks"},
           {{1}, "chunk 1 of sender 0 arrived, but its link has 1 chunks"},
           {{0, 0}, "chunk 0 of sender 0 arrived, expected 1"}}) {
    req.set_update_id(absl::StrCat("u", ++version));
    req.set_target_version(version);
    ASSERT_TRUE(coordinator_->StartWeightUpdate(req).ok()) << b.says;
    for (size_t i = 0; i < b.pushes.size(); ++i) {
      const absl::Status pushed = coordinator_->PushChunk(
          req.update_id(), b.pushes[i], std::string(32, 'w'), deadline, {0, 0});
      if (i + 1 < b.pushes.size()) {
        ASSERT_TRUE(pushed.ok()) << pushed;
        continue;
      }
      EXPECT_EQ(pushed.code(), absl::StatusCode::kInvalidArgument) << pushed;
      EXPECT_THAT(pushed.message(), HasSubstr(b.says));
    }
    EXPECT_EQ(coordinator_->GetStatus(false).update().phase(), "failed");
  }
}

// An engine that registers again while a Start plans (its old layout is
// in the plan) is lost to that update: neither written, versioned nor left
// receiving, and not left paused by it.
TEST_F(CoordinatorDeviceTest, AnEngineRegisteredAgainWhileAStartPlansIsLost) {
  auto f = AddEngine("f");
  std::shared_ptr<AckingEngine> again;
  plane_->on_warm = [&] {
    EXPECT_TRUE(coordinator_->DetachControl("f", f.get()));
    RegisterE(0, 1, "f");
    again = std::make_shared<AckingEngine>(coordinator_.get(), &log_, "f");
    EXPECT_TRUE(coordinator_->AttachControl("f", again).ok());
  };
  ASSERT_TRUE(Start(1, v1::UPDATE_MODE_STREAMING).ok());
  plane_->on_warm = nullptr;
  auto done = Finish("u1");
  ASSERT_TRUE(done.ok()) << done.status();
  auto results = ResultsById(*done);
  EXPECT_TRUE(results["f"].lost());
  EXPECT_FALSE(results["e"].lost());
  EXPECT_EQ(Engine().version(), 1);
  EXPECT_EQ(StatusOf("f").version(), 0);
  EXPECT_EQ(StatusOf("f").state(), v1::ENGINE_READY);
}

// An update whose bytes keep landing (NCCL writes them itself; the plane
// counts them) is not idle, however long its trainer says nothing; once
// they stop, it is ended past the idle timeout, saying so.
TEST_F(CoordinatorDeviceTest, AnUpdateWhoseBytesKeepLandingIsNotIdle) {
  Make(IdleOptions());
  ASSERT_TRUE(Start(1, v1::UPDATE_MODE_STREAMING).ok());
  for (int i = 0; i < 12; ++i) {  // 2.4 s of progress, no call
    ++plane_->written;
    absl::SleepFor(absl::Milliseconds(200));
    ASSERT_EQ(coordinator_->GetStatus(false).update().phase(), "receiving")
        << "after " << (i + 1) * 200 << " ms";
  }
  const v1::UpdateStatus u = WaitUntilFailed();
  EXPECT_THAT(u.error(), HasSubstr("update 'u1' abandoned: no chunk, call or "
                                   "progress from its trainer for"));
}

// A Finish that outlasts the idle timeout (a long drain) is not cut short:
// the watchdog, finding the update idle, waits for the Finish in progress
// and then finds it committed.
TEST_F(CoordinatorDeviceTest, AFinishLongerThanTheIdleTimeoutCommits) {
  Make(IdleOptions());
  ASSERT_TRUE(Start(1, v1::UPDATE_MODE_STREAMING).ok());
  plane_->on_drain = [] { absl::SleepFor(absl::Milliseconds(1600)); };
  auto done = Finish("u1");
  plane_->on_drain = nullptr;
  ASSERT_TRUE(done.ok()) << done.status();
  EXPECT_EQ(Engine().version(), 1);
  absl::SleepFor(absl::Milliseconds(300));  // the watchdog's next ticks
  EXPECT_EQ(coordinator_->GetStatus(false).update().phase(), "committed");
}

// An engine whose shared memory went away under the update (its owner
// shrank it: a SIGBUS the bus guard caught and marked) is dropped at the
// Finish, the first engine as any other: lost to the update and
// unregistered, saying why; the others commit.
TEST_F(CoordinatorDeviceTest, AnEngineWhoseMemoryFaultedIsDroppedAtFinish) {
  auto f = AddEngine("f");
  ASSERT_EQ(mapper_->opened.size(), 2u);
  ASSERT_TRUE(Start(1, v1::UPDATE_MODE_STREAMING).ok());
  mapper_->opened[0]->faulted_flag()->store(true);  // e's allocation
  auto done = Finish("u1");
  ASSERT_TRUE(done.ok()) << done.status();
  auto results = ResultsById(*done);
  EXPECT_TRUE(results["e"].lost());
  EXPECT_THAT(results["e"].message(), HasSubstr("its shared memory is gone"));
  EXPECT_EQ(StatusOf("e").engine_id(), "");  // unregistered
  EXPECT_FALSE(results["f"].lost());
  EXPECT_EQ(StatusOf("f").version(), 1);
}

// A chunk stream opens only for the update in progress it names, once.
TEST_F(CoordinatorDeviceTest, AChunkStreamOpensOnlyForItsUpdateOnce) {
  plane_->receives_own_bytes = false;
  const absl::Status none = coordinator_->BeginPushStream("u1");
  EXPECT_EQ(none.code(), absl::StatusCode::kFailedPrecondition) << none;
  EXPECT_THAT(none.message(), HasSubstr("no update 'u1' in progress; call "
                                        "StartWeightUpdate before PushChunks"));
  ASSERT_TRUE(Start(1, v1::UPDATE_MODE_STREAMING).ok());
  const absl::Status other = coordinator_->BeginPushStream("u7");
  EXPECT_EQ(other.code(), absl::StatusCode::kFailedPrecondition) << other;
  EXPECT_THAT(other.message(), HasSubstr("no update 'u7' in progress"));
  ASSERT_TRUE(coordinator_->BeginPushStream("u1").ok());
  const absl::Status stray = coordinator_->PushChunk(
      "u7", 0, std::string(64, 'x'), absl::Now() + absl::Seconds(5));
  EXPECT_EQ(stray.code(), absl::StatusCode::kFailedPrecondition) << stray;
  EXPECT_THAT(stray.message(), HasSubstr("no update 'u7' in progress"));
  const absl::Status twice = coordinator_->BeginPushStream("u1");
  EXPECT_EQ(twice.code(), absl::StatusCode::kFailedPrecondition) << twice;
  EXPECT_THAT(twice.message(),
              HasSubstr("update 'u1' already has a PushChunks stream open"));
  ASSERT_TRUE(coordinator_
                  ->PushChunk("u1", 0, std::string(64, 'w'),
                              absl::Now() + absl::Seconds(5))
                  .ok());
  ASSERT_TRUE(Finish("u1").ok());
  EXPECT_EQ(Engine().version(), 1);
}

// A call's timeout_ms bounds its wait for the engines, to the millisecond:
// a pause that its engine acknowledges later fails (and leaves nothing
// paused), one given the time succeeds.
TEST_F(CoordinatorDeviceTest, APausesTimeoutBoundsItsWaitForTheEngines) {
  auto f = AddEngine("f");
  f->ack_delay_ms = 300;
  v1::PauseRequest pause;
  pause.add_engine_ids("f");
  pause.set_timeout_ms(1);
  const absl::Status late = coordinator_->Pause(pause).status();
  EXPECT_EQ(late.code(), absl::StatusCode::kDeadlineExceeded) << late;
  EXPECT_EQ(StatusOf("f").state(), v1::ENGINE_READY);
  pause.set_timeout_ms(5000);
  auto paused = coordinator_->Pause(pause);
  ASSERT_TRUE(paused.ok()) << paused.status();
  EXPECT_EQ(StatusOf("f").state(), v1::ENGINE_PAUSED);
}

// Any call of its trainer's keeps an update from idling, not only its
// chunks: here RegisterSource calls while the bytes are on their way.
TEST_F(CoordinatorDeviceTest, ATrainersCallsKeepItsUpdateFromIdling) {
  Make(IdleOptions());
  ASSERT_TRUE(Start(1, v1::UPDATE_MODE_STREAMING).ok());
  v1::RegisterSourceRequest src;
  *src.add_tensors() =
      Request(1, v1::UPDATE_MODE_STREAMING, v1::VERIFY_OFF).tensors(0);
  for (int i = 0; i < 3; ++i) {  // 1.8 s in all, a call every 0.6 s
    absl::SleepFor(absl::Milliseconds(600));
    ASSERT_TRUE(coordinator_->RegisterSource(src).ok());
    ASSERT_EQ(coordinator_->GetStatus(false).update().phase(), "receiving")
        << "after " << (i + 1) * 600 << " ms";
  }
  ASSERT_TRUE(Finish("u1").ok());
  EXPECT_EQ(Engine().version(), 1);
}

// With neither an idle timeout nor an engine grace there is no watchdog:
// updates run, and the daemon stops cleanly.
TEST_F(CoordinatorDeviceTest, WithoutTimeoutsThereIsNoWatchdogToStop) {
  CoordinatorOptions options;
  options.update_idle_timeout = absl::ZeroDuration();
  options.engine_start_grace = absl::ZeroDuration();
  Make(options);
  ASSERT_TRUE(Start(1, v1::UPDATE_MODE_STREAMING).ok());
  ASSERT_TRUE(Finish("u1").ok());
  EXPECT_EQ(Engine().version(), 1);
  TearDown();  // joins no thread
  Make(CoordinatorOptions());
}

// An engine registers again in place only while no control stream speaks
// for it (its old process gone); an engine unknown can't be unregistered.
TEST_F(CoordinatorDeviceTest, ReRegisteringAndUnregisteringSayWhatTheyCant) {
  RegisterE(0, 1, "g");  // no stream yet
  RegisterE(0, 1, "g");  // again: replaces it
  EXPECT_EQ(StatusOf("g").engine_id(), "g");
  const absl::Status open =
      coordinator_->RegisterEngine(RegisterRequest(0, 1, "e")).status();
  EXPECT_EQ(open.code(), absl::StatusCode::kAlreadyExists) << open;
  EXPECT_THAT(open.message(), HasSubstr("engine 'e' is registered and its "
                                        "control stream is open; unregister "
                                        "it first"));
  const absl::Status unknown = coordinator_->UnregisterEngine("nope");
  EXPECT_EQ(unknown.code(), absl::StatusCode::kNotFound) << unknown;
  EXPECT_THAT(unknown.message(), HasSubstr("engine 'nope' is not registered"));
  EXPECT_TRUE(coordinator_->UnregisterEngine("g").ok());
  EXPECT_EQ(StatusOf("g").engine_id(), "");
}

// An engine lost to an update keeps the reason it was lost for: a later
// removal of the same id (its new registration unregistered) neither marks
// it lost again nor rewrites why.
TEST_F(CoordinatorDeviceTest, ALostEngineKeepsTheReasonItWasLostFor) {
  auto f = AddEngine("f");
  ASSERT_TRUE(Start(1, v1::UPDATE_MODE_STREAMING).ok());
  ASSERT_TRUE(coordinator_->DetachControl("f", f.get()));
  RegisterE(0, 1, "f");
  ASSERT_TRUE(coordinator_->UnregisterEngine("f").ok());
  auto done = Finish("u1");
  ASSERT_TRUE(done.ok()) << done.status();
  auto results = ResultsById(*done);
  EXPECT_TRUE(results["f"].lost());
  EXPECT_EQ(results["f"].message(), "control stream closed");
  EXPECT_THAT(plane_->marked_lost(), ElementsAre(1));
}

// A chunk index outside the plan is refused saying so, before anything is
// written, and fails the update.
TEST_F(CoordinatorDeviceTest, AChunkOutsideThePlanIsRefusedByItsIndex) {
  plane_->receives_own_bytes = false;
  for (int64_t index : {int64_t{-1}, int64_t{1}}) {
    const int64_t version = index < 0 ? 1 : 2;
    ASSERT_TRUE(Start(version, v1::UPDATE_MODE_STREAMING).ok());
    const std::string id = absl::StrCat("u", version);
    const absl::Status s = coordinator_->PushChunk(
        id, index, std::string(64, 'w'), absl::Now() + absl::Seconds(5));
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_THAT(s.message(),
                HasSubstr(absl::StrCat("update '", id, "': chunk ", index,
                                       " arrived, but the plan has 1 chunks")));
    EXPECT_THAT(log_.Get(),
                Not(Contains(::testing::StartsWith("SubmitChunk"))));
    EXPECT_EQ(coordinator_->GetStatus(false).update().phase(), "failed");
    v1::AbortWeightUpdateRequest abort;
    abort.set_update_id(id);
    ASSERT_TRUE(coordinator_->AbortWeightUpdate(abort).ok());
    // Its status counts what arrived: nothing.
    EXPECT_EQ(coordinator_->GetStatus(false).update().received_bytes(), 0);
  }
  ASSERT_TRUE(Start(3, v1::UPDATE_MODE_STREAMING).ok());
  ASSERT_TRUE(coordinator_
                  ->PushChunk("u3", 0, std::string(64, 'w'),
                              absl::Now() + absl::Seconds(5))
                  .ok());
  ASSERT_TRUE(Finish("u3").ok());
  EXPECT_EQ(coordinator_->GetStatus(false).update().received_bytes(), 64);
}

// An engine registered with trainer uids takes updates only from those
// trainers and root; one registered without takes them from anyone.
TEST_F(CoordinatorDeviceTest, TrainerUidsAdmitOnlyThoseTrainersAndRoot) {
  v1::RegisterEngineRequest r = RegisterRequest(0, 1, "f");
  r.add_trainer_uids(1000);
  ASSERT_TRUE(coordinator_->RegisterEngine(r).ok());
  google::protobuf::RepeatedPtrField<std::string> f, e;
  f.Add("f");
  e.Add("e");
  EXPECT_TRUE(coordinator_->CheckTrainerUid(f, 1000).ok());
  EXPECT_TRUE(coordinator_->CheckTrainerUid(f, 0).ok());  // root
  EXPECT_TRUE(coordinator_->CheckTrainerUid(e, 1234).ok());
  const absl::Status other = coordinator_->CheckTrainerUid(f, 1001);
  EXPECT_EQ(other.code(), absl::StatusCode::kPermissionDenied) << other;
  EXPECT_THAT(other.message(),
              HasSubstr("engine 'f' accepts updates only from trainers of uid "
                        "1000 (and root), not uid 1001"));
  const absl::Status all = coordinator_->CheckTrainerUid(
      google::protobuf::RepeatedPtrField<std::string>(), 1001);
  EXPECT_EQ(all.code(), absl::StatusCode::kPermissionDenied) << all;
}

// InitWeightTransfer's ranks lie inside its world: a negative world or
// rank, or a rank at the world's size, is refused, and the group formed
// before stays.
TEST_F(CoordinatorDeviceTest, InitRefusesRanksOutsideItsWorld) {
  struct Case {
    int32_t world, rank;
  };
  for (const Case& c : std::vector<Case>{{-1, 0}, {2, -1}, {2, 2}, {1, 1}}) {
    v1::InitWeightTransferRequest init;
    init.set_backend(v1::BACKEND_NCCL);
    init.set_world_size(c.world);
    init.set_rank_offset(c.rank);
    const absl::Status s = coordinator_->InitWeightTransfer(init).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_THAT(s.message(), HasSubstr(absl::StrCat(
                                 "rank_offset ", c.rank,
                                 " must lie inside world_size ", c.world)));
  }
  ASSERT_TRUE(Start(1, v1::UPDATE_MODE_STREAMING).ok());
  ASSERT_TRUE(Finish("u1").ok());
  v1::InitWeightTransferRequest inside;
  inside.set_backend(v1::BACKEND_NCCL);
  inside.set_world_size(2);
  inside.set_rank_offset(1);
  EXPECT_TRUE(coordinator_->InitWeightTransfer(inside).ok());
}

// NCCL versions are compared for an NCCL group alone: a trainer whose NCCL
// differs in major.minor is refused there (unless the daemon allows it),
// and a host group does not look at the field.
TEST_F(CoordinatorDeviceTest, NcclVersionsAreComparedForNcclGroupsAlone) {
  CoordinatorOptions options;
  options.nccl_version = 22809;  // 2.28.9
  Make(options);
  v1::InitWeightTransferRequest init;
  init.set_backend(v1::BACKEND_NCCL);
  init.set_nccl_version(22703);  // 2.27.3
  const absl::Status s = coordinator_->InitWeightTransfer(init).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_THAT(s.message(), HasSubstr("the trainer's NCCL is 2.27.3, this "
                                     "daemon's is 2.28.9"));
  init.set_backend(v1::BACKEND_HOST);
  EXPECT_TRUE(coordinator_->InitWeightTransfer(init).ok());
  options.allow_nccl_version_mismatch = true;
  Make(options);
  init.set_backend(v1::BACKEND_NCCL);
  EXPECT_TRUE(coordinator_->InitWeightTransfer(init).ok());
}

// An engine gone while a Start plans a manifest leaves no memory held once
// the update ends: the plan that names it is not kept for reuse.
TEST_F(CoordinatorDeviceTest, AnEngineGoneWhileAStartPlansLeavesNoMemoryHeld) {
  auto f = AddEngine("f");
  plane_->on_warm = [this] {
    EXPECT_TRUE(coordinator_->UnregisterEngine("f").ok());
  };
  ASSERT_TRUE(Start(1, v1::UPDATE_MODE_STREAMING).ok());
  plane_->on_warm = nullptr;
  auto done = Finish("u1");
  ASSERT_TRUE(done.ok()) << done.status();
  EXPECT_TRUE(ResultsById(*done)["f"].lost());
  plane_->begun.reset();  // the fake's own reference
  ASSERT_EQ(mapper_->opened.size(), 2u);
  EXPECT_EQ(mapper_->opened[1].use_count(), 1)
      << "the gone engine's memory is still mapped";
}

// IpcChunkAck paces an IPC ring by its slots: before packing chunk i+1
// into a slot the trainer needs chunk i+1-slots out of it, so with one
// slot the ack of chunk 0 waits for chunk 1 (1 done), with two it waits
// for nothing. It answers only the update in progress, and a wait or a
// copy that fails fails the update.
TEST_F(CoordinatorDeviceTest, IpcChunkAckPacesTheRingBySlots) {
  const absl::Time deadline = absl::Now() + absl::Seconds(5);
  int64_t version = 0;
  for (int slots : {1, 2}) {
    SCOPED_TRACE(slots);
    const std::string id = absl::StrCat("u", ++version);
    StartRingUpdate(coordinator_.get(), plane_.get(), id,
                    v1::UPDATE_MODE_STREAMING, version, slots);
    const absl::Status other =
        coordinator_->IpcChunkAck("u7", 0, deadline).status();
    EXPECT_EQ(other.code(), absl::StatusCode::kFailedPrecondition) << other;
    ASSERT_TRUE(coordinator_->PushChunk(id, 0, "", deadline).ok());
    const size_t before = log_.Get().size();
    auto done = coordinator_->IpcChunkAck(id, 0, deadline);
    ASSERT_TRUE(done.ok()) << done.status();
    std::vector<std::string> after = log_.Get();
    after.erase(after.begin(), after.begin() + before);
    if (slots == 1) {
      EXPECT_EQ(*done, 1);
      EXPECT_THAT(after, ElementsAre("WaitChunks 1"));
    } else {
      EXPECT_EQ(*done, 0);
      EXPECT_THAT(after, IsEmpty());
    }
    ASSERT_TRUE(Finish(id).ok());
  }
  // A wait that fails, then a copy that fails: each fails its update.
  for (bool wait : {true, false}) {
    const std::string id = absl::StrCat("u", ++version);
    StartRingUpdate(coordinator_.get(), plane_.get(), id,
                    v1::UPDATE_MODE_STREAMING, version);
    (wait ? plane_->wait_chunks_status : plane_->submit_status) =
        absl::InternalError("the copy engine stopped");
    absl::Status s = coordinator_->PushChunk(id, 0, "", deadline);
    if (wait) {
      ASSERT_TRUE(s.ok()) << s;
      // StartRingUpdate's ring has two slots: chunk 1 would need chunk 0.
      s = coordinator_->IpcChunkAck(id, 1, deadline).status();
    }
    EXPECT_EQ(s.code(), absl::StatusCode::kInternal) << s;
    EXPECT_EQ(coordinator_->GetStatus(false).update().phase(), "failed");
    EXPECT_THAT(coordinator_->GetStatus(false).update().error(),
                HasSubstr("the copy engine stopped"));
    plane_->wait_chunks_status = plane_->submit_status = absl::OkStatus();
    plane_->plane_name = "ipc";
    v1::AbortWeightUpdateRequest abort;
    abort.set_update_id(id);
    ASSERT_TRUE(coordinator_->AbortWeightUpdate(abort).ok());
  }
}

// An engine that says its registered memory is no longer its weights is
// unregistered, with its words; one unknown is not.
TEST_F(CoordinatorDeviceTest, AnEngineThatLostItsMemoryIsUnregistered) {
  EXPECT_FALSE(coordinator_->EngineLost("nope", "freed"));
  EXPECT_TRUE(coordinator_->EngineLost("e", "freed by the engine"));
  EXPECT_EQ(StatusOf("e").engine_id(), "");
  const absl::Status start = Start(1, v1::UPDATE_MODE_STREAMING);
  EXPECT_FALSE(start.ok());
}

// GetStatus carries the engines' layouts only when asked.
TEST_F(CoordinatorDeviceTest, StatusCarriesLayoutsOnlyWhenAsked) {
  EXPECT_EQ(coordinator_->GetStatus(false).engines(0).layout_size(), 0);
  const v1::GetStatusResponse with = coordinator_->GetStatus(true);
  ASSERT_EQ(with.engines(0).layout_size(), 1);
  EXPECT_EQ(with.engines(0).layout(0).name(), "w");
}

// An update that names an engine twice updates it once.
TEST_F(CoordinatorDeviceTest, AnEngineNamedTwiceIsUpdatedOnce) {
  v1::StartWeightUpdateRequest req =
      Request(1, v1::UPDATE_MODE_STREAMING, v1::VERIFY_OFF);
  req.add_engine_ids("e");
  req.add_engine_ids("e");
  auto started = coordinator_->StartWeightUpdate(req);
  ASSERT_TRUE(started.ok()) << started.status();
  EXPECT_THAT(started->engine_ids(), ElementsAre("e"));
  auto done = Finish("u1");
  ASSERT_TRUE(done.ok()) << done.status();
  EXPECT_EQ(done->engines_size(), 1);
  EXPECT_EQ(Engine().version(), 1);
}

// A link's stream that ends: complete, nothing happens; short of its
// chunks, the whole update fails naming the sender and what arrived (a
// cancelled stream fails it too, and answers nobody). An end of another
// update's stream, of a link the plan lacks, or of an update failed
// already, changes nothing.
TEST_F(CoordinatorDeviceTest, ALinksStreamEndingShortFailsTheUpdate) {
  v1::StartWeightUpdateRequest req;
  ASSERT_NO_FATAL_FAILURE(StartPlanOverChunks(&req));
  auto phase = [&] { return coordinator_->GetStatus(false).update().phase(); };
  const absl::Time deadline = absl::Now() + absl::Seconds(5);
  EXPECT_TRUE(coordinator_->PushStreamEnded("u7", false, {0, 0}).ok());
  EXPECT_TRUE(coordinator_->PushStreamEnded("u1", false, {5, 0}).ok());
  ASSERT_TRUE(coordinator_->BeginPushStream("u1", {0, 0}).ok());
  ASSERT_TRUE(
      coordinator_->PushChunk("u1", 0, std::string(32, 'w'), deadline, {0, 0})
          .ok());
  EXPECT_TRUE(coordinator_->PushStreamEnded("u1", false, {0, 0}).ok());
  EXPECT_EQ(phase(), "receiving");
  ASSERT_TRUE(coordinator_->BeginPushStream("u1", {1, 0}).ok());
  const absl::Status short_end =
      coordinator_->PushStreamEnded("u1", false, {1, 0});
  EXPECT_EQ(short_end.code(), absl::StatusCode::kAborted) << short_end;
  EXPECT_THAT(short_end.message(),
              HasSubstr("sender 1 ended its stream mid-update after 0 of 1 "
                        "chunks of its link to receiver 0 (update 'u1' "
                        "failed; start it again)"));
  EXPECT_EQ(phase(), "failed");
  // Failed already: a later end says nothing more.
  EXPECT_TRUE(coordinator_->PushStreamEnded("u1", false, {0, 0}).ok());
  v1::AbortWeightUpdateRequest abort;
  abort.set_update_id("u1");
  ASSERT_TRUE(coordinator_->AbortWeightUpdate(abort).ok());
  // A sender that disconnects: the update fails, and the call answers OK
  // (nobody is left to hear it).
  req.set_update_id("u2");
  req.set_target_version(2);
  ASSERT_TRUE(coordinator_->StartWeightUpdate(req).ok());
  ASSERT_TRUE(coordinator_->BeginPushStream("u2", {0, 0}).ok());
  EXPECT_TRUE(coordinator_->PushStreamEnded("u2", true, {0, 0}).ok());
  EXPECT_EQ(phase(), "failed");
  EXPECT_THAT(coordinator_->GetStatus(false).update().error(),
              HasSubstr("sender 0 disconnected mid-update after 0 of 1 "
                        "chunks"));
  // The other sender's stream, short too, ends on the failed update: it
  // hears nothing more (the update's reason stays the first).
  EXPECT_TRUE(coordinator_->PushStreamEnded("u2", false, {1, 0}).ok());
  EXPECT_THAT(coordinator_->GetStatus(false).update().error(),
              HasSubstr("sender 0 disconnected"));
}

// Over an IPC ring the chunks are announced on a stream too: one that ends
// before the last announcement fails the update, naming what is missing.
TEST_F(CoordinatorDeviceTest, ARingsStreamEndingShortFailsTheUpdate) {
  StartRingUpdate(coordinator_.get(), plane_.get(), "u1",
                  v1::UPDATE_MODE_STREAMING);
  ASSERT_TRUE(coordinator_->BeginPushStream("u1").ok());
  const absl::Status s = coordinator_->PushStreamEnded("u1", false);
  EXPECT_EQ(s.code(), absl::StatusCode::kAborted) << s;
  EXPECT_THAT(s.message(), HasSubstr("the chunk stream of update 'u1' ended "
                                     "after 0 of 1 chunks (chunks 0..0 "
                                     "missing)"));
  EXPECT_EQ(coordinator_->GetStatus(false).update().phase(), "failed");
}

// An update fails once, for its first reason: a stream that then ends short
// says nothing more, and the Abort that ends it reports (and tells the
// metrics) that reason, once.
TEST_F(CoordinatorDeviceTest, AnUpdateFailsOnceForItsFirstReason) {
  std::vector<UpdateOutcome> outcomes;
  coordinator_->set_update_listener(
      [&](const UpdateOutcome& o) { outcomes.push_back(o); });
  StartRingUpdate(coordinator_.get(), plane_.get(), "u1",
                  v1::UPDATE_MODE_STREAMING);
  ASSERT_TRUE(coordinator_->BeginPushStream("u1").ok());
  ASSERT_FALSE(
      coordinator_->PushChunk("u1", 7, "", absl::Now() + absl::Seconds(5))
          .ok());
  EXPECT_TRUE(coordinator_->PushStreamEnded("u1", false).ok());
  v1::AbortWeightUpdateRequest abort;
  abort.set_update_id("u1");
  auto aborted = coordinator_->AbortWeightUpdate(abort);
  ASSERT_TRUE(aborted.ok()) << aborted.status();
  EXPECT_THAT(ResultsById(*aborted)["e"].message(),
              HasSubstr("chunk 7 arrived, but the plan has 1 chunks"));
  EXPECT_THAT(coordinator_->GetStatus(false).update().error(),
              HasSubstr("chunk 7 arrived"));
  ASSERT_EQ(outcomes.size(), 1u);
  EXPECT_EQ(outcomes[0].code, absl::StatusCode::kInvalidArgument);
}

// CheckEngine of an engine being written refuses, saying whether its
// update is still receiving or failed and waits to be ended.
TEST_F(CoordinatorDeviceTest, CheckEngineOfAnEngineBeingWrittenSaysWhy) {
  v1::CheckEngineRequest check;
  check.set_engine_id("e");
  ASSERT_TRUE(Start(1, v1::UPDATE_MODE_STREAMING).ok());
  absl::Status s = coordinator_->CheckEngine(check).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_THAT(s.message(), HasSubstr("engine 'e' is being written by update "
                                     "'u1'; check it after Finish"));
  v1::AbortWeightUpdateRequest abort;
  abort.set_update_id("u1");
  ASSERT_TRUE(coordinator_->AbortWeightUpdate(abort).ok());
  FailOverARing(coordinator_.get(), plane_.get(), 2);
  s = coordinator_->CheckEngine(check).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_THAT(s.message(), HasSubstr("engine 'e' was being written by update "
                                     "'u2', which failed and is not ended "
                                     "yet"));
}

// With --update_idle_timeout_ms=0 the watchdog still expires engines that
// never opened their stream, at a quarter of the grace or 200 ms: it does
// not spin.
TEST_F(CoordinatorDeviceTest, AWatchdogWithNoIdleTimeoutDoesNotSpin) {
  CoordinatorOptions options;
  options.update_idle_timeout = absl::ZeroDuration();
  Make(options);
  auto cpu = [] {
    rusage u;
    getrusage(RUSAGE_SELF, &u);
    return absl::DurationFromTimeval(u.ru_utime) +
           absl::DurationFromTimeval(u.ru_stime);
  };
  const absl::Duration before = cpu();
  absl::SleepFor(absl::Milliseconds(1000));
  EXPECT_LT(cpu() - before, absl::Milliseconds(100)) << cpu() - before;
}

}  // namespace
}  // namespace weightsync

// The C++ MultiTrainer (client/multi_trainer.h) against three daemons in
// process, each with two engines (TP=2) of one pipeline stage of the tiny
// synthetic model: stage 0 the embeddings and layer 0, stage 1 layer 1,
// stage 2 the norm and lm_head. Each daemon is sent only its stage's
// bytes; a tensor no daemon uses is refused before anything is paused; a
// daemon gone during prepare and an engine refusing the staged commit's
// pause abort the update on every daemon, committed nowhere.
#include "client/multi_trainer.h"

#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/engine_client.h"
#include "client/host_arena.h"
#include "daemon/backends.h"
#include "daemon/server/server.h"
#include "gmock/gmock.h"
#include "grpc/grpc.h"
#include "gtest/gtest.h"
#include "tools/synthetic/synthetic_model.h"

namespace weightsync {
namespace {

using ::testing::HasSubstr;

const bool kGrpcInitialised = (grpc_init(), true);

bool InStage(const std::string& name, int stage) {
  if (name.rfind("model.layers.", 0) == 0) {
    return std::stoi(name.substr(13)) == stage;  // tiny has 2 layers
  }
  return name == "model.embed_tokens.weight" ? stage == 0 : stage == 2;
}

class MultiTrainerTest : public ::testing::Test {
 protected:
  static constexpr int kDaemons = 3;

  void SetUp() override {
    char tmpl[] = "/tmp/wsmulti.XXXXXX";
    dir_ = mkdtemp(tmpl);
    model_ = *synthetic::ModelByName("tiny");
    CoordinatorOptions core;
    core.notice_timeout = absl::Milliseconds(500);
    core.finish_timeout = absl::Seconds(5);
    HostDataPlane::Options host;
    host.staging_buffers = 2;
    host.staging_budget = 1 << 20;
    std::vector<ClientOptions> daemons;
    for (int k = 0; k < kDaemons; ++k) {
      cores_.push_back(std::make_unique<Coordinator>(
          core, MakeMemoryMapper(), MakeDataPlaneFactory(host)));
      ServerOptions so;
      so.unix_socket = absl::StrCat(dir_, "/d", k, ".sock");
      auto server = Server::BuildAndStart(so, cores_.back().get());
      ASSERT_TRUE(server.ok()) << server.status();
      servers_.push_back(*std::move(server));
      ClientOptions o;
      o.target = "unix:" + so.unix_socket;
      o.call_timeout = absl::Seconds(10);
      daemons.push_back(o);
      for (int r = 0; r < 2; ++r) AddEngine(o, k, r);
    }
    trainer_ = *MultiTrainer::Connect(daemons);
    ASSERT_TRUE(trainer_->InitHost().ok());
  }

  void TearDown() override {
    engines_.clear();
    trainer_.reset();
    for (auto& a : arenas_) a->region().Unlink();
    for (auto& s : servers_) {
      if (s != nullptr) s->Shutdown(absl::ZeroDuration());
    }
    cores_.clear();
    rmdir(dir_.c_str());
  }

  void AddEngine(const ClientOptions& o, int stage, int rank) {
    std::vector<v1::Parameter> params;
    for (const v1::Parameter& p :
         synthetic::EngineParameters(model_, synthetic::Layout::kTensorParallel,
                                     rank, 2, v1::BFLOAT16)) {
      if (InStage(p.name(), stage)) params.push_back(p);
    }
    const std::string id = absl::StrCat("s", stage, ".tp", rank);
    auto arena = HostArena::Create(
        absl::StrCat("/wsmulti-", dir_.substr(dir_.rfind('.') + 1), "-", id),
        params);
    ASSERT_TRUE(arena.ok()) << arena.status();
    auto engine = *EngineClient::Connect(o);
    v1::RegisterEngineRequest r = (*arena)->Registration();
    r.set_engine_id(id);
    ASSERT_TRUE(engine->Register(r).ok());
    EngineHooks hooks;
    hooks.on_pause = [this, id](v1::PauseMode) {
      return id == refuse_ ? absl::AbortedError(id + " refuses to pause")
                           : absl::OkStatus();
    };
    ASSERT_TRUE(engine->StartControl(std::move(hooks)).ok());
    stage_.push_back(stage);
    arenas_.push_back(*std::move(arena));
    engines_.push_back(std::move(engine));
    absl::SleepFor(absl::Milliseconds(20));  // the control stream attaches
  }

  std::vector<HostTensor> Tensors(int64_t version) {
    data_.clear();
    std::vector<HostTensor> out;
    const auto specs = synthetic::Checkpoint(model_, v1::FLOAT32);
    for (const v1::TensorSpec& t : specs) {
      data_[t.name()] = {t, synthetic::Contents(t, version)};
    }
    for (const v1::TensorSpec& t : specs) {
      out.push_back({t, data_[t.name()].second.data()});
    }
    return out;
  }

  v1::StartWeightUpdateRequest Request(int64_t version) {
    v1::StartWeightUpdateRequest r;
    r.set_update_id(absl::StrCat("u", version));
    r.set_target_version(version);
    r.set_chunk_bytes(4096);
    return r;
  }

  bool Installed(int i) {
    const uint8_t* base = arenas_[i]->region().data();
    for (const v1::Parameter& p : arenas_[i]->parameters()) {
      const auto want = synthetic::ExpectedParameter(p, data_);
      if (std::memcmp(base + p.offset(), want.data(), want.size()) != 0) {
        return false;
      }
    }
    return true;
  }

  // (state, version) of engine i as its daemon reports it.
  std::pair<v1::EngineState, int64_t> StateOf(int i) {
    auto st = trainer_->daemon(stage_[i]).GetStatus();
    for (const v1::EngineStatus& e : st->engines()) {
      if (e.engine_id() == absl::StrCat("s", stage_[i], ".tp", i % 2)) {
        return {e.state(), e.version()};
      }
    }
    return {v1::ENGINE_STATE_UNSPECIFIED, -1};
  }

  std::string dir_;
  synthetic::ModelConfig model_;
  std::vector<std::unique_ptr<Coordinator>> cores_;
  std::vector<std::unique_ptr<Server>> servers_;
  std::vector<std::unique_ptr<HostArena>> arenas_;
  std::vector<std::unique_ptr<EngineClient>> engines_;
  std::vector<int> stage_;
  std::unique_ptr<MultiTrainer> trainer_;
  synthetic::CheckpointData data_;
  std::string refuse_;
};

TEST_F(MultiTrainerTest, EachDaemonGetsItsStageAndEveryVersionLands) {
  auto ranks = trainer_->RankLayout(v1::BACKEND_NCCL);
  ASSERT_TRUE(ranks.ok());
  EXPECT_EQ(ranks->world_size, 4);
  EXPECT_EQ(ranks->rank_offsets, std::vector<int>({1, 2, 3}));
  Manifest full;
  for (const HostTensor& t : Tensors(1)) *full.Add() = t.spec;
  const int64_t full_bytes = PlanChunks(full, 4096)->total_bytes;
  for (int64_t v = 1; v <= 3; ++v) {
    std::vector<HostTensor> t = Tensors(v);
    auto done = trainer_->Update(Request(v), t);
    ASSERT_TRUE(done.ok()) << done.status();
    ASSERT_EQ(done->size(), kDaemons);
    int64_t sum = 0;
    for (const v1::StartWeightUpdateResponse& s : trainer_->last_starts()) {
      EXPECT_TRUE(s.stream_omits_unused());
      EXPECT_GT(s.unused_tensors_size(), 0);
      EXPECT_LT(s.total_bytes(), full_bytes);
      sum += s.total_bytes();
    }
    EXPECT_LE(sum, full_bytes);
    for (int i = 0; i < 2 * kDaemons; ++i) {
      EXPECT_TRUE(Installed(i)) << "engine " << i << " v" << v;
      EXPECT_EQ(StateOf(i), std::make_pair(v1::ENGINE_READY, v));
    }
  }
  // A tensor no daemon uses: refused before any engine paused.
  std::vector<HostTensor> t = Tensors(4);
  static const float kOnes[4] = {1, 1, 1, 1};
  HostTensor extra{synthetic::Checkpoint(model_, v1::FLOAT32).back(), kOnes};
  extra.spec.set_name("model.layers.7.nowhere");
  extra.spec.clear_shape();
  extra.spec.add_shape(4);
  t.push_back(extra);
  auto refused = trainer_->Update(Request(4), t);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(refused.status().message(),
              HasSubstr("'model.layers.7.nowhere' are not a parameter"));
  for (int i = 0; i < 2 * kDaemons; ++i) {
    EXPECT_EQ(StateOf(i), std::make_pair(v1::ENGINE_READY, int64_t{3}));
    auto st = trainer_->daemon(stage_[i]).GetStatus();
    EXPECT_EQ(st->update().update_id(), "u3");  // u4 was never opened
  }
}

TEST_F(MultiTrainerTest, ADaemonGoneInPrepareAbortsEverywhere) {
  trainer_->on_phase = [this](absl::string_view phase) {
    if (phase == "pushed") {
      servers_[2]->Shutdown(absl::ZeroDuration());
      servers_[2].reset();
    }
  };
  std::vector<HostTensor> t = Tensors(1);
  auto done = trainer_->Update(Request(1), t);
  ASSERT_FALSE(done.ok());
  EXPECT_THAT(done.status().message(), HasSubstr("daemon 2"));
  EXPECT_THAT(done.status().message(), HasSubstr("committed nowhere"));
  for (int i = 0; i < 4; ++i) {  // daemons 0 and 1: written, not committed
    EXPECT_EQ(StateOf(i), std::make_pair(v1::ENGINE_DIRTY, int64_t{0}));
  }
}

TEST_F(MultiTrainerTest, AnEngineRefusingTheStagedCommitAbortsEverywhere) {
  refuse_ = "s1.tp0";
  std::vector<HostTensor> t = Tensors(1);
  v1::StartWeightUpdateRequest r = Request(1);
  r.set_mode(v1::UPDATE_MODE_STAGED);
  auto done = trainer_->Update(r, t);
  ASSERT_FALSE(done.ok());
  EXPECT_THAT(done.status().message(), HasSubstr("daemon 1"));
  EXPECT_THAT(done.status().message(), HasSubstr("s1.tp0 refuses to pause"));
  for (int i = 0; i < 2 * kDaemons; ++i) {
    // Staged: daemon 1 never wrote (READY, old); the others did (DIRTY).
    EXPECT_EQ(StateOf(i), std::make_pair(stage_[i] == 1 ? v1::ENGINE_READY
                                                        : v1::ENGINE_DIRTY,
                                         int64_t{0}))
        << "engine " << i;
  }
  refuse_.clear();
  t = Tensors(2);
  auto repaired = trainer_->Update(Request(2), t);
  ASSERT_TRUE(repaired.ok()) << repaired.status();
  for (int i = 0; i < 2 * kDaemons; ++i) {
    EXPECT_EQ(StateOf(i), std::make_pair(v1::ENGINE_READY, int64_t{2}));
    EXPECT_TRUE(Installed(i));
  }
}

}  // namespace
}  // namespace weightsync

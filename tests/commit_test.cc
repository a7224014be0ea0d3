// Issue 20 on one daemon, in process: what each daemon of several does.
// Start with skip_unused (tensors no engine uses are left out of its
// stream and listed), plan_only (nothing opened, nothing paused), and the
// two halves of Finish: a prepared update holds its engines paused at
// their old version until CommitWeightUpdate; ended any other way (Abort,
// a new Start, the idle deadline) it leaves them DIRTY and paused, and the
// next dense update repairs them. The multi-daemon proof with separate
// processes is tests/multi_daemon_test.py.
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/daemon_fixture.h"

namespace weightsync {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

class CommitTest : public testing::DaemonTest {
 protected:
  // Starts update `version` of the whole model (plus `extra`, a tensor no
  // engine uses, when set) with skip_unused, pushes what the daemon asked
  // for and prepares it.
  v1::PrepareWeightUpdateResponse Prepared(int64_t version, bool extra = false,
                                           bool staged = false) {
    std::vector<HostTensor> t = Tensors(version);
    v1::StartWeightUpdateRequest r = StartRequest(version, t);
    r.set_skip_unused(true);
    if (staged) r.set_mode(v1::UPDATE_MODE_STAGED);
    if (extra) {
      v1::TensorSpec* s = r.add_tensors();
      s->set_name("not.in.any.engine");
      s->set_dtype(v1::FLOAT32);
      s->add_shape(4);
    }
    auto started = trainer_->StartWeightUpdate(r);
    EXPECT_TRUE(started.ok()) << started.status();
    if (extra) {
      EXPECT_THAT(started->unused_tensors(), ElementsAre("not.in.any.engine"));
      EXPECT_TRUE(started->stream_omits_unused());
    }
    // The stream of the used tensors only (the extra one is last).
    EXPECT_TRUE(
        trainer_->PushTensors(r.update_id(), t, started->chunk_bytes()).ok());
    auto prepared = trainer_->PrepareWeightUpdate(r.update_id());
    EXPECT_TRUE(prepared.ok()) << prepared.status();
    return prepared.ok() ? *prepared : v1::PrepareWeightUpdateResponse();
  }

  std::string Phase() {
    auto st = trainer_->GetStatus();
    return st.ok() ? st->update().phase() : "?";
  }
};

TEST_F(CommitTest, GetWorldSizeAnswersForABackendBeforeInit) {
  EXPECT_EQ(*trainer_->GetWorldSize(), 0);
  EXPECT_EQ(*trainer_->GetWorldSize(v1::BACKEND_HOST), 1);
  Init();
  EXPECT_EQ(*trainer_->GetWorldSize(), 1);
}

TEST_F(CommitTest,
       UnusedTensorsAreRefusedUnlessSkippedAndPlanOnlyOpensNothing) {
  AddEngine("e0");
  Init();
  std::vector<HostTensor> t = Tensors(1);
  v1::StartWeightUpdateRequest r = StartRequest(1, t);
  v1::TensorSpec* s = r.add_tensors();
  s->set_name("not.in.any.engine");
  s->set_dtype(v1::FLOAT32);
  s->add_shape(4);
  // One daemon, as before: refused, naming the tensor, nothing paused.
  auto refused = trainer_->StartWeightUpdate(r);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(refused.status().message(),
              HasSubstr("tensor 'not.in.any.engine' is not a parameter or "
                        "segment source of any engine in the update (e0)"));
  r.set_skip_unused(true);
  r.set_plan_only(true);
  auto planned = trainer_->StartWeightUpdate(r);
  ASSERT_TRUE(planned.ok()) << planned.status();
  EXPECT_THAT(planned->unused_tensors(), ElementsAre("not.in.any.engine"));
  EXPECT_TRUE(planned->stream_omits_unused());
  Manifest used;
  for (const HostTensor& h : t) *used.Add() = h.spec;
  EXPECT_EQ(planned->total_bytes(), PlanChunks(used, 4096)->total_bytes);
  EXPECT_EQ(StatusOf("e0").state(), v1::ENGINE_READY);  // never paused
  EXPECT_FALSE(trainer_->GetStatus()->has_update());    // nothing opened
  r.set_finish(true);
  EXPECT_EQ(trainer_->StartWeightUpdate(r).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(CommitTest, PreparedHoldsTheEnginesUntilTheCommit) {
  AddEngine("e0");
  AddEngine("tp0", true, 0);
  Init();
  const v1::PrepareWeightUpdateResponse prepared = Prepared(1, true);
  ASSERT_EQ(prepared.engines_size(), 2);
  for (const v1::EngineResult& e : prepared.engines()) {
    EXPECT_EQ(e.version(), 0) << e.engine_id();  // not committed yet
    EXPECT_EQ(e.state(), v1::ENGINE_UPDATING) << e.engine_id();
    EXPECT_TRUE(e.has_receipt()) << e.engine_id();
  }
  EXPECT_EQ(Phase(), "prepared");
  // Every byte is in place: the engines hold version 1, paused.
  ExpectInstalled(0);
  ExpectInstalled(1);
  // A repeated Prepare answers the same; Resume can't cut in.
  auto again = trainer_->PrepareWeightUpdate("u1");
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->engines(0).receipt().checksum(),
            prepared.engines(0).receipt().checksum());
  v1::ResumeRequest resume;
  resume.set_allow_dirty(true);
  EXPECT_EQ(trainer_->Resume(resume).status().code(),
            absl::StatusCode::kFailedPrecondition);
  auto committed = trainer_->CommitWeightUpdate("u1");
  ASSERT_TRUE(committed.ok()) << committed.status();
  EXPECT_EQ(committed->version(), 1);
  EXPECT_EQ(committed->engines(0).receipt().checksum(),
            prepared.engines(0).receipt().checksum());
  EXPECT_EQ(StatusOf("e0").state(), v1::ENGINE_READY);
  EXPECT_EQ(StatusOf("tp0").version(), 1);
  EXPECT_EQ(Phase(), "committed");
  auto twice = trainer_->CommitWeightUpdate("u1");
  EXPECT_EQ(twice.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(twice.status().message(), HasSubstr("already committed"));
}

TEST_F(CommitTest, CommitNeedsAPreparedUpdate) {
  AddEngine("e0");
  Init();
  std::vector<HostTensor> t = Tensors(1);
  v1::StartWeightUpdateRequest r = StartRequest(1, t);
  ASSERT_TRUE(trainer_->StartWeightUpdate(r).ok());
  auto early = trainer_->CommitWeightUpdate("u1");
  EXPECT_EQ(early.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(early.status().message(), HasSubstr("not prepared"));
  EXPECT_EQ(trainer_->CommitWeightUpdate("nope").status().code(),
            absl::StatusCode::kFailedPrecondition);
  // Finish of a prepared update commits it.
  ASSERT_TRUE(trainer_->PushTensors("u1", t, 4096).ok());
  ASSERT_TRUE(trainer_->PrepareWeightUpdate("u1").ok());
  auto finished = trainer_->FinishWeightUpdate("u1");
  ASSERT_TRUE(finished.ok()) << finished.status();
  EXPECT_EQ(StatusOf("e0").version(), 1);
  ExpectInstalled(0);
}

// The trainer aborts a prepared update (another daemon failed to prepare):
// its bytes are in engine memory, so the engines are DIRTY and stay
// paused; the next dense update repairs and resumes them.
TEST_F(CommitTest, AbortAfterPrepareLeavesEnginesDirtyUntilTheNextUpdate) {
  AddEngine("e0");
  Init();
  Prepared(1);
  ASSERT_TRUE(trainer_->AbortWeightUpdate("u1", "daemon b failed").ok());
  v1::EngineStatus e = StatusOf("e0");
  EXPECT_EQ(e.state(), v1::ENGINE_DIRTY);
  EXPECT_EQ(e.version(), 0);
  std::vector<HostTensor> t = Tensors(2);
  auto done = trainer_->Update(StartRequest(2, t), t);
  ASSERT_TRUE(done.ok()) << done.status();
  EXPECT_EQ(StatusOf("e0").state(), v1::ENGINE_READY);
  ExpectInstalled(0);
}

// A trainer that died between prepare and commit: a new Start ends the
// prepared update (engines DIRTY, paused) and repairs them.
TEST_F(CommitTest, ANewStartEndsAPreparedUpdateAndRepairsItsEngines) {
  AddEngine("e0");
  Init();
  Prepared(1);
  std::vector<HostTensor> t = Tensors(2);
  v1::StartWeightUpdateRequest r = StartRequest(2, t);
  ASSERT_TRUE(trainer_->StartWeightUpdate(r).ok());
  auto st = trainer_->GetStatus();
  EXPECT_EQ(st->engines(0).state(), v1::ENGINE_DIRTY);
  ASSERT_TRUE(trainer_->PushTensors("u2", t, 4096).ok());
  ASSERT_TRUE(trainer_->FinishWeightUpdate("u2").ok());
  EXPECT_EQ(StatusOf("e0").state(), v1::ENGINE_READY);
  EXPECT_EQ(StatusOf("e0").version(), 2);
  EXPECT_EQ(trainer_->CommitWeightUpdate("u1").status().code(),
            absl::StatusCode::kFailedPrecondition);
}

// No commit and no word from the trainer: the idle deadline ends it. The
// engines stay paused and DIRTY (the trainer may have committed others).
TEST_F(CommitTest, APreparedUpdateLeftAloneEndsDirtyAtTheIdleDeadline) {
  core_options_.update_idle_timeout = absl::Milliseconds(300);
  RestartCore();
  AddEngine("e0");
  Init();
  Prepared(1);
  for (int i = 0; i < 100 && Phase() == "prepared"; ++i) {
    absl::SleepFor(absl::Milliseconds(50));
  }
  auto st = trainer_->GetStatus();
  EXPECT_EQ(st->update().phase(), "failed");
  EXPECT_THAT(st->update().error(), HasSubstr("prepared but not committed"));
  EXPECT_EQ(st->engines(0).state(), v1::ENGINE_DIRTY);
  EXPECT_EQ(st->engines(0).version(), 0);
  // Still paused, still dirty, well after the pause lease would have ended.
  absl::SleepFor(absl::Milliseconds(600));
  EXPECT_EQ(StatusOf("e0").state(), v1::ENGINE_DIRTY);
}

// Staged: prepare pauses the engines and copies staging into them (so the
// receipts can be read); the commit only bumps and resumes.
TEST_F(CommitTest, AStagedUpdateIsCopiedAtPrepare) {
  AddEngine("e0");
  Init();
  const v1::PrepareWeightUpdateResponse prepared = Prepared(1, false, true);
  EXPECT_TRUE(prepared.engines(0).has_receipt());
  ExpectInstalled(0);
  EXPECT_EQ(StatusOf("e0").state(), v1::ENGINE_UPDATING);
  ASSERT_TRUE(trainer_->CommitWeightUpdate("u1").ok());
  EXPECT_EQ(StatusOf("e0").state(), v1::ENGINE_READY);
}

// A daemon whose engines use none of an update's tensors (another stage's
// layers) is sent no byte, and moves to the version with the others.
TEST_F(CommitTest, ADaemonUsingNothingIsSentNothingAndCommitsTheVersion) {
  AddEngine("e0");
  Init();
  v1::StartWeightUpdateRequest r;
  r.set_update_id("u1");
  r.set_target_version(1);
  r.set_chunk_bytes(4096);
  r.set_skip_unused(true);
  v1::TensorSpec* s = r.add_tensors();
  s->set_name("another.stage.weight");
  s->set_dtype(v1::FLOAT32);
  s->add_shape(8);
  auto started = trainer_->StartWeightUpdate(r);
  ASSERT_TRUE(started.ok()) << started.status();
  EXPECT_EQ(started->num_chunks(), 0);
  EXPECT_EQ(started->total_bytes(), 0);
  ASSERT_TRUE(trainer_->PrepareWeightUpdate("u1").ok());
  auto committed = trainer_->CommitWeightUpdate("u1");
  ASSERT_TRUE(committed.ok()) << committed.status();
  EXPECT_EQ(StatusOf("e0").version(), 1);
  EXPECT_EQ(StatusOf("e0").state(), v1::ENGINE_READY);
}

}  // namespace
}  // namespace weightsync

// Issue 36: a trainer that dies is noticed in a second. A real daemon (in
// process, over a Unix socket) serves the host backend and a fake NCCL data
// plane whose bytes never arrive by themselves, as a dead trainer's NCCL
// broadcasts never do; a trainer process (tests/liveness_trainer.cc, the
// C++ TrainerClient, which holds its group without being asked) reaches a
// phase and is SIGKILLed: its update is failed and ended, and the engines
// it paused resumed, within 1 s, with --update_idle_timeout_ms at its 5 min
// default; the next trainer's update commits. A SIGSTOPped trainer is
// alive to the kernel: it still ends at the idle timeout. Also the explicit
// takeover of an update nobody holds, and never of a held one. About 6 s.
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>

#include "absl/synchronization/mutex.h"
#include "gmock/gmock.h"
#include "tests/testing/daemon_fixture.h"

extern char** environ;

namespace weightsync::testing {
namespace {

using ::testing::HasSubstr;

// Whether the fake NCCL plane's bytes arrive (the next, live trainer's) or
// never do (a dead trainer's).
absl::Mutex arrive_mu;
bool bytes_arrive ABSL_GUARDED_BY(arrive_mu) = false;

// The NCCL backend as the core sees it, without a GPU: bytes arrive by
// themselves (ReceivesOwnBytes) once Drain is called if bytes_arrive,
// else never; Drain waits until then, Cancel or its deadline.
class FakeNcclPlane : public DataPlane {
 public:
  absl::Status Begin(std::shared_ptr<const CopyPlan>,
                     const v1::StartWeightUpdateRequest&) override {
    absl::MutexLock lock(&mu_);
    cancelled_ = false;
    return absl::OkStatus();
  }
  absl::Status SubmitChunk(int64_t, std::string, absl::Time) override {
    return absl::UnimplementedError("bytes arrive by NCCL");
  }
  absl::Status Drain(absl::Time deadline) override {
    {
      absl::MutexLock lock(&arrive_mu);
      if (bytes_arrive) return absl::OkStatus();
    }
    absl::MutexLock lock(&mu_);
    auto cancelled = [this]()
                         ABSL_SHARED_LOCKS_REQUIRED(mu_) { return cancelled_; };
    if (mu_.AwaitWithDeadline(absl::Condition(&cancelled), deadline)) {
      return absl::AbortedError("fake NCCL: communicator aborted");
    }
    return absl::DeadlineExceededError("fake NCCL: no bytes");
  }
  void Abort() override { Cancel(); }
  void Cancel() override {
    absl::MutexLock lock(&mu_);
    cancelled_ = true;
  }
  void MarkEngineLost(int) override {}
  int64_t chunks_written() const override { return 0; }
  bool ReceivesOwnBytes() const override { return true; }
  std::string name() const override { return "nccl"; }

 private:
  absl::Mutex mu_;
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
};

// The host backend as built, and FakeNcclPlane for BACKEND_NCCL.
class Planes : public DataPlaneFactory {
 public:
  explicit Planes(std::shared_ptr<DataPlaneFactory> host)
      : host_(std::move(host)) {}
  absl::StatusOr<std::shared_ptr<DataPlane>> Create(
      const v1::InitWeightTransferRequest& request) override {
    if (request.backend() == v1::BACKEND_NCCL) {
      return std::shared_ptr<DataPlane>(std::make_shared<FakeNcclPlane>());
    }
    return host_->Create(request);
  }
  int LocalWorldSize(v1::Backend backend) const override { return 1; }

 private:
  std::shared_ptr<DataPlaneFactory> host_;
};

std::string TrainerBinary() {
  const char* srcdir = std::getenv("TEST_SRCDIR");
  const char* ws = std::getenv("TEST_WORKSPACE");
  return absl::StrCat(srcdir != nullptr ? srcdir : ".", "/",
                      ws != nullptr ? ws : "weightsync",
                      "/tests/liveness_trainer");
}

class LivenessTest : public DaemonTest {
 protected:
  void SetUp() override {
    DaemonTest::SetUp();
    absl::MutexLock lock(&arrive_mu);
    bytes_arrive = false;
  }
  void TearDown() override {
    if (child_ > 0) {
      kill(child_, SIGKILL);
      waitpid(child_, nullptr, 0);
    }
    if (out_ != nullptr) fclose(out_);
    DaemonTest::TearDown();
  }
  std::shared_ptr<DataPlaneFactory> DataPlanes(
      const HostDataPlane::Options& host) override {
    return std::make_shared<Planes>(MakeDataPlaneFactory(host));
  }

  // Starts the trainer process at `phase` and waits for its "ready".
  void SpawnTrainer(const std::string& backend, const std::string& phase) {
    int fds[2];
    ASSERT_EQ(pipe(fds), 0);
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_adddup2(&actions, fds[1], 1);
    posix_spawn_file_actions_addclose(&actions, fds[0]);
    const std::string bin = TrainerBinary();
    std::string a1 = options_.target, a2 = backend, a3 = phase;
    char* argv[] = {const_cast<char*>(bin.c_str()), a1.data(), a2.data(),
                    a3.data(), nullptr};
    ASSERT_EQ(
        posix_spawn(&child_, bin.c_str(), &actions, nullptr, argv, environ), 0)
        << bin;
    posix_spawn_file_actions_destroy(&actions);
    close(fds[1]);
    out_ = fdopen(fds[0], "r");
    char line[512] = {0};
    ASSERT_NE(fgets(line, sizeof(line), out_), nullptr) << "trainer exited";
    ASSERT_EQ(std::string(line), "ready\n") << line;
  }

  // Seconds until no update is in progress and no engine is paused or
  // updating (DIRTY engines stay paused), or -1 past `limit`.
  double SecondsUntilSettled(absl::Time t0, absl::Duration limit) {
    while (absl::Now() - t0 < limit) {
      const v1::GetStatusResponse st = core_->GetStatus();
      bool busy = st.update().phase() == "receiving" ||
                  st.update().phase() == "prepared";
      for (const auto& e : st.engines()) {
        busy = busy || e.state() == v1::ENGINE_PAUSED ||
               e.state() == v1::ENGINE_UPDATING;
      }
      if (!busy) return absl::ToDoubleSeconds(absl::Now() - t0);
      absl::SleepFor(absl::Milliseconds(5));
    }
    return -1;
  }

  // SIGKILLs the trainer; how long the daemon took to settle.
  double Kill(absl::Duration limit = absl::Seconds(5)) {
    const absl::Time t0 = absl::Now();
    kill(child_, SIGKILL);
    waitpid(child_, nullptr, 0);
    child_ = -1;
    const double s = SecondsUntilSettled(t0, limit);
    std::printf("trainer killed: the daemon settled in %.3f s\n", s);
    return s;
  }

  // SIGKILLs the trainer of update "dying": within 1 s the update is
  // failed, its error saying `why`.
  void KillFailsTheUpdate(const std::string& why) {
    const double s = Kill();
    EXPECT_GE(s, 0) << "not settled within 5 s";
    EXPECT_LT(s, 1.0);
    const v1::GetStatusResponse st = core_->GetStatus();
    EXPECT_EQ(st.update().update_id(), "dying");
    EXPECT_EQ(st.update().phase(), "failed");
    EXPECT_THAT(st.update().error(), HasSubstr(why));
  }

  // The next trainer (this process's TrainerClient): a whole update of
  // version `version` on `backend` commits.
  void NextTrainerCommits(v1::Backend backend, int64_t version) {
    {
      absl::MutexLock lock(&arrive_mu);
      bytes_arrive = true;
    }
    v1::InitWeightTransferRequest init;
    init.set_backend(backend);
    if (backend == v1::BACKEND_NCCL) {
      init.set_world_size(2);
      init.set_rank_offset(1);
      init.set_nccl_unique_id(std::string(128, '\0'));
    }
    ASSERT_TRUE(trainer_->InitWeightTransfer(init).ok());
    const std::vector<HostTensor> t = Tensors(version);
    v1::StartWeightUpdateRequest start = StartRequest(version, t);
    // The fake plane has no device memory to read receipts from.
    if (backend == v1::BACKEND_NCCL) start.set_verify(v1::VERIFY_OFF);
    auto started = trainer_->StartWeightUpdate(start);
    ASSERT_TRUE(started.ok()) << started.status();
    if (backend == v1::BACKEND_HOST) {
      ASSERT_TRUE(trainer_->PushTensors(started->update_id(), t, 4096).ok());
    }
    auto done = trainer_->FinishWeightUpdate(started->update_id());
    ASSERT_TRUE(done.ok()) << done.status();
    EXPECT_EQ(StatusOf("a").state(), v1::ENGINE_READY);
    EXPECT_EQ(StatusOf("a").version(), version);
  }

  // Engine "a" paused by a trainer process that formed no group, the idle
  // deadline 5 min (only the trainer's hold can end the pause sooner);
  // another_holds: this process holds a group of its own first.
  void PauseByGrouplessTrainer(bool another_holds) {
    core_options_.update_idle_timeout = absl::Minutes(5);
    RestartCore();
    AddEngine("a");
    if (another_holds) {
      v1::InitWeightTransferRequest init;
      init.set_backend(v1::BACKEND_HOST);
      ASSERT_TRUE(trainer_->InitWeightTransfer(init).ok());
    }
    SpawnTrainer("host", "pause_nogroup");
    ASSERT_EQ(StatusOf("a").state(), v1::ENGINE_PAUSED);
  }

  pid_t child_ = -1;
  FILE* out_ = nullptr;
};

TEST_F(LivenessTest, NcclTrainerKilledAfterStartFailsTheUpdateInASecond) {
  AddEngine("a");
  SpawnTrainer("nccl", "start");
  ASSERT_EQ(StatusOf("a").state(), v1::ENGINE_UPDATING);
  KillFailsTheUpdate("is gone");
  // NCCL bytes may have landed from Start on: the engine is DIRTY.
  EXPECT_EQ(StatusOf("a").state(), v1::ENGINE_DIRTY);
  NextTrainerCommits(v1::BACKEND_NCCL, 7);
}

TEST_F(LivenessTest, NcclTrainerKilledInFinishWakesTheWait) {
  AddEngine("a");
  SpawnTrainer("nccl", "finish");
  absl::SleepFor(absl::Milliseconds(200));  // Finish waits in Drain
  const double s = Kill();
  EXPECT_GE(s, 0) << "not settled within 5 s";
  EXPECT_LT(s, 1.0);
  EXPECT_EQ(StatusOf("a").state(), v1::ENGINE_DIRTY);
  NextTrainerCommits(v1::BACKEND_NCCL, 7);
}

// A trainer that dies between prepare and commit: its update ends at once
// by the prepared update's rule (several daemons: it may have committed
// others), said as such: engines paused and DIRTY, the commit refused, the
// next update repairs them (docs/protocol.md, "Trainer liveness" 2).
TEST_F(LivenessTest, TrainerKilledAfterPrepareEndsItPreparedAndDirty) {
  AddEngine("a");
  {
    absl::MutexLock lock(&arrive_mu);
    bytes_arrive = true;  // its bytes land: Prepare returns
  }
  SpawnTrainer("nccl", "prepared");
  ASSERT_EQ(core_->GetStatus().update().phase(), "prepared");
  KillFailsTheUpdate("is gone (its Liveness stream ended");
  EXPECT_THAT(core_->GetStatus().update().error(),
              HasSubstr("prepared, never committed: its engines stay paused "
                        "and DIRTY"));
  EXPECT_EQ(StatusOf("a").state(), v1::ENGINE_DIRTY);
  v1::CommitWeightUpdateRequest commit;
  commit.set_update_id("dying");
  EXPECT_EQ(core_->CommitWeightUpdate(commit).status().code(),
            absl::StatusCode::kFailedPrecondition);
  NextTrainerCommits(v1::BACKEND_NCCL, 7);
}

TEST_F(LivenessTest, TrainerKilledAfterPauseResumesItsEngines) {
  AddEngine("a");
  SpawnTrainer("nccl", "pause");
  ASSERT_EQ(StatusOf("a").state(), v1::ENGINE_PAUSED);
  const double s = Kill();
  EXPECT_GE(s, 0) << "still paused after 5 s";
  EXPECT_LT(s, 1.0);
  EXPECT_EQ(StatusOf("a").state(), v1::ENGINE_READY);
}

// A trainer that pauses engines without forming a group holds its pauses
// (an empty group id): killed, its pauses end within a second, not at the
// idle deadline (here 5 min); alive but gone quiet, they still last.
TEST_F(LivenessTest, GrouplessTrainerKilledAfterPauseResumesItsEngines) {
  ASSERT_NO_FATAL_FAILURE(PauseByGrouplessTrainer(/*another_holds=*/false));
  absl::SleepFor(absl::Milliseconds(300));  // a live holder: still paused
  EXPECT_EQ(StatusOf("a").state(), v1::ENGINE_PAUSED);
  const double s = Kill();
  EXPECT_GE(s, 0) << "still paused after 5 s";
  EXPECT_LT(s, 1.0);
  EXPECT_EQ(StatusOf("a").state(), v1::ENGINE_READY);
}

// While another trainer holds its group, a group-less trainer's death
// resumes nothing: pauses are not attributed to trainers, and the living
// one may have made them (the idle deadline still ends an orphaned one).
TEST_F(LivenessTest, GrouplessTrainerGoneResumesNothingWhileAnotherHolds) {
  ASSERT_NO_FATAL_FAILURE(PauseByGrouplessTrainer(/*another_holds=*/true));
  EXPECT_EQ(Kill(absl::Seconds(1.5)), -1);  // the engine stays paused
  EXPECT_EQ(StatusOf("a").state(), v1::ENGINE_PAUSED);
}

TEST_F(LivenessTest, FrozenTrainerStillEndsAtTheIdleTimeout) {
  core_options_.update_idle_timeout = absl::Milliseconds(2000);
  RestartCore();
  AddEngine("a");
  // The update starts between `before` and `t0` (the trainer's "ready"
  // may reach a loaded machine's test late): the bounds hold either way.
  const absl::Time before = absl::Now();
  SpawnTrainer("nccl", "start");
  const absl::Time t0 = absl::Now();
  kill(child_, SIGSTOP);
  // Alive to the kernel (its socket open): nothing before the timeout.
  absl::SleepFor(absl::Milliseconds(800));
  EXPECT_EQ(core_->GetStatus().update().phase(), "receiving");
  const double s = SecondsUntilSettled(t0, absl::Seconds(10));
  EXPECT_GE(s, 0) << "not ended within 10 s";
  EXPECT_GE(s + absl::ToDoubleSeconds(t0 - before), 2.0);
  EXPECT_LT(s, 4.0);
  EXPECT_THAT(core_->GetStatus().update().error(), HasSubstr("abandoned"));
  kill(child_, SIGCONT);
}

TEST_F(LivenessTest, HostTrainerKilledBeforeAndDuringItsChunks) {
  AddEngine("a");
  SpawnTrainer("host", "start");  // no stream open: only its hold tells
  double s = Kill();
  EXPECT_GE(s, 0);
  EXPECT_LT(s, 1.0);
  EXPECT_EQ(StatusOf("a").state(), v1::ENGINE_READY);  // nothing written
  SpawnTrainer("host", "mid");
  // Its first chunk was written to the wire, not yet read: kill it only
  // once the daemon has taken it (the engine then holds a part).
  const absl::Time t0 = absl::Now();
  while (core_->GetStatus().update().received_chunks() < 1 &&
         absl::Now() - t0 < absl::Seconds(5)) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  ASSERT_EQ(core_->GetStatus().update().received_chunks(), 1);
  s = Kill();
  EXPECT_GE(s, 0);
  EXPECT_LT(s, 1.0);  // ended, not left for the failed update's 2 s grace
  EXPECT_EQ(StatusOf("a").state(), v1::ENGINE_DIRTY);
  NextTrainerCommits(v1::BACKEND_HOST, 7);
}

TEST_F(LivenessTest, TakeOverEndsOnlyAnUpdateNobodyHolds) {
  AddEngine("a");
  // A trainer that holds nothing (raw calls, as a client older than
  // Liveness makes them) starts an update and goes quiet.
  auto raw_init = [&](const std::string& take_over) {
    grpc::ClientContext ctx;
    v1::InitWeightTransferRequest init;
    init.set_backend(v1::BACKEND_HOST);
    init.set_take_over_update_id(take_over);
    v1::InitWeightTransferResponse r;
    return trainer_->stub()->InitWeightTransfer(&ctx, init, &r);
  };
  ASSERT_TRUE(raw_init("").ok());
  const std::vector<HostTensor> t = Tensors(3);
  ASSERT_TRUE(trainer_->StartWeightUpdate(StartRequest(3, t)).ok());
  grpc::Status refused = raw_init("");
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(refused.error_message(), HasSubstr("in progress"));
  // A restarted trainer names it: ended at once, the group formed.
  ASSERT_TRUE(raw_init("u3").ok());
  EXPECT_EQ(core_->GetStatus().update().phase(), "failed");
  EXPECT_THAT(core_->GetStatus().update().error(), HasSubstr("taken over"));

  // A held update (a trainer process alive) is never taken over.
  SpawnTrainer("host", "start");
  refused = raw_init("dying");
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(refused.error_message(), HasSubstr("live trainer"));
  v1::StartWeightUpdateRequest start = StartRequest(4, t);
  start.set_take_over_update_id("dying");
  auto started = trainer_->StartWeightUpdate(start);
  EXPECT_EQ(started.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(core_->GetStatus().update().phase(), "receiving");
}

TEST_F(LivenessTest, HoldNamesTheGroupFormedNow) {
  Init();  // this client holds the group
  EXPECT_TRUE(trainer_->liveness_status().ok()) << trainer_->liveness_status();
  grpc::ClientContext ctx;
  auto stream = trainer_->stub()->Liveness(&ctx);
  v1::LivenessRequest r;
  r.set_group_id("not-the-group");
  stream->Write(r);
  stream->WritesDone();
  v1::LivenessResponse response;
  EXPECT_FALSE(stream->Read(&response));
  const grpc::Status s = stream->Finish();
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(s.error_message(), HasSubstr("not the transfer group"));
}

}  // namespace
}  // namespace weightsync::testing

// Issue 30 for the C++ clients (docs/integration.md, "C++ clients: restarts
// and errors"): unary calls retried across a daemon restart within a
// bounded window (idempotent ones always, the others only when the request
// never left), an engine that leaves cleanly by unregistering, and gRPC's
// own failures and the daemon's wire-level refusals in the user's terms.
// Against the real daemon in-process (tests/testing/daemon_fixture.h).
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <string>
#include <thread>

#include "absl/time/clock.h"
#include "client/multi_trainer.h"
#include "client/unary_call.h"
#include "gmock/gmock.h"
#include "tests/testing/daemon_fixture.h"

namespace weightsync {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

// Messages the tests below get, each quoted in docs/integration.md 2.9's
// table (DocsQuoteTheMessages).
constexpr const char* kNotReachable = "weightsyncd is not reachable at unix:/";
constexpr const char* kNotSent = "the request was not sent";
constexpr const char* kBroke = "broke during the call (a daemon restart?)";
constexpr const char* kNotResent =
    "it may have reached the daemon, so it was not resent";
constexpr const char* kNoAnswer =
    "did not answer within 30s (ClientOptions::call_timeout)";
constexpr const char* kNoGroup =
    "TrainerClient::Update: no transfer group: call "
    "TrainerClient::InitWeightTransfer before TrainerClient::Update";
constexpr const char* kNoGroupMulti = "call MultiTrainer::InitHost";
constexpr const char* kNoTensors = "TrainerClient::Update got no tensors";
constexpr const char* kNoData =
    "has no data (HostTensor::data is null); nothing was sent";

class CppClientTest : public testing::DaemonTest {
 protected:
  // Stops the daemon (its socket stays unanswered) until RestartCore.
  void StopDaemon() {
    server_->Shutdown(absl::ZeroDuration());
    server_.reset();
  }

  // Starts the daemon again after `delay` on a thread; Join() returns the
  // time it was listening again.
  void RestartAfter(absl::Duration delay) {
    restarter_ = std::thread([this, delay] {
      absl::SleepFor(delay);
      RestartCore();
      listening_ = absl::Now();
    });
  }
  absl::Time Join() {
    restarter_.join();
    return listening_;
  }

  std::thread restarter_;
  absl::Time listening_;
};

// A connected client's idempotent call made while the daemon is down is
// answered by the restarted daemon as soon as it listens (not after gRPC's
// reconnect back-off, ~1 s and growing); a non-idempotent call whose
// request never left (no connection) is resent too.
TEST_F(CppClientTest, CallsReachARestartedDaemonAsSoonAsItListens) {
  auto client = TrainerClient::Connect(options_);
  ASSERT_TRUE(client.ok()) << client.status();
  ASSERT_TRUE((*client)->GetStatus().ok());

  StopDaemon();
  RestartAfter(absl::Milliseconds(150));
  const absl::StatusOr<v1::GetStatusResponse> status = (*client)->GetStatus();
  const absl::Time answered = absl::Now();
  const absl::Time listening = Join();
  ASSERT_TRUE(status.ok()) << status.status();
  std::cerr << "GetStatus answered "
            << absl::FormatDuration(answered - listening)
            << " after the restarted daemon listened\n";
  EXPECT_LT(answered - listening, absl::Milliseconds(500));

  StopDaemon();
  RestartAfter(absl::Milliseconds(150));
  v1::InitWeightTransferRequest init;
  init.set_backend(v1::BACKEND_HOST);
  const auto group = (*client)->InitWeightTransfer(init);
  Join();
  EXPECT_TRUE(group.ok()) << group.status();
}

// The retry window bounds the wait for a daemon that does not come back,
// and the error says what happened in the user's terms.
TEST_F(CppClientTest, ADaemonThatStaysDownFailsWithinTheRetryWindow) {
  for (absl::Duration window :
       {absl::ZeroDuration(), absl::Milliseconds(400)}) {
    ClientOptions options = options_;
    options.retry_window = window;
    auto client = TrainerClient::Connect(options);
    ASSERT_TRUE(client.ok()) << client.status();
    StopDaemon();
    const absl::Time start = absl::Now();
    const auto status = (*client)->GetStatus();
    const absl::Duration took = absl::Now() - start;
    EXPECT_EQ(status.status().code(), absl::StatusCode::kUnavailable);
    EXPECT_THAT(status.status().message(),
                HasSubstr("GetStatus: weightsyncd is not reachable at " +
                          options_.target));
    EXPECT_THAT(status.status().message(), HasSubstr(kNotReachable));
    EXPECT_THAT(status.status().message(), HasSubstr(kNotSent));
    EXPECT_GE(took, window - absl::Milliseconds(100)) << window;
    EXPECT_LT(took, window + absl::Seconds(1)) << window;
    RestartCore();
  }
}

// What is retried: the rules of weightsync._retry, on gRPC's own words.
TEST(RetryRulesTest, OnlyCallsThatCannotHaveArrivedOrAreIdempotent) {
  const grpc::Status never_sent(
      grpc::StatusCode::UNAVAILABLE,
      "failed to connect to all addresses; last error: UNKNOWN: "
      "unix:/tmp/x.sock: Connection refused");
  const grpc::Status broke(grpc::StatusCode::UNAVAILABLE, "Socket closed");
  const grpc::Status late(grpc::StatusCode::DEADLINE_EXCEEDED,
                          "Deadline Exceeded");
  EXPECT_TRUE(Retryable("GetStatus", never_sent));
  EXPECT_TRUE(Retryable("GetStatus", broke));
  EXPECT_TRUE(Retryable("StartWeightUpdate", never_sent));
  EXPECT_FALSE(Retryable("StartWeightUpdate", broke));
  EXPECT_FALSE(Retryable("FinishWeightUpdate", broke));
  EXPECT_FALSE(Retryable("GetStatus", late));
  EXPECT_FALSE(Retryable("GetStatus",
                         grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                                      "failed to connect to all addresses")));

  const absl::Status mid_call =
      UserStatus("unix:/s", "StartWeightUpdate", broke, absl::Seconds(30));
  EXPECT_EQ(mid_call.code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(mid_call.message(),
              HasSubstr("StartWeightUpdate: the connection to weightsyncd at "
                        "unix:/s broke during the call"));
  EXPECT_THAT(mid_call.message(), HasSubstr("retry the whole update"));
  EXPECT_THAT(mid_call.message(), HasSubstr(kBroke));
  EXPECT_THAT(mid_call.message(), HasSubstr(kNotResent));
  const absl::Status timeout =
      UserStatus("unix:/s", "Pause", late, absl::Seconds(30));
  EXPECT_EQ(timeout.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(timeout.message(), HasSubstr(kNoAnswer));
  EXPECT_THAT(timeout.message(),
              HasSubstr("Pause: weightsyncd at unix:/s did not answer within "
                        "30s (ClientOptions::call_timeout)"));
  // The daemon's own words pass as they are.
  const grpc::Status own(grpc::StatusCode::UNAVAILABLE,
                         "daemon is shutting down");
  EXPECT_EQ(UserStatus("unix:/s", "Pause", own, absl::Seconds(1)).message(),
            "daemon is shutting down");
}

// An engine that unregisters is gone when Unregister returns, stays gone
// across a daemon restart (its notice thread does not register it again),
// and may register again; a second Unregister is a no-op.
TEST_F(CppClientTest, UnregisterLeavesAtOnceAndForGood) {
  EngineClient* engine = AddEngine("e0");
  ASSERT_EQ(trainer_->GetStatus()->engines_size(), 1);
  v1::RegisterEngineRequest again = arenas_[0]->Registration();
  again.set_engine_id("e0");
  // Its notice thread reads the registration: not while it runs.
  const auto twice = engine->Register(again);
  EXPECT_EQ(twice.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(twice.status().message(), HasSubstr("call Unregister()"));
  ASSERT_TRUE(engine->Unregister().ok());
  EXPECT_EQ(trainer_->GetStatus()->engines_size(), 0);
  EXPECT_TRUE(engine->Unregister().ok());

  RestartCore();
  absl::SleepFor(absl::Milliseconds(300));  // the old thread would be back
  EXPECT_EQ(trainer_->GetStatus()->engines_size(), 0);
  EXPECT_EQ(engine->reconnects(), 0);

  ASSERT_TRUE(engine->Register(again).ok());
  ASSERT_TRUE(engine->StartControl({}).ok());
  for (int i = 0; i < 200 && !StatusOf("e0").connected(); ++i) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_TRUE(StatusOf("e0").connected());
}

// Close (and so the destructor) unregisters first: an update in progress
// reports the engine "unregistered", not a lost control stream.
TEST_F(CppClientTest, CloseUnregistersInsteadOfDroppingTheStream) {
  AddEngine("stays");
  AddEngine("goes");
  Init();
  const std::vector<HostTensor> t = Tensors(1);
  ASSERT_TRUE(trainer_->StartWeightUpdate(StartRequest(1, t)).ok());
  engines_[1]->Close();
  EXPECT_EQ(StatusOf("goes").engine_id(), "");  // gone when Close returns
  ASSERT_TRUE(trainer_->PushTensors("u1", t, 4096).ok());
  const auto done = trainer_->FinishWeightUpdate("u1");
  ASSERT_TRUE(done.ok()) << done.status();
  bool reported = false;
  for (const v1::EngineResult& e : done->engines()) {
    if (e.engine_id() != "goes") continue;
    reported = true;
    EXPECT_TRUE(e.lost());
    EXPECT_THAT(e.message(), HasSubstr("unregistered"));
    EXPECT_THAT(e.message(), Not(HasSubstr("control stream closed")));
  }
  EXPECT_TRUE(reported);
}

// A C++ engine whose registered memory is gone (freed, reallocated) is
// noticed at the next pause through its check_memory hook: the update
// reports it lost, naming why, instead of calling it READY, writes nothing
// to it, and it stays unregistered.
TEST_F(CppClientTest, AnEngineWhoseMemoryIsGoneIsReportedLost) {
  std::atomic<bool> freed{false};
  std::atomic<int> checks{0};
  EngineHooks hooks;
  hooks.check_memory = [&]() {
    ++checks;
    // A slow check: a report sent after the pause's Ack loses the race to
    // the update's commit every time, not now and then.
    if (freed) absl::SleepFor(absl::Milliseconds(200));
    return freed ? absl::FailedPreconditionError(
                       "parameter 'embed' no longer holds its registered "
                       "memory (freed)")
                 : absl::OkStatus();
  };
  AddEngine("keeps");
  EngineClient* frees = AddEngine("frees", false, 0, hooks);
  Init();
  std::vector<HostTensor> t = Tensors(1);
  ASSERT_TRUE(trainer_->Update(StartRequest(1, t), t).ok());
  EXPECT_GE(checks.load(), 2);  // at the pause and at the resume
  EXPECT_EQ(frees->lost(), "");
  freed = true;
  const ShmRegion& region = arenas_[1]->region();  // "frees"'s memory
  const std::string before(reinterpret_cast<const char*>(region.data()),
                           region.size());
  t = Tensors(2);
  const auto done = trainer_->Update(StartRequest(2, t), t);
  ASSERT_TRUE(done.ok()) << done.status();
  // Reported at the pause, before its Ack: no byte of version 2 was
  // written to it (sent after the Ack, the report raced the update).
  EXPECT_EQ(std::memcmp(region.data(), before.data(), before.size()), 0);
  for (const v1::EngineResult& e : done->engines()) {
    EXPECT_EQ(e.lost(), e.engine_id() == "frees") << e.engine_id();
    if (e.engine_id() == "frees") {
      EXPECT_THAT(e.message(), HasSubstr("no longer holds its registered"));
    }
  }
  EXPECT_THAT(frees->lost(), HasSubstr("parameter 'embed'"));
  EXPECT_EQ(StatusOf("frees").engine_id(), "");
  EXPECT_EQ(StatusOf("keeps").version(), 2);
  ExpectInstalled(0);
}

// Mistakes in Update, refused in its own terms before anything is sent.
TEST_F(CppClientTest, UpdateMistakesAreRefusedInTheUsersTerms) {
  AddEngine("e0");
  const std::vector<HostTensor> t = Tensors(1);
  // No group: the daemon refused RegisterSource, which the user never called.
  auto no_group = trainer_->Update(StartRequest(1, t), t);
  EXPECT_EQ(no_group.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(no_group.status().message(), HasSubstr(kNoGroup));
  auto multi = MultiTrainer::Connect({options_});
  ASSERT_TRUE(multi.ok()) << multi.status();
  auto multi_no_group = (*multi)->Update(StartRequest(1, t), t);
  EXPECT_EQ(multi_no_group.status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(multi_no_group.status().message(), HasSubstr(kNoGroupMulti));

  Init();
  auto empty = trainer_->Update(StartRequest(1, {}), {});
  EXPECT_EQ(empty.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(empty.status().message(), HasSubstr(kNoTensors));
  std::vector<HostTensor> no_data = t;
  no_data[1].data = nullptr;  // once a segfault in the chunk copy
  auto null = trainer_->Update(StartRequest(1, no_data), no_data);
  EXPECT_EQ(null.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(null.status().message(),
              HasSubstr("tensor '" + t[1].spec.name() + "' " + kNoData));
  EXPECT_EQ(StatusOf("e0").version(), 0);  // nothing was sent
  EXPECT_EQ(StatusOf("e0").state(), v1::ENGINE_READY);
  ASSERT_TRUE(trainer_->Update(StartRequest(1, t), t).ok());
  ExpectInstalled(0);
}

// docs/integration.md 2.9 quotes what the tests above get.
TEST(DocsTest, DocsQuoteTheMessages) {
  const char* srcdir = std::getenv("TEST_SRCDIR");
  const char* ws = std::getenv("TEST_WORKSPACE");
  std::ifstream in(absl::StrCat(srcdir != nullptr ? srcdir : ".", "/",
                                ws != nullptr ? ws : "weightsync",
                                "/docs/integration.md"));
  const std::string doc(std::istreambuf_iterator<char>(in), {});
  const size_t at = doc.find("### 2.9 C++ clients: restarts and errors");
  ASSERT_NE(at, std::string::npos);
  const std::string section = doc.substr(at, doc.find("\n## ", at) - at);
  for (const char* message :
       {kNotReachable, kNotSent, kBroke, kNotResent, kNoAnswer, kNoGroup,
        kNoGroupMulti, kNoTensors, kNoData}) {
    EXPECT_THAT(section, HasSubstr(message));
  }
}

}  // namespace
}  // namespace weightsync

// The TCP listener's bearer-token check on its own (docs/security.md,
// "Token failures"): what a caller with the right, a wrong or no token gets,
// what is counted and logged, and when failing callers are slowed. The
// checker is driven directly, as gRPC's auth filter calls it.
#include "daemon/server/token_checker.h"

#include <atomic>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "glog/logging.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/log_lines.h"

namespace weightsync {
namespace {

using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::Not;
using ::testing::SizeIs;

// Warnings the checker logs, as lines.
using Lines = testing::LogLines;

struct Call {
  grpc::Status status;
  TokenChecker::OutputMetadata consumed;
  absl::Duration took;
};

// One call's header block: `authorization: <value>` unless `value` is null.
Call Check(TokenChecker& checker, const char* value,
           const char* key = "authorization") {
  std::string k = key, v = value == nullptr ? "" : value;
  TokenChecker::InputMetadata in;
  if (value != nullptr) in.insert({grpc::string_ref(k), grpc::string_ref(v)});
  in.insert({grpc::string_ref("user-agent"), grpc::string_ref("test")});
  Call c;
  TokenChecker::OutputMetadata response;
  const absl::Time t0 = absl::Now();
  c.status = checker.Process(in, nullptr, &c.consumed, &response);
  c.took = absl::Now() - t0;
  return c;
}

TEST(TokenCheckerTest, OnlyTheExactBearerTokenPasses) {
  TokenChecker checker("s3cret", nullptr);
  const int64_t before = AuthFailures();
  Call ok = Check(checker, "Bearer s3cret");
  ASSERT_TRUE(ok.status.ok()) << ok.status.error_message();
  // The token is consumed: the call's handlers never see it.
  ASSERT_EQ(ok.consumed.count("authorization"), 1u);
  EXPECT_EQ(ok.consumed.find("authorization")->second, "Bearer s3cret");
  EXPECT_EQ(checker.failures(), 0);

  // Every near miss: shorter, longer, one byte off at either end, the token
  // without its scheme, another scheme, an empty value, nothing at all.
  const std::vector<const char*> wrong = {"Bearer s3cre",
                                          "Bearer s3crett",
                                          "Bearer s3creT",
                                          "bearer s3cret",
                                          "s3cret",
                                          "Basic s3cret",
                                          "",
                                          "Bearer ",
                                          "Bearer s3cret ",
                                          "Bearer s3cre\xff"};
  for (const char* w : wrong) {
    Call c = Check(checker, w);
    EXPECT_EQ(c.status.error_code(), grpc::StatusCode::UNAUTHENTICATED) << w;
    EXPECT_EQ(c.status.error_message(), "wrong bearer token") << w;
    EXPECT_THAT(c.consumed, IsEmpty()) << w;
  }
  Call none = Check(checker, nullptr);
  EXPECT_EQ(none.status.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(none.status.error_message(),
            "no bearer token (authorization metadata)");
  // The right value under another key is no token either.
  Call other = Check(checker, "Bearer s3cret", "x-authorization");
  EXPECT_EQ(other.status.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(other.status.error_message(),
            "no bearer token (authorization metadata)");

  const int64_t refused = static_cast<int64_t>(wrong.size()) + 2;
  EXPECT_EQ(checker.failures(), refused);
  EXPECT_EQ(AuthFailures() - before, refused);  // what /metrics shows
  // Still the right token passes, after all that.
  EXPECT_TRUE(Check(checker, "Bearer s3cret").status.ok());
  EXPECT_EQ(checker.failures(), refused);
}

TEST(TokenCheckerTest, FailuresAreLoggedOnceInTenSecondsWithThePeers) {
  Lines lines;
  int asked = 0;
  TokenChecker checker("t", [&] {
    ++asked;
    return std::vector<std::string>{"ipv4:10.0.0.7:5555", "ipv6:[::1]:1"};
  });
  Check(checker, "Bearer nope");
  std::vector<std::string> got = lines.Take();
  ASSERT_THAT(got, SizeIs(1));
  EXPECT_THAT(got[0], HasSubstr("1 call(s) refused"));
  EXPECT_THAT(got[0], HasSubstr("(1 in all"));
  EXPECT_THAT(got[0],
              HasSubstr("latest TCP connections from ipv4:10.0.0.7:5555, "
                        "ipv6:[::1]:1"));
  // The token itself is never logged.
  EXPECT_THAT(got[0], Not(HasSubstr("nope")));
  EXPECT_EQ(asked, 1);
  // Within the 10 s, no more lines (and the peers are not asked again).
  for (int i = 0; i < 5; ++i) Check(checker, nullptr);
  EXPECT_THAT(lines.Take(), IsEmpty());
  EXPECT_EQ(asked, 1);
  // A right token is not a failure: no line.
  Check(checker, "Bearer t");
  EXPECT_THAT(lines.Take(), IsEmpty());
}

TEST(TokenCheckerTest, ALineWithoutPeersNamesNone) {
  Lines lines;
  TokenChecker checker("t", [] { return std::vector<std::string>{}; });
  Check(checker, nullptr);
  std::vector<std::string> got = lines.Take();
  ASSERT_THAT(got, SizeIs(1));
  EXPECT_THAT(got[0], Not(HasSubstr("latest TCP connections")));
}

// gRPC 1.51 asks IsBlocking once when the processor is installed (a yes
// makes its thread pool) and then once a call: the checker blocks only
// while failures come fast, from the kSlowAfter-th in a window on.
TEST(TokenCheckerTest, BlockingOnlyOnceFailuresComeFast) {
  TokenChecker checker("t", nullptr);
  EXPECT_TRUE(checker.IsBlocking());  // installed: the pool is made
  EXPECT_FALSE(checker.IsBlocking());
  for (int i = 0; i < TokenChecker::kSlowAfter - 1; ++i) {
    Check(checker, "Bearer x");
    EXPECT_FALSE(checker.IsBlocking()) << i + 1 << " failures";
  }
  // Right tokens don't count.
  for (int i = 0; i < 3; ++i) Check(checker, "Bearer t");
  EXPECT_FALSE(checker.IsBlocking());
  Check(checker, "Bearer x");
  EXPECT_TRUE(checker.IsBlocking()) << TokenChecker::kSlowAfter << " failures";
}

// The first 2 * kSlowAfter failures of a window are refused at once; past
// that each waits kFailureDelay first. A right token never waits.
TEST(TokenCheckerTest, RepeatedFailuresAreSlowedRightTokensNever) {
  TokenChecker checker("t", nullptr);
  const absl::Duration prompt = TokenChecker::kFailureDelay / 2;
  for (int i = 0; i < 2 * TokenChecker::kSlowAfter; ++i) {
    Call c = Check(checker, "Bearer x");
    EXPECT_LT(c.took, prompt) << "failure " << i + 1;
  }
  Call slowed = Check(checker, "Bearer x");
  EXPECT_EQ(slowed.status.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_GE(slowed.took, TokenChecker::kFailureDelay);
  Call right = Check(checker, "Bearer t");
  EXPECT_TRUE(right.status.ok());
  EXPECT_LT(right.took, prompt);
  EXPECT_GE(Check(checker, nullptr).took, TokenChecker::kFailureDelay);
}

// At most kMaxDelayed failing calls wait at a time: one more fails at once,
// so a flood of wrong tokens costs at most that many threads.
TEST(TokenCheckerTest, AtMostKMaxDelayedWaitAtOnce) {
  TokenChecker checker("t", nullptr);
  for (int i = 0; i < 2 * TokenChecker::kSlowAfter; ++i) {
    Check(checker, "Bearer x");
  }
  std::vector<std::thread> waiting;
  std::vector<absl::Duration> took(TokenChecker::kMaxDelayed);
  for (int i = 0; i < TokenChecker::kMaxDelayed; ++i) {
    waiting.emplace_back([&, i] { took[i] = Check(checker, "Bearer x").took; });
  }
  // They are waiting (each for kFailureDelay) when the next one comes.
  absl::SleepFor(TokenChecker::kFailureDelay / 5);
  Call past = Check(checker, "Bearer x");
  for (std::thread& t : waiting) t.join();
  for (int i = 0; i < TokenChecker::kMaxDelayed; ++i) {
    EXPECT_GE(took[i], TokenChecker::kFailureDelay) << i;
  }
  EXPECT_EQ(past.status.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_LT(past.took, TokenChecker::kFailureDelay / 2);
  // Once they are done, a failure waits again: the places were given back.
  EXPECT_GE(Check(checker, "Bearer x").took, TokenChecker::kFailureDelay);
}

// The window is 10 s: after a quiet one, failures are prompt and the
// checker is not blocking again.
TEST(TokenCheckerTest, AQuietWindowForgetsTheFailures) {
  TokenChecker checker("t", nullptr);
  checker.IsBlocking();
  for (int i = 0; i < 2 * TokenChecker::kSlowAfter; ++i) {
    Check(checker, "Bearer x");
  }
  ASSERT_TRUE(checker.IsBlocking());
  absl::SleepFor(absl::Seconds(10) + absl::Milliseconds(200));
  EXPECT_FALSE(checker.IsBlocking());
  for (int i = 0; i < TokenChecker::kSlowAfter - 1; ++i) {
    EXPECT_LT(Check(checker, "Bearer x").took, TokenChecker::kFailureDelay / 2);
  }
  EXPECT_FALSE(checker.IsBlocking());
  EXPECT_EQ(checker.failures(), 3 * TokenChecker::kSlowAfter - 1);
}

}  // namespace
}  // namespace weightsync

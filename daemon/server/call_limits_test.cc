#include "daemon/server/call_limits.h"

#include <string>
#include <utility>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace weightsync {
namespace {

using ::testing::HasSubstr;

TEST(CallLimitsTest, EachPeerHasItsOwnCapAndTheRefusalNamesTheFlag) {
  CallLimits limits({/*max_calls_per_peer=*/2,
                     /*max_control_streams_per_peer=*/1,
                     /*max_engine_reads=*/1});
  std::vector<CallLimits::Ticket> held;
  for (int i = 0; i < 2; ++i) {
    auto t = limits.Enter(CallLimits::Kind::kCall, "uid 1000");
    ASSERT_TRUE(t.ok());
    held.push_back(*std::move(t));
  }
  auto refused = limits.Enter(CallLimits::Kind::kCall, "uid 1000");
  ASSERT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(refused.status().message(), HasSubstr("--max_calls_per_peer=2"));
  EXPECT_THAT(refused.status().message(), HasSubstr("uid 1000"));
  // Another peer, and Control streams, count apart.
  EXPECT_TRUE(limits.Enter(CallLimits::Kind::kCall, "uid 1001").ok());
  auto control = limits.Enter(CallLimits::Kind::kControl, "uid 1000");
  ASSERT_TRUE(control.ok());
  auto second = limits.Enter(CallLimits::Kind::kControl, "uid 1000");
  EXPECT_THAT(second.status().message(),
              HasSubstr("--max_control_streams_per_peer=1"));
  EXPECT_EQ(limits.refused(CallLimits::Kind::kCall), 1);
  EXPECT_EQ(limits.refused(CallLimits::Kind::kControl), 1);
  // A place given back (ticket destroyed) can be taken again.
  held.pop_back();
  EXPECT_TRUE(limits.Enter(CallLimits::Kind::kCall, "uid 1000").ok());
}

TEST(CallLimitsTest, EngineReadsAreCappedForAllPeersTogether) {
  CallLimits limits({8, 8, /*max_engine_reads=*/1});
  auto first = limits.Enter(CallLimits::Kind::kEngineRead, "uid 1");
  ASSERT_TRUE(first.ok());
  auto second = limits.Enter(CallLimits::Kind::kEngineRead, "uid 2");
  ASSERT_EQ(second.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(second.status().message(), HasSubstr("--max_engine_reads=1"));
  CallLimits::Ticket moved = *std::move(first);
  { CallLimits::Ticket gone = std::move(moved); }
  EXPECT_TRUE(limits.Enter(CallLimits::Kind::kEngineRead, "uid 2").ok());
}

// All peers together hold at most --max_threads less the spare threads:
// the call past that is refused by this cap, naming the flag, whoever
// makes it; Control streams count, engine reads (always inside a call) do
// not; a place given back is free again.
TEST(CallLimitsTest, AllPeersTogetherStayUnderTheThreads) {
  CallLimitOptions o;
  o.max_threads = CallLimitOptions::kSpareThreads + 3;  // three places
  CallLimits limits(o);
  std::vector<CallLimits::Ticket> held;
  for (const auto& [kind, peer] :
       std::vector<std::pair<CallLimits::Kind, std::string>>{
           {CallLimits::Kind::kCall, "uid 1"},
           {CallLimits::Kind::kControl, "uid 2"},
           {CallLimits::Kind::kCall, "uid 3"}}) {
    auto t = limits.Enter(kind, peer);
    ASSERT_TRUE(t.ok()) << peer;
    held.push_back(*std::move(t));
  }
  for (auto kind : {CallLimits::Kind::kCall, CallLimits::Kind::kControl}) {
    auto refused = limits.Enter(kind, "uid 4");
    ASSERT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted);
    EXPECT_THAT(refused.status().message(),
                HasSubstr("the daemon runs 3 calls and Control streams for "
                          "all peers"));
    EXPECT_THAT(refused.status().message(), HasSubstr("--max_threads=11"));
  }
  EXPECT_EQ(limits.refused_all_peers(), 2);
  EXPECT_EQ(limits.refused(CallLimits::Kind::kCall), 0);
  EXPECT_TRUE(limits.Enter(CallLimits::Kind::kEngineRead, "uid 4").ok());
  held.erase(held.begin());  // uid 1's call ends
  EXPECT_TRUE(limits.Enter(CallLimits::Kind::kCall, "uid 4").ok());
  // No cap at all where the server's threads are not said (0).
  CallLimits uncapped({1, 1, 1});
  auto a = uncapped.Enter(CallLimits::Kind::kCall, "uid 1");
  auto b = uncapped.Enter(CallLimits::Kind::kCall, "uid 2");
  EXPECT_TRUE(a.ok() && b.ok());
  // The smallest cap said, --max_threads=1: still one place, never none.
  CallLimitOptions one;
  one.max_threads = 1;
  CallLimits single(one);
  auto first = single.Enter(CallLimits::Kind::kCall, "uid 1");
  ASSERT_TRUE(first.ok());
  EXPECT_EQ(single.Enter(CallLimits::Kind::kCall, "uid 2").status().code(),
            absl::StatusCode::kResourceExhausted);
}

// A peer's count goes down by one per place given back, to zero and no
// further, and a peer with nothing open is forgotten; a ticket moved onto
// itself keeps its place.
TEST(CallLimitsTest, PlacesAreCountedBackExactly) {
  CallLimits limits({/*max_calls_per_peer=*/2, 1, 1});
  auto a = limits.Enter(CallLimits::Kind::kCall, "uid 7");
  auto b = limits.Enter(CallLimits::Kind::kCall, "uid 7");
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(limits.tracked(), 1);
  *a = CallLimits::Ticket();  // one given back: one still open
  auto c = limits.Enter(CallLimits::Kind::kCall, "uid 7");
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(limits.Enter(CallLimits::Kind::kCall, "uid 7").status().code(),
            absl::StatusCode::kResourceExhausted);  // b and c: the cap
  CallLimits::Ticket& self = *c;
  *c = std::move(self);  // a self-move keeps the place
  EXPECT_EQ(limits.Enter(CallLimits::Kind::kCall, "uid 7").status().code(),
            absl::StatusCode::kResourceExhausted);
  *b = CallLimits::Ticket();
  *c = CallLimits::Ticket();
  EXPECT_EQ(limits.tracked(), 0);  // nothing open: forgotten
  auto d = limits.Enter(CallLimits::Kind::kCall, "uid 7");
  auto e = limits.Enter(CallLimits::Kind::kCall, "uid 7");
  EXPECT_TRUE(d.ok() && e.ok());
  EXPECT_EQ(limits.tracked(), 1);
}

}  // namespace
}  // namespace weightsync

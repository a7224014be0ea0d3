#include "daemon/core/notice_hub.h"

#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace weightsync {
namespace {

// A control stream whose engine acknowledges from its own thread, in order,
// only once it has seen `batch` notices (so a hub that waited for one ack
// before sending the next notice would deadlock until the deadline).
class FakeEngine : public ControlChannel {
 public:
  FakeEngine(NoticeHub* hub, std::string id, int batch, bool refuse_second)
      : hub_(hub), id_(std::move(id)), batch_(batch), refuse_(refuse_second) {}
  ~FakeEngine() override {
    if (thread_.joinable()) thread_.join();
  }
  bool Send(const v1::DaemonMessage& m) override {
    absl::MutexLock lock(&mu_);
    seen_.push_back(m);
    if (static_cast<int>(seen_.size()) == batch_) {
      std::vector<v1::DaemonMessage> all = seen_;
      thread_ = std::thread([this, all] {
        for (size_t i = 0; i < all.size(); ++i) {
          v1::EngineMessage::Ack ack;
          ack.set_notice_id(all[i].notice_id());
          ack.set_ok(!(refuse_ && i == 1));
          ack.set_message("busy");
          hub_->OnAck(id_, ack);
        }
      });
    }
    return true;
  }
  std::vector<v1::DaemonMessage> seen() {
    absl::MutexLock lock(&mu_);
    return seen_;
  }

 private:
  NoticeHub* hub_;
  const std::string id_;
  const int batch_;
  const bool refuse_;
  absl::Mutex mu_;
  std::vector<v1::DaemonMessage> seen_;
  std::thread thread_;
};

v1::DaemonMessage Version(int64_t v) {
  v1::DaemonMessage m;
  m.mutable_new_version()->set_version(v);
  return m;
}

v1::DaemonMessage Resume() {
  v1::DaemonMessage m;
  m.mutable_resume();
  return m;
}

TEST(NoticeHubTest, SequencesAreSentBeforeAnyAckAndDeliveredInOrder) {
  NoticeHub hub;
  auto a = std::make_shared<FakeEngine>(&hub, "a", 2, false);
  auto b = std::make_shared<FakeEngine>(&hub, "b", 1, false);
  hub.Attach("a", a);
  hub.Attach("b", b);
  const absl::Time t0 = absl::Now();
  auto acks =
      hub.Broadcast({{"a", {Version(3), Resume()}}, {"b", {Version(3)}}},
                    absl::Now() + absl::Seconds(5));
  EXPECT_LT(absl::Now() - t0, absl::Seconds(2));
  ASSERT_EQ(acks.size(), 2);
  EXPECT_TRUE(acks["a"].ok()) << acks["a"];
  EXPECT_TRUE(acks["b"].ok()) << acks["b"];
  ASSERT_EQ(a->seen().size(), 2);
  EXPECT_TRUE(a->seen()[0].has_new_version());
  EXPECT_TRUE(a->seen()[1].has_resume());
  EXPECT_LT(a->seen()[0].notice_id(), a->seen()[1].notice_id());
}

TEST(NoticeHubTest, FirstFailureOfASequenceIsReported) {
  NoticeHub hub;
  auto a = std::make_shared<FakeEngine>(&hub, "a", 2, /*refuse_second=*/true);
  hub.Attach("a", a);
  auto acks = hub.Broadcast({{"a", {Version(3), Resume()}}},
                            absl::Now() + absl::Seconds(5));
  EXPECT_EQ(acks["a"].code(), absl::StatusCode::kAborted);
  EXPECT_THAT(acks["a"].message(), testing::HasSubstr("engine 'a' refused"));
}

TEST(NoticeHubTest, MissingAckHitsTheDeadlineAndUnknownEngineIsUnavailable) {
  NoticeHub hub;
  auto a = std::make_shared<FakeEngine>(&hub, "a", 99, false);  // never acks
  hub.Attach("a", a);
  auto acks = hub.Broadcast({"a", "ghost"}, Version(1),
                            absl::Now() + absl::Milliseconds(100));
  EXPECT_EQ(acks["a"].code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(acks["ghost"].code(), absl::StatusCode::kUnavailable);
  // A stream that closes while a notice waits fails it at once.
  std::thread closer([&] {
    absl::SleepFor(absl::Milliseconds(50));
    EXPECT_TRUE(hub.Detach("a", a.get()));
  });
  const absl::Time t0 = absl::Now();
  acks = hub.Broadcast({"a"}, Version(2), absl::Now() + absl::Seconds(10));
  closer.join();
  EXPECT_EQ(acks["a"].code(), absl::StatusCode::kUnavailable);
  EXPECT_LT(absl::Now() - t0, absl::Seconds(5));
}

// A control stream whose behaviour each test scripts: `on_send` runs in
// Send (outside the hub's lock, as a real stream's write) and says whether
// the write worked.
class ScriptedChannel : public ControlChannel {
 public:
  explicit ScriptedChannel(std::function<bool(const v1::DaemonMessage&)> f)
      : on_send_(std::move(f)) {}
  bool Send(const v1::DaemonMessage& m) override { return on_send_(m); }

 private:
  std::function<bool(const v1::DaemonMessage&)> on_send_;
};

v1::EngineMessage::Ack Ack(uint64_t id, bool ok) {
  v1::EngineMessage::Ack ack;
  ack.set_notice_id(id);
  ack.set_ok(ok);
  ack.set_message(ok ? "" : "no");
  return ack;
}

// Per engine the first failure stands, also when later notices succeed.
TEST(NoticeHubTest, FirstFailureWinsOverLaterSuccesses) {
  NoticeHub hub;
  int sent = 0;
  auto a = std::make_shared<ScriptedChannel>([&](const v1::DaemonMessage& m) {
    hub.OnAck("a", Ack(m.notice_id(), /*ok=*/sent++ != 0));  // first refused
    return true;
  });
  hub.Attach("a", a);
  auto acks = hub.Broadcast({{"a", {Version(3), Resume()}}},
                            absl::Now() + absl::Seconds(5));
  EXPECT_EQ(acks["a"].code(), absl::StatusCode::kAborted) << acks["a"];
}

// Only an engine's own, first acknowledgement of a pending notice counts:
// another engine's ack of it, a second ack and an unknown id are ignored.
TEST(NoticeHubTest, ForeignLateAndUnknownAcksAreIgnored) {
  NoticeHub hub;
  auto a = std::make_shared<ScriptedChannel>([&](const v1::DaemonMessage& m) {
    hub.OnAck("b", Ack(m.notice_id(), false));  // not b's notice
    hub.OnAck("a", Ack(m.notice_id(), true));
    hub.OnAck("a", Ack(m.notice_id(), false));         // late: already answered
    hub.OnAck("a", Ack(m.notice_id() + 1000, false));  // no such notice
    return true;
  });
  hub.Attach("a", a);
  auto acks = hub.Broadcast({"a"}, Version(1), absl::Now() + absl::Seconds(5));
  EXPECT_TRUE(acks["a"].ok()) << acks["a"];
}

// A write that fails ends that engine's notice at once (UNAVAILABLE), not
// at the deadline.
TEST(NoticeHubTest, AFailedWriteIsUnavailableAtOnce) {
  NoticeHub hub;
  hub.Attach("a", std::make_shared<ScriptedChannel>(
                      [](const v1::DaemonMessage&) { return false; }));
  const absl::Time t0 = absl::Now();
  auto acks = hub.Broadcast({"a"}, Version(1), absl::Now() + absl::Seconds(10));
  EXPECT_EQ(acks["a"].code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(acks["a"].message(), testing::HasSubstr("control stream broke"));
  EXPECT_LT(absl::Now() - t0, absl::Seconds(2));
  // A stream that closed during the write: its notice already ended, and
  // the failed write does not restate it.
  std::shared_ptr<ScriptedChannel> d;
  d = std::make_shared<ScriptedChannel>([&](const v1::DaemonMessage&) {
    hub.Detach("d", d.get());
    return false;
  });
  hub.Attach("d", d);
  acks = hub.Broadcast({"d"}, Version(2), absl::Now() + absl::Seconds(10));
  EXPECT_THAT(acks["d"].message(),
              testing::HasSubstr("closed its control stream"));
}

// Detaching touches only that engine's current stream and only notices
// still waiting: a stale or unknown stream detaches nothing, another
// engine's waiting notice and an answered one keep their results.
TEST(NoticeHubTest, DetachEndsOnlyItsOwnEnginesWaitingNotices) {
  NoticeHub hub;
  auto old_a = std::make_shared<ScriptedChannel>(
      [](const v1::DaemonMessage&) { return true; });
  std::vector<uint64_t> a_ids;
  absl::Mutex ids_mu;
  auto a = std::make_shared<ScriptedChannel>([&](const v1::DaemonMessage& m) {
    absl::MutexLock lock(&ids_mu);
    a_ids.push_back(m.notice_id());  // answered later, from a thread
    return true;
  });
  hub.Attach("a", old_a);
  hub.Attach("a", a);  // a new stream replaces the old one
  EXPECT_FALSE(hub.Detach("a", old_a.get()));
  EXPECT_FALSE(hub.Detach("nobody", a.get()));
  hub.DetachEngine("nobody");
  EXPECT_TRUE(hub.Connected("a"));
  std::shared_ptr<ScriptedChannel> b;
  b = std::make_shared<ScriptedChannel>([&](const v1::DaemonMessage&) {
    EXPECT_TRUE(hub.Detach("b", b.get()));  // b's stream closes as we send
    return true;
  });
  hub.Attach("b", b);
  std::shared_ptr<ScriptedChannel> c;
  c = std::make_shared<ScriptedChannel>([&](const v1::DaemonMessage& m) {
    hub.OnAck("c", Ack(m.notice_id(), true));  // answered, then closed
    EXPECT_TRUE(hub.Detach("c", c.get()));
    return true;
  });
  hub.Attach("c", c);
  std::thread late([&] {
    absl::SleepFor(absl::Milliseconds(100));
    absl::MutexLock lock(&ids_mu);
    for (uint64_t id : a_ids) hub.OnAck("a", Ack(id, true));
  });
  auto acks = hub.Broadcast({"a", "b", "c"}, Version(1),
                            absl::Now() + absl::Seconds(5));
  late.join();
  EXPECT_TRUE(acks["a"].ok()) << acks["a"];
  EXPECT_EQ(acks["b"].code(), absl::StatusCode::kUnavailable) << acks["b"];
  EXPECT_TRUE(acks["c"].ok()) << acks["c"];
  // DetachEngine detaches whatever stream the engine has.
  hub.DetachEngine("a");
  EXPECT_FALSE(hub.Connected("a"));
  acks = hub.Broadcast({"a"}, Version(2), absl::Now() + absl::Seconds(5));
  EXPECT_THAT(acks["a"].message(),
              testing::HasSubstr("has no open control stream"));
}

}  // namespace
}  // namespace weightsync

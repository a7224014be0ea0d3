#include "daemon/core/notice_hub.h"

#include <memory>
#include <string>
#include <thread>
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

}  // namespace
}  // namespace weightsync

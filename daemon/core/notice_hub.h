// Relays notices (pause, resume, new version, dirty) to engines over their
// control streams and collects acknowledgements under a deadline.
// Thread-safe: any thread may call any method.
#ifndef WEIGHTSYNC_DAEMON_CORE_NOTICE_HUB_H_
#define WEIGHTSYNC_DAEMON_CORE_NOTICE_HUB_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "weightsync/v1/engine_service.pb.h"

namespace weightsync {

// One engine's open control stream, as the hub sees it.
class ControlChannel {
 public:
  virtual ~ControlChannel() = default;
  // Sends one notice; false if the stream is gone. Thread-safe.
  virtual bool Send(const v1::DaemonMessage& message) = 0;
};

class NoticeHub {
 public:
  void Attach(const std::string& engine, std::shared_ptr<ControlChannel> ch);
  // Detaches `ch` if it is still the engine's channel; notices waiting on it
  // fail with UNAVAILABLE.
  // Returns true if `ch` was the engine's current channel.
  bool Detach(const std::string& engine, const ControlChannel* ch);
  // Detaches whatever channel the engine has (it was unregistered).
  void DetachEngine(const std::string& engine);
  bool Connected(const std::string& engine) const;
  void OnAck(const std::string& engine, const v1::EngineMessage::Ack& ack);

  // Sends `message` to each engine and waits for every acknowledgement
  // until `deadline`. Per engine: OK; DEADLINE_EXCEEDED (no ack in time);
  // UNAVAILABLE (no stream, or it closed); ABORTED (the engine refused).
  std::map<std::string, absl::Status> Broadcast(
      const std::vector<std::string>& engines, v1::DaemonMessage message,
      absl::Time deadline);

  // Several notices per engine, delivered in order and all acknowledged
  // within one round trip; per engine, the first failure or OK.
  struct Notices {
    std::string engine;
    std::vector<v1::DaemonMessage> messages;
  };
  std::map<std::string, absl::Status> Broadcast(
      const std::vector<Notices>& notices, absl::Time deadline);

 private:
  struct Pending {
    std::string engine;
    bool done = false;
    absl::Status status;
  };
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, std::shared_ptr<ControlChannel>> channels_
      ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<uint64_t, Pending> pending_ ABSL_GUARDED_BY(mu_);
  uint64_t next_notice_ ABSL_GUARDED_BY(mu_) = 1;
};

}  // namespace weightsync

#endif  // WEIGHTSYNC_DAEMON_CORE_NOTICE_HUB_H_

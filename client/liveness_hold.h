// LivenessHold: a trainer's hold on the transfer group it formed
// (TrainerService.Liveness; docs/protocol.md, "Trainer liveness"). While it
// is open the daemon knows the trainer lives; when the process dies the
// kernel closes its socket and the daemon ends the trainer's update within
// a second instead of at --update_idle_timeout_ms. TrainerClient opens one
// after every successful InitWeightTransfer, without being asked.
//
// Owns one thread, blocked reading the stream (it also keeps the
// connection polled, so the daemon's keepalive pings are answered). Not
// thread-safe: one owner opens and destroys it.
#ifndef WEIGHTSYNC_CLIENT_LIVENESS_HOLD_H_
#define WEIGHTSYNC_CLIENT_LIVENESS_HOLD_H_

#include <memory>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "grpcpp/client_context.h"
#include "weightsync/v1/trainer_service.grpc.pb.h"

namespace weightsync {

class LivenessHold {
 public:
  // Opens the stream for `group_id` and waits, at most `timeout`, for the
  // daemon to hold it. The daemon's error if it refuses (UNIMPLEMENTED from
  // a daemon older than the stream: the trainer then goes on without).
  static absl::StatusOr<std::unique_ptr<LivenessHold>> Open(
      v1::TrainerService::Stub* stub, const std::string& group_id,
      absl::Duration timeout);
  // Closes the stream: the daemon ends an update of this group still in
  // progress and resumes engines the trainer paused.
  ~LivenessHold();

  // False once the daemon ended the stream (it restarted, or a new group
  // was formed and the daemon shut the old hold).
  bool open() const;

 private:
  LivenessHold() = default;
  void ReadLoop();

  grpc::ClientContext ctx_;
  std::unique_ptr<
      grpc::ClientReaderWriter<v1::LivenessRequest, v1::LivenessResponse>>
      stream_;
  mutable absl::Mutex mu_;
  bool answered_ ABSL_GUARDED_BY(mu_) = false;  // first read returned
  bool held_ ABSL_GUARDED_BY(mu_) = false;      // ... with held
  bool ended_ ABSL_GUARDED_BY(mu_) = false;     // the reader is done
  std::thread reader_;
};

}  // namespace weightsync

#endif  // WEIGHTSYNC_CLIENT_LIVENESS_HOLD_H_

#include "client/liveness_hold.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "common/grpc_status.h"

namespace weightsync {

absl::StatusOr<std::unique_ptr<LivenessHold>> LivenessHold::Open(
    v1::TrainerService::Stub* stub, const std::string& group_id,
    absl::Duration timeout) {
  std::unique_ptr<LivenessHold> hold(new LivenessHold());
  hold->stream_ = stub->Liveness(&hold->ctx_);
  v1::LivenessRequest request;
  request.set_group_id(group_id);
  hold->stream_->Write(request);  // a refusal shows in the first Read
  hold->reader_ = std::thread([h = hold.get()] { h->ReadLoop(); });
  bool answered, held;
  {
    absl::MutexLock lock(&hold->mu_);
    // A bool Condition: clang can't name a lambda's capture in a lock
    // annotation (the coverage build failed on it).
    hold->mu_.AwaitWithTimeout(absl::Condition(&hold->answered_), timeout);
    answered = hold->answered_;
    held = hold->held_;
  }
  if (held) return hold;
  hold->ctx_.TryCancel();
  hold->reader_.join();
  const grpc::Status s = hold->stream_->Finish();
  hold->stream_.reset();
  if (!answered) {
    return absl::DeadlineExceededError(absl::StrCat(
        "Liveness: no answer within ", absl::FormatDuration(timeout)));
  }
  if (!s.ok()) return FromGrpcStatus(s);
  return absl::UnknownError("Liveness: the daemon ended the stream at once");
}

void LivenessHold::ReadLoop() {
  v1::LivenessResponse response;
  const bool first = stream_->Read(&response);
  {
    absl::MutexLock lock(&mu_);
    answered_ = true;
    held_ = first && response.held();
  }
  // The daemon sends nothing more; this returns when the stream ends.
  while (first && stream_->Read(&response)) {
  }
  absl::MutexLock lock(&mu_);
  ended_ = true;
}

bool LivenessHold::open() const {
  absl::MutexLock lock(&mu_);
  return held_ && !ended_;
}

LivenessHold::~LivenessHold() {
  if (stream_ == nullptr) return;  // Open failed and cleaned up
  // A half-close lets the daemon end the stream itself (and log that the
  // trainer closed it); a daemon that does not answer is cut off.
  stream_->WritesDone();
  {
    absl::MutexLock lock(&mu_);
    auto ended = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return ended_; };
    if (!mu_.AwaitWithTimeout(absl::Condition(&ended), absl::Seconds(1))) {
      ctx_.TryCancel();
    }
  }
  reader_.join();
  stream_->Finish().ok();  // the verdict on a stream being closed is moot
}

}  // namespace weightsync

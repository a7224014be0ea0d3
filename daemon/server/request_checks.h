// What the gRPC front checks in a request before the core sees it: ids
// within their length limits, enum fields holding values this build knows,
// no negative durations. Proto3 keeps unknown enum values and any string,
// so without these a peer could send `mode = 99` and have it acted on as
// the default, or a 10 KB id that every error message would echo.
// INVALID_ARGUMENT naming the field; ids are quoted through Echo
// (common/echo.h). Pure functions; any thread.
#ifndef WEIGHTSYNC_DAEMON_SERVER_REQUEST_CHECKS_H_
#define WEIGHTSYNC_DAEMON_SERVER_REQUEST_CHECKS_H_

#include <cstddef>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "weightsync/v1/engine_service.pb.h"
#include "weightsync/v1/trainer_service.pb.h"

namespace weightsync {

// Longest engine_id (RegisterEngine allows 1-128 of [A-Za-z0-9._:-]) and
// update_id / source_id (docs/security.md, "Every request is bounded").
inline constexpr size_t kMaxEngineIdBytes = 128;
inline constexpr size_t kMaxUpdateIdBytes = 256;
// AbortWeightUpdateRequest.reason.
inline constexpr size_t kMaxReasonBytes = 1024;

// `id` in field `field` is at most `max` bytes.
absl::Status CheckIdLength(absl::string_view field, absl::string_view id,
                           size_t max);

absl::Status CheckRequest(const v1::InitWeightTransferRequest& r);
absl::Status CheckRequest(const v1::StartWeightUpdateRequest& r);
absl::Status CheckRequest(const v1::UnregisterSourceRequest& r);
absl::Status CheckRequest(const v1::GetWorldSizeRequest& r);
absl::Status CheckRequest(const v1::FinishWeightUpdateRequest& r);
absl::Status CheckRequest(const v1::PrepareWeightUpdateRequest& r);
absl::Status CheckRequest(const v1::CommitWeightUpdateRequest& r);
absl::Status CheckRequest(const v1::AbortWeightUpdateRequest& r);
absl::Status CheckRequest(const v1::PauseRequest& r);
absl::Status CheckRequest(const v1::ResumeRequest& r);
absl::Status CheckRequest(const v1::CheckEngineRequest& r);
absl::Status CheckRequest(const v1::RegisterEngineRequest& r);
absl::Status CheckRequest(const v1::UnregisterEngineRequest& r);
absl::Status CheckRequest(const v1::EngineMessage::Hello& r);

}  // namespace weightsync

#endif  // WEIGHTSYNC_DAEMON_SERVER_REQUEST_CHECKS_H_

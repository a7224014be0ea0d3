#include "daemon/server/request_checks.h"

#include <cstdint>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/echo.h"
#include "common/status_macros.h"
#include "google/protobuf/repeated_ptr_field.h"

namespace weightsync {
namespace {

// `value` of enum field `field` is one `valid` accepts.
absl::Status CheckEnum(absl::string_view field, int value, bool (*valid)(int)) {
  if (valid(value)) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(field, " = ", value, " is not a value this daemon knows"));
}

// A duration in milliseconds: 0 means the default, negative is an error.
absl::Status CheckTimeout(absl::string_view field, int64_t ms) {
  if (ms >= 0) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(field, " must be >= 0, not ", ms, " (0: the default)"));
}

absl::Status CheckEngineIds(
    const google::protobuf::RepeatedPtrField<std::string>& ids) {
  for (const std::string& id : ids) {
    WS_RETURN_IF_ERROR(CheckIdLength("engine_ids", id, kMaxEngineIdBytes));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CheckIdLength(absl::string_view field, absl::string_view id,
                           size_t max) {
  if (id.size() <= max) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(field, " '", Echo(id), "' is longer than ", max, " bytes"));
}

absl::Status CheckRequest(const v1::InitWeightTransferRequest& r) {
  WS_RETURN_IF_ERROR(CheckEnum("backend", r.backend(), v1::Backend_IsValid));
  WS_RETURN_IF_ERROR(CheckIdLength("take_over_update_id",
                                   r.take_over_update_id(), kMaxUpdateIdBytes));
  return CheckTimeout("timeout_ms", r.timeout_ms());
}

absl::Status CheckRequest(const v1::StartWeightUpdateRequest& r) {
  WS_RETURN_IF_ERROR(
      CheckIdLength("update_id", r.update_id(), kMaxUpdateIdBytes));
  WS_RETURN_IF_ERROR(
      CheckIdLength("source_id", r.source_id(), kMaxUpdateIdBytes));
  WS_RETURN_IF_ERROR(CheckIdLength("take_over_update_id",
                                   r.take_over_update_id(), kMaxUpdateIdBytes));
  WS_RETURN_IF_ERROR(CheckEnum("mode", r.mode(), v1::UpdateMode_IsValid));
  WS_RETURN_IF_ERROR(CheckEnum("verify", r.verify(), v1::VerifyMode_IsValid));
  WS_RETURN_IF_ERROR(CheckTimeout("finish_timeout_ms", r.finish_timeout_ms()));
  return CheckEngineIds(r.engine_ids());
}

absl::Status CheckRequest(const v1::GetWorldSizeRequest& r) {
  return CheckEnum("backend", r.backend(), v1::Backend_IsValid);
}

absl::Status CheckRequest(const v1::UnregisterSourceRequest& r) {
  return CheckIdLength("source_id", r.source_id(), kMaxUpdateIdBytes);
}

absl::Status CheckRequest(const v1::FinishWeightUpdateRequest& r) {
  WS_RETURN_IF_ERROR(
      CheckIdLength("update_id", r.update_id(), kMaxUpdateIdBytes));
  return CheckTimeout("timeout_ms", r.timeout_ms());
}

absl::Status CheckRequest(const v1::PrepareWeightUpdateRequest& r) {
  WS_RETURN_IF_ERROR(
      CheckIdLength("update_id", r.update_id(), kMaxUpdateIdBytes));
  return CheckTimeout("timeout_ms", r.timeout_ms());
}

absl::Status CheckRequest(const v1::CommitWeightUpdateRequest& r) {
  return CheckIdLength("update_id", r.update_id(), kMaxUpdateIdBytes);
}

absl::Status CheckRequest(const v1::AbortWeightUpdateRequest& r) {
  WS_RETURN_IF_ERROR(
      CheckIdLength("update_id", r.update_id(), kMaxUpdateIdBytes));
  // Relayed to the engines (DaemonMessage.dirty.reason) and logged.
  return CheckIdLength("reason", r.reason(), kMaxReasonBytes);
}

absl::Status CheckRequest(const v1::PauseRequest& r) {
  WS_RETURN_IF_ERROR(CheckEnum("mode", r.mode(), v1::PauseMode_IsValid));
  WS_RETURN_IF_ERROR(CheckTimeout("timeout_ms", r.timeout_ms()));
  return CheckEngineIds(r.engine_ids());
}

absl::Status CheckRequest(const v1::ResumeRequest& r) {
  WS_RETURN_IF_ERROR(CheckTimeout("timeout_ms", r.timeout_ms()));
  return CheckEngineIds(r.engine_ids());
}

absl::Status CheckRequest(const v1::CheckEngineRequest& r) {
  return CheckIdLength("engine_id", r.engine_id(), kMaxEngineIdBytes);
}

absl::Status CheckRequest(const v1::RegisterEngineRequest& r) {
  return CheckIdLength("engine_id", r.engine_id(), kMaxEngineIdBytes);
}

absl::Status CheckRequest(const v1::UnregisterEngineRequest& r) {
  return CheckIdLength("engine_id", r.engine_id(), kMaxEngineIdBytes);
}

absl::Status CheckRequest(const v1::EngineMessage::Hello& r) {
  return CheckIdLength("Hello.engine_id", r.engine_id(), kMaxEngineIdBytes);
}

}  // namespace weightsync

// Coordinator: registered sources (docs/protocol.md, "Registered sources").
// The registry itself is SourceRegistry; this is the part that needs the
// transfer group.
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "daemon/core/coordinator.h"
#include "daemon/core/event_log.h"
#include "glog/logging.h"

namespace weightsync {

absl::StatusOr<v1::RegisterSourceResponse> Coordinator::RegisterSource(
    const v1::RegisterSourceRequest& request) {
  NoteTrainerCall();
  v1::Backend backend;
  {
    absl::MutexLock lock(&mu_);
    if (shut_down_) return absl::UnavailableError("daemon is shutting down");
    if (data_plane_ == nullptr) {
      return absl::FailedPreconditionError(
          "no transfer group: call InitWeightTransfer before RegisterSource "
          "(a source belongs to the group)");
    }
    backend = backend_;
  }
  WS_ASSIGN_OR_RETURN(
      std::shared_ptr<const Source> source,
      sources_.Register(request, *mapper_,
                        backend == v1::BACKEND_IPC ? v1::MEMORY_CUDA_IPC
                        : backend == v1::BACKEND_HOST
                            ? v1::MEMORY_HOST_SHM
                            : v1::MEMORY_KIND_UNSPECIFIED));
  LOG(INFO) << Event("source.registered") << source->id << ": "
            << source->manifest.size() << " tensors, " << source->total_bytes
            << " bytes"
            << (source->has_memory() ? ", in the trainer's memory" : "");
  v1::RegisterSourceResponse response;
  response.set_source_id(source->id);
  response.set_tensors(source->manifest.size());
  response.set_total_bytes(source->total_bytes);
  response.set_memory(source->has_memory());
  return response;
}

absl::Status Coordinator::UnregisterSource(
    const v1::UnregisterSourceRequest& request) {
  NoteTrainerCall();
  return sources_.Unregister(request.source_id());
}

}  // namespace weightsync

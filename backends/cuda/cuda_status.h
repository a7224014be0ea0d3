// cudaError_t / ncclResult_t -> absl::Status, naming the failing expression.
#ifndef WEIGHTSYNC_BACKENDS_CUDA_CUDA_STATUS_H_
#define WEIGHTSYNC_BACKENDS_CUDA_CUDA_STATUS_H_

#include <cuda_runtime_api.h>
#include <nccl.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace weightsync {

inline absl::Status CudaStatus(cudaError_t e, const char* expr) {
  if (e == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(expr, ": ", cudaGetErrorName(e), " (",
                                          cudaGetErrorString(e), ")"));
}

inline absl::Status NcclStatus(ncclResult_t r, const char* expr) {
  if (r == ncclSuccess || r == ncclInProgress) return absl::OkStatus();
  // A remote or system failure means "retry the whole update".
  const bool peer = r == ncclRemoteError || r == ncclSystemError;
  const std::string msg = absl::StrCat(expr, ": ", ncclGetErrorString(r));
  return peer ? absl::AbortedError(msg) : absl::InternalError(msg);
}

}  // namespace weightsync

#define WS_CUDA(expr)                                                  \
  do {                                                                 \
    const ::absl::Status _s = ::weightsync::CudaStatus((expr), #expr); \
    if (!_s.ok()) return _s;                                           \
  } while (0)

#define WS_NCCL(expr)                                                  \
  do {                                                                 \
    const ::absl::Status _s = ::weightsync::NcclStatus((expr), #expr); \
    if (!_s.ok()) return _s;                                           \
  } while (0)

#endif  // WEIGHTSYNC_BACKENDS_CUDA_CUDA_STATUS_H_

// A GPU's UUID as the wire carries it ("GPU-xxxxxxxx-xxxx-xxxx-xxxx-
// xxxxxxxxxxxx", as nvidia-smi prints it). GPUs are named by UUID on the
// wire, never by index (DESIGN.md, invariant 6). Header-only; CUDA builds.
#ifndef WEIGHTSYNC_BACKENDS_CUDA_GPU_UUID_H_
#define WEIGHTSYNC_BACKENDS_CUDA_GPU_UUID_H_

#include <cuda_runtime_api.h>

#include <string>

#include "absl/strings/str_format.h"

namespace weightsync {

// The UUID of CUDA device `ordinal`, or "" if it can't be read.
inline std::string GpuUuid(int ordinal) {
  cudaDeviceProp p;
  if (cudaGetDeviceProperties(&p, ordinal) != cudaSuccess) return "";
  const auto* b = reinterpret_cast<const unsigned char*>(p.uuid.bytes);
  return absl::StrFormat(
      "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x"
      "%02x",
      b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11],
      b[12], b[13], b[14], b[15]);
}

}  // namespace weightsync

#endif  // WEIGHTSYNC_BACKENDS_CUDA_GPU_UUID_H_

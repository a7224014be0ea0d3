// The multiprocessor count of a GPU, cached per device: kernel launches size
// their grids with it and should not query device attributes on every call.
// Shared by the .cu files of //backends/cuda.
#ifndef WEIGHTSYNC_BACKENDS_CUDA_SM_COUNT_CUH_
#define WEIGHTSYNC_BACKENDS_CUDA_SM_COUNT_CUH_

#include <cuda_runtime.h>

#include <atomic>

namespace weightsync {
namespace cuda {

inline cudaError_t MultiprocessorCount(int device, int* count) {
  constexpr int kMaxCached = 64;
  static std::atomic<int> cache[kMaxCached];
  if (device >= 0 && device < kMaxCached) {
    *count = cache[device].load(std::memory_order_relaxed);
    if (*count > 0) return cudaSuccess;
  }
  const cudaError_t err =
      cudaDeviceGetAttribute(count, cudaDevAttrMultiProcessorCount, device);
  if (err != cudaSuccess) return err;
  if (device >= 0 && device < kMaxCached) {
    cache[device].store(*count, std::memory_order_relaxed);
  }
  return cudaSuccess;
}

// Of the current device.
inline cudaError_t MultiprocessorCount(int* count) {
  int device = 0;
  const cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  return MultiprocessorCount(device, count);
}

}  // namespace cuda
}  // namespace weightsync

#endif  // WEIGHTSYNC_BACKENDS_CUDA_SM_COUNT_CUH_

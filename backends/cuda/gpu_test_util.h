// What the GPU tests (tagged gpu, manual) share: a CUDA assertion, an owned
// device buffer, and a fixture with a stream that skips where no GPU is
// visible.
#ifndef WEIGHTSYNC_BACKENDS_CUDA_GPU_TEST_UTIL_H_
#define WEIGHTSYNC_BACKENDS_CUDA_GPU_TEST_UTIL_H_

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "gtest/gtest.h"

#define ASSERT_CUDA_OK(expr)                                                   \
  do {                                                                         \
    const cudaError_t err_ = (expr);                                           \
    ASSERT_EQ(err_, cudaSuccess) << #expr << ": " << cudaGetErrorString(err_); \
  } while (0)

namespace weightsync {
namespace cuda {
namespace gpu_testing {

// Owns one cudaMalloc allocation.
class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t bytes) : bytes_(bytes) {
    if (cudaMalloc(&ptr_, std::max<size_t>(bytes, 1)) != cudaSuccess) {
      ptr_ = nullptr;
    }
  }
  ~DeviceBuffer() { cudaFree(ptr_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  uint8_t* get() const { return static_cast<uint8_t*>(ptr_); }
  size_t bytes() const { return bytes_; }

 private:
  void* ptr_ = nullptr;
  size_t bytes_;
};

inline bool HaveGpu() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

// A non-blocking stream per test; the test is skipped without a GPU.
class GpuStreamTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!HaveGpu()) GTEST_SKIP() << "no CUDA device visible";
    ASSERT_CUDA_OK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  }
  void TearDown() override {
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }

  cudaStream_t stream_ = nullptr;
};

}  // namespace gpu_testing
}  // namespace cuda
}  // namespace weightsync

#endif  // WEIGHTSYNC_BACKENDS_CUDA_GPU_TEST_UTIL_H_

#include "bench/mton_kernels.h"

namespace weightsync {
namespace bench {
namespace {

__device__ __forceinline__ uint32_t Mix(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352dU;
  x ^= x >> 15;
  x *= 0x846ca68bU;
  x ^= x >> 16;
  return x;
}

__device__ __forceinline__ uint16_t Value(uint32_t tensor, int64_t row,
                                          int64_t col, uint32_t version) {
  const uint32_t h = Mix(Mix(tensor * 2654435761U + version * 40503U + 1U) ^
                         static_cast<uint32_t>(row));
  return static_cast<uint16_t>(Mix(h ^ static_cast<uint32_t>(col)) & 0xffff);
}

__global__ void FillKernel(uint16_t* dst, int64_t rows, int64_t cols,
                           int64_t row0, uint32_t tensor, uint32_t version) {
  const int64_t n = rows * cols;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    dst[i] = Value(tensor, row0 + i / cols, i % cols, version);
  }
}

__global__ void CheckKernel(const uint16_t* engine, int64_t rows, int64_t cols,
                            int64_t stride, int64_t row0, int64_t col0,
                            uint32_t tensor, uint32_t version,
                            unsigned long long* bad) {
  const int64_t n = rows * cols;
  unsigned long long mine = 0;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t r = i / cols, c = i % cols;
    mine +=
        engine[r * stride + c] != Value(tensor, row0 + r, col0 + c, version);
  }
  if (mine) atomicAdd(bad, mine);
}

int Blocks(int64_t n) {
  const int64_t b = (n + 255) / 256;
  return static_cast<int>(b < 4096 ? (b > 0 ? b : 1) : 4096);
}

}  // namespace

cudaError_t FillRows(uint16_t* dst, int64_t rows, int64_t cols, int64_t row0,
                     uint32_t tensor, uint32_t version, cudaStream_t stream) {
  FillKernel<<<Blocks(rows * cols), 256, 0, stream>>>(dst, rows, cols, row0,
                                                      tensor, version);
  return cudaGetLastError();
}

cudaError_t CountMismatches(const uint16_t* engine, int64_t rows, int64_t cols,
                            int64_t stride, int64_t row0, int64_t col0,
                            uint32_t tensor, uint32_t version,
                            unsigned long long* bad, cudaStream_t stream) {
  CheckKernel<<<Blocks(rows * cols), 256, 0, stream>>>(
      engine, rows, cols, stride, row0, col0, tensor, version, bad);
  return cudaGetLastError();
}

}  // namespace bench
}  // namespace weightsync

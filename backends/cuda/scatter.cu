#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "backends/cuda/float_convert.cuh"
#include "backends/cuda/scatter.h"
#include "backends/cuda/sm_count.cuh"

namespace weightsync {
namespace cuda {
namespace {

// weightsync::v1::DType values (proto/weightsync/v1/types.proto), as plain
// numbers so that nvcc never sees protobuf. scatter_gpu_test checks that
// DTypeSize agrees with weightsync::ElementSize for every value.
constexpr int kFloat32 = 1;
constexpr int kBfloat16 = 2;
constexpr int kFloat16 = 3;
constexpr int kFloat64 = 4;
constexpr int kInt64 = 5;
constexpr int kInt32 = 6;
constexpr int kInt16 = 7;
constexpr int kInt8 = 8;
constexpr int kUint8 = 9;
constexpr int kBool = 10;
constexpr int kFloat8E4m3fn = 11;
constexpr int kFloat8E5m2 = 12;

// Element types of the conversion kernel: how each is stored and how it
// goes to and from float. Every function reproduces the bits of the CPU
// reference in common/dtype.cc (FloatToBf16, Bf16ToFloat, FloatToHalf,
// HalfToFloat), including its NaN encodings, which the hardware's own
// conversions don't (they return a canonical NaN).
using convert::Bf16;
using convert::F16;
using convert::F32;

// V consecutive elements, aligned to their size so that one access moves
// them (16 bytes: one LDG/STG.128; 32 bytes: two).
template <typename T, int V>
struct alignas(sizeof(T) * V) Vec {
  T v[V];
};

constexpr int kThreads = 256;

// Vectors each thread loads before it converts and stores the first: keeps
// enough bytes in flight per SM to saturate HBM. (The element-wise kernel is
// bound by access count, not by this: 4, 8 or 16 all give ~1.1 TB/s.)
constexpr int kUnroll = 4;

// Elements per vector of the vectorised kernel for a destination element of
// `dst_size` bytes: one 16-byte store per vector. (Measured on H100: 16-byte
// stores beat 16-byte loads; with 32-byte stores, two STG.128 per thread,
// bf16->fp32 drops from 2.8 to 2.25 TB/s.)
constexpr int VecElems(int dst_size) { return 16 / dst_size; }

// Where a block's rows start and how each row splits into a scalar head, a
// body of V-element vectors and a scalar tail. The same for every row.
struct Layout {
  const char* src;
  char* dst;
  int64_t src_stride;  // bytes
  int64_t dst_stride;  // bytes
  int64_t rows;
  int64_t head;       // elements before the first vector (< V)
  int64_t nvec;       // vectors per row
  int64_t tail;       // elements after the last vector (< V)
  int64_t col_tiles;  // tiles along one row
  int64_t num_tiles;  // tiles in all
  int log2_tcols;     // threads along a row in a tile = 1 << log2_tcols
};

// A tile is (kThreads >> log2_tcols) rows by (tcols * kUnroll) vectors. Each
// thread owns one row of its tile and kUnroll vectors strided by tcols, so
// a warp's accesses are contiguous. Blocks stride over the tiles.
template <typename S, typename D, int V>
__global__ void __launch_bounds__(kThreads) ConvertKernel(const Layout p) {
  using SS = typename S::Storage;
  using DS = typename D::Storage;
  using SV = Vec<SS, V>;
  using DV = Vec<DS, V>;

  const int tcols = 1 << p.log2_tcols;
  const int tx = threadIdx.x & (tcols - 1);
  const int ty = threadIdx.x >> p.log2_tcols;
  const int trows = kThreads >> p.log2_tcols;
  const int64_t tile_vecs = static_cast<int64_t>(tcols) * kUnroll;

  for (int64_t tile = blockIdx.x; tile < p.num_tiles; tile += gridDim.x) {
    const int64_t row_tile = tile / p.col_tiles;
    const int64_t col_tile = tile - row_tile * p.col_tiles;
    const int64_t r = row_tile * trows + ty;
    if (r >= p.rows) continue;  // no barriers below: safe to skip
    const SS* __restrict__ s =
        reinterpret_cast<const SS*>(p.src + r * p.src_stride);
    DS* __restrict__ d = reinterpret_cast<DS*>(p.dst + r * p.dst_stride);

    if (col_tile == 0) {
      for (int64_t e = tx; e < p.head; e += tcols) {
        d[e] = D::FromFloat(S::ToFloat(s[e]));
      }
      const int64_t tail0 = p.head + p.nvec * V;
      for (int64_t e = tx; e < p.tail; e += tcols) {
        d[tail0 + e] = D::FromFloat(S::ToFloat(s[tail0 + e]));
      }
    }

    const SV* __restrict__ sv = reinterpret_cast<const SV*>(s + p.head);
    DV* __restrict__ dv = reinterpret_cast<DV*>(d + p.head);
    const int64_t v0 = col_tile * tile_vecs + tx;
    SV in[kUnroll];
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
      const int64_t v = v0 + k * tcols;
      if (v < p.nvec) in[k] = sv[v];
    }
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
      const int64_t v = v0 + k * tcols;
      if (v < p.nvec) {
        DV out;
#pragma unroll
        for (int j = 0; j < V; ++j) {
          out.v[j] = D::FromFloat(S::ToFloat(in[k].v[j]));
        }
        dv[v] = out;
      }
    }
  }
}

int Log2Ceil(int64_t x) {
  int l = 0;
  while ((int64_t{1} << l) < x) ++l;
  return l;
}

template <typename S, typename D, int V>
cudaError_t Launch(const char* src, int64_t src_stride, char* dst,
                   int64_t dst_stride, int64_t rows, int64_t cols, int64_t head,
                   cudaStream_t stream) {
  Layout p;
  p.src = src;
  p.dst = dst;
  p.src_stride = src_stride;
  p.dst_stride = dst_stride;
  p.rows = rows;
  p.head = head;
  p.nvec = (cols - head) / V;
  p.tail = cols - head - p.nvec * V;
  // Enough threads along a row to give each kUnroll vectors, at most a
  // block; the rest of the block takes further rows (narrow blocks).
  const int64_t threads_per_row = (p.nvec + kUnroll - 1) / kUnroll;
  p.log2_tcols = std::min(Log2Ceil(std::max<int64_t>(threads_per_row, 1)),
                          Log2Ceil(kThreads));
  const int64_t tcols = int64_t{1} << p.log2_tcols;
  const int64_t trows = kThreads / tcols;
  const int64_t tile_vecs = tcols * kUnroll;
  p.col_tiles = std::max<int64_t>((p.nvec + tile_vecs - 1) / tile_vecs, 1);
  p.num_tiles = (rows + trows - 1) / trows * p.col_tiles;

  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  int sms = 0;
  err = MultiprocessorCount(device, &sms);
  if (err != cudaSuccess) return err;
  // Resident blocks per SM for this instantiation, cached once per process
  // (every GPU of a node is the same model).
  static std::atomic<int> blocks_per_sm{0};
  int bps = blocks_per_sm.load(std::memory_order_relaxed);
  if (bps == 0) {
    err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(
        &bps, ConvertKernel<S, D, V>, kThreads, 0);
    if (err != cudaSuccess) return err;
    bps = std::max(bps, 1);
    blocks_per_sm.store(bps, std::memory_order_relaxed);
  }
  const int64_t grid =
      std::min<int64_t>(p.num_tiles, static_cast<int64_t>(sms) * bps);
  void* args[] = {&p};
  return cudaLaunchKernel(
      reinterpret_cast<const void*>(&ConvertKernel<S, D, V>),
      dim3(static_cast<unsigned>(grid)), dim3(kThreads), args, 0, stream);
}

// Picks the vectorised kernel when every row's src and dst are equally
// misaligned modulo kVec elements (so one head of < kVec elements aligns
// both), the element-wise one otherwise.
template <typename S, typename D>
cudaError_t LaunchConvert(const void* src, int64_t src_stride, void* dst,
                          int64_t dst_stride, int64_t rows, int64_t cols,
                          cudaStream_t stream) {
  constexpr int64_t ss = sizeof(typename S::Storage);
  constexpr int64_t ds = sizeof(typename D::Storage);
  constexpr int kVec = VecElems(ds);
  const uintptr_t s = reinterpret_cast<uintptr_t>(src);
  const uintptr_t d = reinterpret_cast<uintptr_t>(dst);
  const int64_t src_mis = static_cast<int64_t>((s / ss) % kVec);
  const int64_t dst_mis = static_cast<int64_t>((d / ds) % kVec);
  const bool strides_ok = rows == 1 || (src_stride % (ss * kVec) == 0 &&
                                        dst_stride % (ds * kVec) == 0);
  const char* sp = static_cast<const char*>(src);
  char* dp = static_cast<char*>(dst);
  if (strides_ok && src_mis == dst_mis) {
    const int64_t head = std::min<int64_t>((kVec - src_mis) % kVec, cols);
    return Launch<S, D, kVec>(sp, src_stride, dp, dst_stride, rows, cols, head,
                              stream);
  }
  return Launch<S, D, 1>(sp, src_stride, dp, dst_stride, rows, cols, 0, stream);
}

// Equal dtypes never reach a kernel (CopyConvert2D copies them with the copy
// engines); not instantiating those kernels keeps the object small.
template <typename S, typename D>
cudaError_t LaunchIfDifferent(const void* src, int64_t src_stride, void* dst,
                              int64_t dst_stride, int64_t rows, int64_t cols,
                              cudaStream_t stream) {
  if constexpr (std::is_same<S, D>::value) {
    return cudaErrorInvalidValue;
  } else {
    return LaunchConvert<S, D>(src, src_stride, dst, dst_stride, rows, cols,
                               stream);
  }
}

template <typename S>
cudaError_t DispatchDst(int dst_dtype, const void* src, int64_t src_stride,
                        void* dst, int64_t dst_stride, int64_t rows,
                        int64_t cols, cudaStream_t stream) {
  switch (dst_dtype) {
    case kFloat32:
      return LaunchIfDifferent<S, F32>(src, src_stride, dst, dst_stride, rows,
                                       cols, stream);
    case kBfloat16:
      return LaunchIfDifferent<S, Bf16>(src, src_stride, dst, dst_stride, rows,
                                        cols, stream);
    case kFloat16:
      return LaunchIfDifferent<S, F16>(src, src_stride, dst, dst_stride, rows,
                                       cols, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

bool IsConvertibleFloat(int dtype) {
  return dtype == kFloat32 || dtype == kBfloat16 || dtype == kFloat16;
}

}  // namespace

int64_t DTypeSize(int dtype) {
  switch (dtype) {
    case kFloat32:
    case kInt32:
      return 4;
    case kBfloat16:
    case kFloat16:
    case kInt16:
      return 2;
    case kFloat64:
    case kInt64:
      return 8;
    case kInt8:
    case kUint8:
    case kBool:
    case kFloat8E4m3fn:
    case kFloat8E5m2:
      return 1;
    default:
      return 0;
  }
}

cudaError_t CopyConvert2D(const void* src, int64_t src_stride, int src_dtype,
                          void* dst, int64_t dst_stride, int dst_dtype,
                          int64_t rows, int64_t cols, cudaStream_t stream) {
  const int64_t ss = DTypeSize(src_dtype);
  const int64_t ds = DTypeSize(dst_dtype);
  const bool same = src_dtype == dst_dtype;
  if (ss == 0 || ds == 0 ||
      !(same ||
        (IsConvertibleFloat(src_dtype) && IsConvertibleFloat(dst_dtype)))) {
    return cudaErrorInvalidValue;
  }
  if (rows < 0 || cols < 0) return cudaErrorInvalidValue;
  if (rows == 0 || cols == 0) return cudaSuccess;
  if (src == nullptr || dst == nullptr) return cudaErrorInvalidValue;
  if (reinterpret_cast<uintptr_t>(src) % ss != 0 ||
      reinterpret_cast<uintptr_t>(dst) % ds != 0) {
    return cudaErrorInvalidValue;
  }
  // Byte sizes must fit in int64 with room to spare (offsets below are
  // computed as r * stride + c * size).
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max() / 8;
  if (cols > kMax / 8) return cudaErrorInvalidValue;
  const int64_t src_width = cols * ss;
  const int64_t dst_width = cols * ds;
  if (rows > 1) {
    if (src_stride % ss != 0 || dst_stride % ds != 0 ||
        src_stride < src_width || dst_stride < dst_width ||
        src_stride > kMax / rows || dst_stride > kMax / rows) {
      return cudaErrorInvalidValue;
    }
    if (src_stride == src_width && dst_stride == dst_width) {
      // Both sides contiguous: one long row.
      cols *= rows;
      rows = 1;
    }
  }
  if (rows == 1) {
    src_stride = cols * ss;
    dst_stride = cols * ds;
  }

  if (same) {
    if (rows == 1) {
      return cudaMemcpyAsync(dst, src, static_cast<size_t>(cols * ss),
                             cudaMemcpyDefault, stream);
    }
    return cudaMemcpy2DAsync(
        dst, static_cast<size_t>(dst_stride), src,
        static_cast<size_t>(src_stride), static_cast<size_t>(cols * ss),
        static_cast<size_t>(rows), cudaMemcpyDefault, stream);
  }
  switch (src_dtype) {
    case kFloat32:
      return DispatchDst<F32>(dst_dtype, src, src_stride, dst, dst_stride, rows,
                              cols, stream);
    case kBfloat16:
      return DispatchDst<Bf16>(dst_dtype, src, src_stride, dst, dst_stride,
                               rows, cols, stream);
    case kFloat16:
      return DispatchDst<F16>(dst_dtype, src, src_stride, dst, dst_stride, rows,
                              cols, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

namespace {

// Raw bytes, rows x width, grid-stride; T is the access unit (uint4 when
// every address, stride and width is 16-byte aligned, else a byte).
template <typename T>
__global__ void __launch_bounds__(256)
    CopyBytesKernel(const char* src, int64_t src_stride, char* dst,
                    int64_t dst_stride, int64_t rows, int64_t units) {
  const int64_t total = rows * units;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < total;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t r = i / units, c = i - r * units;
    reinterpret_cast<T*>(dst + r * dst_stride)[c] =
        reinterpret_cast<const T*>(src + r * src_stride)[c];
  }
}

// One copy of a batch per block at a time (16-byte units where the copy's
// addresses, strides and width allow, else bytes).
__global__ void __launch_bounds__(256)
    CopyBatchKernel(const BatchCopy* table, int64_t n) {
  for (int64_t i = blockIdx.x; i < n; i += gridDim.x) {
    const BatchCopy c = table[i];
    const auto* src = static_cast<const char*>(c.src);
    auto* dst = static_cast<char*>(c.dst);
    const bool vec =
        (reinterpret_cast<uintptr_t>(src) | reinterpret_cast<uintptr_t>(dst) |
         static_cast<uintptr_t>(c.width) |
         static_cast<uintptr_t>(c.rows > 1 ? c.src_stride | c.dst_stride : 0)) %
            16 ==
        0;
    const int64_t units = vec ? c.width / 16 : c.width;
    const int64_t total = c.rows * units;
    for (int64_t j = threadIdx.x; j < total; j += blockDim.x) {
      const int64_t r = j / units, u = j - r * units;
      if (vec) {
        reinterpret_cast<uint4*>(dst + r * c.dst_stride)[u] =
            reinterpret_cast<const uint4*>(src + r * c.src_stride)[u];
      } else {
        dst[r * c.dst_stride + u] = src[r * c.src_stride + u];
      }
    }
  }
}

}  // namespace

cudaError_t CopyBatchWithSMs(const BatchCopy* table, int64_t n,
                             cudaStream_t stream) {
  if (n < 0) return cudaErrorInvalidValue;
  if (n == 0) return cudaSuccess;
  int sms = 0;
  const cudaError_t err = MultiprocessorCount(&sms);
  if (err != cudaSuccess) return err;
  const int64_t blocks = std::min<int64_t>(n, int64_t{sms} * 8);
  CopyBatchKernel<<<blocks, 256, 0, stream>>>(table, n);
  return cudaGetLastError();
}

cudaError_t CopyBytes2DWithSMs(const void* src, int64_t src_stride, void* dst,
                               int64_t dst_stride, int64_t width, int64_t rows,
                               cudaStream_t stream) {
  if (rows < 0 || width < 0) return cudaErrorInvalidValue;
  if (rows == 0 || width == 0) return cudaSuccess;
  if (rows == 1) src_stride = dst_stride = width;
  const auto s = reinterpret_cast<uintptr_t>(src);
  const auto d = reinterpret_cast<uintptr_t>(dst);
  const bool vec =
      (s | d | static_cast<uintptr_t>(src_stride) |
       static_cast<uintptr_t>(dst_stride) | static_cast<uintptr_t>(width)) %
          16 ==
      0;
  const int64_t units = vec ? width / 16 : width;
  int sms = 0;
  const cudaError_t err = MultiprocessorCount(&sms);
  if (err != cudaSuccess) return err;
  const int64_t blocks =
      std::min<int64_t>((rows * units + 255) / 256, int64_t{sms} * 8);
  const auto* sp = static_cast<const char*>(src);
  auto* dp = static_cast<char*>(dst);
  if (vec) {
    CopyBytesKernel<uint4><<<blocks, 256, 0, stream>>>(sp, src_stride, dp,
                                                       dst_stride, rows, units);
  } else {
    CopyBytesKernel<unsigned char><<<blocks, 256, 0, stream>>>(
        sp, src_stride, dp, dst_stride, rows, units);
  }
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace weightsync

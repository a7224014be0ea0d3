// Device-side float32 / bfloat16 / float16 conversions, shared by the dense
// conversion kernel (scatter.cu) and the sparse-patch kernels, so a patched
// element gets exactly the bits a dense update would give it, and the same bits
// as the CPU reference in common/dtype.cc (FloatToBf16, Bf16ToFloat,
// FloatToHalf, HalfToFloat), NaN payloads included. Private to the .cu files of
// //backends/cuda.
#ifndef WEIGHTSYNC_BACKENDS_CUDA_FLOAT_CONVERT_CUH_
#define WEIGHTSYNC_BACKENDS_CUDA_FLOAT_CONVERT_CUH_

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace weightsync {
namespace cuda {
namespace convert {

// weightsync::v1::DType values (proto/weightsync/v1/types.proto).
constexpr int kFloat32 = 1;
constexpr int kBfloat16 = 2;
constexpr int kFloat16 = 3;

struct F32 {
  using Storage = float;
  static __device__ __forceinline__ float ToFloat(float v) { return v; }
  static __device__ __forceinline__ float FromFloat(float f) { return f; }
};

struct Bf16 {
  using Storage = uint16_t;
  static __device__ __forceinline__ float ToFloat(uint16_t h) {
    return __uint_as_float(static_cast<uint32_t>(h) << 16);
  }
  static __device__ __forceinline__ uint16_t FromFloat(float f) {
    const uint32_t bits = __float_as_uint(f);
    // NaN: keep sign and payload, force the quiet bit.
    if ((bits & 0x7FFFFFFFu) > 0x7F800000u) {
      return static_cast<uint16_t>((bits >> 16) | 0x40u);
    }
    // Round to nearest even; carries into the exponent give inf on overflow.
    return static_cast<uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
  }
};

struct F16 {
  using Storage = uint16_t;
  static __device__ __forceinline__ float ToFloat(uint16_t h) {
    // Widening is exact; only NaN needs care so that its payload survives
    // exactly as in HalfToFloat.
    if ((h & 0x7C00u) == 0x7C00u && (h & 0x3FFu) != 0) {
      return __uint_as_float((static_cast<uint32_t>(h & 0x8000u) << 16) |
                             0x7F800000u |
                             (static_cast<uint32_t>(h & 0x3FFu) << 13));
    }
    return __half2float(__ushort_as_half(h));
  }
  static __device__ __forceinline__ uint16_t FromFloat(float f) {
    const uint32_t bits = __float_as_uint(f);
    if ((bits & 0x7FFFFFFFu) > 0x7F800000u) {
      return static_cast<uint16_t>(((bits >> 16) & 0x8000u) | 0x7E00u);
    }
    // cvt.rn.f16.f32: IEEE round to nearest even, overflow to inf, half
    // subnormals exact (nvcc's default -ftz=false).
    return __half_as_ushort(__float2half_rn(f));
  }
};

// Equal dtypes: the raw bits of an element of `Bytes` bytes, unchanged.
template <int Bytes>
struct Raw;
template <>
struct Raw<1> {
  using Storage = uint8_t;
};
template <>
struct Raw<2> {
  using Storage = uint16_t;
};
template <>
struct Raw<4> {
  using Storage = uint32_t;
};
template <>
struct Raw<8> {
  using Storage = unsigned long long;
};

}  // namespace convert
}  // namespace cuda
}  // namespace weightsync

#endif  // WEIGHTSYNC_BACKENDS_CUDA_FLOAT_CONVERT_CUH_

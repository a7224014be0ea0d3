// The vectorised direct quantisation kernel's per-thread logic (the "vec"
// and "cvt" variants of --fp8_direct_kernel; quant_kernels.cu runs it,
// quant_direct_emulation.h runs it thread by thread on the CPU for
// quant_steps_test).
//
// Same arithmetic as fp8_math.h's direct kernel ("regs"), laid out for
// fewer instructions per element and more thread blocks per multiprocessor:
// 256 threads, each holding 8 vectors of 16 source bytes in registers as
// raw bits (a 128 x 128 bf16 block is read once), loaded with one 16-byte
// load and written with one 8- or 4-byte store per vector. Exactness:
// - amax: |x|'s source bits compared as unsigned integers. Finite values'
//   bits order as their magnitudes, and widening (float_convert.cuh) is
//   exact and monotonic, so widen(max bits) = max(widen) = Fp8AmaxStep's
//   result; NaN and +-inf are skipped as Fp8AmaxStep skips them.
// - the quotient: Fp8Div (__fdiv_rn) of the widened element, as before.
// - the encoding: Fp8Encode ("vec"), or ("cvt", GPU only) the hardware's
//   cvt.rn.satfinite to e4m3/e5m2 for |q| < FMAX only, where it is IEEE
//   round to nearest even into the format (subnormals and signed zeros
//   included); |q| >= FMAX, +-inf and NaN take Fp8Encode's answers (sign |
//   max, sign | NaN) explicitly, never the hardware's. On the CPU "cvt"
//   runs Fp8Encode (the CPU cannot run cvt); tests/gpu/test_fp8_gpu.py
//   exact checks the GPU's bytes. The lean kernel's blocks without inf or
//   NaN (VecTop finds them) take the hardware's bytes for every q (kFinite):
//   for finite |q| >= FMAX its saturation is Fp8Encode's sign | max
//   (every finite float32, both formats, checked on a GPU:
//   gpu_kernels_bench fp8, "satfinite cvt").
// Blocks whose rows are not whole 16-byte vectors at aligned addresses
// take fp8_math.h's per-element walk with the same 256 threads.
#ifndef WEIGHTSYNC_BACKENDS_CUDA_FP8_DIRECT_VEC_H_
#define WEIGHTSYNC_BACKENDS_CUDA_FP8_DIRECT_VEC_H_

#include <cstdint>
#include <cstring>

#include "backends/cuda/fp8_math.h"

#if defined(__CUDA_ARCH__)
#include <cuda_fp8.h>
#endif

namespace weightsync {
namespace cuda {

// --fp8_direct_kernel's values.
enum class Fp8DirectKernel : int { kRegs = 0, kVec = 1, kCvt = 2, kLean = 3 };

// "regs", "vec", "cvt" or "lean"; false for anything else.
inline bool ParseFp8DirectKernel(const char* s, Fp8DirectKernel* out) {
  if (strcmp(s, "regs") == 0) {
    *out = Fp8DirectKernel::kRegs;
  } else if (strcmp(s, "vec") == 0) {
    *out = Fp8DirectKernel::kVec;
  } else if (strcmp(s, "cvt") == 0) {
    *out = Fp8DirectKernel::kCvt;
  } else if (strcmp(s, "lean") == 0) {
    *out = Fp8DirectKernel::kLean;
  } else {
    return false;
  }
  return true;
}

inline constexpr int kVecThreads = 256;
inline constexpr int kVecPerThread = 8;  // 16-byte vectors held

// 16 source bytes.
struct alignas(16) Fp8Raw16 {
  uint32_t w[4];
};

// The source element size in bytes, and a vector's element count.
template <int kDtype>
WS_FP8_HD constexpr int VecElemBytes() {
  return kDtype == kFp8SrcFloat32 ? 4 : 2;
}
template <int kDtype>
WS_FP8_HD constexpr int VecElems() {
  return 16 / VecElemBytes<kDtype>();
}

// Element e's source bits (little-endian within the 16 bytes).
template <int kDtype>
WS_FP8_HD uint32_t VecBits(const Fp8Raw16& v, int e) {
  if (kDtype == kFp8SrcFloat32) return v.w[e];
  return (v.w[e >> 1] >> (16 * (e & 1))) & 0xFFFFu;
}

// Source bits widened to float32 exactly (as Fp8LoadSource).
template <int kDtype>
WS_FP8_HD float VecWiden(uint32_t bits) {
  if (kDtype == kFp8SrcFloat32) return Fp8FloatOf(bits);
  if (kDtype == kFp8SrcBfloat16) return Fp8FloatOf(bits << 16);
  return Fp8FloatOf(Fp8HalfBits(bits));
}

// |x|'s bits where x is finite, else 0 (what amax ignores).
template <int kDtype>
WS_FP8_HD uint32_t VecAbsFinite(uint32_t bits) {
  if (kDtype == kFp8SrcFloat32) {
    const uint32_t a = bits & 0x7FFFFFFFu;
    return a < 0x7F800000u ? a : 0u;
  }
  const uint32_t a = bits & 0x7FFFu;
  const uint32_t inf = kDtype == kFp8SrcBfloat16 ? 0x7F80u : 0x7C00u;
  return a < inf ? a : 0u;
}

WS_FP8_HD Fp8Raw16 VecLoad(const uint8_t* p) {
  Fp8Raw16 v;
#if defined(__CUDA_ARCH__)
  const uint4 u = __ldg(reinterpret_cast<const uint4*>(p));
  v.w[0] = u.x;
  v.w[1] = u.y;
  v.w[2] = u.z;
  v.w[3] = u.w;
#else
  memcpy(v.w, p, 16);
#endif
  return v;
}

// Whether block b can be walked in aligned 16-byte source vectors and
// whole output words: its width, left column and strides in whole vectors,
// the source 16-byte aligned and the output aligned to a vector's bytes.
template <int kDtype>
WS_FP8_HD bool VecBlockOk(const DirectJob& job, int64_t c0, int64_t w) {
  const int64_t n = VecElems<kDtype>();
  return w % n == 0 && c0 % n == 0 && job.src_stride % n == 0 &&
         job.out.q_stride % n == 0 &&
         reinterpret_cast<uintptr_t>(job.src) % 16 == 0 &&
         reinterpret_cast<uintptr_t>(job.out.q) % n == 0;
}

// Thread t's walk over block b in vectors: vectors t, t + threads, ... of
// the block in row-major order; src and q are byte offsets from job.src
// and job.out.q of the current one. Valid while r < h.
struct VecWalk {
  int32_t h, vw;  // rows, vectors a row
  int64_t i, j;   // the scale's place
  int32_t r, c;   // c in vectors
  int64_t src, q;
  int32_t dr, dc;
  int64_t src_step, q_step, src_row, q_row;
};

template <int kDtype>
WS_FP8_HD VecWalk VecWalkOf(const DirectJob& job, int64_t b, uint32_t t,
                            uint32_t threads) {
  constexpr int kN = VecElems<kDtype>();
  constexpr int kB = VecElemBytes<kDtype>();
  VecWalk k;
  int64_t r0, c0, h, w;
  QuantBlockOf(job.out, b, &r0, &c0, &h, &w, &k.i, &k.j);
  k.h = static_cast<int32_t>(h);
  k.vw = static_cast<int32_t>(w / kN);
  k.r = static_cast<int32_t>(t / k.vw);
  k.c = static_cast<int32_t>(t % k.vw);
  k.src_row = job.src_stride * kB;
  k.q_row = job.out.q_stride;
  k.src = (r0 + k.r) * k.src_row + (c0 + int64_t{k.c} * kN) * kB;
  k.q = (r0 + k.r) * k.q_row + c0 + int64_t{k.c} * kN;
  k.dr = static_cast<int32_t>(threads / k.vw);
  k.dc = static_cast<int32_t>(threads % k.vw);
  k.src_step = int64_t{k.dr} * k.src_row + int64_t{k.dc} * kN * kB;
  k.q_step = int64_t{k.dr} * k.q_row + int64_t{k.dc} * kN;
  return k;
}

template <int kDtype>
WS_FP8_HD void VecNext(VecWalk* k) {
  constexpr int kN = VecElems<kDtype>();
  k->r += k->dr;
  k->c += k->dc;
  k->src += k->src_step;
  k->q += k->q_step;
  if (k->c >= k->vw) {  // dc < vw: one row further at most
    k->c -= k->vw;
    ++k->r;
    k->src += k->src_row - int64_t{k->vw} * kN * VecElemBytes<kDtype>();
    k->q += k->q_row - int64_t{k->vw} * kN;
  }
}

// The largest finite |x| bits of vector v (and acc).
template <int kDtype>
WS_FP8_HD uint32_t VecAmaxBits(uint32_t acc, const Fp8Raw16& v) {
  WS_FP8_UNROLL
  for (int e = 0; e < VecElems<kDtype>(); ++e) {
    const uint32_t a = VecAbsFinite<kDtype>(VecBits<kDtype>(v, e));
    acc = a > acc ? a : acc;
  }
  return acc;
}

// |x|'s largest bits over vector v (and acc), inf and NaN included: one
// 32-bit word per float32 element, else two 16-bit lanes, each the max
// of its half of the elements (on the GPU one bfloat16x2 / half2 max with
// NaN kept, which orders non-negative non-NaN values as their bits do,
// subnormals included; a NaN lane comes out above inf, as its bits are).
// VecTopOf folds the lanes: below inf, the block holds no inf or NaN and
// it is the block's amax bits (VecAmaxBits'), else it is inf or above.
template <int kDtype>
WS_FP8_HD uint32_t VecTop(uint32_t acc, const Fp8Raw16& v) {
  WS_FP8_UNROLL
  for (int w = 0; w < 4; ++w) {
    if (kDtype == kFp8SrcFloat32) {
      const uint32_t a = v.w[w] & 0x7FFFFFFFu;
      acc = a > acc ? a : acc;
      continue;
    }
    const uint32_t a = v.w[w] & 0x7FFF7FFFu;
#if defined(__CUDA_ARCH__)
    uint32_t m;
    if (kDtype == kFp8SrcBfloat16) {
      asm("max.NaN.bf16x2 %0, %1, %2;" : "=r"(m) : "r"(acc), "r"(a));
    } else {
      asm("max.NaN.f16x2 %0, %1, %2;" : "=r"(m) : "r"(acc), "r"(a));
    }
    acc = m;
#else
    const uint32_t lo =
        (a & 0xFFFFu) > (acc & 0xFFFFu) ? a & 0xFFFFu : acc & 0xFFFFu;
    const uint32_t hi = (a >> 16) > (acc >> 16) ? a >> 16 : acc >> 16;
    acc = lo | (hi << 16);
#endif
  }
  return acc;
}

template <int kDtype>
WS_FP8_HD uint32_t VecTopOf(uint32_t acc) {
  if (kDtype == kFp8SrcFloat32) return acc;
  const uint32_t lo = acc & 0xFFFFu, hi = acc >> 16;
  return lo > hi ? lo : hi;
}

// The bits of +inf in the source dtype (VecTopOf's bound).
template <int kDtype>
WS_FP8_HD constexpr uint32_t VecInfBits() {
  return kDtype == kFp8SrcFloat32    ? 0x7F800000u
         : kDtype == kFp8SrcBfloat16 ? 0x7F80u
                                     : 0x7C00u;
}

// q (= x / d, or a NaN x) into the format: Fp8Encode's bytes.
// kFinite (the lean kernel's blocks without inf or NaN, so every q is
// finite): the hardware's bytes alone. For finite |q| >= FMAX its
// saturation gives sign | max, Fp8Encode's answer (checked for every
// finite float32 and both formats on a GPU: gpu_kernels_bench's
// "satfinite cvt" line, bench/results/fp8_probe).
template <bool kCvt, bool kFinite = false>
WS_FP8_HD uint32_t VecEncode2(float q0, float q1, const Fp8Format& f,
                              bool e5m2) {
#if defined(__CUDA_ARCH__)
  if (kCvt && kFinite) {
    float2 p;
    p.x = q0;
    p.y = q1;
    return __nv_cvt_float2_to_fp8x2(p, __NV_SATFINITE,
                                    e5m2 ? __NV_E5M2 : __NV_E4M3);
  }
  if (kCvt) {
    // The hardware rounds |q| < FMAX (IEEE RNE, signs kept); the rest is
    // Fp8Encode's explicitly.
    float2 p;
    p.x = q0;
    p.y = q1;
    uint32_t r = __nv_cvt_float2_to_fp8x2(p, __NV_SATFINITE,
                                          e5m2 ? __NV_E5M2 : __NV_E4M3);
    const uint32_t b0 = Fp8BitsOf(q0), b1 = Fp8BitsOf(q1);
    if ((b0 & 0x7FFFFFFFu) >= f.fmax_f32_bits) {
      r = (r & 0xFF00u) | Fp8Encode(q0, f);
    }
    if ((b1 & 0x7FFFFFFFu) >= f.fmax_f32_bits) {
      r = (r & 0x00FFu) | (uint32_t{Fp8Encode(q1, f)} << 8);
    }
    return r;
  }
#endif
  (void)e5m2;
  return uint32_t{Fp8Encode(q0, f)} | (uint32_t{Fp8Encode(q1, f)} << 8);
}

// Vector v's FP8 bytes at q (a block of scale d): one 8- or 4-byte store.
// kReceipt: their terms added to *sum, the first byte at offset `at` of
// the job's rectangle (job.receipt).
// kDivider: x / d by Fp8Quotient (fp8_math.h's Fp8Divider; the lean
// kernel, bfloat16 and float16 sources only), else Fp8Div.
// kFinite: v holds no inf or NaN (the lean kernel checked its block).
template <int kDtype, bool kCvt, bool kReceipt = false, bool kDivider = false,
          bool kFinite = false>
WS_FP8_HD void VecWrite(uint8_t* q, const Fp8Raw16& v, const Fp8Divider& dv,
                        const Fp8Format& f, bool e5m2,
                        const DirectReceipt* rc = nullptr, int64_t at = 0,
                        uint64_t* sum = nullptr) {
  constexpr int kN = VecElems<kDtype>();
  uint32_t out[kN / 4];
  WS_FP8_UNROLL
  for (int p = 0; p < kN / 2; ++p) {
    const float x0 = VecWiden<kDtype>(VecBits<kDtype>(v, 2 * p));
    const float x1 = VecWiden<kDtype>(VecBits<kDtype>(v, 2 * p + 1));
    // NaN and +-inf pass as they are (+-inf / d is +-inf; Fp8Encode
    // saturates it), the rest divides.
    const bool n0 = !kFinite && (Fp8BitsOf(x0) & 0x7FFFFFFFu) >= 0x7F800000u;
    const bool n1 = !kFinite && (Fp8BitsOf(x1) & 0x7FFFFFFFu) >= 0x7F800000u;
    // kDivider: the caller checked dv.fast (Fp8QuotientFast).
    const float q0 = kDivider ? Fp8QuotientFast(dv, x0) : Fp8Div(x0, dv.d);
    const float q1 = kDivider ? Fp8QuotientFast(dv, x1) : Fp8Div(x1, dv.d);
    const uint32_t pair =
        VecEncode2<kCvt, kFinite>(n0 ? x0 : q0, n1 ? x1 : q1, f, e5m2);
    if (p % 2 == 0) {
      out[p / 2] = pair;
    } else {
      out[p / 2] |= pair << 16;
    }
  }
#if defined(__CUDA_ARCH__)
  if (kN == 8) {
    *reinterpret_cast<uint2*>(q) = make_uint2(out[0], out[kN / 4 - 1]);
  } else {
    *reinterpret_cast<uint32_t*>(q) = out[0];
  }
#else
  memcpy(q, out, kN);
#endif
  if constexpr (kReceipt) {
    const uint64_t index = rc->q_first + static_cast<uint64_t>(at);
    if (static_cast<uint32_t>(index) <= 0xFFFFFFFFu - (kN - 1)) {
      // The low half doesn't wrap within the vector: the keys step by
      // kKeyLo (DirectQTerm's, one add an element).
      const uint32_t key = KeyOf(rc->q_salt, index);
      WS_FP8_UNROLL
      for (int e = 0; e < kN; ++e) {
        *sum += TermOf(key + static_cast<uint32_t>(e) * kKeyLo,
                       (out[e / 4] >> (8 * (e % 4))) & 0xFFu);
      }
    } else {
      for (int e = 0; e < kN; ++e) {
        *sum += DirectQTerm(*rc, at + e, (out[e / 4] >> (8 * (e % 4))) & 0xFFu);
      }
    }
  }
}

// Whether block b's vectors fit `threads` x kPer registers.
template <int kDtype>
WS_FP8_HD bool VecHeld(const DirectJob& job, int64_t b, uint32_t threads,
                       int per_thread) {
  int64_t r0, c0, h, w, i, j;
  QuantBlockOf(job.out, b, &r0, &c0, &h, &w, &i, &j);
  return h * (w / VecElems<kDtype>()) <= int64_t{threads} * per_thread;
}

// Held blocks: thread t's vectors of block b into v; their amax.
template <int kDtype, int kPer>
WS_FP8_HD float VecLoadPart(const DirectJob& job, int64_t b, uint32_t t,
                            uint32_t threads, Fp8Raw16 (&v)[kPer]) {
  VecWalk k = VecWalkOf<kDtype>(job, b, t, threads);
  uint32_t amax = 0;
  WS_FP8_UNROLL
  for (int s = 0; s < kPer; ++s) {
    if (k.r < k.h) {
      v[s] = VecLoad(job.src + k.src);
      amax = VecAmaxBits<kDtype>(amax, v[s]);
    }
    VecNext<kDtype>(&k);
  }
  return VecWiden<kDtype>(amax);
}

// Held blocks: thread t's vectors of block b in v folded by VecTop (kTop)
// or VecAmaxBits. Held: v[s] is the thread's vector s (an array in
// registers, or the lean kernel's shared-memory slots).
template <int kDtype, int kPer, bool kTop, typename Held>
WS_FP8_HD uint32_t VecFoldHeld(const DirectJob& job, int64_t b, uint32_t t,
                               uint32_t threads, const Held& v) {
  VecWalk k = VecWalkOf<kDtype>(job, b, t, threads);
  uint32_t acc = 0;
  WS_FP8_UNROLL
  for (int s = 0; s < kPer; ++s) {
    if (k.r < k.h) {
      acc = kTop ? VecTop<kDtype>(acc, v[s]) : VecAmaxBits<kDtype>(acc, v[s]);
    }
    VecNext<kDtype>(&k);
  }
  return acc;
}

// VecTopOf over them (0 for a thread without any) ...
template <int kDtype, int kPer, typename Held>
WS_FP8_HD uint32_t VecTopPart(const DirectJob& job, int64_t b, uint32_t t,
                              uint32_t threads, const Held& v) {
  return VecTopOf<kDtype>(
      VecFoldHeld<kDtype, kPer, true>(job, b, t, threads, v));
}

// ... and their amax (VecLoadPart's, from the held vectors).
template <int kDtype, int kPer, typename Held>
WS_FP8_HD float VecAmaxHeld(const DirectJob& job, int64_t b, uint32_t t,
                            uint32_t threads, const Held& v) {
  return VecWiden<kDtype>(
      VecFoldHeld<kDtype, kPer, false>(job, b, t, threads, v));
}

// Thread t's held vectors v, walked from k, into the block of divider dv.
template <int kDtype, int kPer, bool kCvt, bool kReceipt, bool kDivider,
          bool kFinite = false, typename Held>
WS_FP8_HD void VecWriteHeld(const DirectJob& job, VecWalk k,
                            const Fp8Divider& dv, const Fp8Format& f,
                            const Held& v, uint64_t* sum) {
  WS_FP8_UNROLL
  for (int s = 0; s < kPer; ++s) {
    if (k.r < k.h) {
      VecWrite<kDtype, kCvt, kReceipt, kDivider, kFinite>(
          job.out.q + k.q, v[s], dv, f, job.out.e5m2, &job.receipt, k.q, sum);
    }
    VecNext<kDtype>(&k);
  }
}

template <int kDtype, bool kCvt, bool kReceipt>
WS_FP8_HD void VecWriteStream(const DirectJob& job, int64_t b, uint32_t t,
                              uint32_t threads, float amax, uint64_t* sum,
                              bool scale_written);

// Held blocks: thread t's FP8 vectors of block b from v, in a block of
// amax `amax`; thread 0 also writes the scale. kReceipt: the terms of what
// the thread stores added to *sum (job.receipt).
// kFinite: as VecWrite (the held vectors hold no inf or NaN).
template <int kDtype, int kPer, bool kCvt, bool kReceipt = false,
          bool kDivider = false, bool kFinite = false, typename Held>
WS_FP8_HD void VecWritePart(const DirectJob& job, int64_t b, uint32_t t,
                            uint32_t threads, float amax, const Held& v,
                            uint64_t* sum = nullptr) {
  const VecWalk k = VecWalkOf<kDtype>(job, b, t, threads);
  const Fp8Format f = Fp8FormatOf(job.out.e5m2);
  const float d = Fp8DequantScale(amax, f);
  if (t == 0) DirectStoreScale<kReceipt>(job, k.i, k.j, d, sum);
  const Fp8Divider dv = kDivider ? Fp8DividerOf(d) : Fp8Divider{d, 1.0f, false};
  if (kDivider && !dv.fast) {
    // A scale outside the divider's range (the whole block, rare): plain
    // divisions of the source read again by the small stream loop, rather
    // than a second unrolled copy of the held loop (half the kernel's code;
    // the same speed on an H100, 12.6 vs 12.4 ms on Qwen3-8B).
    VecWriteStream<kDtype, kCvt, kReceipt>(job, b, t, threads, amax, sum,
                                           /*scale_written=*/true);
    return;
  }
  VecWriteHeld<kDtype, kPer, kCvt, kReceipt, kDivider, kFinite>(job, k, dv, f,
                                                                v, sum);
}

// Blocks too large to hold: thread t's part of the amax, read from the
// source ...
template <int kDtype>
WS_FP8_HD float VecAmaxStream(const DirectJob& job, int64_t b, uint32_t t,
                              uint32_t threads) {
  uint32_t amax = 0;
  for (VecWalk k = VecWalkOf<kDtype>(job, b, t, threads); k.r < k.h;
       VecNext<kDtype>(&k)) {
    amax = VecAmaxBits<kDtype>(amax, VecLoad(job.src + k.src));
  }
  return VecWiden<kDtype>(amax);
}

// ... and its FP8 vectors, read again; thread 0 also writes the scale.
// kReceipt: as VecWritePart.
// scale_written: the caller stored the scale (and summed its term).
template <int kDtype, bool kCvt, bool kReceipt>
WS_FP8_HD void VecWriteStream(const DirectJob& job, int64_t b, uint32_t t,
                              uint32_t threads, float amax, uint64_t* sum,
                              bool scale_written) {
  const Fp8Format f = Fp8FormatOf(job.out.e5m2);
  const float d = Fp8DequantScale(amax, f);
  VecWalk k = VecWalkOf<kDtype>(job, b, t, threads);
  if (t == 0 && !scale_written) {
    DirectStoreScale<kReceipt>(job, k.i, k.j, d, sum);
  }
  const Fp8Divider dv{d, 1.0f, false};
  for (; k.r < k.h; VecNext<kDtype>(&k)) {
    VecWrite<kDtype, kCvt, kReceipt>(job.out.q + k.q, VecLoad(job.src + k.src),
                                     dv, f, job.out.e5m2, &job.receipt, k.q,
                                     sum);
  }
}

// The lean kernel (--fp8_direct_kernel=lean, quant_kernels.cu): every
// block of a job walked in whole aligned 16-byte vectors and held in
// kVecThreads x kVecPerThread registers (VecBlockOk and VecHeld true for
// all of them), so its kernel carries none of the other paths; bfloat16
// and float16 sources divide by Fp8Divider. Jobs of which this is false
// go to the cvt kernel (GpuWorker::PrepareDirect splits a batch).
inline bool DirectLeanOk(const DirectJob& job) {
  const int64_t es =
      job.src_dtype == kFp8SrcFloat32                                       ? 4
      : job.src_dtype == kFp8SrcBfloat16 || job.src_dtype == kFp8SrcFloat16 ? 2
                                                                            : 0;
  if (es == 0) return false;
  const int64_t n = 16 / es;  // elements of a vector
  const QuantJob& o = job.out;
  if (o.rows <= 0 || o.width <= 0) return false;
  const int64_t h = o.rows < o.block_rows ? o.rows : o.block_rows;
  const int64_t w = o.width < o.block_cols ? o.width : o.block_cols;
  return o.block_cols % n == 0 && o.width % n == 0 && job.src_stride % n == 0 &&
         o.q_stride % n == 0 &&
         reinterpret_cast<uintptr_t>(job.src) % 16 == 0 &&
         reinterpret_cast<uintptr_t>(o.q) % n == 0 &&
         h * (w / n) <= int64_t{kVecThreads} * kVecPerThread;
}

}  // namespace cuda
}  // namespace weightsync

#endif  // WEIGHTSYNC_BACKENDS_CUDA_FP8_DIRECT_VEC_H_

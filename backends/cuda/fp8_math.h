// The arithmetic of the GPU FP8 quantisation kernel (quant_kernels.cu):
// docs/protocol.md's one quantisation function ("FP8 targets"), written
// again as plain inline functions that nvcc compiles for the GPU and a C++
// compiler for the CPU. The CPU test (fp8_math_test) runs the very code
// each GPU thread runs, thread by thread, against tests/vectors/fp8.json
// and common/fp8.h, so the GPU writes the host's bytes bit for bit.
//
// Exactness: the two divisions are IEEE float32 divisions rounded to
// nearest even (__fdiv_rn on the GPU: no reciprocal-multiply, no fast-math,
// no flush to zero); amax is a maximum, so the order in which threads
// reduce it changes nothing; rounding into the format is integer
// arithmetic on the float32 bits.
//
// Plain C++17, no CUDA headers needed: includable from any .cc file.
#ifndef WEIGHTSYNC_BACKENDS_CUDA_FP8_MATH_H_
#define WEIGHTSYNC_BACKENDS_CUDA_FP8_MATH_H_

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define WS_FP8_HD __host__ __device__ __forceinline__
#else
#define WS_FP8_HD inline
#endif

namespace weightsync {
namespace cuda {

// The parts of a format that rounding needs (e4m3fn, or e5m2).
struct Fp8Format {
  int mantissa_bits;
  int bias;
  uint32_t max_bits;       // the largest finite value's encoding
  uint32_t nan_bits;       // the NaN written (sign added)
  uint32_t fmax_f32_bits;  // FMAX as float32 bits
  float fmax;              // 448 or 57344
};

WS_FP8_HD Fp8Format Fp8FormatOf(bool e5m2) {
  if (e5m2) return {2, 15, 0x7Bu, 0x7Eu, 0x47600000u, 57344.0f};
  return {3, 7, 0x7Eu, 0x7Fu, 0x43E00000u, 448.0f};
}

WS_FP8_HD uint32_t Fp8BitsOf(float f) {
  uint32_t b;
  memcpy(&b, &f, 4);
  return b;
}

WS_FP8_HD float Fp8FloatOf(uint32_t b) {
  float f;
  memcpy(&f, &b, 4);
  return f;
}

// a / b, an IEEE float32 division rounded to nearest even.
WS_FP8_HD float Fp8Div(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

// The integer m * 2^-shift rounded to nearest, ties to even (shift >= 1).
WS_FP8_HD uint32_t Fp8RoundShift(uint32_t m, int shift) {
  if (shift >= 25) return 0;  // m < 2^24 <= half: rounds to 0
  uint32_t k = m >> shift;
  const uint32_t rem = m & ((1u << shift) - 1);
  const uint32_t half = 1u << (shift - 1);
  if (rem > half || (rem == half && (k & 1))) ++k;
  return k;
}

// q rounded to nearest even into the format; |q| >= FMAX and +-inf
// saturate to +-FMAX; NaN gives the format's NaN with q's sign; -0 stays -0.
WS_FP8_HD uint8_t Fp8Encode(float q, const Fp8Format& f) {
  const uint32_t bits = Fp8BitsOf(q);
  const uint32_t sign = (bits >> 24) & 0x80u;
  const uint32_t a = bits & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return static_cast<uint8_t>(sign | f.nan_bits);
  if (a >= f.fmax_f32_bits) return static_cast<uint8_t>(sign | f.max_bits);
  const int e = static_cast<int>(a >> 23);  // biased float32 exponent
  const int emin = 1 - f.bias;
  if (e - 127 < emin) {
    // A whole number of the format's least subnormal 2^(emin - m); the
    // least normal's encoding is that same number.
    const uint32_t m = e == 0 ? a : ((a & 0x7FFFFFu) | 0x800000u);
    const int shift = (emin - f.mantissa_bits) - ((e == 0 ? 1 : e) - 150);
    return static_cast<uint8_t>(sign | Fp8RoundShift(m, shift));
  }
  const int drop = 23 - f.mantissa_bits;
  // Exponent and mantissa side by side: a carry out of the mantissa raises
  // the exponent; |q| < FMAX keeps it at or below the largest encoding.
  uint32_t r = (static_cast<uint32_t>(e - 127 + f.bias) << f.mantissa_bits) |
               ((a & 0x7FFFFFu) >> drop);
  const uint32_t rem = a & ((1u << drop) - 1);
  const uint32_t half = 1u << (drop - 1);
  if (rem > half || (rem == half && (r & 1))) ++r;
  return static_cast<uint8_t>(sign | r);
}

// max(acc, |x|) where x is finite; acc where x is NaN or +-inf. acc >= 0.
WS_FP8_HD float Fp8AmaxStep(float acc, float x) {
  const uint32_t a = Fp8BitsOf(x) & 0x7FFFFFFFu;
  if (a >= 0x7F800000u) return acc;
  const float v = Fp8FloatOf(a);
  return v > acc ? v : acc;
}

// d = amax / FMAX, or 1 where that quotient is 0.
WS_FP8_HD float Fp8DequantScale(float amax, const Fp8Format& f) {
  const float d = Fp8Div(amax, f.fmax);
  return d == 0.0f ? 1.0f : d;
}

// The FP8 element of x in a block of scale d: NaN keeps x's own sign
// (whatever a division does with it), everything else is x / d rounded.
WS_FP8_HD uint8_t Fp8QuantizeElement(float x, float d, const Fp8Format& f) {
  const bool nan = (Fp8BitsOf(x) & 0x7FFFFFFFu) > 0x7F800000u;
  return Fp8Encode(nan ? x : Fp8Div(x, d), f);
}

// What the scale parameter holds: d, or the float32 division 1 / d.
WS_FP8_HD float Fp8StoredScale(float d, bool reciprocal) {
  return reciprocal ? Fp8Div(1.0f, d) : d;
}

// Four little-endian bytes of v at p (which may be unaligned).
WS_FP8_HD void Fp8StoreScale(uint8_t* p, float v) {
  const uint32_t b = Fp8BitsOf(v);
  p[0] = static_cast<uint8_t>(b);
  p[1] = static_cast<uint8_t>(b >> 8);
  p[2] = static_cast<uint8_t>(b >> 16);
  p[3] = static_cast<uint8_t>(b >> 24);
}

// One launch of the quantisation kernel: rows x width float32 values at x
// (row r at x + r * x_stride elements) cut into block_rows x block_cols
// blocks from the top-left corner (edge blocks may be partial), as
// common/fp8.h's QuantizeBlocks: FP8 element (r, c) to q[r * q_stride + c],
// the stored scale of block (i, j) as 4 bytes at
// scale + 4 * (i * scale_stride + j). One GPU thread block per FP8 block.
struct QuantJob {
  const float* x;
  int64_t rows, width, x_stride;
  int64_t block_rows, block_cols;
  uint8_t* q;
  int64_t q_stride;
  uint8_t* scale;
  int64_t scale_stride;
  bool e5m2, reciprocal;
};

// The number of FP8 blocks of `job` (the launch's grid).
WS_FP8_HD int64_t QuantJobBlocks(const QuantJob& job) {
  return ((job.rows + job.block_rows - 1) / job.block_rows) *
         ((job.width + job.block_cols - 1) / job.block_cols);
}

// Block b of `job`: rows [*r0, *r0 + *h) x cols [*c0, *c0 + *w); its scale's
// place (i, j) in *i, *j.
WS_FP8_HD void QuantBlockOf(const QuantJob& job, int64_t b, int64_t* r0,
                            int64_t* c0, int64_t* h, int64_t* w, int64_t* i,
                            int64_t* j) {
  const int64_t grid_cols = (job.width + job.block_cols - 1) / job.block_cols;
  *i = b / grid_cols;
  *j = b % grid_cols;
  *r0 = *i * job.block_rows;
  *c0 = *j * job.block_cols;
  *h = job.rows - *r0 < job.block_rows ? job.rows - *r0 : job.block_rows;
  *w = job.width - *c0 < job.block_cols ? job.width - *c0 : job.block_cols;
}

// Thread t of `threads` takes elements t, t + threads, ... of block b
// (row-major within the block; a block holds at most 2^26 elements, the
// registration's bound on a row of blocks). Its part of the block's amax.
WS_FP8_HD float QuantAmaxPart(const QuantJob& job, int64_t b, uint32_t t,
                              uint32_t threads) {
  int64_t r0, c0, h, w, i, j;
  QuantBlockOf(job, b, &r0, &c0, &h, &w, &i, &j);
  const uint32_t n = static_cast<uint32_t>(h * w);
  const uint32_t bw = static_cast<uint32_t>(w);
  float amax = 0.0f;
  for (uint32_t e = t; e < n; e += threads) {
    const int64_t r = r0 + e / bw, c = c0 + e % bw;
    amax = Fp8AmaxStep(amax, job.x[r * job.x_stride + c]);
  }
  return amax;
}

// Thread t's FP8 elements of block b, whose amax is `amax`; thread 0 also
// writes the block's scale.
WS_FP8_HD void QuantWritePart(const QuantJob& job, int64_t b, float amax,
                              uint32_t t, uint32_t threads) {
  int64_t r0, c0, h, w, i, j;
  QuantBlockOf(job, b, &r0, &c0, &h, &w, &i, &j);
  const Fp8Format f = Fp8FormatOf(job.e5m2);
  const float d = Fp8DequantScale(amax, f);
  const uint32_t n = static_cast<uint32_t>(h * w);
  const uint32_t bw = static_cast<uint32_t>(w);
  for (uint32_t e = t; e < n; e += threads) {
    const int64_t r = r0 + e / bw, c = c0 + e % bw;
    job.q[r * job.q_stride + c] =
        Fp8QuantizeElement(job.x[r * job.x_stride + c], d, f);
  }
  if (t == 0) {
    Fp8StoreScale(job.scale + 4 * (i * job.scale_stride + j),
                  Fp8StoredScale(d, job.reciprocal));
  }
}

}  // namespace cuda
}  // namespace weightsync

#endif  // WEIGHTSYNC_BACKENDS_CUDA_FP8_MATH_H_

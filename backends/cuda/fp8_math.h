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

#include <cmath>
#include <cstdint>
#include <cstring>

#include "backends/cuda/kernel_math.h"  // the receipt's KeyOf, TermOf

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

// a * b rounded (never contracted into an FMA).
WS_FP8_HD float Fp8Mul(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

// a * b + c rounded once (to nearest even).
WS_FP8_HD float Fp8Fma(float a, float b, float c) {
#if defined(__CUDA_ARCH__)
  return __fmaf_rn(a, b, c);
#else
  return std::fma(a, b, c);
#endif
}

// x / d for the many x of one block, without a division each: with
// y = 1 / d rounded once per block, Markstein's step
//   q0 = x * y,  r = fma(q0, d, -x) (exact),  q = fma(-r, y, q0)
// gives x / d rounded to nearest even wherever the residual r does not
// underflow. With d in [2^-60, 2^60] (`fast`) that holds wherever |x / d|
// >= 2^-24; below, q is within an ulp of a value that small, which every
// FP8 format encodes to the zero of x's sign either way (the residual is
// negated into the second FMA, not the first, so that +-0 and tiny x keep
// their sign). +-inf x gives NaN here: callers pass +-inf and NaN x through
// as they are, never by this quotient. Used only where that was checked
// for every element and every scale (fp8_divide_test: all bfloat16 and
// float16 x, +-inf included, against all amax of their dtype, both
// formats); float32 sources divide (Fp8Div). `fast` false (d outside
// [2^-60, 2^60]): Fp8Div for every element.
struct Fp8Divider {
  float d;  // the block's scale
  float y;  // 1 / d, rounded
  bool fast;
};

WS_FP8_HD Fp8Divider Fp8DividerOf(float d) {
  Fp8Divider v{d, 1.0f, false};
  const uint32_t bits = Fp8BitsOf(d);
  const int e = static_cast<int>((bits >> 23) & 0xFFu);  // biased exponent
  if (e < 127 - 60 || e > 127 + 60 || (bits >> 31) != 0) return v;
#if defined(__CUDA_ARCH__)
  v.y = __frcp_rn(d);  // 1 / d rounded to nearest even, as Fp8Div(1, d)
#else
  v.y = Fp8Div(1.0f, d);
#endif
  v.fast = true;
  return v;
}

// x / d as above, where v.fast (the caller branched on it once per block).
WS_FP8_HD float Fp8QuotientFast(const Fp8Divider& v, float x) {
  const float q0 = Fp8Mul(x, v.y);
  return Fp8Fma(-Fp8Fma(q0, v.d, -x), v.y, q0);
}

// x / d rounded to nearest even (finite x; Fp8QuotientFast's domain).
WS_FP8_HD float Fp8Quotient(const Fp8Divider& v, float x) {
  return v.fast ? Fp8QuotientFast(v, x) : Fp8Div(x, v.d);
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

// Direct quantisation (docs/protocol.md, "FP8 targets on the GPU
// backends"): where an update's whole source is in GPU memory from the
// start, a use's rectangle is quantised straight from the source, with no
// float32 scratch: one GPU thread block per FP8 block loads the block's
// source elements once (widened exactly: NaN sign and payload kept, as
// float_convert.cuh and common/dtype.cc), reduces the amax, and quantises
// the values it holds. The arithmetic is the functions above; what follows
// is where each thread's elements are.

// The source dtypes (weightsync.v1.DType values).
enum : int32_t {
  kFp8SrcFloat32 = 1,
  kFp8SrcBfloat16 = 2,
  kFp8SrcFloat16 = 3,
};

// Threads per block of the direct kernel, and the source elements each
// holds in registers: blocks of up to 16384 elements (128 x 128) are read
// once; larger ones (wide per-row blocks) are read twice (amax, then the
// elements), still without scratch. 1024 x 16 fits 64 registers a thread
// (sm_90, ptxas -v: 64, no real spill), 32 warps per multiprocessor; 512 x
// 32 took 92 registers (16 warps).
inline constexpr int kDirectThreads = 1024;
inline constexpr int kDirectPerThread = 16;

#if defined(__CUDA_ARCH__)
#define WS_FP8_UNROLL _Pragma("unroll")
#else
#define WS_FP8_UNROLL
#endif

// The float32 bits of float16 bits h, exactly (NaN payload and sign kept).
WS_FP8_HD uint32_t Fp8HalfBits(uint32_t h) {
  const uint32_t sign = (h & 0x8000u) << 16;
  const uint32_t e = (h >> 10) & 0x1Fu;
  uint32_t m = h & 0x3FFu;
  if (e == 0x1Fu) return sign | 0x7F800000u | (m << 13);
  if (e != 0) return sign | ((e + 112u) << 23) | (m << 13);
  if (m == 0) return sign;
  // A subnormal m * 2^-24: shift its leading 1 up to bit 10.
  uint32_t exp = 113;  // 2^-14's biased float32 exponent
  while ((m & 0x400u) == 0) {
    m <<= 1;
    --exp;
  }
  return sign | (exp << 23) | ((m & 0x3FFu) << 13);
}

// Element i of a source of dtype kDtype at src (aligned to its size),
// widened to float32 exactly.
template <int kDtype>
WS_FP8_HD float Fp8LoadSource(const uint8_t* src, int64_t i) {
  if (kDtype == kFp8SrcFloat32) {
#if defined(__CUDA_ARCH__)
    return reinterpret_cast<const float*>(src)[i];
#else
    float f;
    memcpy(&f, src + 4 * i, 4);
    return f;
#endif
  }
  uint16_t h;
#if defined(__CUDA_ARCH__)
  h = reinterpret_cast<const uint16_t*>(src)[i];
#else
  memcpy(&h, src + 2 * i, 2);
#endif
  if (kDtype == kFp8SrcBfloat16) return Fp8FloatOf(uint32_t{h} << 16);
  return Fp8FloatOf(Fp8HalfBits(h));
}

// One use's rectangle quantised from its source: source element (r, c) of
// the rectangle at src + (r * src_stride + c) * size of src_dtype; `out`
// as QuantJob (its x and x_stride unused). In a batch, first_block is the
// number of blocks of the jobs before it.
//
// Optional, the job's receipt (docs/protocol.md, "Receipts"): where
// receipt.out is set, the kernel adds to *out (mod 2^64, atomicAdd) the
// ElementTerm of every FP8 byte and every scale it stores, as it stores
// them, so the receipt of an FP8 target costs no second pass over engine
// memory (GpuWorker fuses it: fused_receipts.h). FP8 element (r, c) of the
// rectangle is element q_first + r * out.q_stride + c of the weight salted
// q_salt; the scale of block (i, j) element scale_first + i *
// out.scale_stride + j of the scale parameter salted scale_salt (salts:
// Salt32 of ParameterSalt). The receipt keys an element on its place in
// its parameter, so the index's row strides are the job's own.
struct DirectReceipt {
  unsigned long long* out;  // device memory; nullptr: no receipt
  uint32_t q_salt, scale_salt;
  uint64_t q_first, scale_first;
};

struct DirectJob {
  const uint8_t* src;
  int64_t src_stride;  // elements
  int32_t src_dtype;   // kFp8SrcFloat32, kFp8SrcBfloat16 or kFp8SrcFloat16
  QuantJob out;
  int64_t first_block;
  DirectReceipt receipt;
};

// The receipt term of FP8 byte `q` at offset `at` (r * out.q_stride + c)
// of the job's rectangle ...
WS_FP8_HD uint32_t DirectQTerm(const DirectReceipt& rc, int64_t at,
                               uint32_t q) {
  return TermOf(KeyOf(rc.q_salt, rc.q_first + static_cast<uint64_t>(at)), q);
}

// ... and of the stored scale `v` of block (i, j).
WS_FP8_HD uint32_t DirectScaleTerm(const DirectJob& job, int64_t i, int64_t j,
                                   float v) {
  return TermOf(KeyOf(job.receipt.scale_salt,
                      job.receipt.scale_first +
                          static_cast<uint64_t>(i * job.out.scale_stride + j)),
                Fp8BitsOf(v));
}

// The job of block g of a batch of n jobs (first_block ascending from 0,
// every g below the last job's end): the last job whose first_block <= g.
// `hint` (the caller's last answer) and the job after it are tried first.
WS_FP8_HD int DirectJobOf(const DirectJob* jobs, int n, int64_t g, int hint) {
  for (int j = hint; j >= 0 && j < n && j <= hint + 1; ++j) {
    if (jobs[j].first_block <= g &&
        (j + 1 == n || g < jobs[j + 1].first_block)) {
      return j;
    }
  }
  int lo = 0, hi = n - 1;
  while (lo < hi) {
    const int mid = lo + (hi - lo + 1) / 2;
    if (jobs[mid].first_block <= g) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

// Thread t's walk over block b of a direct job: its elements are t,
// t + threads, ... of the block in row-major order; (r, c) is the current
// one within the block, src and q its element offsets from job.src and
// job.out.q. Valid while r < h.
struct DirectWalk {
  int32_t h, w;  // the block's size (a block holds at most 2^26 elements)
  int64_t i, j;  // its scale's place
  int32_t r, c;
  int64_t src, q;
  int32_t dr, dc;
  int64_t src_step, q_step;
};

WS_FP8_HD DirectWalk DirectWalkOf(const DirectJob& job, int64_t b, uint32_t t,
                                  uint32_t threads) {
  DirectWalk k;
  int64_t r0, c0, h, w;
  QuantBlockOf(job.out, b, &r0, &c0, &h, &w, &k.i, &k.j);
  k.h = static_cast<int32_t>(h);
  k.w = static_cast<int32_t>(w);
  k.r = static_cast<int32_t>(t / w);
  k.c = static_cast<int32_t>(t % w);
  k.src = (r0 + k.r) * job.src_stride + c0 + k.c;
  k.q = (r0 + k.r) * job.out.q_stride + c0 + k.c;
  k.dr = static_cast<int32_t>(threads / w);
  k.dc = static_cast<int32_t>(threads % w);
  k.src_step = int64_t{k.dr} * job.src_stride + k.dc;
  k.q_step = int64_t{k.dr} * job.out.q_stride + k.dc;
  return k;
}

// The walk's next element (`threads` further on in the block).
WS_FP8_HD void DirectNext(const DirectJob& job, DirectWalk* k) {
  k->r += k->dr;
  k->c += k->dc;
  k->src += k->src_step;
  k->q += k->q_step;
  if (k->c >= k->w) {  // dc < w: one row further at most
    k->c -= k->w;
    ++k->r;
    k->src += job.src_stride - k->w;
    k->q += job.out.q_stride - k->w;
  }
}

// Whether block b's elements fit `threads` x kPer registers.
WS_FP8_HD bool DirectHeld(const DirectJob& job, int64_t b, uint32_t threads,
                          int per_thread) {
  int64_t r0, c0, h, w, i, j;
  QuantBlockOf(job.out, b, &r0, &c0, &h, &w, &i, &j);
  return h * w <= static_cast<int64_t>(threads) * per_thread;
}

// Held blocks: thread t loads its elements of block b into v (0 past the
// block's end); returns their amax.
template <int kDtype, int kPer>
WS_FP8_HD float DirectLoadPart(const DirectJob& job, int64_t b, uint32_t t,
                               uint32_t threads, float (&v)[kPer]) {
  DirectWalk k = DirectWalkOf(job, b, t, threads);
  WS_FP8_UNROLL
  for (int e = 0; e < kPer; ++e) {
    v[e] = k.r < k.h ? Fp8LoadSource<kDtype>(job.src, k.src) : 0.0f;
    DirectNext(job, &k);
  }
  float amax = 0.0f;
  WS_FP8_UNROLL
  for (int e = 0; e < kPer; ++e) amax = Fp8AmaxStep(amax, v[e]);
  return amax;
}

// The scale of block (i, j) (thread 0 writes it); kReceipt: its term
// added to *sum.
template <bool kReceipt = false>
WS_FP8_HD void DirectStoreScale(const DirectJob& job, int64_t i, int64_t j,
                                float d, uint64_t* sum = nullptr) {
  const float v = Fp8StoredScale(d, job.out.reciprocal);
  Fp8StoreScale(job.out.scale + 4 * (i * job.out.scale_stride + j), v);
  if constexpr (kReceipt) *sum += DirectScaleTerm(job, i, j, v);
}

// Held blocks: thread t's FP8 elements of block b from v (DirectLoadPart's),
// in a block of amax `amax`; thread 0 also writes the scale. kReceipt: the
// terms of what the thread stores added to *sum (job.receipt).
template <int kPer, bool kReceipt = false>
WS_FP8_HD void DirectWritePart(const DirectJob& job, int64_t b, uint32_t t,
                               uint32_t threads, float amax,
                               const float (&v)[kPer],
                               uint64_t* sum = nullptr) {
  DirectWalk k = DirectWalkOf(job, b, t, threads);
  const Fp8Format f = Fp8FormatOf(job.out.e5m2);
  const float d = Fp8DequantScale(amax, f);
  if (t == 0) DirectStoreScale<kReceipt>(job, k.i, k.j, d, sum);
  WS_FP8_UNROLL
  for (int e = 0; e < kPer; ++e) {
    if (k.r < k.h) {
      const uint8_t q = Fp8QuantizeElement(v[e], d, f);
      job.out.q[k.q] = q;
      if constexpr (kReceipt) *sum += DirectQTerm(job.receipt, k.q, q);
    }
    DirectNext(job, &k);
  }
}

// Blocks too large to hold: thread t's part of block b's amax, read from
// the source ...
template <int kDtype>
WS_FP8_HD float DirectAmaxStream(const DirectJob& job, int64_t b, uint32_t t,
                                 uint32_t threads) {
  float amax = 0.0f;
  for (DirectWalk k = DirectWalkOf(job, b, t, threads); k.r < k.h;
       DirectNext(job, &k)) {
    amax = Fp8AmaxStep(amax, Fp8LoadSource<kDtype>(job.src, k.src));
  }
  return amax;
}

// ... and its FP8 elements, read again; thread 0 also writes the scale.
// kReceipt: as DirectWritePart.
template <int kDtype, bool kReceipt = false>
WS_FP8_HD void DirectWriteStream(const DirectJob& job, int64_t b, uint32_t t,
                                 uint32_t threads, float amax,
                                 uint64_t* sum = nullptr) {
  const Fp8Format f = Fp8FormatOf(job.out.e5m2);
  const float d = Fp8DequantScale(amax, f);
  DirectWalk k = DirectWalkOf(job, b, t, threads);
  if (t == 0) DirectStoreScale<kReceipt>(job, k.i, k.j, d, sum);
  for (; k.r < k.h; DirectNext(job, &k)) {
    const uint8_t q =
        Fp8QuantizeElement(Fp8LoadSource<kDtype>(job.src, k.src), d, f);
    job.out.q[k.q] = q;
    if constexpr (kReceipt) *sum += DirectQTerm(job.receipt, k.q, q);
  }
}

}  // namespace cuda
}  // namespace weightsync

#endif  // WEIGHTSYNC_BACKENDS_CUDA_FP8_MATH_H_

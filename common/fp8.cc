#include "common/fp8.h"

#include <algorithm>
#include <cmath>
#include <cstring>

namespace weightsync {
namespace {

// The parts of a format that rounding needs.
struct Fp8Spec {
  int mantissa_bits;
  int bias;
  uint32_t max_bits;       // the largest finite value's encoding
  uint32_t nan_bits;       // the NaN the daemon writes (sign added)
  uint32_t fmax_f32_bits;  // FMAX as float32 bits
};

Fp8Spec SpecOf(v1::DType format) {
  if (format == v1::FLOAT8_E5M2) {
    return {2, 15, 0x7B, 0x7E, 0x47600000};  // 57344 = 1.75 * 2^15
  }
  return {3, 7, 0x7E, 0x7F, 0x43E00000};  // 448 = 1.75 * 2^8
}

// Rounds the integer m * 2^-shift to nearest, ties to even (shift >= 1).
uint32_t RoundShift(uint32_t m, int shift) {
  if (shift >= 25) return 0;  // m < 2^24 <= half: rounds to 0
  uint32_t k = m >> shift;
  const uint32_t rem = m & ((1u << shift) - 1);
  const uint32_t half = 1u << (shift - 1);
  if (rem > half || (rem == half && (k & 1))) ++k;
  return k;
}

}  // namespace

bool IsFp8(v1::DType dtype) {
  return dtype == v1::FLOAT8_E4M3FN || dtype == v1::FLOAT8_E5M2;
}

float Fp8Max(v1::DType format) {
  return format == v1::FLOAT8_E5M2 ? 57344.0f : 448.0f;
}

uint8_t FloatToFp8(float q, v1::DType format) {
  const Fp8Spec f = SpecOf(format);
  uint32_t bits;
  std::memcpy(&bits, &q, 4);
  const uint32_t sign = (bits >> 24) & 0x80;
  const uint32_t a = bits & 0x7FFFFFFF;
  if (a > 0x7F800000) return static_cast<uint8_t>(sign | f.nan_bits);
  if (a >= f.fmax_f32_bits) return static_cast<uint8_t>(sign | f.max_bits);
  const int e = static_cast<int>(a >> 23);  // biased float32 exponent
  const int emin = 1 - f.bias;              // the format's least exponent
  if (e - 127 < emin) {
    // Below the format's normals: an integer number k of its least
    // subnormal 2^(emin - m); k = 2^m is the least normal, whose encoding
    // is that same integer.
    const uint32_t m = e == 0 ? a : ((a & 0x7FFFFF) | 0x800000);
    const int shift = (emin - f.mantissa_bits) - ((e == 0 ? 1 : e) - 150);
    return static_cast<uint8_t>(sign | RoundShift(m, shift));
  }
  const int drop = 23 - f.mantissa_bits;
  // Exponent and mantissa side by side: a carry out of the mantissa
  // raises the exponent, as rounding should. |q| < FMAX keeps the result
  // at or below the largest finite encoding.
  uint32_t r = (static_cast<uint32_t>(e - 127 + f.bias) << f.mantissa_bits) |
               ((a & 0x7FFFFF) >> drop);
  const uint32_t rem = a & ((1u << drop) - 1);
  const uint32_t half = 1u << (drop - 1);
  if (rem > half || (rem == half && (r & 1))) ++r;
  return static_cast<uint8_t>(sign | r);
}

float Fp8ToFloat(uint8_t bits, v1::DType format) {
  const Fp8Spec f = SpecOf(format);
  const bool negative = bits & 0x80;
  const int exp_bits = 7 - f.mantissa_bits;
  const int exp = (bits >> f.mantissa_bits) & ((1 << exp_bits) - 1);
  const int mant = bits & ((1 << f.mantissa_bits) - 1);
  const int exp_all = (1 << exp_bits) - 1;
  float v;
  if (format == v1::FLOAT8_E5M2 && exp == exp_all) {
    v = mant == 0 ? INFINITY : NAN;
  } else if (format != v1::FLOAT8_E5M2 && (bits & 0x7F) == 0x7F) {
    v = NAN;
  } else if (exp == 0) {
    v = std::ldexp(static_cast<float>(mant), 1 - f.bias - f.mantissa_bits);
  } else {
    v = std::ldexp(static_cast<float>((1 << f.mantissa_bits) | mant),
                   exp - f.bias - f.mantissa_bits);
  }
  return negative ? -v : v;
}

float DequantScale(float amax, v1::DType format) {
  const float d = amax / Fp8Max(format);
  return d == 0.0f ? 1.0f : d;
}

float StoredScale(float d, bool reciprocal) {
  return reciprocal ? 1.0f / d : d;
}

void QuantizeBlocks(const float* x, int64_t rows, int64_t cols,
                    int64_t x_stride, const Fp8Blocks& q, uint8_t* q_out,
                    int64_t q_stride, uint8_t* scale_out,
                    int64_t scale_stride) {
  for (int64_t r0 = 0, i = 0; r0 < rows; r0 += q.block_rows, ++i) {
    const int64_t r1 = std::min(rows, r0 + q.block_rows);
    for (int64_t c0 = 0, j = 0; c0 < cols; c0 += q.block_cols, ++j) {
      const int64_t c1 = std::min(cols, c0 + q.block_cols);
      float amax = 0.0f;
      for (int64_t r = r0; r < r1; ++r) {
        for (int64_t c = c0; c < c1; ++c) {
          const float v = std::fabs(x[r * x_stride + c]);
          if (std::isfinite(v)) amax = std::max(amax, v);
        }
      }
      const float d = DequantScale(amax, q.format);
      for (int64_t r = r0; r < r1; ++r) {
        for (int64_t c = c0; c < c1; ++c) {
          const float v = x[r * x_stride + c];
          // NaN takes x's own sign, whatever a division does with it.
          q_out[r * q_stride + c] =
              FloatToFp8(std::isnan(v) ? v : v / d, q.format);
        }
      }
      const float stored = StoredScale(d, q.reciprocal);
      std::memcpy(scale_out + 4 * (i * scale_stride + j), &stored, 4);
    }
  }
}

}  // namespace weightsync

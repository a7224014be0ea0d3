// FP8 quantisation with one float32 scale per block: the one function the
// daemon applies to FP8 targets and the clients apply to compute their
// receipts' expectation (docs/protocol.md, "FP8 targets"). Bit for bit the
// same as client/python/weightsync/fp8.py; tests/vectors/fp8.json (written
// by tools/fp8_vectors.py with exact rational arithmetic) binds both.
//
// Per block of float32 values x (the source elements converted exactly):
//   amax  = max |x| over the block's finite elements (0 if none)
//   d     = amax / FMAX in float32 (FMAX: 448 e4m3fn, 57344 e5m2);
//           d = 1 where that is 0 (a block of zeros, or amax < FMAX*2^-150)
//   q     = x / d in float32 (IEEE division, round to nearest even)
//   fp8   = q rounded to nearest even into the format; |q| >= FMAX (and
//           +-inf) saturate to +-FMAX; NaN x gives NaN with x's sign
//           (e4m3fn S.1111.111, e5m2 S.11111.10); -0 stays -0
//   scale = d (SCALE_FORM_DEQUANT) or 1.0f / d (SCALE_FORM_RECIPROCAL)
// Pure functions; safe from any thread. No fast-math: the divisions must be
// IEEE float32 divisions.
#ifndef WEIGHTSYNC_COMMON_FP8_H_
#define WEIGHTSYNC_COMMON_FP8_H_

#include <cstdint>

#include "weightsync/v1/types.pb.h"

namespace weightsync {

// True for FLOAT8_E4M3FN and FLOAT8_E5M2.
bool IsFp8(v1::DType dtype);

// The largest finite value of `format`: 448 (e4m3fn), 57344 (e5m2).
float Fp8Max(v1::DType format);

// `q` rounded to nearest even into `format`, saturating (see above).
uint8_t FloatToFp8(float q, v1::DType format);

// The value of an FP8 element (exact; for tests and dequantisation).
float Fp8ToFloat(uint8_t bits, v1::DType format);

// d of a block whose largest finite magnitude is `amax` (see above).
float DequantScale(float amax, v1::DType format);

// What the scale parameter holds for d: d, or 1.0f / d.
float StoredScale(float d, bool reciprocal);

// How a parameter is quantised: format, block shape (PER_ROW: 1 x cols of
// the whole parameter), stored scale form.
struct Fp8Blocks {
  v1::DType format = v1::FLOAT8_E4M3FN;
  int64_t block_rows = 128;
  int64_t block_cols = 128;
  bool reciprocal = false;
};

// Quantises `rows` x `cols` float32 values at `x` (rows `x_stride`
// elements apart), cut into blocks of q.block_rows x q.block_cols from the
// top-left corner (those at the right and bottom edges may be partial):
// FP8 element (r, c) to q_out[r * q_stride + c], the stored scale of block
// (i, j) as 4 little-endian bytes at scale_out + 4 * (i * scale_stride + j).
// Both outputs may be unaligned.
void QuantizeBlocks(const float* x, int64_t rows, int64_t cols,
                    int64_t x_stride, const Fp8Blocks& q, uint8_t* q_out,
                    int64_t q_stride, uint8_t* scale_out, int64_t scale_stride);

}  // namespace weightsync

#endif  // WEIGHTSYNC_COMMON_FP8_H_

// A direct quant step (worker::v1::GpuQuantDirect) as the kernel's job
// (fp8_math.h, DirectJob), and the bytes it reads and writes: shared by the
// GPU worker and the CPU emulation of the steps (quant_steps_test), so both
// read a step the same way. Plain C++, header only; pure functions.
#ifndef WEIGHTSYNC_BACKENDS_CUDA_QUANT_DIRECT_H_
#define WEIGHTSYNC_BACKENDS_CUDA_QUANT_DIRECT_H_

#include <cstdint>

#include "backends/cuda/fp8_math.h"
#include "weightsync/worker/v1/gpu_worker.pb.h"

namespace weightsync {
namespace cuda {

// Bytes of one source element (0: a dtype the direct kernel doesn't read).
inline int64_t DirectSourceElementBytes(int32_t dtype) {
  switch (dtype) {
    case kFp8SrcFloat32:
      return 4;
    case kFp8SrcBfloat16:
    case kFp8SrcFloat16:
      return 2;
    default:
      return 0;
  }
}

// Whether the step's sizes make sense (positive block sides, sizes >= 0,
// strides at least a row, a source dtype the kernel reads, a block of at
// most 2^26 elements), and its extents: the bytes past src_offset that it
// reads, past out.offset and out.scale_offset that it writes (0 where the
// rectangle is empty).
struct DirectExtents {
  bool ok = false;
  int64_t src = 0, q = 0, scale = 0;
};

inline DirectExtents DirectExtentsOf(const worker::v1::GpuQuantDirect& d) {
  DirectExtents x;
  const worker::v1::GpuQuantFlush& f = d.out();
  const int64_t es = DirectSourceElementBytes(d.src_dtype());
  if (es == 0 || f.rows() < 0 || f.width() < 0 || f.block_rows() < 1 ||
      f.block_cols() < 1 || d.src_offset() < 0 || d.src_offset() % es != 0 ||
      f.offset() < 0 || f.scale_offset() < 0) {
    return x;
  }
  x.ok = true;
  if (f.rows() == 0 || f.width() == 0) return x;
  const int64_t h = f.rows() < f.block_rows() ? f.rows() : f.block_rows();
  const int64_t w = f.width() < f.block_cols() ? f.width() : f.block_cols();
  const int64_t grid_rows = (f.rows() + f.block_rows() - 1) / f.block_rows();
  const int64_t grid_cols = (f.width() + f.block_cols() - 1) / f.block_cols();
  if ((f.rows() > 1 && d.src_stride() < f.width()) ||
      (f.rows() > 1 && f.stride() < f.width()) ||
      (grid_rows > 1 && f.scale_stride() < grid_cols) ||
      h * w > (int64_t{1} << 26)) {
    x.ok = false;
    return x;
  }
  x.src = ((f.rows() - 1) * d.src_stride() + f.width()) * es;
  x.q = (f.rows() - 1) * f.stride() + f.width();
  x.scale = 4 * ((grid_rows - 1) * f.scale_stride() + grid_cols);
  return x;
}

// The step's job: its source's element (0, 0) at `src`, the FP8 elements
// at out_base + out.offset, the scales at scale_base + out.scale_offset.
inline DirectJob DirectJobOf(const worker::v1::GpuQuantDirect& d,
                             const uint8_t* src, uint8_t* out_base,
                             uint8_t* scale_base) {
  const worker::v1::GpuQuantFlush& f = d.out();
  DirectJob job{};
  job.src = src;
  job.src_stride = d.src_stride();
  job.src_dtype = d.src_dtype();
  job.out.x = nullptr;
  job.out.rows = f.rows();
  job.out.width = f.width();
  job.out.x_stride = 0;
  job.out.block_rows = f.block_rows();
  job.out.block_cols = f.block_cols();
  job.out.q = out_base + f.offset();
  job.out.q_stride = f.stride();
  job.out.scale = scale_base + f.scale_offset();
  job.out.scale_stride = f.scale_stride();
  job.out.e5m2 = f.format() == 12;  // weightsync.v1.FLOAT8_E5M2
  job.out.reciprocal = f.reciprocal();
  job.first_block = 0;
  return job;
}

}  // namespace cuda
}  // namespace weightsync

#endif  // WEIGHTSYNC_BACKENDS_CUDA_QUANT_DIRECT_H_

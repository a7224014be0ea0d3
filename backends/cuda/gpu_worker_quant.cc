// GpuWorker's FP8 targets (docs/protocol.md, "FP8 targets on the GPU
// backends"): the update's quant steps, built by the daemon
// (quant_steps.h), run on the scatter stream after each chunk's ops.
// Gathers widen a quantised use's elements into the quant scratch
// (CopyConvert2D into float32, exact); a flush quantises a window of
// complete rows of blocks into the engine's FP8 parameter and its scales
// (QuantizeFp8Blocks). Stream order makes the scratch safe to reuse: the
// gathers after a flush are enqueued after it.
#include <algorithm>

#include "absl/strings/str_cat.h"
#include "backends/cuda/cuda_status.h"
#include "backends/cuda/gpu_worker.h"
#include "backends/cuda/quant_kernels.h"
#include "backends/cuda/scatter.h"

namespace weightsync {
namespace {

constexpr int kFloat32 = 1;      // weightsync.v1.FLOAT32
constexpr int kFloat8E5m2 = 12;  // weightsync.v1.FLOAT8_E5M2

}  // namespace

absl::Status GpuWorker::PrepareQuant(
    const worker::v1::BeginUpdateRequest& held) {
  quant_next_step_ = 0;
  if (held.quant_steps_size() == 0) return absl::OkStatus();
  WS_CUDA(cudaSetDevice(scatter_device_));
  return Grow(&quant_scratch_, &quant_scratch_bytes_,
              held.quant_scratch_bytes(), /*pinned=*/false);
}

absl::Status GpuWorker::EnqueueChunkQuant(
    const worker::v1::BeginUpdateRequest& held, int64_t k, const uint8_t* chunk,
    const absl::flat_hash_map<int64_t, Allocation>& allocs) {
  auto outside = [&](int64_t at, int64_t bytes) {
    return at < 0 || bytes < 0 || at + bytes > quant_scratch_bytes_;
  };
  for (; quant_next_step_ < held.quant_steps_size() &&
         held.quant_steps(quant_next_step_).chunk() == k;
       ++quant_next_step_) {
    const worker::v1::GpuQuantStep& s = held.quant_steps(quant_next_step_);
    if (s.has_gather()) {
      const worker::v1::GpuOp& g = s.gather();
      const uint8_t* src = chunk + g.src_offset();
      if (g.src_allocation_id() != 0) {
        absl::StatusOr<uint8_t*> from = BaseOf(allocs, g.src_allocation_id());
        if (!from.ok()) return from.status();
        src = *from + g.src_offset();
      }
      if (g.dst_dtype() != kFloat32 || g.rows() < 1 ||
          outside(g.dst_offset(),
                  (g.rows() - 1) * g.dst_stride() + g.cols() * 4)) {
        return absl::InvalidArgumentError(
            absl::StrCat("quant step ", quant_next_step_,
                         " gathers outside the quant scratch of ",
                         quant_scratch_bytes_, " bytes"));
      }
      WS_CUDA(cuda::CopyConvert2D(
          src, g.src_stride(), g.src_dtype(), quant_scratch_ + g.dst_offset(),
          g.dst_stride(), kFloat32, g.rows(), g.cols(), scatter_stream_));
      continue;
    }
    const worker::v1::GpuQuantFlush& f = s.flush();
    if (outside(f.scratch_offset(), f.rows() * f.width() * 4)) {
      return absl::InvalidArgumentError(
          absl::StrCat("quant step ", quant_next_step_,
                       " quantises outside the quant scratch of ",
                       quant_scratch_bytes_, " bytes"));
    }
    absl::StatusOr<uint8_t*> out = BaseOf(allocs, f.allocation_id());
    if (!out.ok()) return out.status();
    absl::StatusOr<uint8_t*> scales = BaseOf(allocs, f.scale_allocation_id());
    if (!scales.ok()) return scales.status();
    cuda::QuantJob job{};
    job.x = reinterpret_cast<const float*>(quant_scratch_ + f.scratch_offset());
    job.rows = f.rows();
    job.width = f.width();
    job.x_stride = f.width();
    job.block_rows = f.block_rows();
    job.block_cols = f.block_cols();
    job.q = *out + f.offset();
    job.q_stride = f.stride();
    job.scale = *scales + f.scale_offset();
    job.scale_stride = f.scale_stride();
    job.e5m2 = f.format() == kFloat8E5m2;
    job.reciprocal = f.reciprocal();
    WS_CUDA(cuda::QuantizeFp8Blocks(job, scatter_stream_));
  }
  return absl::OkStatus();
}

}  // namespace weightsync

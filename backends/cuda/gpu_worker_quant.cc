// GpuWorker's FP8 targets (docs/protocol.md, "FP8 targets on the GPU
// backends"): the update's quant steps, built by the daemon
// (quant_steps.h), run on the scatter stream after each chunk's ops.
// Gathers widen a quantised use's elements into the quant scratch
// (CopyConvert2D into float32, exact); a flush quantises a window of
// complete rows of blocks into the engine's FP8 parameter and its scales
// (QuantizeFp8Blocks). Stream order makes the scratch safe to reuse: the
// gathers after a flush are enqueued after it. Direct steps (the whole
// source in GPU memory from the start) quantise a use's rectangle straight
// from the source: a chunk's direct steps are one QuantizeFp8Direct launch
// over a table of jobs uploaded at BeginUpdate (kept while the held ops
// and the open allocations are the same). Where the update's receipts are
// fused (PrepareReceipts), the jobs also sum the receipt terms of the FP8
// weights and scales they write.
#include <algorithm>

#include "absl/strings/str_cat.h"
#include "backends/cuda/cuda_status.h"
#include "backends/cuda/gpu_worker.h"
#include "backends/cuda/quant_direct.h"
#include "backends/cuda/quant_kernels.h"
#include "backends/cuda/scatter.h"

namespace weightsync {
namespace {

constexpr int kFloat32 = 1;      // weightsync.v1.FLOAT32
constexpr int kFloat8E5m2 = 12;  // weightsync.v1.FLOAT8_E5M2

}  // namespace

absl::Status GpuWorker::PrepareQuant(
    const worker::v1::BeginUpdateRequest& held,
    const worker::v1::BeginUpdateRequest& request) {
  quant_next_step_ = 0;
  direct_next_batch_ = 0;
  if (held.quant_steps_size() == 0) {
    direct_batches_.clear();
    direct_jobs_.clear();
    direct_ops_id_ = 0;
    return absl::OkStatus();
  }
  WS_CUDA(cudaSetDevice(scatter_device_));
  absl::Status s = Grow(&quant_scratch_, &quant_scratch_bytes_,
                        held.quant_scratch_bytes(), /*pinned=*/false);
  if (!s.ok()) return s;
  return PrepareDirect(held, request);
}

absl::Status GpuWorker::PrepareDirect(
    const worker::v1::BeginUpdateRequest& held,
    const worker::v1::BeginUpdateRequest& request) {
  uint64_t generation;
  {
    absl::MutexLock lock(&mu_);
    generation = allocations_generation_;
  }
  if (request.reuse_ops() && held.ops_id() != 0 &&
      direct_ops_id_ == held.ops_id() && direct_generation_ == generation) {
    return absl::OkStatus();  // the table is this update's
  }
  direct_batches_.clear();
  direct_jobs_.clear();
  direct_ops_id_ = 0;
  // The jobs' receipt fields are planned against this table, and the
  // device's copy is stale from here.
  receipts_ops_id_ = 0;
  direct_upload_ = true;
  absl::flat_hash_map<int64_t, Allocation> allocs;
  {
    absl::MutexLock lock(&mu_);
    allocs = allocations_;
  }
  // Bytes [offset, offset + bytes) of allocation `id` (0: the packed ipc
  // source), or an error naming step i.
  auto at = [&](int i, int64_t id, int64_t offset,
                int64_t bytes) -> absl::StatusOr<uint8_t*> {
    uint8_t* base = nullptr;
    int64_t size = 0;
    if (id == 0) {
      base = const_cast<uint8_t*>(ipc_source_);
      size = request.ipc_source_size();
    } else if (auto it = allocs.find(id); it != allocs.end()) {
      base = it->second.ptr;
      size = it->second.size;
    }
    if (base == nullptr || offset < 0 || bytes < 0 || offset > size ||
        bytes > size - offset) {
      return absl::InvalidArgumentError(absl::StrCat(
          "direct quant step ", i, " addresses bytes [", offset, ", +", bytes,
          ") of ", id == 0 ? "the ipc source" : "allocation ",
          id == 0 ? "" : absl::StrCat(id), ", which holds ", size));
    }
    return base + offset;
  };
  std::vector<cuda::DirectJob>& jobs = direct_jobs_;
  for (int i = 0; i < held.quant_steps_size(); ++i) {
    const worker::v1::GpuQuantStep& step = held.quant_steps(i);
    if (!step.has_direct()) continue;
    // The whole source must be readable from the first step.
    if (request.staged() || request.ipc_ring_slots() != 0 ||
        (ipc_source_ == nullptr && !request.ipc_registered_source())) {
      return absl::InvalidArgumentError(absl::StrCat(
          "direct quant step ", i,
          " needs the whole source in GPU memory (ipc, not staged, no ring)"));
    }
    const worker::v1::GpuQuantDirect& d = step.direct();
    const cuda::DirectExtents x = cuda::DirectExtentsOf(d);
    if (!x.ok) {
      return absl::InvalidArgumentError(
          absl::StrCat("direct quant step ", i, " has invalid sizes"));
    }
    if (x.src == 0) continue;  // an empty rectangle
    absl::StatusOr<uint8_t*> src =
        at(i, d.src_allocation_id(), d.src_offset(), x.src);
    if (!src.ok()) return src.status();
    if (reinterpret_cast<uintptr_t>(*src) %
            cuda::DirectSourceElementBytes(d.src_dtype()) !=
        0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "direct quant step ", i, "'s source is not element-aligned"));
    }
    absl::StatusOr<uint8_t*> q =
        at(i, d.out().allocation_id(), d.out().offset(), x.q);
    if (!q.ok()) return q.status();
    absl::StatusOr<uint8_t*> scale =
        at(i, d.out().scale_allocation_id(), d.out().scale_offset(), x.scale);
    if (!scale.ok()) return scale.status();
    if (d.out().allocation_id() == 0 || d.out().scale_allocation_id() == 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "direct quant step ", i, " writes no engine allocation"));
    }
    if (direct_batches_.empty() ||
        direct_batches_.back().chunk != step.chunk()) {
      if (!direct_batches_.empty() &&
          direct_batches_.back().chunk > step.chunk()) {
        return absl::InvalidArgumentError(
            absl::StrCat("direct quant step ", i, " is out of chunk order"));
      }
      DirectBatch b;
      b.chunk = step.chunk();
      b.first = static_cast<int64_t>(jobs.size());
      direct_batches_.push_back(b);
    }
    DirectBatch& b = direct_batches_.back();
    // DirectJobOf adds the offsets to the bases: give it the bases.
    cuda::DirectJob job = cuda::DirectJobOf(d, *src, *q - d.out().offset(),
                                            *scale - d.out().scale_offset());
    job.first_block = b.blocks;
    b.blocks += cuda::QuantJobBlocks(job.out);
    ++b.count;
    jobs.push_back(job);
  }
  SplitDirectBatches();
  for (const DirectBatch& b : direct_batches_) {
    if (b.chunk < 0 || b.chunk >= request.chunk_sizes_size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("direct quant steps of chunk ", b.chunk, " in ",
                       request.chunk_sizes_size(), " chunks"));
    }
    if (b.blocks > 0x7FFFFFFF) {
      return absl::InvalidArgumentError("a batch of direct quant steps of " +
                                        absl::StrCat(b.blocks) + " blocks");
    }
  }
  if (request.ipc_registered_source() && held.ops_id() != 0) {
    direct_ops_id_ = held.ops_id();
    direct_generation_ = generation;
  }
  return absl::OkStatus();
}

void GpuWorker::SplitDirectBatches() {
  if (fp8_direct_kernel_ != cuda::Fp8DirectKernel::kLean) return;
  constexpr int32_t kDtypes[3] = {cuda::kFp8SrcFloat32, cuda::kFp8SrcBfloat16,
                                  cuda::kFp8SrcFloat16};
  std::vector<DirectBatch> parts;
  for (const DirectBatch& b : direct_batches_) {
    std::vector<cuda::DirectJob> group[4];  // lean by dtype, then the rest
    for (int64_t i = b.first; i < b.first + b.count; ++i) {
      const cuda::DirectJob& job = direct_jobs_[i];
      int g = 3;
      if (cuda::DirectLeanOk(job)) {
        for (int d = 0; d < 3; ++d) {
          if (job.src_dtype == kDtypes[d]) g = d;
        }
      }
      group[g].push_back(job);
    }
    int64_t at = b.first;
    for (int g = 0; g < 4; ++g) {
      if (group[g].empty()) continue;
      DirectBatch p;
      p.chunk = b.chunk;
      p.first = at;
      p.lean_dtype = g < 3 ? kDtypes[g] : 0;
      for (cuda::DirectJob& job : group[g]) {
        job.first_block = p.blocks;
        p.blocks += cuda::QuantJobBlocks(job.out);
        ++p.count;
        direct_jobs_[at++] = job;
      }
      parts.push_back(p);
    }
  }
  direct_batches_.swap(parts);
}

absl::Status GpuWorker::UploadDirect() {
  for (DirectBatch& b : direct_batches_) {
    b.receipts = false;
    for (int64_t i = b.first; i < b.first + b.count; ++i) {
      b.receipts = b.receipts || direct_jobs_[i].receipt.out != nullptr;
    }
  }
  if (!direct_upload_ || direct_jobs_.empty()) return absl::OkStatus();
  const int64_t bytes = static_cast<int64_t>(sizeof(cuda::DirectJob)) *
                        static_cast<int64_t>(direct_jobs_.size());
  WS_CUDA(cudaSetDevice(scatter_device_));
  // An earlier update's launch (one aborted) may still read the table.
  WS_CUDA(cudaStreamSynchronize(scatter_stream_));
  absl::Status grown =
      Grow(&direct_dev_, &direct_dev_bytes_, bytes, /*pinned=*/false);
  if (!grown.ok()) return grown;
  WS_CUDA(cudaMemcpy(direct_dev_, direct_jobs_.data(), bytes,
                     cudaMemcpyHostToDevice));
  direct_upload_ = false;
  return absl::OkStatus();
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
    if (s.has_direct()) continue;  // the chunk's batch, below
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
  // The chunk's direct steps (they touch no scratch).
  return EnqueueDirect(k, scatter_stream_);
}

absl::Status GpuWorker::EnqueueDirect(int64_t k, cudaStream_t stream) {
  // One launch a batch; with --fp8_direct_kernel=lean, one for each run
  // SplitDirectBatches cut.
  while (direct_next_batch_ < direct_batches_.size() &&
         (k < 0 || direct_batches_[direct_next_batch_].chunk == k)) {
    const DirectBatch& b = direct_batches_[direct_next_batch_++];
    const auto* jobs =
        reinterpret_cast<const cuda::DirectJob*>(direct_dev_) + b.first;
    if (b.lean_dtype != 0) {
      WS_CUDA(cuda::QuantizeFp8DirectLean(jobs, b.count, b.blocks, b.lean_dtype,
                                          scatter_stream_, b.receipts));
    } else {
      const cuda::Fp8DirectKernel kernel =
          fp8_direct_kernel_ == cuda::Fp8DirectKernel::kLean
              ? cuda::Fp8DirectKernel::kCvt
              : fp8_direct_kernel_;
      WS_CUDA(cuda::QuantizeFp8Direct(jobs, b.count, b.blocks, scatter_stream_,
                                      kernel, b.receipts));
    }
  }
  return absl::OkStatus();
}

}  // namespace weightsync

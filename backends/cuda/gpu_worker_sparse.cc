// GpuWorker's sparse patches (owner thread): payloads assembled from their
// chunks, indices checked and patches applied in batched launches, and the
// verdict read back once the update's GPU work is complete.
#include <algorithm>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "backends/cuda/cuda_status.h"
#include "backends/cuda/gpu_worker.h"
#include "backends/cuda/scatter.h"
#include "backends/cuda/sparse_kernels.h"

namespace weightsync {

namespace {
constexpr int64_t kReportBytes = sizeof(cuda::SparseIndexReport);
}  // namespace

absl::Status GpuWorker::PrepareSparse(
    const worker::v1::BeginUpdateRequest& request) {
  const int n = request.sparse_size();
  sparse_offsets_.assign(n, 0);
  sparse_have_.assign(n, 0);
  sparse_payload_.assign(n, nullptr);
  jobs_used_ = 0;
  sparse_next_piece_ = 0;
  sparse_names_.clear();
  sparse_numel_.clear();
  if (n == 0) return absl::OkStatus();
  // Reports first (8-byte aligned), then each payload 256-byte aligned, so
  // indices and values are aligned to their sizes.
  int64_t at = (n * kReportBytes + 255) / 256 * 256;
  int64_t jobs = n;
  int64_t tiles = 0;  // at least as many as any one batch has
  for (int p = 0; p < n; ++p) {
    const worker::v1::GpuSparsePatch& g = request.sparse(p);
    jobs += g.uses_size();
    tiles += (std::max<int64_t>(g.nnz(), 0) + cuda::kSparseTileEntries - 1) /
             cuda::kSparseTileEntries * std::max(1, g.uses_size());
    const int64_t es = cuda::DTypeSize(g.dtype());
    if ((g.index_bytes() != 4 && g.index_bytes() != 8) || es == 0 ||
        g.nnz() < 0 || g.numel() < 0 || g.cols() < 1 ||
        g.payload_bytes() != g.nnz() * (g.index_bytes() + es)) {
      return absl::InvalidArgumentError(
          absl::StrCat("sparse patch '", g.name(), "' is malformed (nnz ",
                       g.nnz(), ", index bytes ", g.index_bytes(), ", payload ",
                       g.payload_bytes(), " bytes)"));
    }
    sparse_offsets_[p] = at;
    at += (g.payload_bytes() + 255) / 256 * 256;
    sparse_names_.push_back(g.name());
    sparse_numel_.push_back(g.numel());
  }
  int64_t prev_chunk = 0;
  for (const worker::v1::GpuSparsePiece& piece : request.sparse_pieces()) {
    if (piece.patch() < 0 || piece.patch() >= n || piece.chunk() < prev_chunk ||
        piece.chunk() >= request.chunk_sizes_size() || piece.length() < 0 ||
        piece.patch_offset() < 0 || piece.chunk_offset() < 0 ||
        piece.patch_offset() + piece.length() >
            request.sparse(piece.patch()).payload_bytes() ||
        piece.chunk_offset() + piece.length() >
            request.chunk_sizes(piece.chunk())) {
      return absl::InvalidArgumentError(absl::StrCat(
          "sparse piece of patch ", piece.patch(), " in chunk ", piece.chunk(),
          " lies outside its patch or chunk (or out of chunk order)"));
    }
    prev_chunk = piece.chunk();
  }
  WS_CUDA(cudaSetDevice(device_));
  const int64_t job_bytes = jobs * sizeof(cuda::SparseJob);
  absl::Status s = Grow(&sparse_dev_, &sparse_dev_bytes_, at, false);
  if (s.ok()) {
    s = Grow(&sparse_host_, &sparse_host_bytes_, n * kReportBytes, true);
  }
  if (s.ok()) s = Grow(&jobs_host_, &jobs_host_bytes_, job_bytes, true);
  if (s.ok()) s = Grow(&jobs_dev_, &jobs_dev_bytes_, job_bytes, false);
  if (s.ok()) {
    s = Grow(&tile_jobs_dev_, &tile_jobs_bytes_,
             std::max<int64_t>(tiles, 1) * sizeof(int32_t), false);
  }
  if (!s.ok()) return s;
  // No patch refused until checked (a patch with no pieces: nnz 0).
  std::memset(sparse_host_, 0, n * kReportBytes);
  WS_CUDA(cuda::SparseResetReports(
      reinterpret_cast<cuda::SparseIndexReport*>(sparse_dev_), n,
      scatter_stream_));
  return absl::OkStatus();
}

absl::Status GpuWorker::EnqueueChunkSparse(
    const worker::v1::BeginUpdateRequest& request, int64_t k,
    const uint8_t* chunk,
    const absl::flat_hash_map<int64_t, Allocation>& allocs, bool apply) {
  std::vector<int> done;
  for (; sparse_next_piece_ < request.sparse_pieces_size() &&
         request.sparse_pieces(sparse_next_piece_).chunk() == k;
       ++sparse_next_piece_) {
    const worker::v1::GpuSparsePiece& piece =
        request.sparse_pieces(sparse_next_piece_);
    const int p = piece.patch();
    const worker::v1::GpuSparsePatch& g = request.sparse(p);
    const uint8_t* in = chunk + piece.chunk_offset();
    uint8_t* payload = sparse_dev_ + sparse_offsets_[p];
    if (piece.patch_offset() == 0 && piece.length() == g.payload_bytes() &&
        reinterpret_cast<uintptr_t>(in) % 8 == 0) {
      sparse_payload_[p] = in;  // whole in this chunk: no copy
    } else {
      WS_CUDA(cudaMemcpyAsync(payload + piece.patch_offset(), in,
                              piece.length(), cudaMemcpyDeviceToDevice,
                              scatter_stream_));
      sparse_payload_[p] = payload;
    }
    sparse_have_[p] += piece.length();
    if (sparse_have_[p] == g.payload_bytes()) done.push_back(p);
  }
  if (done.empty()) return absl::OkStatus();
  const int64_t checks = jobs_used_;
  for (int p : done) AddCheckJob(request, p);
  absl::Status s = LaunchJobs(checks, /*apply=*/false);
  if (!s.ok() || !apply) return s;
  const int64_t applies = jobs_used_;
  for (int p : done) {
    s = AddApplyJobs(request, p, allocs);
    if (!s.ok()) return s;
  }
  return LaunchJobs(applies, /*apply=*/true);
}

void GpuWorker::AddCheckJob(const worker::v1::BeginUpdateRequest& request,
                            int p) {
  const worker::v1::GpuSparsePatch& g = request.sparse(p);
  cuda::SparseJob& j = jobs_host_[jobs_used_++];
  j = cuda::SparseJob{};
  j.indices = sparse_payload_[p];
  j.values = sparse_payload_[p] + g.nnz() * g.index_bytes();
  j.report = reinterpret_cast<cuda::SparseIndexReport*>(sparse_dev_ +
                                                        p * kReportBytes);
  j.nnz = g.nnz();
  j.cols = g.cols();
  j.numel = g.numel();
  j.index_bytes = g.index_bytes();
  j.value_dtype = g.dtype();
}

absl::Status GpuWorker::AddApplyJobs(
    const worker::v1::BeginUpdateRequest& request, int p,
    const absl::flat_hash_map<int64_t, Allocation>& allocs) {
  const worker::v1::GpuSparsePatch& g = request.sparse(p);
  for (const worker::v1::GpuSparseUse& u : g.uses()) {
    absl::StatusOr<uint8_t*> base = BaseOf(allocs, u.allocation_id());
    if (!base.ok()) return base.status();
    AddCheckJob(request, p);  // the same patch fields; the report guards
    cuda::SparseUse& use = jobs_host_[jobs_used_ - 1].use;
    use.param = *base + u.param_offset();
    use.dtype = u.dtype();
    use.implicit = u.implicit();
    use.row_begin = u.row_begin();
    use.row_count = u.row_count();
    use.col_begin = u.col_begin();
    use.col_count = u.col_count();
    use.dest_offset = u.dest_offset();
    use.dest_row_stride = u.dest_row_stride();
  }
  return absl::OkStatus();
}

absl::Status GpuWorker::LaunchJobs(int64_t first, bool apply) {
  const int64_t n = jobs_used_ - first;
  if (n == 0) return absl::OkStatus();
  int64_t tiles = 0;
  WS_CUDA(cuda::PlanSparseJobs(jobs_host_ + first, n, apply, &tiles));
  if (tiles * static_cast<int64_t>(sizeof(int32_t)) > tile_jobs_bytes_) {
    return absl::InternalError(absl::StrCat(
        "sparse batch of ", tiles, " tiles exceeds the ",
        tile_jobs_bytes_ / sizeof(int32_t), " PrepareSparse sized"));
  }
  // Each slot is written once per update, so the host array needs no
  // synchronisation with this copy.
  WS_CUDA(cudaMemcpyAsync(jobs_dev_ + first, jobs_host_ + first,
                          n * sizeof(cuda::SparseJob), cudaMemcpyHostToDevice,
                          scatter_stream_));
  WS_CUDA(apply ? cuda::SparseApplyBatch(jobs_dev_ + first, n, tiles,
                                         tile_jobs_dev_, scatter_stream_)
                : cuda::SparseCheckBatch(jobs_dev_ + first, n, tiles,
                                         tile_jobs_dev_, scatter_stream_));
  return absl::OkStatus();
}

absl::Status GpuWorker::CopyReportsOut() {
  if (sparse_names_.empty()) return absl::OkStatus();
  WS_CUDA(cudaMemcpyAsync(sparse_host_, sparse_dev_,
                          sparse_names_.size() * kReportBytes,
                          cudaMemcpyDeviceToHost, scatter_stream_));
  return absl::OkStatus();
}

absl::Status GpuWorker::SparseVerdict() const {
  const auto* reports =
      static_cast<const cuda::SparseIndexReport*>(sparse_host_);
  for (size_t p = 0; p < sparse_names_.size(); ++p) {
    const cuda::SparseIndexReport& r = reports[p];
    if (r.out_of_range == 0) continue;
    return absl::InvalidArgumentError(absl::StrCat(
        "tensor '", sparse_names_[p], "': sparse index at position ",
        r.first_out_of_range, " is outside [0, ", sparse_numel_[p], ") (",
        r.out_of_range, " such); the patch was not applied"));
  }
  return absl::OkStatus();
}

}  // namespace weightsync

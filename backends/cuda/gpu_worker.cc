#include "backends/cuda/gpu_worker.h"

#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "backends/cuda/cuda_status.h"
#include "backends/cuda/gpu_uuid.h"
#include "backends/cuda/receipt_kernels.h"
#include "backends/cuda/scatter.h"
#include "backends/cuda/sparse_kernels.h"
#include "common/grpc_status.h"
#include "glog/logging.h"

namespace weightsync {

// ------------------------------------------------------------ owner thread

struct OwnerThread::Task {
  std::function<absl::Status()> fn;
  bool done = false;
  absl::Status status;
};

OwnerThread::OwnerThread() : thread_([this] { Loop(); }) {}

OwnerThread::~OwnerThread() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  thread_.join();
}

void OwnerThread::Post(std::function<void()> fn) {
  auto task = std::make_shared<Task>();
  task->fn = [fn = std::move(fn)]() {
    fn();
    return absl::OkStatus();
  };
  absl::MutexLock lock(&mu_);
  queue_.push_back(std::move(task));
}

absl::Status OwnerThread::Run(std::function<absl::Status()> fn,
                              absl::Time deadline) {
  auto task = std::make_shared<Task>();
  task->fn = std::move(fn);
  absl::MutexLock lock(&mu_);
  queue_.push_back(task);
  auto done = [&task]() { return task->done; };
  if (!mu_.AwaitWithDeadline(absl::Condition(&done), deadline)) {
    return absl::DeadlineExceededError("GPU worker: call still running");
  }
  return task->status;
}

void OwnerThread::Loop() {
  absl::MutexLock lock(&mu_);
  while (true) {
    auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return stop_ || !queue_.empty();
    };
    mu_.Await(absl::Condition(&ready));
    if (stop_) return;
    std::shared_ptr<Task> task = queue_.front();
    queue_.pop_front();
    mu_.Unlock();
    absl::Status s = task->fn();
    mu_.Lock();
    task->status = std::move(s);
    task->done = true;
  }
}

// ------------------------------------------------------------ worker

GpuWorker::GpuWorker(int device, bool sm_copies)
    : scatter_device_(device), sm_copies_(sm_copies), device_(device) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) n = 0;
  for (int i = 0; i < n; ++i) {
    uuids_.push_back(GpuUuid(i));
  }
  // Every GPU may write every other GPU's engine memory (TP across GPUs).
  for (int i = 0; i < n; ++i) {
    cudaSetDevice(i);
    for (int j = 0; j < n; ++j) {
      int can = 0;
      if (i != j && cudaDeviceCanAccessPeer(&can, i, j) == cudaSuccess && can) {
        cudaDeviceEnablePeerAccess(j, 0);
        cudaGetLastError();  // already enabled is fine
      }
    }
  }
  LOG(INFO) << "GPU worker: " << n << " device(s)";
}

GpuWorker::~GpuWorker() {
  // Process exit releases the context; nothing here may hang.
}

absl::Time GpuWorker::Deadline(const grpc::ServerContext* ctx) const {
  const auto d = ctx->deadline();
  if (d == std::chrono::system_clock::time_point::max()) {
    return absl::Now() + absl::Seconds(30);
  }
  return absl::FromChrono(d);
}

grpc::Status GpuWorker::Ping(grpc::ServerContext*,
                             const worker::v1::PingRequest*,
                             worker::v1::PingResponse* response) {
  for (const auto& u : uuids_) response->add_device_uuids(u);
  absl::MutexLock lock(&mu_);
  response->set_allocations(allocations_.size());
  int v = 0;
  cudaRuntimeGetVersion(&v);
  response->set_build_info(absl::StrCat("CUDA runtime ", v / 1000, ".",
                                        (v % 1000) / 10, ", NCCL ", NCCL_MAJOR,
                                        ".", NCCL_MINOR, ".", NCCL_PATCH));
  return grpc::Status::OK;
}

grpc::Status GpuWorker::OpenAllocation(
    grpc::ServerContext* ctx, const worker::v1::OpenAllocationRequest* request,
    worker::v1::OpenAllocationResponse* response) {
  int device = -1;
  for (size_t i = 0; i < uuids_.size(); ++i) {
    if (uuids_[i] == request->device_uuid()) device = i;
  }
  if (device < 0) {
    return ToGrpcStatus(absl::NotFoundError(absl::StrCat(
        "GPU ", request->device_uuid(), " is not visible to this daemon")));
  }
  Allocation a;
  absl::Status s = owner_.Run(
      [&]() -> absl::Status {
        absl::StatusOr<Allocation> m =
            MapShared(request->handle(), request->size(), request->vmm());
        if (!m.ok()) return m.status();
        a = *m;
        return absl::OkStatus();
      },
      Deadline(ctx));
  if (!s.ok()) return ToGrpcStatus(s);
  a.device = device;
  absl::MutexLock lock(&mu_);
  allocations_[request->allocation_id()] = a;
  response->set_device(device);
  return grpc::Status::OK;
}

grpc::Status GpuWorker::CloseAllocation(
    grpc::ServerContext* ctx, const worker::v1::CloseAllocationRequest* request,
    worker::v1::Empty*) {
  Allocation a;
  {
    absl::MutexLock lock(&mu_);
    auto it = allocations_.find(request->allocation_id());
    if (it == allocations_.end()) return grpc::Status::OK;
    a = it->second;
    allocations_.erase(it);
  }
  return ToGrpcStatus(owner_.Run(
      [&]() -> absl::Status {
        Unmap(&a);
        return absl::OkStatus();
      },
      Deadline(ctx)));
}

absl::StatusOr<GpuWorker::Allocation> GpuWorker::MapShared(
    const std::string& handle, int64_t size, bool vmm) {
  // Mapped for the GPU that runs the copies: for memory on another GPU the
  // driver sets up peer access for this mapping.
  WS_CUDA(cudaSetDevice(scatter_device_));
  Allocation a;
  a.size = size;
  if (vmm) {
    std::pair<std::string, std::string> parts = absl::StrSplit(handle, ':');
    int pid = 0, fd = -1;
    if (!absl::SimpleAtoi(parts.first, &pid) ||
        !absl::SimpleAtoi(parts.second, &fd) || pid <= 0 || fd < 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "a CUDA VMM handle is \"<pid>:<fd>\", not \"", handle, "\""));
    }
    absl::StatusOr<int> mine = cuda::DuplicatePeerFd(pid, fd);
    if (!mine.ok()) return mine.status();
    absl::StatusOr<cuda::VmmMemory> m =
        cuda::VmmImport(*mine, static_cast<size_t>(size), scatter_device_);
    close(*mine);  // the import holds the memory
    if (!m.ok()) return m.status();
    a.vmm = *m;
    a.ptr = static_cast<uint8_t*>(m->ptr);
    return a;
  }
  if (handle.size() != sizeof(cudaIpcMemHandle_t)) {
    return absl::InvalidArgumentError(
        absl::StrCat("a CUDA IPC handle has ", sizeof(cudaIpcMemHandle_t),
                     " bytes, not ", handle.size()));
  }
  cudaIpcMemHandle_t h;
  std::memcpy(&h, handle.data(), sizeof(h));
  void* p = nullptr;
  WS_CUDA(cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess));
  a.ptr = static_cast<uint8_t*>(p);
  // The registered size is the engine's word: hold it to the allocation.
  absl::StatusOr<size_t> real = cuda::BytesFrom(p);
  if (real.ok() && static_cast<size_t>(size) > *real) {
    Unmap(&a);
    return absl::InvalidArgumentError(
        absl::StrCat("registered size ", size, " exceeds the ", *real,
                     " bytes the CUDA IPC handle's allocation holds"));
  }
  return a;
}

void GpuWorker::Unmap(Allocation* a) {
  if (a->ptr == nullptr) return;
  cudaSetDevice(scatter_device_);
  if (a->vmm.ptr != nullptr) {
    cuda::VmmFree(&a->vmm);
  } else {
    cudaIpcCloseMemHandle(a->ptr);
  }
  a->ptr = nullptr;
}

grpc::Status GpuWorker::InitGroup(grpc::ServerContext* ctx,
                                  const worker::v1::InitGroupRequest* request,
                                  worker::v1::Empty*) {
  if (request->nccl_unique_id().size() != sizeof(ncclUniqueId)) {
    return ToGrpcStatus(absl::InvalidArgumentError(
        absl::StrCat("nccl_unique_id must be ", sizeof(ncclUniqueId),
                     " bytes, not ", request->nccl_unique_id().size())));
  }
  if (request->device() != scatter_device_) {
    return ToGrpcStatus(absl::InvalidArgumentError(
        absl::StrCat("this worker scatters on GPU ", scatter_device_, ", not ",
                     request->device())));
  }
  if (request->device() < 0 ||
      request->device() >= static_cast<int>(uuids_.size())) {
    return ToGrpcStatus(absl::InvalidArgumentError(
        absl::StrCat("GPU ", request->device(), " does not exist (",
                     uuids_.size(), " visible)")));
  }
  ncclUniqueId id;
  std::memcpy(&id, request->nccl_unique_id().data(), sizeof(id));
  return ToGrpcStatus(owner_.Run(
      [&, id]() mutable -> absl::Status {
        if (comm_ != nullptr) {  // a new group replaces the old one
          ncclCommAbort(comm_);
          comm_ = nullptr;
        }
        update_active_ = false;
        enqueue_timeout_ = request->timeout_ms() > 0
                               ? absl::Milliseconds(request->timeout_ms())
                               : kDefaultEnqueueTimeout;
        device_ = request->device();
        WS_CUDA(cudaSetDevice(device_));
        absl::Status streams = EnsureStreams();
        if (!streams.ok()) return streams;
        ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
        config.blocking = 0;  // every wait is ours, with a deadline
        comm_ready_ = false;
        WS_NCCL(ncclCommInitRankConfig(&comm_, request->world_size(), id,
                                       request->rank(), &config));
        LOG(INFO) << "NCCL rank " << request->rank() << " of "
                  << request->world_size() << " on GPU " << device_
                  << " initialising";
        return absl::OkStatus();
      },
      Deadline(ctx)));
}

absl::Status GpuWorker::WaitComm(absl::Time deadline) {
  if (comm_ == nullptr) {
    return absl::FailedPreconditionError("no NCCL group: InitGroup first");
  }
  while (!comm_ready_) {
    ncclResult_t state;
    WS_NCCL(ncclCommGetAsyncError(comm_, &state));
    if (state == ncclSuccess) {
      comm_ready_ = true;
      break;
    }
    WS_NCCL(state);
    if (absl::Now() > deadline) {
      return absl::DeadlineExceededError(
          "NCCL group not formed before the deadline (is the trainer "
          "joining?)");
    }
    absl::SleepFor(absl::Microseconds(200));
  }
  return absl::OkStatus();
}

absl::Status GpuWorker::EnsureStreams() {
  if (recv_stream_ != nullptr) return absl::OkStatus();
  WS_CUDA(cudaSetDevice(scatter_device_));
  WS_CUDA(cudaStreamCreateWithFlags(&recv_stream_, cudaStreamNonBlocking));
  WS_CUDA(cudaStreamCreateWithFlags(&scatter_stream_, cudaStreamNonBlocking));
  WS_CUDA(cudaEventCreateWithFlags(&all_done_, cudaEventDisableTiming));
  WS_CUDA(cudaEventCreate(&first_op_));
  WS_CUDA(cudaEventCreate(&last_op_));
  WS_CUDA(cudaEventCreateWithFlags(&received_, cudaEventDisableTiming));
  return absl::OkStatus();
}

absl::StatusOr<uint8_t*> GpuWorker::BaseOf(
    const absl::flat_hash_map<int64_t, Allocation>& allocs, int64_t id) {
  auto it = allocs.find(id);
  if (it == allocs.end()) {
    return absl::FailedPreconditionError(
        absl::StrCat("allocation ", id, " is not open in the worker"));
  }
  return it->second.ptr;
}

absl::Status GpuWorker::EnqueueChunkOps(
    const worker::v1::BeginUpdateRequest& request, int64_t k,
    const uint8_t* chunk,
    const absl::flat_hash_map<int64_t, Allocation>& allocs, bool sm_copies,
    int* op) {
  for (; *op < request.ops_size() && request.ops(*op).chunk() == k; ++*op) {
    const worker::v1::GpuOp& o = request.ops(*op);
    absl::StatusOr<uint8_t*> base = BaseOf(allocs, o.allocation_id());
    if (!base.ok()) return base.status();
    uint8_t* dst = *base + o.dst_offset();
    if (sm_copies_ && ipc_source_ != nullptr &&
        o.src_dtype() == o.dst_dtype()) {
      const int64_t width = o.cols() * cuda::DTypeSize(o.src_dtype());
      WS_CUDA(cuda::CopyBytes2DWithSMs(chunk + o.src_offset(), o.src_stride(),
                                       dst, o.dst_stride(), width, o.rows(),
                                       scatter_stream_));
      continue;
    }
    WS_CUDA(cuda::CopyConvert2D(
        chunk + o.src_offset(), o.src_stride(), o.src_dtype(), dst,
        o.dst_stride(), o.dst_dtype(), o.rows(), o.cols(), scatter_stream_));
  }
  return absl::OkStatus();
}

absl::Status GpuWorker::EnqueueChunk(
    const worker::v1::BeginUpdateRequest& request, int64_t k,
    const uint8_t* chunk,
    const absl::flat_hash_map<int64_t, Allocation>& allocs, bool sm_copies,
    int* op) {
  absl::Status s = EnqueueChunkOps(request, k, chunk, allocs, sm_copies, op);
  if (!s.ok()) return s;
  s = EnqueueChunkSparse(request, k, chunk, allocs, /*apply=*/true);
  if (!s.ok()) return s;
  return EnqueueReceiptsAfter(k);
}

namespace {

// Grows a buffer of device memory (pinned host memory with `pinned`) on the
// current device to at least `bytes`, keeping nothing of its contents.
template <typename T>
absl::Status Grow(T** p, int64_t* have, int64_t bytes, bool pinned) {
  if (bytes <= *have) return absl::OkStatus();
  if (*p != nullptr) pinned ? cudaFreeHost(*p) : cudaFree(*p);
  *p = nullptr;
  *have = 0;
  void* d = nullptr;
  WS_CUDA(pinned ? cudaMallocHost(&d, bytes) : cudaMalloc(&d, bytes));
  *p = static_cast<T*>(d);
  *have = bytes;
  return absl::OkStatus();
}
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

absl::Status GpuWorker::PrepareReceipts(
    const worker::v1::BeginUpdateRequest& request) {
  receipt_batches_.clear();
  receipt_groups_ = 0;
  const worker::v1::ComputeReceiptsRequest& rr = request.receipts();
  if (rr.groups() == 0) return absl::OkStatus();
  if (request.receipt_after_chunk_size() != rr.regions_size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        rr.regions_size(), " receipt regions but ",
        request.receipt_after_chunk_size(), " receipt_after_chunk entries"));
  }
  std::vector<cuda::ReceiptRegion> regions;
  std::vector<int32_t> group_of;
  absl::Status s = ResolveReceiptRegions(rr, &regions, &group_of);
  if (!s.ok()) return s;
  // Regions in chunk order, each chunk's batch planned on its own.
  const int64_t chunks = request.chunk_sizes_size();
  std::vector<std::vector<int>> by_chunk(chunks);
  for (int i = 0; i < rr.regions_size(); ++i) {
    const int64_t k = request.receipt_after_chunk(i);
    if (k < 0 || k >= chunks) {
      return absl::InvalidArgumentError(absl::StrCat(
          "receipt region ", i, " follows chunk ", k, " of ", chunks));
    }
    by_chunk[k].push_back(i);
  }
  const int groups = rr.groups();
  const int64_t sum_bytes = sizeof(uint64_t) * groups;
  const int64_t need = sum_bytes + sizeof(cuda::ReceiptRegion) * regions.size();
  WS_CUDA(cudaSetDevice(scatter_device_));
  absl::Status grown = Grow(&receipt_dev_, &receipt_dev_bytes_, need, false);
  if (grown.ok()) {
    grown = Grow(&receipt_host_, &receipt_host_bytes_, sum_bytes, true);
  }
  if (!grown.ok()) return grown;
  auto* out = reinterpret_cast<unsigned long long*>(receipt_dev_);
  std::vector<cuda::ReceiptRegion> ordered;
  ordered.reserve(regions.size());
  receipt_batches_.assign(chunks, ReceiptBatch());
  for (int64_t k = 0; k < chunks; ++k) {
    ReceiptBatch& b = receipt_batches_[k];
    b.first = ordered.size();
    for (int i : by_chunk[k]) {
      ordered.push_back(regions[i]);
      ordered.back().out = out + group_of[i];
    }
    b.count = ordered.size() - b.first;
    if (b.count == 0) continue;
    b.tiles = cuda::PlanReceiptRegions(ordered.data() + b.first, b.count);
    if (b.tiles < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("a receipt region after chunk ", k,
                       " is not readable as planned (alignment, stride)"));
    }
  }
  WS_CUDA(cudaMemsetAsync(out, 0, sum_bytes, scatter_stream_));
  if (!ordered.empty()) {
    // Synchronous: `ordered` is a local.
    WS_CUDA(cudaMemcpy(receipt_dev_ + sum_bytes, ordered.data(),
                       sizeof(cuda::ReceiptRegion) * ordered.size(),
                       cudaMemcpyHostToDevice));
  }
  receipt_groups_ = groups;
  return absl::OkStatus();
}

absl::Status GpuWorker::EnqueueReceiptsAfter(int64_t k) {
  if (receipt_groups_ == 0 ||
      k >= static_cast<int64_t>(receipt_batches_.size())) {
    return absl::OkStatus();
  }
  const ReceiptBatch& b = receipt_batches_[k];
  if (b.count == 0) return absl::OkStatus();
  const auto* regions = reinterpret_cast<const cuda::ReceiptRegion*>(
      receipt_dev_ + sizeof(uint64_t) * receipt_groups_);
  WS_CUDA(cuda::ReceiptSumBatch(regions + b.first, b.count, b.tiles,
                                scatter_stream_));
  return absl::OkStatus();
}

absl::Status GpuWorker::CopyReceiptsOut() {
  if (receipt_groups_ == 0) return absl::OkStatus();
  WS_CUDA(cudaMemcpyAsync(receipt_host_, receipt_dev_,
                          sizeof(uint64_t) * receipt_groups_,
                          cudaMemcpyDeviceToHost, scatter_stream_));
  return absl::OkStatus();
}

absl::Status GpuWorker::EnqueueIpcUpdate(
    const worker::v1::BeginUpdateRequest& request) {
  WS_CUDA(cudaSetDevice(scatter_device_));
  absl::flat_hash_map<int64_t, Allocation> allocs;
  {
    absl::MutexLock lock(&mu_);
    allocs = allocations_;
  }
  // Straight from the trainer's packed buffer into engine memory: no
  // staging, and same-dtype copies run on the copy engines (no SMs).
  int op = 0;
  WS_CUDA(cudaEventRecord(first_op_, scatter_stream_));
  for (int64_t k = 0; k < request.chunk_sizes_size(); ++k) {
    const uint8_t* chunk = ipc_source_ + k * request.chunk_bytes();
    absl::Status s = EnqueueChunk(request, k, chunk, allocs, sm_copies_, &op);
    if (!s.ok()) return s;
  }
  absl::Status out = CopyReportsOut();
  if (out.ok()) out = CopyReceiptsOut();
  if (!out.ok()) return out;
  WS_CUDA(cudaEventRecord(last_op_, scatter_stream_));
  WS_CUDA(cudaEventRecord(all_done_, scatter_stream_));
  return absl::OkStatus();
}

absl::Status GpuWorker::OpenIpcSource(
    const worker::v1::BeginUpdateRequest& request) {
  for (size_t i = 0; i < ipc_sources_.size(); ++i) {
    if (ipc_sources_[i].handle == request.ipc_source_handle() &&
        ipc_sources_[i].size == request.ipc_source_size()) {
      std::rotate(ipc_sources_.begin() + i, ipc_sources_.begin() + i + 1,
                  ipc_sources_.end());
      ipc_source_ = ipc_sources_.back().mapping.ptr;
      return absl::OkStatus();
    }
  }
  ipc_source_ = nullptr;
  if (ipc_sources_.size() >= kIpcSources) {
    cudaSetDevice(scatter_device_);
    if (scatter_stream_ != nullptr) cudaStreamSynchronize(scatter_stream_);
    if (recv_stream_ != nullptr) cudaStreamSynchronize(recv_stream_);
    Unmap(&ipc_sources_.front().mapping);
    ipc_sources_.erase(ipc_sources_.begin());
  }
  absl::StatusOr<Allocation> m =
      MapShared(request.ipc_source_handle(), request.ipc_source_size(),
                request.ipc_source_vmm());
  if (!m.ok()) {
    return absl::Status(m.status().code(),
                        absl::StrCat("ipc_source: ", m.status().message()));
  }
  ipc_sources_.push_back(
      {request.ipc_source_handle(), request.ipc_source_size(), *m});
  ipc_source_ = m->ptr;
  return absl::OkStatus();
}

void GpuWorker::CloseIpcSource() {
  ipc_source_ = nullptr;
  if (ipc_sources_.empty()) return;
  cudaSetDevice(scatter_device_);
  if (scatter_stream_ != nullptr) cudaStreamSynchronize(scatter_stream_);
  if (recv_stream_ != nullptr) cudaStreamSynchronize(recv_stream_);
  for (IpcSource& source : ipc_sources_) Unmap(&source.mapping);
  ipc_sources_.clear();
}

absl::Status GpuWorker::EnsureStaging(int64_t chunk_bytes, int buffers,
                                      bool larger_ok) {
  if ((staging_chunk_ == chunk_bytes ||
       (larger_ok && staging_chunk_ > chunk_bytes)) &&
      static_cast<int>(staging_.size()) == buffers) {
    return absl::OkStatus();
  }
  WS_CUDA(cudaSetDevice(device_));
  WS_CUDA(cudaDeviceSynchronize());
  for (uint8_t* p : staging_) cudaFree(p);
  for (cudaEvent_t e : recv_done_) cudaEventDestroy(e);
  for (cudaEvent_t e : scatter_done_) cudaEventDestroy(e);
  staging_.clear();
  recv_done_.clear();
  scatter_done_.clear();
  staging_chunk_ = 0;
  for (int i = 0; i < buffers; ++i) {
    void* p = nullptr;
    WS_CUDA(cudaMalloc(&p, chunk_bytes));
    staging_.push_back(static_cast<uint8_t*>(p));
    cudaEvent_t r, s;
    WS_CUDA(cudaEventCreateWithFlags(&r, cudaEventDisableTiming));
    WS_CUDA(cudaEventCreateWithFlags(&s, cudaEventDisableTiming));
    recv_done_.push_back(r);
    scatter_done_.push_back(s);
  }
  staging_chunk_ = chunk_bytes;
  return absl::OkStatus();
}

absl::Status GpuWorker::EnqueueUpdate(
    const worker::v1::BeginUpdateRequest& request) {
  // Other owner tasks (OpenAllocation) may have switched the device.
  WS_CUDA(cudaSetDevice(device_));
  const int n = staging_.size();
  absl::flat_hash_map<int64_t, Allocation> allocs;
  {
    absl::MutexLock lock(&mu_);
    allocs = allocations_;
  }
  // Buffers start free: the first wait on each scatter_done is a no-op.
  for (int i = 0; i < n; ++i) {
    WS_CUDA(cudaEventRecord(scatter_done_[i], scatter_stream_));
  }
  int op = 0;
  WS_CUDA(cudaEventRecord(first_op_, recv_stream_));
  for (int64_t k = 0; k < request.chunk_sizes_size(); ++k) {
    const int b = k % n;
    uint8_t* buf = staging_[b];
    // Receive chunk k only once chunk k-n has left this buffer.
    WS_CUDA(cudaStreamWaitEvent(recv_stream_, scatter_done_[b], 0));
    absl::Status received = ReceiveChunk(buf, request.chunk_sizes(k));
    if (!received.ok()) return received;
    WS_CUDA(cudaEventRecord(recv_done_[b], recv_stream_));
    WS_CUDA(cudaStreamWaitEvent(scatter_stream_, recv_done_[b], 0));
    absl::Status s = EnqueueChunk(request, k, buf, allocs, false, &op);
    if (!s.ok()) return s;
    WS_CUDA(cudaEventRecord(scatter_done_[b], scatter_stream_));
  }
  absl::Status out = CopyReportsOut();
  if (out.ok()) out = CopyReceiptsOut();
  if (!out.ok()) return out;
  WS_CUDA(cudaEventRecord(last_op_, scatter_stream_));
  WS_CUDA(cudaEventRecord(all_done_, scatter_stream_));
  return absl::OkStatus();
}

absl::Status GpuWorker::ReceiveChunk(uint8_t* buf, int64_t bytes) {
  const ncclResult_t r =
      ncclBroadcast(buf, buf, bytes, ncclUint8, 0, comm_, recv_stream_);
  WS_NCCL(r);
  if (r == ncclInProgress) {
    // Non-blocking communicator: the enqueue completes asynchronously (the
    // first one waits for the trainer to connect).
    const absl::Time deadline = absl::Now() + enqueue_timeout_;
    ncclResult_t state = ncclInProgress;
    while (state == ncclInProgress) {
      WS_NCCL(ncclCommGetAsyncError(comm_, &state));
      if (state != ncclInProgress) break;
      if (abort_requested_) return absl::AbortedError("update aborted");
      if (absl::Now() > deadline) {
        return absl::DeadlineExceededError(absl::StrCat(
            "broadcast enqueue timed out after ",
            absl::FormatDuration(enqueue_timeout_),
            " (InitWeightTransfer timeout_ms): is the trainer broadcasting?"));
      }
      absl::SleepFor(absl::Microseconds(10));
    }
    WS_NCCL(state);
  }
  return absl::OkStatus();
}

absl::Status GpuWorker::EnqueueStagedReceive(
    const worker::v1::BeginUpdateRequest& request) {
  WS_CUDA(cudaSetDevice(device_));
  // Every chunk has its own buffer: nothing waits for a scatter, and engine
  // memory is not touched until CommitStaged. Sparse payloads are assembled
  // and their indices checked as their chunks arrive (scatter stream), so
  // that a bad patch is refused before the commit.
  // IPC (the whole update shared): each chunk is copied out of the
  // trainer's buffer instead of broadcast.
  const absl::flat_hash_map<int64_t, Allocation> none;
  const bool ipc = !request.ipc_source_handle().empty();
  for (int64_t k = 0; k < request.chunk_sizes_size(); ++k) {
    uint8_t* buf = staging_[k];
    if (ipc) {
      WS_CUDA(cudaMemcpyAsync(buf, ipc_source_ + k * request.chunk_bytes(),
                              request.chunk_sizes(k), cudaMemcpyDeviceToDevice,
                              recv_stream_));
    } else {
      absl::Status received = ReceiveChunk(buf, request.chunk_sizes(k));
      if (!received.ok()) return received;
    }
    if (sparse_next_piece_ < request.sparse_pieces_size() &&
        request.sparse_pieces(sparse_next_piece_).chunk() == k) {
      WS_CUDA(cudaEventRecord(recv_done_[k], recv_stream_));
      WS_CUDA(cudaStreamWaitEvent(scatter_stream_, recv_done_[k], 0));
      absl::Status s = EnqueueChunkSparse(request, k, buf, none, false);
      if (!s.ok()) return s;
    }
  }
  WS_CUDA(cudaEventRecord(received_, recv_stream_));
  if (request.sparse_size() > 0) {
    WS_CUDA(cudaStreamWaitEvent(scatter_stream_, received_, 0));
    absl::Status s = CopyReportsOut();
    if (!s.ok()) return s;
    WS_CUDA(cudaEventRecord(received_, scatter_stream_));
  }
  return absl::OkStatus();
}

grpc::Status GpuWorker::BeginUpdate(
    grpc::ServerContext* ctx, const worker::v1::BeginUpdateRequest* request,
    worker::v1::Empty*) {
  const absl::Time deadline = Deadline(ctx);
  const absl::Time t_call = absl::Now();
  const absl::Cleanup answered = [t_call] {
    VLOG(1) << "BeginUpdate answers after "
            << absl::ToDoubleMilliseconds(absl::Now() - t_call) << " ms";
  };
  return ToGrpcStatus(owner_.Run(
      [&]() -> absl::Status {
        if (update_active_) {
          return absl::FailedPreconditionError("an update is in progress");
        }
        const absl::Time t_run = absl::Now();
        const bool ipc = !request->ipc_source_handle().empty();
        absl::Status s = EnsureStreams();
        if (!s.ok()) return s;
        if (ipc) {
          s = OpenIpcSource(*request);
          if (!s.ok()) return s;
          // Staged: the chunks are copied into staging as they are read.
          if (request->staged()) {
            s = EnsureStaging(request->chunk_bytes(),
                              request->chunk_sizes_size(), /*larger_ok=*/false);
            if (!s.ok()) return s;
          }
        } else {
          if (request->staging_buffers() < 2 && !request->staged()) {
            return absl::InvalidArgumentError("at least 2 staging buffers");
          }
          s = WaitComm(deadline);
          if (!s.ok()) return s;
          WS_CUDA(cudaSetDevice(device_));
          // Staged: one buffer per chunk (the daemon checked the budget).
          // Streaming keeps larger buffers it already has: a trainer that
          // sends sparse updates in small chunks (to overlap their apply
          // with the receive) between dense ones in large chunks would
          // otherwise reallocate them, synchronising the GPU, every update.
          s = EnsureStaging(request->chunk_bytes(),
                            request->staged() ? request->chunk_sizes_size()
                                              : request->staging_buffers(),
                            /*larger_ok=*/!request->staged());
          if (!s.ok()) return s;
        }
        const absl::Time t_data = absl::Now();
        s = PrepareSparse(*request);
        const absl::Time t_sparse = absl::Now();
        if (s.ok()) s = PrepareReceipts(*request);
        if (!s.ok()) return s;
        VLOG(1) << "begin update (" << request->chunk_sizes_size()
                << " chunks, " << request->ops_size() << " copies, "
                << request->sparse_size() << " patches), ms: owner thread "
                << absl::ToDoubleMilliseconds(t_run - t_call)
                << ", streams + source/staging "
                << absl::ToDoubleMilliseconds(t_data - t_run) << ", sparse "
                << absl::ToDoubleMilliseconds(t_sparse - t_data)
                << ", receipts "
                << absl::ToDoubleMilliseconds(absl::Now() - t_sparse);
        ended_clean_ = false;
        update_active_ = true;
        update_chunks_ = request->chunk_sizes_size();
        abort_requested_ = false;
        {
          absl::MutexLock lock(&enqueue_mu_);
          enqueue_done_ = false;
          enqueue_status_ = absl::OkStatus();
        }
        ring_.Clear();
        ring_slots_ = 0;
        if (ipc && request->ipc_ring_slots() > 0) {
          // Chunks are copied as the trainer announces them (CopyChunk).
          if (request->ipc_ring_slots() < 2 ||
              request->ipc_source_size() <
                  request->ipc_ring_slots() * request->chunk_bytes()) {
            update_active_ = false;
            return absl::InvalidArgumentError(absl::StrCat(
                "an IPC ring needs >= 2 slots of ", request->chunk_bytes(),
                " bytes; got ", request->ipc_ring_slots(), " slots in ",
                request->ipc_source_size(), " bytes"));
          }
          ring_ = *request;
          staged_pending_ = request->staged();
          if (request->staged()) staged_ = *request;
          ring_slots_ = request->ipc_ring_slots();
          ring_next_chunk_ = 0;
          ring_next_op_ = 0;
          ring_enqueued_ = 0;
          while (slot_done_.size() <
                 static_cast<size_t>(request->ipc_ring_slots())) {
            cudaEvent_t e;
            WS_CUDA(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
            slot_done_.push_back(e);
          }
          absl::MutexLock lock(&enqueue_mu_);
          enqueue_done_ = false;
          return absl::OkStatus();
        }
        staged_pending_ = request->staged();
        if (request->staged()) staged_ = *request;
        owner_.Post([this, ipc, req = *request] {
          const absl::Time t_enqueue = absl::Now();
          absl::Status s = req.staged() ? EnqueueStagedReceive(req)
                           : ipc        ? EnqueueIpcUpdate(req)
                                        : EnqueueUpdate(req);
          if (!s.ok()) LOG(WARNING) << "update enqueue: " << s;
          VLOG(1) << "update enqueued in "
                  << absl::ToDoubleMilliseconds(absl::Now() - t_enqueue)
                  << " ms";
          absl::MutexLock lock(&enqueue_mu_);
          enqueue_status_ = s;
          enqueue_done_ = true;
        });
        return absl::OkStatus();
      },
      deadline));
}

grpc::Status GpuWorker::WaitUpdate(grpc::ServerContext* ctx,
                                   const worker::v1::WaitUpdateRequest* request,
                                   worker::v1::WaitUpdateResponse* response) {
  const absl::Time deadline =
      std::min(Deadline(ctx),
               absl::Now() + absl::Milliseconds(request->timeout_ms() > 0
                                                    ? request->timeout_ms()
                                                    : 60000));
  // Poll without the owner thread (it may be enqueuing): event queries and
  // the communicator's async error are safe from any thread, never block.
  if (!update_active_) {
    return ToGrpcStatus(absl::FailedPreconditionError("no update in progress"));
  }
  const bool received_only = request->received_only();
  if (received_only != staged_pending_.load()) {
    return ToGrpcStatus(absl::FailedPreconditionError(
        received_only ? "no staged update awaits its commit"
                      : "the staged update is not committed (CommitStaged)"));
  }
  // Staged, before the commit: every chunk in staging is the goal.
  const cudaEvent_t goal = received_only ? received_ : all_done_;
  while (true) {
    bool enqueued;
    {
      absl::MutexLock lock(&enqueue_mu_);
      if (!enqueue_status_.ok()) return ToGrpcStatus(enqueue_status_);
      enqueued = enqueue_done_;
    }
    // all_done_ is recorded last by the enqueue: query it only after that.
    const cudaError_t e = enqueued ? cudaEventQuery(goal) : cudaErrorNotReady;
    if (e == cudaSuccess) break;
    if (e != cudaErrorNotReady) {
      return ToGrpcStatus(CudaStatus(e, "scatter"));
    }
    if (enqueued && comm_ != nullptr) {  // while enqueuing, the owner watches
      ncclResult_t state = ncclSuccess;
      ncclCommGetAsyncError(comm_, &state);
      if (state != ncclSuccess && state != ncclInProgress) {
        return ToGrpcStatus(NcclStatus(state, "broadcast"));
      }
    }
    if (absl::Now() > deadline) {
      return ToGrpcStatus(absl::DeadlineExceededError(
          "update not complete before the deadline (trainer gone or slow?)"));
    }
    absl::SleepFor(absl::Microseconds(20));
  }
  // Every patch was checked by now; one refused ends the update here, with
  // its GPU work complete (AbortUpdate will leave the communicator alone).
  const absl::Status verdict = SparseVerdict();
  if (!verdict.ok()) {
    ended_clean_ = true;
    staged_pending_ = false;
    update_active_ = false;
    return ToGrpcStatus(verdict);
  }
  if (received_only) {  // the update goes on: CommitStaged is next
    response->set_chunks_done(0);
    return grpc::Status::OK;
  }
  update_active_ = false;
  response->set_chunks_done(update_chunks_);
  for (int g = 0; g < receipt_groups_; ++g) {
    response->add_receipt_sums(receipt_host_[g]);
  }
  float ms = 0;
  if (cudaEventElapsedTime(&ms, first_op_, last_op_) == cudaSuccess) {
    response->set_device_seconds(ms / 1e3);
  }
  return grpc::Status::OK;
}

grpc::Status GpuWorker::CopyChunk(grpc::ServerContext* ctx,
                                  const worker::v1::CopyChunkRequest* request,
                                  worker::v1::Empty*) {
  return ToGrpcStatus(owner_.Run(
      [&]() -> absl::Status {
        const int64_t k = request->chunk();
        if (!update_active_ || ring_.ipc_ring_slots() == 0) {
          return absl::FailedPreconditionError(
              "no IPC ring update in progress");
        }
        if (k != ring_next_chunk_ || k >= ring_.chunk_sizes_size()) {
          return absl::InvalidArgumentError(
              absl::StrCat("chunk ", k, " announced; expected ",
                           ring_next_chunk_, " of ", ring_.chunk_sizes_size()));
        }
        WS_CUDA(cudaSetDevice(scatter_device_));
        absl::flat_hash_map<int64_t, Allocation> allocs;
        {
          absl::MutexLock lock(&mu_);
          allocs = allocations_;
        }
        const int slot = k % ring_.ipc_ring_slots();
        const uint8_t* in = ipc_source_ + slot * ring_.chunk_bytes();
        absl::Status s;
        if (ring_.staged()) {
          // Into staging (and a patch's piece assembled and checked);
          // engine memory waits for CommitStaged.
          WS_CUDA(cudaMemcpyAsync(staging_[k], in, ring_.chunk_sizes(k),
                                  cudaMemcpyDeviceToDevice, scatter_stream_));
          if (sparse_next_piece_ < ring_.sparse_pieces_size() &&
              ring_.sparse_pieces(sparse_next_piece_).chunk() == k) {
            s = EnqueueChunkSparse(ring_, k, staging_[k], {}, false);
          }
        } else {
          if (k == 0) WS_CUDA(cudaEventRecord(first_op_, scatter_stream_));
          s = EnqueueChunk(ring_, k, in, allocs, sm_copies_, &ring_next_op_);
        }
        if (!s.ok()) return s;
        WS_CUDA(cudaEventRecord(slot_done_[slot], scatter_stream_));
        ++ring_next_chunk_;
        ring_enqueued_ = ring_next_chunk_;
        if (ring_next_chunk_ == ring_.chunk_sizes_size()) {
          s = CopyReportsOut();
          if (s.ok() && !ring_.staged()) s = CopyReceiptsOut();
          if (!s.ok()) return s;
          if (ring_.staged()) {
            WS_CUDA(cudaEventRecord(received_, scatter_stream_));
          } else {
            WS_CUDA(cudaEventRecord(last_op_, scatter_stream_));
            WS_CUDA(cudaEventRecord(all_done_, scatter_stream_));
          }
          absl::MutexLock lock(&enqueue_mu_);
          enqueue_done_ = true;
        }
        return absl::OkStatus();
      },
      Deadline(ctx)));
}

grpc::Status GpuWorker::WaitChunks(grpc::ServerContext* ctx,
                                   const worker::v1::WaitChunksRequest* request,
                                   worker::v1::WaitChunksResponse* response) {
  const absl::Time deadline =
      std::min(Deadline(ctx),
               absl::Now() + absl::Milliseconds(request->timeout_ms() > 0
                                                    ? request->timeout_ms()
                                                    : 60000));
  const int64_t n = request->chunks();
  const int slots = ring_slots_.load();
  if (!update_active_ || slots == 0) {
    return ToGrpcStatus(
        absl::FailedPreconditionError("no IPC ring update in progress"));
  }
  if (n <= 0) return grpc::Status::OK;
  // Slot (n-1) % slots holds chunk n-1 until chunk n-1+slots is announced,
  // which the trainer does only after this answer.
  if (n > ring_enqueued_.load() || n + slots <= ring_enqueued_.load()) {
    return ToGrpcStatus(absl::InvalidArgumentError(
        absl::StrCat("wait for ", n, " chunks with ", ring_enqueued_.load(),
                     " announced and ", slots, " slots")));
  }
  while (true) {
    const cudaError_t e = cudaEventQuery(slot_done_[(n - 1) % slots]);
    if (e == cudaSuccess) break;
    if (e != cudaErrorNotReady) return ToGrpcStatus(CudaStatus(e, "copy"));
    if (abort_requested_) {
      return ToGrpcStatus(absl::AbortedError("update aborted"));
    }
    if (absl::Now() > deadline) {
      return ToGrpcStatus(absl::DeadlineExceededError(
          absl::StrCat("chunk ", n - 1, " not copied before the deadline")));
    }
    absl::SleepFor(absl::Microseconds(10));
  }
  response->set_chunks_done(n);
  return grpc::Status::OK;
}

grpc::Status GpuWorker::AbortUpdate(grpc::ServerContext* ctx,
                                    const worker::v1::Empty*,
                                    worker::v1::Empty*) {
  if (!update_active_ && ended_clean_) {
    return grpc::Status::OK;  // nothing in flight; the communicator is fine
  }
  abort_requested_ = true;  // stops an enqueue waiting for the trainer
  return ToGrpcStatus(owner_.Run(
      [&]() -> absl::Status {
        update_active_ = false;
        staged_pending_ = false;
        CloseIpcSource();
        if (comm_ != nullptr) {
          // May hang when a peer vanished: the daemon's deadline catches it
          // and kills this process.
          ncclCommAbort(comm_);
          comm_ = nullptr;
          comm_ready_ = false;
        }
        if (scatter_stream_ != nullptr) {
          WS_CUDA(cudaStreamSynchronize(scatter_stream_));
          WS_CUDA(cudaStreamSynchronize(recv_stream_));
        }
        return absl::OkStatus();
      },
      Deadline(ctx)));
}

grpc::Status GpuWorker::CommitStaged(grpc::ServerContext* ctx,
                                     const worker::v1::Empty*,
                                     worker::v1::Empty*) {
  return ToGrpcStatus(owner_.Run(
      [&]() -> absl::Status {
        if (!update_active_ || !staged_pending_) {
          return absl::FailedPreconditionError(
              "no staged update awaits its commit");
        }
        {
          absl::MutexLock lock(&enqueue_mu_);
          if (!enqueue_status_.ok()) return enqueue_status_;
          if (!enqueue_done_) {
            return absl::FailedPreconditionError(
                "the staged chunks are still being received");
          }
        }
        WS_CUDA(cudaSetDevice(device_));
        absl::flat_hash_map<int64_t, Allocation> allocs;
        {
          absl::MutexLock lock(&mu_);
          allocs = allocations_;
        }
        // Only now does engine memory change: staging -> engines, by the
        // plan's ops, after the last receive.
        WS_CUDA(cudaStreamWaitEvent(scatter_stream_, received_, 0));
        WS_CUDA(cudaEventRecord(first_op_, scatter_stream_));
        int op = 0;
        for (int64_t k = 0; k < staged_.chunk_sizes_size(); ++k) {
          absl::Status s =
              EnqueueChunkOps(staged_, k, staging_[k], allocs, false, &op);
          if (!s.ok()) return s;
        }
        // The patches were assembled and checked while receiving: one
        // apply launch for all of them.
        const int64_t applies = jobs_used_;
        for (int p = 0; p < staged_.sparse_size(); ++p) {
          absl::Status s = AddApplyJobs(staged_, p, allocs);
          if (!s.ok()) return s;
        }
        absl::Status applied = LaunchJobs(applies, /*apply=*/true);
        if (!applied.ok()) return applied;
        for (int64_t k = 0; k < staged_.chunk_sizes_size(); ++k) {
          absl::Status s = EnqueueReceiptsAfter(k);
          if (!s.ok()) return s;
        }
        absl::Status out = CopyReceiptsOut();
        if (!out.ok()) return out;
        WS_CUDA(cudaEventRecord(last_op_, scatter_stream_));
        WS_CUDA(cudaEventRecord(all_done_, scatter_stream_));
        staged_pending_ = false;
        return absl::OkStatus();
      },
      Deadline(ctx)));
}

absl::Status GpuWorker::ResolveReceiptRegions(
    const worker::v1::ComputeReceiptsRequest& request,
    std::vector<cuda::ReceiptRegion>* regions, std::vector<int32_t>* group_of) {
  const int groups = request.groups();
  if (groups < 0 || groups > (1 << 20)) {
    return absl::InvalidArgumentError(
        absl::StrCat("groups is ", groups, "; use 0 to 2^20"));
  }
  regions->clear();
  group_of->clear();
  regions->reserve(request.regions_size());
  {
    absl::MutexLock lock(&mu_);
    for (int i = 0; i < request.regions_size(); ++i) {
      const worker::v1::ReceiptRegionSpec& g = request.regions(i);
      const int64_t es = g.element_size();
      auto it = allocations_.find(g.allocation_id());
      if (it == allocations_.end()) {
        return absl::NotFoundError(
            absl::StrCat("receipt region ", i, ": allocation ",
                         g.allocation_id(), " is not open in the worker"));
      }
      constexpr int64_t kMax = int64_t{1} << 40;
      if (g.group() < 0 || g.group() >= groups ||
          (es != 1 && es != 2 && es != 4 && es != 8) || g.rows() < 0 ||
          g.cols() < 0 || g.rows() > kMax || g.cols() > kMax ||
          g.offset() < 0 || g.row_stride_bytes() < 0 ||
          g.row_stride_bytes() > kMax) {
        return absl::InvalidArgumentError(
            absl::StrCat("receipt region ", i, " is malformed (group ",
                         g.group(), " of ", groups, ", element size ", es, ", ",
                         g.rows(), " x ", g.cols(), ")"));
      }
      if (g.rows() > 0 && g.cols() > 0) {
        const int64_t end =
            g.offset() + (g.rows() - 1) * g.row_stride_bytes() + g.cols() * es;
        if (end > it->second.size) {
          return absl::InvalidArgumentError(absl::StrCat(
              "receipt region ", i, " ends at byte ", end, " of allocation ",
              g.allocation_id(), " (", it->second.size, " bytes)"));
        }
      }
      cuda::ReceiptRegion r{};
      r.base = it->second.ptr + g.offset();
      r.rows = g.rows();
      r.cols = g.cols();
      r.row_stride_bytes = g.row_stride_bytes();
      r.salt = g.salt();
      r.first_index = g.first_index();
      r.es = static_cast<int32_t>(es);
      regions->push_back(r);
      group_of->push_back(g.group());
    }
  }
  return absl::OkStatus();
}

grpc::Status GpuWorker::ComputeReceipts(
    grpc::ServerContext* ctx, const worker::v1::ComputeReceiptsRequest* request,
    worker::v1::ComputeReceiptsResponse* response) {
  const int groups = request->groups();
  // Validated against the open allocations before anything reaches CUDA.
  std::vector<cuda::ReceiptRegion> regions;
  std::vector<int32_t> group_of;
  absl::Status resolved = ResolveReceiptRegions(*request, &regions, &group_of);
  if (!resolved.ok()) return ToGrpcStatus(resolved);
  std::vector<uint64_t> sums(groups, 0);
  float ms = 0;
  absl::Status s = owner_.Run(
      [&]() -> absl::Status {
        if (groups == 0) return absl::OkStatus();
        absl::Status st = EnsureStreams();
        if (!st.ok()) return st;
        WS_CUDA(cudaSetDevice(scatter_device_));
        const size_t sum_bytes = sizeof(uint64_t) * groups;
        const size_t region_bytes =
            sizeof(cuda::ReceiptRegion) * regions.size();
        void* mem = nullptr;
        // Sums first: the regions array after them stays 8-byte aligned.
        WS_CUDA(cudaMalloc(&mem, sum_bytes + region_bytes));
        absl::Cleanup free_mem = [&] {
          cudaStreamSynchronize(scatter_stream_);
          cudaFree(mem);
        };
        auto* out = static_cast<unsigned long long*>(mem);
        auto* dev_regions = reinterpret_cast<cuda::ReceiptRegion*>(
            static_cast<uint8_t*>(mem) + sum_bytes);
        for (size_t i = 0; i < regions.size(); ++i) {
          regions[i].out = out + group_of[i];
        }
        const int64_t tiles =
            cuda::PlanReceiptRegions(regions.data(), regions.size());
        if (tiles < 0) {
          return absl::InvalidArgumentError(
              absl::StrCat("receipt region ", -1 - tiles,
                           " is not readable as planned (alignment, stride)"));
        }
        cudaEvent_t t0, t1;
        WS_CUDA(cudaEventCreate(&t0));
        WS_CUDA(cudaEventCreate(&t1));
        absl::Cleanup free_events = [&] {
          cudaEventDestroy(t0);
          cudaEventDestroy(t1);
        };
        WS_CUDA(cudaMemsetAsync(out, 0, sum_bytes, scatter_stream_));
        if (region_bytes > 0) {
          WS_CUDA(cudaMemcpyAsync(dev_regions, regions.data(), region_bytes,
                                  cudaMemcpyHostToDevice, scatter_stream_));
        }
        WS_CUDA(cudaEventRecord(t0, scatter_stream_));
        WS_CUDA(cuda::ReceiptSumBatch(dev_regions, regions.size(), tiles,
                                      scatter_stream_));
        WS_CUDA(cudaEventRecord(t1, scatter_stream_));
        WS_CUDA(cudaMemcpyAsync(sums.data(), out, sum_bytes,
                                cudaMemcpyDeviceToHost, scatter_stream_));
        WS_CUDA(cudaStreamSynchronize(scatter_stream_));
        cudaEventElapsedTime(&ms, t0, t1);
        return absl::OkStatus();
      },
      Deadline(ctx));
  if (!s.ok()) return ToGrpcStatus(s);
  for (uint64_t v : sums) response->add_sums(v);
  response->set_device_seconds(ms / 1e3);
  return grpc::Status::OK;
}

}  // namespace weightsync

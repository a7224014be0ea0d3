#include "backends/cuda/gpu_worker.h"

#include <malloc.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <string>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "backends/cuda/cuda_status.h"
#include "backends/cuda/gpu_uuid.h"
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

GpuWorker::GpuWorker(int device, bool sm_copies, bool fused_receipts,
                     cuda::Fp8DirectKernel fp8_direct_kernel)
    : scatter_device_(device),
      sm_copies_(sm_copies),
      fused_receipts_(fused_receipts),
      fp8_direct_kernel_(fp8_direct_kernel),
      device_(device) {
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
  VLOG(1) << "allocation " << request->allocation_id() << " opened at "
          << static_cast<void*>(a.ptr) << " (" << request->size()
          << " bytes registered)";
  absl::MutexLock lock(&mu_);
  allocations_[request->allocation_id()] = a;
  ++allocations_generation_;
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
    ++allocations_generation_;
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
        DropCommunicator();  // a new group replaces the old one
        update_active_ = false;
        enqueue_timeout_ = request->timeout_ms() > 0
                               ? absl::Milliseconds(request->timeout_ms())
                               : kDefaultEnqueueTimeout;
        device_ = request->device();
        world_size_ = request->world_size();
        rank_ = request->rank();
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

namespace {

// VmRSS of this process in KiB (/proc/self/status), or -1.
int64_t RssKib() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    int64_t kib;
    if (absl::StartsWith(line, "VmRSS:") &&
        absl::SimpleAtoi(absl::StripAsciiWhitespace(absl::StripSuffix(
                             absl::StripPrefix(line, "VmRSS:"), "kB")),
                         &kib)) {
      return kib;
    }
  }
  return -1;
}

}  // namespace

void GpuWorker::DropCommunicator() {
  if (comm_ == nullptr) return;
  // May hang when a peer vanished: the daemon's deadline catches it and
  // kills this process.
  ncclCommAbort(comm_);
  comm_ = nullptr;
  comm_ready_ = false;
  const int64_t before = RssKib();
  malloc_trim(0);
  LOG(INFO) << "event=nccl.comm_released: communicator aborted; RSS "
            << before / 1024 << " MiB, " << RssKib() / 1024
            << " MiB after returning freed heap";
}

absl::Status GpuWorker::EnsureStreams() {
  if (recv_stream_ != nullptr) return absl::OkStatus();
  WS_CUDA(cudaSetDevice(scatter_device_));
  WS_CUDA(cudaStreamCreateWithFlags(&recv_stream_, cudaStreamNonBlocking));
  WS_CUDA(cudaStreamCreateWithFlags(&scatter_stream_, cudaStreamNonBlocking));
  WS_CUDA(cudaStreamCreateWithFlags(&quant_stream_, cudaStreamNonBlocking));
  WS_CUDA(cudaEventCreateWithFlags(&quant_done_, cudaEventDisableTiming));
  WS_CUDA(cudaEventCreateWithFlags(&all_done_, cudaEventDisableTiming));
  WS_CUDA(cudaEventCreate(&first_op_));
  WS_CUDA(cudaEventCreate(&last_op_));
  WS_CUDA(cudaEventCreateWithFlags(&received_, cudaEventDisableTiming));
  WS_CUDA(cudaEventCreateWithFlags(&round_done_, cudaEventDisableTiming));
  return absl::OkStatus();
}

}  // namespace weightsync

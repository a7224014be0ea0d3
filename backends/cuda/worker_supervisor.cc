// The GPU worker process and its connection (GpuWorkerSupervisor): start,
// restart after a crash, warm-up, and the calls an update makes to it.

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "backends/cuda/worker_client.h"
#include "common/grpc_status.h"
#include "common/status_macros.h"
#include "glog/logging.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/support/channel_arguments.h"

namespace weightsync {
namespace {

std::unique_ptr<grpc::ClientContext> Ctx(absl::Time deadline) {
  auto ctx = std::make_unique<grpc::ClientContext>();
  ctx->set_deadline(absl::ToChronoTime(deadline));
  return ctx;
}

}  // namespace

GpuWorkerSupervisor::GpuWorkerSupervisor(Options options)
    : options_(std::move(options)),
      closer_([this] { CloserLoop(); }),
      warmer_([this] { WarmerLoop(); }) {}

GpuWorkerSupervisor::~GpuWorkerSupervisor() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  closer_.join();
  warmer_.join();
  absl::MutexLock lock(&mu_);
  KillLocked();
}

int GpuWorkerSupervisor::restarts() const {
  absl::MutexLock lock(&mu_);
  return restarts_;
}

void GpuWorkerSupervisor::KillLocked() {
  if (pid_ > 0) {
    kill(pid_, SIGKILL);
    waitpid(pid_, nullptr, 0);
    pid_ = -1;
  }
  stub_.reset();
}

absl::Status GpuWorkerSupervisor::EnsureStartedLocked() {
  if (pid_ > 0 && waitpid(pid_, nullptr, WNOHANG) == 0 && stub_ != nullptr) {
    return absl::OkStatus();
  }
  if (pid_ > 0) {
    LOG(WARNING) << "GPU worker " << pid_ << " died; starting a new one";
    pid_ = -1;
    ++restarts_;
  }
  if (options_.worker_binary.empty() ||
      access(options_.worker_binary.c_str(), X_OK) != 0) {
    return absl::UnavailableError(absl::StrCat(
        "GPU worker binary '", options_.worker_binary, "' is not executable"));
  }
  const std::string socket_flag = "--socket=" + options_.socket_path;
  const std::string parent_flag = absl::StrCat("--parent_pid=", getpid());
  const std::string device_flag = absl::StrCat("--device=", options_.device);
  const std::string sm_flag = absl::StrCat(
      "--ipc_sm_copies=", options_.ipc_sm_copies ? "true" : "false");
  const std::string fused_flag = absl::StrCat(
      "--ipc_fused_receipts=", options_.ipc_fused_receipts ? "true" : "false");
  const std::string fp8_flag =
      "--fp8_direct_kernel=" + options_.fp8_direct_kernel;
  unlink(options_.socket_path.c_str());
  const pid_t pid = fork();
  if (pid < 0) return absl::UnavailableError("fork failed");
  if (pid == 0) {
    // The daemon blocks SIGTERM/SIGINT for its sigwait; the worker must not.
    sigset_t all;
    sigfillset(&all);
    pthread_sigmask(SIG_UNBLOCK, &all, nullptr);
    execl(options_.worker_binary.c_str(), options_.worker_binary.c_str(),
          socket_flag.c_str(), parent_flag.c_str(), device_flag.c_str(),
          sm_flag.c_str(), fused_flag.c_str(), fp8_flag.c_str(), nullptr);
    _exit(127);
  }
  pid_ = pid;
  grpc::ChannelArguments args;
  args.SetMaxSendMessageSize(256 << 20);
  // The worker listens within a second of starting: retry quickly rather
  // than with gRPC's default 1 s reconnect backoff.
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 20);
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 20);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 200);
  auto channel = grpc::CreateCustomChannel(
      "unix:" + options_.socket_path, grpc::InsecureChannelCredentials(), args);
  auto stub = worker::v1::GpuWorker::NewStub(channel);
  const absl::Time deadline = absl::Now() + options_.start_timeout;
  while (true) {
    worker::v1::PingRequest req;
    worker::v1::PingResponse resp;
    auto ctx = Ctx(absl::Now() + absl::Seconds(1));
    ctx->set_wait_for_ready(true);
    if (stub->Ping(ctx.get(), req, &resp).ok()) {
      LOG(INFO) << "GPU worker " << pid_ << " up: " << resp.device_uuids_size()
                << " GPU(s), " << resp.build_info();
      break;
    }
    if (waitpid(pid_, nullptr, WNOHANG) != 0) {
      pid_ = -1;  // already reaped: never signal a pid that may be reused
      stub_.reset();
      return absl::UnavailableError("GPU worker failed to start");
    }
    if (absl::Now() > deadline) {
      KillLocked();
      return absl::UnavailableError("GPU worker failed to start");
    }
  }
  stub_ = std::move(stub);
  // Registrations outlive workers: open every allocation again.
  for (const auto& [id, alloc] : allocations_) {
    worker::v1::OpenAllocationRequest req;
    req.set_allocation_id(id);
    req.set_handle(alloc.handle());
    req.set_size(alloc.size());
    req.set_device_uuid(alloc.device_uuid());
    req.set_vmm(alloc.kind() == v1::MEMORY_CUDA_VMM);
    worker::v1::OpenAllocationResponse resp;
    auto ctx = Ctx(absl::Now() + options_.call_timeout);
    grpc::Status s = stub_->OpenAllocation(ctx.get(), req, &resp);
    if (!s.ok()) {
      LOG(ERROR) << "re-opening allocation " << id << ": " << s.error_message();
    }
  }
  return absl::OkStatus();
}

absl::Status GpuWorkerSupervisor::Restart(const std::string& why) {
  absl::MutexLock lock(&mu_);
  LOG(WARNING) << "restarting GPU worker: " << why;
  KillLocked();
  ++restarts_;
  return EnsureStartedLocked();
}

absl::StatusOr<int64_t> GpuWorkerSupervisor::OpenAllocation(
    const v1::Allocation& allocation) {
  absl::MutexLock lock(&mu_);
  absl::Status s = EnsureStartedLocked();
  if (!s.ok()) return s;
  const int64_t id = next_id_++;
  worker::v1::OpenAllocationRequest req;
  req.set_allocation_id(id);
  req.set_handle(allocation.handle());
  req.set_size(allocation.size());
  req.set_device_uuid(allocation.device_uuid());
  req.set_vmm(allocation.kind() == v1::MEMORY_CUDA_VMM);
  worker::v1::OpenAllocationResponse resp;
  for (int attempt = 0; attempt < 2; ++attempt) {
    auto ctx = Ctx(absl::Now() + options_.call_timeout);
    s = FromGrpcStatus(stub_->OpenAllocation(ctx.get(), req, &resp));
    if (s.code() != absl::StatusCode::kDeadlineExceeded &&
        s.code() != absl::StatusCode::kUnavailable) {
      break;
    }
    // A hung or dead worker: replace it, then try once more.
    LOG(WARNING) << "GPU worker did not answer (" << s << "); restarting";
    KillLocked();
    ++restarts_;
    absl::Status started = EnsureStartedLocked();
    if (!started.ok()) return started;
  }
  if (!s.ok()) return s;
  allocations_[id] = allocation;
  return id;
}

void GpuWorkerSupervisor::CloseAllocation(int64_t id) {
  absl::MutexLock lock(&mu_);
  allocations_.erase(id);
  to_close_.push_back(id);
}

void GpuWorkerSupervisor::CloserLoop() {
  absl::MutexLock lock(&mu_);
  while (true) {
    auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return stop_ || !to_close_.empty();
    };
    mu_.Await(absl::Condition(&ready));
    if (stop_) return;
    const int64_t id = to_close_.front();
    to_close_.pop_front();
    if (stub_ == nullptr) continue;  // a dead worker closed everything
    worker::v1::CloseAllocationRequest req;
    req.set_allocation_id(id);
    worker::v1::Empty resp;
    auto ctx = Ctx(absl::Now() + absl::Seconds(5));
    grpc::Status s = stub_->CloseAllocation(ctx.get(), req, &resp);
    if (!s.ok())
      LOG(WARNING) << "closing allocation " << id << ": " << s.error_message();
  }
}

void GpuWorkerSupervisor::WarmAsync() {
  absl::MutexLock lock(&mu_);
  warm_requested_ = true;
}

void GpuWorkerSupervisor::StartAsync() {
  absl::MutexLock lock(&mu_);
  start_requested_ = true;
}

void GpuWorkerSupervisor::WarmerLoop() {
  while (true) {
    {
      absl::MutexLock lock(&mu_);
      auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return stop_ || warm_requested_ || start_requested_;
      };
      mu_.Await(absl::Condition(&ready));
      if (stop_) return;
      if (start_requested_) {
        // Under mu_, as every start is: a registration arriving meanwhile
        // waits for this start instead of making its own.
        start_requested_ = false;
        absl::Status s = EnsureStartedLocked();
        if (!s.ok()) {
          LOG(WARNING) << "GPU worker not started at launch (" << s
                       << "); the first use tries again";
        }
        continue;
      }
      warm_requested_ = false;
    }
    // Unlocked: the update's own calls must not wait behind this one. A
    // failure is of no interest here; the update's calls report their own.
    Ping(absl::Now() + absl::Milliseconds(500)).IgnoreError();
  }
}

absl::Status GpuWorkerSupervisor::InitGroup(
    const worker::v1::InitGroupRequest& request) {
  absl::MutexLock lock(&mu_);
  absl::Status s = EnsureStartedLocked();
  if (!s.ok()) return s;
  worker::v1::Empty resp;
  auto ctx = Ctx(absl::Now() + options_.call_timeout);
  s = FromGrpcStatus(stub_->InitGroup(ctx.get(), request, &resp));
  if (s.code() == absl::StatusCode::kDeadlineExceeded ||
      s.code() == absl::StatusCode::kUnavailable) {
    KillLocked();
    ++restarts_;
    EnsureStartedLocked().IgnoreError();
  }
  return s;
}

absl::Status GpuWorkerSupervisor::BeginUpdate(
    const worker::v1::BeginUpdateRequest& request, absl::Time deadline) {
  absl::MutexLock lock(&mu_);
  if (stub_ == nullptr) {
    return absl::FailedPreconditionError(
        "the GPU worker restarted since InitWeightTransfer; init again");
  }
  worker::v1::Empty resp;
  auto ctx = Ctx(deadline);
  return FromGrpcStatus(stub_->BeginUpdate(ctx.get(), request, &resp));
}

std::shared_ptr<worker::v1::GpuWorker::Stub> GpuWorkerSupervisor::Stub() {
  absl::MutexLock lock(&mu_);
  return stub_;
}

absl::Status GpuWorkerSupervisor::Ping(absl::Time deadline) {
  std::shared_ptr<worker::v1::GpuWorker::Stub> stub = Stub();
  if (stub == nullptr) return absl::UnavailableError("no GPU worker running");
  worker::v1::PingRequest req;
  worker::v1::PingResponse resp;
  auto ctx = Ctx(deadline);
  return FromGrpcStatus(stub->Ping(ctx.get(), req, &resp));
}

absl::Status GpuWorkerSupervisor::CopyChunk(int64_t k, absl::Time deadline) {
  std::shared_ptr<worker::v1::GpuWorker::Stub> stub = Stub();
  if (stub == nullptr) return absl::AbortedError("GPU worker is gone");
  worker::v1::CopyChunkRequest req;
  req.set_chunk(k);
  worker::v1::Empty resp;
  auto ctx = Ctx(deadline);
  return FromGrpcStatus(stub->CopyChunk(ctx.get(), req, &resp));
}

absl::Status GpuWorkerSupervisor::WaitChunks(int64_t n, absl::Time deadline) {
  std::shared_ptr<worker::v1::GpuWorker::Stub> stub = Stub();
  if (stub == nullptr) return absl::AbortedError("GPU worker is gone");
  worker::v1::WaitChunksRequest req;
  req.set_chunks(n);
  req.set_timeout_ms(
      std::max<int64_t>(1, absl::ToInt64Milliseconds(deadline - absl::Now())));
  worker::v1::WaitChunksResponse resp;
  auto ctx = Ctx(deadline + absl::Seconds(2));
  return FromGrpcStatus(stub->WaitChunks(ctx.get(), req, &resp));
}

absl::Status GpuWorkerSupervisor::CommitStaged(absl::Time deadline) {
  std::shared_ptr<worker::v1::GpuWorker::Stub> stub = Stub();
  if (stub == nullptr) return absl::AbortedError("GPU worker is gone");
  worker::v1::Empty req, resp;
  auto ctx = Ctx(deadline);
  return FromGrpcStatus(stub->CommitStaged(ctx.get(), req, &resp));
}

absl::StatusOr<std::vector<uint64_t>> GpuWorkerSupervisor::ComputeReceipts(
    const worker::v1::ComputeReceiptsRequest& request, absl::Time deadline) {
  std::shared_ptr<worker::v1::GpuWorker::Stub> stub = Stub();
  if (stub == nullptr) return absl::AbortedError("GPU worker is gone");
  worker::v1::ComputeReceiptsResponse resp;
  auto ctx = Ctx(deadline);
  absl::Status s =
      FromGrpcStatus(stub->ComputeReceipts(ctx.get(), request, &resp));
  if (!s.ok()) return s;
  if (resp.sums_size() != request.groups()) {
    return absl::InternalError(absl::StrCat("GPU worker returned ",
                                            resp.sums_size(), " sums for ",
                                            request.groups(), " groups"));
  }
  return std::vector<uint64_t>(resp.sums().begin(), resp.sums().end());
}

absl::StatusOr<GpuWorkerSupervisor::Waited> GpuWorkerSupervisor::WaitUpdate(
    absl::Time deadline, bool received_only) {
  std::shared_ptr<worker::v1::GpuWorker::Stub> stub = Stub();
  if (stub == nullptr) return absl::AbortedError("GPU worker is gone");
  worker::v1::WaitUpdateRequest req;
  req.set_received_only(received_only);
  req.set_timeout_ms(
      std::max<int64_t>(1, absl::ToInt64Milliseconds(deadline - absl::Now())));
  worker::v1::WaitUpdateResponse resp;
  // A little slack so the worker's own deadline answers first.
  auto ctx = Ctx(deadline + absl::Seconds(2));
  absl::Status s = FromGrpcStatus(stub->WaitUpdate(ctx.get(), req, &resp));
  if (!s.ok()) return s;
  Waited w;
  w.device = absl::Seconds(resp.device_seconds());
  w.receipt_sums.assign(resp.receipt_sums().begin(), resp.receipt_sums().end());
  return w;
}

void GpuWorkerSupervisor::AbortUpdate(absl::Time deadline) {
  absl::MutexLock lock(&mu_);
  if (stub_ == nullptr) return;
  worker::v1::Empty req, resp;
  auto ctx = Ctx(deadline);
  grpc::Status s = stub_->AbortUpdate(ctx.get(), req, &resp);
  if (!s.ok()) {
    // ncclCommAbort can hang when a peer vanished: only a kill is certain.
    LOG(WARNING) << "GPU worker abort failed (" << s.error_message()
                 << "); killing it";
    KillLocked();
    ++restarts_;
    EnsureStartedLocked().IgnoreError();
  }
}

}  // namespace weightsync

#include "backends/cuda/worker_client.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "backends/cuda/quant_steps.h"
#include "common/checksum.h"
#include "common/dtype.h"
#include "common/grpc_status.h"
#include "common/status_macros.h"
#include "glog/logging.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/support/channel_arguments.h"

namespace weightsync {
namespace {

// The names of the plan's dense tensors, the ones receipts cover (a
// patch's other elements are not the trainer's to vouch for).
absl::flat_hash_set<std::string> DenseSources(const CopyPlan& plan) {
  absl::flat_hash_set<std::string> sources;
  sources.reserve(plan.manifest.size());
  for (const v1::TensorSpec& t : plan.manifest) {
    if (t.sparse_nnz() == 0) sources.insert(t.name());
  }
  return sources;
}

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

absl::StatusOr<std::shared_ptr<MappedRegion>> GpuMapper::Open(
    const v1::Allocation& allocation) {
  absl::StatusOr<int64_t> id = sup_->OpenAllocation(allocation);
  if (!id.ok()) return id.status();
  return std::shared_ptr<MappedRegion>(std::make_shared<GpuRegion>(
      sup_, *id, allocation.size(), allocation.device_uuid()));
}

absl::Status GpuDataPlane::Begin(std::shared_ptr<const CopyPlan> plan,
                                 const v1::StartWeightUpdateRequest& request) {
  return BeginImpl(std::move(plan), request, /*staged=*/false, nullptr);
}

absl::Status GpuDataPlane::BeginFromSource(
    std::shared_ptr<const CopyPlan> plan,
    const v1::StartWeightUpdateRequest& request, const Source& source) {
  if (backend_ != v1::BACKEND_IPC || !source.has_memory()) {
    return absl::InvalidArgumentError(
        "only the ipc backend copies from a source's registered memory");
  }
  return BeginImpl(std::move(plan), request, /*staged=*/false, &source);
}

absl::Status GpuDataPlane::BeginStaged(
    std::shared_ptr<const CopyPlan> plan,
    const v1::StartWeightUpdateRequest& request) {
  return BeginImpl(std::move(plan), request, /*staged=*/true, nullptr);
}

// NCCL and IPC alike: a staged update is copied into GPU staging, one
// chunk-sized buffer per chunk, before the commit writes engine memory.
int64_t GpuDataPlane::DeviceStagingBudget() const {
  return sup_->options().staging_budget;
}

absl::Status GpuDataPlane::WaitStaged(absl::Time deadline) {
  return sup_->WaitUpdate(deadline, /*received_only=*/true).status();
}

absl::Status GpuDataPlane::CommitStaged(absl::Time deadline) {
  return sup_->CommitStaged(deadline);
}

namespace {

// The stored scales of the blocks that segment `s` of FP8 target `p`
// writes, as ComputeReceipt sums them (daemon/core/receipt.cc,
// AddScaleTerms): one region of the scale parameter, 4-byte elements keyed
// on the block's index, salted with the scale parameter's name; counted in
// *receipt (the scale parameter once per engine).
absl::Status AddScaleRegion(const EngineLayout& engine,
                            const ParameterLayout& p, const SegmentLayout& s,
                            int group, worker::v1::ComputeReceiptsRequest* req,
                            v1::Receipt* receipt,
                            absl::flat_hash_set<int32_t>* scales_seen) {
  const QuantLayout& q = *p.quant;
  const ParameterLayout& scale = engine.parameters[q.scale_parameter];
  const auto* region =
      dynamic_cast<const GpuRegion*>(engine.regions[scale.region].get());
  if (region == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        "engine '", engine.engine_id, "': scale parameter '", scale.name,
        "' is in host memory; the GPU backends read GPU memory"));
  }
  const auto [i0, i1, j0, j1, first] = ScaleBlocksOf(q, s);
  worker::v1::ReceiptRegionSpec* g = req->add_regions();
  g->set_allocation_id(region->id());
  g->set_offset(scale.offset + first * 4);
  g->set_rows(i1 - i0);
  g->set_cols(j1 - j0);
  g->set_row_stride_bytes(q.grid_cols * 4);
  g->set_element_size(4);
  g->set_salt(scale.salt);
  g->set_first_index(static_cast<uint64_t>(first));
  g->set_group(group);
  receipt->set_bytes(receipt->bytes() + (i1 - i0) * (j1 - j0) * 4);
  if (scales_seen->insert(q.scale_parameter).second) {
    receipt->set_parameters(receipt->parameters() + 1);
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ReceiptRegionsOf(const std::vector<const EngineLayout*>& engines,
                              const absl::flat_hash_set<std::string>& sources,
                              const std::vector<bool>& skip,
                              worker::v1::ComputeReceiptsRequest* req,
                              std::vector<v1::Receipt>* out,
                              std::vector<std::string>* region_sources) {
  out->assign(engines.size(), v1::Receipt());
  req->set_groups(engines.size());
  for (size_t e = 0; e < engines.size(); ++e) {
    if (e < skip.size() && skip[e]) continue;
    const EngineLayout& engine = *engines[e];
    v1::Receipt& receipt = (*out)[e];
    absl::flat_hash_set<int32_t> scales_seen;  // counted scale parameters
    for (const ParameterLayout& p : engine.parameters) {
      const auto* region =
          dynamic_cast<const GpuRegion*>(engine.regions[p.region].get());
      if (region == nullptr) {
        return absl::InvalidArgumentError(absl::StrCat(
            "engine '", engine.engine_id,
            "' registered host memory; the GPU backends read GPU memory"));
      }
      const int64_t es = ElementSize(p.dtype);
      const uint64_t salt = p.salt;
      bool touched = false;
      for (const SegmentLayout& s : p.segments) {
        if (!sources.contains(s.source)) continue;
        touched = true;
        worker::v1::ReceiptRegionSpec* g = req->add_regions();
        g->set_allocation_id(region->id());
        g->set_offset(p.offset + s.dest_offset * es);
        g->set_rows(s.row_count);
        g->set_cols(s.col_count);
        g->set_row_stride_bytes(s.dest_row_stride * es);
        g->set_element_size(static_cast<int32_t>(es));
        g->set_salt(salt);
        g->set_first_index(static_cast<uint64_t>(s.dest_offset));
        g->set_group(static_cast<int32_t>(e));
        region_sources->push_back(s.source);
        receipt.set_bytes(receipt.bytes() + s.row_count * s.col_count * es);
        if (p.quant.has_value()) {
          WS_RETURN_IF_ERROR(AddScaleRegion(engine, p, s, static_cast<int>(e),
                                            req, &receipt, &scales_seen));
          region_sources->push_back(s.source);
        }
      }
      if (touched) receipt.set_parameters(receipt.parameters() + 1);
    }
  }
  return absl::OkStatus();
}

namespace {

std::vector<const EngineLayout*> EnginesOf(const CopyPlan& plan) {
  std::vector<const EngineLayout*> engines;
  for (const auto& e : plan.engines) engines.push_back(e.get());
  return engines;
}

}  // namespace

absl::StatusOr<v1::Receipt> GpuMapper::DeviceReceipt(
    const EngineLayout& engine, const absl::flat_hash_set<std::string>& sources,
    absl::Time deadline) {
  std::vector<v1::Receipt> out;
  worker::v1::ComputeReceiptsRequest req;
  std::vector<std::string> region_sources;
  WS_RETURN_IF_ERROR(
      ReceiptRegionsOf({&engine}, sources, {}, &req, &out, &region_sources));
  absl::StatusOr<std::vector<uint64_t>> sums =
      sup_->ComputeReceipts(req, deadline);
  if (!sums.ok()) return sums.status();
  out[0].set_checksum((*sums)[0]);
  return out[0];
}

absl::StatusOr<std::vector<v1::Receipt>> GpuDataPlane::DeviceReceipts(
    const CopyPlan& plan, const std::vector<bool>& skip, absl::Time deadline) {
  {
    // Computed by the worker as the update went (AddReceipts).
    absl::MutexLock lock(&mu_);
    if (inflight_receipts_ready_ && inflight_plan_ == &plan) {
      std::vector<v1::Receipt> out = inflight_receipts_;
      for (size_t e = 0; e < out.size(); ++e) {
        if (e < skip.size() && skip[e]) out[e] = v1::Receipt();
      }
      return out;
    }
  }
  // Not computed as the update went (a staged update): from the plan's
  // dense tensors, whose names are gathered only here.
  absl::flat_hash_set<std::string> sources = DenseSources(plan);
  std::vector<v1::Receipt> out;
  worker::v1::ComputeReceiptsRequest req;
  std::vector<std::string> region_sources;
  WS_RETURN_IF_ERROR(ReceiptRegionsOf(EnginesOf(plan), sources, skip, &req,
                                      &out, &region_sources));
  absl::StatusOr<std::vector<uint64_t>> sums =
      sup_->ComputeReceipts(req, deadline);
  if (!sums.ok()) return sums.status();
  for (size_t e = 0; e < out.size(); ++e) out[e].set_checksum((*sums)[e]);
  return out;
}

absl::Status GpuDataPlane::AddReceipts(
    const CopyPlan& plan, const v1::StartWeightUpdateRequest& request,
    worker::v1::BeginUpdateRequest* req) {
  // The sources receipts cover (the coordinator's: dense tensors), and the
  // last chunk that carries each.
  const absl::flat_hash_set<std::string> sources = DenseSources(plan);
  absl::flat_hash_map<std::string, int64_t> last_chunk;
  for (const Chunk& c : plan.chunks.chunks) {
    for (const Piece& piece : c.pieces) {
      last_chunk[plan.manifest[piece.tensor].name()] = c.index;
    }
  }
  std::vector<v1::Receipt> receipts;
  std::vector<std::string> region_sources;
  WS_RETURN_IF_ERROR(ReceiptRegionsOf(EnginesOf(plan), sources, {},
                                      req->mutable_receipts(), &receipts,
                                      &region_sources));
  // ipc with the whole update present: nothing arrives to overlap with, so
  // every region is summed in one launch after the last copy (one batch at
  // full occupancy, not a small launch after each of ~2000 chunks).
  const bool at_end =
      backend_ == v1::BACKEND_IPC && request.ipc_ring_slots() == 0;
  const int64_t last = static_cast<int64_t>(plan.chunks.chunks.size()) - 1;
  for (const std::string& source : region_sources) {
    auto it = last_chunk.find(source);
    // A tensor of no bytes rides in no chunk: after the first.
    req->add_receipt_after_chunk(at_end                   ? last
                                 : it == last_chunk.end() ? 0
                                                          : it->second);
  }
  absl::MutexLock lock(&mu_);
  inflight_receipts_ = std::move(receipts);
  return absl::OkStatus();
}

absl::Status GpuDataPlane::SetIpcSource(
    const CopyPlan& plan, const v1::StartWeightUpdateRequest& request,
    const Source* source, worker::v1::BeginUpdateRequest* req) {
  if (source != nullptr) {
    if (request.has_ipc_source() || request.ipc_ring_slots() != 0) {
      return absl::InvalidArgumentError(
          "an update from a source with registered memory copies from the "
          "trainer's tensors: leave ipc_source and ipc_ring_slots unset");
    }
    req->set_ipc_registered_source(true);
    return absl::OkStatus();
  }
  const v1::Allocation& src = request.ipc_source();
  if ((src.kind() != v1::MEMORY_CUDA_IPC &&
       src.kind() != v1::MEMORY_CUDA_VMM) ||
      src.handle().empty()) {
    return absl::InvalidArgumentError(
        "the ipc backend needs ipc_source: the CUDA IPC handle (or CUDA "
        "VMM \"pid:fd\") of the trainer's packed update");
  }
  const int slots = request.ipc_ring_slots();
  if (slots < 0 || slots == 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "ipc_ring_slots is ", slots, "; use 0 (whole update) or >= 2"));
  }
  const int64_t need =
      slots > 0 ? slots * plan.chunks.chunk_bytes : plan.chunks.total_bytes;
  if (src.size() < need) {
    return absl::InvalidArgumentError(absl::StrCat(
        "ipc_source holds ", src.size(), " bytes; ",
        slots > 0 ? absl::StrCat(slots, " ring slots of ",
                                 plan.chunks.chunk_bytes, " bytes need ")
                  : std::string("the update packs "),
        need));
  }
  req->set_ipc_ring_slots(slots);
  req->set_ipc_source_handle(src.handle());
  req->set_ipc_source_size(src.size());
  req->set_ipc_source_uuid(src.device_uuid());
  req->set_ipc_source_vmm(src.kind() == v1::MEMORY_CUDA_VMM);
  return absl::OkStatus();
}

namespace {

// The worker's id of each of a source's regions.
absl::StatusOr<std::vector<int64_t>> SourceRegionIds(const Source* source) {
  std::vector<int64_t> ids;
  if (source == nullptr) return ids;
  for (const auto& r : source->regions) {
    const auto* region = dynamic_cast<const GpuRegion*>(r.get());
    if (region == nullptr) {
      return absl::InvalidArgumentError(
          "a registered source's memory is not GPU memory");
    }
    ids.push_back(region->id());
  }
  return ids;
}

// The worker's id of region `r` of engine `e` of `plan`: GPU memory only.
absl::StatusOr<int64_t> WorkerRegionId(const CopyPlan& plan, int32_t e,
                                       int32_t r, const std::string& backend) {
  const auto* region =
      dynamic_cast<const GpuRegion*>(plan.engines[e]->regions[r].get());
  if (region == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("engine '", plan.engines[e]->engine_id,
                     "' registered host memory; the ", backend,
                     " backend writes GPU memory"));
  }
  return region->id();
}

}  // namespace

absl::Status GpuDataPlane::SetOps(const std::shared_ptr<const CopyPlan>& plan,
                                  const v1::StartWeightUpdateRequest& request,
                                  const Source* source, bool staged, bool reuse,
                                  int64_t quant_window,
                                  worker::v1::BeginUpdateRequest* req) {
  req->clear_ops();
  req->clear_receipts();
  req->clear_receipt_after_chunk();
  req->set_ops_id(0);
  req->set_reuse_ops(false);
  // Receipts (the GPU backends verify only when asked: VERIFY_ON) are
  // computed by the worker chunk by chunk, overlapping the transfer.
  const bool receipts =
      request.verify() == v1::VERIFY_ON && !plan->chunks.chunks.empty();
  // Only a registered source's streaming update names its ops.
  const bool named = source != nullptr && !staged;
  WS_ASSIGN_OR_RETURN(std::vector<int64_t> ids, SourceRegionIds(source));
  if (named && reuse && ops_id_ != 0 && ops_plan_.lock() == plan &&
      ops_sources_ == ids && ops_receipts_ == receipts &&
      ops_quant_window_ == quant_window) {
    req->set_ops_id(ops_id_);
    req->set_reuse_ops(true);
    absl::MutexLock lock(&mu_);
    inflight_receipts_ = ops_receipt_counts_;
    return absl::OkStatus();
  }
  WS_RETURN_IF_ERROR(AddOps(*plan, source, req));
  const bool whole = WholeSource(staged, *req);
  if (whole) MergeContiguousOps(req);
  WS_RETURN_IF_ERROR(AddQuantSteps(
      *plan, quant_window, whole,
      [&](int32_t e, int32_t r) -> absl::StatusOr<int64_t> {
        return WorkerRegionId(*plan, e, r, name());
      },
      source, ids, req));
  if (receipts) WS_RETURN_IF_ERROR(AddReceipts(*plan, request, req));
  ops_plan_.reset();
  ops_id_ = 0;
  if (named) {
    ops_plan_ = plan;
    ops_sources_ = std::move(ids);
    ops_receipts_ = receipts;
    ops_quant_window_ = quant_window;
    absl::MutexLock lock(&mu_);
    ops_receipt_counts_ = inflight_receipts_;
    ops_id_ = next_ops_id_++;
    req->set_ops_id(ops_id_);
  }
  return absl::OkStatus();
}

absl::Status GpuDataPlane::AddOps(const CopyPlan& plan, const Source* source,
                                  worker::v1::BeginUpdateRequest* req) {
  // The worker's id of each source region.
  WS_ASSIGN_OR_RETURN(std::vector<int64_t> source_ids, SourceRegionIds(source));
  for (size_t k = 0; k < plan.ops_by_chunk.size(); ++k) {
    for (const CopyOp& op : plan.ops_by_chunk[k]) {
      const auto* region = dynamic_cast<const GpuRegion*>(
          plan.engines[op.engine]->regions[op.region].get());
      if (region == nullptr) {
        return absl::InvalidArgumentError(absl::StrCat(
            "engine '", plan.engines[op.engine]->engine_id,
            "' registered host memory; the nccl backend writes GPU memory"));
      }
      worker::v1::GpuOp g;
      g.set_chunk(k);
      g.set_allocation_id(region->id());
      g.set_src_offset(op.src_offset);
      g.set_src_stride(op.src_stride);
      g.set_dst_offset(op.dst_offset);
      g.set_dst_stride(op.dst_stride);
      g.set_rows(op.rows);
      g.set_cols(op.cols);
      g.set_src_dtype(op.src_dtype);
      g.set_dst_dtype(op.dst_dtype);
      if (source == nullptr) {
        *req->add_ops() = std::move(g);
      } else {
        WS_RETURN_IF_ERROR(SplitSourceOp(plan.chunks, *source, source_ids, k,
                                         std::move(g), req));
      }
    }
  }
  return absl::OkStatus();
}

namespace {

// The quant steps' window (quant_steps.h): kQuantWindowBytes where the
// scratch fits the staging budget beside `staging`, else one row of blocks
// per use; RESOURCE_EXHAUSTED where even that does not fit.
// `whole`, `source`: as for AddQuantSteps (direct uses need no scratch).
absl::StatusOr<int64_t> QuantWindow(const CopyPlan& plan, int64_t staging,
                                    int64_t budget, bool whole,
                                    const Source* source) {
  if (plan.quant.empty()) return 0;
  if (staging + QuantScratchBytes(plan, kQuantWindowBytes, whole, source) <=
      budget) {
    return kQuantWindowBytes;
  }
  const int64_t least = QuantScratchBytes(plan, 0, whole, source);
  if (staging + least <= budget) return 0;
  return absl::ResourceExhaustedError(absl::StrCat(
      "GPU staging of ", staging, " bytes and ", least,
      " bytes of FP8 targets' rows of blocks (float32) exceed the budget of ",
      budget,
      "; use a smaller chunk_bytes or raise --gpu_staging_budget_bytes"));
}

}  // namespace

absl::Status GpuDataPlane::BeginImpl(
    std::shared_ptr<const CopyPlan> plan,
    const v1::StartWeightUpdateRequest& request, bool staged,
    const Source* source) {
  const absl::Time t_entry = absl::Now();
  const auto& o = sup_->options();
  // Staged: one buffer per chunk, the whole update.
  const int64_t staging =
      (staged ? static_cast<int64_t>(plan->chunks.chunks.size())
              : o.staging_buffers) *
      plan->chunks.chunk_bytes;
  worker::v1::BeginUpdateRequest req;
  req.set_staged(staged);
  if (backend_ == v1::BACKEND_IPC) {
    WS_RETURN_IF_ERROR(SetIpcSource(*plan, request, source, &req));
  } else if (staging > o.staging_budget) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "GPU staging of ",
        staged ? plan->chunks.chunks.size() : o.staging_buffers, " x ",
        plan->chunks.chunk_bytes, " bytes exceeds the budget of ",
        o.staging_budget, "; use a smaller chunk_bytes"));
  }
  // GPU staging the worker holds for this update (ipc streaming copies
  // straight from the trainer's buffer).
  const int64_t held_staging =
      backend_ == v1::BACKEND_NCCL || staged ? staging : 0;
  // FP8 targets: their rows of blocks (float32) in the worker's scratch,
  // in windows of several rows of blocks where the budget allows.
  // Where the whole source is there from the start, FP8 uses are
  // quantised straight from it (direct quant steps, no scratch).
  const bool whole = WholeSource(staged, req);
  WS_ASSIGN_OR_RETURN(
      const int64_t quant_window,
      QuantWindow(*plan, held_staging, o.staging_budget, whole, source));
  staging_bytes_ =
      held_staging + QuantScratchBytes(*plan, quant_window, whole, source);
  req.set_chunk_bytes(plan->chunks.chunk_bytes);
  req.set_staging_buffers(o.staging_buffers);
  for (const Chunk& c : plan->chunks.chunks) req.add_chunk_sizes(c.size);
  {
    absl::MutexLock lock(&mu_);
    inflight_plan_ = nullptr;
    inflight_receipts_ready_ = false;
    inflight_receipts_.clear();
  }
  WS_RETURN_IF_ERROR(SetOps(plan, request, source, staged, /*reuse=*/true,
                            quant_window, &req));
  // Sparse patches: assembled, checked and applied by the worker on its GPU.
  int64_t sparse_bytes = 0;
  for (const SparsePatch& patch : plan->sparse) {
    worker::v1::GpuSparsePatch* g = req.add_sparse();
    g->set_name(patch.name);
    g->set_nnz(patch.nnz);
    g->set_numel(patch.numel);
    g->set_index_bytes(patch.index_bytes);
    g->set_dtype(patch.dtype);
    g->set_cols(patch.cols);
    g->set_payload_bytes(patch.payload_bytes);
    sparse_bytes += (patch.payload_bytes + 255) / 256 * 256 + 32;
    for (const SparsePatch::Use& u : patch.uses) {
      const auto* region = dynamic_cast<const GpuRegion*>(
          plan->engines[u.engine]->regions[u.region].get());
      if (region == nullptr) {
        return absl::InvalidArgumentError(
            absl::StrCat("engine '", plan->engines[u.engine]->engine_id,
                         "' registered host memory; the ", name(),
                         " backend writes GPU "
                         "memory"));
      }
      worker::v1::GpuSparseUse* gu = g->add_uses();
      gu->set_allocation_id(region->id());
      gu->set_param_offset(u.param_offset);
      gu->set_dtype(u.dtype);
      gu->set_implicit(u.implicit);
      gu->set_row_begin(u.row_begin);
      gu->set_row_count(u.row_count);
      gu->set_col_begin(u.col_begin);
      gu->set_col_count(u.col_count);
      gu->set_dest_offset(u.dest_offset);
      gu->set_dest_row_stride(u.dest_row_stride);
    }
  }
  for (size_t k = 0; k < plan->sparse_pieces_by_chunk.size(); ++k) {
    for (const auto& [si, piece] : plan->sparse_pieces_by_chunk[k]) {
      worker::v1::GpuSparsePiece* g = req.add_sparse_pieces();
      g->set_chunk(k);
      g->set_patch(si);
      g->set_chunk_offset(piece.chunk_offset);
      g->set_patch_offset(piece.tensor_offset);
      g->set_length(piece.length);
    }
  }
  // The patches' payloads live in the worker's GPU memory until applied:
  // they count against the staging budget.
  if (sparse_bytes > 0 &&
      (backend_ == v1::BACKEND_IPC ? 0 : staging) + sparse_bytes >
          o.staging_budget) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "GPU staging of ", backend_ == v1::BACKEND_IPC ? 0 : staging,
        " bytes plus ", sparse_bytes,
        " bytes of sparse patches exceeds the "
        "budget of ",
        o.staging_budget,
        "; send the denser tensors dense or raise --gpu_staging_budget_bytes"));
  }
  const bool verify = request.verify() == v1::VERIFY_ON;
  const absl::Time t_rpc = absl::Now();
  absl::Status s =
      sup_->BeginUpdate(req, absl::Now() + sup_->options().call_timeout);
  if (absl::IsNotFound(s) && req.reuse_ops()) {
    // A worker that doesn't hold the ops (it was restarted): send them.
    WS_RETURN_IF_ERROR(SetOps(plan, request, source, staged, /*reuse=*/false,
                              quant_window, &req));
    s = sup_->BeginUpdate(req, absl::Now() + sup_->options().call_timeout);
  }
  if (!s.ok()) ops_plan_.reset();  // send them again next time
  VLOG(1) << "begin: request of " << req.ByteSizeLong() << " bytes built in "
          << absl::ToDoubleMilliseconds(t_rpc - t_entry)
          << " ms, the worker's BeginUpdate answered in "
          << absl::ToDoubleMilliseconds(absl::Now() - t_rpc) << " ms";
  absl::MutexLock lock(&mu_);
  if (verify && !plan->chunks.chunks.empty()) inflight_plan_ = plan.get();
  chunks_ = plan->chunks.chunks.size();
  written_ = 0;
  ring_slots_ = request.ipc_ring_slots();
  return s;
}

absl::Status GpuDataPlane::SubmitChunk(int64_t index, std::string data,
                                       absl::Time deadline) {
  {
    absl::MutexLock lock(&mu_);
    if (ring_slots_ == 0) {
      return absl::FailedPreconditionError(
          "this update uses a GPU backend: its bytes travel by NCCL or CUDA "
          "IPC, not PushChunks");
    }
  }
  if (!data.empty()) {
    return absl::InvalidArgumentError(
        "an IPC ring chunk carries no bytes: they are in the trainer's slot");
  }
  return sup_->CopyChunk(index, deadline);
}

absl::Status GpuDataPlane::WaitChunks(int64_t n, absl::Time deadline) {
  return sup_->WaitChunks(n, deadline);
}

absl::Status GpuDataPlane::Drain(absl::Time deadline) {
  absl::StatusOr<GpuWorkerSupervisor::Waited> s = sup_->WaitUpdate(deadline);
  if (!s.ok() && s.status().code() == absl::StatusCode::kInvalidArgument) {
    // A refused sparse patch: the transfer itself completed and the worker
    // ended the update; the communicator is intact.
    return s.status();
  }
  if (!s.ok()) {
    sup_->AbortUpdate(absl::Now() + absl::Seconds(5));
    return absl::AbortedError(
        absl::StrCat(name(), " transfer failed: ", s.status().message(),
                     backend_ == v1::BACKEND_NCCL
                         ? " (communicator aborted; InitWeightTransfer again)"
                         : ""));
  }
  absl::MutexLock lock(&mu_);
  written_ = chunks_;
  device_time_ = s->device;
  if (inflight_plan_ != nullptr) {
    if (s->receipt_sums.size() != inflight_receipts_.size()) {
      return absl::InternalError(absl::StrCat(
          "the GPU worker returned ", s->receipt_sums.size(),
          " receipt sums for ", inflight_receipts_.size(), " engines"));
    }
    for (size_t e = 0; e < inflight_receipts_.size(); ++e) {
      inflight_receipts_[e].set_checksum(s->receipt_sums[e]);
    }
    inflight_receipts_ready_ = true;
  }
  return absl::OkStatus();
}

absl::Duration GpuDataPlane::device_time() const {
  absl::MutexLock lock(&mu_);
  return device_time_;
}

void GpuDataPlane::Abort() {
  sup_->AbortUpdate(absl::Now() + absl::Seconds(5));
}

int64_t GpuDataPlane::chunks_written() const {
  absl::MutexLock lock(&mu_);
  return written_;
}

}  // namespace weightsync

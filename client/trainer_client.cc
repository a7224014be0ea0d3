#include "client/trainer_client.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "client/receipts.h"
#include "client/unary_call.h"
#include "common/chunk_planner.h"
#include "common/grpc_status.h"
#include "common/status_macros.h"

namespace weightsync {
namespace {

// Rephrases the daemon's refusal of an update the user's Update() or
// MultiTrainer::Update() made without a group: they called neither
// RegisterSource nor StartWeightUpdate themselves.
constexpr absl::string_view kNoGroup =
    "no transfer group: call InitWeightTransfer before ";

}  // namespace

absl::Status InUpdateTerms(const absl::Status& s, absl::string_view call,
                           absl::string_view init) {
  if (!absl::IsFailedPrecondition(s) ||
      !absl::StrContains(s.message(), kNoGroup)) {
    return s;
  }
  return absl::FailedPreconditionError(
      absl::StrCat(call, ": no transfer group: call ", init, " before ", call,
                   " [the daemon said: ", s.message(), "]"));
}

absl::Status CheckHostTensors(const std::vector<HostTensor>& tensors,
                              absl::string_view call) {
  if (tensors.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        call, " got no tensors: pass at least one HostTensor (spec and data)"));
  }
  for (const HostTensor& t : tensors) {
    if (t.data == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat(call, ": tensor '", t.spec.name(),
                       "' has no data (HostTensor::data is null); nothing "
                       "was sent"));
    }
  }
  return absl::OkStatus();
}

namespace {

// One unary call with its deadline and retries (client/unary_call.h).
template <typename Response, typename Method, typename Stub, typename Request>
absl::StatusOr<Response> Call(grpc::Channel* channel,
                              const ClientOptions& options, Stub* stub,
                              absl::string_view name, Method method,
                              const Request& request) {
  Response response;
  WS_RETURN_IF_ERROR(
      CallUnary(channel, options, name, [&](grpc::ClientContext* ctx) {
        response.Clear();
        return (stub->*method)(ctx, request, &response);
      }));
  return response;
}

}  // namespace

TrainerClient::TrainerClient(ClientOptions options,
                             std::shared_ptr<grpc::Channel> channel)
    : options_(std::move(options)),
      channel_(std::move(channel)),
      stub_(v1::TrainerService::NewStub(channel_)) {}

absl::StatusOr<std::unique_ptr<TrainerClient>> TrainerClient::Connect(
    const ClientOptions& options) {
  WS_ASSIGN_OR_RETURN(auto channel, ConnectChannel(options));
  return std::unique_ptr<TrainerClient>(
      new TrainerClient(options, std::move(channel)));
}

absl::StatusOr<v1::InitWeightTransferResponse>
TrainerClient::InitWeightTransfer(const v1::InitWeightTransferRequest& r) {
  absl::StatusOr<v1::InitWeightTransferResponse> group =
      Call<v1::InitWeightTransferResponse>(
          channel_.get(), options_, stub_.get(), "InitWeightTransfer",
          &v1::TrainerService::Stub::InitWeightTransfer, r);
  if (!group.ok()) return group;
  // The new hold first: the old one's group is not the daemon's any more,
  // so closing it ends nothing (engines this trainer paused stay paused).
  absl::StatusOr<std::unique_ptr<LivenessHold>> hold =
      LivenessHold::Open(stub_.get(), group->group_id(), options_.call_timeout);
  hold_status_ = hold.status();
  hold_ = hold.ok() ? *std::move(hold) : nullptr;
  return group;
}

absl::Status TrainerClient::liveness_status() const {
  if (hold_ != nullptr && !hold_->open()) {
    return absl::UnavailableError(
        "the daemon ended this trainer's Liveness stream (it restarted, or "
        "its group was replaced)");
  }
  return hold_status_;
}

absl::StatusOr<v1::StartWeightUpdateResponse> TrainerClient::StartWeightUpdate(
    const v1::StartWeightUpdateRequest& r) {
  return Call<v1::StartWeightUpdateResponse>(
      channel_.get(), options_, stub_.get(), "StartWeightUpdate",
      &v1::TrainerService::Stub::StartWeightUpdate, r);
}

absl::Status TrainerClient::PushTensors(const std::string& update_id,
                                        const std::vector<HostTensor>& tensors,
                                        int64_t chunk_bytes) {
  WS_RETURN_IF_ERROR(CheckHostTensors(tensors, "TrainerClient::PushTensors"));
  Manifest manifest;
  manifest.Reserve(
      static_cast<int>(tensors.size()));  // 100k-tensor MoE updates
  for (const HostTensor& t : tensors) *manifest.Add() = t.spec;
  WS_ASSIGN_OR_RETURN(ChunkPlan plan, PlanChunks(manifest, chunk_bytes));
  return PushPlanned(update_id, tensors, plan);
}

absl::Status TrainerClient::PushPlanned(const std::string& update_id,
                                        const std::vector<HostTensor>& tensors,
                                        const ChunkPlan& plan) {
  grpc::ClientContext stream_ctx;
  stream_ctx.set_deadline(
      absl::ToChronoTime(absl::Now() + options_.stream_timeout));
  grpc::ClientContext* ctx = &stream_ctx;
  v1::PushChunksResponse response;
  auto writer = stub_->PushChunks(ctx, &response);
  v1::PushChunksRequest request;
  request.set_update_id(update_id);
  for (const Chunk& chunk : plan.chunks) {
    request.set_chunk_index(chunk.index);
    std::string* data = request.mutable_data();
    // Padding between tensors is zero on the wire (docs/chunk_planner.md).
    data->assign(chunk.size, '\0');
    for (const Piece& p : chunk.pieces) {
      std::memcpy(
          &(*data)[p.chunk_offset],
          static_cast<const uint8_t*>(tensors[p.tensor].data) + p.tensor_offset,
          p.length);
    }
    if (!writer->Write(request)) break;  // the daemon ended the stream
    request.clear_update_id();
  }
  writer->WritesDone();
  return UserStatus(options_.target, "PushChunks", writer->Finish(),
                    options_.stream_timeout);
}

std::unique_ptr<IpcChunkStream> TrainerClient::OpenIpcChunks(
    const std::string& update_id) {
  auto ctx = std::make_unique<grpc::ClientContext>();
  ctx->set_deadline(absl::ToChronoTime(absl::Now() + options_.stream_timeout));
  auto stream = stub_->IpcChunks(ctx.get());
  return std::make_unique<IpcChunkStream>(std::move(ctx), std::move(stream),
                                          update_id);
}

absl::Status IpcChunkStream::Ready(int64_t chunk) {
  v1::IpcChunksRequest r;
  if (first_) r.set_update_id(update_id_);
  first_ = false;
  r.set_chunk_index(chunk);
  if (!stream_->Write(r)) return Close();  // the daemon ended the stream
  return absl::OkStatus();
}

absl::Status IpcChunkStream::WaitDone(int64_t chunks) {
  v1::IpcChunksResponse r;
  while (done_ < chunks) {
    if (!stream_->Read(&r)) {
      absl::Status s = Close();
      return s.ok() ? absl::AbortedError(
                          "the daemon ended the IPC chunk stream early")
                    : s;
    }
    done_ = r.chunks_done();
  }
  return absl::OkStatus();
}

absl::Status IpcChunkStream::Close() {
  if (stream_ == nullptr) return absl::OkStatus();
  stream_->WritesDone();
  v1::IpcChunksResponse r;
  while (stream_->Read(&r)) {
  }
  absl::Status s = FromGrpcStatus(stream_->Finish());
  stream_.reset();
  return s;
}

absl::StatusOr<v1::FinishWeightUpdateResponse>
TrainerClient::FinishWeightUpdate(const std::string& update_id) {
  v1::FinishWeightUpdateRequest r;
  r.set_update_id(update_id);
  // The daemon waits for the bytes for two thirds of our deadline, so that
  // on a failure its abort (and answer) still arrive before the deadline.
  r.set_timeout_ms(absl::ToInt64Milliseconds(options_.call_timeout) * 2 / 3);
  return Call<v1::FinishWeightUpdateResponse>(
      channel_.get(), options_, stub_.get(), "FinishWeightUpdate",
      &v1::TrainerService::Stub::FinishWeightUpdate, r);
}

absl::StatusOr<v1::PrepareWeightUpdateResponse>
TrainerClient::PrepareWeightUpdate(const std::string& update_id) {
  v1::PrepareWeightUpdateRequest r;
  r.set_update_id(update_id);
  r.set_timeout_ms(absl::ToInt64Milliseconds(options_.call_timeout) * 2 / 3);
  return Call<v1::PrepareWeightUpdateResponse>(
      channel_.get(), options_, stub_.get(), "PrepareWeightUpdate",
      &v1::TrainerService::Stub::PrepareWeightUpdate, r);
}

absl::StatusOr<v1::FinishWeightUpdateResponse>
TrainerClient::CommitWeightUpdate(const std::string& update_id) {
  v1::CommitWeightUpdateRequest r;
  r.set_update_id(update_id);
  return Call<v1::FinishWeightUpdateResponse>(
      channel_.get(), options_, stub_.get(), "CommitWeightUpdate",
      &v1::TrainerService::Stub::CommitWeightUpdate, r);
}

absl::StatusOr<v1::AbortWeightUpdateResponse> TrainerClient::AbortWeightUpdate(
    const std::string& update_id, const std::string& reason) {
  v1::AbortWeightUpdateRequest r;
  r.set_update_id(update_id);
  r.set_reason(reason);
  return Call<v1::AbortWeightUpdateResponse>(
      channel_.get(), options_, stub_.get(), "AbortWeightUpdate",
      &v1::TrainerService::Stub::AbortWeightUpdate, r);
}

absl::StatusOr<v1::PauseResponse> TrainerClient::Pause(
    const v1::PauseRequest& r) {
  if (hold_ == nullptr) {
    // No group held: hold the pauses instead (an empty group id), so that
    // they end within a second if this process dies, not at the daemon's
    // idle deadline. A daemon older than that refuses it: no hold, as
    // before.
    absl::StatusOr<std::unique_ptr<LivenessHold>> hold =
        LivenessHold::Open(stub_.get(), "", options_.call_timeout);
    if (hold.ok()) hold_ = *std::move(hold);
  }
  return Call<v1::PauseResponse>(channel_.get(), options_, stub_.get(), "Pause",
                                 &v1::TrainerService::Stub::Pause, r);
}

absl::StatusOr<v1::ResumeResponse> TrainerClient::Resume(
    const v1::ResumeRequest& r) {
  return Call<v1::ResumeResponse>(channel_.get(), options_, stub_.get(),
                                  "Resume", &v1::TrainerService::Stub::Resume,
                                  r);
}

absl::StatusOr<int> TrainerClient::GetWorldSize(v1::Backend backend) {
  v1::GetWorldSizeRequest request;
  request.set_backend(backend);
  WS_ASSIGN_OR_RETURN(v1::GetWorldSizeResponse r,
                      (Call<v1::GetWorldSizeResponse>(
                          channel_.get(), options_, stub_.get(), "GetWorldSize",
                          &v1::TrainerService::Stub::GetWorldSize, request)));
  return r.world_size();
}

absl::StatusOr<v1::GetStatusResponse> TrainerClient::GetStatus(
    bool include_layouts) {
  v1::GetStatusRequest r;
  r.set_include_layouts(include_layouts);
  return Call<v1::GetStatusResponse>(channel_.get(), options_, stub_.get(),
                                     "GetStatus",
                                     &v1::TrainerService::Stub::GetStatus, r);
}

absl::StatusOr<v1::CheckEngineResponse> TrainerClient::CheckEngine(
    const std::string& engine_id) {
  v1::CheckEngineRequest r;
  r.set_engine_id(engine_id);
  return Call<v1::CheckEngineResponse>(
      channel_.get(), options_, stub_.get(), "CheckEngine",
      &v1::TrainerService::Stub::CheckEngine, r);
}

absl::StatusOr<v1::RegisterSourceResponse> TrainerClient::RegisterSource(
    const v1::RegisterSourceRequest& r) {
  return Call<v1::RegisterSourceResponse>(
      channel_.get(), options_, stub_.get(), "RegisterSource",
      &v1::TrainerService::Stub::RegisterSource, r);
}

absl::Status TrainerClient::UnregisterSource(const std::string& source_id) {
  v1::UnregisterSourceRequest r;
  r.set_source_id(source_id);
  return Call<v1::UnregisterSourceResponse>(
             channel_.get(), options_, stub_.get(), "UnregisterSource",
             &v1::TrainerService::Stub::UnregisterSource, r)
      .status();
}

namespace {

bool SameSpec(const v1::TensorSpec& a, const v1::TensorSpec& b) {
  return a.name() == b.name() && a.dtype() == b.dtype() &&
         std::equal(a.shape().begin(), a.shape().end(), b.shape().begin(),
                    b.shape().end());
}

bool Dense(const std::vector<HostTensor>& tensors) {
  for (const HostTensor& t : tensors) {
    if (t.spec.sparse_nnz() != 0) return false;
  }
  return true;
}

}  // namespace

absl::StatusOr<v1::StartWeightUpdateResponse> TrainerClient::StartFromSource(
    v1::StartWeightUpdateRequest request,
    const std::vector<HostTensor>& tensors) {
  const bool same =
      source_manifest_.size() == static_cast<int>(tensors.size()) &&
      std::equal(tensors.begin(), tensors.end(), source_manifest_.begin(),
                 [](const HostTensor& t, const v1::TensorSpec& s) {
                   return SameSpec(t.spec, s);
                 });
  if (!same) {
    source_id_.clear();
    source_manifest_.Clear();
    source_manifest_.Reserve(static_cast<int>(tensors.size()));
    for (const HostTensor& t : tensors) {
      v1::TensorSpec* spec = source_manifest_.Add();
      spec->set_name(t.spec.name());
      spec->set_dtype(t.spec.dtype());
      *spec->mutable_shape() = t.spec.shape();
    }
    plan_chunk_bytes_ = -1;
  }
  request.clear_tensors();
  for (int attempt = 0;; ++attempt) {
    if (source_id_.empty()) {
      v1::RegisterSourceRequest r;
      *r.mutable_tensors() = source_manifest_;
      WS_ASSIGN_OR_RETURN(v1::RegisterSourceResponse registered,
                          RegisterSource(r));
      source_id_ = registered.source_id();
    }
    request.set_source_id(source_id_);
    absl::StatusOr<v1::StartWeightUpdateResponse> started =
        StartWeightUpdate(request);
    // A new group (Init) or an evicted source: register again, once.
    if (started.ok() || !absl::IsNotFound(started.status()) || attempt > 0) {
      return started;
    }
    source_id_.clear();
  }
}

absl::StatusOr<v1::FinishWeightUpdateResponse> TrainerClient::Update(
    v1::StartWeightUpdateRequest request,
    const std::vector<HostTensor>& tensors) {
  WS_RETURN_IF_ERROR(CheckHostTensors(tensors, "TrainerClient::Update"));
  const bool dense = Dense(tensors);
  absl::StatusOr<v1::StartWeightUpdateResponse> started;
  if (dense) {
    started = StartFromSource(request, tensors);
  } else {
    request.clear_tensors();
    request.mutable_tensors()->Reserve(static_cast<int>(tensors.size()));
    for (const HostTensor& t : tensors) *request.add_tensors() = t.spec;
    started = StartWeightUpdate(request);
  }
  if (!started.ok()) {
    return InUpdateTerms(started.status(), "TrainerClient::Update",
                         "TrainerClient::InitWeightTransfer");
  }
  absl::Status pushed;
  if (dense) {
    if (plan_chunk_bytes_ != started->chunk_bytes()) {
      WS_ASSIGN_OR_RETURN(source_plan_,
                          PlanChunks(source_manifest_, started->chunk_bytes()));
      plan_chunk_bytes_ = started->chunk_bytes();
    }
    pushed = PushPlanned(request.update_id(), tensors, source_plan_);
  } else {
    pushed = PushTensors(request.update_id(), tensors, started->chunk_bytes());
  }
  if (!pushed.ok()) {
    // Finish reports the daemon's view (e.g. which engines are dirty).
    absl::StatusOr<v1::FinishWeightUpdateResponse> finished =
        FinishWeightUpdate(request.update_id());
    if (!finished.ok()) return finished.status();
    return pushed;
  }
  WS_ASSIGN_OR_RETURN(v1::FinishWeightUpdateResponse finished,
                      FinishWeightUpdate(request.update_id()));
  if (request.verify() != v1::VERIFY_OFF) {
    WS_RETURN_IF_ERROR(CheckUpdateReceipts(finished, tensors));
  }
  return finished;
}

absl::Status TrainerClient::CheckUpdateReceipts(
    const v1::FinishWeightUpdateResponse& done,
    const std::vector<HostTensor>& tensors) {
  bool receipts = false, known = true;
  for (const v1::EngineResult& e : done.engines()) {
    if (!e.has_receipt()) continue;
    receipts = true;
    bool listed = false;
    for (const v1::EngineStatus& s : layouts_.engines()) {
      listed =
          listed || (s.engine_id() == e.engine_id() && !e.layout_id().empty() &&
                     s.layout_id() == e.layout_id());
    }
    known = known && listed;
  }
  if (!receipts) return absl::OkStatus();
  if (!known) {
    // An engine registered (again) since: fetch the layouts once more.
    WS_ASSIGN_OR_RETURN(layouts_, GetStatus(true));
  }
  return CheckReceipts(done, layouts_, tensors);
}

}  // namespace weightsync

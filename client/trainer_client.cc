#include "client/trainer_client.h"

#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "client/receipts.h"
#include "common/chunk_planner.h"
#include "common/grpc_status.h"
#include "common/status_macros.h"

namespace weightsync {
namespace {

template <typename Response, typename Method, typename Stub, typename Request>
absl::StatusOr<Response> Call(Stub* stub, Method method,
                              grpc::ClientContext* ctx,
                              const Request& request) {
  Response response;
  grpc::Status s = (stub->*method)(ctx, request, &response);
  if (!s.ok()) return FromGrpcStatus(s);
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

std::unique_ptr<grpc::ClientContext> TrainerClient::Context() const {
  auto ctx = std::make_unique<grpc::ClientContext>();
  ctx->set_deadline(absl::ToChronoTime(absl::Now() + options_.call_timeout));
  return ctx;
}

absl::StatusOr<v1::InitWeightTransferResponse>
TrainerClient::InitWeightTransfer(const v1::InitWeightTransferRequest& r) {
  return Call<v1::InitWeightTransferResponse>(
      stub_.get(), &v1::TrainerService::Stub::InitWeightTransfer,
      Context().get(), r);
}

absl::StatusOr<v1::StartWeightUpdateResponse> TrainerClient::StartWeightUpdate(
    const v1::StartWeightUpdateRequest& r) {
  return Call<v1::StartWeightUpdateResponse>(
      stub_.get(), &v1::TrainerService::Stub::StartWeightUpdate,
      Context().get(), r);
}

absl::Status TrainerClient::PushTensors(const std::string& update_id,
                                        const std::vector<HostTensor>& tensors,
                                        int64_t chunk_bytes) {
  Manifest manifest;
  manifest.Reserve(
      static_cast<int>(tensors.size()));  // 100k-tensor MoE updates
  for (const HostTensor& t : tensors) *manifest.Add() = t.spec;
  WS_ASSIGN_OR_RETURN(ChunkPlan plan, PlanChunks(manifest, chunk_bytes));
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
  return FromGrpcStatus(writer->Finish());
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
      stub_.get(), &v1::TrainerService::Stub::FinishWeightUpdate,
      Context().get(), r);
}

absl::StatusOr<v1::AbortWeightUpdateResponse> TrainerClient::AbortWeightUpdate(
    const std::string& update_id, const std::string& reason) {
  v1::AbortWeightUpdateRequest r;
  r.set_update_id(update_id);
  r.set_reason(reason);
  return Call<v1::AbortWeightUpdateResponse>(
      stub_.get(), &v1::TrainerService::Stub::AbortWeightUpdate,
      Context().get(), r);
}

absl::StatusOr<v1::PauseResponse> TrainerClient::Pause(
    const v1::PauseRequest& r) {
  return Call<v1::PauseResponse>(stub_.get(), &v1::TrainerService::Stub::Pause,
                                 Context().get(), r);
}

absl::StatusOr<v1::ResumeResponse> TrainerClient::Resume(
    const v1::ResumeRequest& r) {
  return Call<v1::ResumeResponse>(
      stub_.get(), &v1::TrainerService::Stub::Resume, Context().get(), r);
}

absl::StatusOr<int> TrainerClient::GetWorldSize() {
  WS_ASSIGN_OR_RETURN(v1::GetWorldSizeResponse r,
                      (Call<v1::GetWorldSizeResponse>(
                          stub_.get(), &v1::TrainerService::Stub::GetWorldSize,
                          Context().get(), v1::GetWorldSizeRequest())));
  return r.world_size();
}

absl::StatusOr<v1::GetStatusResponse> TrainerClient::GetStatus(
    bool include_layouts) {
  v1::GetStatusRequest r;
  r.set_include_layouts(include_layouts);
  return Call<v1::GetStatusResponse>(
      stub_.get(), &v1::TrainerService::Stub::GetStatus, Context().get(), r);
}

absl::StatusOr<v1::CheckEngineResponse> TrainerClient::CheckEngine(
    const std::string& engine_id) {
  v1::CheckEngineRequest r;
  r.set_engine_id(engine_id);
  return Call<v1::CheckEngineResponse>(
      stub_.get(), &v1::TrainerService::Stub::CheckEngine, Context().get(), r);
}

absl::StatusOr<v1::FinishWeightUpdateResponse> TrainerClient::Update(
    v1::StartWeightUpdateRequest request,
    const std::vector<HostTensor>& tensors) {
  request.clear_tensors();
  request.mutable_tensors()->Reserve(static_cast<int>(tensors.size()));
  for (const HostTensor& t : tensors) *request.add_tensors() = t.spec;
  WS_ASSIGN_OR_RETURN(v1::StartWeightUpdateResponse started,
                      StartWeightUpdate(request));
  absl::Status pushed =
      PushTensors(request.update_id(), tensors, started.chunk_bytes());
  if (!pushed.ok()) {
    // Finish reports the daemon's view (e.g. which engines are dirty).
    absl::StatusOr<v1::FinishWeightUpdateResponse> finished =
        FinishWeightUpdate(request.update_id());
    if (!finished.ok()) return finished.status();
    return pushed;
  }
  WS_ASSIGN_OR_RETURN(v1::FinishWeightUpdateResponse finished,
                      FinishWeightUpdate(request.update_id()));
  bool receipts = false;
  for (const v1::EngineResult& e : finished.engines()) {
    receipts = receipts || e.has_receipt();
  }
  if (request.verify() != v1::VERIFY_OFF && receipts) {
    WS_ASSIGN_OR_RETURN(v1::GetStatusResponse status, GetStatus(true));
    WS_RETURN_IF_ERROR(CheckReceipts(finished, status, tensors));
  }
  return finished;
}

}  // namespace weightsync

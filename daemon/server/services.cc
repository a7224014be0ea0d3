#include "daemon/server/services.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <memory>
#include <string>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "backends/host/shm_memory.h"
#include "common/echo.h"
#include "common/grpc_status.h"
#include "common/status_macros.h"
#include "daemon/server/request_checks.h"
#include "glog/logging.h"

namespace weightsync {
namespace {

// Runs `call` and moves its value into `response`, or converts its error.
template <typename Response, typename Call>
grpc::Status Answer(Response* response, Call&& call) {
  auto result = call();
  if (!result.ok()) return ToGrpcStatus(result.status());
  *response = *std::move(result);
  return grpc::Status::OK;
}

// Refuses a request whose own fields are out of bounds (request_checks.h).
#define WS_CHECK_REQUEST(request)                          \
  do {                                                     \
    if (absl::Status s = CheckRequest(request); !s.ok()) { \
      return ToGrpcStatus(s);                              \
    }                                                      \
  } while (false)

// The caller's credential for the caps of call_limits.h: its uid on the
// Unix socket, the token on TCP.
std::string PeerKey(const PeerLookup& peer_of, const std::string& peer) {
  if (peer_of) {
    if (std::optional<PeerCred> p = peer_of(peer); p.has_value()) {
      return absl::StrCat("uid ", p->uid);
    }
  }
  if (absl::StartsWith(peer, "ipv4:") || absl::StartsWith(peer, "ipv6:")) {
    return "the TCP token";
  }
  return peer;
}

absl::StatusOr<CallLimits::Ticket> Admit(CallLimits* limits,
                                         const PeerLookup& peer_of,
                                         grpc::ServerContext* ctx,
                                         CallLimits::Kind kind) {
  if (limits == nullptr) return CallLimits::Ticket();
  return limits->Enter(kind, PeerKey(peer_of, ctx->peer()));
}

// Holds a place among the caller's open calls for the handler's run, or
// ends the call with RESOURCE_EXHAUSTED (call_limits.h).
#define WS_ADMIT(ctx, kind)                                  \
  absl::StatusOr<CallLimits::Ticket> ws_admitted =           \
      Admit(limits_, peer_of_, ctx, CallLimits::Kind::kind); \
  if (!ws_admitted.ok()) return ToGrpcStatus(ws_admitted.status())

absl::Time ContextDeadline(grpc::ServerContext* ctx, absl::Duration fallback) {
  const auto d = ctx->deadline();
  if (d == std::chrono::system_clock::time_point::max()) {
    return absl::Now() + fallback;
  }
  return absl::FromChrono(d);
}

// An engine's control stream. Writes are serialised; once the handler
// returns (Close), sends fail instead of touching a dead stream.
class StreamChannel : public ControlChannel {
 public:
  explicit StreamChannel(
      grpc::ServerReaderWriter<v1::DaemonMessage, v1::EngineMessage>* stream)
      : stream_(stream) {}
  bool Send(const v1::DaemonMessage& message) override {
    absl::MutexLock lock(&mu_);
    return stream_ != nullptr && stream_->Write(message);
  }
  void Close() {
    absl::MutexLock lock(&mu_);
    stream_ = nullptr;
  }

 private:
  absl::Mutex mu_;
  grpc::ServerReaderWriter<v1::DaemonMessage, v1::EngineMessage>* stream_
      ABSL_GUARDED_BY(mu_);
};

}  // namespace

grpc::Status TrainerServiceImpl::CheckOwner(grpc::ServerContext* ctx,
                                            bool forming) {
  if (!peer_of_) return grpc::Status::OK;
  const std::optional<PeerCred> peer = peer_of_(ctx->peer());
  if (!peer.has_value() || peer->uid == 0) return grpc::Status::OK;
  absl::MutexLock lock(&owner_mu_);
  if (!owner_.has_value() || *owner_ == peer->uid) return grpc::Status::OK;
  return ToGrpcStatus(absl::PermissionDeniedError(absl::StrCat(
      "the transfer group belongs to uid ", *owner_,
      ", not to the caller (uid ", peer->uid, ", pid ", peer->pid, ")",
      forming ? ": another user's trainer can't take it over" : "")));
}

void TrainerServiceImpl::TakeOwnership(grpc::ServerContext* ctx) {
  if (!peer_of_) return;
  const std::optional<PeerCred> peer = peer_of_(ctx->peer());
  if (!peer.has_value()) return;
  absl::MutexLock lock(&owner_mu_);
  owner_ = peer->uid;
}

grpc::Status TrainerServiceImpl::InitWeightTransfer(
    grpc::ServerContext* ctx, const v1::InitWeightTransferRequest* request,
    v1::InitWeightTransferResponse* response) {
  WS_ADMIT(ctx, kCall);
  WS_CHECK_REQUEST(*request);
  grpc::Status owner = CheckOwner(ctx, /*forming=*/true);
  if (!owner.ok()) return owner;
  grpc::Status s =
      Answer(response, [&] { return core_->InitWeightTransfer(*request); });
  if (s.ok()) TakeOwnership(ctx);
  return s;
}

grpc::Status TrainerServiceImpl::StartWeightUpdate(
    grpc::ServerContext* ctx, const v1::StartWeightUpdateRequest* request,
    v1::StartWeightUpdateResponse* response) {
  WS_ADMIT(ctx, kCall);
  WS_CHECK_REQUEST(*request);
  grpc::Status owner = CheckOwner(ctx, false);
  if (!owner.ok()) return owner;
  if (peer_of_) {
    const std::optional<PeerCred> peer = peer_of_(ctx->peer());
    if (peer.has_value()) {
      absl::Status own = CheckOwnSource(*request, *peer);
      if (own.ok())
        own = core_->CheckTrainerUid(request->engine_ids(), peer->uid);
      if (!own.ok()) return ToGrpcStatus(own);
    }
  }
  grpc::Status started =
      Answer(response, [&] { return core_->StartWeightUpdate(*request); });
  if (!started.ok() || !request->finish()) return started;
  // One-call update (a registered source with memory): the daemon needs
  // nothing more from the trainer, so Finish runs here.
  v1::FinishWeightUpdateRequest finish;
  finish.set_update_id(request->update_id());
  finish.set_timeout_ms(request->finish_timeout_ms());
  return Answer(response->mutable_finished(),
                [&] { return core_->FinishWeightUpdate(finish); });
}

grpc::Status TrainerServiceImpl::RegisterSource(
    grpc::ServerContext* ctx, const v1::RegisterSourceRequest* request,
    v1::RegisterSourceResponse* response) {
  WS_ADMIT(ctx, kCall);
  grpc::Status owner = CheckOwner(ctx, false);
  if (!owner.ok()) return owner;
  if (peer_of_) {
    const std::optional<PeerCred> peer = peer_of_(ctx->peer());
    if (peer.has_value()) {
      absl::Status own = CheckOwnSourceMemory(*request, *peer);
      if (!own.ok()) return ToGrpcStatus(own);
    }
  }
  return Answer(response, [&] { return core_->RegisterSource(*request); });
}

grpc::Status TrainerServiceImpl::UnregisterSource(
    grpc::ServerContext* ctx, const v1::UnregisterSourceRequest* request,
    v1::UnregisterSourceResponse* response) {
  WS_ADMIT(ctx, kCall);
  WS_CHECK_REQUEST(*request);
  grpc::Status owner = CheckOwner(ctx, false);
  if (!owner.ok()) return owner;
  return Answer(response,
                [&]() -> absl::StatusOr<v1::UnregisterSourceResponse> {
                  WS_RETURN_IF_ERROR(core_->UnregisterSource(*request));
                  return v1::UnregisterSourceResponse();
                });
}

namespace {

// The link a chunk stream's first message names (a transfer-plan update's
// sender and receiver; the only stream otherwise).
StreamLink LinkOf(const v1::PushChunksRequest& r) {
  return {r.sender(), r.receiver()};
}
StreamLink LinkOf(const v1::IpcChunksRequest&) { return {}; }

// The loop both chunk streams share: the first message names the update,
// every later one names it or nothing; `each(request, deadline)` handles a
// message and returns false (with *status set) to end the stream early.
template <typename Request, typename Stream, typename Each>
grpc::Status ServeChunkStream(grpc::ServerContext* ctx, Stream* stream,
                              Coordinator* core, const char* rpc, Each each) {
  Request request;
  if (!stream->Read(&request)) {
    // gRPC ends a stream at a message that does not parse as it does at a
    // half-close: either way nothing arrived.
    return grpc::Status(
        grpc::StatusCode::INVALID_ARGUMENT,
        absl::StrCat(rpc,
                     ": the stream carried no message that parsed (it was "
                     "empty, or its first message is not a ",
                     Request::descriptor()->full_name(), "); nothing changed"));
  }
  const std::string update_id = request.update_id();
  absl::Status status =
      CheckIdLength("update_id", update_id, kMaxUpdateIdBytes);
  if (!status.ok()) return ToGrpcStatus(status);
  const StreamLink link = LinkOf(request);
  status = core->BeginPushStream(update_id, link);
  if (!status.ok()) return ToGrpcStatus(status);
  const absl::Time deadline = ContextDeadline(ctx, absl::Minutes(10));
  do {
    if (!request.update_id().empty() && request.update_id() != update_id) {
      status = absl::InvalidArgumentError(
          absl::StrCat("every ", rpc, " message must name the same update"));
      break;
    }
  } while (each(update_id, link, request, deadline, &status) &&
           stream->Read(&request));
  const absl::Status ended =
      core->PushStreamEnded(update_id, ctx->IsCancelled(), link);
  if (status.ok() && !ended.ok()) {
    status =
        absl::Status(ended.code(), absl::StrCat(rpc, ": ", ended.message()));
  }
  return ToGrpcStatus(status);
}

}  // namespace

grpc::Status TrainerServiceImpl::RegisterTransferPlan(
    grpc::ServerContext* ctx, const v1::RegisterTransferPlanRequest* request,
    v1::RegisterTransferPlanResponse* response) {
  WS_ADMIT(ctx, kCall);
  grpc::Status owner = CheckOwner(ctx, false);
  if (!owner.ok()) return owner;
  return Answer(response,
                [&] { return core_->RegisterTransferPlan(*request); });
}

grpc::Status TrainerServiceImpl::PushChunks(
    grpc::ServerContext* ctx, grpc::ServerReader<v1::PushChunksRequest>* reader,
    v1::PushChunksResponse* response) {
  WS_ADMIT(ctx, kCall);
  grpc::Status owner = CheckOwner(ctx, false);
  if (!owner.ok()) return owner;
  return ServeChunkStream<v1::PushChunksRequest>(
      ctx, reader, core_, "PushChunks",
      [&](const std::string& update_id, StreamLink link,
          v1::PushChunksRequest& request, absl::Time deadline,
          absl::Status* status) {
        const int64_t bytes = request.data().size();
        // The message's byte string becomes the staging buffer: no copy.
        *status = core_->PushChunk(update_id, request.chunk_index(),
                                   std::move(*request.mutable_data()), deadline,
                                   link);
        if (!status->ok()) return false;
        response->set_chunks_received(response->chunks_received() + 1);
        response->set_bytes_received(response->bytes_received() + bytes);
        return true;
      });
}

grpc::Status TrainerServiceImpl::IpcChunks(
    grpc::ServerContext* ctx,
    grpc::ServerReaderWriter<v1::IpcChunksResponse, v1::IpcChunksRequest>*
        stream) {
  WS_ADMIT(ctx, kCall);
  grpc::Status owner = CheckOwner(ctx, false);
  if (!owner.ok()) return owner;
  return ServeChunkStream<v1::IpcChunksRequest>(
      ctx, stream, core_, "IpcChunks",
      [&](const std::string& update_id, StreamLink,
          v1::IpcChunksRequest& request, absl::Time deadline,
          absl::Status* status) {
        *status =
            core_->PushChunk(update_id, request.chunk_index(), "", deadline);
        if (!status->ok()) return false;
        absl::StatusOr<int64_t> done =
            core_->IpcChunkAck(update_id, request.chunk_index(), deadline);
        if (!done.ok()) {
          *status = done.status();
          return false;
        }
        if (*done == 0) return true;
        v1::IpcChunksResponse response;
        response.set_chunks_done(*done);
        return stream->Write(response);
      });
}

grpc::Status TrainerServiceImpl::FinishWeightUpdate(
    grpc::ServerContext* ctx, const v1::FinishWeightUpdateRequest* request,
    v1::FinishWeightUpdateResponse* response) {
  WS_ADMIT(ctx, kCall);
  WS_CHECK_REQUEST(*request);
  grpc::Status owner = CheckOwner(ctx, false);
  if (!owner.ok()) return owner;
  return Answer(response, [&] { return core_->FinishWeightUpdate(*request); });
}

grpc::Status TrainerServiceImpl::PrepareWeightUpdate(
    grpc::ServerContext* ctx, const v1::PrepareWeightUpdateRequest* request,
    v1::PrepareWeightUpdateResponse* response) {
  WS_ADMIT(ctx, kCall);
  WS_CHECK_REQUEST(*request);
  grpc::Status owner = CheckOwner(ctx, false);
  if (!owner.ok()) return owner;
  return Answer(response, [&] { return core_->PrepareWeightUpdate(*request); });
}

grpc::Status TrainerServiceImpl::CommitWeightUpdate(
    grpc::ServerContext* ctx, const v1::CommitWeightUpdateRequest* request,
    v1::FinishWeightUpdateResponse* response) {
  WS_ADMIT(ctx, kCall);
  WS_CHECK_REQUEST(*request);
  grpc::Status owner = CheckOwner(ctx, false);
  if (!owner.ok()) return owner;
  return Answer(response, [&] { return core_->CommitWeightUpdate(*request); });
}

grpc::Status TrainerServiceImpl::AbortWeightUpdate(
    grpc::ServerContext* ctx, const v1::AbortWeightUpdateRequest* request,
    v1::AbortWeightUpdateResponse* response) {
  WS_ADMIT(ctx, kCall);
  WS_CHECK_REQUEST(*request);
  grpc::Status owner = CheckOwner(ctx, false);
  if (!owner.ok()) return owner;
  return Answer(response, [&] { return core_->AbortWeightUpdate(*request); });
}

grpc::Status TrainerServiceImpl::Pause(grpc::ServerContext* ctx,
                                       const v1::PauseRequest* request,
                                       v1::PauseResponse* response) {
  WS_ADMIT(ctx, kCall);
  WS_CHECK_REQUEST(*request);
  grpc::Status owner = CheckOwner(ctx, false);
  if (!owner.ok()) return owner;
  return Answer(response, [&] { return core_->Pause(*request); });
}

grpc::Status TrainerServiceImpl::Resume(grpc::ServerContext* ctx,
                                        const v1::ResumeRequest* request,
                                        v1::ResumeResponse* response) {
  WS_ADMIT(ctx, kCall);
  WS_CHECK_REQUEST(*request);
  grpc::Status owner = CheckOwner(ctx, false);
  if (!owner.ok()) return owner;
  return Answer(response, [&] { return core_->Resume(*request); });
}

grpc::Status TrainerServiceImpl::GetWorldSize(
    grpc::ServerContext* ctx, const v1::GetWorldSizeRequest* request,
    v1::GetWorldSizeResponse* response) {
  WS_ADMIT(ctx, kCall);
  WS_CHECK_REQUEST(*request);
  *response = core_->GetWorldSize(*request);
  return grpc::Status::OK;
}

grpc::Status TrainerServiceImpl::GetStatus(grpc::ServerContext* ctx,
                                           const v1::GetStatusRequest* request,
                                           v1::GetStatusResponse* response) {
  WS_ADMIT(ctx, kCall);
  *response = core_->GetStatus(request->include_layouts());
  return grpc::Status::OK;
}

grpc::Status TrainerServiceImpl::CheckEngine(
    grpc::ServerContext* ctx, const v1::CheckEngineRequest* request,
    v1::CheckEngineResponse* response) {
  WS_ADMIT(ctx, kCall);
  WS_CHECK_REQUEST(*request);
  if (owners_ != nullptr) {
    const std::optional<PeerCred> peer =
        peer_of_ ? peer_of_(ctx->peer()) : std::nullopt;
    absl::Status own = owners_->Check(request->engine_id(), peer,
                                      EngineOwners::Action::kCheck);
    if (!own.ok()) return ToGrpcStatus(own);
  }
  // Reads the engine's whole memory: a few at a time, all peers together.
  absl::StatusOr<CallLimits::Ticket> read =
      limits_ != nullptr ? limits_->Enter(CallLimits::Kind::kEngineRead, "")
                         : CallLimits::Ticket();
  if (!read.ok()) return ToGrpcStatus(read.status());
  return Answer(response, [&] { return core_->CheckEngine(*request); });
}

void TrainerServiceImpl::EndLivenessStreams() {
  absl::MutexLock lock(&live_mu_);
  live_ended_ = true;
  for (grpc::ServerContext* ctx : live_) ctx->TryCancel();
}

grpc::Status TrainerServiceImpl::Liveness(
    grpc::ServerContext* ctx,
    grpc::ServerReaderWriter<v1::LivenessResponse, v1::LivenessRequest>*
        stream) {
  // Holds one of the peer's call places for the trainer's life.
  WS_ADMIT(ctx, kCall);
  grpc::Status owner = CheckOwner(ctx, false);
  if (!owner.ok()) return owner;
  v1::LivenessRequest request;
  if (!stream->Read(&request)) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        "Liveness: the stream carried no message that parsed "
                        "(the first names the group); nothing is held");
  }
  absl::Status s = CheckIdLength("group_id", request.group_id(), 64);
  if (!s.ok()) return ToGrpcStatus(s);
  {
    absl::MutexLock lock(&live_mu_);
    if (live_ended_) {
      return grpc::Status(grpc::StatusCode::UNAVAILABLE,
                          "daemon is shutting down");
    }
    live_.insert(ctx);
  }
  struct Forget {
    TrainerServiceImpl* self;
    grpc::ServerContext* ctx;
    ~Forget() {
      absl::MutexLock lock(&self->live_mu_);
      self->live_.erase(ctx);
    }
  } forget{this, ctx};
  absl::StatusOr<int64_t> hold = core_->HoldGroup(request.group_id());
  if (!hold.ok()) return ToGrpcStatus(hold.status());
  v1::LivenessResponse held;
  held.set_held(true);
  stream->Write(held);
  // Nothing more is expected: the stream's end is the news. A process that
  // dies has its socket closed by the kernel, which cancels the call here
  // at once; keepalive (--keepalive_ms) cancels it on a cut network.
  while (stream->Read(&request)) {
  }
  bool server_stopping;
  {
    absl::MutexLock lock(&live_mu_);
    server_stopping = live_ended_;
  }
  // A server that stops (EndLivenessStreams) says nothing of the trainer.
  core_->ReleaseGroup(*hold,
                      ctx->IsCancelled()
                          ? "its connection closed (the process "
                            "exited, or keepalive found it cut off)"
                          : "it closed its Liveness stream",
                      !server_stopping);
  return grpc::Status::OK;
}

namespace {

// A CUDA VMM handle ("pid:fd") must name the caller's pid: the daemon takes
// the descriptor out of that process (pidfd_getfd).
absl::Status CheckVmmOwner(const v1::Allocation& a, const PeerCred& peer,
                           absl::string_view what, absl::string_view rule) {
  if (a.kind() != v1::MEMORY_CUDA_VMM) return absl::OkStatus();
  const size_t colon = a.handle().find(':');
  int64_t pid = -1;
  if (colon != std::string::npos &&
      absl::SimpleAtoi(a.handle().substr(0, colon), &pid) && pid != peer.pid) {
    return absl::PermissionDeniedError(
        absl::StrCat(what, ": a CUDA VMM handle of pid ", pid,
                     ", but the caller is pid ", peer.pid, ": ", rule));
  }
  return absl::OkStatus();
}

// A host shared-memory allocation `a` must belong to the peer (root may
// name any). Never blocks, follows no link, regular files only (a peer's
// FIFO would hold the handler forever). A missing object is the mapper's
// to name.
absl::Status CheckShmOwner(const v1::Allocation& a, const PeerCred& peer,
                           absl::string_view what, absl::string_view rule) {
  if (a.kind() != v1::MEMORY_HOST_SHM || peer.uid == 0) {
    return absl::OkStatus();
  }
  struct stat st;
  absl::StatusOr<int> fd = OpenShmObject(a.handle(), O_RDONLY, &st);
  if (!fd.ok()) {
    if (absl::IsNotFound(fd.status())) return absl::OkStatus();
    return absl::Status(fd.status().code(),
                        absl::StrCat(what, ": ", fd.status().message()));
  }
  close(*fd);
  if (st.st_uid != peer.uid) {
    return absl::PermissionDeniedError(absl::StrCat(
        what, ": shared memory '", Echo(a.handle()), "' belongs to uid ",
        st.st_uid, ", not to the caller (uid ", peer.uid, "): ", rule));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CheckOwnSourceMemory(const v1::RegisterSourceRequest& request,
                                  const PeerCred& peer) {
  constexpr absl::string_view rule = "a trainer shares only its own memory";
  for (int i = 0; i < request.allocations_size(); ++i) {
    const std::string what = absl::StrCat("source allocation ", i);
    WS_RETURN_IF_ERROR(CheckVmmOwner(request.allocations(i), peer, what, rule));
    WS_RETURN_IF_ERROR(CheckShmOwner(request.allocations(i), peer, what, rule));
  }
  return absl::OkStatus();
}

absl::Status CheckOwnSource(const v1::StartWeightUpdateRequest& request,
                            const PeerCred& peer) {
  if (!request.has_ipc_source()) return absl::OkStatus();
  return CheckVmmOwner(request.ipc_source(), peer, "ipc_source",
                       "a trainer shares only its own memory");
}

absl::Status CheckOwnAllocations(const v1::RegisterEngineRequest& request,
                                 const PeerCred& peer) {
  for (int i = 0; i < request.allocations_size(); ++i) {
    const v1::Allocation& a = request.allocations(i);
    if (a.kind() == v1::MEMORY_CUDA_VMM) {
      absl::Status s = CheckVmmOwner(a, peer, absl::StrCat("allocation ", i),
                                     "an engine registers only its own memory");
      if (!s.ok()) return s;
    } else {
      WS_RETURN_IF_ERROR(CheckShmOwner(a, peer, absl::StrCat("allocation ", i),
                                       "an engine registers only its own "
                                       "memory"));
    }
  }
  return absl::OkStatus();
}

std::optional<PeerCred> EngineServiceImpl::PeerOf(grpc::ServerContext* ctx) {
  return peer_of_ ? peer_of_(ctx->peer()) : std::nullopt;
}

grpc::Status EngineServiceImpl::RegisterEngine(
    grpc::ServerContext* ctx, const v1::RegisterEngineRequest* request,
    v1::RegisterEngineResponse* response) {
  WS_ADMIT(ctx, kCall);
  WS_CHECK_REQUEST(*request);
  const std::optional<PeerCred> peer = PeerOf(ctx);
  absl::Status own = owners_->Check(request->engine_id(), peer,
                                    EngineOwners::Action::kRegister);
  if (own.ok() && peer.has_value()) own = CheckOwnAllocations(*request, *peer);
  if (!own.ok()) return ToGrpcStatus(own);
  grpc::Status s =
      Answer(response, [&] { return core_->RegisterEngine(*request); });
  if (s.ok()) {
    EngineOwners::Owner owner{peer, {}};
    for (const v1::Allocation& a : request->allocations()) {
      if (a.kind() == v1::MEMORY_HOST_SHM)
        owner.shm_names.push_back(a.handle());
    }
    owners_->Record(request->engine_id(), std::move(owner));
  }
  return s;
}

void EngineServiceImpl::CancelControlStreams() {
  absl::MutexLock lock(&streams_mu_);
  streams_cancelled_ = true;
  for (grpc::ServerContext* ctx : streams_) ctx->TryCancel();
}

void EngineServiceImpl::Forget(const std::string& engine) {
  // If the engine's process died, nobody else will remove its shared
  // memory (shm_reaper.h).
  std::optional<EngineOwners::Owner> owner = owners_->Remove(engine);
  if (owner.has_value() && owner->peer.has_value()) {
    reaper_.UnlinkWhenGone(owner->peer->pid, owner->peer->uid,
                           owner->shm_names);
  }
}

grpc::Status EngineServiceImpl::UnregisterEngine(
    grpc::ServerContext* ctx, const v1::UnregisterEngineRequest* request,
    v1::UnregisterEngineResponse*) {
  WS_ADMIT(ctx, kCall);
  WS_CHECK_REQUEST(*request);
  absl::Status s = owners_->Check(request->engine_id(), PeerOf(ctx),
                                  EngineOwners::Action::kUnregister);
  if (s.ok()) s = core_->UnregisterEngine(request->engine_id());
  if (s.ok()) Forget(request->engine_id());
  return ToGrpcStatus(s);
}

grpc::Status EngineServiceImpl::Control(
    grpc::ServerContext* ctx,
    grpc::ServerReaderWriter<v1::DaemonMessage, v1::EngineMessage>* stream) {
  WS_ADMIT(ctx, kControl);
  v1::EngineMessage message;
  if (!stream->Read(&message) || !message.has_hello()) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        "Control: the first message must be a Hello");
  }
  WS_CHECK_REQUEST(message.hello());
  const std::string engine = message.hello().engine_id();
  absl::Status status =
      owners_->Check(engine, PeerOf(ctx), EngineOwners::Action::kControl);
  if (!status.ok()) return ToGrpcStatus(status);
  {
    absl::MutexLock lock(&streams_mu_);
    if (streams_cancelled_) {
      return grpc::Status(grpc::StatusCode::UNAVAILABLE,
                          "daemon is shutting down");
    }
    streams_.insert(ctx);
  }
  struct Untrack {
    EngineServiceImpl* self;
    grpc::ServerContext* ctx;
    ~Untrack() {
      absl::MutexLock lock(&self->streams_mu_);
      self->streams_.erase(ctx);
    }
  } untrack{this, ctx};
  auto channel = std::make_shared<StreamChannel>(stream);
  // ALREADY_EXISTS while another stream speaks for the engine.
  status = core_->AttachControl(engine, channel);
  if (!status.ok()) return ToGrpcStatus(status);
  VLOG(1) << "engine " << engine << " control stream open";
  while (stream->Read(&message)) {
    if (!message.has_ack()) continue;
    const v1::EngineMessage::Ack& ack = message.ack();
    if (ack.notice_id() != 0) {
      core_->OnAck(engine, ack);
    } else if (!ack.ok() &&
               core_->EngineLost(engine, ack.message().substr(0, 1024))) {
      // Notice 0 is never sent: its refusal is the engine reporting that
      // its registered memory is no longer its weights (docs/protocol.md,
      // "EngineService"). Daemons before this ignore it as a foreign ack.
      Forget(engine);
    }
  }
  channel->Close();
  // Only the stream that spoke for the engine removes it (and its owner).
  if (core_->DetachControl(engine, channel.get())) Forget(engine);
  return grpc::Status::OK;
}

}  // namespace weightsync

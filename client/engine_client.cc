#include "client/engine_client.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "client/unary_call.h"
#include "common/grpc_status.h"
#include "common/status_macros.h"

namespace weightsync {

EngineClient::EngineClient(ClientOptions options,
                           std::shared_ptr<grpc::Channel> channel)
    : options_(std::move(options)),
      channel_(std::move(channel)),
      stub_(v1::EngineService::NewStub(channel_)) {}

absl::StatusOr<std::unique_ptr<EngineClient>> EngineClient::Connect(
    const ClientOptions& options) {
  WS_ASSIGN_OR_RETURN(auto channel, ConnectChannel(options));
  return std::unique_ptr<EngineClient>(
      new EngineClient(options, std::move(channel)));
}

EngineClient::~EngineClient() { Close(); }

absl::StatusOr<v1::RegisterEngineResponse> EngineClient::Register(
    const v1::RegisterEngineRequest& request) {
  if (thread_.joinable()) {
    // Its notice thread reads the registration: Unregister first.
    return absl::FailedPreconditionError(absl::StrCat(
        "EngineClient::Register: engine '", engine_id_,
        "' is registered and its control stream open; call Unregister() "
        "before registering again"));
  }
  v1::RegisterEngineResponse response;
  WS_RETURN_IF_ERROR(CallUnary(channel_.get(), options_, "RegisterEngine",
                               [&](grpc::ClientContext* ctx) {
                                 response.Clear();
                                 return stub_->RegisterEngine(ctx, request,
                                                              &response);
                               }));
  registration_ = request;
  engine_id_ = request.engine_id();
  version_ = response.version();
  {
    absl::MutexLock lock(&lost_mu_);
    lost_.clear();
  }
  return response;
}

absl::Status EngineClient::Unregister() { return Leave(/*patient=*/true); }

absl::Status EngineClient::Leave(bool patient) {
  absl::Status s;
  if (!engine_id_.empty()) {
    ClientOptions options = options_;
    if (!patient) {
      options.call_timeout = std::min(options.call_timeout, absl::Seconds(1));
    }
    v1::UnregisterEngineRequest request;
    request.set_engine_id(engine_id_);
    v1::UnregisterEngineResponse response;
    // Before the stream closes: the daemon then records a clean leave
    // ("unregistered"), not a lost stream.
    s = CallUnary(
        channel_.get(), options, "UnregisterEngine",
        [&](grpc::ClientContext* ctx) {
          return stub_->UnregisterEngine(ctx, request, &response);
        },
        /*retry=*/patient);
    // Gone already (its stream closed, it expired), or a daemon that can't
    // be reached: it forgets the engine once the stream below closes (a
    // restarted one never knew it).
    if (absl::IsNotFound(s) || absl::IsUnavailable(s)) s = absl::OkStatus();
  }
  StopControl();
  engine_id_.clear();
  registration_.Clear();
  return s;
}

absl::Status EngineClient::StartControl(EngineHooks hooks) {
  if (engine_id_.empty()) {
    return absl::FailedPreconditionError("Register before StartControl");
  }
  if (thread_.joinable()) {
    return absl::FailedPreconditionError("control stream already open");
  }
  hooks_ = std::move(hooks);
  {
    absl::MutexLock lock(&stream_mu_);
    closing_ = false;  // after an Unregister, registered again
    WS_RETURN_IF_ERROR(OpenStreamLocked());
  }
  thread_ = std::thread([this] { Run(); });
  return absl::OkStatus();
}

absl::Status EngineClient::OpenStreamLocked() {
  control_ctx_ = std::make_unique<grpc::ClientContext>();
  control_ = stub_->Control(control_ctx_.get());
  v1::EngineMessage hello;
  hello.mutable_hello()->set_engine_id(engine_id_);
  if (!control_->Write(hello)) {
    absl::Status s = UserStatus(options_.target, "Control", control_->Finish(),
                                options_.call_timeout);
    control_.reset();
    return s.ok() ? absl::UnavailableError("control stream closed") : s;
  }
  return absl::OkStatus();
}

absl::Status EngineClient::Reregister() {
  v1::RegisterEngineRequest request = registration_;
  request.set_version(version_.load());
  // Paused for an update when the daemon vanished: maybe half written.
  request.set_dirty(dirty_.load() || paused_.load());
  v1::RegisterEngineResponse response;
  // One try: Run's loop paces the retries.
  WS_RETURN_IF_ERROR(CallUnary(
      channel_.get(), options_, "RegisterEngine",
      [&](grpc::ClientContext* ctx) {
        return stub_->RegisterEngine(ctx, request, &response);
      },
      /*retry=*/false));
  if (request.dirty()) dirty_ = true;
  return absl::OkStatus();
}

void EngineClient::Run() {
  absl::Duration backoff = absl::Milliseconds(50);
  while (true) {
    Serve();
    // The stream ended: Close, or the daemon went away.
    absl::MutexLock lock(&stream_mu_);
    if (control_ != nullptr) {
      control_->Finish().IgnoreError();
      control_.reset();
    }
    auto closing = [this]() ABSL_SHARED_LOCKS_REQUIRED(stream_mu_) {
      return closing_;
    };
    if (!lost().empty()) {
      // The memory is gone: never register it again (register anew to
      // come back).
      stream_mu_.Await(absl::Condition(&closing));
      return;
    }
    while (!closing_) {
      if (stream_mu_.AwaitWithTimeout(absl::Condition(&closing), backoff)) {
        return;
      }
      backoff = std::min(backoff * 2, absl::Seconds(2));
      // Reach a restarted daemon as soon as it listens, not after gRPC's
      // own reconnect back-off.
      grpc::experimental::ChannelResetConnectionBackoff(channel_.get());
      stream_mu_.Unlock();
      const absl::Status registered = Reregister();
      stream_mu_.Lock();
      if (registered.ok() && !closing_ && OpenStreamLocked().ok()) {
        ++reconnects_;
        backoff = absl::Milliseconds(50);
        break;
      }
    }
    if (closing_) return;
  }
}

void EngineClient::Serve() {
  v1::DaemonMessage m;
  while (control_->Read(&m)) {
    // At a pause, before the Ack: no byte of the update is written to
    // memory that is gone (docs/protocol.md, "Control"); at a resume, after.
    if (m.has_pause() && !CheckMemory()) break;
    absl::Status result;
    switch (m.kind_case()) {
      case v1::DaemonMessage::kPause:
        if (hooks_.on_pause) result = hooks_.on_pause(m.pause().mode());
        if (result.ok()) paused_ = true;
        break;
      case v1::DaemonMessage::kResume:
        if (hooks_.on_resume) result = hooks_.on_resume();
        if (result.ok()) paused_ = false;
        break;
      case v1::DaemonMessage::kNewVersion: {
        absl::MutexLock lock(&mu_);
        version_ = m.new_version().version();
        dirty_ = false;
        if (hooks_.on_new_version) hooks_.on_new_version(version_);
        break;
      }
      case v1::DaemonMessage::kDirty:
        dirty_ = true;
        if (hooks_.on_dirty) hooks_.on_dirty(m.dirty().reason());
        break;
      default:
        break;
    }
    v1::EngineMessage ack;
    ack.mutable_ack()->set_notice_id(m.notice_id());
    ack.mutable_ack()->set_ok(result.ok());
    ack.mutable_ack()->set_message(std::string(result.message()));
    if (!control_->Write(ack)) break;
    if (m.has_resume() && !CheckMemory()) break;
  }
}

bool EngineClient::CheckMemory() {
  if (!hooks_.check_memory || !lost().empty()) return true;
  const absl::Status memory = hooks_.check_memory();
  if (memory.ok()) return true;
  const std::string why = memory.message().empty()
                              ? "the engine's check_memory hook failed"
                              : std::string(memory.message());
  {
    absl::MutexLock lock(&lost_mu_);
    lost_ = why;
  }
  // No notice has id 0: a refused Ack of it says "my registered memory is
  // no longer my weights" (docs/protocol.md, "EngineService"). The daemon
  // then unregisters the engine, naming `why`.
  v1::EngineMessage gone;
  gone.mutable_ack()->set_notice_id(0);
  gone.mutable_ack()->set_ok(false);
  gone.mutable_ack()->set_message(why);
  return control_->Write(gone);
}

std::string EngineClient::lost() const {
  absl::MutexLock lock(&lost_mu_);
  return lost_;
}

bool EngineClient::WaitForVersion(int64_t version, absl::Time deadline) {
  absl::MutexLock lock(&mu_);
  auto reached = [&] { return version_.load() >= version; };
  return mu_.AwaitWithDeadline(absl::Condition(&reached), deadline);
}

void EngineClient::Close() { Leave(/*patient=*/false).IgnoreError(); }

void EngineClient::StopControl() {
  {
    absl::MutexLock lock(&stream_mu_);
    closing_ = true;
    if (control_ctx_ != nullptr) control_ctx_->TryCancel();
  }
  if (thread_.joinable()) thread_.join();
  absl::MutexLock lock(&stream_mu_);
  if (control_ != nullptr) {
    control_->Finish().IgnoreError();
    control_.reset();
  }
  control_ctx_.reset();
}

}  // namespace weightsync

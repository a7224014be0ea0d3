// EngineClient: what an inference engine worker calls to offer its weights
// to weightsyncd. Register once, then StartControl: a background thread
// receives pause / resume / new-version / dirty notices, runs the engine's
// hooks and acknowledges each one. version() is the committed weight version
// (tag responses with it). If the daemon goes away (crash, restart), the
// thread registers the same memory again with the current version (dirty if
// the engine was paused for an update: its memory may hold part of it) and
// reopens the stream, retrying with backoff until Unregister or Close. An
// engine that is done calls Unregister (or Close, or lets the destructor
// run): it leaves cleanly instead of being noticed by its stream closing.
// Thread-safe, except that Register, Unregister, StartControl and Close
// are called by one owner; Close (or the destructor) joins.
#ifndef WEIGHTSYNC_CLIENT_ENGINE_CLIENT_H_
#define WEIGHTSYNC_CLIENT_ENGINE_CLIENT_H_

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "client/channel.h"
#include "weightsync/v1/engine_service.grpc.pb.h"

namespace weightsync {

struct EngineHooks {
  // Stop (or freeze) generation; an error refuses the pause.
  std::function<absl::Status(v1::PauseMode)> on_pause;
  std::function<absl::Status()> on_resume;
  std::function<void(int64_t version)> on_new_version;
  std::function<void(const std::string& reason)> on_dirty;
  // Optional, run at each pause (before acknowledging it, so that the
  // update goes on without this engine) and after each resume: an error says
  // the registered memory is no longer the engine's weights (freed, moved,
  // reallocated: the contract is "unregister before freeing"). The client
  // then tells the daemon, which unregisters the engine (an update reports
  // it lost, naming the error's message, instead of calling it READY), and
  // never registers that memory again; lost() says why.
  std::function<absl::Status()> check_memory;
};

class EngineClient {
 public:
  static absl::StatusOr<std::unique_ptr<EngineClient>> Connect(
      const ClientOptions& options);
  ~EngineClient();

  // Retried while the daemon is unreachable and the request was not sent
  // (client/unary_call.h).
  absl::StatusOr<v1::RegisterEngineResponse> Register(
      const v1::RegisterEngineRequest& request);
  // Leaves cleanly: tells the daemon to forget this engine (no update
  // reaches it after this returns; an update in progress reports it lost,
  // "unregistered"), then ends the control stream and joins the notice
  // thread, which no longer registers the engine again after a daemon
  // restart. The engine may Register (and StartControl) again. Idempotent:
  // OK if the engine is not registered (never, already, or forgotten by
  // the daemon: its stream closed, it expired for want of a control
  // stream) or the daemon can't be reached (it forgets the engine when the
  // stream closes; a restarted one never knew it). Another refusal (e.g.
  // PERMISSION_DENIED) is returned, the stream ended all the same.
  absl::Status Unregister();
  // Opens the control stream and starts the notice thread.
  absl::Status StartControl(EngineHooks hooks);
  // Unregister, waiting at most 1 s (one try) for a daemon that is down;
  // nothing stays registered. The destructor calls it.
  void Close();

  int64_t version() const { return version_.load(); }
  // Times the thread registered again after the daemon went away.
  int64_t reconnects() const { return reconnects_.load(); }
  bool paused() const { return paused_.load(); }
  bool dirty() const { return dirty_.load(); }
  // Why check_memory said the memory is gone ("" while it has not).
  std::string lost() const;
  // Blocks until version() >= `version` or `deadline`; true if reached.
  bool WaitForVersion(int64_t version, absl::Time deadline);
  const std::string& engine_id() const { return engine_id_; }

 private:
  EngineClient(ClientOptions options, std::shared_ptr<grpc::Channel> channel);
  void Run();
  // Unregister (patient: call_timeout and retries) or Close (1 s, one try).
  absl::Status Leave(bool patient);
  // Ends the control stream and joins the notice thread.
  void StopControl();
  // Reads notices until the stream ends.
  void Serve();
  // Runs hooks_.check_memory; on an error, reports the engine's memory
  // gone. False if the stream broke.
  bool CheckMemory();
  // Opens the control stream and says hello (stream_mu_ held).
  absl::Status OpenStreamLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(stream_mu_);
  // Registers again after the daemon went away.
  absl::Status Reregister();

  const ClientOptions options_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::EngineService::Stub> stub_;
  std::string engine_id_;
  EngineHooks hooks_;
  std::unique_ptr<grpc::ClientContext> control_ctx_;
  std::unique_ptr<
      grpc::ClientReaderWriter<v1::EngineMessage, v1::DaemonMessage>>
      control_;
  std::thread thread_;
  v1::RegisterEngineRequest registration_;
  absl::Mutex stream_mu_;  // control_ctx_ / control_ replaced on reconnect
  bool closing_ ABSL_GUARDED_BY(stream_mu_) = false;
  std::atomic<int64_t> reconnects_{0};
  std::atomic<int64_t> version_{0};
  std::atomic<bool> paused_{false};
  std::atomic<bool> dirty_{false};
  absl::Mutex mu_;
  // Its own mutex: hooks run under mu_ may call lost().
  mutable absl::Mutex lost_mu_;
  std::string lost_ ABSL_GUARDED_BY(lost_mu_);
};

}  // namespace weightsync

#endif  // WEIGHTSYNC_CLIENT_ENGINE_CLIENT_H_

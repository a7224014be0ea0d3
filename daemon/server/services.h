// The gRPC front: thin service classes that take a request, call the
// Coordinator and convert its absl::Status. They hold no state of their
// own. gRPC's thread pool calls them concurrently; the Coordinator is
// thread-safe. No handler waits on CUDA or NCCL.
#ifndef WEIGHTSYNC_DAEMON_SERVER_SERVICES_H_
#define WEIGHTSYNC_DAEMON_SERVER_SERVICES_H_

#include <functional>
#include <optional>

#include "absl/container/flat_hash_set.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "daemon/core/coordinator.h"
#include "daemon/server/call_limits.h"
#include "daemon/server/engine_owners.h"
#include "daemon/server/shm_reaper.h"
#include "daemon/server/unix_listener.h"
#include "weightsync/v1/engine_service.grpc.pb.h"
#include "weightsync/v1/trainer_service.grpc.pb.h"

namespace weightsync {

// The credentials of the peer gRPC names `grpc_peer`, where known (a
// connection through the daemon's own Unix listener).
using PeerLookup =
    std::function<std::optional<PeerCred>(const std::string& grpc_peer)>;

// OK if every allocation `request` registers is the caller's own: a CUDA
// VMM handle ("pid:fd") must name the caller's pid, and a host shared
// memory object must belong to the caller's uid (root may register any).
// PERMISSION_DENIED naming the allocation otherwise. Legacy CUDA IPC
// handles carry no owner (docs/security.md).
absl::Status CheckOwnAllocations(const v1::RegisterEngineRequest& request,
                                 const PeerCred& peer);
// The same for a trainer's StartWeightUpdateRequest.ipc_source: the daemon
// reads from it, so it must be the caller's own (a CUDA VMM handle of its
// pid).
absl::Status CheckOwnSourceMemory(const v1::RegisterSourceRequest& request,
                                  const PeerCred& peer);
absl::Status CheckOwnSource(const v1::StartWeightUpdateRequest& request,
                            const PeerCred& peer);

class TrainerServiceImpl final : public v1::TrainerService::Service {
 public:
  // `owners` (may be null: no ownership checks) outlives the service.
  explicit TrainerServiceImpl(Coordinator* core,
                              const EngineOwners* owners = nullptr)
      : core_(core), owners_(owners) {}
  // Set before the server starts.
  void set_peer_lookup(PeerLookup lookup) { peer_of_ = std::move(lookup); }
  // Set before the server starts; null (the default): no caps.
  void set_limits(CallLimits* limits) { limits_ = limits; }

  grpc::Status InitWeightTransfer(
      grpc::ServerContext* ctx, const v1::InitWeightTransferRequest* request,
      v1::InitWeightTransferResponse* response) override;
  grpc::Status StartWeightUpdate(
      grpc::ServerContext* ctx, const v1::StartWeightUpdateRequest* request,
      v1::StartWeightUpdateResponse* response) override;
  grpc::Status RegisterSource(grpc::ServerContext* ctx,
                              const v1::RegisterSourceRequest* request,
                              v1::RegisterSourceResponse* response) override;
  grpc::Status UnregisterSource(
      grpc::ServerContext* ctx, const v1::UnregisterSourceRequest* request,
      v1::UnregisterSourceResponse* response) override;
  grpc::Status RegisterTransferPlan(
      grpc::ServerContext* ctx, const v1::RegisterTransferPlanRequest* request,
      v1::RegisterTransferPlanResponse* response) override;
  grpc::Status PushChunks(grpc::ServerContext* ctx,
                          grpc::ServerReader<v1::PushChunksRequest>* reader,
                          v1::PushChunksResponse* response) override;
  grpc::Status IpcChunks(
      grpc::ServerContext* ctx,
      grpc::ServerReaderWriter<v1::IpcChunksResponse, v1::IpcChunksRequest>*
          stream) override;
  grpc::Status FinishWeightUpdate(
      grpc::ServerContext* ctx, const v1::FinishWeightUpdateRequest* request,
      v1::FinishWeightUpdateResponse* response) override;
  grpc::Status PrepareWeightUpdate(
      grpc::ServerContext* ctx, const v1::PrepareWeightUpdateRequest* request,
      v1::PrepareWeightUpdateResponse* response) override;
  grpc::Status CommitWeightUpdate(
      grpc::ServerContext* ctx, const v1::CommitWeightUpdateRequest* request,
      v1::FinishWeightUpdateResponse* response) override;
  grpc::Status AbortWeightUpdate(
      grpc::ServerContext* ctx, const v1::AbortWeightUpdateRequest* request,
      v1::AbortWeightUpdateResponse* response) override;
  grpc::Status Pause(grpc::ServerContext* ctx, const v1::PauseRequest* request,
                     v1::PauseResponse* response) override;
  grpc::Status Resume(grpc::ServerContext* ctx,
                      const v1::ResumeRequest* request,
                      v1::ResumeResponse* response) override;
  grpc::Status GetWorldSize(grpc::ServerContext* ctx,
                            const v1::GetWorldSizeRequest* request,
                            v1::GetWorldSizeResponse* response) override;
  grpc::Status GetStatus(grpc::ServerContext* ctx,
                         const v1::GetStatusRequest* request,
                         v1::GetStatusResponse* response) override;
  grpc::Status CheckEngine(grpc::ServerContext* ctx,
                           const v1::CheckEngineRequest* request,
                           v1::CheckEngineResponse* response) override;
  // Holds the group for the stream's life (Coordinator::HoldGroup); its end
  // releases it. Occupies one handler thread while open.
  // EndLivenessStreams (the server stopping) cancels every open one, so
  // that they don't hold the stop up for its grace, and refuses new ones.
  void EndLivenessStreams();
  grpc::Status Liveness(
      grpc::ServerContext* ctx,
      grpc::ServerReaderWriter<v1::LivenessResponse, v1::LivenessRequest>*
          stream) override;

 private:
  // The transfer group belongs to the uid whose trainer formed it (over the
  // Unix socket): calls that steer updates or pauses from another uid (not
  // root) are PERMISSION_DENIED, so one local user can't drive or hijack
  // another's updates. `forming`: InitWeightTransfer, which takes the group
  // over when allowed.
  grpc::Status CheckOwner(grpc::ServerContext* ctx, bool forming);
  // After a successful InitWeightTransfer.
  void TakeOwnership(grpc::ServerContext* ctx);

  Coordinator* const core_;
  const EngineOwners* const owners_;
  PeerLookup peer_of_;
  CallLimits* limits_ = nullptr;
  absl::Mutex owner_mu_;
  std::optional<uid_t> owner_ ABSL_GUARDED_BY(owner_mu_);
  absl::Mutex live_mu_;
  absl::flat_hash_set<grpc::ServerContext*> live_ ABSL_GUARDED_BY(live_mu_);
  bool live_ended_ ABSL_GUARDED_BY(live_mu_) = false;
};

// Every call that speaks for an engine (Register of a known id, Control,
// Unregister) is checked against `owners` (engine_owners.h) first; a
// registration records its caller as the owner, and the stream or call
// that ends the engine forgets it.
class EngineServiceImpl final : public v1::EngineService::Service {
 public:
  // `owners` outlives the service.
  // Takes the core's engine-expired listener (an expired engine is
  // forgotten as an unregistered one is).
  EngineServiceImpl(Coordinator* core, EngineOwners* owners)
      : core_(core), owners_(owners) {
    core_->set_engine_expired_listener(
        [this](const std::string& engine) { Forget(engine); });
  }
  // Set before the server starts.
  void set_peer_lookup(PeerLookup lookup) { peer_of_ = std::move(lookup); }
  // Set before the server starts; null (the default): no caps.
  void set_limits(CallLimits* limits) { limits_ = limits; }

  grpc::Status RegisterEngine(grpc::ServerContext* ctx,
                              const v1::RegisterEngineRequest* request,
                              v1::RegisterEngineResponse* response) override;
  grpc::Status UnregisterEngine(
      grpc::ServerContext* ctx, const v1::UnregisterEngineRequest* request,
      v1::UnregisterEngineResponse* response) override;
  grpc::Status Control(
      grpc::ServerContext* ctx,
      grpc::ServerReaderWriter<v1::DaemonMessage, v1::EngineMessage>* stream)
      override;
  // Shutdown: cancels every open control stream (an idle engine's stream
  // would otherwise hold the server's stop for its whole grace) and every
  // one opened from now on. Any thread.
  void CancelControlStreams();

 private:
  std::optional<PeerCred> PeerOf(grpc::ServerContext* ctx);
  // The engine left (unregistered, its stream closed): drops its owner and
  // has the reaper remove its shared memory once that process is gone.
  void Forget(const std::string& engine);

  Coordinator* const core_;
  EngineOwners* const owners_;
  PeerLookup peer_of_;
  CallLimits* limits_ = nullptr;
  ShmReaper reaper_;
  absl::Mutex streams_mu_;
  absl::flat_hash_set<grpc::ServerContext*> streams_
      ABSL_GUARDED_BY(streams_mu_);
  bool streams_cancelled_ ABSL_GUARDED_BY(streams_mu_) = false;
};

}  // namespace weightsync

#endif  // WEIGHTSYNC_DAEMON_SERVER_SERVICES_H_

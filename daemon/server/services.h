// The gRPC front: thin service classes that take a request, call the
// Coordinator and convert its absl::Status. They hold no state of their
// own. gRPC's thread pool calls them concurrently; the Coordinator is
// thread-safe. No handler waits on CUDA or NCCL.
#ifndef WEIGHTSYNC_DAEMON_SERVER_SERVICES_H_
#define WEIGHTSYNC_DAEMON_SERVER_SERVICES_H_

#include "absl/time/time.h"
#include "daemon/core/coordinator.h"
#include "weightsync/v1/engine_service.grpc.pb.h"
#include "weightsync/v1/trainer_service.grpc.pb.h"

namespace weightsync {

class TrainerServiceImpl final : public v1::TrainerService::Service {
 public:
  explicit TrainerServiceImpl(Coordinator* core) : core_(core) {}

  grpc::Status InitWeightTransfer(
      grpc::ServerContext* ctx, const v1::InitWeightTransferRequest* request,
      v1::InitWeightTransferResponse* response) override;
  grpc::Status StartWeightUpdate(
      grpc::ServerContext* ctx, const v1::StartWeightUpdateRequest* request,
      v1::StartWeightUpdateResponse* response) override;
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

 private:
  Coordinator* const core_;
};

class EngineServiceImpl final : public v1::EngineService::Service {
 public:
  explicit EngineServiceImpl(Coordinator* core) : core_(core) {}

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

 private:
  Coordinator* const core_;
};

}  // namespace weightsync

#endif  // WEIGHTSYNC_DAEMON_SERVER_SERVICES_H_

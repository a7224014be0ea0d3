// TrainerClient: what a trainer calls to push weights through weightsyncd.
// Every call carries a deadline; results are absl::StatusOr with the
// daemon's code and message, or, where gRPC itself failed the call (no
// daemon listening, a broken connection, a passed deadline), the same code
// with a message in the user's terms. Unary calls that found the daemon
// unreachable (a restart) are retried as client/unary_call.h says; streams
// never are. Thread-compatible: one update at a time per
// client; separate clients may be used from separate threads.
#ifndef WEIGHTSYNC_CLIENT_TRAINER_CLIENT_H_
#define WEIGHTSYNC_CLIENT_TRAINER_CLIENT_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "client/channel.h"
#include "client/liveness_hold.h"
#include "common/chunk_planner.h"
#include "weightsync/v1/trainer_service.grpc.pb.h"

namespace weightsync {

// A tensor the trainer holds in host memory (checkpoint format).
struct HostTensor {
  v1::TensorSpec spec;
  const void* data = nullptr;  // payload_bytes(spec) bytes
};

// INVALID_ARGUMENT in the terms of `call` (e.g. "TrainerClient::Update")
// if `tensors` is empty or one has no data; checked before anything is
// sent.
absl::Status CheckHostTensors(const std::vector<HostTensor>& tensors,
                              absl::string_view call);
// The daemon's "no transfer group: call InitWeightTransfer before <RPC>"
// refusal of an RPC that `call` made for the user, rephrased to name
// `call` and `init`, the user's own way to form the group; any other
// status unchanged.
absl::Status InUpdateTerms(const absl::Status& s, absl::string_view call,
                           absl::string_view init);

// An IPC ring update's announcements (StartWeightUpdateRequest
// .ipc_ring_slots > 0): Ready(k) once chunk k is in slot k % slots;
// before writing chunk k into its slot (k >= slots), WaitDone(k - slots + 1)
// so the daemon has finished reading the chunk that was there.
class IpcChunkStream {
 public:
  IpcChunkStream(
      std::unique_ptr<grpc::ClientContext> ctx,
      std::unique_ptr<
          grpc::ClientReaderWriter<v1::IpcChunksRequest, v1::IpcChunksResponse>>
          stream,
      std::string update_id)
      : ctx_(std::move(ctx)),
        stream_(std::move(stream)),
        update_id_(std::move(update_id)) {}
  absl::Status Ready(int64_t chunk);
  absl::Status WaitDone(int64_t chunks);
  // Ends the stream; returns the daemon's verdict on it.
  absl::Status Close();

 private:
  std::unique_ptr<grpc::ClientContext> ctx_;
  std::unique_ptr<
      grpc::ClientReaderWriter<v1::IpcChunksRequest, v1::IpcChunksResponse>>
      stream_;
  std::string update_id_;
  bool first_ = true;
  int64_t done_ = 0;
};

class TrainerClient {
 public:
  static absl::StatusOr<std::unique_ptr<TrainerClient>> Connect(
      const ClientOptions& options);

  // Forms the group, then holds it (client/liveness_hold.h) for as long as
  // this client lives or until the next InitWeightTransfer: if the process
  // dies, the daemon ends its update within a second. A daemon that can't
  // hold it (older than TrainerService.Liveness) still forms the group;
  // liveness_status() says why.
  absl::StatusOr<v1::InitWeightTransferResponse> InitWeightTransfer(
      const v1::InitWeightTransferRequest& request);
  // OK while the daemon holds this client's group; the hold's error
  // otherwise (FAILED_PRECONDITION before InitWeightTransfer).
  absl::Status liveness_status() const;
  absl::StatusOr<v1::StartWeightUpdateResponse> StartWeightUpdate(
      const v1::StartWeightUpdateRequest& request);
  // Host backend: packs `tensors` (in manifest order) with the shared chunk
  // planner and streams every chunk of update `update_id`.
  absl::Status PushTensors(const std::string& update_id,
                           const std::vector<HostTensor>& tensors,
                           int64_t chunk_bytes);
  absl::StatusOr<v1::FinishWeightUpdateResponse> FinishWeightUpdate(
      const std::string& update_id);
  // Several daemons (docs/protocol.md, "Several daemons"): Finish's two
  // halves. Prepare waits for every byte (the same deadline as Finish).
  absl::StatusOr<v1::PrepareWeightUpdateResponse> PrepareWeightUpdate(
      const std::string& update_id);
  absl::StatusOr<v1::FinishWeightUpdateResponse> CommitWeightUpdate(
      const std::string& update_id);
  absl::StatusOr<v1::AbortWeightUpdateResponse> AbortWeightUpdate(
      const std::string& update_id, const std::string& reason);
  absl::StatusOr<v1::PauseResponse> Pause(const v1::PauseRequest& request);
  absl::StatusOr<v1::ResumeResponse> Resume(const v1::ResumeRequest& request);
  // The ranks of the group formed; with `backend`, those this daemon would
  // contribute to a group of that backend (also before Init).
  absl::StatusOr<int> GetWorldSize(
      v1::Backend backend = v1::BACKEND_UNSPECIFIED);
  absl::StatusOr<v1::GetStatusResponse> GetStatus(bool include_layouts = false);
  // The receipt of everything `engine_id` holds now (weightsyncctl check).
  absl::StatusOr<v1::CheckEngineResponse> CheckEngine(
      const std::string& engine_id);

  // Registered sources (docs/protocol.md): a manifest (and on ipc the
  // trainer's memory) the daemon validates once and plans by id.
  absl::StatusOr<v1::RegisterSourceResponse> RegisterSource(
      const v1::RegisterSourceRequest& request);
  absl::Status UnregisterSource(const std::string& source_id);

  // Start, PushTensors and Finish in one call. If sending fails, Finish
  // still runs so the daemon ends the update (and reports dirty engines);
  // the send error is returned. Unless request.verify is VERIFY_OFF, the
  // engines' receipts are checked against what was sent (DATA_LOSS naming
  // the engine on a mismatch; see client/receipts.h). `request` supplies id,
  // version, mode, chunk size and engine ids; its manifest is filled from
  // `tensors`. A dense update (no sparse tensors) goes by registered
  // source: the manifest is registered the first time and again only when
  // a name, dtype or shape changed or the daemon forgot it (a new group:
  // NOT_FOUND, registered again and retried once); its chunk plan and the
  // engines' layouts for receipts are kept between updates.
  absl::StatusOr<v1::FinishWeightUpdateResponse> Update(
      v1::StartWeightUpdateRequest request,
      const std::vector<HostTensor>& tensors);

  // The source Update registered last ("" before the first dense update).
  const std::string& source_id() const { return source_id_; }

  // IPC ring mode: opens the announcement stream of update `update_id`.
  std::unique_ptr<IpcChunkStream> OpenIpcChunks(const std::string& update_id);

  v1::TrainerService::Stub* stub() { return stub_.get(); }

 private:
  TrainerClient(ClientOptions options, std::shared_ptr<grpc::Channel> channel);
  // Start of a dense update by registered source (registering first when
  // needed); the manifest of `tensors` is what source_manifest_ holds.
  absl::StatusOr<v1::StartWeightUpdateResponse> StartFromSource(
      v1::StartWeightUpdateRequest request,
      const std::vector<HostTensor>& tensors);
  absl::Status PushPlanned(const std::string& update_id,
                           const std::vector<HostTensor>& tensors,
                           const ChunkPlan& plan);
  absl::Status CheckUpdateReceipts(const v1::FinishWeightUpdateResponse& done,
                                   const std::vector<HostTensor>& tensors);

  const ClientOptions options_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::TrainerService::Stub> stub_;
  // The hold on the group InitWeightTransfer formed last (null: none, and
  // hold_status_ says why). Declared after stub_: closed before it goes.
  std::unique_ptr<LivenessHold> hold_;
  absl::Status hold_status_ =
      absl::FailedPreconditionError("no transfer group formed by this client");
  // The registered source of the last dense update and its chunk plan.
  std::string source_id_;
  Manifest source_manifest_;
  int64_t plan_chunk_bytes_ = -1;
  ChunkPlan source_plan_;
  // GetStatus(include_layouts) of the engines, reused for receipts while
  // every engine's layout_id is one it lists.
  v1::GetStatusResponse layouts_;
};

}  // namespace weightsync

#endif  // WEIGHTSYNC_CLIENT_TRAINER_CLIENT_H_

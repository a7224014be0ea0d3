// The daemon's core: the engine registry, the transfer group, update
// sessions and versions, pause/resume. It validates and plans every request
// before anything moves, drives a DataPlane for the bytes, and knows nothing
// of gRPC or of how a backend moves bytes.
//
// Thread-safety: every method may be called from any thread. Control
// operations (Init, Start, Finish, Abort, Pause, Resume) run one at a time
// under control_mu_, which they hold while they wait (bounded by deadlines);
// registration, chunk submission and status run beside them and never wait
// on the state lock mu_ behind an engine or the data plane.
//
// The class is defined in nine files: coordinator.cc (the engine registry,
// the transfer group, status, shutdown), engine_expiry.cc (engines without a
// control stream), pause.cc (pause/resume), sources.cc
// (registered sources), update_start.cc (an update's validation, planning,
// pause and Begin), update_session.cc (its chunks, its failure),
// update_watchdog.cc (the idle watchdog), update_finish.cc (Finish with the
// staged commit, Abort, ending a failed update) and update_commit.cc
// (Finish's two halves, prepare and commit, also called one by one by a
// trainer of several daemons) and trainer_liveness.cc (the trainer's hold
// on its group, and what its end ends).
#ifndef WEIGHTSYNC_DAEMON_CORE_COORDINATOR_H_
#define WEIGHTSYNC_DAEMON_CORE_COORDINATOR_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/random/random.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "daemon/core/copy_plan.h"
#include "daemon/core/data_plane.h"
#include "daemon/core/engine_layout.h"
#include "daemon/core/link_plan.h"
#include "daemon/core/memory.h"
#include "daemon/core/notice_hub.h"
#include "daemon/core/source_registry.h"
#include "weightsync/v1/engine_service.pb.h"
#include "weightsync/v1/trainer_service.pb.h"

namespace weightsync {

// Makes the data plane of a transfer group. UNIMPLEMENTED for backends this
// build does not carry.
class DataPlaneFactory {
 public:
  virtual ~DataPlaneFactory() = default;
  virtual absl::StatusOr<std::shared_ptr<DataPlane>> Create(
      const v1::InitWeightTransferRequest& request) = 0;
  // Ranks this daemon contributes to a group of `backend`.
  virtual int LocalWorldSize(v1::Backend backend) const = 0;
};

// How an update ended, for metrics (UpdateListener): committed (code OK)
// or failed with `code`.
struct UpdateOutcome {
  std::string update_id;
  std::string backend;  // "host", "nccl", "ipc"
  bool staged = false;
  absl::StatusCode code = absl::StatusCode::kOk;
  int64_t version = 0;       // committed (OK) or targeted
  int64_t bytes = 0;         // committed: the update's bytes; failed: received
  double seconds = 0;        // Start to commit (or failure)
  double pause_seconds = 0;  // committed: how long its engines were paused
};
using UpdateListener = std::function<void(const UpdateOutcome&)>;
// An engine the core unregistered by itself (engine_start_grace), by id.
using EngineExpiredListener = std::function<void(const std::string&)>;

struct CoordinatorOptions {
  // Chunk size when Start asks for none, and the largest accepted.
  int64_t default_chunk_bytes = int64_t{8} << 20;
  // The nccl backend's: a broadcast or send of 8 MiB runs at a third of
  // the speed of one of 64 MiB over NVLink (tests/gpu/RESULTS_mton_daemon.txt).
  int64_t default_nccl_chunk_bytes = int64_t{64} << 20;
  // A transfer plan's (many senders) nccl update that asks no chunk size,
  // in a group whose trainer said its senders are on this host
  // (InitWeightTransferRequest.senders_on_this_host), starts from this
  // instead of default_nccl_chunk_bytes; either is lowered to fit the
  // staging budget (below). Over NVLink 256 MiB rounds ran 5-16% faster
  // than 64 MiB ones through the daemons, over NCCL's network transport
  // 10-20% slower (4 x H200, tests/gpu/RESULTS_mton_daemon.txt runs 9 and
  // 10). Not capped by max_chunk_bytes: that bounds what a trainer may ask
  // and a host chunk's message; these are the daemon's own NCCL receives.
  int64_t default_plan_chunk_bytes = int64_t{256} << 20;
  // The GPU data plane's staging (--gpu_staging_buffers, _budget_bytes):
  // a transfer plan's nccl update that asks no chunk size gets one whose
  // staging (the larger of the buffers and two chunks per sending link)
  // fits the budget, so many senders don't run it out.
  int64_t device_staging_buffers = 4;
  int64_t device_staging_budget_bytes = int64_t{4} << 30;
  int64_t max_chunk_bytes = int64_t{64} << 20;
  int64_t max_manifest_tensors = 1 << 20;
  // A manifest tensor's rank (its name is bounded by limits.max_name_length).
  static constexpr int kMaxTensorRank = 16;
  // Staged updates hold the whole packed update in daemon memory until
  // commit; above this, Start refuses (or falls back to streaming).
  int64_t staged_budget_bytes = int64_t{4} << 30;
  // Deadline for engine acknowledgements when a request names none.
  absl::Duration notice_timeout = absl::Seconds(10);
  // Deadline for Finish to see every byte written when it names none.
  absl::Duration finish_timeout = absl::Seconds(60);
  // An update with no sign of its trainer for this long (no chunk, no
  // call, no progress of a data plane that receives by itself) is ended as
  // if aborted: a trainer that froze or vanished without closing its
  // stream would otherwise hold the engines paused forever. Zero: never.
  absl::Duration update_idle_timeout = absl::Minutes(5);
  // An engine registered this long without opening its control stream
  // (its process never called start(), or hangs before it) is unregistered
  // and reported (engine.expired): no notice can reach it, so it could only
  // stop updates. Zero: never.
  absl::Duration engine_start_grace = absl::Seconds(5);
  RegistrationLimits limits;
  std::string build_info;
  // This daemon's NCCL as ncclGetVersion encodes it (0: none, the host-only
  // build): an nccl Init from a trainer whose NCCL differs in major.minor
  // is refused unless allow_nccl_version_mismatch (nccl_version.h).
  int nccl_version = 0;
  bool allow_nccl_version_mismatch = false;
};

// One stream of chunks: the update's only one, or link (sender, receiver)
// of a transfer-plan update.
struct StreamLink {
  int32_t sender = 0;
  int32_t receiver = 0;
};

class Coordinator {
 public:
  Coordinator(CoordinatorOptions options, std::shared_ptr<MemoryMapper> mapper,
              std::shared_ptr<DataPlaneFactory> data_planes);
  ~Coordinator();

  // Registered sources (docs/protocol.md, "Registered sources";
  // sources.cc): FAILED_PRECONDITION without a transfer group; memory only
  // on the ipc backend.
  absl::StatusOr<v1::RegisterSourceResponse> RegisterSource(
      const v1::RegisterSourceRequest& request);
  absl::Status UnregisterSource(const v1::UnregisterSourceRequest& request);

  // Transfer plans of many senders (docs/transfer_plan.md;
  // transfer_plans.cc): validated and kept by id until the group is
  // re-Initialised; FAILED_PRECONDITION without a transfer group.
  absl::StatusOr<v1::RegisterTransferPlanResponse> RegisterTransferPlan(
      const v1::RegisterTransferPlanRequest& request);

  // Engine side.
  absl::StatusOr<v1::RegisterEngineResponse> RegisterEngine(
      const v1::RegisterEngineRequest& request);
  // PERMISSION_DENIED unless every engine `engine_ids` selects (empty: all)
  // accepts trainers of `uid` (RegisterEngineRequest.trainer_uids; root
  // always may).
  absl::Status CheckTrainerUid(
      const google::protobuf::RepeatedPtrField<std::string>& engine_ids,
      uint32_t uid);
  absl::Status UnregisterEngine(const std::string& engine_id);
  // A control stream opened: NOT_FOUND for an unregistered engine,
  // ALREADY_EXISTS while another stream speaks for it (a second stream never
  // takes an engine's notices over).
  absl::Status AttachControl(const std::string& engine_id,
                             std::shared_ptr<ControlChannel> channel);
  // A control stream closed: the engine is gone, so it is unregistered.
  // True if `ch` was the engine's stream and the engine was removed.
  bool DetachControl(const std::string& engine_id, const ControlChannel* ch);
  void OnAck(const std::string& engine_id, const v1::EngineMessage::Ack& ack);
  // The engine reported its registered memory gone (EngineMessage.Lost):
  // unregistered, lost to an update in flight with `reason`, its stream
  // detached. True if it was registered.
  bool EngineLost(const std::string& engine_id, const std::string& reason);

  // Trainer side.
  absl::StatusOr<v1::InitWeightTransferResponse> InitWeightTransfer(
      const v1::InitWeightTransferRequest& request);
  absl::StatusOr<v1::StartWeightUpdateResponse> StartWeightUpdate(
      const v1::StartWeightUpdateRequest& request);
  // One chunk of a host-backend update, in order.
  // In a transfer-plan update, `index` counts the chunks of `link`.
  absl::Status PushChunk(const std::string& update_id, int64_t index,
                         std::string data, absl::Time deadline,
                         StreamLink link = {});
  // IPC ring mode, after chunk `index` was submitted: waits until the
  // trainer may reuse the slot it needs next; returns how many chunks are
  // done (0: no wait needed yet).
  absl::StatusOr<int64_t> IpcChunkAck(const std::string& update_id,
                                      int64_t index, absl::Time deadline);
  // A chunk stream (PushChunks, IpcChunks) ended; `cancelled`: the trainer
  // went away. A stream that ends with chunks still missing fails the
  // update: ABORTED naming them (the trainer half-closed early, or a
  // message did not parse, which ends a gRPC stream like a half-close).
  // In a transfer-plan update each link has its own stream; one that ends
  // early (its sender gone) fails the update.
  absl::Status PushStreamEnded(const std::string& update_id, bool cancelled,
                               StreamLink link = {});
  absl::Status BeginPushStream(const std::string& update_id,
                               StreamLink link = {});
  // Prepare and commit in one call (update_commit.cc).
  absl::StatusOr<v1::FinishWeightUpdateResponse> FinishWeightUpdate(
      const v1::FinishWeightUpdateRequest& request);
  // Several daemons (docs/protocol.md): every byte in engine memory and the
  // receipts read, engines paused at their old version; idempotent.
  absl::StatusOr<v1::PrepareWeightUpdateResponse> PrepareWeightUpdate(
      const v1::PrepareWeightUpdateRequest& request);
  // Commits a prepared update: FAILED_PRECONDITION for one not prepared
  // (or ended meanwhile: its engines are then DIRTY).
  absl::StatusOr<v1::FinishWeightUpdateResponse> CommitWeightUpdate(
      const v1::CommitWeightUpdateRequest& request);
  absl::StatusOr<v1::AbortWeightUpdateResponse> AbortWeightUpdate(
      const v1::AbortWeightUpdateRequest& request);
  absl::StatusOr<v1::PauseResponse> Pause(const v1::PauseRequest& request);
  absl::StatusOr<v1::ResumeResponse> Resume(const v1::ResumeRequest& request);
  // The ranks of the group formed (0 before Init), or with `request.backend`
  // set those this daemon would contribute to a group of that backend.
  v1::GetWorldSizeResponse GetWorldSize(
      const v1::GetWorldSizeRequest& request = {});
  v1::GetStatusResponse GetStatus(bool include_layouts = false);
  // The receipt of every parameter `engine_id` holds, read from its memory
  // now (weightsyncctl check). Doesn't pause the engine: the daemon is the
  // only writer, and it refuses (FAILED_PRECONDITION) while an update
  // writes the engine and answers ABORTED if one began while it read.
  absl::StatusOr<v1::CheckEngineResponse> CheckEngine(
      const v1::CheckEngineRequest& request);

  // Trainer liveness (docs/protocol.md, "Trainer liveness";
  // trainer_liveness.cc). A trainer holds the group it formed while it
  // lives (TrainerService.Liveness): HoldGroup opens a hold of `group_id`
  // and returns its token: FAILED_PRECONDITION unless it is the group formed
  // now or empty (a group-less trainer's hold of its pauses: released while
  // no other hold is open, it resumes the engines trainers paused),
  // RESOURCE_EXHAUSTED past kMaxHolds. ReleaseGroup closes it; if the
  // hold was of the current group its trainer is gone: the update in
  // progress fails and ends at once (engines DIRTY, or resumed, as for any
  // failed update) and engines paused by a trainer are resumed. It may wait
  // on control_mu_ (a Finish in progress is woken first); call it from a
  // thread that may block, never under a lock.
  static constexpr size_t kMaxHolds = 64;
  absl::StatusOr<int64_t> HoldGroup(const std::string& group_id);
  // `trainer_gone` false (the server itself is stopping, not the trainer):
  // only forgets the hold.
  void ReleaseGroup(int64_t hold, absl::string_view why,
                    bool trainer_gone = true);

  // Called once for every update that ends (metrics); set before serving.
  // Runs under the core's lock: it must be quick and must not call back.
  void set_update_listener(UpdateListener listener) {
    listener_ = std::move(listener);
  }
  // Called (outside the core's locks) for every engine expired for want of
  // a control stream; set before serving.
  void set_engine_expired_listener(EngineExpiredListener listener) {
    expired_listener_ = std::move(listener);
  }

  // Runs the part of CheckEngine that reads the engine's whole memory (no
  // lock held): `run(read)` must call `read` once and return after it. The
  // gRPC front runs it at the lowest CPU priority, so that checks can't slow
  // updates (daemon/server/idle_priority.h). Unset: on the caller's thread.
  // Set before serving.
  using ReadRunner = std::function<void(const std::function<void()>& read)>;
  void set_engine_read_runner(ReadRunner run) {
    engine_read_runner_ = std::move(run);
  }

  // Aborts an update in flight and releases every mapping (SIGTERM).
  void Shutdown();

 private:
  struct EngineRecord {
    std::shared_ptr<const EngineLayout> layout;
    // The Parameter messages as registered, for GetStatus(include_layouts):
    // trainers compute the receipts they expect from them. The
    // parameter_table's rows are not kept twice: GetStatus makes their
    // messages from the layout (AppendParameterMessages).
    google::protobuf::RepeatedPtrField<v1::Parameter> parameters;
    int64_t version = 0;
    bool paused = false;
    bool paused_by_update = false;  // Finish resumes it
    // Time spent paused, for GetStatus (paused_seconds) and metrics: the
    // closed pauses, and when the open one began.
    absl::Duration paused_total;
    absl::Time paused_since = absl::InfiniteFuture();
    bool dirty = false;
    bool updating = false;
    std::vector<uint32_t> trainer_uids;  // empty: any
    std::string layout_id;     // EngineStatus.layout_id: new per registration
    absl::Time registered_at;  // for engine_start_grace
  };
  using EngineMap = absl::flat_hash_map<std::string, EngineRecord>;
  static SourceLimits SourceLimitsOf(const CoordinatorOptions& o);
  // Sets r.paused and keeps its paused time.
  static void SetPaused(EngineRecord& r, bool paused);
  // kPrepared: every byte in engine memory and the receipts read; only a
  // commit makes the engines clean again (update_commit.cc).
  enum class Phase { kReceiving, kFailed, kPrepared };
  struct Update {
    std::string id;
    int64_t target_version = 0;
    std::shared_ptr<const CopyPlan> plan;
    std::vector<std::string> engine_ids;  // index = plan engine index
    std::vector<bool> lost;
    std::vector<std::string> lost_why;  // RemoveEngineLocked's reason
    std::shared_ptr<DataPlane> data_plane;
    Phase phase = Phase::kReceiving;
    absl::Status error;
    int64_t next_chunk = 0;
    int64_t received_bytes = 0;
    bool stream_open = false;
    int submits_in_flight = 0;  // PushChunk calls past the checks
    absl::Time started;         // Start called
    // The last sign of the trainer (Start, a chunk, a call, data plane
    // progress) and the data plane's chunks_written() then (the watchdog).
    absl::Time last_activity;
    int64_t last_written = 0;
    absl::Time failed_at;  // FailUpdateLocked
    absl::Time begun;      // Start's data plane ready
    int ipc_ring_slots = 0;
    v1::UpdateTimings timings;
    // Staged mode: chunks wait here, engines serve on, until Finish commits.
    bool staged = false;
    bool committing = false;  // staged bytes are being written
    // Staged in the data plane's own (GPU) staging: bytes arrive by NCCL
    // from Start on; the commit is DataPlane::CommitStaged.
    bool device_staged = false;
    std::vector<std::string> staged_chunks;
    v1::StartWeightUpdateRequest request;  // for the data plane at commit
    absl::Time paused_at = absl::InfiniteFuture();
    bool verify = false;  // compute receipts at Finish
    // Prepared: the receipts to report at the commit, and when.
    std::vector<absl::StatusOr<v1::Receipt>> receipts;
    absl::Time t_prepared;
    // The registered source the update copies from or names its manifest
    // by (kept alive, with its memory, until the update ends).
    std::shared_ptr<const Source> source;
    // The bytes reach the engines without PushChunks: they arrive by
    // themselves (NCCL, IPC) or are copied from a source's memory.
    bool bytes_by_plane = false;
    // A transfer-plan update: per link (sender, receiver), its chunks in
    // the plan, how many arrived and whether its stream is open.
    // next_chunk then counts the chunks of every link.
    struct LinkState {
      LinkChunks chunks;
      int64_t next = 0;
      bool open = false;
    };
    std::vector<LinkState> links;
    // The index into links of (sender, receiver), or -1.
    int FindLink(StreamLink l) const {
      for (size_t i = 0; i < links.size(); ++i) {
        if (links[i].chunks.sender == l.sender &&
            links[i].chunks.receiver == l.receiver) {
          return i;
        }
      }
      return -1;
    }
    // Registered engines that an update of every engine left out for want
    // of a control stream, with why; Finish reports them as lost.
    std::vector<std::pair<std::string, std::string>> left_out;
  };

  // StartWeightUpdate's working state, filled step by step by its helpers
  // (update_start.cc).
  struct StartState {
    int64_t chunk_bytes = 0;
    std::vector<std::string> ids;  // the engines, in plan order
    std::vector<std::shared_ptr<const EngineLayout>> layouts;  // as ids
    std::vector<std::string> to_pause;                         // not paused yet
    std::vector<std::string> paused;  // of to_pause, those that acknowledged
    std::vector<std::pair<std::string, std::string>> left_out;  // Update's
    std::shared_ptr<DataPlane> plane;
    std::shared_ptr<const CopyPlan> plan;
    // The manifest: the request's tensors, or its registered source's.
    const Manifest* manifest = nullptr;
    std::shared_ptr<const Source> source;
    // What the plan does with tensors no engine uses (skip_unused).
    UnusedTensors unused = UnusedTensors::kRefuse;
    // StartWeightUpdateRequest.transfer_plan_id: the plan and this
    // daemon's receivers in it; its links once planned.
    std::shared_ptr<const TransferPlan> transfer;
    std::vector<int32_t> receivers;
    std::vector<LinkChunks> links;
    bool staged = false;          // after a fallback to streaming: false
    bool device_staging = false;  // the data plane stages its own bytes
    absl::Time t_entry, t_planned, t_paused, t_begun;
  };
  // The request's own bounds (id, manifest size, names, ranks, chunk
  // size); sets s.chunk_bytes.
  absl::Status ValidateStart(const v1::StartWeightUpdateRequest& request,
                             StartState& s) const;
  // StartWeightUpdateRequest.source_id / finish: sets s.source and
  // s.manifest; NOT_FOUND for an unknown source.
  absl::Status ResolveSource(const v1::StartWeightUpdateRequest& request,
                             StartState& s);
  // A transfer plan's nccl chunk size when the trainer asks none: at most
  // `chunk_bytes`, small enough that the worker's staging (its buffers, or
  // two chunks per sender linked to `receivers`) fits the device budget.
  int64_t FittingChunkBytes(const TransferPlan& plan,
                            const std::vector<int32_t>& receivers,
                            int64_t chunk_bytes) const;
  // Under mu_: the group, no update in flight, the engines and their
  // versions; sets s.ids, s.layouts, s.to_pause and s.plane.
  absl::Status SelectForStart(const v1::StartWeightUpdateRequest& request,
                              StartState& s);
  // The copy plan and the mode (staged, or streaming where staging is over
  // budget and the request allows it); sets s.plan, s.staged and
  // s.device_staging.
  absl::Status PlanStart(const v1::StartWeightUpdateRequest& request,
                         StartState& s)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(control_mu_);
  // Pauses the engines a streaming update writes and begins the data plane;
  // if Begin fails, resumes the engines it paused. Requires control_mu_.
  absl::Status PauseAndBegin(const v1::StartWeightUpdateRequest& request,
                             StartState& s);
  // Makes update_ from `s` and marks its engines updating.
  void InstallUpdateLocked(const v1::StartWeightUpdateRequest& request,
                           const StartState& s)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // What FinishWeightUpdate committed (CommitVersionsLocked), for the
  // notices and the report that follow (update_finish.cc).
  struct Committed {
    std::string id;
    int64_t version = 0;
    std::vector<std::string> engines;  // committed (not lost)
    std::vector<std::string> resume;   // paused by the update, and clean
    absl::Time paused_at = absl::InfiniteFuture();
    absl::Time started;
  };
  // Under mu_: the update Finish or Prepare names, failed if chunks are
  // missing; its data plane.
  absl::StatusOr<std::shared_ptr<DataPlane>> CheckFinish(
      const std::string& update_id);
  // The first half of Finish: waits for every byte (a staged update's
  // commit copy included), reads the receipts and marks the update
  // prepared; returns when it was prepared. On failure ends the update
  // (FailFinish). Requires control_mu_.
  absl::StatusOr<absl::Time> Prepare(const std::string& update_id,
                                     const std::shared_ptr<DataPlane>& plane,
                                     absl::Time deadline);
  // The second half: versions, notices, the report; `t_commit` is when the
  // commit began. Requires control_mu_ and a prepared update.
  absl::StatusOr<v1::FinishWeightUpdateResponse> CommitPrepared(
      const DataPlane& plane, absl::Time t_commit);
  // The receipts of what was installed (empty when not verifying): GPU
  // memory by the data plane, host memory here.
  absl::Status CollectReceipts(
      DataPlane& plane, absl::Time deadline,
      std::vector<absl::StatusOr<v1::Receipt>>* receipts);
  // Ends the update as failed; Finish's ABORTED answer naming dirty engines.
  // Requires control_mu_.
  absl::Status FailFinish(const std::string& update_id,
                          const absl::Status& status);
  // The result of the update's engine i (id; lost: UNAVAILABLE and why);
  // its record, or engines_.end() for a lost one.
  EngineMap::iterator UpdateEngineResultLocked(size_t i,
                                               v1::EngineResult* result)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Sets the engines' new version and fills response's engines, version
  // and bytes.
  Committed CommitVersionsLocked(
      const std::vector<absl::StatusOr<v1::Receipt>>& receipts,
      v1::FinishWeightUpdateResponse& response)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Sends the new version (and Resume to the engines the update paused).
  void NotifyCommitted(const Committed& c);
  // Response times, the listener and the log line of a commit that began
  // at `t_commit`.
  void ReportCommitted(const Committed& c, const DataPlane& plane, bool staged,
                       absl::Time t_commit,
                       v1::FinishWeightUpdateResponse& response);
  // CommitStaged's pause, all or nothing: engines that left while being
  // paused are lost to the update, the others paused. Requires control_mu_.
  absl::StatusOr<std::vector<std::string>> PauseForCommit(
      const std::vector<std::string>& to_pause);
  // Marks lost to `update` each engine of `to_pause` that PauseAll left out
  // of `paused` (it left while being paused; its removal may come later).
  void MarkLeftWhilePausedLocked(Update& update,
                                 const std::vector<std::string>& to_pause,
                                 const std::vector<std::string>& paused,
                                 absl::string_view what)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Records `paused` as paused by the update, its engines as updating;
  // returns the staged chunks (host staging).
  std::vector<std::string> StartCommitLocked(
      const std::vector<std::string>& paused)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // A caller's deadline, capped so no request can hold the control lock
  // (and delay shutdown) for long.
  static absl::Time DeadlineFrom(int64_t timeout_ms, absl::Duration fallback);
  static v1::DaemonMessage ResumeNotice();

  // Ends the update in flight as failed: stops the data plane, marks the
  // engines it wrote into dirty and tells them, resumes engines it paused
  // that are still clean. Requires control_mu_.
  std::vector<v1::EngineResult> EndFailedUpdate(const absl::Status& reason);
  // Pauses `engines` all or nothing: if any engine fails to acknowledge,
  // the ones that paused are resumed and the first failure returned, its
  // message prefixed by `why` and naming every engine that failed. Returns
  // the engines paused. An engine that left meanwhile (unregistered or
  // disconnected) is neither: the caller finds it gone. Requires
  // control_mu_.
  absl::StatusOr<std::vector<std::string>> PauseAll(
      const std::vector<std::string>& engines, v1::PauseMode mode,
      absl::Time deadline, absl::string_view why);
  // Staged mode, at Finish: pauses the engines and hands every staged chunk
  // to the data plane. Requires control_mu_.
  absl::Status CommitStaged(absl::Time deadline);
  // The copy plan of (manifest, chunk size, layouts), reusing the last one
  // when all three are unchanged. Requires control_mu_.
  absl::StatusOr<std::shared_ptr<const CopyPlan>> PlanFor(
      const Manifest& manifest, int64_t chunk_bytes,
      const std::vector<std::shared_ptr<const EngineLayout>>& layouts,
      const Source* source, UnusedTensors unused)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(control_mu_);
  // The linked copy plan of a transfer-plan update (PlanFor's cache, for
  // plans of many senders; `wire`: the tensors sent quantised). Requires
  // control_mu_.
  absl::StatusOr<LinkedCopyPlan> LinkedPlanFor(
      const TransferPlan& plan, const std::vector<int32_t>& receivers,
      int64_t chunk_bytes,
      const std::vector<std::shared_ptr<const EngineLayout>>& layouts,
      const std::vector<LinkPatch>& patches,
      const std::vector<WireTensor>& wire)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(control_mu_);
  // Start's answer for the plan in `s` (plan_only, or an update begun).
  static v1::StartWeightUpdateResponse StartResponse(
      const v1::StartWeightUpdateRequest& request, const StartState& s);
  // Waits until no PushChunk is between its checks and its submit.
  absl::Status WaitForSubmits(absl::Time deadline);
  void FailUpdateLocked(const absl::Status& reason)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Sends Resume to `engines` and records them resumed where acknowledged.
  absl::Status ResumeEngines(const std::vector<std::string>& engines,
                             absl::Time deadline);
  absl::StatusOr<std::vector<std::string>> SelectEngines(
      const google::protobuf::RepeatedPtrField<std::string>& ids)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The engines a notice can reach (engine_expiry.cc): as SelectEngines,
  // but `ids` empty selects only engines with an open control stream and
  // lists the others in *left_out (id, why); an engine named in `ids`
  // without one is FAILED_PRECONDITION saying how to fix it, and so is an
  // empty selection.
  absl::StatusOr<std::vector<std::string>> SelectReachableEngines(
      const google::protobuf::RepeatedPtrField<std::string>& ids,
      std::vector<std::pair<std::string, std::string>>* left_out)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Why `id`, registered, can't be reached: no stream since it registered.
  std::string StreamlessWhy(const std::string& id, const EngineRecord& r) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Unregisters engines registered longer than engine_start_grace without
  // a control stream, and tells expired_listener_ (WatchIdle).
  void ExpireStreamlessEngines();
  void RemoveEngineLocked(const std::string& engine_id, const std::string& why)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Removes the engines of the update in flight whose shared memory its
  // owner shrank under the daemon (bus_guard.h): lost to the update and
  // unregistered, while the other engines commit.
  void DropFaultedEnginesLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Removes `id` if it is still registered with `layout`, whose memory
  // faulted (its stream detached).
  void DropFaultedLocked(const std::string& id, const EngineLayout* layout)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  v1::EngineStatus EngineStatusLocked(const std::string& id,
                                      const EngineRecord& r) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void RecordUpdateStatusLocked(const std::string& phase)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const CoordinatorOptions options_;
  const std::shared_ptr<MemoryMapper> mapper_;
  const std::shared_ptr<DataPlaneFactory> data_planes_;
  NoticeHub hub_;
  SourceRegistry sources_;

  absl::Mutex control_mu_ ABSL_ACQUIRED_BEFORE(mu_);
  mutable absl::Mutex mu_;
  int64_t next_layout_ ABSL_GUARDED_BY(mu_) = 0;
  // Random per daemon: layout ids of one daemon never name another's.
  const std::string layout_prefix_ =
      absl::StrFormat("%016x", absl::Uniform<uint64_t>(absl::BitGen()));
  // PlanFor's cache of one plan.
  std::shared_ptr<const CopyPlan> last_plan_ ABSL_GUARDED_BY(mu_);
  std::string last_plan_key_ ABSL_GUARDED_BY(mu_);
  std::vector<std::shared_ptr<const EngineLayout>> last_plan_layouts_
      ABSL_GUARDED_BY(mu_);
  // Registered transfer plans (RegisterTransferPlan), most recent first,
  // at most kMaxTransferPlans; dropped at InitWeightTransfer.
  struct TransferPlanEntry {
    std::shared_ptr<const TransferPlan> plan;
    std::vector<int32_t> receivers;
  };
  static constexpr int kMaxTransferPlans = 8;
  std::vector<TransferPlanEntry> transfer_plans_ ABSL_GUARDED_BY(mu_);
  // LinkedPlanFor's cache of one plan.
  std::string last_linked_key_ ABSL_GUARDED_BY(mu_);
  std::vector<std::shared_ptr<const EngineLayout>> last_linked_layouts_
      ABSL_GUARDED_BY(mu_);
  LinkedCopyPlan last_linked_ ABSL_GUARDED_BY(mu_);
  EngineMap engines_ ABSL_GUARDED_BY(mu_);
  // Why each engine id was last removed (RemoveEngineLocked), for an update
  // that selected it just before: its result names the reason. Cleared by
  // a new registration of the id.
  absl::flat_hash_map<std::string, std::string> removed_why_
      ABSL_GUARDED_BY(mu_);
  v1::Backend backend_ ABSL_GUARDED_BY(mu_) = v1::BACKEND_UNSPECIFIED;
  // This daemon's first NCCL rank in the group (InitWeightTransfer): a
  // transfer plan's senders are ranks [0, M), so it must be >= M.
  int32_t rank_offset_ ABSL_GUARDED_BY(mu_) = 0;
  // InitWeightTransferRequest.senders_on_this_host: the default chunk size
  // of the group's transfer-plan updates on nccl.
  bool senders_on_this_host_ ABSL_GUARDED_BY(mu_) = false;
  UpdateListener listener_;
  ReadRunner engine_read_runner_;
  // A whole-engine read in flight (CheckEngine). Callers that ask for the
  // same engine, layout and version while it runs wait for it and share its
  // receipt: N readers hammering one engine cost one read at a time, not N
  // (issue 35). Each caller still checks, after it, that the engine did not
  // change while it was read.
  struct EngineRead {
    const EngineLayout* layout = nullptr;
    int64_t version = 0;
    absl::Notification done;
    absl::StatusOr<v1::Receipt> receipt;  // set before done
    double seconds = 0;
  };
  absl::flat_hash_map<std::string, std::shared_ptr<EngineRead>> engine_reads_
      ABSL_GUARDED_BY(mu_);
  EngineExpiredListener expired_listener_;
  std::shared_ptr<DataPlane> data_plane_ ABSL_GUARDED_BY(mu_);
  std::unique_ptr<Update> update_ ABSL_GUARDED_BY(mu_);
  v1::UpdateStatus last_update_ ABSL_GUARDED_BY(mu_);
  bool shut_down_ ABSL_GUARDED_BY(mu_) = false;
  // Ends an update idle past options_.update_idle_timeout, and resumes
  // engines a trainer paused and then left alone that long (WatchIdle).
  void WatchIdle();
  // Waits one watchdog period; false once the watchdog is to stop.
  bool WatchSleep(absl::Duration period);
  // Resumes engines a trainer paused and then left alone past the idle
  // timeout; true if there were any (WatchIdle's pass is over).
  bool ResumeOrphanedPauses();
  // Ends the update if it is idle past the timeout, or failed and not ended
  // within the grace.
  void EndIdleUpdate();
  // A trainer called (any TrainerService call but GetStatus and
  // GetWorldSize): the pause lease and the update are alive.
  void NoteTrainerCall();
  // Ends the update if it failed and nobody ended it (its trainer gone).
  void EndIfFailed(absl::string_view by)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(control_mu_);
  // InitWeightTransfer's and Start's take_over_update_id: ends update
  // `update_id` if it is in progress and no trainer holds the group;
  // FAILED_PRECONDITION if one does. Requires control_mu_.
  absl::Status TakeOver(const std::string& update_id, absl::string_view by);
  // Whether a Liveness stream holds the current group.
  bool GroupHeldLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Resumes engines paused by a trainer (not by an update, not dirty) when
  // no update is in progress: their trainer is gone. Requires control_mu_.
  void ResumeTrainerPauses(absl::string_view why);
  // The group formed by the last InitWeightTransfer ("" before), and the
  // open Liveness holds (token -> the group each holds).
  std::string group_id_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<int64_t, std::string> holds_ ABSL_GUARDED_BY(mu_);
  int64_t next_hold_ ABSL_GUARDED_BY(mu_) = 1;
  absl::Time last_trainer_call_ ABSL_GUARDED_BY(mu_) = absl::Now();
  absl::Mutex watch_mu_;
  bool watch_stop_ ABSL_GUARDED_BY(watch_mu_) = false;
  std::thread watchdog_;
};

}  // namespace weightsync

#endif  // WEIGHTSYNC_DAEMON_CORE_COORDINATOR_H_

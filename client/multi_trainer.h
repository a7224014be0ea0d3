// MultiTrainer: one update over several daemons (one per inference node),
// the C++ side of docs/protocol.md, "Several daemons". It runs the same
// steps as the Python client (weightsync._multi):
//
//   1. Start(plan_only, skip_unused) on every daemon: a tensor that no
//      daemon's engines use is refused (INVALID_ARGUMENT naming it) before
//      any daemon pauses an engine or receives a byte;
//   2. Start(skip_unused) on every daemon;
//   3. host backend: each daemon's own PushChunks stream (only the tensors
//      its engines use), pushed from one thread per daemon;
//   4. PrepareWeightUpdate on every daemon, then the receipts checked:
//      any failure aborts the update on every daemon, committed nowhere;
//   5. CommitWeightUpdate on every daemon; a daemon that fails here keeps
//      its engines paused (DIRTY once its update ends): ABORTED names the
//      daemons that committed and those that did not.
//
// Thread-compatible: one update at a time. Calls to the daemons run on
// threads the call starts and joins before it returns.
#ifndef WEIGHTSYNC_CLIENT_MULTI_TRAINER_H_
#define WEIGHTSYNC_CLIENT_MULTI_TRAINER_H_

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "client/trainer_client.h"

namespace weightsync {

class MultiTrainer {
 public:
  static absl::StatusOr<std::unique_ptr<MultiTrainer>> Connect(
      const std::vector<ClientOptions>& daemons);

  // A host-backend group on every daemon.
  absl::Status InitHost();

  // The group's ranks: world size (1 for the trainer plus every daemon's
  // ranks, from GetWorldSize(backend)) and each daemon's rank_offset.
  struct Ranks {
    int world_size = 0;
    std::vector<int> rank_offsets;
  };
  absl::StatusOr<Ranks> RankLayout(v1::Backend backend);

  // Steps 1-5 on the host backend; `request` gives id, version, mode,
  // chunk size, verify; its manifest is filled from `tensors`. Unless
  // request.verify is VERIFY_OFF the receipts of every engine are checked
  // between prepare and commit (a mismatch aborts everywhere: DATA_LOSS).
  // Returns one FinishWeightUpdateResponse per daemon, in order.
  absl::StatusOr<std::vector<v1::FinishWeightUpdateResponse>> Update(
      v1::StartWeightUpdateRequest request,
      const std::vector<HostTensor>& tensors);

  int size() const { return static_cast<int>(daemons_.size()); }
  TrainerClient& daemon(int i) { return *daemons_[i]; }
  // Each daemon's Start answer of the last update.
  const std::vector<v1::StartWeightUpdateResponse>& last_starts() const {
    return starts_;
  }

  // Tests only: called with "pushed" (bytes sent, before prepare) and
  // "prepared" (every daemon prepared, receipts checked, before commit).
  std::function<void(absl::string_view)> on_phase;

 private:
  explicit MultiTrainer(std::vector<std::unique_ptr<TrainerClient>> daemons,
                        std::vector<std::string> targets)
      : daemons_(std::move(daemons)), targets_(std::move(targets)) {}
  // Runs fn(i) for every daemon on its own thread; the statuses in order.
  std::vector<absl::Status> Each(const std::function<absl::Status(int)>& fn);
  std::string Name(int i) const;
  // Steps 1 and 2: the daemons' Start answers (into starts_).
  absl::Status StartEverywhere(const v1::StartWeightUpdateRequest& request);
  // Aborts `update_id` everywhere after `why` (on daemon `i`, or the
  // trainer's own when i < 0); returns why's code with a message naming
  // the daemon and saying nothing was committed.
  absl::Status FailEverywhere(const std::string& update_id, int i,
                              const absl::Status& why, absl::string_view what);
  absl::Status Prepare(const std::string& update_id,
                       const std::vector<HostTensor>& tensors, bool verify);
  absl::StatusOr<std::vector<v1::FinishWeightUpdateResponse>> Commit(
      const std::string& update_id);

  std::vector<std::unique_ptr<TrainerClient>> daemons_;
  std::vector<std::string> targets_;
  std::vector<v1::StartWeightUpdateResponse> starts_;
};

}  // namespace weightsync

#endif  // WEIGHTSYNC_CLIENT_MULTI_TRAINER_H_

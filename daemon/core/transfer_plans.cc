// Coordinator: transfer plans of many senders (docs/transfer_plan.md).
// RegisterTransferPlan validates a plan once and keeps it by id; Start
// names it (update_start.cc) and LinkedPlanFor resolves its links into the
// copy plan the data plane runs, reusing the last one while neither the
// plan, the chunk size nor the engines' layouts change.
#include <algorithm>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "daemon/core/coordinator.h"
#include "daemon/core/event_log.h"
#include "glog/logging.h"

namespace weightsync {

absl::StatusOr<v1::RegisterTransferPlanResponse>
Coordinator::RegisterTransferPlan(
    const v1::RegisterTransferPlanRequest& request) {
  NoteTrainerCall();
  {
    absl::MutexLock lock(&mu_);
    if (shut_down_) return absl::UnavailableError("daemon is shutting down");
    if (data_plane_ == nullptr) {
      return absl::FailedPreconditionError(
          "no transfer group: call InitWeightTransfer before "
          "RegisterTransferPlan (a plan belongs to the group)");
    }
  }
  if (request.receivers_size() == 0) {
    return absl::InvalidArgumentError(
        "RegisterTransferPlan: name the receivers of the plan this daemon "
        "is (receivers)");
  }
  std::vector<int32_t> receivers(request.receivers().begin(),
                                 request.receivers().end());
  std::sort(receivers.begin(), receivers.end());
  for (size_t i = 0; i < receivers.size(); ++i) {
    if (receivers[i] < 0 || receivers[i] >= request.spec().receivers_size() ||
        (i > 0 && receivers[i] == receivers[i - 1])) {
      return absl::InvalidArgumentError(
          absl::StrCat("RegisterTransferPlan: receiver ", receivers[i],
                       " is repeated or not one of the spec's ",
                       request.spec().receivers_size()));
    }
  }
  // Bounded like a Start's manifest (the spec is a manifest and more).
  TransferPlanLimits limits;
  limits.max_blocks = options_.max_manifest_tensors * 64;
  limits.max_tensors = options_.max_manifest_tensors;
  limits.max_name_length = options_.limits.max_name_length;
  limits.max_rank = CoordinatorOptions::kMaxTensorRank;
  WS_ASSIGN_OR_RETURN(TransferPlan built,
                      BuildTransferPlan(request.spec(), limits));
  auto plan = std::make_shared<const TransferPlan>(std::move(built));
  v1::RegisterTransferPlanResponse response;
  response.set_plan_id(plan->id);
  int senders = 0;
  for (int s = 0; s < plan->num_senders; ++s) {
    bool any = false;
    for (int32_t r : receivers) any |= !plan->links[s][r].empty();
    senders += any;
  }
  int64_t bytes = 0;
  for (int32_t r : receivers) bytes += plan->receiver_bytes[r];
  response.set_bytes(bytes);
  response.set_senders(senders);
  for (const std::string& t : plan->unused) response.add_unused_tensors(t);
  {
    absl::MutexLock lock(&mu_);
    // Kept by id, as a Start names it: a plan registered again (with these
    // receivers or others) replaces its entry, so an entry no Start could
    // reach never holds one of the kMaxTransferPlans places.
    auto same = [&](const TransferPlanEntry& e) {
      return e.plan->id == plan->id;
    };
    transfer_plans_.erase(
        std::remove_if(transfer_plans_.begin(), transfer_plans_.end(), same),
        transfer_plans_.end());
    transfer_plans_.insert(transfer_plans_.begin(), {plan, receivers});
    if (transfer_plans_.size() > kMaxTransferPlans) transfer_plans_.pop_back();
  }
  LOG(INFO) << Event("transfer_plan.registered") << plan->id << ": "
            << plan->num_senders << " senders, " << plan->num_receivers
            << " receivers, " << plan->pieces.size() << " pieces; " << bytes
            << " bytes from " << senders << " senders to this daemon";
  return response;
}

absl::StatusOr<LinkedCopyPlan> Coordinator::LinkedPlanFor(
    const TransferPlan& plan, const std::vector<int32_t>& receivers,
    int64_t chunk_bytes,
    const std::vector<std::shared_ptr<const EngineLayout>>& layouts,
    const std::vector<LinkPatch>& patches,
    const std::vector<WireTensor>& wire) {
  // Patches change with every update: planned each time, never cached.
  if (!patches.empty()) {
    return BuildLinkedCopyPlan(plan, receivers, chunk_bytes, layouts, patches,
                               wire);
  }
  std::string key = absl::StrCat(plan.id, "|", chunk_bytes);
  for (int32_t r : receivers) absl::StrAppend(&key, "|", r);
  // The tensors sent quantised (the same every update, as a rule).
  for (const WireTensor& w : wire) {
    absl::StrAppend(&key, "|", w.tensor, "=",
                    absl::BytesToHexString(w.quantization.SerializeAsString()));
  }
  {
    absl::MutexLock lock(&mu_);
    if (last_linked_.copy != nullptr && key == last_linked_key_ &&
        layouts == last_linked_layouts_) {
      return last_linked_;
    }
  }
  WS_ASSIGN_OR_RETURN(
      LinkedCopyPlan linked,
      BuildLinkedCopyPlan(plan, receivers, chunk_bytes, layouts, {}, wire));
  absl::MutexLock lock(&mu_);
  for (const auto& l : layouts) {
    bool registered = false;
    for (const auto& [id, r] : engines_) registered |= r.layout == l;
    if (!registered) return linked;
  }
  last_linked_ = linked;
  last_linked_key_ = std::move(key);
  last_linked_layouts_ = layouts;
  return linked;
}

}  // namespace weightsync

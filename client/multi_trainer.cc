#include "client/multi_trainer.h"

#include <algorithm>
#include <thread>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/receipts.h"
#include "common/status_macros.h"

namespace weightsync {
namespace {

// The tensors every answer lists as unused, in manifest order.
std::vector<std::string> UnusedEverywhere(
    const std::vector<v1::StartWeightUpdateResponse>& starts,
    const std::vector<HostTensor>& tensors) {
  std::vector<std::string> out;
  for (const HostTensor& t : tensors) {
    bool everywhere = !starts.empty();
    for (const v1::StartWeightUpdateResponse& s : starts) {
      everywhere =
          everywhere &&
          std::find(s.unused_tensors().begin(), s.unused_tensors().end(),
                    t.spec.name()) != s.unused_tensors().end();
    }
    if (everywhere) out.push_back(t.spec.name());
  }
  return out;
}

absl::Status Annotate(const absl::Status& s, absl::string_view prefix) {
  return absl::Status(s.code(), absl::StrCat(prefix, ": ", s.message()));
}

}  // namespace

absl::StatusOr<std::unique_ptr<MultiTrainer>> MultiTrainer::Connect(
    const std::vector<ClientOptions>& daemons) {
  if (daemons.empty()) return absl::InvalidArgumentError("no daemon target");
  std::vector<std::unique_ptr<TrainerClient>> clients;
  std::vector<std::string> targets;
  for (const ClientOptions& o : daemons) {
    absl::StatusOr<std::unique_ptr<TrainerClient>> c =
        TrainerClient::Connect(o);
    if (!c.ok()) return Annotate(c.status(), o.target);
    clients.push_back(*std::move(c));
    targets.push_back(o.target);
  }
  return std::unique_ptr<MultiTrainer>(
      new MultiTrainer(std::move(clients), std::move(targets)));
}

std::string MultiTrainer::Name(int i) const {
  return absl::StrCat("daemon ", i, " (", targets_[i], ")");
}

std::vector<absl::Status> MultiTrainer::Each(
    const std::function<absl::Status(int)>& fn) {
  std::vector<absl::Status> out(daemons_.size());
  std::vector<std::thread> threads;
  for (int i = 0; i < size(); ++i) {
    threads.emplace_back([&, i] { out[i] = fn(i); });
  }
  for (std::thread& t : threads) t.join();
  return out;
}

absl::Status MultiTrainer::InitHost() {
  const std::vector<absl::Status> done = Each([&](int i) {
    v1::InitWeightTransferRequest init;
    init.set_backend(v1::BACKEND_HOST);
    return daemons_[i]->InitWeightTransfer(init).status();
  });
  for (int i = 0; i < size(); ++i) {
    if (!done[i].ok()) return Annotate(done[i], Name(i));
  }
  return absl::OkStatus();
}

absl::StatusOr<MultiTrainer::Ranks> MultiTrainer::RankLayout(
    v1::Backend backend) {
  Ranks r;
  r.world_size = 1;  // the trainer is rank 0
  for (int i = 0; i < size(); ++i) {
    absl::StatusOr<int> n = daemons_[i]->GetWorldSize(backend);
    if (!n.ok()) return Annotate(n.status(), Name(i));
    r.rank_offsets.push_back(r.world_size);
    r.world_size += *n;
  }
  return r;
}

absl::Status MultiTrainer::StartEverywhere(
    const v1::StartWeightUpdateRequest& request) {
  starts_.assign(size(), {});
  std::vector<HostTensor> names;  // for UnusedEverywhere's order
  for (const v1::TensorSpec& t : request.tensors()) names.push_back({t});
  for (bool plan_only : {true, false}) {
    v1::StartWeightUpdateRequest r = request;
    r.set_skip_unused(true);
    r.set_plan_only(plan_only);
    const std::vector<absl::Status> done = Each([&](int i) {
      absl::StatusOr<v1::StartWeightUpdateResponse> s =
          daemons_[i]->StartWeightUpdate(r);
      if (s.ok()) starts_[i] = *std::move(s);
      return s.status();
    });
    absl::Status failed;
    for (int i = 0; i < size() && failed.ok(); ++i) {
      if (!done[i].ok()) failed = Annotate(done[i], Name(i));
    }
    std::vector<std::string> nowhere = UnusedEverywhere(starts_, names);
    if (failed.ok() && !nowhere.empty()) {
      failed = absl::InvalidArgumentError(absl::StrCat(
          "tensor(s) '", absl::StrJoin(nowhere, "', '"),
          "' are not a parameter or segment source of any engine on any of "
          "the ",
          size(), " daemons (", absl::StrJoin(targets_, ", "),
          "); nothing was sent"));
    }
    if (failed.ok()) continue;
    if (!plan_only) {
      // The daemons that started: no byte moved, their engines untouched.
      Each([&](int i) {
        return done[i].ok() ? daemons_[i]
                                  ->AbortWeightUpdate(request.update_id(),
                                                      "Start failed elsewhere")
                                  .status()
                            : absl::OkStatus();
      });
    }
    return failed;
  }
  return absl::OkStatus();
}

absl::Status MultiTrainer::FailEverywhere(const std::string& update_id, int i,
                                          const absl::Status& why,
                                          absl::string_view what) {
  std::vector<std::vector<std::string>> dirty(size());
  Each([&](int d) {
    absl::StatusOr<v1::AbortWeightUpdateResponse> a =
        daemons_[d]->AbortWeightUpdate(update_id, std::string(what));
    if (a.ok()) {
      for (const v1::EngineResult& e : a->engines()) {
        if (e.state() == v1::ENGINE_DIRTY) dirty[d].push_back(e.engine_id());
      }
    }
    return absl::OkStatus();  // already ended there, or gone: fine
  });
  std::vector<std::string> all;
  for (const auto& d : dirty) all.insert(all.end(), d.begin(), d.end());
  return absl::Status(
      why.code(),
      absl::StrCat("update '", update_id, "': ", what, ": ",
                   i >= 0 ? absl::StrCat(Name(i), ": ") : "", why.message(),
                   "; aborted on every daemon, committed nowhere",
                   all.empty() ? "; engines untouched"
                               : absl::StrCat("; engines left DIRTY (paused "
                                              "until a dense update): ",
                                              absl::StrJoin(all, ", "))));
}

absl::Status MultiTrainer::Prepare(const std::string& update_id,
                                   const std::vector<HostTensor>& tensors,
                                   bool verify) {
  std::vector<v1::FinishWeightUpdateResponse> prepared(size());
  std::vector<absl::Status> done = Each([&](int i) -> absl::Status {
    WS_ASSIGN_OR_RETURN(v1::PrepareWeightUpdateResponse p,
                        daemons_[i]->PrepareWeightUpdate(update_id));
    *prepared[i].mutable_engines() = std::move(*p.mutable_engines());
    if (!verify) return absl::OkStatus();
    WS_ASSIGN_OR_RETURN(v1::GetStatusResponse layouts,
                        daemons_[i]->GetStatus(/*include_layouts=*/true));
    // A mismatch is the trainer's finding, not the daemon's failure.
    const absl::Status receipts = CheckReceipts(prepared[i], layouts, tensors);
    return receipts.ok() ? receipts
                         : absl::DataLossError(absl::StrCat(
                               "receipts do not match: ", receipts.message()));
  });
  for (int i = 0; i < size(); ++i) {
    if (!done[i].ok()) {
      return FailEverywhere(update_id, i, done[i], "prepare failed");
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<v1::FinishWeightUpdateResponse>>
MultiTrainer::Commit(const std::string& update_id) {
  std::vector<v1::FinishWeightUpdateResponse> out(size());
  const std::vector<absl::Status> done = Each([&](int i) -> absl::Status {
    WS_ASSIGN_OR_RETURN(out[i], daemons_[i]->CommitWeightUpdate(update_id));
    return absl::OkStatus();
  });
  std::vector<std::string> committed, not_committed;
  for (int i = 0; i < size(); ++i) {
    if (done[i].ok()) {
      committed.push_back(Name(i));
    } else {
      not_committed.push_back(
          absl::StrCat(Name(i), " (", done[i].ToString(), ")"));
    }
  }
  if (not_committed.empty()) return out;
  return absl::AbortedError(absl::StrCat(
      "update '", update_id, "' committed on ",
      committed.empty() ? "no daemon" : absl::StrJoin(committed, ", "),
      " but not on ", absl::StrJoin(not_committed, "; "),
      ": the engines there stay paused (DIRTY once the update ends) and "
      "never serve the old weights beside the new; a dense update at a "
      "higher version repairs them"));
}

absl::StatusOr<std::vector<v1::FinishWeightUpdateResponse>>
MultiTrainer::Update(v1::StartWeightUpdateRequest request,
                     const std::vector<HostTensor>& tensors) {
  WS_RETURN_IF_ERROR(CheckHostTensors(tensors, "MultiTrainer::Update"));
  request.clear_tensors();
  for (const HostTensor& t : tensors) *request.add_tensors() = t.spec;
  const std::string& id = request.update_id();
  WS_RETURN_IF_ERROR(InUpdateTerms(StartEverywhere(request),
                                   "MultiTrainer::Update",
                                   "MultiTrainer::InitHost"));
  // Each daemon is sent the tensors its engines use (stream_omits_unused).
  const std::vector<absl::Status> pushed = Each([&](int i) {
    const v1::StartWeightUpdateResponse& s = starts_[i];
    if (s.num_chunks() == 0) return absl::OkStatus();
    const absl::flat_hash_set<std::string> unused(s.unused_tensors().begin(),
                                                  s.unused_tensors().end());
    std::vector<HostTensor> mine;
    for (const HostTensor& t : tensors) {
      if (!s.stream_omits_unused() || !unused.contains(t.spec.name())) {
        mine.push_back(t);
      }
    }
    return daemons_[i]->PushTensors(id, mine, s.chunk_bytes());
  });
  for (int i = 0; i < size(); ++i) {
    if (!pushed[i].ok()) {
      return FailEverywhere(id, i, pushed[i], "sending failed");
    }
  }
  if (on_phase) on_phase("pushed");
  WS_RETURN_IF_ERROR(Prepare(id, tensors, request.verify() != v1::VERIFY_OFF));
  if (on_phase) on_phase("prepared");
  return Commit(id);
}

}  // namespace weightsync

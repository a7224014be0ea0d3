// Coordinator: an update while its bytes arrive. BeginPushStream, PushChunk
// and PushStreamEnded take the trainer's chunk stream and IpcChunkAck paces
// an IPC ring; FailUpdateLocked marks the update failed (and its engines
// dirty where it may have written); WaitForSubmits lets Finish and Abort wait
// out a chunk in flight. Start is in update_start.cc, the idle watchdog in
// update_watchdog.cc, Finish and Abort in update_finish.cc; the locking rules
// are coordinator.h's.
#include <memory>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "daemon/core/coordinator.h"
#include "daemon/core/event_log.h"
#include "glog/logging.h"

namespace weightsync {

absl::Status Coordinator::BeginPushStream(const std::string& update_id,
                                          StreamLink link) {
  absl::MutexLock lock(&mu_);
  if (update_ == nullptr || update_->id != update_id) {
    return absl::FailedPreconditionError(
        absl::StrCat("no update '", update_id,
                     "' in progress; call StartWeightUpdate "
                     "before PushChunks"));
  }
  if (!update_->links.empty()) {
    const int l = update_->FindLink(link);
    if (l < 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "update '", update_id,
          "': the transfer plan has no link from "
          "sender ",
          link.sender, " to receiver ", link.receiver, " on this daemon"));
    }
    if (update_->links[l].open) {
      return absl::FailedPreconditionError(absl::StrCat(
          "update '", update_id, "' already has the stream of sender ",
          link.sender, " to receiver ", link.receiver, " open"));
    }
    update_->links[l].open = true;
    update_->last_activity = absl::Now();
    return absl::OkStatus();
  }
  if (update_->stream_open) {
    return absl::FailedPreconditionError(absl::StrCat(
        "update '", update_id, "' already has a PushChunks stream open"));
  }
  update_->stream_open = true;
  update_->last_activity = absl::Now();
  return absl::OkStatus();
}

absl::Status Coordinator::PushChunk(const std::string& update_id, int64_t index,
                                    std::string data, absl::Time deadline,
                                    StreamLink link) {
  std::shared_ptr<DataPlane> plane;
  {
    absl::MutexLock lock(&mu_);
    if (update_ == nullptr || update_->id != update_id) {
      return absl::FailedPreconditionError(
          absl::StrCat("no update '", update_id, "' in progress"));
    }
    if (update_->phase == Phase::kFailed) {
      return absl::AbortedError(absl::StrCat(
          "update '", update_id, "' failed: ", update_->error.message()));
    }
    const bool ring = update_->ipc_ring_slots > 0;
    if (update_->bytes_by_plane && !ring) {
      return absl::FailedPreconditionError(absl::StrCat(
          "update '", update_id, "' ",
          update_->data_plane->ReceivesOwnBytes()
              ? absl::StrCat("uses the ", update_->data_plane->name(),
                             " backend")
              : "copies from its registered source's memory",
          ": its bytes do not travel through PushChunks"));
    }
    const auto& chunks = update_->plan->chunks.chunks;
    absl::Status bad;
    // A transfer-plan update: `index` counts the link's chunks; they are
    // plan chunks [first_chunk, first_chunk + num_chunks).
    int64_t* next = &update_->next_chunk;
    int64_t first = 0;
    if (!update_->links.empty()) {
      const int l = update_->FindLink(link);
      if (l < 0) {
        bad = absl::InvalidArgumentError(
            absl::StrCat("update '", update_id, "': no link from sender ",
                         link.sender, " to receiver ", link.receiver));
      } else {
        Update::LinkState& ls = update_->links[l];
        if (index < 0 || index >= ls.chunks.num_chunks) {
          bad = absl::InvalidArgumentError(absl::StrCat(
              "update '", update_id, "': chunk ", index, " of sender ",
              link.sender, " arrived, but its link has ", ls.chunks.num_chunks,
              " chunks"));
        } else if (index != ls.next) {
          bad = absl::InvalidArgumentError(absl::StrCat(
              "update '", update_id, "': chunk ", index, " of sender ",
              link.sender, " arrived, expected ", ls.next));
        }
        next = &ls.next;
        first = ls.chunks.first_chunk;
      }
      if (bad.ok()) index += first;
    }
    if (!bad.ok()) {
      // The link's own checks refused the chunk.
    } else if (index < 0 || index >= static_cast<int64_t>(chunks.size())) {
      bad = absl::InvalidArgumentError(absl::StrCat("update '", update_id,
                                                    "': chunk ", index,
                                                    " arrived, but the plan "
                                                    "has ",
                                                    chunks.size(), " chunks"));
    } else if (update_->links.empty() && index != update_->next_chunk) {
      bad = absl::InvalidArgumentError(absl::StrCat(
          "update '", update_id, "': chunk ", index, " arrived, expected ",
          update_->next_chunk, " of ", chunks.size()));
    } else if (!ring &&
               static_cast<int64_t>(data.size()) != chunks[index].size) {
      bad = absl::InvalidArgumentError(absl::StrCat(
          "update '", update_id, "': chunk ", index, " has ", data.size(),
          " bytes, the plan says ", chunks[index].size));
    }
    if (!bad.ok()) {
      // The stream is out of step with the plan: nothing of this chunk is
      // written and the update can't complete.
      FailUpdateLocked(bad);
      return bad;
    }
    if (next != &update_->next_chunk) ++*next;
    ++update_->next_chunk;
    update_->received_bytes += chunks[index].size;
    update_->last_activity = absl::Now();
    if (update_->staged && !update_->device_staged) {
      update_->staged_chunks[index] = std::move(data);
      return absl::OkStatus();
    }
    // Device staging (an IPC ring): the data plane copies the chunk out of
    // its slot into GPU staging; engine memory waits for the commit.
    ++update_->submits_in_flight;
    plane = update_->data_plane;
  }
  absl::Status s = plane->SubmitChunk(index, std::move(data), deadline);
  absl::MutexLock lock(&mu_);
  // Finish and Abort wait for this count to drop before they end the update,
  // so update_ is still this update here.
  --update_->submits_in_flight;
  if (!s.ok()) FailUpdateLocked(s);
  return s;
}

absl::StatusOr<int64_t> Coordinator::IpcChunkAck(const std::string& update_id,
                                                 int64_t index,
                                                 absl::Time deadline) {
  std::shared_ptr<DataPlane> plane;
  int64_t need;
  {
    absl::MutexLock lock(&mu_);
    if (update_ == nullptr || update_->id != update_id) {
      return absl::FailedPreconditionError(
          absl::StrCat("no update '", update_id, "' in progress"));
    }
    // Before it packs chunk index+1 into slot (index+1) % slots, the
    // trainer needs chunk index+1-slots out of it.
    update_->last_activity = absl::Now();
    need = index + 2 - update_->ipc_ring_slots;
    if (need <= 0) return 0;
    ++update_->submits_in_flight;
    plane = update_->data_plane;
  }
  absl::Status s = plane->WaitChunks(need, deadline);
  absl::MutexLock lock(&mu_);
  --update_->submits_in_flight;
  if (!s.ok()) {
    FailUpdateLocked(s);
    return s;
  }
  return need;
}

absl::Status Coordinator::PushStreamEnded(const std::string& update_id,
                                          bool cancelled, StreamLink link) {
  absl::MutexLock lock(&mu_);
  if (update_ == nullptr || update_->id != update_id) return absl::OkStatus();
  if (!update_->links.empty()) {
    const int l = update_->FindLink(link);
    if (l < 0 || update_->phase == Phase::kFailed) return absl::OkStatus();
    Update::LinkState& ls = update_->links[l];
    ls.open = false;
    if (ls.next >= ls.chunks.num_chunks) return absl::OkStatus();
    // One sender gone fails the whole update: its bytes will never come.
    const absl::Status lost = absl::AbortedError(absl::StrCat(
        "sender ", link.sender,
        cancelled ? " disconnected" : " ended its stream", " mid-update after ",
        ls.next, " of ", ls.chunks.num_chunks,
        " chunks of its link to receiver ", link.receiver, " (update '",
        update_id, "' failed; start it again)"));
    FailUpdateLocked(lost);
    return cancelled ? absl::OkStatus() : lost;
  }
  update_->stream_open = false;
  const int64_t total = update_->plan->chunks.chunks.size();
  const int64_t next = update_->next_chunk;
  // A stream to an update whose bytes don't travel as chunks was refused at
  // its first message; the update itself is not missing anything.
  const bool no_chunks =
      update_->bytes_by_plane && update_->ipc_ring_slots == 0;
  if (no_chunks || next >= total || update_->phase == Phase::kFailed) {
    return absl::OkStatus();
  }
  if (cancelled) {
    FailUpdateLocked(absl::AbortedError(
        absl::StrCat("trainer disconnected mid-stream after ", next, " of ",
                     total, " chunks")));
    return absl::OkStatus();  // nobody is left to answer
  }
  const absl::Status missing = absl::AbortedError(absl::StrCat(
      "the chunk stream of update '", update_id, "' ended after ", next, " of ",
      total, " chunks (chunks ", next, "..", total - 1,
      " missing): the trainer closed it early or a message did not parse; "
      "the update failed, start it again"));
  FailUpdateLocked(missing);
  return missing;
}

void Coordinator::FailUpdateLocked(const absl::Status& reason) {
  if (update_->phase == Phase::kFailed) return;
  update_->phase = Phase::kFailed;
  update_->failed_at = absl::Now();
  update_->error = reason;
  if (listener_) {
    UpdateOutcome o;
    o.update_id = update_->id;
    o.backend = update_->data_plane->name();
    o.staged = update_->staged;
    o.code = reason.code() == absl::StatusCode::kOk ? absl::StatusCode::kUnknown
                                                    : reason.code();
    o.version = update_->target_version;
    o.bytes = update_->received_bytes;
    o.seconds = absl::ToDoubleSeconds(update_->failed_at - update_->started);
    listener_(o);
  }
  // Engines that may hold part of this update are dirty from now on. Bytes
  // that arrive by themselves (NCCL) may have landed from Begin on.
  const bool wrote = update_->staged
                         ? update_->committing
                         : update_->next_chunk > 0 || update_->bytes_by_plane;
  if (wrote) {
    for (size_t i = 0; i < update_->engine_ids.size(); ++i) {
      auto it = engines_.find(update_->engine_ids[i]);
      if (!update_->lost[i] && it != engines_.end()) it->second.dirty = true;
    }
  }
  LOG(WARNING) << Event("update.failed", update_->id, update_->target_version,
                        absl::StrJoin(update_->engine_ids, ","))
               << reason;
  RecordUpdateStatusLocked("failed");
}

absl::Status Coordinator::WaitForSubmits(absl::Time deadline) {
  absl::MutexLock lock(&mu_);
  auto idle = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return update_->submits_in_flight == 0;
  };
  if (!mu_.AwaitWithDeadline(absl::Condition(&idle), deadline)) {
    return absl::DeadlineExceededError("a chunk was still being received");
  }
  return absl::OkStatus();
}

}  // namespace weightsync

#include "daemon/core/source_registry.h"

#include <iterator>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace weightsync {

absl::Status SourceRegistry::Validate(const v1::RegisterSourceRequest& request,
                                      v1::MemoryKind memory,
                                      Source* source) const {
  if (request.tensors_size() == 0 ||
      request.tensors_size() > limits_.max_tensors) {
    return absl::InvalidArgumentError(
        absl::StrCat("a source has 1 to ", limits_.max_tensors,
                     " tensors; this one has ", request.tensors_size()));
  }
  absl::flat_hash_set<absl::string_view> names;
  names.reserve(request.tensors_size());
  source->payload_bytes.reserve(request.tensors_size());
  for (int i = 0; i < request.tensors_size(); ++i) {
    const v1::TensorSpec& t = request.tensors(i);
    if (t.name().empty() ||
        static_cast<int64_t>(t.name().size()) > limits_.max_name_length ||
        t.shape_size() > limits_.max_rank) {
      return absl::InvalidArgumentError(absl::StrCat(
          "source tensor ", i, " ('", t.name().substr(0, 64), "'): a name of ",
          t.name().size(), " bytes and ", t.shape_size(),
          " dimensions; names must be 1-", limits_.max_name_length,
          " bytes, at most ", limits_.max_rank, " dimensions"));
    }
    if (t.sparse_nnz() != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "source tensor '", t.name(),
          "' is a sparse patch; a source registers dense tensors (send "
          "patches in StartWeightUpdate.tensors)"));
    }
    if (!names.insert(t.name()).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("source tensor '", t.name(), "' appears twice"));
    }
    absl::StatusOr<int64_t> bytes = PayloadBytes(t);
    if (!bytes.ok()) return bytes.status();
    source->payload_bytes.push_back(*bytes);
    source->total_bytes += *bytes;
  }
  if (request.allocations_size() == 0 && request.placements_size() == 0) {
    return absl::OkStatus();
  }
  if (memory == v1::MEMORY_KIND_UNSPECIFIED) {
    return absl::InvalidArgumentError(
        "this source registers memory, which the host and ipc backends copy "
        "from, not this group's; register the manifest alone (no "
        "allocations, no placements)");
  }
  return ValidateMemory(request, memory, *source);
}

absl::Status SourceRegistry::ValidateMemory(
    const v1::RegisterSourceRequest& request, v1::MemoryKind memory,
    const Source& source) const {
  if (request.placements_size() != request.tensors_size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a source with memory places every tensor: ", request.tensors_size(),
        " tensors, ", request.placements_size(), " placements"));
  }
  if (request.allocations_size() == 0 ||
      request.allocations_size() > limits_.max_allocations) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a source with memory has 1 to ", limits_.max_allocations,
        " allocations; this one has ", request.allocations_size()));
  }
  for (int a = 0; a < request.allocations_size(); ++a) {
    const v1::Allocation& al = request.allocations(a);
    const bool host = memory == v1::MEMORY_HOST_SHM;
    const bool kind_ok = host ? al.kind() == v1::MEMORY_HOST_SHM
                              : al.kind() == v1::MEMORY_CUDA_IPC ||
                                    al.kind() == v1::MEMORY_CUDA_VMM;
    if (!kind_ok || al.handle().empty() || al.size() <= 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "source allocation ", a, ": a source's memory is ",
          host ? "MEMORY_HOST_SHM (the host backend)"
               : "MEMORY_CUDA_IPC or MEMORY_CUDA_VMM (the ipc backend)",
          " with a handle and a positive size"));
    }
  }
  for (int i = 0; i < request.placements_size(); ++i) {
    const v1::SourcePlacement& p = request.placements(i);
    const std::string& name = request.tensors(i).name();
    if (p.allocation() < 0 || p.allocation() >= request.allocations_size()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "source tensor '", name, "': allocation ", p.allocation(),
          " is not one of the ", request.allocations_size(), " registered"));
    }
    const int64_t size = request.allocations(p.allocation()).size();
    if (p.offset() < 0 || p.offset() > size ||
        source.payload_bytes[i] > size - p.offset()) {
      return absl::InvalidArgumentError(
          absl::StrCat("source tensor '", name, "': bytes [", p.offset(), ", +",
                       source.payload_bytes[i], ") lie outside allocation ",
                       p.allocation(), " of ", size, " bytes"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<const Source>> SourceRegistry::Register(
    const v1::RegisterSourceRequest& request, MemoryMapper& mapper,
    v1::MemoryKind memory) {
  std::string content;
  request.SerializeToString(&content);
  {
    absl::MutexLock lock(&mu_);
    for (auto it = entries_.begin(); it != entries_.end(); ++it) {
      if (it->content == content) {
        entries_.splice(entries_.begin(), entries_, it);
        return it->source;
      }
    }
  }
  auto source = std::make_shared<Source>();
  WS_RETURN_IF_ERROR(Validate(request, memory, source.get()));
  source->manifest = request.tensors();
  for (int a = 0; a < request.allocations_size(); ++a) {
    absl::StatusOr<std::shared_ptr<MappedRegion>> region =
        mapper.Open(request.allocations(a));
    if (!region.ok()) {
      return absl::Status(region.status().code(),
                          absl::StrCat("source allocation ", a, ": ",
                                       region.status().message()));
    }
    source->regions.push_back(*std::move(region));
  }
  source->placements.reserve(request.placements_size());
  for (const v1::SourcePlacement& p : request.placements()) {
    source->placements.push_back({p.allocation(), p.offset()});
  }
  std::list<Entry> dropped;  // closed after the lock is released
  absl::MutexLock lock(&mu_);
  source->id = absl::StrCat("source-", next_id_++);
  entries_.push_front({std::move(content), source});
  while (static_cast<int>(entries_.size()) > limits_.max_sources) {
    dropped.splice(dropped.end(), entries_, std::prev(entries_.end()));
  }
  return std::shared_ptr<const Source>(source);
}

absl::StatusOr<std::shared_ptr<const Source>> SourceRegistry::Find(
    const std::string& id) {
  absl::MutexLock lock(&mu_);
  for (auto it = entries_.begin(); it != entries_.end(); ++it) {
    if (it->source->id == id) {
      entries_.splice(entries_.begin(), entries_, it);
      return it->source;
    }
  }
  return absl::NotFoundError(absl::StrCat(
      "no source '", id.substr(0, 64),
      "': the transfer group was initialised again or the source was "
      "dropped; register it again"));
}

absl::Status SourceRegistry::Unregister(const std::string& id) {
  absl::MutexLock lock(&mu_);
  for (auto it = entries_.begin(); it != entries_.end(); ++it) {
    if (it->source->id == id) {
      entries_.erase(it);
      return absl::OkStatus();
    }
  }
  return absl::NotFoundError(
      absl::StrCat("no source '", id.substr(0, 64), "'"));
}

void SourceRegistry::Clear() {
  std::list<Entry> dropped;
  {
    absl::MutexLock lock(&mu_);
    dropped.swap(entries_);
  }
  // Mappings close outside the lock (a GPU region's close is an RPC).
}

int SourceRegistry::size() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int>(entries_.size());
}

}  // namespace weightsync

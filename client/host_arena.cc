#include "client/host_arena.h"

#include <utility>

#include "common/dtype.h"
#include "common/status_macros.h"

namespace weightsync {

absl::StatusOr<int64_t> HostArena::Layout(std::vector<v1::Parameter>* params) {
  int64_t offset = 0;
  for (v1::Parameter& p : *params) {
    const std::vector<int64_t> shape(p.shape().begin(), p.shape().end());
    WS_ASSIGN_OR_RETURN(int64_t numel, NumElements(shape, p.dtype(), p.name()));
    offset = (offset + 255) / 256 * 256;
    p.set_allocation(0);
    p.set_offset(offset);
    offset += numel * ElementSize(p.dtype());
  }
  return offset;
}

absl::StatusOr<std::unique_ptr<HostArena>> HostArena::Create(
    const std::string& shm_name, std::vector<v1::Parameter> parameters) {
  auto arena = std::unique_ptr<HostArena>(new HostArena());
  WS_ASSIGN_OR_RETURN(const int64_t size, Layout(&parameters));
  for (const v1::Parameter& p : parameters) {
    arena->offsets_[p.name()] = p.offset();
  }
  WS_ASSIGN_OR_RETURN(arena->region_,
                      ShmRegion::Create(shm_name, std::max<int64_t>(size, 1)));
  arena->params_ = std::move(parameters);
  return arena;
}

v1::RegisterEngineRequest HostArena::Registration() const {
  v1::RegisterEngineRequest r;
  v1::Allocation* a = r.add_allocations();
  a->set_kind(v1::MEMORY_HOST_SHM);
  a->set_handle(region_->name());
  a->set_size(region_->size());
  a->set_device_uuid("host");
  for (const v1::Parameter& p : params_) *r.add_parameters() = p;
  return r;
}

uint8_t* HostArena::data(const std::string& name) const {
  auto it = offsets_.find(name);
  return it == offsets_.end() ? nullptr : region_->data() + it->second;
}

}  // namespace weightsync

// The collection of receipts on the GPU: the regions of engine memory the
// worker sums (ReceiptRegionsOf, FP8 scales included), one engine's
// receipt now (CheckEngine) and an update's receipts with its last copy.

#include <algorithm>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "backends/cuda/worker_client.h"
#include "common/checksum.h"
#include "common/dtype.h"
#include "common/status_macros.h"

namespace weightsync {

absl::flat_hash_set<std::string> ReceiptSources(const CopyPlan& plan) {
  absl::flat_hash_set<std::string> sources;
  for (size_t e = 0; e < plan.dense_uses.size() && e < plan.engines.size();
       ++e) {
    const EngineLayout& engine = *plan.engines[e];
    for (const SourceUse& u : plan.dense_uses[e]) {
      sources.insert(engine.parameters[u.parameter].segments[u.segment].source);
    }
  }
  return sources;
}

namespace {

// The stored scales of the blocks that segment `s` of FP8 target `p`
// writes, as ComputeReceipt sums them (daemon/core/receipt.cc,
// AddScaleTerms): one region of the scale parameter, 4-byte elements keyed
// on the block's index, salted with the scale parameter's name; counted in
// *receipt (the scale parameter once per engine).
absl::Status AddScaleRegion(const EngineLayout& engine,
                            const ParameterLayout& p, const SegmentLayout& s,
                            int group, worker::v1::ComputeReceiptsRequest* req,
                            v1::Receipt* receipt,
                            absl::flat_hash_set<int32_t>* scales_seen) {
  const QuantLayout& q = *p.quant;
  const ParameterLayout& scale = engine.parameters[q.scale_parameter];
  const auto* region =
      dynamic_cast<const GpuRegion*>(engine.regions[scale.region].get());
  if (region == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        "engine '", engine.engine_id, "': scale parameter '", scale.name,
        "' is in host memory; the GPU backends read GPU memory"));
  }
  const auto [i0, i1, j0, j1, first] = ScaleBlocksOf(q, s);
  worker::v1::ReceiptRegionSpec* g = req->add_regions();
  g->set_allocation_id(region->id());
  g->set_offset(scale.offset + first * 4);
  g->set_rows(i1 - i0);
  g->set_cols(j1 - j0);
  g->set_row_stride_bytes(q.grid_cols * 4);
  g->set_element_size(4);
  g->set_salt(scale.salt);
  g->set_first_index(static_cast<uint64_t>(first));
  g->set_group(group);
  receipt->set_bytes(receipt->bytes() + (i1 - i0) * (j1 - j0) * 4);
  if (scales_seen->insert(q.scale_parameter).second) {
    receipt->set_parameters(receipt->parameters() + 1);
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ReceiptRegionsOf(const std::vector<const EngineLayout*>& engines,
                              const absl::flat_hash_set<std::string>& sources,
                              const std::vector<bool>& skip,
                              worker::v1::ComputeReceiptsRequest* req,
                              std::vector<v1::Receipt>* out,
                              std::vector<std::string>* region_sources) {
  out->assign(engines.size(), v1::Receipt());
  req->set_groups(engines.size());
  for (size_t e = 0; e < engines.size(); ++e) {
    if (e < skip.size() && skip[e]) continue;
    const EngineLayout& engine = *engines[e];
    v1::Receipt& receipt = (*out)[e];
    absl::flat_hash_set<int32_t> scales_seen;  // counted scale parameters
    for (const ParameterLayout& p : engine.parameters) {
      const auto* region =
          dynamic_cast<const GpuRegion*>(engine.regions[p.region].get());
      if (region == nullptr) {
        return absl::InvalidArgumentError(absl::StrCat(
            "engine '", engine.engine_id,
            "' registered host memory; the GPU backends read GPU memory"));
      }
      const int64_t es = ElementSize(p.dtype);
      const uint64_t salt = p.salt;
      bool touched = false;
      for (const SegmentLayout& s : p.segments) {
        if (!sources.contains(s.source)) continue;
        touched = true;
        worker::v1::ReceiptRegionSpec* g = req->add_regions();
        g->set_allocation_id(region->id());
        g->set_offset(p.offset + s.dest_offset * es);
        g->set_rows(s.row_count);
        g->set_cols(s.col_count);
        g->set_row_stride_bytes(s.dest_row_stride * es);
        g->set_element_size(static_cast<int32_t>(es));
        g->set_salt(salt);
        g->set_first_index(static_cast<uint64_t>(s.dest_offset));
        g->set_group(static_cast<int32_t>(e));
        region_sources->push_back(s.source);
        receipt.set_bytes(receipt.bytes() + s.row_count * s.col_count * es);
        if (p.quant.has_value()) {
          WS_RETURN_IF_ERROR(AddScaleRegion(engine, p, s, static_cast<int>(e),
                                            req, &receipt, &scales_seen));
          region_sources->push_back(s.source);
        }
      }
      if (touched) receipt.set_parameters(receipt.parameters() + 1);
    }
  }
  return absl::OkStatus();
}

namespace {

std::vector<const EngineLayout*> EnginesOf(const CopyPlan& plan) {
  std::vector<const EngineLayout*> engines;
  for (const auto& e : plan.engines) engines.push_back(e.get());
  return engines;
}

}  // namespace

absl::StatusOr<v1::Receipt> GpuMapper::DeviceReceipt(
    const EngineLayout& engine, const absl::flat_hash_set<std::string>& sources,
    absl::Time deadline) {
  std::vector<v1::Receipt> out;
  worker::v1::ComputeReceiptsRequest req;
  std::vector<std::string> region_sources;
  WS_RETURN_IF_ERROR(
      ReceiptRegionsOf({&engine}, sources, {}, &req, &out, &region_sources));
  absl::StatusOr<std::vector<uint64_t>> sums =
      sup_->ComputeReceipts(req, deadline);
  if (!sums.ok()) return sums.status();
  out[0].set_checksum((*sums)[0]);
  return out[0];
}

absl::StatusOr<std::vector<v1::Receipt>> GpuDataPlane::DeviceReceipts(
    const CopyPlan& plan, const std::vector<bool>& skip, absl::Time deadline) {
  {
    // Computed by the worker as the update went (AddReceipts).
    absl::MutexLock lock(&mu_);
    if (inflight_receipts_ready_ && inflight_plan_ == &plan) {
      std::vector<v1::Receipt> out = inflight_receipts_;
      for (size_t e = 0; e < out.size(); ++e) {
        if (e < skip.size() && skip[e]) out[e] = v1::Receipt();
      }
      return out;
    }
  }
  // Not computed as the update went (a staged update): from the plan's
  // dense tensors, whose names are gathered only here.
  absl::flat_hash_set<std::string> sources = ReceiptSources(plan);
  std::vector<v1::Receipt> out;
  worker::v1::ComputeReceiptsRequest req;
  std::vector<std::string> region_sources;
  WS_RETURN_IF_ERROR(ReceiptRegionsOf(EnginesOf(plan), sources, skip, &req,
                                      &out, &region_sources));
  absl::StatusOr<std::vector<uint64_t>> sums =
      sup_->ComputeReceipts(req, deadline);
  if (!sums.ok()) return sums.status();
  for (size_t e = 0; e < out.size(); ++e) out[e].set_checksum((*sums)[e]);
  return out;
}

absl::Status GpuDataPlane::AddReceipts(
    const CopyPlan& plan, const v1::StartWeightUpdateRequest& request,
    worker::v1::BeginUpdateRequest* req) {
  // The sources receipts cover (the coordinator's: dense tensors), and the
  // last chunk that carries each.
  const absl::flat_hash_set<std::string> sources = ReceiptSources(plan);
  absl::flat_hash_map<std::string, int64_t> last_chunk;
  for (const Chunk& c : plan.chunks.chunks) {
    for (const Piece& piece : c.pieces) {
      last_chunk[plan.manifest[piece.tensor].name()] = c.index;
    }
  }
  std::vector<v1::Receipt> receipts;
  std::vector<std::string> region_sources;
  WS_RETURN_IF_ERROR(ReceiptRegionsOf(EnginesOf(plan), sources, {},
                                      req->mutable_receipts(), &receipts,
                                      &region_sources));
  // ipc with the whole update present: nothing arrives to overlap with, so
  // every region is summed in one launch after the last copy (one batch at
  // full occupancy, not a small launch after each of ~2000 chunks).
  const bool at_end =
      backend_ == v1::BACKEND_IPC && request.ipc_ring_slots() == 0;
  const int64_t last = static_cast<int64_t>(plan.chunks.chunks.size()) - 1;
  for (const std::string& source : region_sources) {
    auto it = last_chunk.find(source);
    // A tensor of no bytes rides in no chunk: after the first.
    req->add_receipt_after_chunk(at_end                   ? last
                                 : it == last_chunk.end() ? 0
                                                          : it->second);
  }
  absl::MutexLock lock(&mu_);
  inflight_receipts_ = std::move(receipts);
  return absl::OkStatus();
}

}  // namespace weightsync

#include "daemon/core/link_plan.h"

#include <algorithm>
#include <string>
#include <tuple>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace weightsync {

SegmentLayout SegmentBlock(const ParameterLayout& p, const SegmentLayout& s) {
  if (!p.implicit) return s;
  SegmentLayout b = s;
  SourceMatrix(p.shape, &b.row_count, &b.col_count);
  b.row_begin = b.col_begin = b.dest_offset = 0;
  b.dest_row_stride = b.col_count;
  return b;
}

namespace {

// `engine` as the link's stream sees it: every segment that uses tensor t
// becomes one segment per piece of t it intersects, whose source is that
// piece's pseudo tensor of the link manifest. Same regions, so CopyOps of
// the result write where the engine's own would.
std::shared_ptr<const EngineLayout> LinkView(const EngineLayout& engine,
                                             const TransferPlan& plan,
                                             const std::vector<int32_t>& link,
                                             const Manifest& link_manifest) {
  absl::flat_hash_map<std::string, std::vector<int>> by_tensor;
  for (size_t k = 0; k < link.size(); ++k) {
    by_tensor[plan.manifest.Get(plan.pieces[link[k]].tensor).name()].push_back(
        k);
  }
  auto view = std::make_shared<EngineLayout>();
  view->engine_id = engine.engine_id;
  view->regions = engine.regions;
  view->device_uuids = engine.device_uuids;
  view->total_bytes = engine.total_bytes;
  view->parameters.reserve(engine.parameters.size());
  for (const ParameterLayout& p : engine.parameters) {
    ParameterLayout q = p;
    q.implicit = false;
    q.segments.clear();
    for (const SegmentLayout& segment : p.segments) {
      const SegmentLayout s = SegmentBlock(p, segment);
      auto it = by_tensor.find(s.source);
      if (it == by_tensor.end()) continue;
      const int64_t stride =
          s.dest_row_stride == 0 ? s.col_count : s.dest_row_stride;
      for (int k : it->second) {
        const PlanPiece& piece = plan.pieces[link[k]];
        const int64_t r0 = std::max(s.row_begin, piece.row_begin);
        const int64_t r1 = std::min(s.row_begin + s.row_count,
                                    piece.row_begin + piece.row_count);
        const int64_t c0 = std::max(s.col_begin, piece.col_begin);
        const int64_t c1 = std::min(s.col_begin + s.col_count,
                                    piece.col_begin + piece.col_count);
        if (r1 <= r0 || c1 <= c0) continue;
        SegmentLayout seg;
        seg.source = link_manifest.Get(k).name();
        seg.row_begin = r0 - piece.row_begin;
        seg.row_count = r1 - r0;
        seg.col_begin = c0 - piece.col_begin;
        seg.col_count = c1 - c0;
        seg.dest_offset =
            s.dest_offset + (r0 - s.row_begin) * stride + (c0 - s.col_begin);
        seg.dest_row_stride = stride;
        q.segments.push_back(std::move(seg));
      }
    }
    view->parameters.push_back(std::move(q));
  }
  // The map's keys view the segments' strings: built once they are final.
  for (int32_t i = 0; i < static_cast<int32_t>(view->parameters.size()); ++i) {
    const auto& segments = view->parameters[i].segments;
    for (int32_t j = 0; j < static_cast<int32_t>(segments.size()); ++j) {
      view->uses_by_source[segments[j].source].push_back({i, j});
    }
  }
  return view;
}

// Appends link plan `l` to `out` (chunks renumbered, stream offsets moved
// past what `out` holds, aligned to the chunk size).
void Append(const CopyPlan& l, CopyPlan& out) {
  const int64_t base_tensor = out.manifest.size();
  const int64_t base_offset =
      (out.chunks.total_bytes + out.chunks.chunk_bytes - 1) /
      out.chunks.chunk_bytes * out.chunks.chunk_bytes;
  for (const v1::TensorSpec& t : l.manifest) *out.manifest.Add() = t;
  for (size_t t = 0; t < l.chunks.payload_bytes.size(); ++t) {
    out.chunks.tensor_offsets.push_back(base_offset +
                                        l.chunks.tensor_offsets[t]);
    out.chunks.payload_bytes.push_back(l.chunks.payload_bytes[t]);
  }
  for (const Chunk& c : l.chunks.chunks) {
    Chunk moved = c;
    moved.index = out.chunks.chunks.size();
    moved.offset += base_offset;
    for (Piece& p : moved.pieces) p.tensor += base_tensor;
    out.chunks.chunks.push_back(std::move(moved));
  }
  if (!l.chunks.chunks.empty()) {
    out.chunks.total_bytes = base_offset + l.chunks.total_bytes;
  }
  out.ops_by_chunk.insert(out.ops_by_chunk.end(), l.ops_by_chunk.begin(),
                          l.ops_by_chunk.end());
  out.sparse_pieces_by_chunk.resize(out.chunks.chunks.size());
  out.quant_by_chunk.resize(out.chunks.chunks.size());
}

}  // namespace

std::vector<RoundChunk> ChunksByRound(const LinkedCopyPlan& linked) {
  std::vector<RoundChunk> out;
  for (const LinkChunks& l : linked.links) {
    for (int64_t k = 0; k < l.num_chunks; ++k) {
      out.push_back({l.first_chunk + k, l.sender, l.receiver, k});
    }
  }
  std::sort(out.begin(), out.end(),
            [](const RoundChunk& a, const RoundChunk& b) {
              return std::tie(a.round, a.sender, a.receiver) <
                     std::tie(b.round, b.sender, b.receiver);
            });
  return out;
}

absl::StatusOr<LinkedCopyPlan> BuildLinkedCopyPlan(
    const TransferPlan& plan, const std::vector<int32_t>& receivers,
    int64_t chunk_bytes,
    const std::vector<std::shared_ptr<const EngineLayout>>& engines) {
  if (receivers.size() != 1) {
    return absl::FailedPreconditionError(absl::StrCat(
        "transfer plan '", plan.id, "': this daemon is ", receivers.size(),
        " receivers; the host data plane takes exactly one (a daemon of "
        "several GPU ranks maps its engines to ranks)"));
  }
  const int32_t receiver = receivers[0];
  if (receiver < 0 || receiver >= plan.num_receivers) {
    return absl::InvalidArgumentError(
        absl::StrCat("transfer plan '", plan.id, "' has ", plan.num_receivers,
                     " receivers; this daemon can't be receiver ", receiver));
  }
  // The whole manifest against the engines: names, shapes, dtypes; and
  // what the receipts sum and which engines the update rewrites whole.
  WS_ASSIGN_OR_RETURN(
      std::shared_ptr<const CopyPlan> whole,
      BuildCopyPlan(plan.manifest, chunk_bytes, engines, UnusedTensors::kSkip));
  if (!whole->quant.empty()) {
    const QuantTarget& q = whole->quant[0];
    return absl::FailedPreconditionError(absl::StrCat(
        "engine '", engines[q.engine]->engine_id, "' parameter '",
        engines[q.engine]->parameters[q.parameter].name,
        "' is an FP8 target: a transfer plan's pieces may cut its blocks, "
        "and updates of many senders don't quantise yet; send it through "
        "an ordinary update"));
  }
  auto out = std::make_shared<CopyPlan>();
  out->engines = whole->engines;
  out->unused = whole->unused;
  out->dense_uses = whole->dense_uses;
  out->covers_engine = whole->covers_engine;
  out->bytes_by_engine = whole->bytes_by_engine;
  out->chunks.chunk_bytes = chunk_bytes;
  std::vector<int64_t> written(engines.size(), 0);
  LinkedCopyPlan linked;
  for (int32_t s = 0; s < plan.num_senders; ++s) {
    const std::vector<int32_t>& link = plan.links[s][receiver];
    if (link.empty()) continue;
    const Manifest m = LinkManifest(plan, s, receiver);
    std::vector<std::shared_ptr<const EngineLayout>> views;
    for (const auto& e : engines) views.push_back(LinkView(*e, plan, link, m));
    WS_ASSIGN_OR_RETURN(
        std::shared_ptr<const CopyPlan> l,
        BuildCopyPlan(m, chunk_bytes, std::move(views), UnusedTensors::kSkip));
    for (size_t e = 0; e < engines.size(); ++e) {
      written[e] += l->bytes_by_engine[e];
    }
    LinkChunks lc;
    lc.sender = s;
    lc.receiver = receiver;
    lc.first_chunk = out->chunks.chunks.size();
    lc.num_chunks = l->chunks.chunks.size();
    lc.bytes = l->chunks.total_bytes;
    Append(*l, *out);
    linked.links.push_back(lc);
  }
  // The pieces of one receiver are disjoint, so the bytes they write add
  // up to the engine's only if they cover every element it uses.
  for (size_t e = 0; e < engines.size(); ++e) {
    if (written[e] != whole->bytes_by_engine[e]) {
      return absl::FailedPreconditionError(absl::StrCat(
          "transfer plan '", plan.id, "': receiver ", receiver,
          " needs less than engine '", engines[e]->engine_id, "' uses (",
          written[e], " of ", whole->bytes_by_engine[e],
          " bytes): the engine layouts changed since the plan was made; "
          "make it again from the engines' layouts"));
    }
  }
  linked.copy = std::move(out);
  return linked;
}

}  // namespace weightsync

#include "daemon/core/link_plan.h"

#include <algorithm>
#include <string>
#include <tuple>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/dtype.h"
#include "common/echo.h"
#include "common/status_macros.h"
#include "daemon/core/quant_layout.h"

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
std::shared_ptr<const EngineLayout> LinkView(
    const EngineLayout& engine, const TransferPlan& plan,
    const std::vector<int32_t>& link, const Manifest& link_manifest,
    const absl::flat_hash_set<std::string>& wired) {
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
      // An FP8 target takes its link pieces as QuantPieces of the whole
      // manifest's target (QuantLinks below), not as copies; but those of
      // a tensor sent quantised are copied as they are (EmitWireOps).
      if (p.quant.has_value() && !wired.contains(s.source)) continue;
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
  const int base_sparse = out.sparse.size();
  for (const SparsePatch& p : l.sparse) {
    out.sparse.push_back(p);
    out.sparse.back().tensor += base_tensor;
  }
  for (const auto& pieces : l.sparse_pieces_by_chunk) {
    std::vector<std::pair<int, Piece>> moved = pieces;
    for (auto& [patch, piece] : moved) {
      patch += base_sparse;
      piece.tensor += base_tensor;
    }
    out.sparse_pieces_by_chunk.push_back(std::move(moved));
  }
  out.sparse_pieces_by_chunk.resize(out.chunks.chunks.size());
  out.quant_by_chunk.resize(out.chunks.chunks.size());
}

// FP8 targets through a plan's links (docs/transfer_plan.md, "FP8
// targets"). The targets are the whole manifest's (one per engine segment,
// as for one stream); each link piece of a tensor that feeds one becomes
// QuantPieces of it in flat source elements: one per chunk piece where the
// plan piece spans its tensor's columns, else one per row. The data plane
// gathers every row of blocks from whichever links carry its elements and
// quantises it once whole, so a block cut between senders is quantised
// once, with one scale, as if one sender had sent it.
class QuantLinks {
 public:
  // `whole`: the copy plan of the plan's whole manifest (kSkip).
  QuantLinks(const TransferPlan& plan, const CopyPlan& whole)
      : plan_(plan),
        whole_(whole),
        by_tensor_(plan.manifest.size()),
        seen_(whole.quant.size()) {
    for (int32_t i = 0; i < static_cast<int32_t>(whole.quant.size()); ++i) {
      by_tensor_[whole.quant[i].tensor].push_back(i);
    }
  }

  // The quantised pieces of link chunk plan `l` (the link's plan pieces
  // `link`), whose chunks and tensors were appended to `out` from
  // `base_chunk` and `base_tensor` on.
  void Add(const std::vector<int32_t>& link, const CopyPlan& l,
           int64_t base_chunk, int64_t base_tensor, CopyPlan& out) {
    for (const Chunk& chunk : l.chunks.chunks) {
      for (const Piece& c : chunk.pieces) {
        const PlanPiece& piece = plan_.pieces[link[c.tensor]];
        if (by_tensor_[piece.tensor].empty()) continue;
        int64_t rows, cols;
        const v1::TensorSpec& spec = plan_.manifest.Get(piece.tensor);
        SourceMatrix(
            std::vector<int64_t>(spec.shape().begin(), spec.shape().end()),
            &rows, &cols);
        const int64_t es = ElementSize(spec.dtype());
        const int64_t e0 = c.tensor_offset / es, e1 = e0 + c.length / es;
        const int64_t w = piece.col_count;
        // Runs of the chunk piece in the tensor's flat elements.
        std::vector<std::pair<int64_t, int64_t>> runs;  // (first, n)
        if (w == cols) {
          runs.push_back({piece.row_begin * cols + e0, e1 - e0});
        } else {
          for (int64_t r = e0 / w; r * w < e1; ++r) {
            const int64_t a = std::max(e0, r * w),
                          z = std::min(e1, (r + 1) * w);
            runs.push_back(
                {(piece.row_begin + r) * cols + piece.col_begin + a - r * w,
                 z - a});
          }
        }
        for (int32_t target : by_tensor_[piece.tensor]) {
          int64_t at = c.chunk_offset;
          for (const auto& [first, n] : runs) {
            if (Note(target, link[c.tensor], first, first + n)) {
              out.quant_by_chunk[base_chunk + chunk.index].push_back(
                  {target, static_cast<int32_t>(base_tensor + c.tensor), first,
                   first + n, at, c.tensor_offset + (at - c.chunk_offset)});
            }
            at += n * es;
          }
        }
      }
    }
  }

  // Every target's elements must have arrived exactly (else the engine
  // layouts changed since the plan was made); sets out.quant, each marked
  // gathered unless one plan piece carries all of it, and the float32 bytes
  // of rows of blocks that may be open at once: those one piece fills
  // (its elements come in order) are open only while it streams by (each
  // of `links` links at one place: `whole.quant_band_bytes` at most); one
  // that several pieces fill may wait for the last of them.
  absl::Status Finish(int32_t receiver, int64_t links, CopyPlan& out) {
    out.quant = whole_.quant;
    int64_t waiting = 0;
    for (size_t i = 0; i < out.quant.size(); ++i) {
      QuantTarget& t = out.quant[i];
      const EngineLayout& engine = *whole_.engines[t.engine];
      const ParameterLayout& p = engine.parameters[t.parameter];
      const SegmentLayout& s = p.segments[t.segment];
      const Seen& seen = seen_[i];
      if (seen.elements != s.row_count * s.col_count) {
        return absl::FailedPreconditionError(absl::StrCat(
            "transfer plan '", plan_.id, "': receiver ", receiver, " gets ",
            seen.elements, " of the ", s.row_count * s.col_count,
            " elements FP8 target '", p.name, "' of engine '", engine.engine_id,
            "' takes: the engine layouts changed since the plan was made; "
            "make it again from the engines' layouts"));
      }
      const int64_t br = p.quant->block_rows;
      int32_t only = -1;  // the one piece of every band, while there is one
      t.gathered = false;
      for (const auto& [band, use] : seen.bands) {
        if (only == -1) only = use.piece;
        t.gathered = t.gathered || use.shared || use.piece != only;
        if (!use.shared) continue;
        const int64_t rows = std::min(t.rect.r1, (band + 1) * br) -
                             std::max(t.rect.r0, band * br);
        waiting += rows * (t.rect.c1 - t.rect.c0) * 4;
      }
    }
    out.quant_band_bytes = links * whole_.quant_band_bytes + waiting;
    return absl::OkStatus();
  }

  // Per manifest tensor, the targets it feeds.
  const std::vector<std::vector<int32_t>>& targets_by_tensor() const {
    return by_tensor_;
  }

 private:
  struct BandUse {
    int32_t piece = -1;   // the first plan piece writing it
    bool shared = false;  // and another one too
  };
  struct Seen {
    int64_t elements = 0;
    absl::flat_hash_map<int64_t, BandUse> bands;
  };

  // Counts flat source elements [begin, end) of plan piece `piece` into
  // target `target`; false where none of them is the target's.
  bool Note(int32_t target, int32_t piece, int64_t begin, int64_t end) {
    const QuantTarget& t = whole_.quant[target];
    const ParameterLayout& p =
        whole_.engines[t.engine]->parameters[t.parameter];
    const SegmentLayout& s = p.segments[t.segment];
    const int64_t cols = t.src_cols;
    const int64_t r_lo = std::max(s.row_begin, begin / cols);
    const int64_t r_hi =
        std::min(s.row_begin + s.row_count - 1, (end - 1) / cols);
    Seen& seen = seen_[target];
    bool any = false;
    for (int64_t r = r_lo; r <= r_hi; ++r) {
      const int64_t a = std::max(r * cols + s.col_begin, begin);
      const int64_t z = std::min(r * cols + s.col_begin + s.col_count, end);
      if (z <= a) continue;
      any = true;
      seen.elements += z - a;
      const int64_t dest = s.dest_offset +
                           (r - s.row_begin) * s.dest_row_stride +
                           (a - r * cols - s.col_begin);
      const int64_t br = p.quant->block_rows;
      const int64_t b0 = dest / p.quant->cols / br;
      const int64_t b1 = (dest + (z - a) - 1) / p.quant->cols / br;
      for (int64_t b = b0; b <= b1; ++b) {
        BandUse& use = seen.bands[b];
        if (use.piece == -1) use.piece = piece;
        use.shared = use.shared || use.piece != piece;
      }
    }
    return any;
  }

  const TransferPlan& plan_;
  const CopyPlan& whole_;
  std::vector<std::vector<int32_t>> by_tensor_;  // targets of each tensor
  std::vector<Seen> seen_;                       // per target
};

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

namespace {

// `patches` by sender, then piece: checked against the plan's links to
// `receiver` and `quant` (a patch can't go into an FP8 target).
absl::StatusOr<std::vector<absl::flat_hash_map<int32_t, LinkPatch>>>
PatchesBySender(const TransferPlan& plan, int32_t receiver,
                const std::vector<LinkPatch>& patches,
                const std::vector<std::vector<int32_t>>& fp8_targets_of,
                const CopyPlan& whole) {
  std::vector<absl::flat_hash_map<int32_t, LinkPatch>> out(plan.num_senders);
  for (const LinkPatch& p : patches) {
    const std::string entry = absl::StrCat(
        "transfer plan '", plan.id, "': the sparse patch of sender ", p.sender,
        "'s piece ", p.piece, " to receiver ", receiver);
    if (p.sender < 0 || p.sender >= plan.num_senders || p.piece < 0 ||
        p.piece >=
            static_cast<int64_t>(plan.links[p.sender][receiver].size())) {
      return absl::InvalidArgumentError(
          absl::StrCat(entry, " names no piece of the plan"));
    }
    const PlanPiece& piece =
        plan.pieces[plan.links[p.sender][receiver][p.piece]];
    const int64_t numel = piece.row_count * piece.col_count;
    const v1::TensorSpec& t = plan.manifest.Get(piece.tensor);
    if (p.nnz < 1 || p.nnz > numel ||
        (p.index_bytes != 4 && p.index_bytes != 8) ||
        (p.index_bytes == 4 && numel > (int64_t{1} << 32))) {
      return absl::InvalidArgumentError(absl::StrCat(
          entry, " (tensor '", t.name(), "', ", numel, " elements) has nnz ",
          p.nnz, " and ", p.index_bytes,
          "-byte indices: nnz must be 1 to the piece's elements, indices 4 "
          "(up to 2^32 elements) or 8 bytes"));
    }
    if (!fp8_targets_of[piece.tensor].empty()) {
      const QuantTarget& q = whole.quant[fp8_targets_of[piece.tensor][0]];
      return absl::FailedPreconditionError(absl::StrCat(
          entry, ": tensor '", t.name(), "' feeds FP8 target '",
          whole.engines[q.engine]->parameters[q.parameter].name,
          "' of engine '", whole.engines[q.engine]->engine_id,
          "', whose blocks' scales a patch would leave stale; send it dense"));
    }
    if (!out[p.sender].emplace(p.piece, p).second) {
      return absl::InvalidArgumentError(absl::StrCat(entry, " is named twice"));
    }
  }
  return out;
}

// `wire` by manifest index, checked: each names a float tensor of the plan
// once, and every piece of it (any sender's, to any receiver) lies on
// whole blocks of the tensor, so its blocks are the tensor's.
absl::StatusOr<absl::flat_hash_map<int32_t, const v1::Quantization*>>
WireByTensor(const TransferPlan& plan, const std::vector<WireTensor>& wire) {
  absl::flat_hash_map<std::string, int32_t> index;
  for (int32_t i = 0; i < plan.manifest.size(); ++i) {
    index.emplace(plan.manifest.Get(i).name(), i);
  }
  absl::flat_hash_map<int32_t, const v1::Quantization*> out;
  for (const WireTensor& w : wire) {
    const std::string entry = absl::StrCat(
        "transfer plan '", plan.id, "': plan_wire tensor '", w.tensor, "'");
    auto it = index.find(w.tensor);
    if (it == index.end()) {
      return absl::InvalidArgumentError(
          absl::StrCat(entry, " is not in the plan's manifest"));
    }
    if (!IsConvertibleFloat(plan.manifest.Get(it->second).dtype())) {
      return absl::InvalidArgumentError(absl::StrCat(
          entry, " is ", DTypeName(plan.manifest.Get(it->second).dtype()),
          ": only float32, bfloat16 and float16 tensors are quantised"));
    }
    if (!out.emplace(it->second, &w.quantization).second) {
      return absl::InvalidArgumentError(absl::StrCat(entry, " is named twice"));
    }
  }
  for (const PlanPiece& p : plan.pieces) {
    auto it = out.find(p.tensor);
    if (it == out.end()) continue;
    const v1::TensorSpec& t = plan.manifest.Get(p.tensor);
    int64_t rows, cols;
    SourceMatrix(std::vector<int64_t>(t.shape().begin(), t.shape().end()),
                 &rows, &cols);
    const v1::Quantization& q = *it->second;
    const bool per_row = q.scheme() == v1::QUANT_SCHEME_PER_ROW;
    const int64_t br =
        per_row ? 1 : (q.block_rows() > 0 ? q.block_rows() : 128);
    const int64_t bc =
        per_row ? cols : (q.block_cols() > 0 ? q.block_cols() : 128);
    auto on_grid = [](int64_t begin, int64_t count, int64_t block,
                      int64_t end) {
      return begin % block == 0 &&
             ((begin + count) % block == 0 || begin + count == end);
    };
    if (!on_grid(p.row_begin, p.row_count, br, rows) ||
        !on_grid(p.col_begin, p.col_count, bc, cols)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "transfer plan '", plan.id, "': tensor '", t.name(),
          "' is sent quantised (plan_wire), but sender ", p.sender,
          "'s piece rows ", HalfOpen(p.row_begin, p.row_count), " x cols ",
          HalfOpen(p.col_begin, p.col_count), " cuts its ", br, " x ", bc,
          " blocks; send that tensor unquantised"));
    }
  }
  return out;
}

}  // namespace

absl::StatusOr<LinkedCopyPlan> BuildLinkedCopyPlan(
    const TransferPlan& plan, const std::vector<int32_t>& receivers,
    int64_t chunk_bytes,
    const std::vector<std::shared_ptr<const EngineLayout>>& engines,
    const std::vector<LinkPatch>& patches,
    const std::vector<WireTensor>& wire) {
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
  // FP8 on the wire: the tensors sent quantised, in the whole manifest as
  // in their links' pseudo tensors.
  WS_ASSIGN_OR_RETURN(const auto wired, WireByTensor(plan, wire));
  Manifest manifest = plan.manifest;
  absl::flat_hash_set<std::string> wired_names;
  auto quantised = [&wired](int32_t tensor, v1::TensorSpec* t) {
    auto it = wired.find(tensor);
    if (it == wired.end()) return;
    t->set_dtype(it->second->format());
    *t->mutable_quantization() = *it->second;
  };
  for (const auto& [i, q] : wired) {
    quantised(i, manifest.Mutable(i));
    wired_names.insert(manifest.Get(i).name());
  }
  // The whole manifest against the engines: names, shapes, dtypes; and
  // what the receipts sum and which engines the update rewrites whole.
  WS_ASSIGN_OR_RETURN(
      std::shared_ptr<const CopyPlan> whole,
      BuildCopyPlan(manifest, chunk_bytes, engines, UnusedTensors::kSkip));
  auto out = std::make_shared<CopyPlan>();
  out->engines = whole->engines;
  out->unused = whole->unused;
  out->dense_uses = whole->dense_uses;
  out->covers_engine = whole->covers_engine;
  out->bytes_by_engine = whole->bytes_by_engine;
  out->chunks.chunk_bytes = chunk_bytes;
  // What the links' copies must write: all but the FP8 targets' bytes,
  // which QuantLinks counts.
  std::vector<int64_t> written(engines.size(), 0);
  std::vector<int64_t> copied = whole->bytes_by_engine;
  for (const QuantTarget& t : whole->quant) {
    const ParameterLayout& p = engines[t.engine]->parameters[t.parameter];
    const SegmentLayout& s = p.segments[t.segment];
    const ScaleBlocks b = ScaleBlocksOf(*p.quant, s);
    copied[t.engine] -= s.row_count * s.col_count * ElementSize(p.dtype) +
                        (b.i1 - b.i0) * (b.j1 - b.j0) * 4;
  }
  QuantLinks quant(plan, *whole);
  WS_ASSIGN_OR_RETURN(const auto patched,
                      PatchesBySender(plan, receiver, patches,
                                      quant.targets_by_tensor(), *whole));
  LinkedCopyPlan linked;
  for (int32_t s = 0; s < plan.num_senders; ++s) {
    const std::vector<int32_t>& link = plan.links[s][receiver];
    if (link.empty()) continue;
    Manifest m = LinkManifest(plan, s, receiver);
    for (size_t k = 0; k < link.size(); ++k) {
      quantised(plan.pieces[link[k]].tensor, m.Mutable(k));
    }
    std::vector<std::shared_ptr<const EngineLayout>> views;
    for (const auto& e : engines) {
      views.push_back(LinkView(*e, plan, link, m, wired_names));
    }
    WS_ASSIGN_OR_RETURN(
        std::shared_ptr<const CopyPlan> l,
        BuildCopyPlan(m, chunk_bytes, views, UnusedTensors::kSkip));
    // What the link's pieces write, counted dense (a patch writes some of
    // its piece's elements: coverage is the plan's, not the patch's).
    for (size_t e = 0; e < engines.size(); ++e) {
      written[e] += l->bytes_by_engine[e];
    }
    if (!patched[s].empty()) {
      for (const auto& [k, p] : patched[s]) {
        m.Mutable(k)->set_sparse_nnz(p.nnz);
        m.Mutable(k)->set_sparse_index_bytes(p.index_bytes);
      }
      WS_ASSIGN_OR_RETURN(l, BuildCopyPlan(m, chunk_bytes, std::move(views),
                                           UnusedTensors::kSkip));
    }
    LinkChunks lc;
    lc.sender = s;
    lc.receiver = receiver;
    lc.first_chunk = out->chunks.chunks.size();
    lc.num_chunks = l->chunks.chunks.size();
    lc.bytes = l->chunks.total_bytes;
    const int64_t base_tensor = out->manifest.size();
    Append(*l, *out);
    quant.Add(link, *l, lc.first_chunk, base_tensor, *out);
    linked.links.push_back(lc);
  }
  // The pieces of one receiver are disjoint, so the bytes they write add
  // up to the engine's only if they cover every element it uses.
  for (size_t e = 0; e < engines.size(); ++e) {
    if (written[e] != copied[e]) {
      return absl::FailedPreconditionError(absl::StrCat(
          "transfer plan '", plan.id, "': receiver ", receiver,
          " needs less than engine '", engines[e]->engine_id, "' uses (",
          written[e], " of ", copied[e],
          " bytes): the engine layouts changed since the plan was made; "
          "make it again from the engines' layouts"));
    }
  }
  if (!whole->quant.empty()) {
    WS_RETURN_IF_ERROR(quant.Finish(receiver, linked.links.size(), *out));
  }
  if (!patches.empty()) out->covers_engine.assign(engines.size(), false);
  linked.copy = std::move(out);
  return linked;
}

}  // namespace weightsync

#include "backends/cuda/p2p_rounds.h"

#include <algorithm>
#include <climits>
#include <tuple>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "common/dtype.h"
#include "common/status_macros.h"

namespace weightsync {

absl::StatusOr<P2pSchedule> PlanP2pRounds(
    const worker::v1::BeginUpdateRequest& request, int world, int rank,
    const std::function<bool(int64_t)>& on_my_gpu) {
  const int64_t n = request.chunk_sizes_size();
  if (request.chunk_peers_size() != n) {
    return absl::InvalidArgumentError(
        absl::StrCat("chunk_peers has ", request.chunk_peers_size(),
                     " entries for ", n, " chunks"));
  }
  if (request.chunk_rounds_size() != 0 && request.chunk_rounds_size() != n) {
    return absl::InvalidArgumentError(
        absl::StrCat("chunk_rounds has ", request.chunk_rounds_size(),
                     " entries for ", n, " chunks (0 or one per chunk)"));
  }
  if (request.staged() || !request.ipc_source_handle().empty() ||
      request.ipc_registered_source()) {
    return absl::InvalidArgumentError(
        "M->N receives (chunk_peers) stream: not staged, not IPC");
  }
  if (request.staging_buffers() < 2) {
    return absl::InvalidArgumentError("at least 2 staging buffers");
  }
  P2pSchedule out;
  out.direct.assign(n, false);
  out.direct_op.assign(n, -1);
  // Chunks that carry work besides their ops: never direct. (Receipts
  // summed after a chunk are not such work: the worker sums them once the
  // chunk's round has arrived, received in place or staged.)
  absl::flat_hash_set<int64_t> busy;
  for (const auto& p : request.sparse_pieces()) busy.insert(p.chunk());
  for (const auto& q : request.quant_steps()) busy.insert(q.chunk());
  std::vector<int> ops_of(n, 0), first_op(n, -1);
  for (int i = 0; i < request.ops_size(); ++i) {
    const int64_t k = request.ops(i).chunk();
    if (k < 0 || k >= n) {
      return absl::InvalidArgumentError(
          absl::StrCat("op ", i, " names chunk ", k, " of ", n));
    }
    if (++ops_of[k] == 1) first_op[k] = i;
  }
  for (int64_t k = 0; k < n; ++k) {
    const int peer = request.chunk_peers(k);
    if (peer < 0 || peer >= world || peer == rank) {
      return absl::InvalidArgumentError(
          absl::StrCat("chunk ", k, " comes from rank ", peer,
                       ": not a peer of rank ", rank, " of ", world));
    }
    if (request.chunk_sizes(k) <= 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("chunk ", k, " has ", request.chunk_sizes(k), " bytes"));
    }
    if (ops_of[k] != 1 || busy.contains(k)) continue;
    const worker::v1::GpuOp& o = request.ops(first_op[k]);
    const int64_t es = v1::DType_IsValid(o.src_dtype())
                           ? ElementSize(static_cast<v1::DType>(o.src_dtype()))
                           : 0;
    const int64_t width = o.cols() * es;
    const bool one_row = o.rows() == 1;
    if (es == 0 || o.src_dtype() != o.dst_dtype() || o.src_offset() != 0 ||
        o.src_allocation_id() != 0 ||
        width * o.rows() != request.chunk_sizes(k) ||
        (!one_row && (o.src_stride() != width || o.dst_stride() != width)) ||
        !on_my_gpu(o.allocation_id())) {
      continue;
    }
    out.direct[k] = true;
    out.direct_op[k] = first_op[k];
    out.direct_bytes += request.chunk_sizes(k);
  }
  const int64_t cap = request.staging_buffers() / 2;
  for (int64_t k = 0; k < n;) {
    P2pRound r{k, k + 1};
    const int32_t id =
        request.chunk_rounds_size() ? request.chunk_rounds(k) : 0;
    if (request.chunk_rounds_size()) {
      while (r.end < n && request.chunk_rounds(r.end) == id) ++r.end;
      if (r.end < n && request.chunk_rounds(r.end) < id) {
        return absl::InvalidArgumentError(
            absl::StrCat("chunk_rounds decrease at chunk ", r.end));
      }
    }
    absl::flat_hash_set<int> peers;
    int64_t staged = 0;
    for (int64_t j = r.first; j < r.end; ++j) {
      if (!peers.insert(request.chunk_peers(j)).second) {
        return absl::InvalidArgumentError(
            absl::StrCat("round ", id, " has two chunks from rank ",
                         request.chunk_peers(j), " (chunk ", j, ")"));
      }
      if (!out.direct[j]) ++staged;
    }
    if (staged > cap) {
      return absl::InvalidArgumentError(absl::StrCat(
          "round ", id, " stages ", staged, " chunks; ",
          request.staging_buffers(), " staging buffers take ", cap,
          " a round (the next round's receive overlaps this one's scatter)"));
    }
    out.staged_chunks += staged;
    out.rounds.push_back(r);
    k = r.end;
  }
  return out;
}

int64_t MaxChunksPerRound(const std::vector<int64_t>& round) {
  std::vector<int64_t> sorted = round;
  std::sort(sorted.begin(), sorted.end());
  int64_t best = 0;
  for (size_t i = 0; i < sorted.size();) {
    size_t j = i;
    while (j < sorted.size() && sorted[j] == sorted[i]) ++j;
    best = std::max<int64_t>(best, j - i);
    i = j;
  }
  return best;
}

namespace {

// Bytes [begin, end) of an allocation.
struct Span {
  int64_t begin = 0;
  int64_t end = 0;
};

// The bytes a strided 2-D block covers, first byte to last (the rows' gaps
// included: a superset, which only ever places a receipt later).
Span BlockSpan(int64_t offset, int64_t rows, int64_t stride, int64_t width) {
  if (rows <= 0 || width <= 0) return {offset, offset};
  return {offset, offset + (rows - 1) * stride + width};
}

int64_t ElementBytes(int32_t dtype) {
  // An unknown dtype: the widest, so the span can only grow.
  return v1::DType_IsValid(dtype) ? ElementSize(static_cast<v1::DType>(dtype))
                                  : 8;
}

}  // namespace

absl::Status PlaceReceipts(worker::v1::BeginUpdateRequest* req) {
  const int64_t n = req->chunk_sizes_size();
  const auto& regions = req->receipts().regions();
  if (req->receipt_after_chunk_size() != regions.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        regions.size(), " receipt regions but ",
        req->receipt_after_chunk_size(), " receipt_after_chunk entries"));
  }
  // Per allocation: its regions sorted by first byte, with the running
  // maximum of their last bytes (regions may overlap).
  struct Sorted {
    std::vector<std::pair<Span, int>> spans;  // (span, region index)
    std::vector<int64_t> max_end;
  };
  absl::flat_hash_map<int64_t, Sorted> by_alloc;
  for (int i = 0; i < regions.size(); ++i) {
    const worker::v1::ReceiptRegionSpec& r = regions[i];
    by_alloc[r.allocation_id()].spans.push_back(
        {BlockSpan(r.offset(), r.rows(), r.row_stride_bytes(),
                   r.cols() * r.element_size()),
         i});
  }
  for (auto& [id, sorted] : by_alloc) {
    std::sort(sorted.spans.begin(), sorted.spans.end(),
              [](const auto& a, const auto& b) {
                return a.first.begin < b.first.begin;
              });
    int64_t m = INT64_MIN;
    for (const auto& [span, i] : sorted.spans) {
      m = std::max(m, span.end);
      sorted.max_end.push_back(m);
    }
  }
  // A region is summed after the last chunk whose ops write into it; one
  // that no op writes (a tensor of no bytes) after the first.
  std::vector<int64_t> after(regions.size(), 0);
  for (const worker::v1::GpuOp& o : req->ops()) {
    auto it = by_alloc.find(o.allocation_id());
    if (it == by_alloc.end()) continue;
    const Span w = BlockSpan(o.dst_offset(), o.rows(), o.dst_stride(),
                             o.cols() * ElementBytes(o.dst_dtype()));
    if (w.end <= w.begin) continue;
    const Sorted& sorted = it->second;
    // Regions starting before the op's end, walked back while some region
    // at or before them still reaches past the op's start.
    int64_t j =
        std::lower_bound(
            sorted.spans.begin(), sorted.spans.end(), w.end,
            [](const auto& a, int64_t v) { return a.first.begin < v; }) -
        sorted.spans.begin() - 1;
    for (; j >= 0 && sorted.max_end[j] > w.begin; --j) {
      const auto& [span, i] = sorted.spans[j];
      if (span.end > w.begin && span.begin < span.end) {
        after[i] = std::max(after[i], o.chunk());
      }
    }
  }
  for (int i = 0; i < regions.size(); ++i) {
    req->set_receipt_after_chunk(i, n == 0 ? -1 : after[i]);
  }
  return absl::OkStatus();
}

absl::Status OrderChunksByRound(const std::vector<int32_t>& sender,
                                const std::vector<int64_t>& round,
                                worker::v1::BeginUpdateRequest* req) {
  const int64_t n = req->chunk_sizes_size();
  if (static_cast<int64_t>(sender.size()) != n ||
      static_cast<int64_t>(round.size()) != n) {
    return absl::InvalidArgumentError(
        absl::StrCat("chunk sources for ", sender.size(), " / ", round.size(),
                     " chunks; the update has ", n));
  }
  if (req->staged() || req->sparse_size() > 0 || req->quant_steps_size() > 0 ||
      req->reuse_ops()) {
    return absl::UnimplementedError(
        "M->N updates stream dense copies: not staged, no sparse patches, no "
        "FP8 targets, no held ops");
  }
  std::vector<int64_t> order(n);
  for (int64_t k = 0; k < n; ++k) {
    if (sender[k] < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("chunk ", k, " has no sender"));
    }
    order[k] = k;
  }
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    return std::tie(round[a], sender[a]) < std::tie(round[b], sender[b]);
  });
  std::vector<int64_t> place(n);
  for (int64_t i = 0; i < n; ++i) place[order[i]] = i;
  worker::v1::BeginUpdateRequest out = *req;
  out.clear_chunk_sizes();
  out.clear_chunk_peers();
  out.clear_chunk_rounds();
  out.clear_ops();
  for (int64_t i = 0; i < n; ++i) {
    out.add_chunk_sizes(req->chunk_sizes(order[i]));
    out.add_chunk_peers(sender[order[i]]);
    out.add_chunk_rounds(static_cast<int32_t>(round[order[i]]));
  }
  // Ops by their new chunk, in their old order within it.
  std::vector<std::vector<int>> by_chunk(n);
  for (int i = 0; i < req->ops_size(); ++i) {
    const int64_t k = req->ops(i).chunk();
    if (k < 0 || k >= n) {
      return absl::InvalidArgumentError(
          absl::StrCat("op ", i, " names chunk ", k, " of ", n));
    }
    by_chunk[place[k]].push_back(i);
  }
  for (int64_t c = 0; c < n; ++c) {
    for (int i : by_chunk[c]) {
      worker::v1::GpuOp* o = out.add_ops();
      *o = req->ops(i);
      o->set_chunk(c);
    }
  }
  WS_RETURN_IF_ERROR(PlaceReceipts(&out));
  out.set_staging_buffers(
      std::max<int64_t>(req->staging_buffers(), 2 * MaxChunksPerRound(round)));
  *req = std::move(out);
  return absl::OkStatus();
}

}  // namespace weightsync

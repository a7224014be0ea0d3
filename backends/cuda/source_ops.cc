#include "backends/cuda/source_ops.h"

#include <algorithm>
#include <tuple>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "common/dtype.h"

namespace weightsync {

void MergeContiguousOps(worker::v1::BeginUpdateRequest* req) {
  // A tensor the chunk planner cut at chunk boundaries arrives as one copy
  // per chunk; where the whole source is there at once (ipc, no ring), the
  // pieces that continue one another (the same allocations, dtypes, and
  // source and destination bytes that follow on) become one copy: one
  // copy-engine transfer per tensor instead of one per chunk (at 8 MiB
  // chunks, ~2000 copies of ~8 us each for 16 GB, twice the copy itself).
  // The merged copy keeps its first chunk: it runs earlier, never later, so
  // receipts enqueued after a chunk still follow every copy they read.
  using Key = std::tuple<int64_t, int64_t, int64_t, int64_t, int32_t, int32_t>;
  absl::flat_hash_map<Key, int> next;  // where a copy ends -> its index
  auto* ops = req->mutable_ops();
  int out = 0;
  for (int i = 0; i < ops->size(); ++i) {
    worker::v1::GpuOp o = ops->Get(i);
    const int64_t ss = ElementSize(static_cast<v1::DType>(o.src_dtype()));
    const int64_t ds = ElementSize(static_cast<v1::DType>(o.dst_dtype()));
    const bool flat = o.rows() == 1 || (o.src_stride() == o.cols() * ss &&
                                        o.dst_stride() == o.cols() * ds);
    if (flat) {
      o.set_cols(o.rows() * o.cols());
      o.set_rows(1);
      o.set_src_stride(o.cols() * ss);
      o.set_dst_stride(o.cols() * ds);
    }
    // Source bytes in the whole update (packed buffer) or in the source
    // allocation (a registered source).
    const int64_t src_at =
        o.src_allocation_id() != 0
            ? o.src_offset()
            : o.chunk() * req->chunk_bytes() + o.src_offset();
    const Key here{o.allocation_id(),     o.dst_offset(),
                   o.src_allocation_id(), src_at,
                   o.src_dtype(),         o.dst_dtype()};
    auto it = flat ? next.find(here) : next.end();
    if (it != next.end()) {
      worker::v1::GpuOp& m = ops->at(it->second);
      m.set_cols(m.cols() + o.cols());
      m.set_src_stride(m.cols() * ss);
      m.set_dst_stride(m.cols() * ds);
      const int at = it->second;
      next.erase(it);
      next[Key{o.allocation_id(), o.dst_offset() + o.cols() * ds,
               o.src_allocation_id(), src_at + o.cols() * ss, o.src_dtype(),
               o.dst_dtype()}] = at;
      continue;
    }
    if (flat) {
      next[Key{o.allocation_id(), o.dst_offset() + o.cols() * ds,
               o.src_allocation_id(), src_at + o.cols() * ss, o.src_dtype(),
               o.dst_dtype()}] = out;
    }
    *ops->Mutable(out++) = std::move(o);
  }
  ops->DeleteSubrange(out, ops->size() - out);
}

absl::Status SplitSourceOp(const ChunkPlan& chunks, const Source& source,
                           const std::vector<int64_t>& region_ids, int64_t k,
                           worker::v1::GpuOp g,
                           worker::v1::BeginUpdateRequest* req) {
  return SplitSourceOp(chunks, source, region_ids, k, std::move(g),
                       [req]() { return req->add_ops(); });
}

absl::Status SplitSourceOp(const ChunkPlan& chunks, const Source& source,
                           const std::vector<int64_t>& region_ids, int64_t k,
                           worker::v1::GpuOp g,
                           const std::function<worker::v1::GpuOp*()>& add) {
  // The op reads bytes of the packed stream; a registered source has no
  // packed stream, so each byte is read where its tensor lives. The copy
  // plan joins ops that are contiguous in the stream and in the engine,
  // across tensors: such an op is cut back into one op per tensor here
  // (MergeContiguousOps joins again what is contiguous in the trainer's
  // memory too).
  const std::vector<int64_t>& starts = chunks.tensor_offsets;
  const int64_t ss = ElementSize(static_cast<v1::DType>(g.src_dtype()));
  const int64_t ds = ElementSize(static_cast<v1::DType>(g.dst_dtype()));
  const bool flat = g.rows() == 1 || (g.src_stride() == g.cols() * ss &&
                                      g.dst_stride() == g.cols() * ds);
  int64_t packed = k * chunks.chunk_bytes + g.src_offset();
  int64_t dst = g.dst_offset();
  int64_t left = flat ? g.rows() * g.cols() : 1;
  const int64_t extent =
      flat ? 0 : (g.rows() - 1) * g.src_stride() + g.cols() * ss;
  while (left > 0) {
    const int64_t t = std::upper_bound(starts.begin(), starts.end(), packed) -
                      starts.begin() - 1;
    const int64_t end = t < 0 ? 0 : starts[t] + chunks.payload_bytes[t];
    if (t < 0 || packed >= end || (!flat && packed + extent > end)) {
      return absl::InternalError(absl::StrCat(
          "a copy of chunk ", k, " reads packed bytes at ", packed,
          " that no tensor of the registered source '", source.id, "' holds"));
    }
    const Source::Placement& p = source.placements[t];
    worker::v1::GpuOp* out = add();
    *out = g;
    out->set_src_allocation_id(region_ids[p.region]);
    out->set_src_offset(p.offset + packed - starts[t]);
    if (!flat) break;  // a strided block lies inside one tensor
    const int64_t n = std::min(left, (end - packed) / ss);
    out->set_rows(1);
    out->set_cols(n);
    out->set_src_stride(n * ss);
    out->set_dst_stride(n * ds);
    out->set_dst_offset(dst);
    packed += n * ss;
    dst += n * ds;
    left -= n;
  }
  return absl::OkStatus();
}

}  // namespace weightsync

#include "common/chunk_planner.h"

#include <algorithm>
#include <string>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/dtype.h"

namespace weightsync {

absl::StatusOr<int> SparseIndexBytes(const v1::TensorSpec& tensor,
                                     int64_t numel) {
  switch (tensor.sparse_index_bytes()) {
    case 0:
    case 8:
      return 8;
    case 4:
      if (numel > (int64_t{1} << 32)) {
        return absl::InvalidArgumentError(
            absl::StrCat("tensor '", tensor.name(),
                         "': sparse_index_bytes 4 holds indices "
                         "of at most 2^32 elements; it has ",
                         numel));
      }
      return 4;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("tensor '", tensor.name(), "': sparse_index_bytes ",
                       tensor.sparse_index_bytes(), " is not 0, 4 or 8"));
  }
}

absl::StatusOr<WireQuant> ResolveWireQuant(const v1::TensorSpec& tensor) {
  const v1::Quantization& q = tensor.quantization();
  auto bad = [&tensor](const std::string& why) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tensor '", tensor.name(), "' (quantised on the wire): ", why));
  };
  const bool fp8 =
      tensor.dtype() == v1::FLOAT8_E4M3FN || tensor.dtype() == v1::FLOAT8_E5M2;
  if (!fp8 || q.format() != tensor.dtype()) {
    return bad(absl::StrCat("dtype ", DTypeName(tensor.dtype()),
                            " and quantization.format ", DTypeName(q.format()),
                            " must be one FP8 format, float8_e4m3fn or "
                            "float8_e5m2"));
  }
  if (!q.scale_parameter().empty()) {
    return bad(
        "quantization.scale_parameter names an engine's parameter; a "
        "manifest tensor's scales travel in its payload: leave it empty");
  }
  if (!v1::QuantScheme_IsValid(q.scheme()) ||
      !v1::ScaleForm_IsValid(q.scale_form())) {
    return bad(absl::StrCat("quantization.scheme ", q.scheme(),
                            " or scale_form ", q.scale_form(),
                            " is not a value this daemon knows"));
  }
  constexpr int64_t kMaxBlockSide = int64_t{1} << 24;
  if (q.block_rows() < 0 || q.block_cols() < 0 ||
      q.block_rows() > kMaxBlockSide || q.block_cols() > kMaxBlockSide) {
    return bad(absl::StrCat("block ", q.block_rows(), " x ", q.block_cols(),
                            " must be 0 (128) or 1 to ", kMaxBlockSide));
  }
  WireQuant w;
  w.per_row = q.scheme() == v1::QUANT_SCHEME_PER_ROW;
  if (w.per_row && (q.block_rows() != 0 || q.block_cols() != 0)) {
    return bad(
        "block_rows and block_cols are for QUANT_SCHEME_BLOCK; leave them 0 "
        "with QUANT_SCHEME_PER_ROW");
  }
  if (tensor.sparse_nnz() != 0) {
    return bad("a sparse patch can't be quantised; send it in its dtype");
  }
  const std::vector<int64_t> shape(tensor.shape().begin(),
                                   tensor.shape().end());
  absl::StatusOr<int64_t> numel = NumElements(
      shape, tensor.dtype(), absl::StrCat("tensor '", tensor.name(), "'"));
  if (!numel.ok()) return numel.status();
  if (*numel == 0) return bad("an empty tensor has nothing to quantise");
  w.rows = shape.empty() ? 1 : shape[0];
  w.cols = *numel / w.rows;
  w.block_rows = w.per_row ? 1 : (q.block_rows() ? q.block_rows() : 128);
  w.block_cols = w.per_row ? w.cols : (q.block_cols() ? q.block_cols() : 128);
  w.grid_rows = (w.rows + w.block_rows - 1) / w.block_rows;
  w.grid_cols = (w.cols + w.block_cols - 1) / w.block_cols;
  w.scales_offset = (*numel + 3) / 4 * 4;
  w.reciprocal = q.scale_form() == v1::SCALE_FORM_RECIPROCAL;
  return w;
}

absl::StatusOr<int64_t> PayloadBytes(const v1::TensorSpec& tensor) {
  if (tensor.has_quantization()) {
    absl::StatusOr<WireQuant> w = ResolveWireQuant(tensor);
    if (!w.ok()) return w.status();
    // numel < 2^62 bytes of FP8; the grid has at most numel scales.
    return w->scales_offset + w->grid_rows * w->grid_cols * 4;
  }
  const std::string what = absl::StrCat("tensor '", tensor.name(), "'");
  const std::vector<int64_t> shape(tensor.shape().begin(),
                                   tensor.shape().end());
  absl::StatusOr<int64_t> numel = NumElements(shape, tensor.dtype(), what);
  if (!numel.ok()) return numel.status();
  const int64_t esize = ElementSize(tensor.dtype());
  const int64_t nnz = tensor.sparse_nnz();
  if (nnz < 0 || nnz > *numel) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": sparse_nnz ", nnz, " is outside [0, ", *numel,
                     "] for shape ", ShapeString(shape)));
  }
  if (nnz == 0) return *numel * esize;
  absl::StatusOr<int> ib = SparseIndexBytes(tensor, *numel);
  if (!ib.ok()) return ib.status();
  return nnz * (*ib + esize);
}

absl::StatusOr<ChunkPlan> PlanChunks(const Manifest& manifest,
                                     int64_t chunk_bytes) {
  if (chunk_bytes <= 0 || chunk_bytes % kChunkAlignment != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("chunk_bytes ", chunk_bytes,
                     " must be a positive multiple of ", kChunkAlignment));
  }
  ChunkPlan plan;
  plan.chunk_bytes = chunk_bytes;
  plan.tensor_offsets.reserve(manifest.size());
  plan.payload_bytes.reserve(manifest.size());
  absl::flat_hash_set<std::string> names;
  int64_t next = 0;
  for (const v1::TensorSpec& t : manifest) {
    if (t.name().empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "tensor #", plan.payload_bytes.size(), " has an empty name"));
    }
    if (!names.insert(t.name()).second) {
      return absl::InvalidArgumentError(absl::StrCat(
          "tensor '", t.name(), "' appears twice in the manifest"));
    }
    absl::StatusOr<int64_t> payload = PayloadBytes(t);
    if (!payload.ok()) return payload.status();
    const int64_t offset =
        (next + kChunkAlignment - 1) / kChunkAlignment * kChunkAlignment;
    if (*payload > (int64_t{1} << 62) - offset) {
      return absl::InvalidArgumentError(absl::StrCat(
          "tensor '", t.name(), "' takes the update past 2^62 bytes"));
    }
    plan.tensor_offsets.push_back(offset);
    plan.payload_bytes.push_back(*payload);
    plan.total_bytes = offset + *payload;
    next = plan.total_bytes;
  }
  const int64_t num_chunks = (plan.total_bytes + chunk_bytes - 1) / chunk_bytes;
  if (num_chunks > kMaxChunks) {
    // Checked before anything is allocated: a plan is ~100 bytes a chunk.
    return absl::InvalidArgumentError(absl::StrCat(
        "the update packs ", plan.total_bytes, " bytes into ", num_chunks,
        " chunks of ", chunk_bytes, " bytes; the limit is ", kMaxChunks,
        " chunks: use larger chunks"));
  }
  plan.chunks.resize(num_chunks);
  // Tensors are in stream order, so one forward sweep assigns every piece.
  int tensor = 0;
  for (int64_t k = 0; k < num_chunks; ++k) {
    Chunk& chunk = plan.chunks[k];
    chunk.index = k;
    chunk.offset = k * chunk_bytes;
    const int64_t end = std::min(chunk.offset + chunk_bytes, plan.total_bytes);
    chunk.size = end - chunk.offset;
    for (int t = tensor; t < manifest.size(); ++t) {
      const int64_t t_begin = plan.tensor_offsets[t];
      const int64_t t_end = t_begin + plan.payload_bytes[t];
      if (t_begin >= end) break;
      if (t_end <= chunk.offset) {
        if (t == tensor) ++tensor;
        continue;
      }
      const int64_t start = std::max(chunk.offset, t_begin);
      const int64_t stop = std::min(end, t_end);
      if (stop > start) {
        chunk.pieces.push_back(
            {t, start - t_begin, start - chunk.offset, stop - start});
      }
    }
  }
  return plan;
}

}  // namespace weightsync

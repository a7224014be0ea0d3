#include "client/receipts.h"

#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "client/fp8_receipts.h"
#include "common/checksum.h"
#include "common/dtype.h"

namespace weightsync {

v1::Receipt ExpectedReceipt(
    const google::protobuf::RepeatedPtrField<v1::Parameter>& parameters,
    const std::vector<HostTensor>& tensors) {
  absl::flat_hash_map<std::string, const HostTensor*> sent;
  for (const HostTensor& t : tensors) {
    // Receipts cover dense tensors (a patch's other elements are not ours).
    if (t.spec.sparse_nnz() == 0) sent[t.spec.name()] = &t;
  }
  v1::Receipt receipt;
  uint64_t sum = 0;
  std::vector<uint8_t> row;  // one run of source elements, converted
  // FP8 targets' scale parameters: summed with their owners.
  absl::flat_hash_set<std::string> scales;
  for (const v1::Parameter& p : parameters) {
    if (p.has_quantization()) scales.insert(p.quantization().scale_parameter());
  }
  for (const v1::Parameter& p : parameters) {
    if (p.has_quantization()) {
      AddQuantizedTerms(p, sent, &sum, &receipt);
      continue;
    }
    if (scales.contains(p.name())) continue;
    const uint64_t salt = ParameterSalt(p.name());
    const int64_t des = ElementSize(p.dtype());
    bool touched = false;
    // Source elements [from, from + n) become parameter elements
    // [to, to + n), converted to the parameter's dtype a run at a time.
    auto add = [&](const HostTensor& src, int64_t from, int64_t to, int64_t n) {
      const int64_t ses = ElementSize(src.spec.dtype());
      row.resize(n * des);
      ConvertElements(static_cast<const uint8_t*>(src.data) + from * ses,
                      src.spec.dtype(), row.data(), p.dtype(), n);
      sum += RunTerms(salt, to, row.data(), n, des);
    };
    if (p.segments_size() == 0) {
      auto it = sent.find(p.name());
      if (it == sent.end()) continue;
      int64_t numel = 1;
      for (int64_t d : p.shape()) numel *= d;
      add(*it->second, 0, 0, numel);
      receipt.set_bytes(receipt.bytes() + numel * des);
      touched = true;
    }
    for (const v1::Segment& s : p.segments()) {
      auto it = sent.find(s.source());
      if (it == sent.end()) continue;
      const HostTensor& src = *it->second;
      int64_t cols = 1;
      for (int i = 1; i < src.spec.shape_size(); ++i) cols *= src.spec.shape(i);
      const int64_t stride =
          s.dest_row_stride() ? s.dest_row_stride() : s.col_count();
      for (int64_t r = 0; r < s.row_count(); ++r) {
        add(src, (s.row_begin() + r) * cols + s.col_begin(),
            s.dest_offset() + r * stride, s.col_count());
      }
      receipt.set_bytes(receipt.bytes() + s.row_count() * s.col_count() * des);
      touched = true;
    }
    if (touched) receipt.set_parameters(receipt.parameters() + 1);
  }
  receipt.set_checksum(sum);
  return receipt;
}

absl::StatusOr<std::vector<cuda::ReceiptRegion>> ExpectedReceiptRegions(
    const google::protobuf::RepeatedPtrField<v1::Parameter>& parameters,
    const std::vector<HostTensor>& tensors, unsigned long long* out,
    v1::Receipt* counts) {
  absl::flat_hash_map<std::string, const HostTensor*> sent;
  for (const HostTensor& t : tensors) {
    if (t.spec.sparse_nnz() == 0) sent[t.spec.name()] = &t;
  }
  std::vector<cuda::ReceiptRegion> regions;
  *counts = v1::Receipt();
  for (const v1::Parameter& p : parameters) {
    const int64_t es = ElementSize(p.dtype());
    bool touched = false;
    // rows x cols source elements from element `from` of `src` (its rows
    // `src_cols` apart) become parameter elements `to` + r * dest_stride + c.
    auto add = [&](const HostTensor& src, int64_t from, int64_t rows,
                   int64_t cols, int64_t src_cols, int64_t to,
                   int64_t dest_stride) -> absl::Status {
      if (src.spec.dtype() != p.dtype()) {
        return absl::UnimplementedError(absl::StrCat(
            "parameter '", p.name(), "' converts '", src.spec.name(),
            "' to its dtype: sum it on the host (ExpectedReceipt)"));
      }
      cuda::ReceiptRegion r{};
      r.base = static_cast<const uint8_t*>(src.data) + from * es;
      r.rows = rows;
      r.cols = cols;
      r.row_stride_bytes = src_cols * es;
      r.dst_row_stride_bytes = dest_stride * es;
      r.salt = ParameterSalt(p.name());
      r.first_index = static_cast<uint64_t>(to);
      r.out = out;
      r.es = static_cast<int32_t>(es);
      regions.push_back(r);
      counts->set_bytes(counts->bytes() + rows * cols * es);
      touched = true;
      return absl::OkStatus();
    };
    if (p.segments_size() == 0) {
      auto it = sent.find(p.name());
      if (it != sent.end()) {
        int64_t numel = 1;
        for (int64_t d : p.shape()) numel *= d;
        absl::Status s = add(*it->second, 0, 1, numel, numel, 0, numel);
        if (!s.ok()) return s;
      }
    }
    for (const v1::Segment& g : p.segments()) {
      auto it = sent.find(g.source());
      if (it == sent.end()) continue;
      const HostTensor& src = *it->second;
      int64_t cols = 1;
      for (int i = 1; i < src.spec.shape_size(); ++i) cols *= src.spec.shape(i);
      absl::Status s =
          add(src, g.row_begin() * cols + g.col_begin(), g.row_count(),
              g.col_count(), cols, g.dest_offset(),
              g.dest_row_stride() ? g.dest_row_stride() : g.col_count());
      if (!s.ok()) return s;
    }
    if (touched) counts->set_parameters(counts->parameters() + 1);
  }
  return regions;
}

absl::Status CheckReceipts(const v1::FinishWeightUpdateResponse& finished,
                           const v1::GetStatusResponse& status,
                           const std::vector<HostTensor>& tensors) {
  absl::flat_hash_map<std::string, const v1::EngineStatus*> engines;
  for (const v1::EngineStatus& e : status.engines())
    engines[e.engine_id()] = &e;
  for (const v1::EngineResult& r : finished.engines()) {
    if (!r.has_receipt() || r.lost()) continue;
    auto it = engines.find(r.engine_id());
    if (it == engines.end()) continue;  // gone since; nothing to prove
    const v1::Receipt want = ExpectedReceipt(it->second->layout(), tensors);
    if (want.checksum() != r.receipt().checksum() ||
        want.bytes() != r.receipt().bytes()) {
      return absl::DataLossError(absl::StrFormat(
          "engine '%s' receipt %016x over %d bytes does not match %016x over "
          "%d bytes computed from what was sent: its memory does not hold "
          "this update",
          r.engine_id(), r.receipt().checksum(), r.receipt().bytes(),
          want.checksum(), want.bytes()));
    }
  }
  return absl::OkStatus();
}

}  // namespace weightsync

#include "client/receipts.h"

#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
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
  for (const v1::Parameter& p : parameters) {
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

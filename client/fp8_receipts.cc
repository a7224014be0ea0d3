#include "client/fp8_receipts.h"

#include <vector>

#include "common/checksum.h"
#include "common/dtype.h"
#include "common/fp8.h"

namespace weightsync {
namespace {

struct Image {
  int64_t rows = 0, cols = 0;
  std::vector<float> values;  // the parameter's [rows, cols], widened
  std::vector<bool> written;  // elements a sent tensor writes
};

// Widens what the sent tensors write into `p` (its segments, or the tensor
// of its own name) into `image`; false if nothing is sent.
bool Gather(const v1::Parameter& p,
            const absl::flat_hash_map<std::string, const HostTensor*>& sent,
            Image& image) {
  image.values.assign(image.rows * image.cols, 0.0f);
  image.written.assign(image.rows * image.cols, false);
  bool any = false;
  // Source elements [from, from + n) of `t` become elements [to, to + n).
  auto take = [&](const HostTensor& t, int64_t from, int64_t to, int64_t n) {
    const int64_t es = ElementSize(t.spec.dtype());
    ConvertElements(static_cast<const uint8_t*>(t.data) + from * es,
                    t.spec.dtype(), &image.values[to], v1::FLOAT32, n);
    std::fill(image.written.begin() + to, image.written.begin() + to + n, true);
    any = true;
  };
  if (p.segments_size() == 0) {
    auto it = sent.find(p.name());
    if (it != sent.end()) take(*it->second, 0, 0, image.rows * image.cols);
    return any;
  }
  for (const v1::Segment& s : p.segments()) {
    auto it = sent.find(s.source());
    if (it == sent.end()) continue;
    int64_t cols = 1;
    for (int i = 1; i < it->second->spec.shape_size(); ++i) {
      cols *= it->second->spec.shape(i);
    }
    const int64_t stride =
        s.dest_row_stride() ? s.dest_row_stride() : s.col_count();
    for (int64_t r = 0; r < s.row_count(); ++r) {
      take(*it->second, (s.row_begin() + r) * cols + s.col_begin(),
           s.dest_offset() + r * stride, s.col_count());
    }
  }
  return any;
}

}  // namespace

void AddQuantizedTerms(
    const v1::Parameter& p,
    const absl::flat_hash_map<std::string, const HostTensor*>& sent,
    uint64_t* sum, v1::Receipt* receipt) {
  const v1::Quantization& decl = p.quantization();
  Image image;
  // A stacked weight [..., n, k] (experts) is the matrix of its rows
  // (quant_layout.cc): rows = prod(...) * n, cols = k.
  image.cols = p.shape_size() > 0 ? p.shape(p.shape_size() - 1) : 1;
  image.rows = 1;
  for (int i = 0; i + 1 < p.shape_size(); ++i) image.rows *= p.shape(i);
  if (!Gather(p, sent, image)) return;
  const bool per_row = decl.scheme() == v1::QUANT_SCHEME_PER_ROW;
  Fp8Blocks q;
  q.format = decl.format();
  q.block_rows = per_row ? 1 : (decl.block_rows() ? decl.block_rows() : 128);
  q.block_cols =
      per_row ? image.cols : (decl.block_cols() ? decl.block_cols() : 128);
  q.reciprocal = decl.scale_form() == v1::SCALE_FORM_RECIPROCAL;
  const int64_t grid_rows = (image.rows + q.block_rows - 1) / q.block_rows;
  const int64_t grid_cols = (image.cols + q.block_cols - 1) / q.block_cols;
  std::vector<uint8_t> fp8(image.rows * image.cols);
  std::vector<uint8_t> scales(grid_rows * grid_cols * 4);
  QuantizeBlocks(image.values.data(), image.rows, image.cols, image.cols, q,
                 fp8.data(), image.cols, scales.data(), grid_cols);
  const uint64_t salt = ParameterSalt(p.name());
  std::vector<bool> block_written(grid_rows * grid_cols, false);
  int64_t elements = 0;
  for (int64_t i = 0; i < image.rows * image.cols; ++i) {
    if (!image.written[i]) continue;
    *sum += ElementTerm(salt, i, fp8[i]);
    ++elements;
    const int64_t r = i / image.cols, c = i % image.cols;
    block_written[(r / q.block_rows) * grid_cols + c / q.block_cols] = true;
  }
  const uint64_t scale_salt = ParameterSalt(decl.scale_parameter());
  int64_t blocks = 0;
  for (int64_t b = 0; b < grid_rows * grid_cols; ++b) {
    if (!block_written[b]) continue;
    *sum += ElementTerm(scale_salt, b, ElementBits(&scales[b * 4], 4));
    ++blocks;
  }
  receipt->set_parameters(receipt->parameters() + 2);
  receipt->set_bytes(receipt->bytes() + elements + 4 * blocks);
}

}  // namespace weightsync

#include "tools/synthetic/fp8_layout.h"

#include <cstring>
#include <map>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/dtype.h"
#include "common/fp8.h"

namespace weightsync::synthetic {
namespace {

// Fused (tensor-parallel layout) and plain names.
constexpr const char* kLinear[] = {
    "self_attn.qkv_proj.weight", "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",   "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",   "mlp.gate_up_proj.weight",
    "mlp.gate_proj.weight",      "mlp.up_proj.weight",
    "mlp.down_proj.weight"};

// Whether segment `s` of a parameter of `rows` x `cols` starts and ends on
// block boundaries (or the parameter's edges); the segments these layouts
// make land their rows one parameter row apart.
bool OnBlocks(const v1::Segment& s, int64_t rows, int64_t cols, int64_t block) {
  const int64_t r0 = s.dest_offset() / cols, c0 = s.dest_offset() % cols;
  const int64_t r1 = r0 + s.row_count(), c1 = c0 + s.col_count();
  auto edge = [&](int64_t x, int64_t end) {
    return x % block == 0 || x == end;
  };
  return c0 % block == 0 && r0 % block == 0 && edge(r1, rows) && edge(c1, cols);
}

}  // namespace

bool IsFp8Linear(const std::string& name) {
  for (const char* suffix : kLinear) {
    if (absl::EndsWith(name, suffix)) return true;
  }
  return false;
}

absl::StatusOr<std::vector<v1::Parameter>> Fp8EngineParameters(
    const ModelConfig& m, Layout layout, int rank, int size, v1::DType dtype,
    v1::DType format, int64_t block) {
  std::vector<v1::Parameter> out;
  for (v1::Parameter& p : EngineParameters(m, layout, rank, size, dtype)) {
    if (!IsFp8Linear(p.name())) {
      out.push_back(std::move(p));
      continue;
    }
    const int64_t rows = p.shape(0), cols = p.shape(1);
    for (const v1::Segment& s : p.segments()) {
      if (block > 0 && !OnBlocks(s, rows, cols, block)) {
        return absl::InvalidArgumentError(
            absl::StrCat("parameter '", p.name(), "': the shard of '",
                         s.source(), "' cuts a ", block, " x ", block,
                         " block at tensor-parallel size ", size));
      }
    }
    const std::string scale = p.name() + "_scale_inv";
    p.set_dtype(format);
    v1::Quantization* q = p.mutable_quantization();
    q->set_format(format);
    q->set_scale_parameter(scale);
    q->set_scheme(block > 0 ? v1::QUANT_SCHEME_BLOCK
                            : v1::QUANT_SCHEME_PER_ROW);
    q->set_block_rows(block);
    q->set_block_cols(block);
    q->set_scale_form(v1::SCALE_FORM_DEQUANT);
    v1::Parameter s;
    s.set_name(scale);
    s.set_dtype(v1::FLOAT32);
    s.add_shape(block > 0 ? (rows + block - 1) / block : rows);
    s.add_shape(block > 0 ? (cols + block - 1) / block : 1);
    out.push_back(std::move(p));
    out.push_back(std::move(s));
  }
  return out;
}

std::vector<std::vector<uint8_t>> ExpectedFp8Engine(
    const std::vector<v1::Parameter>& params,
    const CheckpointData& checkpoint) {
  std::vector<std::vector<uint8_t>> out(params.size());
  std::map<std::string, size_t> index;
  for (size_t i = 0; i < params.size(); ++i) index[params[i].name()] = i;
  for (size_t i = 0; i < params.size(); ++i) {
    const v1::Parameter& p = params[i];
    if (!p.has_quantization()) {
      // A scale parameter is filled with its owner below.
      if (out[i].empty()) out[i] = ExpectedParameter(p, checkpoint);
      continue;
    }
    v1::Parameter wide = p;
    wide.set_dtype(v1::FLOAT32);
    const std::vector<uint8_t> values = ExpectedParameter(wide, checkpoint);
    const int64_t rows = p.shape(0), cols = p.shape(1);
    const v1::Quantization& q = p.quantization();
    const bool per_row = q.scheme() == v1::QUANT_SCHEME_PER_ROW;
    Fp8Blocks b{q.format(), per_row ? 1 : q.block_rows(),
                per_row ? cols : q.block_cols(),
                q.scale_form() == v1::SCALE_FORM_RECIPROCAL};
    const int64_t grid_cols = (cols + b.block_cols - 1) / b.block_cols;
    const int64_t grid_rows = (rows + b.block_rows - 1) / b.block_rows;
    std::vector<float> x(rows * cols);
    std::memcpy(x.data(), values.data(), values.size());
    out[i].resize(rows * cols);
    const size_t s = index.at(q.scale_parameter());
    out[s].resize(grid_rows * grid_cols * 4);
    QuantizeBlocks(x.data(), rows, cols, cols, b, out[i].data(), cols,
                   out[s].data(), grid_cols);
  }
  return out;
}

}  // namespace weightsync::synthetic

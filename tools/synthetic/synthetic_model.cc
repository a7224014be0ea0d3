#include "tools/synthetic/synthetic_model.h"

#include <cstring>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/dtype.h"

namespace weightsync::synthetic {
namespace {

uint64_t SplitMix(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

uint64_t Fnv1a(const std::string& s) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char c : s) h = (h ^ c) * 0x100000001b3ull;
  return h;
}

v1::TensorSpec Spec(const std::string& name, v1::DType dtype,
                    std::vector<int64_t> shape) {
  v1::TensorSpec t;
  t.set_name(name);
  t.set_dtype(dtype);
  for (int64_t d : shape) t.add_shape(d);
  return t;
}

v1::Segment Block(const std::string& source, std::vector<int64_t> shape,
                  int64_t row_begin, int64_t row_count, int64_t col_begin,
                  int64_t col_count, int64_t dest_offset, int64_t stride) {
  v1::Segment s;
  s.set_source(source);
  for (int64_t d : shape) s.add_source_shape(d);
  s.set_row_begin(row_begin);
  s.set_row_count(row_count);
  s.set_col_begin(col_begin);
  s.set_col_count(col_count);
  s.set_dest_offset(dest_offset);
  s.set_dest_row_stride(stride);
  return s;
}

v1::Parameter Param(const std::string& name, v1::DType dtype,
                    std::vector<int64_t> shape) {
  v1::Parameter p;
  p.set_name(name);
  p.set_dtype(dtype);
  for (int64_t d : shape) p.add_shape(d);
  return p;
}

}  // namespace

absl::StatusOr<ModelConfig> ModelByName(const std::string& name) {
  if (name == "tiny") return ModelConfig{1003, 64, 160, 2, 4, 2, 16};
  if (name == "demo") return ModelConfig{32003, 1024, 2816, 4, 16, 4, 64};
  if (name == "qwen3-1.7b") {
    return ModelConfig{151936, 2048, 6144, 28, 16, 8, 128, true};
  }
  if (name == "qwen3-8b") {
    return ModelConfig{151936, 4096, 12288, 36, 32, 8, 128};
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "unknown model '", name, "' (tiny, demo, qwen3-1.7b, qwen3-8b)"));
}

std::vector<v1::TensorSpec> Checkpoint(const ModelConfig& m, v1::DType dtype) {
  std::vector<v1::TensorSpec> t;
  const int64_t q = m.heads * m.head_dim, kv = m.kv_heads * m.head_dim;
  t.push_back(Spec("model.embed_tokens.weight", dtype, {m.vocab, m.hidden}));
  for (int64_t l = 0; l < m.layers; ++l) {
    const std::string p = absl::StrCat("model.layers.", l, ".");
    t.push_back(Spec(p + "input_layernorm.weight", dtype, {m.hidden}));
    t.push_back(Spec(p + "self_attn.q_proj.weight", dtype, {q, m.hidden}));
    t.push_back(Spec(p + "self_attn.k_proj.weight", dtype, {kv, m.hidden}));
    t.push_back(Spec(p + "self_attn.v_proj.weight", dtype, {kv, m.hidden}));
    t.push_back(Spec(p + "self_attn.o_proj.weight", dtype, {m.hidden, q}));
    t.push_back(Spec(p + "self_attn.q_norm.weight", dtype, {m.head_dim}));
    t.push_back(Spec(p + "self_attn.k_norm.weight", dtype, {m.head_dim}));
    t.push_back(Spec(p + "post_attention_layernorm.weight", dtype, {m.hidden}));
    t.push_back(
        Spec(p + "mlp.gate_proj.weight", dtype, {m.intermediate, m.hidden}));
    t.push_back(
        Spec(p + "mlp.up_proj.weight", dtype, {m.intermediate, m.hidden}));
    t.push_back(
        Spec(p + "mlp.down_proj.weight", dtype, {m.hidden, m.intermediate}));
  }
  t.push_back(Spec("model.norm.weight", dtype, {m.hidden}));
  if (!m.tie_embeddings) {
    t.push_back(Spec("lm_head.weight", dtype, {m.vocab, m.hidden}));
  }
  return t;
}

namespace {

// The reference installer's element conversion, written apart from
// common/dtype.cc's ConvertElements so that tests comparing the daemon's
// bytes with this reference would catch a rounding bug there: equal dtypes
// copy; float32 <-> bfloat16 by hand (round to nearest even on the upper 16
// bits; a NaN keeps its sign and payload with the quiet bit set); float16
// conversions (subnormals, overflow) still go through ConvertElements.
void ReferenceConvert(const uint8_t* src, v1::DType from, uint8_t* dst,
                      v1::DType to) {
  if (from == to) {
    std::memcpy(dst, src, ElementSize(from));
    return;
  }
  if (from == v1::FLOAT32 && to == v1::BFLOAT16) {
    uint32_t x;
    std::memcpy(&x, src, 4);
    const bool nan = (x & 0x7FFFFFFFu) > 0x7F800000u;
    const uint16_t y =
        nan ? static_cast<uint16_t>((x >> 16) | 0x40)
            : static_cast<uint16_t>((x + 0x7FFFu + ((x >> 16) & 1u)) >> 16);
    std::memcpy(dst, &y, 2);
    return;
  }
  if (from == v1::BFLOAT16 && to == v1::FLOAT32) {
    uint16_t y;
    std::memcpy(&y, src, 2);
    const uint32_t x = static_cast<uint32_t>(y) << 16;
    std::memcpy(dst, &x, 4);
    return;
  }
  ConvertElements(src, from, dst, to, 1);
}

}  // namespace

std::vector<uint8_t> Contents(const v1::TensorSpec& spec, int64_t version) {
  int64_t numel = 1;
  for (int64_t d : spec.shape()) numel *= d;
  const int64_t es = ElementSize(spec.dtype());
  std::vector<uint8_t> out(numel * es);
  const uint64_t seed = Fnv1a(spec.name()) ^ SplitMix(version);
  for (int64_t i = 0; i < numel; ++i) {
    const uint64_t r = SplitMix(seed + i);
    // Values in [-1, 1) with a version-dependent pattern.
    const float f = static_cast<float>(r >> 40) / (1 << 23) - 1.0f;
    ConvertElements(&f, v1::FLOAT32, out.data() + i * es, spec.dtype(), 1);
  }
  return out;
}

std::vector<v1::Parameter> EngineParameters(const ModelConfig& m, Layout layout,
                                            int rank, int size,
                                            v1::DType dtype) {
  std::vector<v1::Parameter> out;
  if (layout == Layout::kPlain) {
    for (const v1::TensorSpec& t : Checkpoint(m, dtype)) {
      out.push_back(
          Param(t.name(), dtype,
                std::vector<int64_t>(t.shape().begin(), t.shape().end())));
    }
    return out;
  }
  const int64_t H = m.hidden, I = m.intermediate;
  const int64_t q = m.heads * m.head_dim, kv = m.kv_heads * m.head_dim;
  const int64_t qs = q / size, kvs = kv / size, is = I / size;
  // Vocab shards are padded to a multiple of 64 rows.
  const int64_t vs = ((m.vocab + size - 1) / size + 63) / 64 * 64;
  const int64_t v0 = rank * vs;
  const int64_t vrows = std::max<int64_t>(0, std::min(vs, m.vocab - v0));
  auto vocab_param = [&](const std::string& name) {
    v1::Parameter p = Param(name, dtype, {vs, H});
    if (vrows > 0) {
      *p.add_segments() = Block(name, {m.vocab, H}, v0, vrows, 0, H, 0, H);
    }
    return p;
  };
  out.push_back(vocab_param("model.embed_tokens.weight"));
  for (int64_t l = 0; l < m.layers; ++l) {
    const std::string p = absl::StrCat("model.layers.", l, ".");
    out.push_back(Param(p + "input_layernorm.weight", dtype, {H}));
    // Column-parallel fused qkv: this rank's rows of q, k and v stacked.
    v1::Parameter qkv =
        Param(p + "self_attn.qkv_proj.weight", dtype, {qs + 2 * kvs, H});
    *qkv.add_segments() =
        Block(p + "self_attn.q_proj.weight", {q, H}, rank * qs, qs, 0, H, 0, H);
    *qkv.add_segments() = Block(p + "self_attn.k_proj.weight", {kv, H},
                                rank * kvs, kvs, 0, H, qs * H, H);
    *qkv.add_segments() = Block(p + "self_attn.v_proj.weight", {kv, H},
                                rank * kvs, kvs, 0, H, (qs + kvs) * H, H);
    out.push_back(qkv);
    // Row-parallel o_proj: this rank's columns.
    v1::Parameter o = Param(p + "self_attn.o_proj.weight", dtype, {H, qs});
    *o.add_segments() = Block(p + "self_attn.o_proj.weight", {H, q}, 0, H,
                              rank * qs, qs, 0, qs);
    out.push_back(o);
    out.push_back(Param(p + "self_attn.q_norm.weight", dtype, {m.head_dim}));
    out.push_back(Param(p + "self_attn.k_norm.weight", dtype, {m.head_dim}));
    out.push_back(Param(p + "post_attention_layernorm.weight", dtype, {H}));
    v1::Parameter gu = Param(p + "mlp.gate_up_proj.weight", dtype, {2 * is, H});
    *gu.add_segments() =
        Block(p + "mlp.gate_proj.weight", {I, H}, rank * is, is, 0, H, 0, H);
    *gu.add_segments() =
        Block(p + "mlp.up_proj.weight", {I, H}, rank * is, is, 0, H, is * H, H);
    out.push_back(gu);
    v1::Parameter down = Param(p + "mlp.down_proj.weight", dtype, {H, is});
    *down.add_segments() =
        Block(p + "mlp.down_proj.weight", {H, I}, 0, H, rank * is, is, 0, is);
    out.push_back(down);
  }
  out.push_back(Param("model.norm.weight", dtype, {H}));
  if (!m.tie_embeddings) out.push_back(vocab_param("lm_head.weight"));
  return out;
}

std::vector<uint8_t> ExpectedParameter(const v1::Parameter& param,
                                       const CheckpointData& checkpoint) {
  int64_t numel = 1;
  for (int64_t d : param.shape()) numel *= d;
  const int64_t des = ElementSize(param.dtype());
  std::vector<uint8_t> out(numel * des, 0);
  auto install = [&](const v1::Segment& s) {
    auto it = checkpoint.find(s.source());
    if (it == checkpoint.end()) return;
    const v1::TensorSpec& spec = it->second.first;
    const uint8_t* src = it->second.second.data();
    const int64_t ses = ElementSize(spec.dtype());
    int64_t cols = 1;
    for (int i = 1; i < spec.shape_size(); ++i) cols *= spec.shape(i);
    const int64_t stride =
        s.dest_row_stride() ? s.dest_row_stride() : s.col_count();
    for (int64_t i = 0; i < s.row_count(); ++i) {
      for (int64_t j = 0; j < s.col_count(); ++j) {
        const int64_t from = (s.row_begin() + i) * cols + s.col_begin() + j;
        const int64_t to = s.dest_offset() + i * stride + j;
        ReferenceConvert(src + from * ses, spec.dtype(), out.data() + to * des,
                         param.dtype());
      }
    }
  };
  if (param.segments_size() == 0) {
    auto it = checkpoint.find(param.name());
    if (it != checkpoint.end()) {
      const v1::DType from = it->second.first.dtype();
      const int64_t ses = ElementSize(from);
      for (int64_t j = 0; j < numel; ++j) {
        ReferenceConvert(it->second.second.data() + j * ses, from,
                         out.data() + j * des, param.dtype());
      }
    }
    return out;
  }
  for (const v1::Segment& s : param.segments()) install(s);
  return out;
}

}  // namespace weightsync::synthetic

// FP8 targets through the host data plane: rows of blocks gathered across
// chunks that cut them anywhere, quantised whole and written with their
// scales, bit for bit the function applied to the whole parameter; the
// daemon's receipts of FP8 engines against tests/vectors/fp8.json (exact
// arithmetic, tools/fp8_vectors.py); the plan's refusals.
#include "backends/host/quant_scatter.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstring>
#include <fstream>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "backends/host/host_data_plane.h"
#include "common/dtype.h"
#include "common/fp8.h"
#include "common/status_macros.h"
#include "daemon/core/copy_plan.h"
#include "daemon/core/engine_layout.h"
#include "daemon/core/receipt.h"
#include "gmock/gmock.h"
#include "google/protobuf/struct.pb.h"
#include "google/protobuf/util/json_util.h"
#include "gtest/gtest.h"
#include "tests/testing/heap_memory.h"
#include "tests/testing/layout_builders.h"

namespace weightsync {
namespace {

using ::testing::HasSubstr;

struct Tensor {
  v1::TensorSpec spec;
  std::string bytes;
};

Tensor RandomTensor(const std::string& name, v1::DType dtype, int64_t rows,
                    int64_t cols, std::mt19937& rng) {
  Tensor t;
  t.spec.set_name(name);
  t.spec.set_dtype(dtype);
  t.spec.add_shape(rows);
  t.spec.add_shape(cols);
  std::normal_distribution<float> normal(0.0f, 2.0f);
  std::vector<float> f(rows * cols);
  for (float& x : f) x = normal(rng);
  f[0] = NAN;  // a NaN in the first block: ignored by its amax
  t.bytes.resize(rows * cols * ElementSize(dtype));
  ConvertElements(f.data(), v1::FLOAT32, t.bytes.data(), dtype, rows * cols);
  return t;
}

v1::Parameter* Add(v1::RegisterEngineRequest& r, const std::string& name,
                   v1::DType dtype, int64_t rows, int64_t cols,
                   int64_t* offset) {
  v1::Parameter* p = r.add_parameters();
  p->set_name(name);
  p->set_dtype(dtype);
  p->add_shape(rows);
  if (cols > 0) p->add_shape(cols);
  p->set_offset(*offset);
  *offset += (rows * std::max<int64_t>(cols, 1) * ElementSize(dtype) + 255) /
             256 * 256;
  return p;
}

using testing::AddSegment;

// `r`'s one allocation: host shared memory `handle` of `size` bytes.
void AddHostShm(v1::RegisterEngineRequest& r, const std::string& handle,
                int64_t size) {
  v1::Allocation* a = r.add_allocations();
  a->set_kind(v1::MEMORY_HOST_SHM);
  a->set_handle(handle);
  a->set_size(size);
}
using testing::Quantize;

// Engine "fp8": one e4m3 weight "w" [rows, cols] in 128 x 128 blocks and
// its float32 scales "w_scale_inv" [scale_rows, scale_cols], in host memory.
v1::RegisterEngineRequest OneFp8Weight(int64_t rows, int64_t cols,
                                       int64_t scale_rows, int64_t scale_cols) {
  v1::RegisterEngineRequest r;
  r.set_engine_id("fp8");
  int64_t offset = 0;
  Quantize(Add(r, "w", v1::FLOAT8_E4M3FN, rows, cols, &offset),
           v1::FLOAT8_E4M3FN, "w_scale_inv", v1::QUANT_SCHEME_BLOCK,
           v1::SCALE_FORM_DEQUANT);
  Add(r, "w_scale_inv", v1::FLOAT32, scale_rows, scale_cols, &offset);
  AddHostShm(r, "/fp8", offset);
  return r;
}

// Registers `r` in heap memory, plans `tensors` in chunks of `chunk_bytes`
// and pushes them through a host data plane. Returns the layout.
std::shared_ptr<const EngineLayout> Install(
    const v1::RegisterEngineRequest& r, const std::vector<Tensor>& tensors,
    int64_t chunk_bytes, testing::HeapMapper& mapper,
    std::shared_ptr<const CopyPlan>* plan_out = nullptr,
    bool engine_lost = false) {
  auto layout = BuildEngineLayout(r, mapper);
  EXPECT_TRUE(layout.ok()) << layout.status();
  if (!layout.ok()) return nullptr;
  Manifest manifest;
  for (const Tensor& t : tensors) *manifest.Add() = t.spec;
  auto plan = BuildCopyPlan(manifest, chunk_bytes, {*layout});
  EXPECT_TRUE(plan.ok()) << plan.status();
  if (!plan.ok()) return nullptr;
  std::string packed((*plan)->chunks.total_bytes, '\0');
  for (size_t t = 0; t < tensors.size(); ++t) {
    std::memcpy(&packed[(*plan)->chunks.tensor_offsets[t]],
                tensors[t].bytes.data(), tensors[t].bytes.size());
  }
  HostDataPlane plane({});
  v1::StartWeightUpdateRequest request;
  EXPECT_TRUE(plane.Begin(*plan, request).ok());
  if (engine_lost) plane.MarkEngineLost(0);  // it died mid-update
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  for (const Chunk& c : (*plan)->chunks.chunks) {
    EXPECT_TRUE(
        plane.SubmitChunk(c.index, packed.substr(c.offset, c.size), deadline)
            .ok());
  }
  const absl::Status drained = plane.Drain(deadline);
  EXPECT_TRUE(drained.ok() || engine_lost) << drained;
  if (plan_out != nullptr) *plan_out = *plan;
  return *layout;
}

std::string Bytes(const EngineLayout& layout, int i) {
  const ParameterLayout& p = layout.parameters[i];
  return std::string(
      reinterpret_cast<const char*>(layout.regions[p.region]->data()) +
          p.offset,
      p.bytes);
}

// What quantising `x` (rows x cols float32) in blocks gives: FP8 bytes and
// stored scales.
std::pair<std::string, std::string> Reference(const std::vector<float>& x,
                                              int64_t rows, int64_t cols,
                                              const Fp8Blocks& q) {
  const int64_t grid_rows = (rows + q.block_rows - 1) / q.block_rows;
  const int64_t grid_cols = (cols + q.block_cols - 1) / q.block_cols;
  std::string fp8(rows * cols, '\0'), scales(grid_rows * grid_cols * 4, '\0');
  QuantizeBlocks(x.data(), rows, cols, cols, q,
                 reinterpret_cast<uint8_t*>(fp8.data()), cols,
                 reinterpret_cast<uint8_t*>(scales.data()), grid_cols);
  return {fp8, scales};
}

// Rows [rb, rb + rc) x cols [cb, cb + cc) of a rows x cols tensor, widened.
std::vector<float> Widen(const Tensor& t, int64_t cols, int64_t rb, int64_t rc,
                         int64_t cb, int64_t cc) {
  std::vector<float> out(rc * cc);
  const int64_t es = ElementSize(t.spec.dtype());
  for (int64_t r = 0; r < rc; ++r) {
    ConvertElements(t.bytes.data() + ((rb + r) * cols + cb) * es,
                    t.spec.dtype(), &out[r * cc], v1::FLOAT32, cc);
  }
  return out;
}

// w: bfloat16 [300, 260] into e4m3 128 x 128 (edge blocks partial), and
// the same tensor copied plainly into a bfloat16 parameter; qkv: a TP
// rank of fused float32/float16 sources into e5m2 with reciprocal
// scales; o: a row-parallel shard of a bfloat16 tensor, per-row scales;
// side: parts of two tensors side by side (a block column from 256).
std::vector<Tensor> MixedTensors() {
  std::mt19937 rng(7);
  return {
      RandomTensor("w", v1::BFLOAT16, 300, 260, rng),
      RandomTensor("q", v1::FLOAT32, 256, 200, rng),
      RandomTensor("k", v1::FLOAT32, 128, 200, rng),
      RandomTensor("v", v1::FLOAT16, 256, 200, rng),
      RandomTensor("o_proj", v1::BFLOAT16, 130, 512, rng),
  };
}

v1::RegisterEngineRequest MixedFp8Engine() {
  v1::RegisterEngineRequest r;
  r.set_engine_id("fp8");
  int64_t offset = 0;
  Quantize(Add(r, "w", v1::FLOAT8_E4M3FN, 300, 260, &offset), v1::FLOAT8_E4M3FN,
           "w_scale_inv", v1::QUANT_SCHEME_BLOCK, v1::SCALE_FORM_DEQUANT);
  Add(r, "w_scale_inv", v1::FLOAT32, 3, 3, &offset);
  AddSegment(Add(r, "w_copy", v1::BFLOAT16, 300, 260, &offset), "w", 0, 300, 0,
             260, 0, 0);
  v1::Parameter* qkv = Add(r, "qkv", v1::FLOAT8_E5M2, 384, 200, &offset);
  Quantize(qkv, v1::FLOAT8_E5M2, "qkv_scale", v1::QUANT_SCHEME_BLOCK,
           v1::SCALE_FORM_RECIPROCAL);
  AddSegment(qkv, "q", 128, 128, 0, 200, 0, 200);
  AddSegment(qkv, "k", 0, 128, 0, 200, 128 * 200, 200);
  AddSegment(qkv, "v", 128, 128, 0, 200, 256 * 200, 200);
  Add(r, "qkv_scale", v1::FLOAT32, 3, 2, &offset);
  v1::Parameter* o = Add(r, "o", v1::FLOAT8_E4M3FN, 130, 256, &offset);
  Quantize(o, v1::FLOAT8_E4M3FN, "o_scale", v1::QUANT_SCHEME_PER_ROW,
           v1::SCALE_FORM_DEQUANT);
  AddSegment(o, "o_proj", 0, 130, 256, 256, 0, 0);
  Add(r, "o_scale", v1::FLOAT32, 130, 1, &offset);
  // side: two sources side by side (a column block at 256), 2-row blocks.
  v1::Parameter* side = Add(r, "side", v1::FLOAT8_E4M3FN, 130, 384, &offset);
  Quantize(side, v1::FLOAT8_E4M3FN, "side_scale", v1::QUANT_SCHEME_BLOCK,
           v1::SCALE_FORM_DEQUANT);
  side->mutable_quantization()->set_block_rows(2);
  AddSegment(side, "w", 0, 130, 0, 256, 0, 384);
  AddSegment(side, "o_proj", 0, 130, 0, 128, 256, 384);
  Add(r, "side_scale", v1::FLOAT32, 65, 3, &offset);
  AddHostShm(r, "/fp8", offset);
  return r;
}

TEST(QuantScatterTest, ChunksThatCutBlocksGiveTheWholeParameterQuantised) {
  const std::vector<Tensor> tensors = MixedTensors();
  const v1::RegisterEngineRequest r = MixedFp8Engine();

  // The references, from the whole matrices.
  const auto w = Reference(Widen(tensors[0], 260, 0, 300, 0, 260), 300, 260,
                           {v1::FLOAT8_E4M3FN, 128, 128, false});
  std::vector<float> fused = Widen(tensors[1], 200, 128, 128, 0, 200);
  for (const auto& part : {Widen(tensors[2], 200, 0, 128, 0, 200),
                           Widen(tensors[3], 200, 128, 128, 0, 200)}) {
    fused.insert(fused.end(), part.begin(), part.end());
  }
  const auto qkv_ref =
      Reference(fused, 384, 200, {v1::FLOAT8_E5M2, 128, 128, true});
  const auto o_ref = Reference(Widen(tensors[4], 512, 0, 130, 256, 256), 130,
                               256, {v1::FLOAT8_E4M3FN, 1, 256, false});
  const std::string& w_copy = tensors[0].bytes;
  std::vector<float> beside(130 * 384);
  const std::vector<float> left = Widen(tensors[0], 260, 0, 130, 0, 256);
  const std::vector<float> right = Widen(tensors[4], 512, 0, 130, 0, 128);
  for (int64_t i = 0; i < 130; ++i) {
    std::copy(&left[i * 256], &left[i * 256] + 256, &beside[i * 384]);
    std::copy(&right[i * 128], &right[i * 128] + 128, &beside[i * 384 + 256]);
  }
  const auto side_ref =
      Reference(beside, 130, 384, {v1::FLOAT8_E4M3FN, 2, 128, false});

  for (int64_t chunk_bytes : {256, 768, 4096, 11520, 65536, 1 << 20}) {
    SCOPED_TRACE(chunk_bytes);
    testing::HeapMapper mapper;
    auto layout = Install(r, tensors, chunk_bytes, mapper);
    ASSERT_NE(layout, nullptr);
    EXPECT_TRUE(Bytes(*layout, 0) == w.first);
    EXPECT_TRUE(Bytes(*layout, 1) == w.second);
    EXPECT_TRUE(Bytes(*layout, 2) == w_copy);
    EXPECT_TRUE(Bytes(*layout, 3) == qkv_ref.first);
    EXPECT_TRUE(Bytes(*layout, 4) == qkv_ref.second);
    EXPECT_TRUE(Bytes(*layout, 5) == o_ref.first);
    EXPECT_TRUE(Bytes(*layout, 6) == o_ref.second);
    EXPECT_TRUE(Bytes(*layout, 7) == side_ref.first);
    EXPECT_TRUE(Bytes(*layout, 8) == side_ref.second);
  }
}

// `t` quantised on the wire (TensorSpec.quantization): its FP8 elements,
// then from the next multiple of 4 bytes the stored scales of its blocks
// (per row: [rows]), by the one function, from the whole tensor.
Tensor OnTheWire(const Tensor& t, v1::DType format, int64_t block_rows,
                 int64_t block_cols, bool reciprocal, bool per_row = false) {
  const int64_t rows = t.spec.shape(0), cols = t.spec.shape(1);
  const Fp8Blocks q{format, per_row ? 1 : block_rows,
                    per_row ? cols : block_cols, reciprocal};
  const auto [fp8, scales] =
      Reference(Widen(t, cols, 0, rows, 0, cols), rows, cols, q);
  Tensor w;
  w.spec = t.spec;
  w.spec.set_dtype(format);
  v1::Quantization* z = w.spec.mutable_quantization();
  z->set_format(format);
  z->set_scheme(per_row ? v1::QUANT_SCHEME_PER_ROW : v1::QUANT_SCHEME_BLOCK);
  if (!per_row) {
    z->set_block_rows(block_rows);
    z->set_block_cols(block_cols);
  }
  z->set_scale_form(reciprocal ? v1::SCALE_FORM_RECIPROCAL
                               : v1::SCALE_FORM_DEQUANT);
  w.bytes = fp8;
  w.bytes.resize((fp8.size() + 3) / 4 * 4, '\0');
  w.bytes += scales;
  return w;
}

// FP8 on the wire: the sender quantises the tensors whose every use is an
// FP8 target of its blocks (q, k, v into qkv, in e5m2 with reciprocal
// scales, each use on whole blocks of its tensor: the TP rank's rows from
// 128), and the engine holds, at every chunk size, exactly what the daemon
// quantising them gives; the other tensors, sent as they are, still are
// quantised by the daemon beside them. The payload is a byte per element
// plus the scales.
TEST(QuantScatterTest, QuantisedOnTheWireLandsAsTheDaemonQuantises) {
  const std::vector<Tensor> plain = MixedTensors();
  const v1::RegisterEngineRequest r = MixedFp8Engine();
  std::vector<Tensor> wire = plain;
  for (int t : {1, 2, 3}) {
    wire[t] = OnTheWire(plain[t], v1::FLOAT8_E5M2, 128, 128, true);
  }
  EXPECT_EQ(wire[1].bytes.size(), 256 * 200 + 2 * 2 * 4);
  testing::HeapMapper ref_mapper;
  auto want = Install(r, plain, 1 << 20, ref_mapper);
  ASSERT_NE(want, nullptr);
  for (int64_t chunk_bytes : {256, 768, 4096, 11520, 65536, 1 << 20}) {
    SCOPED_TRACE(chunk_bytes);
    testing::HeapMapper mapper;
    std::shared_ptr<const CopyPlan> plan;
    auto layout = Install(r, wire, chunk_bytes, mapper, &plan);
    ASSERT_NE(layout, nullptr);
    for (size_t i = 0; i < layout->parameters.size(); ++i) {
      EXPECT_TRUE(Bytes(*layout, i) == Bytes(*want, i))
          << layout->parameters[i].name;
    }
    // Only w's, o_proj's and side's uses are quantised by the daemon.
    for (const QuantTarget& q : plan->quant) {
      EXPECT_TRUE(q.tensor == 0 || q.tensor == 4) << q.tensor;
    }
    auto got = ComputeReceipt(*layout, plan->dense_uses[0]);
    auto ref = ComputeReceipt(*want, plan->dense_uses[0]);
    ASSERT_TRUE(got.ok() && ref.ok());
    EXPECT_EQ(got->checksum(), ref->checksum());
  }
}

// A per-row target fed whole rows of a tensor quantised per row on the
// wire; and what can't be copied as it is, refused before anything is
// written, naming the tensor, the engine and the parameter: a tensor that
// also feeds a plain parameter, another format, block or scale form, a
// segment off the tensor's blocks, per-row scales of part of a row, and
// a payload that isn't FP8 elements of the quantization's format.
TEST(QuantScatterTest, OnTheWireOnlyWhatCopiesAsItIs) {
  std::mt19937 rng(11);
  const Tensor rows = RandomTensor("rows", v1::BFLOAT16, 130, 256, rng);
  v1::RegisterEngineRequest r;
  r.set_engine_id("per_row");
  int64_t offset = 0;
  Quantize(Add(r, "rows", v1::FLOAT8_E4M3FN, 130, 256, &offset),
           v1::FLOAT8_E4M3FN, "rows_scale", v1::QUANT_SCHEME_PER_ROW,
           v1::SCALE_FORM_DEQUANT);
  Add(r, "rows_scale", v1::FLOAT32, 130, 0, &offset);
  AddHostShm(r, "/fp8", offset);
  {
    testing::HeapMapper m1, m2;
    auto want = Install(r, {rows}, 4096, m1);
    auto got = Install(
        r, {OnTheWire(rows, v1::FLOAT8_E4M3FN, 0, 0, false, true)}, 4096, m2);
    ASSERT_NE(want, nullptr);
    ASSERT_NE(got, nullptr);
    EXPECT_TRUE(Bytes(*got, 0) == Bytes(*want, 0));
    EXPECT_TRUE(Bytes(*got, 1) == Bytes(*want, 1));
    // Blocks of one row but not the whole row (1 x 128) are not per row:
    // the per-row target refuses them, whatever their scales' count.
    Manifest m;
    *m.Add() = OnTheWire(rows, v1::FLOAT8_E4M3FN, 1, 128, false).spec;
    testing::HeapMapper m3;
    auto per_row = BuildEngineLayout(r, m3);
    ASSERT_TRUE(per_row.ok()) << per_row.status();
    const absl::Status s = BuildCopyPlan(m, 4096, {*per_row}).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_THAT(std::string(s.message()),
                HasSubstr("the tensor is quantised to float8_e4m3fn (1 x 128) "
                          "but the target quantises to float8_e4m3fn (1 x "
                          "256)"));
  }

  const std::vector<Tensor> plain = MixedTensors();
  testing::HeapMapper mapper;
  auto layout = BuildEngineLayout(MixedFp8Engine(), mapper);
  ASSERT_TRUE(layout.ok()) << layout.status();
  auto refused = [&](int t, const Tensor& sent) {
    Manifest manifest;
    for (size_t i = 0; i < plain.size(); ++i) {
      *manifest.Add() = static_cast<int>(i) == t ? sent.spec : plain[i].spec;
    }
    return BuildCopyPlan(manifest, 4096, {*layout}).status();
  };
  struct Case {
    int tensor;
    Tensor sent;
    std::string says;
  };
  Tensor e4m3_payload_e5m2 =
      OnTheWire(plain[1], v1::FLOAT8_E5M2, 128, 128, true);
  e4m3_payload_e5m2.spec.set_dtype(v1::FLOAT8_E4M3FN);
  Tensor scale_named = OnTheWire(plain[1], v1::FLOAT8_E5M2, 128, 128, true);
  scale_named.spec.mutable_quantization()->set_scale_parameter("qkv_scale");
  const std::vector<Case> cases = {
      // w also feeds w_copy (bfloat16): it can't arrive as FP8.
      {0, OnTheWire(plain[0], v1::FLOAT8_E4M3FN, 128, 128, false),
       "parameter 'w_copy': the tensor arrives quantised to float8_e4m3fn but "
       "the parameter (bfloat16) is not an FP8 target"},
      {1, OnTheWire(plain[1], v1::FLOAT8_E4M3FN, 128, 128, true),
       "parameter 'qkv': the tensor is quantised to float8_e4m3fn (128 x 128, "
       "reciprocal scales) but the target quantises to float8_e5m2"},
      {1, OnTheWire(plain[1], v1::FLOAT8_E5M2, 64, 128, true),
       "(64 x 128, reciprocal scales) but the target quantises to "
       "float8_e5m2 (128 x 128, reciprocal scales)"},
      {1, OnTheWire(plain[1], v1::FLOAT8_E5M2, 128, 128, false),
       "(128 x 128) but the target"},
      // side reads w's rows [0, 130): they end inside w's second block row
      // (128 x 128 blocks on the wire against side's 2 x 128).
      {0, OnTheWire(plain[0], v1::FLOAT8_E4M3FN, 2, 128, false),
       "parameter 'w'"},
      // o reads columns [256, 512) of o_proj: part of each row.
      {4, OnTheWire(plain[4], v1::FLOAT8_E4M3FN, 0, 0, false, true),
       "parameter 'o': the segment reads rows [0, 130) x cols [256, 512) of "
       "the tensor's 130x512 matrix, which are not whole blocks of it"},
      // Per row on the wire into a target of 128 x 128 blocks.
      {1, OnTheWire(plain[1], v1::FLOAT8_E5M2, 0, 0, true, true),
       "(per row, reciprocal scales) but the target quantises to float8_e5m2 "
       "(128 x 128, reciprocal scales)"},
      {1, e4m3_payload_e5m2,
       "tensor 'q' (quantised on the wire): dtype float8_e4m3fn and "
       "quantization.format float8_e5m2 must be one FP8 format"},
      {1, scale_named, "leave it empty"},
  };
  for (const Case& c : cases) {
    const absl::Status s = refused(c.tensor, c.sent);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_THAT(std::string(s.message()), HasSubstr(c.says));
    if (absl::StrContains(c.says, "parameter")) {
      EXPECT_THAT(std::string(s.message()), HasSubstr("engine 'fp8'"));
    }
  }
}

// Each edge of "whole blocks of both": an FP8 target of one weight (and
// its scales) fed one tensor quantised on the wire, refused or planned as
// the use lies on the tensor's blocks and the target's. `shape` is the
// target's; `segment` (source rows, row count, cols, col count, stride)
// none for the whole tensor.
struct WireUse {
  std::vector<int64_t> target_shape;
  int64_t block_rows, block_cols;  // the target's blocks
  int64_t scale_rows, scale_cols;
  std::vector<int64_t> segment;  // empty: the tensor is the parameter
  std::vector<int64_t> tensor_shape;
  int64_t wire_rows, wire_cols;  // the tensor's blocks; 0, 0: per row
  std::string says;              // "": planned
};

absl::Status PlanWireUse(const WireUse& u) {
  v1::RegisterEngineRequest r;
  r.set_engine_id("fp8");
  v1::Parameter* p = r.add_parameters();
  p->set_name("w");
  p->set_dtype(v1::FLOAT8_E4M3FN);
  int64_t numel = 1;
  for (int64_t d : u.target_shape) {
    p->add_shape(d);
    numel *= d;
  }
  Quantize(p, v1::FLOAT8_E4M3FN, "w_scale", v1::QUANT_SCHEME_BLOCK,
           v1::SCALE_FORM_DEQUANT, u.block_rows, u.block_cols);
  if (!u.segment.empty()) {
    AddSegment(p, "t", u.segment[0], u.segment[1], u.segment[2], u.segment[3],
               0, u.segment[4]);
  }
  int64_t offset = (numel + 255) / 256 * 256;
  Add(r, "w_scale", v1::FLOAT32, u.scale_rows, u.scale_cols, &offset);
  AddHostShm(r, "/fp8", offset);
  testing::HeapMapper mapper;
  auto layout = BuildEngineLayout(r, mapper);
  EXPECT_TRUE(layout.ok()) << layout.status();
  if (!layout.ok()) return layout.status();
  std::mt19937 rng(5);
  int64_t rows = u.tensor_shape[0], cols = 1;
  for (size_t i = 1; i < u.tensor_shape.size(); ++i) cols *= u.tensor_shape[i];
  Tensor t = RandomTensor(u.segment.empty() ? "w" : "t", v1::BFLOAT16, rows,
                          cols, rng);
  t = OnTheWire(t, v1::FLOAT8_E4M3FN, u.wire_rows, u.wire_cols, false,
                u.wire_rows == 0);
  t.spec.clear_shape();
  for (int64_t d : u.tensor_shape) t.spec.add_shape(d);
  Manifest m;
  *m.Add() = t.spec;
  return BuildCopyPlan(m, 4096, {*layout}).status();
}

TEST(QuantScatterTest, OnTheWireAUseIsWholeBlocksOfBothAtEachEdge) {
  const std::string cut = "which are not whole blocks of it";
  const std::vector<WireUse> uses = {
      // The whole tensor, the same blocks: planned.
      {{256, 128}, 128, 128, 2, 1, {}, {256, 128}, 128, 128, ""},
      // Per row into blocks of 128 rows as wide as the target: refused
      // (one scale a row is not one a block).
      {{256, 128},
       128,
       128,
       2,
       1,
       {},
       {256, 128},
       0,
       0,
       "(per row) but the target quantises to float8_e4m3fn (128 x 128)"},
      // A stacked target [2, 128, 128] is quantised as its 256 x 128
      // matrix, the tensor of the same shape as its 2 x 16384 view.
      {{2, 128, 128},
       128,
       128,
       2,
       1,
       {},
       {2, 128, 128},
       128,
       128,
       "the parameter's blocks are of its 256 x 128 matrix, the tensor's of "
       "its 2 x 16384 view"},
      // The second block row of the tensor, whole: planned.
      {{128, 128},
       128,
       128,
       1,
       1,
       {128, 128, 0, 128, 128},
       {256, 128},
       128,
       128,
       ""},
      // Rows from the middle of a block to the tensor's end: the target's
      // blocks start where the tensor's don't.
      {{192, 128},
       128,
       128,
       2,
       1,
       {64, 192, 0, 128, 128},
       {256, 128},
       128,
       128,
       "the segment reads rows [64, 256) x cols [0, 128) of the tensor's "
       "256x128 matrix, " +
           cut},
      // Rows that end inside a block, short of the tensor's end.
      {{64, 128},
       128,
       128,
       1,
       1,
       {0, 64, 0, 128, 128},
       {256, 128},
       128,
       128,
       "rows [0, 64) x cols [0, 128) of the tensor's 256x128 matrix, " + cut},
      // Columns that end inside a block, short of the tensor's end.
      {{128, 64},
       128,
       128,
       1,
       1,
       {0, 128, 0, 64, 64},
       {128, 256},
       128,
       128,
       "rows [0, 128) x cols [0, 64) of the tensor's 128x256 matrix, " + cut},
      // Two rows of 64 laid into one row of 128 (a contiguous run): the
      // tensor's 1 x 128 blocks are its rows, the target's is both.
      {{1, 128},
       1,
       128,
       1,
       1,
       {0, 2, 0, 64, 64},
       {2, 64},
       1,
       128,
       "rows [0, 2) x cols [0, 64) of the tensor's 2x64 matrix, " + cut},
  };
  for (const WireUse& u : uses) {
    SCOPED_TRACE(u.says.empty() ? "planned" : u.says);
    const absl::Status s = PlanWireUse(u);
    if (u.says.empty()) {
      EXPECT_TRUE(s.ok()) << s;
      continue;
    }
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_THAT(std::string(s.message()), HasSubstr(u.says));
    EXPECT_THAT(
        std::string(s.message()),
        HasSubstr("tensor '" + std::string(u.segment.empty() ? "w" : "t") +
                  "' -> engine 'fp8' parameter 'w'"));
  }
}

// What planning `m` for an engine registered as `r` (heap memory) says.
absl::Status PlanOf(const v1::RegisterEngineRequest& r, const Manifest& m) {
  testing::HeapMapper mapper;
  auto layout = BuildEngineLayout(r, mapper);
  if (!layout.ok()) return layout.status();
  return BuildCopyPlan(m, 4096, {*layout}).status();
}

// A tensor quantised on the wire is checked as such before its shape: into
// a plain parameter it is refused as FP8 whatever its shape; into an FP8
// target of another shape the shape is what is wrong.
TEST(QuantScatterTest, OnTheWireTheFormIsCheckedWhereItDecides) {
  std::mt19937 rng(3);
  Tensor t = OnTheWire(RandomTensor("w", v1::BFLOAT16, 128, 256, rng),
                       v1::FLOAT8_E4M3FN, 128, 128, false);
  Manifest m;
  *m.Add() = t.spec;
  {
    v1::RegisterEngineRequest r;
    r.set_engine_id("plain");
    int64_t offset = 0;
    Add(r, "w", v1::BFLOAT16, 256, 128, &offset);
    AddHostShm(r, "/plain", offset);
    const absl::Status s = PlanOf(r, m);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_THAT(std::string(s.message()),
                HasSubstr("arrives quantised to float8_e4m3fn but the "
                          "parameter (bfloat16) is not an FP8 target"));
  }
  {
    const v1::RegisterEngineRequest r = OneFp8Weight(256, 128, 2, 1);
    const absl::Status s = PlanOf(r, m);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_THAT(std::string(s.message()),
                HasSubstr("shape [128, 256] does not match the registered "
                          "[256, 128]"));
  }
}

// An engine marked lost during an update (it died, or was unregistered)
// is not written any more: neither its FP8 values nor its scales. The
// same update without the mark writes both (the test can tell).
TEST(QuantScatterTest, ALostEnginesFp8ParametersAreNotWritten) {
  std::mt19937 rng(3);
  const std::vector<Tensor> tensors = {
      RandomTensor("w", v1::BFLOAT16, 128, 256, rng)};
  const v1::RegisterEngineRequest r = OneFp8Weight(128, 256, 1, 2);
  for (bool lost : {true, false}) {
    SCOPED_TRACE(lost ? "lost" : "not lost");
    testing::HeapMapper mapper;
    auto layout = Install(r, tensors, 4096, mapper, nullptr, lost);
    ASSERT_NE(layout, nullptr);
    for (int i : {0, 1}) {
      const std::string bytes = Bytes(*layout, i);
      EXPECT_EQ(bytes == std::string(bytes.size(), '\0'), lost)
          << "parameter " << i;
    }
  }
}

// An FP8 parameter [4, 128] taken from rows 0-3, columns 0-127 of a
// bfloat16 tensor [5, 129], in chunks of 128 elements: row r of the
// source splits at column 128 - r, so row 1 leaves a run of one element
// for the next chunk, and the chunks also carry row 4, which no element
// of the parameter comes from. The parameter is the quantised sub-matrix.
TEST(QuantScatterTest, RunsOfOneElementAndRowsOutsideTheSegment) {
  std::mt19937 rng(11);
  const std::vector<Tensor> tensors = {
      RandomTensor("w", v1::BFLOAT16, 5, 129, rng)};
  v1::RegisterEngineRequest r;
  r.set_engine_id("fp8");
  int64_t offset = 0;
  v1::Parameter* w = Add(r, "w", v1::FLOAT8_E4M3FN, 4, 128, &offset);
  Quantize(w, v1::FLOAT8_E4M3FN, "w_scale_inv", v1::QUANT_SCHEME_BLOCK,
           v1::SCALE_FORM_DEQUANT);
  AddSegment(w, "w", 0, 4, 0, 128, 0, 128);
  Add(r, "w_scale_inv", v1::FLOAT32, 1, 1, &offset);
  AddHostShm(r, "/fp8", offset);
  const auto ref = Reference(Widen(tensors[0], 129, 0, 4, 0, 128), 4, 128,
                             {v1::FLOAT8_E4M3FN, 128, 128, false});
  testing::HeapMapper mapper;
  auto layout = Install(r, tensors, 256, mapper);
  ASSERT_NE(layout, nullptr);
  EXPECT_TRUE(Bytes(*layout, 0) == ref.first);
  EXPECT_TRUE(Bytes(*layout, 1) == ref.second);
}

// One random bfloat16 tensor "w" [256, 256] (from `seed`) and its manifest.
struct Bf16Weight {
  std::vector<Tensor> tensors;
  Manifest manifest;
};
Bf16Weight RandomBf16Weight(unsigned seed) {
  std::mt19937 rng(seed);
  Bf16Weight w;
  w.tensors = {RandomTensor("w", v1::BFLOAT16, 256, 256, rng)};
  *w.manifest.Add() = w.tensors[0].spec;
  return w;
}

// A fresh QuantScatter fed `chunks` of `plan` in that order from the
// packed stream `bytes`; the first failure, or OK.
absl::Status FeedChunks(const CopyPlan& plan, const std::string& bytes,
                        const std::vector<int64_t>& chunks) {
  QuantScatter q;
  q.Reset(plan);
  for (int64_t k : chunks) {
    WS_RETURN_IF_ERROR(q.Feed(plan, k,
                              reinterpret_cast<const uint8_t*>(bytes.data()) +
                                  plan.chunks.chunks[k].offset,
                              nullptr, nullptr));
  }
  return absl::OkStatus();
}

// QuantScatter alone: a plan without FP8 targets feeds nothing; a plan
// whose pieces fall outside their target's rectangle, or reach a second
// row of blocks while the first is still open, is refused (INTERNAL) and
// nothing is written outside the band.
TEST(QuantScatterTest, ABrokenPlanIsRefusedNotWrittenOutsideItsBand) {
  std::mt19937 rng(5);
  const std::vector<Tensor> tensors = {
      RandomTensor("w", v1::BFLOAT16, 256, 256, rng)};
  Manifest m;
  *m.Add() = tensors[0].spec;
  testing::HeapMapper mapper;
  {
    v1::RegisterEngineRequest plain;
    plain.set_engine_id("bf16");
    int64_t offset = 0;
    Add(plain, "w", v1::BFLOAT16, 256, 256, &offset);
    AddHostShm(plain, "/bf16", offset);
    auto layout = BuildEngineLayout(plain, mapper);
    ASSERT_TRUE(layout.ok()) << layout.status();
    auto plan = BuildCopyPlan(m, 4096, {*layout});
    ASSERT_TRUE(plan.ok()) << plan.status();
    EXPECT_TRUE(FeedChunks(**plan, tensors[0].bytes, {0}).ok());
  }
  auto layout = BuildEngineLayout(OneFp8Weight(256, 256, 2, 2), mapper);
  ASSERT_TRUE(layout.ok()) << layout.status();
  // One chunk holds the whole tensor (band 0 then band 1); chunks of 256
  // bytes hold half a row each.
  auto whole = BuildCopyPlan(m, 1 << 20, {*layout});
  auto halves = BuildCopyPlan(m, 256, {*layout});
  ASSERT_TRUE(whole.ok() && halves.ok());
  auto feed = [&](const CopyPlan& plan, std::vector<int64_t> chunks) {
    return FeedChunks(plan, tensors[0].bytes, chunks);
  };
  EXPECT_TRUE(feed(**whole, {0}).ok());
  for (int side = 0; side < 4; ++side) {
    SCOPED_TRACE(side);
    CopyPlan bad = **whole;
    QuantRect& r = bad.quant[0].rect;
    (side == 0   ? r.r0
     : side == 1 ? r.r1
     : side == 2 ? r.c0
                 : r.c1) += side % 2 == 0 ? 1 : -1;
    const absl::Status s = feed(bad, {0});
    EXPECT_EQ(s.code(), absl::StatusCode::kInternal) << s;
    EXPECT_THAT(s.message(), HasSubstr("outside its rows of blocks"));
  }
  // One row: a rectangle one column short is caught by its right edge
  // alone (no other check notices: the row's count fits no band).
  {
    const std::vector<Tensor> row = {
        RandomTensor("w", v1::BFLOAT16, 1, 256, rng)};
    Manifest m1;
    *m1.Add() = row[0].spec;
    auto one = BuildEngineLayout(OneFp8Weight(1, 256, 1, 2), mapper);
    ASSERT_TRUE(one.ok()) << one.status();
    auto plan1 = BuildCopyPlan(m1, 1 << 20, {*one});
    ASSERT_TRUE(plan1.ok()) << plan1.status();
    CopyPlan bad = **plan1;
    bad.quant[0].rect.c1 -= 1;
    const absl::Status s = FeedChunks(bad, row[0].bytes, {0});
    EXPECT_EQ(s.code(), absl::StatusCode::kInternal) << s;
  }
  // Half a row of band 0, then a chunk of band 1: band 0 is still open.
  // (Into a fresh engine: nothing may be written, no band was complete.)
  testing::HeapMapper fresh_mapper;
  auto fresh = BuildEngineLayout(OneFp8Weight(256, 256, 2, 2), fresh_mapper);
  ASSERT_TRUE(fresh.ok()) << fresh.status();
  auto fresh_halves = BuildCopyPlan(m, 256, {*fresh});
  ASSERT_TRUE(fresh_halves.ok()) << fresh_halves.status();
  const int64_t band1 = 128 * 2;  // row 128's first half-row chunk
  ASSERT_EQ((*fresh_halves)->chunks.chunks[band1].offset, 128 * 256 * 2);
  EXPECT_TRUE(feed(**halves, {0, 1}).ok());
  const absl::Status s = feed(**fresh_halves, {0, band1});
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal) << s;
  EXPECT_THAT(s.message(), HasSubstr("out of order"));
  EXPECT_TRUE(Bytes(**fresh, 0) == std::string(256 * 256, '\0'));
  EXPECT_TRUE(Bytes(**fresh, 1) == std::string(2 * 2 * 4, '\0'));
}

// What a stream holds open: the float32 row of blocks being filled, from
// its first element (band 0 too) until its last; nothing once it is
// written, though its memory is kept for the next band.
TEST(QuantScatterTest, OpenBytesAreTheBandBeingFilled) {
  const Bf16Weight w = RandomBf16Weight(7);
  const std::vector<Tensor>& tensors = w.tensors;
  const Manifest& m = w.manifest;
  testing::HeapMapper mapper;
  auto layout = BuildEngineLayout(OneFp8Weight(256, 256, 2, 2), mapper);
  ASSERT_TRUE(layout.ok()) << layout.status();
  auto plan = BuildCopyPlan(m, 256, {*layout});  // half a row a chunk
  ASSERT_TRUE(plan.ok()) << plan.status();
  QuantScatter q;
  q.Reset(**plan);
  const int64_t band = 128 * 256 * 4;
  auto feed = [&](int64_t k) {
    ASSERT_TRUE(
        q.Feed(**plan, k,
               reinterpret_cast<const uint8_t*>(tensors[0].bytes.data()) +
                   (*plan)->chunks.chunks[k].offset,
               nullptr, nullptr)
            .ok());
  };
  EXPECT_EQ(q.open_bytes(), 0);
  feed(0);
  EXPECT_EQ(q.open_bytes(), band);
  for (int64_t k = 1; k < 256; ++k) feed(k);  // rows 0-127: band 0 written
  EXPECT_EQ(q.open_bytes(), 0);
  feed(256);
  EXPECT_EQ(q.open_bytes(), band);
  for (int64_t k = 257; k < 512; ++k) feed(k);
  EXPECT_EQ(q.open_bytes(), 0);
}

// Trainer "trainer-7"'s registered source: one 256 x 256 bfloat16 tensor
// in an allocation the trainer truncated (every read faults).
struct ShrunkTrainer {
  std::shared_ptr<testing::ShrunkRegion> region =
      std::make_shared<testing::ShrunkRegion>(256 * 256 * 2);
  Source source;
  ShrunkTrainer() {
    source.id = "trainer-7";
    source.regions = {region};
    source.placements = {{0, 0}};
  }
};

// An FP8 target fed from a registered source whose memory its trainer
// truncated: the piece is refused (DATA_LOSS, naming the source: "register
// the source again"), not read as zeros, and nothing reaches the engine.
TEST(QuantScatterTest, AnFp8PieceFromASourceThatShrankIsRefusedNamingIt) {
  const Bf16Weight w = RandomBf16Weight(9);
  const std::vector<Tensor>& tensors = w.tensors;
  const Manifest& m = w.manifest;
  testing::HeapMapper mapper;
  auto layout = BuildEngineLayout(OneFp8Weight(256, 256, 2, 2), mapper);
  ASSERT_TRUE(layout.ok()) << layout.status();
  auto plan = BuildCopyPlan(m, 1 << 20, {*layout});
  ASSERT_TRUE(plan.ok()) << plan.status();
  ShrunkTrainer trainer;
  ASSERT_NE(trainer.region->data(), nullptr);
  QuantScatter q;
  q.Reset(**plan);
  const absl::Status s = q.Feed(
      **plan, 0, reinterpret_cast<const uint8_t*>(tensors[0].bytes.data()),
      &trainer.source, nullptr);
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_THAT(s.message(),
              ::testing::HasSubstr("of source 'trainer-7' shrank under the "
                                   "daemon"))
      << s;
  EXPECT_TRUE(trainer.region->faulted());
  EXPECT_TRUE(Bytes(**layout, 0) == std::string(256 * 256, '\0'));
  EXPECT_TRUE(Bytes(**layout, 1) == std::string(2 * 2 * 4, '\0'));
}

// The same through the host data plane: the update ends DATA_LOSS at
// Drain. And when the chunk's copies failed first (a broken plan: a copy
// of bytes no tensor holds), that first error is the one reported, not
// the FP8 piece's after it.
TEST(QuantScatterTest, ThePlaneReportsAnFp8PiecesLossAfterItsChunksFirstError) {
  const Bf16Weight w = RandomBf16Weight(9);
  testing::HeapMapper mapper;
  auto layout = BuildEngineLayout(OneFp8Weight(256, 256, 2, 2), mapper);
  ASSERT_TRUE(layout.ok()) << layout.status();
  auto plan = BuildCopyPlan(w.manifest, 1 << 20, {*layout});
  ASSERT_TRUE(plan.ok()) << plan.status();
  for (bool broken_copy : {false, true}) {
    ShrunkTrainer trainer;
    ASSERT_NE(trainer.region->data(), nullptr);
    auto p = std::make_shared<CopyPlan>(**plan);
    if (broken_copy) {
      CopyOp op;
      op.src_offset = 256 * 256 * 2;  // past the only tensor
      op.rows = op.cols = 1;
      op.src_dtype = op.dst_dtype = v1::UINT8;
      p->ops_by_chunk[0].push_back(op);
    }
    HostDataPlane plane({});
    ASSERT_TRUE(plane.BeginFromSource(p, {}, trainer.source).ok());
    const absl::Status s = plane.Drain(absl::Now() + absl::Seconds(20));
    if (broken_copy) {
      EXPECT_EQ(s.code(), absl::StatusCode::kInternal) << s;
      EXPECT_THAT(s.message(), HasSubstr("that no tensor of the registered "
                                         "source 'trainer-7' holds"));
    } else {
      EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
      EXPECT_THAT(s.message(), HasSubstr("of source 'trainer-7' shrank under "
                                         "the daemon"));
    }
    EXPECT_TRUE(Bytes(**layout, 0) == std::string(256 * 256, '\0'));
  }
}

// An FP8 engine whose scales live in an allocation of their own that its
// owner shrank: writing a band's scales faults in the guard's window (the
// weight's and the scales' regions both armed), the scale region is marked
// faulted for Finish to drop the engine, and the daemon lives on.
TEST(QuantScatterTest, ScalesInAShrunkAllocationOfTheirOwnFailTheEngineOnly) {
  const Bf16Weight w = RandomBf16Weight(11);
  const std::vector<Tensor>& tensors = w.tensors;
  const Manifest& m = w.manifest;
  v1::RegisterEngineRequest r = OneFp8Weight(256, 256, 2, 2);
  r.mutable_parameters(1)->set_allocation(1);
  r.mutable_parameters(1)->set_offset(0);
  r.mutable_allocations(0)->set_size(256 * 256);
  v1::Allocation* scales = r.add_allocations();
  scales->set_kind(v1::MEMORY_HOST_SHM);
  scales->set_handle("/scales");
  scales->set_size(2 * 2 * 4);
  struct Mapper : MemoryMapper {
    absl::StatusOr<std::shared_ptr<MappedRegion>> Open(
        const v1::Allocation& a) override {
      if (a.handle() == "/scales") {
        shrunk = std::make_shared<testing::ShrunkRegion>(a.size());
        return std::shared_ptr<MappedRegion>(shrunk);
      }
      return std::shared_ptr<MappedRegion>(
          std::make_shared<testing::HeapRegion>(a.size()));
    }
    std::shared_ptr<testing::ShrunkRegion> shrunk;
  } mapper;
  auto layout = BuildEngineLayout(r, mapper);
  ASSERT_TRUE(layout.ok()) << layout.status();
  ASSERT_NE(mapper.shrunk, nullptr);
  ASSERT_NE(mapper.shrunk->data(), nullptr);
  auto plan = BuildCopyPlan(m, 1 << 20, {*layout});
  ASSERT_TRUE(plan.ok()) << plan.status();
  QuantScatter q;
  q.Reset(**plan);
  EXPECT_TRUE(q.Feed(**plan, 0,
                     reinterpret_cast<const uint8_t*>(tensors[0].bytes.data()),
                     nullptr, nullptr)
                  .ok());
  EXPECT_TRUE(mapper.shrunk->faulted());
  EXPECT_FALSE((*layout)->regions[0]->faulted());
}

TEST(QuantScatterTest, PlanRefusesPatchesAndSourcesThatCantBeQuantised) {
  const v1::RegisterEngineRequest r = OneFp8Weight(4, 8, 1, 1);
  testing::HeapMapper mapper;
  auto layout = BuildEngineLayout(r, mapper);
  ASSERT_TRUE(layout.ok()) << layout.status();
  Manifest m;
  v1::TensorSpec* t = m.Add();
  t->set_name("w");
  t->set_dtype(v1::BFLOAT16);
  t->add_shape(4);
  t->add_shape(8);
  absl::StatusOr<std::shared_ptr<const CopyPlan>> plan;
  for (int64_t nnz : {1, 3}) {  // one changed element is a patch too
    t->set_sparse_nnz(nnz);
    plan = BuildCopyPlan(m, 256, {*layout});
    EXPECT_EQ(plan.status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_THAT(plan.status().message(),
                HasSubstr("tensor 'w' -> engine 'fp8' parameter 'w': a sparse "
                          "patch can't update an FP8 target"));
  }
  for (v1::DType d : {v1::INT32, v1::FLOAT8_E4M3FN, v1::FLOAT64}) {
    t->set_sparse_nnz(0);
    t->set_dtype(d);
    plan = BuildCopyPlan(m, 256, {*layout});
    EXPECT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(plan.status().message(), HasSubstr("can't be quantised"));
  }
  // The scale parameter is no checkpoint tensor: sending it is refused.
  t->set_dtype(v1::FLOAT32);
  t->set_name("w_scale_inv");
  t->set_shape(0, 1);
  t->set_shape(1, 1);
  plan = BuildCopyPlan(m, 256, {*layout});
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(plan.status().message(), HasSubstr("is not a parameter"));
}

// The rows of blocks that the uses of one tensor hold at once count
// against the host staging budget, next to the staging buffers.
TEST(QuantScatterTest, RowsOfBlocksCountAgainstTheStagingBudget) {
  v1::RegisterEngineRequest r;
  r.set_engine_id("fp8");
  int64_t offset = 0;
  for (const std::string name : {"a", "b"}) {
    v1::Parameter* p = Add(r, name, v1::FLOAT8_E4M3FN, 300, 260, &offset);
    Quantize(p, v1::FLOAT8_E4M3FN, name + "_scale", v1::QUANT_SCHEME_BLOCK,
             v1::SCALE_FORM_DEQUANT);
    AddSegment(p, "w", 0, 300, 0, 260, 0, 0);
    Add(r, name + "_scale", v1::FLOAT32, 3, 3, &offset);
  }
  AddHostShm(r, "/fp8", offset);
  testing::HeapMapper mapper;
  auto layout = BuildEngineLayout(r, mapper);
  ASSERT_TRUE(layout.ok()) << layout.status();
  Manifest m;
  v1::TensorSpec* t = m.Add();
  t->set_name("w");
  t->set_dtype(v1::FLOAT32);
  t->add_shape(300);
  t->add_shape(260);
  auto plan = BuildCopyPlan(m, 4096, {*layout});
  ASSERT_TRUE(plan.ok()) << plan.status();
  // Two uses of "w" fill a 128 x 260 float32 row of blocks each.
  EXPECT_EQ((*plan)->quant_band_bytes, 2 * 128 * 260 * 4);
  const int64_t need = 2 * 4096 + 2 * 128 * 260 * 4;
  v1::StartWeightUpdateRequest request;
  HostDataPlane tight({/*staging_buffers=*/2, /*staging_budget=*/need - 1});
  const absl::Status s = tight.Begin(*plan, request);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(s.message(), HasSubstr("FP8 targets' rows of blocks"));
  HostDataPlane enough({/*staging_buffers=*/2, /*staging_budget=*/need});
  EXPECT_TRUE(enough.Begin(*plan, request).ok());
  enough.Abort();
}

// The receipt cases of tests/vectors/fp8.json installed by the daemon's
// host data plane: ComputeReceipt of the memory equals the vector.
TEST(QuantScatterTest, ReceiptsOfInstalledFp8EnginesMatchTheVectors) {
  std::ifstream in("tests/vectors/fp8.json");
  ASSERT_TRUE(in.good());
  std::stringstream text;
  text << in.rdbuf();
  google::protobuf::Struct v;
  ASSERT_TRUE(google::protobuf::util::JsonStringToMessage(text.str(), &v).ok());
  const auto& cases = v.fields().at("receipts").list_value().values();
  ASSERT_GE(cases.size(), 3);
  for (const auto& c : cases) {
    const auto& f = c.struct_value().fields();
    SCOPED_TRACE(f.at("name").string_value());
    v1::RegisterEngineRequest r;
    r.set_engine_id("e");
    int64_t offset = 0;
    for (const auto& p : f.at("layout").list_value().values()) {
      std::string json;
      ASSERT_TRUE(google::protobuf::util::MessageToJsonString(p, &json).ok());
      v1::Parameter* param = r.add_parameters();
      ASSERT_TRUE(
          google::protobuf::util::JsonStringToMessage(json, param).ok());
      param->set_offset(offset);
      int64_t numel = 1;
      for (int64_t d : param->shape()) numel *= d;
      offset += (numel * ElementSize(param->dtype()) + 255) / 256 * 256;
    }
    AddHostShm(r, "/v", offset);
    std::vector<Tensor> tensors;
    for (const auto& t : f.at("tensors").list_value().values()) {
      std::string json;
      ASSERT_TRUE(google::protobuf::util::MessageToJsonString(t, &json).ok());
      google::protobuf::Struct s;
      ASSERT_TRUE(google::protobuf::util::JsonStringToMessage(json, &s).ok());
      Tensor x;
      x.spec.set_name(s.fields().at("name").string_value());
      v1::DType d = v1::DTYPE_UNSPECIFIED;
      ASSERT_TRUE(v1::DType_Parse(s.fields().at("dtype").string_value(), &d));
      x.spec.set_dtype(d);
      for (const auto& dim : s.fields().at("shape").list_value().values()) {
        x.spec.add_shape(dim.number_value());
      }
      x.bytes = absl::HexStringToBytes(s.fields().at("hex").string_value());
      tensors.push_back(x);
    }
    testing::HeapMapper mapper;
    std::shared_ptr<const CopyPlan> plan;
    auto layout = Install(r, tensors, 256, mapper, &plan);
    ASSERT_NE(layout, nullptr);
    auto receipt = ComputeReceipt(*layout, plan->dense_uses[0]);
    ASSERT_TRUE(receipt.ok()) << receipt.status();
    uint64_t want = 0;
    ASSERT_TRUE(absl::SimpleHexAtoi(f.at("checksum").string_value(), &want));
    EXPECT_EQ(receipt->checksum(), want);
    EXPECT_EQ(receipt->parameters(), f.at("parameters").number_value());
    EXPECT_EQ(receipt->bytes(), f.at("bytes").number_value());
    // What the plan says it writes is what the receipt covers.
    EXPECT_EQ(plan->bytes_by_engine[0], receipt->bytes());
  }
}

}  // namespace
}  // namespace weightsync

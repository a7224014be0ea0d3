// Shared by kernel_math_test (CPU) and patch_gpu_test (GPU): engine layouts
// built by the daemon's own code (BuildEngineLayout, BuildCopyPlan) in heap
// memory, the host references (ComputeReceipt, ApplySparsePatch) run on
// them, and the translation of a layout into the kernels' inputs
// (ReceiptRegion, SparseUse), i.e. what the GPU worker will do when it is
// wired in.
#ifndef WEIGHTSYNC_BACKENDS_CUDA_PATCH_TEST_UTIL_H_
#define WEIGHTSYNC_BACKENDS_CUDA_PATCH_TEST_UTIL_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "backends/cuda/kernel_math.h"
#include "common/checksum.h"
#include "common/dtype.h"
#include "daemon/core/copy_plan.h"
#include "daemon/core/engine_layout.h"
#include "tests/testing/heap_memory.h"
#include "weightsync/v1/engine_service.pb.h"
#include "weightsync/v1/types.pb.h"

namespace weightsync {
namespace patch_test {

inline void FillRandom(uint8_t* p, int64_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const uint64_t v = rng();
    std::memcpy(p + i, &v, 8);
  }
  for (; i < n; ++i) p[i] = static_cast<uint8_t>(rng());
}

// Builds a RegisterEngineRequest parameter by parameter, each placed after
// the previous one at `misalign` bytes past a 64-byte boundary.
class RequestBuilder {
 public:
  explicit RequestBuilder(std::string engine_id) {
    request_.set_engine_id(std::move(engine_id));
  }
  v1::Parameter* Add(const std::string& name, v1::DType dtype,
                     std::vector<int64_t> shape, int64_t misalign = 0) {
    v1::Parameter* p = request_.add_parameters();
    p->set_name(name);
    p->set_dtype(dtype);
    int64_t numel = 1;
    for (int64_t d : shape) {
      p->add_shape(d);
      numel *= d;
    }
    const int64_t offset = (next_ + 63) / 64 * 64 + misalign;
    p->set_offset(offset);
    next_ = offset + numel * ElementSize(dtype);
    return p;
  }
  static void AddSegment(v1::Parameter* p, const std::string& source,
                         std::vector<int64_t> source_shape, int64_t row_begin,
                         int64_t row_count, int64_t col_begin,
                         int64_t col_count, int64_t dest_offset,
                         int64_t dest_row_stride) {
    v1::Segment* s = p->add_segments();
    s->set_source(source);
    for (int64_t d : source_shape) s->add_source_shape(d);
    s->set_row_begin(row_begin);
    s->set_row_count(row_count);
    s->set_col_begin(col_begin);
    s->set_col_count(col_count);
    s->set_dest_offset(dest_offset);
    s->set_dest_row_stride(dest_row_stride);
  }
  v1::RegisterEngineRequest Finish() {
    v1::Allocation* a = request_.add_allocations();
    a->set_kind(v1::MEMORY_HOST_SHM);
    a->set_handle("/patch-test");
    a->set_size((next_ + 4095) / 4096 * 4096);
    a->set_device_uuid("host");
    return request_;
  }

 private:
  v1::RegisterEngineRequest request_;
  int64_t next_ = 0;
};

// An engine of mixed parameters: element sizes 1, 2, 4 and 8; whole
// tensors of several tiles with a misaligned start; strided side-by-side
// segments (narrow rows, several per tile); rows wider than a tile; rows of
// one tile; contiguous row blocks; fused qkv; a segment whose source is
// not in the update ("f.other", left out of ReceiptSources()).
inline v1::RegisterEngineRequest ReceiptEngine() {
  RequestBuilder b("receipts");
  b.Add("a.weight", v1::BFLOAT16, {317, 129}, 2);
  b.Add("b.bias", v1::FLOAT32, {5}, 0);
  b.Add("c.weight", v1::FLOAT32, {100000}, 4);
  v1::Parameter* d = b.Add("d.weight", v1::BFLOAT16, {64, 300}, 6);
  RequestBuilder::AddSegment(d, "d.left", {64, 100}, 0, 64, 0, 100, 0, 300);
  RequestBuilder::AddSegment(d, "d.right", {64, 400}, 0, 64, 100, 200, 100,
                             300);
  v1::Parameter* e = b.Add("e.q", v1::INT8, {4, 40000}, 3);
  RequestBuilder::AddSegment(e, "e.src", {4, 50000}, 0, 4, 1000, 30000, 5000,
                             40000);
  v1::Parameter* f = b.Add("f.step", v1::INT64, {37, 11}, 8);
  RequestBuilder::AddSegment(f, "f.src", {74, 11}, 37, 20, 0, 11, 0, 0);
  RequestBuilder::AddSegment(f, "f.other", {17, 11}, 0, 17, 0, 11, 220, 11);
  v1::Parameter* g = b.Add("g.w", v1::FLOAT16, {3, 6100}, 0);
  RequestBuilder::AddSegment(g, "g.src", {3, 6000}, 0, 3, 0, 6000, 50, 6100);
  v1::Parameter* qkv = b.Add("qkv", v1::BFLOAT16, {16, 8}, 16);
  RequestBuilder::AddSegment(qkv, "q", {16, 8}, 8, 8, 0, 8, 0, 8);
  RequestBuilder::AddSegment(qkv, "k", {8, 8}, 4, 4, 0, 8, 64, 8);
  RequestBuilder::AddSegment(qkv, "v", {8, 8}, 4, 4, 0, 8, 96, 8);
  // Rows narrower than a 16-byte vector, strided (element-wise tiles).
  v1::Parameter* h = b.Add("h.tiny_rows", v1::FLOAT32, {5000, 3}, 12);
  RequestBuilder::AddSegment(h, "h.src", {5000, 2}, 0, 5000, 0, 2, 1, 3);
  return b.Finish();
}

inline absl::flat_hash_set<std::string> ReceiptSources() {
  return {"a.weight", "b.bias", "c.weight", "d.left", "d.right", "e.src",
          "f.src",    "g.src",  "q",        "k",      "v",       "h.src"};
}

// The ReceiptRegions that sum what ComputeReceipt sums for `engine` and
// `sources`, with the engine's region 0 at `region_base` (host or device
// address; the layout's own regions are not read), every term going to
// `out`. Not planned yet (PlanReceiptRegions).
inline std::vector<cuda::ReceiptRegion> ReceiptRegionsOf(
    const EngineLayout& engine, const absl::flat_hash_set<std::string>& sources,
    const uint8_t* region_base, unsigned long long* out) {
  std::vector<cuda::ReceiptRegion> regions;
  for (const ParameterLayout& p : engine.parameters) {
    const int64_t es = ElementSize(p.dtype);
    for (const SegmentLayout& s : p.segments) {
      if (!sources.contains(s.source)) continue;
      cuda::ReceiptRegion r{};
      r.base = region_base + p.offset + s.dest_offset * es;
      r.rows = s.row_count;
      r.cols = s.col_count;
      r.row_stride_bytes = s.dest_row_stride * es;
      r.salt = ParameterSalt(p.name);
      r.first_index = static_cast<uint64_t>(s.dest_offset);
      r.out = out;
      r.es = static_cast<int32_t>(es);
      regions.push_back(r);
    }
  }
  return regions;
}

// The reference sum of one region, element by element (common/checksum.h),
// reading host memory at `base` in place of r.base.
inline uint64_t ReferenceRegionSum(const cuda::ReceiptRegion& r,
                                   const uint8_t* base) {
  uint64_t sum = 0;
  const int64_t irs = r.es > 0 ? r.row_stride_bytes / r.es : 0;
  for (int64_t row = 0; row < r.rows; ++row) {
    sum += RunTerms(
        r.salt,
        r.first_index + static_cast<uint64_t>(row) * static_cast<uint64_t>(irs),
        base + row * r.row_stride_bytes, r.cols, r.es);
  }
  return sum;
}

// A checkpoint and an engine for sparse patches: "w" float32 [96, 200] feeds
// a bfloat16 parameter whole (implicit), a float16 shard cutting rows and
// columns, a float32 side-by-side block, two row blocks of one fused
// bfloat16 parameter; "bias" bfloat16 [200] feeds a float32 parameter whole
// and a float16 half; "ids" int32 [1000] an int32 parameter (bytewise).
inline v1::RegisterEngineRequest SparseEngine() {
  RequestBuilder b("sparse");
  b.Add("w", v1::BFLOAT16, {96, 200}, 2);
  v1::Parameter* shard = b.Add("w_shard", v1::FLOAT16, {48, 100}, 0);
  RequestBuilder::AddSegment(shard, "w", {96, 200}, 24, 48, 50, 100, 0, 0);
  v1::Parameter* side = b.Add("w_side", v1::FLOAT32, {96, 250}, 4);
  RequestBuilder::AddSegment(side, "w", {96, 200}, 0, 96, 0, 200, 25, 250);
  v1::Parameter* fused = b.Add("fused", v1::BFLOAT16, {40, 200}, 0);
  RequestBuilder::AddSegment(fused, "w", {96, 200}, 10, 20, 0, 200, 0, 200);
  RequestBuilder::AddSegment(fused, "w", {96, 200}, 60, 20, 0, 200, 4000, 200);
  b.Add("bias", v1::FLOAT32, {200}, 8);
  v1::Parameter* half = b.Add("bias_half", v1::FLOAT16, {100}, 2);
  RequestBuilder::AddSegment(half, "bias", {200}, 100, 100, 0, 1, 0, 0);
  b.Add("ids", v1::INT32, {1000}, 4);
  return b.Finish();
}

struct SparseTensor {
  std::string name;
  v1::DType dtype;
  std::vector<int64_t> shape;
};

inline std::vector<SparseTensor> SparseTensors() {
  return {{"w", v1::FLOAT32, {96, 200}},
          {"bias", v1::BFLOAT16, {200}},
          {"ids", v1::INT32, {1000}}};
}

// Float32 values that exercise conversions: NaN payloads, infinities,
// signed zeros, float and half subnormals, half overflow, bfloat16 and
// float16 rounding ties; otherwise random normal values of mixed scale.
inline float InterestingFloat(std::mt19937_64& rng) {
  static const uint32_t kSpecial[] = {
      0x7FC00001u, 0xFFA00000u, 0x7F800001u, 0x7F800000u, 0xFF800000u,
      0x00000000u, 0x80000000u, 0x00000001u, 0x807FFFFFu, 0x33800000u,
      0x477FF000u, 0x477FEFFFu, 0xC7800000u, 0x3F808000u, 0x3F818000u,
      0x3F800FFFu, 0x38800000u, 0x387FC000u, 0x3F801000u, 0x3F803000u};
  const uint64_t r = rng();
  if (r % 4 == 0) {
    const uint32_t bits =
        kSpecial[(r >> 8) % (sizeof(kSpecial) / sizeof(kSpecial[0]))];
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
  }
  std::normal_distribution<float> normal(0.0f, 1.0f);
  return std::ldexp(normal(rng), static_cast<int>((r >> 16) % 40) - 25);
}

// A patch payload (nnz int64 indices, then nnz values of `dtype`) for a
// tensor of `numel` elements: about `density` of them, in increasing order;
// with `repeats`, some indices appear two or three times in a row (the last
// value must win).
inline std::string MakePatch(v1::DType dtype, int64_t numel, double density,
                             bool repeats, uint64_t seed, int64_t* nnz) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> u(0.0, 1.0);
  std::vector<int64_t> index;
  for (int64_t i = 0; i < numel; ++i) {
    if (u(rng) >= density) continue;
    index.push_back(i);
    if (repeats && u(rng) < 0.2) {
      index.push_back(i);
      if (u(rng) < 0.5) index.push_back(i);
    }
  }
  if (index.empty()) index.push_back(numel - 1);
  *nnz = static_cast<int64_t>(index.size());
  const int64_t es = ElementSize(dtype);
  std::string payload(index.size() * (8 + es), '\0');
  std::memcpy(payload.data(), index.data(), index.size() * 8);
  uint8_t* values =
      reinterpret_cast<uint8_t*>(payload.data()) + index.size() * 8;
  for (size_t k = 0; k < index.size(); ++k) {
    if (dtype == v1::FLOAT32 || dtype == v1::BFLOAT16 || dtype == v1::FLOAT16) {
      const float f = InterestingFloat(rng);
      ConvertElements(&f, v1::FLOAT32, values + k * es, dtype, 1);
    } else {
      FillRandom(values + k * es, es, rng());
    }
  }
  return payload;
}

// The manifest of SparseTensors(), each a patch of nnz[i] entries.
inline Manifest SparseManifest(const std::vector<int64_t>& nnz) {
  Manifest m;
  const std::vector<SparseTensor> tensors = SparseTensors();
  for (size_t i = 0; i < tensors.size(); ++i) {
    v1::TensorSpec* t = m.Add();
    t->set_name(tensors[i].name);
    t->set_dtype(tensors[i].dtype);
    for (int64_t d : tensors[i].shape) t->add_shape(d);
    t->set_sparse_nnz(nnz[i]);
  }
  return m;
}

// An update of patches only, for an engine: its manifest and each tensor's
// payload.
struct PatchUpdate {
  v1::RegisterEngineRequest engine;
  Manifest manifest;
  std::vector<std::string> payloads;  // by manifest index
};

// SparseEngine() patched at about `density`: sorted indices, with
// `repeats` some repeated in a row, with `shuffle` in random order.
inline PatchUpdate SparseEngineUpdate(double density, bool repeats,
                                      bool shuffle, uint64_t seed) {
  PatchUpdate u;
  u.engine = SparseEngine();
  const std::vector<SparseTensor> tensors = SparseTensors();
  std::vector<int64_t> nnz;
  for (size_t i = 0; i < tensors.size(); ++i) {
    int64_t numel = 1;
    for (int64_t d : tensors[i].shape) numel *= d;
    int64_t n = 0;
    std::string p =
        MakePatch(tensors[i].dtype, numel, density, repeats, seed + i, &n);
    nnz.push_back(n);
    if (shuffle) {  // the same pairs in random order
      const int64_t es = ElementSize(tensors[i].dtype);
      std::vector<int64_t> order(n);
      for (int64_t k = 0; k < n; ++k) order[k] = k;
      std::shuffle(order.begin(), order.end(), std::mt19937_64(seed));
      std::string q = p;
      for (int64_t k = 0; k < n; ++k) {
        std::memcpy(&q[k * 8], &p[order[k] * 8], 8);
        std::memcpy(&q[n * 8 + k * es], &p[n * 8 + order[k] * es], es);
      }
      p = std::move(q);
    }
    u.payloads.push_back(std::move(p));
  }
  u.manifest = SparseManifest(nnz);
  return u;
}

// Every conversion on every value pattern: a float32 tensor of 2^20 random
// bit patterns, a bfloat16 and a float16 tensor of all 65536 patterns, each
// patched whole into parameters of the three float types (1-D segments);
// and every other dtype copied bytewise into a whole (implicit) parameter.
inline PatchUpdate ConversionUpdate() {
  struct Source {
    std::string name;
    v1::DType dtype;
    int64_t numel;
  };
  std::vector<Source> sources = {{"x32", v1::FLOAT32, 1 << 20},
                                 {"xbf", v1::BFLOAT16, 65536},
                                 {"xh", v1::FLOAT16, 65536}};
  RequestBuilder b("conversions");
  for (const Source& s : sources) {
    for (v1::DType to : {v1::FLOAT32, v1::BFLOAT16, v1::FLOAT16}) {
      v1::Parameter* p =
          b.Add(s.name + "_to_" + DTypeName(to), to, {s.numel}, 0);
      RequestBuilder::AddSegment(p, s.name, {s.numel}, 0, s.numel, 0, 1, 0, 0);
    }
  }
  const v1::DType kOthers[] = {v1::FLOAT64, v1::INT64,         v1::INT32,
                               v1::INT16,   v1::INT8,          v1::UINT8,
                               v1::BOOL,    v1::FLOAT8_E4M3FN, v1::FLOAT8_E5M2};
  for (v1::DType t : kOthers) {
    sources.push_back({"raw_" + DTypeName(t), t, 4099});
    b.Add(sources.back().name, t, {4099}, ElementSize(t) == 1 ? 1 : 0);
  }
  PatchUpdate u;
  u.engine = b.Finish();
  std::mt19937_64 rng(21);
  for (const Source& s : sources) {
    v1::TensorSpec* t = u.manifest.Add();
    t->set_name(s.name);
    t->set_dtype(s.dtype);
    t->add_shape(s.numel);
    t->set_sparse_nnz(s.numel);
    const int64_t es = ElementSize(s.dtype);
    std::string payload(s.numel * (8 + es), '\0');
    for (int64_t i = 0; i < s.numel; ++i) {
      std::memcpy(&payload[i * 8], &i, 8);
      const uint64_t bits = es == 2 && s.numel == 65536
                                ? static_cast<uint64_t>(i)
                                : static_cast<uint64_t>(rng());
      std::memcpy(&payload[s.numel * 8 + i * es], &bits, es);
    }
    u.payloads.push_back(std::move(payload));
  }
  return u;
}

// The kernel's view of a use, with the engine's region 0 at `region_base`.
inline cuda::SparseUse SparseUseOf(const SparsePatch::Use& u,
                                   uint8_t* region_base) {
  cuda::SparseUse s{};
  s.param = region_base + u.param_offset;
  s.dtype = static_cast<int>(u.dtype);
  s.implicit = u.implicit;
  s.row_begin = u.row_begin;
  s.row_count = u.row_count;
  s.col_begin = u.col_begin;
  s.col_count = u.col_count;
  s.dest_offset = u.dest_offset;
  s.dest_row_stride = u.dest_row_stride;
  return s;
}

// The changed elements from `before` to `after` (n elements of es bytes),
// bitwise: what DiffChanged must produce.
inline void ReferenceDiff(const uint8_t* before, const uint8_t* after,
                          int64_t n, int es, std::vector<int64_t>* index,
                          std::vector<uint8_t>* values) {
  index->clear();
  values->clear();
  for (int64_t i = 0; i < n; ++i) {
    if (std::memcmp(before + i * es, after + i * es, es) == 0) continue;
    index->push_back(i);
    values->insert(values->end(), after + i * es, after + (i + 1) * es);
  }
}

}  // namespace patch_test
}  // namespace weightsync

#endif  // WEIGHTSYNC_BACKENDS_CUDA_PATCH_TEST_UTIL_H_

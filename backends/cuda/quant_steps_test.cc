// The GPU worker's quant steps (quant_steps.h) run on the CPU as the worker
// runs them: gathers widen into the scratch (ConvertElements, as
// CopyConvert2D), flushes quantise through fp8_math.h thread by thread (as
// the kernel), in step order, reusing the scratch as the worker does. The
// engine memory they leave must equal, byte for byte, what the host data
// plane installs for the same update, whatever the chunk size (blocks cut
// anywhere), the window size, and whether the gathers read the packed
// stream or a registered source's tensors in place.
#include "backends/cuda/quant_steps.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "absl/time/clock.h"
#include "backends/cuda/fp8_math.h"
#include "backends/cuda/fused_receipts.h"
#include "backends/cuda/quant_direct.h"
#include "backends/cuda/quant_direct_emulation.h"
#include "backends/host/host_data_plane.h"
#include "common/checksum.h"
#include "common/dtype.h"
#include "daemon/core/copy_plan.h"
#include "daemon/core/engine_layout.h"
#include "daemon/core/quant_layout.h"
#include "daemon/core/receipt.h"
#include "gtest/gtest.h"
#include "tests/testing/heap_memory.h"
#include "tests/testing/layout_builders.h"

namespace weightsync {
namespace {

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
  f[0] = NAN;        // ignored by its block's amax
  f[1] = -INFINITY;  // saturates
  f[2] = -NAN;       // a NaN keeps its sign
  // The largest values last in 64 x 64 and 128 x 128 blocks (the last
  // element a thread holds).
  for (int64_t r = 63; r < rows; r += 64) {
    for (int64_t c = 63; c < cols; c += 64) {
      f[r * cols + c] = -40.0f - r / 64 - c / 64;
    }
  }
  // A row of zeros: per-row blocks of scale 1.
  for (int64_t c = 0; c < cols && rows > 3; ++c) f[3 * cols + c] = 0.0f;
  // float16: rows of subnormals (whole blocks of them: widened exactly).
  for (int64_t r = 4; dtype == v1::FLOAT16 && r < std::min<int64_t>(rows, 16);
       ++r) {
    for (int64_t c = 0; c < cols; ++c) f[r * cols + c] = 1e-7f * (c % 50);
  }
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
  // Odd offsets: the worker's FP8 and scale writes need no alignment.
  *offset += rows * std::max<int64_t>(cols, 1) * ElementSize(dtype) + 4 + 1;
  if (dtype != v1::FLOAT8_E4M3FN && dtype != v1::FLOAT8_E5M2) {
    *offset = (*offset + 255) / 256 * 256;
  }
  return p;
}

using testing::AddSegment;
using testing::Quantize;

// Every kind of quantised use: a whole bf16 tensor in 64 x 64 blocks with
// partial edges (and the same tensor copied plainly), fused q/k/v of
// float32/float16 into e5m2 with reciprocal scales, a row-parallel shard in
// per-row scales, two sources side by side, and a tensor whose rows land
// one after another (half a parameter row each).
struct Case {
  std::vector<Tensor> tensors;
  v1::RegisterEngineRequest r;
};

Case MakeCase() {
  std::mt19937 rng(11);
  Case c;
  c.tensors = {
      RandomTensor("w", v1::BFLOAT16, 150, 130, rng),
      RandomTensor("q", v1::FLOAT32, 128, 100, rng),
      RandomTensor("k", v1::FLOAT32, 64, 100, rng),
      RandomTensor("v", v1::FLOAT16, 128, 100, rng),
      RandomTensor("o_proj", v1::BFLOAT16, 70, 256, rng),
      RandomTensor("halves", v1::FLOAT16, 24, 48, rng),
      RandomTensor("big", v1::BFLOAT16, 200, 300, rng),
  };
  v1::RegisterEngineRequest& r = c.r;
  r.set_engine_id("fp8");
  int64_t offset = 0;
  Quantize(Add(r, "w", v1::FLOAT8_E4M3FN, 150, 130, &offset), v1::FLOAT8_E4M3FN,
           "w_scale_inv", v1::QUANT_SCHEME_BLOCK, v1::SCALE_FORM_DEQUANT, 64,
           64);
  Add(r, "w_scale_inv", v1::FLOAT32, 3, 3, &offset);
  AddSegment(Add(r, "w_copy", v1::BFLOAT16, 150, 130, &offset), "w", 0, 150, 0,
             130, 0, 0);
  v1::Parameter* qkv = Add(r, "qkv", v1::FLOAT8_E5M2, 192, 100, &offset);
  Quantize(qkv, v1::FLOAT8_E5M2, "qkv_scale", v1::QUANT_SCHEME_BLOCK,
           v1::SCALE_FORM_RECIPROCAL, 32, 32);
  AddSegment(qkv, "q", 64, 64, 0, 100, 0, 100);
  AddSegment(qkv, "k", 0, 64, 0, 100, 64 * 100, 100);
  AddSegment(qkv, "v", 64, 64, 0, 100, 128 * 100, 100);
  Add(r, "qkv_scale", v1::FLOAT32, 6, 4, &offset);
  v1::Parameter* o = Add(r, "o", v1::FLOAT8_E4M3FN, 70, 128, &offset);
  Quantize(o, v1::FLOAT8_E4M3FN, "o_scale", v1::QUANT_SCHEME_PER_ROW,
           v1::SCALE_FORM_RECIPROCAL);
  AddSegment(o, "o_proj", 0, 70, 128, 128, 0, 0);
  Add(r, "o_scale", v1::FLOAT32, 70, 1, &offset);
  v1::Parameter* side = Add(r, "side", v1::FLOAT8_E4M3FN, 70, 192, &offset);
  Quantize(side, v1::FLOAT8_E4M3FN, "side_scale", v1::QUANT_SCHEME_BLOCK,
           v1::SCALE_FORM_DEQUANT, 2, 64);
  AddSegment(side, "w", 0, 70, 0, 128, 0, 192);
  AddSegment(side, "o_proj", 0, 70, 0, 64, 128, 192);
  Add(r, "side_scale", v1::FLOAT32, 35, 3, &offset);
  v1::Parameter* flat = Add(r, "flat", v1::FLOAT8_E5M2, 12, 96, &offset);
  Quantize(flat, v1::FLOAT8_E5M2, "flat_scale", v1::QUANT_SCHEME_BLOCK,
           v1::SCALE_FORM_DEQUANT, 4, 32);
  AddSegment(flat, "halves", 0, 24, 0, 48, 0, 48);
  Add(r, "flat_scale", v1::FLOAT32, 3, 3, &offset);
  // Half of each of 8 source rows, one after another: no one stride (the
  // gathers, even where the whole source is there).
  v1::Parameter* part = Add(r, "part", v1::FLOAT8_E4M3FN, 4, 64, &offset);
  Quantize(part, v1::FLOAT8_E4M3FN, "part_scale", v1::QUANT_SCHEME_BLOCK,
           v1::SCALE_FORM_DEQUANT, 2, 32);
  AddSegment(part, "o_proj", 8, 8, 0, 32, 0, 32);
  Add(r, "part_scale", v1::FLOAT32, 2, 2, &offset);
  // 128 x 128 blocks (the kernel's threads hold a whole one), partial edges.
  Quantize(Add(r, "big", v1::FLOAT8_E4M3FN, 200, 300, &offset),
           v1::FLOAT8_E4M3FN, "big_scale", v1::QUANT_SCHEME_BLOCK,
           v1::SCALE_FORM_DEQUANT, 128, 128);
  Add(r, "big_scale", v1::FLOAT32, 2, 3, &offset);
  v1::Allocation* a = r.add_allocations();
  a->set_kind(v1::MEMORY_HOST_SHM);
  a->set_handle("/fp8");
  a->set_size(offset);
  return c;
}

std::string Packed(const CopyPlan& plan, const std::vector<Tensor>& tensors) {
  std::string packed(plan.chunks.total_bytes, '\0');
  for (size_t t = 0; t < tensors.size(); ++t) {
    std::memcpy(&packed[plan.chunks.tensor_offsets[t]], tensors[t].bytes.data(),
                tensors[t].bytes.size());
  }
  return packed;
}

std::shared_ptr<const CopyPlan> PlanOf(const Case& c,
                                       std::shared_ptr<const EngineLayout> e,
                                       int64_t chunk_bytes) {
  Manifest manifest;
  for (const Tensor& t : c.tensors) *manifest.Add() = t.spec;
  auto plan = BuildCopyPlan(manifest, chunk_bytes, {std::move(e)});
  EXPECT_TRUE(plan.ok()) << plan.status();
  return plan.ok() ? *plan : nullptr;
}

// The host data plane's engine memory after the update.
std::string HostInstall(const Case& c, int64_t chunk_bytes) {
  testing::HeapMapper mapper;
  auto layout = BuildEngineLayout(c.r, mapper);
  EXPECT_TRUE(layout.ok()) << layout.status();
  auto plan = PlanOf(c, *layout, chunk_bytes);
  const std::string packed = Packed(*plan, c.tensors);
  HostDataPlane plane({});
  EXPECT_TRUE(plane.Begin(plan, v1::StartWeightUpdateRequest()).ok());
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  for (const Chunk& k : plan->chunks.chunks) {
    EXPECT_TRUE(
        plane.SubmitChunk(k.index, packed.substr(k.offset, k.size), deadline)
            .ok());
  }
  EXPECT_TRUE(plane.Drain(deadline).ok());
  const MappedRegion& region = *(*layout)->regions[0];
  return std::string(reinterpret_cast<const char*>(region.data()),
                     region.size());
}

// rows x cols elements, row r at src + r * src_stride, widened or copied
// into dst + r * dst_stride (what CopyConvert2D does).
void Copy2D(const uint8_t* src, int64_t src_stride, v1::DType sd, uint8_t* dst,
            int64_t dst_stride, v1::DType dd, int64_t rows, int64_t cols) {
  for (int64_t r = 0; r < rows; ++r) {
    ConvertElements(src + r * src_stride, sd, dst + r * dst_stride, dd, cols);
  }
}

using testing::DirectShape;
using testing::RunDirectBatch;

// The worker's run of an update on the CPU: per chunk its ops, then its
// quant steps in order. `memory`: allocation id -> bytes (engine regions
// and a registered source's); `scratch` sized as the request says, filled
// with garbage a flush must never read.
class Worker {
 public:
  std::map<int64_t, uint8_t*> memory;
  std::map<int64_t, int64_t> sizes;  // of memory's allocations
  DirectShape shape = DirectShape::kKernel;
  int64_t direct_steps = 0;
  // Called with each chunk's direct jobs before they run (receipt fields).
  std::function<void(std::vector<cuda::DirectJob>&)> before_direct;
  // Called once the update has run (engine memory still there).
  std::function<void()> after_run;

  // Chunk k's direct steps, as one batch.
  void RunDirect(const std::vector<cuda::DirectJob>& jobs) {
    if (jobs.empty()) return;
    if (shape == DirectShape::kKernel) {
      RunDirectBatch<cuda::kDirectPerThread>(jobs, cuda::kDirectThreads, 5);
    } else if (shape == DirectShape::kSmall) {
      RunDirectBatch<128>(jobs, 32, 2);  // 64 x 64 blocks fill every register
    } else if (shape == DirectShape::kVec) {
      RunDirectBatch<cuda::kDirectPerThread, cuda::kVecPerThread>(
          jobs, cuda::kVecThreads, 5);
    } else if (shape == DirectShape::kVecStreaming) {
      RunDirectBatch<2, 2>(jobs, 16, 3);
    } else if (shape == DirectShape::kLean) {
      testing::RunLeanBatch(jobs);
    } else {
      RunDirectBatch<2>(jobs, 16, 3);
    }
  }

  void Run(const CopyPlan& plan, const worker::v1::BeginUpdateRequest& req,
           const std::string& packed, uint8_t* engine_base) {
    std::vector<uint8_t> scratch(req.quant_scratch_bytes(), 0xFF);
    int step = 0;
    for (const Chunk& k : plan.chunks.chunks) {
      const uint8_t* chunk =
          reinterpret_cast<const uint8_t*>(packed.data()) + k.offset;
      std::vector<cuda::DirectJob> direct;
      for (const CopyOp& op : plan.ops_by_chunk[k.index]) {
        Copy2D(chunk + op.src_offset, op.src_stride, op.src_dtype,
               engine_base + op.dst_offset, op.dst_stride, op.dst_dtype,
               op.rows, op.cols);
      }
      for (; step < req.quant_steps_size() &&
             req.quant_steps(step).chunk() == k.index;
           ++step) {
        const worker::v1::GpuQuantStep& s = req.quant_steps(step);
        if (s.has_direct()) {
          // The worker's checks, then the job it builds.
          const worker::v1::GpuQuantDirect& d = s.direct();
          const cuda::DirectExtents x = cuda::DirectExtentsOf(d);
          ASSERT_TRUE(x.ok);
          const uint8_t* src = reinterpret_cast<const uint8_t*>(packed.data());
          int64_t src_size = packed.size();
          if (d.src_allocation_id() != 0) {
            src = memory.at(d.src_allocation_id());
            src_size = sizes.at(d.src_allocation_id());
          }
          ASSERT_LE(d.src_offset() + x.src, src_size);
          ASSERT_LE(d.out().offset() + x.q, sizes.at(d.out().allocation_id()));
          ASSERT_LE(d.out().scale_offset() + x.scale,
                    sizes.at(d.out().scale_allocation_id()));
          direct.push_back(cuda::DirectJobOf(
              d, src + d.src_offset(), memory.at(d.out().allocation_id()),
              memory.at(d.out().scale_allocation_id())));
          ++direct_steps;
          continue;
        }
        if (s.has_gather()) {
          const worker::v1::GpuOp& g = s.gather();
          ASSERT_EQ(g.allocation_id(), 0);
          ASSERT_EQ(g.dst_dtype(), v1::FLOAT32);
          ASSERT_LE(
              g.dst_offset() + (g.rows() - 1) * g.dst_stride() + g.cols() * 4,
              static_cast<int64_t>(scratch.size()));
          const uint8_t* src = g.src_allocation_id() != 0
                                   ? memory.at(g.src_allocation_id())
                                   : chunk;
          Copy2D(src + g.src_offset(), g.src_stride(),
                 static_cast<v1::DType>(g.src_dtype()),
                 scratch.data() + g.dst_offset(), g.dst_stride(), v1::FLOAT32,
                 g.rows(), g.cols());
          continue;
        }
        ASSERT_TRUE(s.has_flush());
        const worker::v1::GpuQuantFlush& f = s.flush();
        ASSERT_LE(f.scratch_offset() + f.rows() * f.width() * 4,
                  static_cast<int64_t>(scratch.size()));
        ASSERT_EQ(f.scratch_offset() % 256, 0);
        cuda::QuantJob job{};
        job.x =
            reinterpret_cast<const float*>(scratch.data() + f.scratch_offset());
        job.rows = f.rows();
        job.width = f.width();
        job.x_stride = f.width();
        job.block_rows = f.block_rows();
        job.block_cols = f.block_cols();
        job.q = memory.at(f.allocation_id()) + f.offset();
        job.q_stride = f.stride();
        job.scale = memory.at(f.scale_allocation_id()) + f.scale_offset();
        job.scale_stride = f.scale_stride();
        job.e5m2 = f.format() == v1::FLOAT8_E5M2;
        job.reciprocal = f.reciprocal();
        for (int64_t b = 0; b < cuda::QuantJobBlocks(job); ++b) {
          float amax = 0.0f;
          for (uint32_t t = 0; t < 32; ++t) {
            const float part = cuda::QuantAmaxPart(job, b, t, 32);
            amax = part > amax ? part : amax;
          }
          for (uint32_t t = 0; t < 32; ++t) {
            cuda::QuantWritePart(job, b, amax, t, 32);
          }
        }
        // The worker may hand the slot to the next gathers: garbage again.
        std::memset(scratch.data() + f.scratch_offset(), 0xFF,
                    f.rows() * f.width() * 4);
      }
      if (before_direct && !direct.empty()) before_direct(direct);
      RunDirect(direct);
    }
    EXPECT_EQ(step, req.quant_steps_size());
    if (after_run) after_run();
  }
};

constexpr int64_t kEngineId = 7;

// How StepsInstall runs the update.
struct Mode {
  int64_t chunk_bytes = 4096;
  int64_t window = 0;
  bool from_source = false;
  bool whole = false;  // the whole source there at once: direct steps
  // A registered source whose tensor "w" starts one byte off an element.
  bool misaligned = false;
  DirectShape shape = DirectShape::kKernel;
};

// Called by StepsInstall with the engine's layout before the update runs;
// may set the worker's before_direct.
using BeforeRun = std::function<void(const EngineLayout&, Worker&)>;

std::string StepsInstall(const Case& c, const Mode& m,
                         int64_t* direct_steps = nullptr,
                         const BeforeRun& before_run = nullptr) {
  testing::HeapMapper mapper;
  auto layout = BuildEngineLayout(c.r, mapper);
  EXPECT_TRUE(layout.ok()) << layout.status();
  auto plan = PlanOf(c, *layout, m.chunk_bytes);
  const std::string packed = Packed(*plan, c.tensors);
  uint8_t* engine = (*layout)->regions[0]->data();
  Worker worker;
  worker.shape = m.shape;
  if (before_run) before_run(**layout, worker);
  worker.memory[kEngineId] = engine;
  worker.sizes[kEngineId] = (*layout)->regions[0]->size();
  // A registered source: tensors alternately in two regions, out of order,
  // each after `pad` bytes.
  auto pad = [&](size_t t) { return m.misaligned && t == 0 ? 257 : 256; };
  Source source;
  std::vector<std::string> regions(2);
  for (size_t t = 0; t < c.tensors.size(); ++t) {
    std::string& region = regions[t % 2];
    region.insert(0, c.tensors[t].bytes);
    region.insert(0, pad(t), '\x55');
  }
  std::vector<int64_t> ids = {301, 302};
  if (m.from_source) {
    for (size_t t = 0; t < c.tensors.size(); ++t) {
      // Tensor t sits where its bytes were inserted: after everything
      // inserted later (tensors t + 2, t + 4, ...) and their padding.
      int64_t offset = pad(t);
      for (size_t u = t + 2; u < c.tensors.size(); u += 2) {
        offset += c.tensors[u].bytes.size() + pad(u);
      }
      source.placements.push_back({static_cast<int32_t>(t % 2), offset});
    }
    for (int i = 0; i < 2; ++i) {
      worker.memory[ids[i]] = reinterpret_cast<uint8_t*>(regions[i].data());
      worker.sizes[ids[i]] = regions[i].size();
    }
  }
  const Source* src = m.from_source ? &source : nullptr;
  worker::v1::BeginUpdateRequest req;
  const absl::Status added = AddQuantSteps(
      *plan, m.window, m.whole,
      [](int32_t engine, int32_t region) -> absl::StatusOr<int64_t> {
        EXPECT_EQ(engine, 0);
        EXPECT_EQ(region, 0);
        return kEngineId;
      },
      src, ids, &req);
  EXPECT_TRUE(added.ok()) << added;
  EXPECT_EQ(req.quant_scratch_bytes(),
            QuantScratchBytes(*plan, m.window, m.whole, src));
  int64_t direct = 0;
  for (size_t i = 0; i < plan->quant.size(); ++i) {
    direct += QuantIsDirect(*plan, i, m.whole, src);
  }
  int64_t last_chunk = -1;
  for (const worker::v1::GpuQuantStep& s : req.quant_steps()) {
    EXPECT_GE(s.chunk(), last_chunk);  // in chunk order
    last_chunk = s.chunk();
    if (s.has_gather()) {
      EXPECT_EQ(s.gather().src_allocation_id() != 0, m.from_source);
    }
    if (s.has_direct()) {
      EXPECT_TRUE(m.whole);
      EXPECT_EQ(s.direct().src_allocation_id() != 0, m.from_source);
      EXPECT_EQ(s.chunk(),
                static_cast<int64_t>(plan->chunks.chunks.size()) - 1);
      --direct;
    }
  }
  EXPECT_EQ(direct, 0);
  worker.Run(*plan, req, packed, engine);
  if (direct_steps != nullptr) *direct_steps = worker.direct_steps;
  const MappedRegion& region = *(*layout)->regions[0];
  return std::string(reinterpret_cast<const char*>(region.data()),
                     region.size());
}

TEST(QuantStepsTest, StepsInstallWhatTheHostDataPlaneInstalls) {
  const Case c = MakeCase();
  for (int64_t chunk_bytes : {256, 768, 4096, 11520, 1 << 20}) {
    const std::string want = HostInstall(c, chunk_bytes);
    ASSERT_NE(want, std::string(want.size(), '\0'));
    for (int64_t window : {int64_t{0}, int64_t{3000}, int64_t{1} << 20}) {
      for (bool from_source : {false, true}) {
        SCOPED_TRACE(::testing::Message()
                     << "chunk_bytes " << chunk_bytes << " window " << window
                     << (from_source ? " from a source" : " packed"));
        Mode m;
        m.chunk_bytes = chunk_bytes;
        m.window = window;
        m.from_source = from_source;
        EXPECT_TRUE(StepsInstall(c, m) == want);
      }
    }
  }
}

// The whole source there at once (ipc, no ring, not staged): every use
// but "part" (half of each source row, one after another) is quantised
// by a direct step straight from the source, the kernel's way and with
// blocks larger than the threads hold (read twice).
TEST(QuantStepsTest, DirectStepsInstallWhatTheHostDataPlaneInstalls) {
  const Case c = MakeCase();
  for (int64_t chunk_bytes : {256, 768, 4096, 11520, 1 << 20}) {
    const std::string want = HostInstall(c, chunk_bytes);
    for (bool from_source : {false, true}) {
      for (DirectShape shape : testing::kAllDirectShapes) {
        SCOPED_TRACE(::testing::Message()
                     << "chunk_bytes " << chunk_bytes
                     << (from_source ? " from a source" : " packed")
                     << " shape " << static_cast<int>(shape));
        Mode m;
        m.chunk_bytes = chunk_bytes;
        m.window = int64_t{1} << 20;
        m.from_source = from_source;
        m.whole = true;
        m.shape = shape;
        int64_t direct = 0;
        EXPECT_TRUE(StepsInstall(c, m, &direct) == want);
        // w, q, k, v, o, side x 2, flat, big; not part.
        EXPECT_EQ(direct, 9);
      }
    }
  }
  // The vec shapes ran blocks both in vectors and by the walk.
  EXPECT_GT(testing::VecBlocksRun(), 0);
  EXPECT_GT(testing::LeanBlocksRun(), 0);  // the lean kernel's blocks too
  // ... both its finite path and the one with inf or NaN in the block.
  EXPECT_GT(testing::LeanFiniteBlocksRun(), 0);
  EXPECT_LT(testing::LeanFiniteBlocksRun(), testing::LeanBlocksRun());
}

// The receipt regions of `engine` for an update of `sources`, as the
// daemon makes them (worker_receipts.cc, ReceiptRegionsOf: one per segment
// fed by a source, one per such segment's scales), resolved to host
// addresses; the names of their parameters in *names.
std::vector<cuda::ReceiptRegion> RegionsOf(
    const EngineLayout& engine, const absl::flat_hash_set<std::string>& sources,
    std::vector<std::string>* names) {
  std::vector<cuda::ReceiptRegion> regions;
  uint8_t* base = engine.regions[0]->data();
  for (const ParameterLayout& p : engine.parameters) {
    const int64_t es = ElementSize(p.dtype);
    for (const SegmentLayout& s : p.segments) {
      if (!sources.contains(s.source)) continue;
      cuda::ReceiptRegion g{};
      g.base = base + p.offset + s.dest_offset * es;
      g.rows = s.row_count;
      g.cols = s.col_count;
      g.row_stride_bytes = s.dest_row_stride * es;
      g.es = static_cast<int32_t>(es);
      g.salt = p.salt;
      g.first_index = static_cast<uint64_t>(s.dest_offset);
      regions.push_back(g);
      names->push_back(p.name);
      if (!p.quant.has_value()) continue;
      const QuantLayout& q = *p.quant;
      const ParameterLayout& scale = engine.parameters[q.scale_parameter];
      const auto [i0, i1, j0, j1, first] = ScaleBlocksOf(q, s);
      cuda::ReceiptRegion k{};
      k.base = base + scale.offset + first * 4;
      k.rows = i1 - i0;
      k.cols = j1 - j0;
      k.row_stride_bytes = q.grid_cols * 4;
      k.es = 4;
      k.salt = scale.salt;
      k.first_index = static_cast<uint64_t>(first);
      regions.push_back(k);
      names->push_back(scale.name);
    }
  }
  return regions;
}

// common/checksum.h over the regions.
uint64_t TermsOf(const std::vector<cuda::ReceiptRegion>& regions) {
  uint64_t sum = 0;
  for (const cuda::ReceiptRegion& g : regions) {
    for (int64_t r = 0; r < g.rows; ++r) {
      sum +=
          RunTerms(g.salt, g.first_index + r * (g.row_stride_bytes / g.es),
                   static_cast<const uint8_t*>(g.base) + r * g.row_stride_bytes,
                   g.cols, g.es);
    }
  }
  return sum;
}

// What a fused update's direct kernel sums (DirectReceipt), run thread by
// thread for each kernel kind: the receipt fields that PlanFusedReceipts
// (the worker's planning) gives the direct jobs, over the receipt regions
// of the FP8 weights and scales they write, make the kernel's sum the
// host's receipt of those regions; the regions themselves sum, with the
// rest, to ComputeReceipt of the host data plane's install. The FP8
// targets: fused q/k/v in 32 x 32 blocks (e5m2, reciprocal scales, partial
// edge blocks), a bf16 weight in 64 x 64 (e4m3, partial edges), per-row
// scales, two sources side by side, 128 x 128 blocks with partial edges,
// float32, bfloat16 and float16 sources. A wrong index or salt in a job's
// fields gives another sum.
TEST(QuantStepsTest, DirectKernelsSumTheReceiptOfWhatTheyWrite) {
  const Case c = MakeCase();
  const absl::flat_hash_set<std::string> sources = {
      "w", "q", "k", "v", "o_proj", "halves", "big"};
  for (int64_t chunk_bytes : {768, 1 << 20}) {
    const std::string want = HostInstall(c, chunk_bytes);
    uint64_t host_receipt = 0;
    {
      testing::HeapMapper mapper;
      auto layout = BuildEngineLayout(c.r, mapper);
      ASSERT_TRUE(layout.ok()) << layout.status();
      std::memcpy((*layout)->regions[0]->data(), want.data(), want.size());
      auto receipt = ComputeReceipt(**layout, sources);
      ASSERT_TRUE(receipt.ok()) << receipt.status();
      host_receipt = receipt->checksum();
    }
    for (bool from_source : {false, true}) {
      for (DirectShape shape : testing::kAllDirectShapes) {
        for (int wrong : {0, 1, 2}) {
          SCOPED_TRACE(::testing::Message()
                       << "chunk_bytes " << chunk_bytes
                       << (from_source ? " from a source" : " packed")
                       << " shape " << static_cast<int>(shape) << " wrong "
                       << wrong);
          Mode m;
          m.chunk_bytes = chunk_bytes;
          m.window = int64_t{1} << 20;
          m.from_source = from_source;
          m.whole = true;
          m.shape = shape;
          uint64_t fused = 0, direct_terms = 0, other_terms = 0;
          std::vector<cuda::ReceiptRegion> all, direct_regions, other_regions;
          const BeforeRun before = [&](const EngineLayout& engine,
                                       Worker& worker) {
            std::vector<std::string> names;
            all = RegionsOf(engine, sources, &names);
            for (size_t i = 0; i < all.size(); ++i) {
              // part (gathered, then flushed) and w_copy (a copy) are not
              // the direct kernel's.
              const bool direct = names[i] != "part" &&
                                  names[i] != "part_scale" &&
                                  names[i] != "w_copy";
              (direct ? direct_regions : other_regions).push_back(all[i]);
            }
            worker.before_direct = [&](std::vector<cuda::DirectJob>& jobs) {
              // The whole engine's regions: part's are nobody's here, so
              // nothing fuses (the worker falls back).
              cuda::FusedReceiptPlan plan;
              std::vector<int32_t> groups(all.size(), 0);
              EXPECT_FALSE(
                  cuda::PlanFusedReceipts(all, groups, {}, jobs, &plan));
              groups.resize(direct_regions.size());
              ASSERT_TRUE(cuda::PlanFusedReceipts(direct_regions, groups, {},
                                                  jobs, &plan));
              for (size_t j = 0; j < jobs.size(); ++j) {
                ASSERT_EQ(plan.direct_group[j], 0);
                jobs[j].receipt = plan.direct[j];
                jobs[j].receipt.out =
                    reinterpret_cast<unsigned long long*>(&fused);
              }
              if (wrong == 1) jobs.back().receipt.q_first += 1;
              if (wrong == 2) jobs.front().receipt.scale_salt += 1;
            };
            // Summed over the bytes just written (the host's, as checked).
            worker.after_run = [&] {
              direct_terms = TermsOf(direct_regions);
              other_terms = TermsOf(other_regions);
            };
          };
          int64_t direct = 0;
          EXPECT_TRUE(StepsInstall(c, m, &direct, before) == want);
          EXPECT_EQ(direct, 9);
          ASSERT_FALSE(direct_regions.empty());
          if (wrong == 0) {
            EXPECT_EQ(fused, direct_terms);
          } else {
            EXPECT_NE(fused, direct_terms);
          }
          EXPECT_EQ(direct_terms + other_terms, host_receipt);
        }
      }
    }
  }
}

// A registered source's tensor that starts off an element boundary keeps
// the gathers (the kernel loads whole elements); the others go direct.
TEST(QuantStepsTest, AMisalignedSourceTensorKeepsTheGathers) {
  const Case c = MakeCase();
  const std::string want = HostInstall(c, 4096);
  Mode m;
  m.from_source = true;
  m.whole = true;
  m.misaligned = true;
  int64_t direct = 0;
  EXPECT_TRUE(StepsInstall(c, m, &direct) == want);
  EXPECT_EQ(direct, 9 - 2);  // w and side's first segment (from w)
}

// Direct uses hold no scratch: only "part" does.
TEST(QuantStepsTest, DirectUsesNeedNoScratch) {
  const Case c = MakeCase();
  testing::HeapMapper mapper;
  auto layout = BuildEngineLayout(c.r, mapper);
  ASSERT_TRUE(layout.ok());
  auto plan = PlanOf(c, *layout, 4096);
  // part: one 2 x 64 window (float32), 256-aligned.
  EXPECT_EQ(QuantScratchBytes(*plan, 0, /*whole_source=*/true, nullptr), 512);
  EXPECT_GT(QuantScratchBytes(*plan, 0), 512);
}

TEST(QuantStepsTest, WindowsBoundTheScratchAndTheFlushes) {
  const Case c = MakeCase();
  testing::HeapMapper mapper;
  auto layout = BuildEngineLayout(c.r, mapper);
  ASSERT_TRUE(layout.ok());
  auto plan = PlanOf(c, *layout, 4096);
  auto flushes = [&](int64_t window) {
    worker::v1::BeginUpdateRequest req;
    EXPECT_TRUE(
        AddQuantSteps(
            *plan, window, /*whole_source=*/false,
            [](int32_t, int32_t) -> absl::StatusOr<int64_t> { return 1; },
            nullptr, {}, &req)
            .ok());
    int n = 0;
    for (const auto& s : req.quant_steps()) n += s.has_flush();
    return n;
  };
  // One row of blocks per flush and use: w 3, q/k/v 2 each, o 70, side's
  // two uses 35 each, flat 3, part 2, big 2.
  EXPECT_EQ(flushes(0), 3 + 6 + 70 + 70 + 3 + 2 + 2);
  // Whole rectangles: one flush per use (w, q, k, v, o, side x 2, flat,
  // part, big).
  EXPECT_EQ(flushes(int64_t{1} << 20), 10);
  EXPECT_LT(QuantScratchBytes(*plan, 0), QuantScratchBytes(*plan, 1 << 20));
  // No quantised use: no steps, no scratch.
  Case plain = MakeCase();
  plain.r.clear_parameters();
  int64_t offset = 0;
  AddSegment(Add(plain.r, "w_copy", v1::BFLOAT16, 150, 130, &offset), "w", 0,
             150, 0, 130, 0, 0);
  plain.tensors.resize(1);
  auto plain_layout = BuildEngineLayout(plain.r, mapper);
  ASSERT_TRUE(plain_layout.ok()) << plain_layout.status();
  auto plain_plan = PlanOf(plain, *plain_layout, 4096);
  worker::v1::BeginUpdateRequest req;
  ASSERT_TRUE(
      AddQuantSteps(*plain_plan, 0, false, nullptr, nullptr, {}, &req).ok());
  EXPECT_EQ(req.quant_steps_size(), 0);
  EXPECT_EQ(req.quant_scratch_bytes(), 0);
}

TEST(QuantStepsTest, AnEngineInHostMemoryIsRefusedByTheRegionIds) {
  const Case c = MakeCase();
  testing::HeapMapper mapper;
  auto layout = BuildEngineLayout(c.r, mapper);
  ASSERT_TRUE(layout.ok());
  auto plan = PlanOf(c, *layout, 4096);
  worker::v1::BeginUpdateRequest req;
  const absl::Status s = AddQuantSteps(
      *plan, 0, false,
      [](int32_t, int32_t) -> absl::StatusOr<int64_t> {
        return absl::InvalidArgumentError("host memory");
      },
      nullptr, {}, &req);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace weightsync

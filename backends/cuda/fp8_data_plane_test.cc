// FP8 targets on the GPU backends, on the daemon's side (no GPU needed):
// registration takes them in GPU memory, the GPU data plane plans them
// (quant steps and their scratch within the staging budget) instead of
// refusing them, and the receipt regions the worker sums cover the FP8
// elements and the written scales exactly as the host's ComputeReceipt
// does. What the worker then writes is quant_steps_test's and
// tests/gpu/run_fp8_checks.sh's to prove.
#include <random>
#include <string>

#include "backends/cuda/fake_gpu_mapper.h"
#include "backends/cuda/quant_steps.h"
#include "backends/cuda/worker_client.h"
#include "common/checksum.h"
#include "daemon/core/copy_plan.h"
#include "daemon/core/engine_layout.h"
#include "daemon/core/receipt.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/heap_memory.h"

namespace weightsync {
namespace {

using ::testing::HasSubstr;

void AddSegment(v1::Parameter* p, const std::string& source, int64_t rb,
                int64_t rc, int64_t dest) {
  v1::Segment* s = p->add_segments();
  s->set_source(source);
  s->set_row_begin(rb);
  s->set_row_count(rc);
  s->set_col_begin(0);
  s->set_col_count(256);
  s->set_dest_offset(dest);
  s->set_dest_row_stride(256);
}

// Engine "e0": "w" e4m3 [300, 256] in 128 x 128 blocks (scales in a second
// allocation) fed by two tensors stacked by rows ("w_top" rows [0, 256),
// "w_bottom"), "o" e5m2 [64, 256] per row with reciprocal scales, "norm"
// bf16 [256]. Allocation kinds as given.
v1::RegisterEngineRequest Fp8Engine(v1::MemoryKind kind) {
  v1::RegisterEngineRequest r;
  r.set_engine_id("e0");
  for (int i = 0; i < 2; ++i) {
    v1::Allocation* a = r.add_allocations();
    a->set_kind(kind);
    a->set_handle(std::string(64, static_cast<char>('h' + i)));
    a->set_size(1 << 20);
    a->set_device_uuid("GPU-0");
  }
  v1::Parameter* w = r.add_parameters();
  w->set_name("w");
  w->set_dtype(v1::FLOAT8_E4M3FN);
  w->add_shape(300);
  w->add_shape(256);
  w->mutable_quantization()->set_format(v1::FLOAT8_E4M3FN);
  w->mutable_quantization()->set_scale_parameter("w_scale_inv");
  AddSegment(w, "w_top", 0, 256, 0);
  AddSegment(w, "w_bottom", 0, 44, 256 * 256);
  v1::Parameter* s = r.add_parameters();
  s->set_name("w_scale_inv");
  s->set_dtype(v1::FLOAT32);
  s->add_shape(3);
  s->add_shape(2);
  s->set_allocation(1);
  s->set_offset(12);
  v1::Parameter* o = r.add_parameters();
  o->set_name("o");
  o->set_dtype(v1::FLOAT8_E5M2);
  o->add_shape(64);
  o->add_shape(256);
  o->set_offset(300 * 256 + 7);
  o->mutable_quantization()->set_format(v1::FLOAT8_E5M2);
  o->mutable_quantization()->set_scale_parameter("o_scale");
  o->mutable_quantization()->set_scheme(v1::QUANT_SCHEME_PER_ROW);
  o->mutable_quantization()->set_scale_form(v1::SCALE_FORM_RECIPROCAL);
  v1::Parameter* os = r.add_parameters();
  os->set_name("o_scale");
  os->set_dtype(v1::FLOAT32);
  os->add_shape(64);
  os->set_allocation(1);
  os->set_offset(4096);
  v1::Parameter* n = r.add_parameters();
  n->set_name("norm");
  n->set_dtype(v1::BFLOAT16);
  n->add_shape(256);
  n->set_offset(200 * 1024);
  return r;
}

Manifest Tensors() {
  Manifest m;
  for (auto [name, rows] : std::vector<std::pair<std::string, int>>{
           {"w_top", 256}, {"w_bottom", 44}, {"o", 64}, {"norm", 0}}) {
    v1::TensorSpec* t = m.Add();
    t->set_name(name);
    t->set_dtype(v1::BFLOAT16);
    if (rows > 0) t->add_shape(rows);
    t->add_shape(256);
  }
  return m;
}

TEST(GpuFp8DataPlaneTest, PlansFp8TargetsInsteadOfRefusingThem) {
  auto sup = FakeSupervisor(int64_t{4} << 30);
  FakeGpuMapper mapper(sup);
  auto layout = BuildEngineLayout(Fp8Engine(v1::MEMORY_CUDA_IPC), mapper);
  ASSERT_TRUE(layout.ok()) << layout.status();
  auto plan = BuildCopyPlan(Tensors(), 64 << 10, {*layout});
  ASSERT_TRUE(plan.ok()) << plan.status();
  ASSERT_EQ((*plan)->quant.size(), 3u);
  GpuDataPlane plane(sup, v1::BACKEND_NCCL);
  v1::StartWeightUpdateRequest request;
  // Planned and sent: only the worker, never started here, refuses.
  const absl::Status begun = plane.Begin(*plan, request);
  EXPECT_EQ(begun.code(), absl::StatusCode::kFailedPrecondition) << begun;
  EXPECT_THAT(begun.message(), HasSubstr("GPU worker"));
  // The quant scratch counts as staging, in windows of several rows.
  EXPECT_EQ(plane.staging_bytes(),
            sup->options().staging_buffers * (64 << 10) +
                QuantScratchBytes(**plan, kQuantWindowBytes));
  EXPECT_GT(QuantScratchBytes(**plan, kQuantWindowBytes),
            QuantScratchBytes(**plan, 0));
  EXPECT_EQ(plane.BeginStaged(*plan, request).code(),
            absl::StatusCode::kFailedPrecondition);
}

TEST(GpuFp8DataPlaneTest, TheScratchCountsAgainstTheStagingBudget) {
  auto plan_with = [](std::shared_ptr<GpuWorkerSupervisor> sup,
                      FakeGpuMapper& mapper) {
    auto layout = BuildEngineLayout(Fp8Engine(v1::MEMORY_CUDA_VMM), mapper);
    EXPECT_TRUE(layout.ok()) << layout.status();
    return *BuildCopyPlan(Tensors(), 64 << 10, {*layout});
  };
  {
    // Room for the staging and one row of blocks per use, not for windows:
    // planned with one row of blocks each.
    auto probe = FakeSupervisor(1);
    FakeGpuMapper probe_mapper(probe);
    auto plan = plan_with(probe, probe_mapper);
    const int64_t staging = 4 * (64 << 10);
    auto sup = FakeSupervisor(staging + QuantScratchBytes(*plan, 0));
    FakeGpuMapper mapper(sup);
    plan = plan_with(sup, mapper);
    GpuDataPlane plane(sup, v1::BACKEND_NCCL);
    EXPECT_EQ(plane.Begin(plan, {}).code(),
              absl::StatusCode::kFailedPrecondition);
    EXPECT_EQ(plane.staging_bytes(), staging + QuantScratchBytes(*plan, 0));
  }
  auto sup = FakeSupervisor(4 * (64 << 10) + 1000);
  FakeGpuMapper mapper(sup);
  auto plan = plan_with(sup, mapper);
  GpuDataPlane plane(sup, v1::BACKEND_NCCL);
  const absl::Status s = plane.Begin(plan, {});
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_THAT(s.message(), HasSubstr("FP8 targets' rows of blocks"));
}

// The receipt regions of an FP8 engine, summed on the CPU over the same
// bytes, give the host's ComputeReceipt: checksum, parameters and bytes.
TEST(GpuFp8DataPlaneTest, ReceiptRegionsCoverFp8BytesAndWrittenScales) {
  auto sup = FakeSupervisor(int64_t{4} << 30);
  FakeGpuMapper gpu_mapper(sup);
  auto gpu = BuildEngineLayout(Fp8Engine(v1::MEMORY_CUDA_IPC), gpu_mapper);
  ASSERT_TRUE(gpu.ok()) << gpu.status();
  testing::HeapMapper heap_mapper;
  auto host = BuildEngineLayout(Fp8Engine(v1::MEMORY_HOST_SHM), heap_mapper);
  ASSERT_TRUE(host.ok()) << host.status();
  std::mt19937 rng(3);
  for (auto& region : heap_mapper.opened) {
    for (int64_t i = 0; i < region->size(); ++i) region->data()[i] = rng();
  }
  // Region ids 1 and 2 are the host layout's regions 0 and 1.
  auto memory = [&](int64_t id) { return heap_mapper.opened[id - 1]->data(); };
  for (const auto& sources : std::vector<absl::flat_hash_set<std::string>>{
           {"w_top", "w_bottom", "o", "norm"}, {"w_bottom"}, {"o", "norm"}}) {
    worker::v1::ComputeReceiptsRequest req;
    std::vector<v1::Receipt> out;
    std::vector<std::string> region_sources;
    ASSERT_TRUE(
        ReceiptRegionsOf({gpu->get()}, sources, {}, &req, &out, &region_sources)
            .ok());
    ASSERT_EQ(region_sources.size(), static_cast<size_t>(req.regions_size()));
    uint64_t sum = 0;
    for (const worker::v1::ReceiptRegionSpec& g : req.regions()) {
      const int64_t es = g.element_size();
      for (int64_t r = 0; r < g.rows(); ++r) {
        sum += RunTerms(
            g.salt(), g.first_index() + r * (g.row_stride_bytes() / es),
            memory(g.allocation_id()) + g.offset() + r * g.row_stride_bytes(),
            g.cols(), es);
      }
    }
    auto want = ComputeReceipt(**host, sources);
    ASSERT_TRUE(want.ok()) << want.status();
    ASSERT_EQ(out.size(), 1u);
    EXPECT_EQ(sum, want->checksum());
    EXPECT_EQ(out[0].parameters(), want->parameters());
    EXPECT_EQ(out[0].bytes(), want->bytes());
  }
}

}  // namespace
}  // namespace weightsync

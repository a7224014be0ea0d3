// FP8 targets on the GPU backends, before the GPU quantisation kernels
// exist: the GPU data plane refuses a plan that has them, naming the engine
// and the parameter, before it asks the worker for anything (registration
// refuses them in GPU memory first: daemon/core/quant_layout_test.cc).
#include <string>

#include "backends/cuda/worker_client.h"
#include "daemon/core/copy_plan.h"
#include "daemon/core/engine_layout.h"
#include "gtest/gtest.h"
#include "tests/testing/heap_memory.h"

namespace weightsync {
namespace {

TEST(GpuFp8RefusalTest, BeginRefusesAPlanWithFp8Targets) {
  v1::RegisterEngineRequest r;
  r.set_engine_id("e0");
  v1::Allocation* a = r.add_allocations();
  a->set_kind(v1::MEMORY_HOST_SHM);
  a->set_handle("/x");
  a->set_size(4096);
  v1::Parameter* w = r.add_parameters();
  w->set_name("w");
  w->set_dtype(v1::FLOAT8_E4M3FN);
  w->add_shape(16);
  w->add_shape(16);
  w->mutable_quantization()->set_format(v1::FLOAT8_E4M3FN);
  w->mutable_quantization()->set_scale_parameter("w_scale_inv");
  v1::Parameter* s = r.add_parameters();
  s->set_name("w_scale_inv");
  s->set_dtype(v1::FLOAT32);
  s->add_shape(1);
  s->add_shape(1);
  s->set_offset(1024);
  testing::HeapMapper mapper;
  auto layout = BuildEngineLayout(r, mapper);
  ASSERT_TRUE(layout.ok()) << layout.status();
  Manifest m;
  v1::TensorSpec* t = m.Add();
  t->set_name("w");
  t->set_dtype(v1::BFLOAT16);
  t->add_shape(16);
  t->add_shape(16);
  auto plan = BuildCopyPlan(m, 1 << 20, {*layout});
  ASSERT_TRUE(plan.ok()) << plan.status();
  ASSERT_EQ((*plan)->quant.size(), 1u);
  // No supervisor: the refusal comes before the worker is touched.
  for (v1::Backend backend : {v1::BACKEND_NCCL, v1::BACKEND_IPC}) {
    GpuDataPlane plane(nullptr, backend);
    v1::StartWeightUpdateRequest request;
    const absl::Status begun = plane.Begin(*plan, request);
    EXPECT_EQ(begun.code(), absl::StatusCode::kUnimplemented);
    EXPECT_NE(begun.message().find("engine 'e0' parameter 'w' is an FP8 "
                                   "target"),
              std::string::npos)
        << begun;
    EXPECT_NE(begun.message().find("GPU quantisation kernels are not built"),
              std::string::npos);
    EXPECT_EQ(plane.BeginStaged(*plan, request).code(),
              absl::StatusCode::kUnimplemented);
  }
}

}  // namespace
}  // namespace weightsync

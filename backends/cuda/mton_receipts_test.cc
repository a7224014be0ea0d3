// The receipts of a transfer plan's update on the GPU data plane (issue
// 32), without a GPU: its stream carries pieces named "<tensor>[r0:r1,
// c0:c1]" while the engines' segments name the tensors, so the regions the
// worker sums must come from the plan's uses (ReceiptSources), and equal
// those of an ordinary update of the same tensors. Before, the first
// two-sender update through the daemons on 4 GPUs read back "0 bytes"
// (tests/gpu/RESULTS_mton_daemon.txt).
#include <string>

#include "backends/cuda/fake_gpu_mapper.h"
#include "backends/cuda/worker_client.h"
#include "common/transfer_plan.h"
#include "daemon/core/copy_plan.h"
#include "daemon/core/engine_layout.h"
#include "daemon/core/link_plan.h"
#include "gtest/gtest.h"

namespace weightsync {
namespace {

// Engine "e0": "w" bf16 [64, 256] whole, "b" bf16 [256].
v1::RegisterEngineRequest Engine() {
  v1::RegisterEngineRequest r;
  r.set_engine_id("e0");
  v1::Allocation* a = r.add_allocations();
  a->set_kind(v1::MEMORY_CUDA_IPC);
  a->set_handle(std::string(64, 'h'));
  a->set_size(1 << 20);
  a->set_device_uuid("GPU-0");
  v1::Parameter* w = r.add_parameters();
  w->set_name("w");
  w->set_dtype(v1::BFLOAT16);
  w->add_shape(64);
  w->add_shape(256);
  v1::Parameter* b = r.add_parameters();
  b->set_name("b");
  b->set_dtype(v1::BFLOAT16);
  b->add_shape(256);
  b->set_offset(64 * 256 * 2);
  return r;
}

void Block(v1::TensorBlock* b, const std::string& t, int64_t r0, int64_t rn,
           int64_t cn) {
  b->set_tensor(t);
  b->set_row_begin(r0);
  b->set_row_count(rn);
  b->set_col_begin(0);
  b->set_col_count(cn);
}

// Two senders: row halves of "w", "b" replicated; one receiver needs all.
v1::TransferPlanSpec Spec() {
  v1::TransferPlanSpec spec;
  for (const auto& [name, rows, cols] :
       {std::tuple<std::string, int64_t, int64_t>{"w", 64, 256},
        {"b", 256, 1}}) {
    v1::TensorSpec* t = spec.add_tensors();
    t->set_name(name);
    t->set_dtype(v1::BFLOAT16);
    t->add_shape(rows);
    if (name == "w") t->add_shape(cols);
  }
  for (int s = 0; s < 2; ++s) {
    v1::SenderLayout* sl = spec.add_senders();
    Block(sl->add_holds(), "w", 32 * s, 32, 256);
    Block(sl->add_holds(), "b", 0, 256, 1);
  }
  v1::ReceiverLayout* r = spec.add_receivers();
  r->set_name("d0");
  Block(r->add_needs(), "w", 0, 64, 256);
  Block(r->add_needs(), "b", 0, 256, 1);
  return spec;
}

TEST(MtonReceiptsTest, LinkedPlanSumsTheSameRegionsAsAnOrdinaryUpdate) {
  FakeGpuMapper mapper(FakeSupervisor(int64_t{4} << 30));
  auto layout = BuildEngineLayout(Engine(), mapper);
  ASSERT_TRUE(layout.ok()) << layout.status();
  auto plan = BuildTransferPlan(Spec());
  ASSERT_TRUE(plan.ok()) << plan.status();
  auto linked = BuildLinkedCopyPlan(*plan, {0}, 4096, {*layout});
  ASSERT_TRUE(linked.ok()) << linked.status();
  auto ordinary = BuildCopyPlan(plan->manifest, 4096, {*layout});
  ASSERT_TRUE(ordinary.ok()) << ordinary.status();

  // The linked stream's manifest names pieces, not the tensors.
  for (const v1::TensorSpec& t : linked->copy->manifest) {
    EXPECT_NE(t.name(), "w");
  }
  const auto sources = ReceiptSources(*linked->copy);
  EXPECT_EQ(sources, ReceiptSources(**ordinary));
  EXPECT_TRUE(sources.contains("w") && sources.contains("b"));

  auto regions = [](const CopyPlan& p,
                    const absl::flat_hash_set<std::string>& s,
                    std::vector<v1::Receipt>* out) {
    worker::v1::ComputeReceiptsRequest req;
    std::vector<std::string> region_sources;
    EXPECT_TRUE(ReceiptRegionsOf({p.engines[0].get()}, s, {}, &req, out,
                                 &region_sources)
                    .ok());
    return req.SerializeAsString();
  };
  std::vector<v1::Receipt> linked_receipts, ordinary_receipts;
  EXPECT_EQ(
      regions(*linked->copy, sources, &linked_receipts),
      regions(**ordinary, ReceiptSources(**ordinary), &ordinary_receipts));
  ASSERT_EQ(linked_receipts.size(), 1u);
  EXPECT_EQ(linked_receipts[0].bytes(), (64 * 256 + 256) * 2);
  EXPECT_EQ(linked_receipts[0].parameters(), 2);
  EXPECT_EQ(linked_receipts[0].bytes(), ordinary_receipts[0].bytes());
}

}  // namespace
}  // namespace weightsync

#include "daemon/core/link_plan.h"

#include <cstring>
#include <string>
#include <vector>

#include "backends/host/host_data_plane.h"
#include "client/host_arena.h"
#include "common/dtype.h"
#include "daemon/core/receipt.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/heap_memory.h"
#include "tools/synthetic/synthetic_model.h"

namespace weightsync {
namespace {

using ::testing::HasSubstr;

struct Engine {
  std::vector<v1::Parameter> params;
  std::shared_ptr<const EngineLayout> layout;
};

Engine MakeEngine(const std::string& id, synthetic::Layout layout, int rank,
                  int size, v1::DType dtype, testing::HeapMapper& mapper) {
  const auto model = *synthetic::ModelByName("tiny");
  Engine e;
  e.params = synthetic::EngineParameters(model, layout, rank, size, dtype);
  const int64_t bytes = *HostArena::Layout(&e.params);
  v1::RegisterEngineRequest r;
  r.set_engine_id(id);
  v1::Allocation* a = r.add_allocations();
  a->set_kind(v1::MEMORY_HOST_SHM);
  a->set_handle("/heap");
  a->set_size(bytes);
  for (const auto& p : e.params) *r.add_parameters() = p;
  auto built = BuildEngineLayout(r, mapper);
  EXPECT_TRUE(built.ok()) << built.status();
  e.layout = *built;
  return e;
}

v1::TensorBlock Block(const std::string& t, int64_t r0, int64_t rn, int64_t c0,
                      int64_t cn) {
  v1::TensorBlock b;
  b.set_tensor(t);
  b.set_row_begin(r0);
  b.set_row_count(rn);
  b.set_col_begin(c0);
  b.set_col_count(cn);
  return b;
}

void View(const v1::TensorSpec& t, int64_t* rows, int64_t* cols) {
  SourceMatrix(std::vector<int64_t>(t.shape().begin(), t.shape().end()), rows,
               cols);
}

// The spec of `senders` trainer ranks (row shards, or `replicas` whole
// copies) and one receiver that needs what `engines` use.
v1::TransferPlanSpec Spec(const Manifest& manifest, int senders, bool replicas,
                          const std::vector<Engine>& engines) {
  v1::TransferPlanSpec spec;
  *spec.mutable_tensors() = manifest;
  for (int s = 0; s < senders; ++s) spec.add_senders();
  v1::ReceiverLayout* r = spec.add_receivers();
  r->set_name("daemon");
  for (const v1::TensorSpec& t : manifest) {
    int64_t rows, cols;
    View(t, &rows, &cols);
    const int64_t step = (rows + senders - 1) / senders;
    for (int s = 0; s < senders; ++s) {
      const int64_t lo = replicas ? 0 : std::min(rows, s * step);
      const int64_t hi = replicas ? rows : std::min(rows, (s + 1) * step);
      if (hi > lo) {
        *spec.mutable_senders(s)->add_holds() =
            Block(t.name(), lo, hi - lo, 0, cols);
      }
    }
  }
  for (const Engine& e : engines) {
    for (const ParameterLayout& p : e.layout->parameters) {
      for (const SegmentLayout& segment : p.segments) {
        const SegmentLayout s = SegmentBlock(p, segment);
        *r->add_needs() =
            Block(s.source, s.row_begin, s.row_count, s.col_begin, s.col_count);
      }
    }
  }
  return spec;
}

// Every link's stream packed as its sender packs it, scattered through the
// linked plan; every engine parameter must equal the reference installer's.
void RunAndCompare(int senders, bool replicas, int64_t chunk_bytes) {
  testing::HeapMapper mapper;
  std::vector<Engine> engines = {
      MakeEngine("plain", synthetic::Layout::kPlain, 0, 1, v1::BFLOAT16,
                 mapper),
      MakeEngine("tp0", synthetic::Layout::kTensorParallel, 0, 2, v1::BFLOAT16,
                 mapper),
      MakeEngine("tp1", synthetic::Layout::kTensorParallel, 1, 2, v1::FLOAT16,
                 mapper)};
  const auto model = *synthetic::ModelByName("tiny");
  Manifest manifest;
  synthetic::CheckpointData data;
  for (const v1::TensorSpec& t : synthetic::Checkpoint(model, v1::FLOAT32)) {
    *manifest.Add() = t;
    data[t.name()] = {t, synthetic::Contents(t, 3)};
  }
  absl::StatusOr<TransferPlan> plan =
      BuildTransferPlan(Spec(manifest, senders, replicas, engines));
  ASSERT_TRUE(plan.ok()) << plan.status();
  std::vector<std::shared_ptr<const EngineLayout>> layouts;
  for (const Engine& e : engines) layouts.push_back(e.layout);
  absl::StatusOr<LinkedCopyPlan> linked =
      BuildLinkedCopyPlan(*plan, {0}, chunk_bytes, layouts);
  ASSERT_TRUE(linked.ok()) << linked.status();
  int64_t chunks = 0;
  for (const LinkChunks& l : linked->links) {
    const Manifest m = LinkManifest(*plan, l.sender, l.receiver);
    absl::StatusOr<ChunkPlan> cp = PlanChunks(m, chunk_bytes);
    ASSERT_TRUE(cp.ok());
    ASSERT_EQ(cp->chunks.size(), l.num_chunks);
    std::vector<uint8_t> stream(cp->total_bytes, 0);
    const std::vector<int32_t>& pieces = plan->links[l.sender][l.receiver];
    for (size_t k = 0; k < pieces.size(); ++k) {
      const PlanPiece& p = plan->pieces[pieces[k]];
      const v1::TensorSpec& t = manifest.Get(p.tensor);
      int64_t rows, cols;
      View(t, &rows, &cols);
      const int64_t es = ElementSize(t.dtype());
      const uint8_t* src = data.at(t.name()).second.data();
      for (int64_t i = 0; i < p.row_count; ++i) {
        std::memcpy(
            stream.data() + cp->tensor_offsets[k] + i * p.col_count * es,
            src + ((p.row_begin + i) * cols + p.col_begin) * es,
            p.col_count * es);
      }
    }
    for (const Chunk& c : cp->chunks) {
      const int64_t g = l.first_chunk + c.index;
      ASSERT_EQ(linked->copy->chunks.chunks[g].size, c.size);
      ScatterChunk(*linked->copy, linked->copy->ops_by_chunk[g],
                   stream.data() + c.offset, nullptr);
      ++chunks;
    }
  }
  EXPECT_EQ(chunks, linked->copy->chunks.chunks.size());
  for (const Engine& e : engines) {
    const uint8_t* base = e.layout->regions[0]->data();
    for (const v1::Parameter& p : e.params) {
      const std::vector<uint8_t> want = synthetic::ExpectedParameter(p, data);
      ASSERT_EQ(std::memcmp(base + p.offset(), want.data(), want.size()), 0)
          << e.layout->engine_id << " " << p.name() << " senders " << senders
          << " chunk " << chunk_bytes;
    }
  }
  for (size_t i = 0; i < engines.size(); ++i) {
    EXPECT_TRUE(linked->copy->covers_engine[i]);
  }
}

TEST(LinkPlanTest, RowShardsScatterBitExact) {
  for (int64_t chunk : {256, 1280, 65536}) RunAndCompare(2, false, chunk);
  RunAndCompare(3, false, 768);
}

TEST(LinkPlanTest, ReplicasScatterBitExact) {
  RunAndCompare(2, true, 512);
  RunAndCompare(3, true, 65536);
}

TEST(LinkPlanTest, ChunksByRoundTakeChunkKOfEveryLinkInRoundK) {
  LinkedCopyPlan linked;
  linked.links = {{0, 0, 0, 3, 0}, {1, 0, 3, 1, 0}, {2, 0, 4, 2, 0}};
  const std::vector<RoundChunk> r = ChunksByRound(linked);
  std::vector<int64_t> chunks, rounds;
  for (const RoundChunk& c : r) {
    chunks.push_back(c.chunk);
    rounds.push_back(c.round);
  }
  EXPECT_EQ(chunks, (std::vector<int64_t>{0, 3, 4, 1, 5, 2}));
  EXPECT_EQ(rounds, (std::vector<int64_t>{0, 0, 0, 1, 1, 2}));
}

TEST(LinkPlanTest, ReceiverThatNeedsLessThanItsEnginesIsRefused) {
  testing::HeapMapper mapper;
  std::vector<Engine> engines = {MakeEngine("plain", synthetic::Layout::kPlain,
                                            0, 1, v1::BFLOAT16, mapper)};
  const auto model = *synthetic::ModelByName("tiny");
  Manifest manifest;
  for (const v1::TensorSpec& t : synthetic::Checkpoint(model, v1::FLOAT32)) {
    *manifest.Add() = t;
  }
  v1::TransferPlanSpec spec = Spec(manifest, 2, false, engines);
  // The receiver forgets the last row of its first need.
  v1::TensorBlock* b = spec.mutable_receivers(0)->mutable_needs(0);
  b->set_row_count(b->row_count() - 1);
  absl::StatusOr<TransferPlan> plan = BuildTransferPlan(spec);
  ASSERT_TRUE(plan.ok()) << plan.status();
  absl::StatusOr<LinkedCopyPlan> linked =
      BuildLinkedCopyPlan(*plan, {0}, 4096, {engines[0].layout});
  ASSERT_FALSE(linked.ok());
  EXPECT_EQ(linked.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(linked.status().message(), HasSubstr("engine 'plain'"));
  EXPECT_THAT(linked.status().message(), HasSubstr("make it again"));
  EXPECT_FALSE(
      BuildLinkedCopyPlan(*plan, {0, 0}, 4096, {engines[0].layout}).ok());
}

}  // namespace
}  // namespace weightsync

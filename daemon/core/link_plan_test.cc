#include "daemon/core/link_plan.h"

#include <array>
#include <cstring>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "backends/host/host_data_plane.h"
#include "backends/host/quant_scatter.h"
#include "client/host_arena.h"
#include "common/dtype.h"
#include "common/fp8.h"
#include "daemon/core/receipt.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/heap_memory.h"
#include "tools/synthetic/fp8_layout.h"
#include "tools/synthetic/synthetic_model.h"

namespace weightsync {
namespace {

using ::testing::HasSubstr;

struct Engine {
  std::vector<v1::Parameter> params;
  std::shared_ptr<const EngineLayout> layout;
};

Engine MakeEngineOf(const std::string& id, std::vector<v1::Parameter> params,
                    testing::HeapMapper& mapper) {
  Engine e;
  e.params = std::move(params);
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

Engine MakeEngine(const std::string& id, synthetic::Layout layout, int rank,
                  int size, v1::DType dtype, testing::HeapMapper& mapper) {
  const auto model = *synthetic::ModelByName("tiny");
  return MakeEngineOf(
      id, synthetic::EngineParameters(model, layout, rank, size, dtype),
      mapper);
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

// How the trainer ranks hold each tensor: row shards (torch.chunk's cut),
// column shards, or whole copies.
enum class Split { kRows, kCols, kReplicas };

// The spec of `senders` trainer ranks holding tensors as `split` says and
// one receiver that needs what `engines` use.
v1::TransferPlanSpec Spec(const Manifest& manifest, int senders, Split split,
                          const std::vector<Engine>& engines,
                          bool idle_sender = false) {
  v1::TransferPlanSpec spec;
  *spec.mutable_tensors() = manifest;
  for (int s = 0; s < senders; ++s) spec.add_senders();
  if (idle_sender) spec.add_senders();  // one more rank, holding nothing
  v1::ReceiverLayout* r = spec.add_receivers();
  r->set_name("daemon");
  for (const v1::TensorSpec& t : manifest) {
    int64_t rows, cols;
    View(t, &rows, &cols);
    const int64_t cut = split == Split::kCols ? cols : rows;
    const int64_t step = (cut + senders - 1) / senders;
    for (int s = 0; s < senders; ++s) {
      const int64_t lo =
          split == Split::kReplicas ? 0 : std::min(cut, s * step);
      const int64_t hi =
          split == Split::kReplicas ? cut : std::min(cut, (s + 1) * step);
      if (hi <= lo) continue;
      *spec.mutable_senders(s)->add_holds() =
          split == Split::kCols ? Block(t.name(), 0, rows, lo, hi - lo)
                                : Block(t.name(), lo, hi - lo, 0, cols);
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

// Link `l`'s stream as its sender packs it (chunk plan `cp` of its link
// manifest): each piece's block of `data`, row-major.
std::vector<uint8_t> PackLink(const TransferPlan& plan, const LinkChunks& l,
                              const ChunkPlan& cp,
                              const synthetic::CheckpointData& data) {
  std::vector<uint8_t> stream(cp.total_bytes, 0);
  const std::vector<int32_t>& pieces = plan.links[l.sender][l.receiver];
  for (size_t k = 0; k < pieces.size(); ++k) {
    const PlanPiece& p = plan.pieces[pieces[k]];
    const v1::TensorSpec& t = plan.manifest.Get(p.tensor);
    int64_t rows, cols;
    View(t, &rows, &cols);
    const int64_t es = ElementSize(t.dtype());
    const uint8_t* src = data.at(t.name()).second.data();
    for (int64_t i = 0; i < p.row_count; ++i) {
      std::memcpy(stream.data() + cp.tensor_offsets[k] + i * p.col_count * es,
                  src + ((p.row_begin + i) * cols + p.col_begin) * es,
                  p.col_count * es);
    }
  }
  return stream;
}

// Every link's stream packed as its sender packs it, scattered through the
// linked plan; every engine parameter must equal the reference installer's.
void RunAndCompare(int senders, Split split, int64_t chunk_bytes,
                   bool idle_sender = false) {
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
      BuildTransferPlan(Spec(manifest, senders, split, engines, idle_sender));
  ASSERT_TRUE(plan.ok()) << plan.status();
  std::vector<std::shared_ptr<const EngineLayout>> layouts;
  for (const Engine& e : engines) layouts.push_back(e.layout);
  absl::StatusOr<LinkedCopyPlan> linked =
      BuildLinkedCopyPlan(*plan, {0}, chunk_bytes, layouts);
  ASSERT_TRUE(linked.ok()) << linked.status();
  // The host data plane is exactly one receiver, one in the plan.
  absl::StatusOr<LinkedCopyPlan> two =
      BuildLinkedCopyPlan(*plan, {0, 0}, chunk_bytes, layouts);
  EXPECT_EQ(two.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(two.status().message(), HasSubstr("exactly one"));
  for (int32_t outside : {-1, 1}) {  // the plan has receiver 0 only
    EXPECT_EQ(BuildLinkedCopyPlan(*plan, {outside}, chunk_bytes, layouts)
                  .status()
                  .code(),
              absl::StatusCode::kInvalidArgument)
        << outside;
  }
  // One entry per link that carries pieces (a sender holding nothing the
  // receiver needs has none), in sender order.
  std::vector<int32_t> carrying, listed;
  for (int32_t s = 0; s < plan->num_senders; ++s) {
    if (!plan->links[s][0].empty()) carrying.push_back(s);
  }
  for (const LinkChunks& l : linked->links) {
    listed.push_back(l.sender);
    EXPECT_GT(l.num_chunks, 0);
  }
  EXPECT_EQ(listed, carrying);
  int64_t chunks = 0;
  for (const LinkChunks& l : linked->links) {
    const Manifest m = LinkManifest(*plan, l.sender, l.receiver);
    absl::StatusOr<ChunkPlan> cp = PlanChunks(m, chunk_bytes);
    ASSERT_TRUE(cp.ok());
    ASSERT_EQ(cp->chunks.size(), l.num_chunks);
    const std::vector<uint8_t> stream = PackLink(*plan, l, *cp, data);
    for (const Chunk& c : cp->chunks) {
      const int64_t g = l.first_chunk + c.index;
      ASSERT_EQ(linked->copy->chunks.chunks[g].size, c.size);
      ScatterChunk(*linked->copy, linked->copy->ops_by_chunk[g],
                   stream.data() + c.offset, nullptr);
      ++chunks;
    }
  }
  EXPECT_EQ(chunks, linked->copy->chunks.chunks.size());
  // The links' chunk plans appended: one offset and size per piece, each
  // piece inside the stream, the stream's length past its last chunk.
  const ChunkPlan& all = linked->copy->chunks;
  ASSERT_EQ(all.tensor_offsets.size(), linked->copy->manifest.size());
  ASSERT_EQ(all.payload_bytes.size(), linked->copy->manifest.size());
  for (size_t k = 0; k < all.tensor_offsets.size(); ++k) {
    EXPECT_LE(all.tensor_offsets[k] + all.payload_bytes[k], all.total_bytes);
  }
  ASSERT_FALSE(all.chunks.empty());
  for (size_t g = 0; g < all.chunks.size(); ++g) {  // each link aligned
    EXPECT_EQ(all.chunks[g].offset, static_cast<int64_t>(g) * chunk_bytes);
  }
  EXPECT_EQ(all.total_bytes, all.chunks.back().offset + all.chunks.back().size);
  // Every copy moves something: a piece beside a segment makes none.
  for (const auto& ops : linked->copy->ops_by_chunk) {
    for (const CopyOp& op : ops) {
      ASSERT_GT(op.rows, 0) << "senders " << senders;
      ASSERT_GT(op.cols, 0) << "senders " << senders;
    }
  }
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
  for (int64_t chunk : {256, 1280, 65536})
    RunAndCompare(2, Split::kRows, chunk);
  RunAndCompare(3, Split::kRows, 768);
}

// Shards that meet an engine's segments in a single row or column, and
// pieces beside a segment (the same tensor, no common row or column):
// each must give exactly its overlap, never a piece of zero or negative
// size, nor lose a one-row overlap.
TEST(LinkPlanTest, ThinAndDisjointOverlapsScatterBitExact) {
  for (int senders : {5, 7}) {
    RunAndCompare(senders, Split::kRows, 512);
    RunAndCompare(senders, Split::kCols, 512);
  }
  RunAndCompare(2, Split::kCols, 65536);
  RunAndCompare(3, Split::kRows, 512, /*idle_sender=*/true);  // a link empty
}

TEST(LinkPlanTest, ReplicasScatterBitExact) {
  RunAndCompare(2, Split::kReplicas, 512);
  RunAndCompare(3, Split::kReplicas, 65536);
}

// The order chunks of several links reach a host daemon: each link in
// order, the links interleaved in rounds, or one link after another from
// the last.
enum class Arrival { kRounds, kLastLinkFirst };

// FP8 engines of the tiny model in e4m3 with 16 x 16 blocks: a plain one
// ("fp8") and a TP=2 pair ("tp0", "tp1").
std::vector<Engine> Fp8Engines(testing::HeapMapper& mapper) {
  const auto model = *synthetic::ModelByName("tiny");
  auto fp8 = [&](synthetic::Layout layout, int rank, int size) {
    return *synthetic::Fp8EngineParameters(model, layout, rank, size,
                                           v1::BFLOAT16, v1::FLOAT8_E4M3FN, 16);
  };
  return {MakeEngineOf("fp8", fp8(synthetic::Layout::kPlain, 0, 1), mapper),
          MakeEngineOf("tp0", fp8(synthetic::Layout::kTensorParallel, 0, 2),
                       mapper),
          MakeEngineOf("tp1", fp8(synthetic::Layout::kTensorParallel, 1, 2),
                       mapper)};
}

// The tiny model's float32 checkpoint: its manifest and contents (`seed`).
void TinyCheckpoint(int seed, Manifest* manifest,
                    synthetic::CheckpointData* data) {
  const auto model = *synthetic::ModelByName("tiny");
  for (const v1::TensorSpec& t : synthetic::Checkpoint(model, v1::FLOAT32)) {
    *manifest->Add() = t;
    (*data)[t.name()] = {t, synthetic::Contents(t, seed)};
  }
}

// FP8 engines (16 x 16 blocks: a plain one and a TP=2 pair) fed by the
// links of `senders` ranks holding the checkpoint as `split` says, the
// chunks arriving as `arrival` says: every parameter (FP8 elements and
// scales included) must equal the reference quantisation of the whole
// checkpoint, whichever senders cut which blocks, and the open bands must
// stay within the plan's bound. Returns the linked plan and the bound of
// one stream of the whole manifest.
std::pair<LinkedCopyPlan, int64_t> RunFp8AndCompare(int senders, Split split,
                                                    int64_t chunk_bytes,
                                                    Arrival arrival) {
  testing::HeapMapper mapper;
  const std::vector<Engine> engines = Fp8Engines(mapper);
  Manifest manifest;
  synthetic::CheckpointData data;
  TinyCheckpoint(5, &manifest, &data);
  absl::StatusOr<TransferPlan> plan =
      BuildTransferPlan(Spec(manifest, senders, split, engines));
  EXPECT_TRUE(plan.ok()) << plan.status();
  std::vector<std::shared_ptr<const EngineLayout>> layouts;
  for (const Engine& e : engines) layouts.push_back(e.layout);
  absl::StatusOr<LinkedCopyPlan> linked =
      BuildLinkedCopyPlan(*plan, {0}, chunk_bytes, layouts);
  EXPECT_TRUE(linked.ok()) << linked.status();
  if (!linked.ok()) return {};
  const CopyPlan& copy = *linked->copy;
  EXPECT_FALSE(copy.quant.empty());
  // Each link's stream as its sender packs it, cut into its chunks.
  struct Arrived {
    int64_t chunk = 0;  // in the linked plan
    int64_t round = 0;
    std::vector<uint8_t> bytes;
  };
  std::vector<std::vector<Arrived>> by_link;
  for (const LinkChunks& l : linked->links) {
    const Manifest m = LinkManifest(*plan, l.sender, l.receiver);
    absl::StatusOr<ChunkPlan> cp = PlanChunks(m, chunk_bytes);
    EXPECT_TRUE(cp.ok());
    const std::vector<uint8_t> stream = PackLink(*plan, l, *cp, data);
    by_link.emplace_back();
    for (const Chunk& c : cp->chunks) {
      by_link.back().push_back(
          {l.first_chunk + c.index, c.index,
           std::vector<uint8_t>(stream.begin() + c.offset,
                                stream.begin() + c.offset + c.size)});
    }
  }
  std::vector<const Arrived*> order;
  if (arrival == Arrival::kRounds) {
    for (int64_t round = 0;; ++round) {
      bool any = false;
      for (const auto& link : by_link) {
        if (round < static_cast<int64_t>(link.size())) {
          order.push_back(&link[round]);
          any = true;
        }
      }
      if (!any) break;
    }
  } else {
    for (auto l = by_link.rbegin(); l != by_link.rend(); ++l) {
      for (const Arrived& a : *l) order.push_back(&a);
    }
  }
  QuantScatter quant;
  quant.Reset(copy);
  int64_t most_open = 0;
  for (const Arrived* a : order) {
    ScatterChunk(copy, copy.ops_by_chunk[a->chunk], a->bytes.data(), nullptr);
    const absl::Status fed =
        quant.Feed(copy, a->chunk, a->bytes.data(), nullptr, nullptr);
    EXPECT_TRUE(fed.ok()) << fed;
    most_open = std::max(most_open, quant.open_bytes());
  }
  EXPECT_EQ(quant.open_bytes(), 0) << "a row of blocks never completed";
  EXPECT_LE(most_open, copy.quant_band_bytes);
  for (const Engine& e : engines) {
    const uint8_t* base = e.layout->regions[0]->data();
    const std::vector<std::vector<uint8_t>> want =
        synthetic::ExpectedFp8Engine(e.params, data);
    for (size_t i = 0; i < e.params.size(); ++i) {
      const v1::Parameter& p = e.params[i];
      EXPECT_EQ(std::memcmp(base + p.offset(), want[i].data(), want[i].size()),
                0)
          << e.layout->engine_id << " " << p.name() << " senders " << senders
          << " chunk " << chunk_bytes;
    }
  }
  for (size_t i = 0; i < engines.size(); ++i) {
    EXPECT_TRUE(copy.covers_engine[i]);
  }
  absl::StatusOr<std::shared_ptr<const CopyPlan>> whole =
      BuildCopyPlan(manifest, chunk_bytes, layouts, UnusedTensors::kSkip);
  EXPECT_TRUE(whole.ok());
  return {*linked, (*whole)->quant_band_bytes};
}

// Row shards on multiples of the block (tiny's rows over 2 ranks): every
// block comes whole from one sender, so no band waits for another link.
TEST(LinkPlanTest, Fp8TargetsFromAlignedRowShardsWaitForNothing) {
  for (Arrival arrival : {Arrival::kRounds, Arrival::kLastLinkFirst}) {
    const auto [linked, one_stream] =
        RunFp8AndCompare(2, Split::kRows, 1280, arrival);
    ASSERT_NE(linked.copy, nullptr);
    EXPECT_EQ(linked.copy->quant_band_bytes, 2 * one_stream);
    int gathered = 0;
    for (const QuantTarget& t : linked.copy->quant) gathered += t.gathered;
    EXPECT_GT(gathered, 0);  // q_proj's rows come from both
  }
}

// Shards that cut blocks (3 ranks: rows or columns at 22 and 44 of 64) and
// replicas (the plan splits rows by bytes, anywhere): a block cut between
// senders is quantised once, whole, with one scale, whatever order the
// links' chunks come in.
TEST(LinkPlanTest, Fp8BlocksCutBetweenSendersQuantiseWhole) {
  for (Arrival arrival : {Arrival::kRounds, Arrival::kLastLinkFirst}) {
    for (Split split : {Split::kRows, Split::kCols, Split::kReplicas}) {
      const auto [linked, one_stream] =
          RunFp8AndCompare(3, split, 768, arrival);
      ASSERT_NE(linked.copy, nullptr);
      EXPECT_GT(linked.copy->quant_band_bytes, 3 * one_stream);
    }
    RunFp8AndCompare(2, Split::kReplicas, 65536, arrival);
  }
  // Column shards of 13 and 12 columns in chunks of 64 elements: a chunk
  // ends one element into a piece's row (59 rows of 13 and one).
  RunFp8AndCompare(5, Split::kCols, 256, Arrival::kRounds);
}

// The tiny model's checkpoint in float32, and one plain FP8 engine of it
// (16 x 16 blocks).
Manifest TinyManifest() {
  Manifest manifest;
  for (const v1::TensorSpec& t :
       synthetic::Checkpoint(*synthetic::ModelByName("tiny"), v1::FLOAT32)) {
    *manifest.Add() = t;
  }
  return manifest;
}

Engine TinyFp8Engine(testing::HeapMapper& mapper) {
  return MakeEngineOf(
      "fp8",
      *synthetic::Fp8EngineParameters(*synthetic::ModelByName("tiny"),
                                      synthetic::Layout::kPlain, 0, 1,
                                      v1::BFLOAT16, v1::FLOAT8_E4M3FN, 16),
      mapper);
}

// FP8 on the wire through a plan (plan_wire): the FP8 targets' tensors of
// `wired` are sent quantised, each piece its rectangle's FP8 elements and
// then the scales of its blocks (the one function, 16 x 16 e4m3 blocks as
// the engines'); the rest as they are.
struct Wired {
  std::vector<WireTensor> tensors;
  absl::flat_hash_map<std::string, Fp8Blocks> blocks;
};

Wired WireOf(const std::vector<std::string>& names, int64_t block) {
  Wired w;
  for (const std::string& n : names) {
    WireTensor t;
    t.tensor = n;
    t.quantization.set_format(v1::FLOAT8_E4M3FN);
    t.quantization.set_scheme(v1::QUANT_SCHEME_BLOCK);
    t.quantization.set_block_rows(block);
    t.quantization.set_block_cols(block);
    w.tensors.push_back(t);
    w.blocks[n] = Fp8Blocks{v1::FLOAT8_E4M3FN, block, block, false};
  }
  return w;
}

// Link `l`'s stream with the pieces of `wired` tensors quantised: its
// manifest's pseudo tensors carry their quantization, and each such piece
// is the FP8 of its float32 rectangle, zeros to 4, its blocks' scales.
std::vector<uint8_t> PackWireLink(const TransferPlan& plan, const LinkChunks& l,
                                  const Wired& wired,
                                  const synthetic::CheckpointData& data,
                                  int64_t chunk_bytes,
                                  std::vector<Chunk>* chunks) {
  Manifest m = LinkManifest(plan, l.sender, l.receiver);
  const std::vector<int32_t>& pieces = plan.links[l.sender][l.receiver];
  for (size_t k = 0; k < pieces.size(); ++k) {
    const v1::TensorSpec& t = plan.manifest.Get(plan.pieces[pieces[k]].tensor);
    for (const WireTensor& w : wired.tensors) {
      if (w.tensor != t.name()) continue;
      m.Mutable(k)->set_dtype(w.quantization.format());
      *m.Mutable(k)->mutable_quantization() = w.quantization;
    }
  }
  absl::StatusOr<ChunkPlan> cp = PlanChunks(m, chunk_bytes);
  EXPECT_TRUE(cp.ok()) << cp.status();
  std::vector<uint8_t> stream(cp->total_bytes, 0);
  for (size_t k = 0; k < pieces.size(); ++k) {
    const PlanPiece& p = plan.pieces[pieces[k]];
    const v1::TensorSpec& t = plan.manifest.Get(p.tensor);
    int64_t rows, cols;
    View(t, &rows, &cols);
    const int64_t es = ElementSize(t.dtype());
    const uint8_t* src = data.at(t.name()).second.data();
    uint8_t* out = stream.data() + cp->tensor_offsets[k];
    auto q = wired.blocks.find(t.name());
    if (q == wired.blocks.end()) {
      for (int64_t i = 0; i < p.row_count; ++i) {
        std::memcpy(out + i * p.col_count * es,
                    src + ((p.row_begin + i) * cols + p.col_begin) * es,
                    p.col_count * es);
      }
      continue;
    }
    EXPECT_EQ(t.dtype(), v1::FLOAT32);
    const int64_t n = p.row_count * p.col_count;
    const int64_t gc =
        (p.col_count + q->second.block_cols - 1) / q->second.block_cols;
    QuantizeBlocks(
        reinterpret_cast<const float*>(src) + p.row_begin * cols + p.col_begin,
        p.row_count, p.col_count, cols, q->second, out, p.col_count,
        out + (n + 3) / 4 * 4, gc);
  }
  *chunks = cp->chunks;
  return stream;
}

// The FP8 engines of RunFp8AndCompare fed by `senders` ranks holding rows
// (or replicas), `wired`'s tensors quantised on the wire: every parameter
// equals the reference quantisation of the whole checkpoint, the links
// carry a byte an element of what travels quantised, and only the other
// tensors' targets are left to quantise on the daemon.
void RunFp8WireAndCompare(int senders, Split split, int64_t chunk_bytes,
                          bool all) {
  testing::HeapMapper mapper;
  const std::vector<Engine> engines = Fp8Engines(mapper);
  Manifest manifest;
  synthetic::CheckpointData data;
  TinyCheckpoint(7, &manifest, &data);
  std::vector<std::shared_ptr<const EngineLayout>> layouts;
  for (const Engine& e : engines) layouts.push_back(e.layout);
  // The FP8 targets' tensors (all, or every other one).
  absl::StatusOr<std::shared_ptr<const CopyPlan>> whole =
      BuildCopyPlan(manifest, chunk_bytes, layouts, UnusedTensors::kSkip);
  ASSERT_TRUE(whole.ok()) << whole.status();
  std::vector<std::string> names;
  for (const QuantTarget& t : (*whole)->quant) {
    const std::string& n = manifest.Get(t.tensor).name();
    if (std::find(names.begin(), names.end(), n) == names.end()) {
      names.push_back(n);
    }
  }
  ASSERT_GE(names.size(), 4u);
  absl::StatusOr<TransferPlan> plan =
      BuildTransferPlan(Spec(manifest, senders, split, engines));
  ASSERT_TRUE(plan.ok()) << plan.status();
  // As a trainer chooses: a tensor some piece of which cuts a block goes
  // unquantised (k and v: 16 rows, cut in two by 2 senders' row shards).
  absl::flat_hash_set<std::string> cut;
  for (const PlanPiece& p : plan->pieces) {
    const v1::TensorSpec& t = plan->manifest.Get(p.tensor);
    int64_t rows, cols;
    View(t, &rows, &cols);
    auto off = [](int64_t b, int64_t n, int64_t end) {
      return b % 16 != 0 || ((b + n) % 16 != 0 && b + n != end);
    };
    if (off(p.row_begin, p.row_count, rows) ||
        off(p.col_begin, p.col_count, cols)) {
      cut.insert(t.name());
    }
  }
  std::vector<std::string> chosen;
  for (size_t i = 0; i < names.size(); ++i) {
    if ((all || i % 2 == 0) && !cut.contains(names[i])) {
      chosen.push_back(names[i]);
    }
  }
  ASSERT_GE(chosen.size(), 2u);
  const Wired wired = WireOf(chosen, 16);
  absl::StatusOr<LinkedCopyPlan> linked =
      BuildLinkedCopyPlan(*plan, {0}, chunk_bytes, layouts, {}, wired.tensors);
  ASSERT_TRUE(linked.ok()) << linked.status();
  const CopyPlan& copy = *linked->copy;
  // Only the tensors not on the wire feed the daemon's quantisation.
  for (const QuantTarget& t : copy.quant) {
    EXPECT_EQ(wired.blocks.count(manifest.Get(t.tensor).name()), 0u)
        << manifest.Get(t.tensor).name();
  }
  EXPECT_EQ(copy.quant.empty(), chosen.size() == names.size());
  QuantScatter quant;
  quant.Reset(copy);
  int64_t wire_bytes = 0, dense_bytes = 0;
  for (const LinkChunks& l : linked->links) {
    std::vector<Chunk> chunks;
    const std::vector<uint8_t> stream =
        PackWireLink(*plan, l, wired, data, chunk_bytes, &chunks);
    ASSERT_EQ(chunks.size(), l.num_chunks);
    EXPECT_EQ(l.bytes, static_cast<int64_t>(stream.size()));
    wire_bytes += l.bytes;
    absl::StatusOr<ChunkPlan> dense =
        PlanChunks(LinkManifest(*plan, l.sender, l.receiver), chunk_bytes);
    dense_bytes += dense->total_bytes;
    for (const Chunk& c : chunks) {
      const int64_t g = l.first_chunk + c.index;
      ASSERT_EQ(copy.chunks.chunks[g].size, c.size);
      ScatterChunk(copy, copy.ops_by_chunk[g], stream.data() + c.offset,
                   nullptr);
      ASSERT_TRUE(
          quant.Feed(copy, g, stream.data() + c.offset, nullptr, nullptr).ok());
    }
  }
  EXPECT_EQ(quant.open_bytes(), 0);
  EXPECT_LT(wire_bytes, dense_bytes);
  for (const Engine& e : engines) {
    const uint8_t* base = e.layout->regions[0]->data();
    const std::vector<std::vector<uint8_t>> want =
        synthetic::ExpectedFp8Engine(e.params, data);
    for (size_t i = 0; i < e.params.size(); ++i) {
      const v1::Parameter& p = e.params[i];
      EXPECT_EQ(std::memcmp(base + p.offset(), want[i].data(), want[i].size()),
                0)
          << e.layout->engine_id << " " << p.name() << " senders " << senders
          << " chunk " << chunk_bytes << (all ? " all" : " half") << " wired";
    }
  }
  for (size_t i = 0; i < engines.size(); ++i) {
    EXPECT_TRUE(copy.covers_engine[i]);
  }
}

TEST(LinkPlanTest, Fp8OnTheWireThroughAPlanLandsAsTheDaemonQuantises) {
  for (bool all : {true, false}) {
    for (int64_t chunk : {256, 1280, 65536}) {
      RunFp8WireAndCompare(2, Split::kRows, chunk, all);
    }
    RunFp8WireAndCompare(4, Split::kRows, 768, all);  // 16 rows each: blocks
    RunFp8WireAndCompare(2, Split::kCols, 768, all);
  }
}

// plan_wire entries the daemon can't take are refused before anything
// moves, naming the tensor: not in the plan, twice, not float, a use that
// is not an FP8 target of its blocks, and a piece that cuts a block (3
// senders cut 64 rows at 22 and 44: send that tensor unquantised).
TEST(LinkPlanTest, Fp8OnTheWireThroughAPlanRefusesWhatCantCopyAsItIs) {
  testing::HeapMapper mapper;
  std::vector<Engine> engines = {TinyFp8Engine(mapper)};
  const Manifest manifest = TinyManifest();
  std::vector<std::shared_ptr<const EngineLayout>> layouts = {
      engines[0].layout};
  absl::StatusOr<TransferPlan> two =
      BuildTransferPlan(Spec(manifest, 2, Split::kRows, engines));
  ASSERT_TRUE(two.ok()) << two.status();
  const std::string q = "model.layers.0.self_attn.q_proj.weight";
  auto refused = [&](const TransferPlan& plan, const Wired& w) {
    absl::StatusOr<LinkedCopyPlan> linked =
        BuildLinkedCopyPlan(plan, {0}, 4096, layouts, {}, w.tensors);
    EXPECT_FALSE(linked.ok());
    return linked.status();
  };
  absl::Status s = refused(*two, WireOf({"nope"}, 16));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("'nope' is not in the plan"));
  s = refused(*two, WireOf({q, q}, 16));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("named twice"));
  s = refused(*two, WireOf({q}, 32));  // the engine's blocks are 16 x 16
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr(q));
  EXPECT_THAT(s.message(), HasSubstr("but the target quantises"));
  s = refused(*two,
              WireOf({"model.norm.weight"}, 16));  // [64]: its pieces whole
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("is not an FP8 target")) << s;
  absl::StatusOr<TransferPlan> three =
      BuildTransferPlan(Spec(manifest, 3, Split::kRows, engines));
  ASSERT_TRUE(three.ok()) << three.status();
  s = refused(*three, WireOf({q}, 16));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr(absl::StrCat("tensor '", q, "'")));
  EXPECT_THAT(s.message(), HasSubstr("cuts its 16 x 16 blocks"));
  // The same tensor unquantised goes through the daemon's quantisation.
  EXPECT_TRUE(BuildLinkedCopyPlan(*three, {0}, 4096, layouts).ok());
  // Only float tensors are quantised: an int32 one in the plan (no engine
  // uses it) is refused by its dtype.
  Manifest with_int = manifest;
  v1::TensorSpec* steps = with_int.Add();
  steps->set_name("steps");
  steps->set_dtype(v1::INT32);
  steps->add_shape(16);
  absl::StatusOr<TransferPlan> ints =
      BuildTransferPlan(Spec(with_int, 2, Split::kRows, engines));
  ASSERT_TRUE(ints.ok()) << ints.status();
  s = refused(*ints, WireOf({"steps"}, 16));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("'steps' is int32: only float32")) << s;
}

// One FP8 target w [rows, cols] (FLOAT8_E4M3FN) in br x bc blocks (0: the
// default 128) and its float32 scales.
Engine OneFp8Engine(int64_t rows, int64_t cols, int64_t br, int64_t bc,
                    testing::HeapMapper& mapper) {
  std::vector<v1::Parameter> params(2);
  params[0].set_name("w");
  params[0].set_dtype(v1::FLOAT8_E4M3FN);
  params[0].add_shape(rows);
  params[0].add_shape(cols);
  v1::Quantization* q = params[0].mutable_quantization();
  q->set_format(v1::FLOAT8_E4M3FN);
  q->set_scale_parameter("w_scale");
  q->set_block_rows(br);
  q->set_block_cols(bc);
  const int64_t r = br ? br : 128, c = bc ? bc : 128;
  params[1].set_name("w_scale");
  params[1].set_dtype(v1::FLOAT32);
  params[1].add_shape((rows + r - 1) / r);
  params[1].add_shape((cols + c - 1) / c);
  return MakeEngineOf("e", params, mapper);
}

// A plan's spec of one float32 tensor w [rows, cols]: each of `holds` (r0
// rn c0 cn) a sender's block, one receiver "daemon" needing it whole.
v1::TransferPlanSpec OneTensorSpec(
    int64_t rows, int64_t cols,
    const std::vector<std::array<int64_t, 4>>& holds) {
  v1::TransferPlanSpec spec;
  v1::TensorSpec* t = spec.add_tensors();
  t->set_name("w");
  t->set_dtype(v1::FLOAT32);
  t->add_shape(rows);
  t->add_shape(cols);
  for (const auto& h : holds) {
    *spec.add_senders()->add_holds() = Block("w", h[0], h[1], h[2], h[3]);
  }
  v1::ReceiverLayout* r = spec.add_receivers();
  r->set_name("daemon");
  *r->add_needs() = Block("w", 0, rows, 0, cols);
  return spec;
}

// One FP8 target w [64, 32] in 16 x 16 blocks, fed whole by one tensor that
// `cuts` split into row shards of as many senders: the rows of blocks a
// cut falls in wait for both senders, every other streams by. The plan's
// bound is each link at one place (one row of blocks, 2 KiB) plus the
// waiting ones; the target is gathered unless one piece feeds it all.
TEST(LinkPlanTest, Fp8BandsThatWaitAreTheOnesACutFallsIn) {
  struct Case {
    std::vector<int64_t> cuts;
    int64_t bound;
    bool gathered;
  };
  for (const Case& c :
       std::vector<Case>{{{}, 2048, false},
                         {{32}, 2 * 2048, true},
                         {{20}, 2 * 2048 + 2048, true},
                         {{20, 44}, 3 * 2048 + 2 * 2048, true},
                         {{1, 63}, 3 * 2048 + 2 * 2048, true}}) {
    testing::HeapMapper mapper;
    Engine e = OneFp8Engine(64, 32, 16, 16, mapper);
    std::vector<int64_t> edges = {0};
    edges.insert(edges.end(), c.cuts.begin(), c.cuts.end());
    edges.push_back(64);
    std::vector<std::array<int64_t, 4>> holds;
    for (size_t i = 0; i + 1 < edges.size(); ++i) {
      holds.push_back({edges[i], edges[i + 1] - edges[i], 0, 32});
    }
    const v1::TransferPlanSpec spec = OneTensorSpec(64, 32, holds);
    absl::StatusOr<TransferPlan> plan = BuildTransferPlan(spec);
    ASSERT_TRUE(plan.ok()) << plan.status();
    absl::StatusOr<LinkedCopyPlan> linked =
        BuildLinkedCopyPlan(*plan, {0}, 1024, {e.layout});
    ASSERT_TRUE(linked.ok()) << linked.status();
    ASSERT_EQ(linked->copy->quant.size(), 1u);
    EXPECT_EQ(linked->copy->quant_band_bytes, c.bound) << c.cuts.size();
    EXPECT_EQ(linked->copy->quant[0].gathered, c.gathered) << c.cuts.size();
  }
}

// Two FP8 targets w0, w1 [64, 16] in 16 x 16 blocks, the column halves of
// one tensor w [64, 32] (a row-parallel weight's TP shards in one daemon),
// held by as many senders as `halves` says: with two, each target is fed
// by one sender alone (a sender's rows begin or end exactly where the
// other target's columns do, and touch none of them), so nothing is
// gathered and no band waits: each link at one place. Then w, the plan's
// first tensor, on the wire: both targets take copies, the daemon
// quantises nothing.
TEST(LinkPlanTest, Fp8ColumnHalvesOfOneTensorWaitForNothing) {
  testing::HeapMapper mapper;
  std::vector<v1::Parameter> params;
  for (int half = 0; half < 2; ++half) {
    v1::Parameter& w = params.emplace_back();
    w.set_name(absl::StrCat("w", half));
    w.set_dtype(v1::FLOAT8_E4M3FN);
    w.add_shape(64);
    w.add_shape(16);
    v1::Segment* s = w.add_segments();
    s->set_source("w");
    s->add_source_shape(64);
    s->add_source_shape(32);
    s->set_row_count(64);
    s->set_col_begin(16 * half);
    s->set_col_count(16);
    v1::Quantization* q = w.mutable_quantization();
    q->set_format(v1::FLOAT8_E4M3FN);
    q->set_scale_parameter(absl::StrCat("w", half, "_scale"));
    q->set_block_rows(16);
    q->set_block_cols(16);
    v1::Parameter& scale = params.emplace_back();
    scale.set_name(absl::StrCat("w", half, "_scale"));
    scale.set_dtype(v1::FLOAT32);
    scale.add_shape(4);
    scale.add_shape(1);
  }
  Engine e = MakeEngineOf("e", params, mapper);
  auto linked = [&](int senders, const std::vector<WireTensor>& wire) {
    std::vector<std::array<int64_t, 4>> holds;
    for (int s = 0; s < senders; ++s) {
      holds.push_back({0, 64, 32 / senders * s, 32 / senders});
    }
    absl::StatusOr<TransferPlan> plan =
        BuildTransferPlan(OneTensorSpec(64, 32, holds));
    EXPECT_TRUE(plan.ok()) << plan.status();
    return BuildLinkedCopyPlan(*plan, {0}, 1024, {e.layout}, {}, wire);
  };
  absl::StatusOr<LinkedCopyPlan> one = linked(1, {});
  ASSERT_TRUE(one.ok()) << one.status();
  absl::StatusOr<LinkedCopyPlan> two = linked(2, {});
  ASSERT_TRUE(two.ok()) << two.status();
  ASSERT_EQ(two->copy->quant.size(), 2u);
  for (const QuantTarget& t : two->copy->quant) {
    EXPECT_FALSE(t.gathered) << t.parameter;
  }
  EXPECT_GT(one->copy->quant_band_bytes, 0);
  EXPECT_EQ(two->copy->quant_band_bytes, 2 * one->copy->quant_band_bytes);
  for (int senders : {1, 2}) {
    absl::StatusOr<LinkedCopyPlan> wired =
        linked(senders, WireOf({"w"}, 16).tensors);
    ASSERT_TRUE(wired.ok()) << wired.status();
    EXPECT_TRUE(wired->copy->quant.empty()) << senders;
    EXPECT_TRUE(wired->copy->covers_engine[0]) << senders;
    // Each link's one piece travels quantised: a byte an element (and
    // the scales of its 16 x 16 blocks), not float32's four.
    const absl::StatusOr<LinkedCopyPlan>& dense = senders == 1 ? one : two;
    ASSERT_EQ(wired->links.size(), dense->links.size());
    for (size_t k = 0; k < wired->links.size(); ++k) {
      EXPECT_EQ(wired->links[k].bytes,
                64 * 32 / senders + 64 / 16 * 32 / senders / 16 * 4)
          << senders;
      EXPECT_EQ(dense->links[k].bytes, 64 * 32 / senders * 4) << senders;
    }
  }
}

// plan_wire's block grid at its edges: the default blocks (0: 128), blocks
// one row or one column wide (any cut lies on them), and a cut that only
// a piece's begin or only its end shows; the refusal names the first
// piece off the grid.
TEST(LinkPlanTest, Fp8OnTheWireTakesEveryPieceOnItsBlocksAndNoOther) {
  struct Case {
    int64_t rows, cols, br, bc;
    std::vector<std::array<int64_t, 4>> holds;  // each sender's r0 rn c0 cn
    std::string refused;                        // empty: accepted
  };
  const std::vector<Case> cases = {
      {256, 128, 0, 0, {{0, 128, 0, 128}, {128, 128, 0, 128}}, ""},
      {256,
       128,
       0,
       0,
       {{0, 85, 0, 128}, {85, 85, 0, 128}, {170, 86, 0, 128}},
       "sender 0's piece rows [0, 85) x cols [0, 128) cuts its 128 x 128"},
      {64, 32, 1, 16, {{0, 21, 0, 32}, {21, 21, 0, 32}, {42, 22, 0, 32}}, ""},
      {64, 32, 16, 1, {{0, 64, 0, 10}, {0, 64, 10, 11}, {0, 64, 21, 11}}, ""},
      {64,
       32,
       16,
       16,
       {{0, 64, 10, 22}, {0, 64, 0, 10}},
       "sender 0's piece rows [0, 64) x cols [10, 32) cuts its 16 x 16"},
      {64,
       32,
       16,
       16,
       {{0, 64, 0, 10}, {0, 64, 10, 22}},
       "sender 0's piece rows [0, 64) x cols [0, 10) cuts its 16 x 16"},
  };
  for (const Case& c : cases) {
    testing::HeapMapper mapper;
    Engine e = OneFp8Engine(c.rows, c.cols, c.br, c.bc, mapper);
    absl::StatusOr<TransferPlan> plan =
        BuildTransferPlan(OneTensorSpec(c.rows, c.cols, c.holds));
    ASSERT_TRUE(plan.ok()) << plan.status();
    WireTensor w;
    w.tensor = "w";
    w.quantization.set_format(v1::FLOAT8_E4M3FN);
    w.quantization.set_scheme(v1::QUANT_SCHEME_BLOCK);
    w.quantization.set_block_rows(c.br);
    w.quantization.set_block_cols(c.bc);
    absl::StatusOr<LinkedCopyPlan> linked =
        BuildLinkedCopyPlan(*plan, {0}, 4096, {e.layout}, {}, {w});
    const std::string what =
        absl::StrCat(c.rows, " x ", c.cols, " in ", c.br, " x ", c.bc,
                     " blocks, ", c.holds.size(), " senders");
    if (c.refused.empty()) {
      ASSERT_TRUE(linked.ok()) << what << ": " << linked.status();
      EXPECT_TRUE(linked->copy->quant.empty()) << what;
    } else {
      EXPECT_EQ(linked.status().code(), absl::StatusCode::kInvalidArgument)
          << what;
      EXPECT_THAT(linked.status().message(), HasSubstr(c.refused)) << what;
    }
  }
}

// An engine's FP8 target whose elements a receiver no longer needs (the
// plan was made before the layout changed) is refused, naming it.
TEST(LinkPlanTest, Fp8TargetNotCoveredIsRefused) {
  testing::HeapMapper mapper;
  std::vector<Engine> engines = {TinyFp8Engine(mapper)};
  const Manifest manifest = TinyManifest();
  v1::TransferPlanSpec spec = Spec(manifest, 2, Split::kRows, engines);
  // The receiver forgets the last row of q_proj's need.
  for (v1::TensorBlock& b : *spec.mutable_receivers(0)->mutable_needs()) {
    if (b.tensor() == "model.layers.0.self_attn.q_proj.weight") {
      b.set_row_count(b.row_count() - 1);
    }
  }
  absl::StatusOr<TransferPlan> plan = BuildTransferPlan(spec);
  ASSERT_TRUE(plan.ok()) << plan.status();
  absl::StatusOr<LinkedCopyPlan> linked =
      BuildLinkedCopyPlan(*plan, {0}, 4096, {engines[0].layout});
  ASSERT_FALSE(linked.ok());
  EXPECT_EQ(linked.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(linked.status().message(), HasSubstr("FP8 target"));
  EXPECT_THAT(linked.status().message(), HasSubstr("engine 'fp8'"));
  EXPECT_THAT(linked.status().message(), HasSubstr("make it again"));
}

// Pieces sent as sparse patches: each becomes a patch of its pseudo tensor
// (through the engines' segments it meets), in its link's stream; the rest
// stay copies; no engine is rewritten whole. Bad entries are refused
// naming them.
TEST(LinkPlanTest, SparsePiecesBecomePatchesOfTheirLinks) {
  testing::HeapMapper mapper;
  std::vector<Engine> engines = {
      MakeEngine("plain", synthetic::Layout::kPlain, 0, 1, v1::BFLOAT16,
                 mapper),
      MakeEngine("tp0", synthetic::Layout::kTensorParallel, 0, 2, v1::BFLOAT16,
                 mapper)};
  const auto model = *synthetic::ModelByName("tiny");
  Manifest manifest;
  for (const v1::TensorSpec& t : synthetic::Checkpoint(model, v1::FLOAT32)) {
    *manifest.Add() = t;
  }
  absl::StatusOr<TransferPlan> plan =
      BuildTransferPlan(Spec(manifest, 2, Split::kRows, engines));
  ASSERT_TRUE(plan.ok()) << plan.status();
  std::vector<std::shared_ptr<const EngineLayout>> layouts;
  for (const Engine& e : engines) layouts.push_back(e.layout);
  absl::StatusOr<LinkedCopyPlan> dense =
      BuildLinkedCopyPlan(*plan, {0}, 4096, layouts);
  ASSERT_TRUE(dense.ok()) << dense.status();
  const std::vector<LinkPatch> patches = {{0, 1, 3, 4}, {1, 0, 1, 8}};
  absl::StatusOr<LinkedCopyPlan> sparse =
      BuildLinkedCopyPlan(*plan, {0}, 4096, layouts, patches);
  ASSERT_TRUE(sparse.ok()) << sparse.status();
  const CopyPlan& c = *sparse->copy;
  ASSERT_EQ(c.sparse.size(), 2u);
  const std::string piece01 = LinkManifest(*plan, 0, 0).Get(1).name();
  const std::string piece10 = LinkManifest(*plan, 1, 0).Get(0).name();
  EXPECT_EQ(c.sparse[0].name, piece01);
  EXPECT_EQ(c.sparse[0].nnz, 3);
  EXPECT_EQ(c.sparse[0].index_bytes, 4);
  EXPECT_EQ(c.sparse[1].name, piece10);
  EXPECT_EQ(c.sparse[1].index_bytes, 8);
  for (const SparsePatch& p : c.sparse) {
    EXPECT_EQ(c.manifest.Get(p.tensor).name(), p.name);
    EXPECT_FALSE(p.uses.empty()) << p.name;
  }
  // Each patch's payload lies in its own link's chunks.
  int64_t pieces = 0;
  for (const LinkChunks& l : sparse->links) {
    for (int64_t k = l.first_chunk; k < l.first_chunk + l.num_chunks; ++k) {
      for (const auto& [patch, piece] : c.sparse_pieces_by_chunk[k]) {
        EXPECT_EQ(c.sparse[patch].name, l.sender == 0 ? piece01 : piece10);
        EXPECT_EQ(c.manifest.Get(piece.tensor).name(), c.sparse[patch].name);
        ++pieces;
      }
    }
  }
  EXPECT_GE(pieces, 2);
  EXPECT_LT(c.chunks.total_bytes, dense->copy->chunks.total_bytes);
  for (size_t e = 0; e < engines.size(); ++e) {
    EXPECT_TRUE(dense->copy->covers_engine[e]);
    EXPECT_FALSE(c.covers_engine[e]);
  }
  struct Bad {
    LinkPatch patch;
    const char* words;
  };
  const int32_t last = plan->links[0][0].size();
  for (const Bad& b : std::vector<Bad>{
           {{2, 0, 1, 8}, "names no piece"},
           {{-1, 0, 1, 8}, "names no piece"},
           {{0, last, 1, 8}, "names no piece"},
           {{0, -1, 1, 8}, "names no piece"},
           {{0, 0, 0, 8}, "has nnz 0"},
           {{0, 0, 1 << 30, 8}, "nnz must be 1 to the piece's elements"},
           {{0, 0, 1, 2}, "2-byte indices"}}) {
    absl::StatusOr<LinkedCopyPlan> r =
        BuildLinkedCopyPlan(*plan, {0}, 4096, layouts, {b.patch});
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << b.words;
    EXPECT_THAT(r.status().message(), HasSubstr(b.words));
  }
  // nnz one past the piece's elements; the last piece of a link is one.
  const PlanPiece& p1 = plan->pieces[plan->links[0][0][1]];
  absl::StatusOr<LinkedCopyPlan> over = BuildLinkedCopyPlan(
      *plan, {0}, 4096, layouts, {{0, 1, p1.row_count * p1.col_count + 1, 8}});
  EXPECT_EQ(over.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(over.status().message(),
              HasSubstr("nnz must be 1 to the piece's elements"));
  EXPECT_TRUE(
      BuildLinkedCopyPlan(*plan, {0}, 4096, layouts, {{0, last - 1, 1, 8}})
          .ok());
  absl::StatusOr<LinkedCopyPlan> twice = BuildLinkedCopyPlan(
      *plan, {0}, 4096, layouts, {{0, 1, 3, 4}, {0, 1, 2, 4}});
  EXPECT_EQ(twice.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(twice.status().message(), HasSubstr("named twice"));
  // A piece's whole elements is the most a patch names.
  const PlanPiece& p0 = plan->pieces[plan->links[0][0][0]];
  EXPECT_TRUE(BuildLinkedCopyPlan(*plan, {0}, 4096, layouts,
                                  {{0, 0, p0.row_count * p0.col_count, 4}})
                  .ok());
}

// uint32 indices reach 2^32 elements: a piece of exactly that many takes
// them, one of more needs int64 (the plan describes the tensor; no engine
// holds it, so nothing of its 4 GiB is allocated).
TEST(LinkPlanTest, FourByteIndicesReachTwoToTheThirtyTwoElements) {
  testing::HeapMapper mapper;
  std::vector<Engine> engines = {MakeEngine("plain", synthetic::Layout::kPlain,
                                            0, 1, v1::BFLOAT16, mapper)};
  const auto model = *synthetic::ModelByName("tiny");
  Manifest manifest;
  for (const v1::TensorSpec& t : synthetic::Checkpoint(model, v1::FLOAT32)) {
    *manifest.Add() = t;
  }
  const int64_t four_g = int64_t{1} << 32;
  v1::TensorSpec* huge = manifest.Add();
  huge->set_name("huge");
  huge->set_dtype(v1::UINT8);
  huge->add_shape(four_g + 1);
  v1::TransferPlanSpec spec = Spec(manifest, 1, Split::kRows, engines);
  // The receiver needs the first 2^32 elements (rows of the [2^32 + 1, 1]
  // view): one piece.
  *spec.mutable_receivers(0)->add_needs() = Block("huge", 0, four_g, 0, 1);
  absl::StatusOr<TransferPlan> plan = BuildTransferPlan(spec);
  ASSERT_TRUE(plan.ok()) << plan.status();
  int32_t big = -1;
  const std::vector<int32_t>& link = plan->links[0][0];
  for (size_t k = 0; k < link.size(); ++k) {
    const PlanPiece& p = plan->pieces[link[k]];
    if (manifest.Get(p.tensor).name() == "huge" && p.row_count == four_g) {
      big = k;
    }
  }
  ASSERT_GE(big, 0);
  const std::vector<std::shared_ptr<const EngineLayout>> layouts = {
      engines[0].layout};
  EXPECT_TRUE(BuildLinkedCopyPlan(*plan, {0}, int64_t{1} << 30, layouts,
                                  {{0, big, 1, 4}})
                  .ok());
  // One element more: the same piece made one row longer.
  v1::TransferPlanSpec longer = spec;
  auto* needs = longer.mutable_receivers(0)->mutable_needs();
  needs->RemoveLast();
  *longer.mutable_receivers(0)->add_needs() =
      Block("huge", 0, four_g + 1, 0, 1);
  plan = BuildTransferPlan(longer);
  ASSERT_TRUE(plan.ok()) << plan.status();
  big = -1;
  for (size_t k = 0; k < plan->links[0][0].size(); ++k) {
    if (manifest.Get(plan->pieces[plan->links[0][0][k]].tensor).name() ==
        "huge") {
      big = k;
    }
  }
  ASSERT_GE(big, 0);
  absl::StatusOr<LinkedCopyPlan> r = BuildLinkedCopyPlan(
      *plan, {0}, int64_t{1} << 30, layouts, {{0, big, 1, 4}});
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(r.status().message(), HasSubstr("4-byte indices"));
  EXPECT_TRUE(BuildLinkedCopyPlan(*plan, {0}, int64_t{1} << 30, layouts,
                                  {{0, big, 1, 8}})
                  .ok());
}

TEST(LinkPlanTest, ASparsePieceIntoAnFp8TargetIsRefused) {
  testing::HeapMapper mapper;
  std::vector<Engine> engines = {TinyFp8Engine(mapper)};
  const Manifest manifest = TinyManifest();
  absl::StatusOr<TransferPlan> plan =
      BuildTransferPlan(Spec(manifest, 2, Split::kRows, engines));
  ASSERT_TRUE(plan.ok()) << plan.status();
  // The link piece of an FP8 linear layer's weight, and of a plain norm.
  int32_t fp8_piece = -1, plain_piece = -1;
  const std::vector<int32_t>& link = plan->links[0][0];
  for (size_t k = 0; k < link.size(); ++k) {
    const std::string& t = manifest.Get(plan->pieces[link[k]].tensor).name();
    if (synthetic::IsFp8Linear(t) && fp8_piece < 0) fp8_piece = k;
    if (t.find("norm") != std::string::npos && plain_piece < 0) plain_piece = k;
  }
  ASSERT_GE(fp8_piece, 0);
  ASSERT_GE(plain_piece, 0);
  absl::StatusOr<LinkedCopyPlan> r = BuildLinkedCopyPlan(
      *plan, {0}, 4096, {engines[0].layout}, {{0, fp8_piece, 1, 4}});
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(r.status().message(), HasSubstr("feeds FP8 target"));
  EXPECT_THAT(r.status().message(), HasSubstr("send it dense"));
  EXPECT_TRUE(BuildLinkedCopyPlan(*plan, {0}, 4096, {engines[0].layout},
                                  {{0, plain_piece, 1, 4}})
                  .ok());
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
  v1::TransferPlanSpec spec = Spec(manifest, 2, Split::kRows, engines);
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

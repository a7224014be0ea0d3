// PlanP2pRounds (backends/cuda/p2p_rounds.h): the M->N receive rounds and
// direct receives of a GPU worker, checked without a GPU.
#include "backends/cuda/p2p_rounds.h"

#include "gtest/gtest.h"
#include "weightsync/v1/types.pb.h"

namespace weightsync {
namespace {

using worker::v1::BeginUpdateRequest;
using worker::v1::GpuOp;

// rank 2 of 4; allocation 7 is on the worker's GPU, 8 is not.
bool OnMyGpu(int64_t id) { return id == 7; }

void AddChunk(BeginUpdateRequest* r, int64_t bytes, int peer, int round) {
  r->add_chunk_sizes(bytes);
  r->add_chunk_peers(peer);
  r->add_chunk_rounds(round);
}

GpuOp* AddOp(BeginUpdateRequest* r, int64_t chunk, int64_t alloc, int64_t rows,
             int64_t cols, int64_t src_stride, int64_t dst_stride) {
  GpuOp* o = r->add_ops();
  o->set_chunk(chunk);
  o->set_allocation_id(alloc);
  o->set_rows(rows);
  o->set_cols(cols);
  o->set_src_stride(src_stride);
  o->set_dst_stride(dst_stride);
  o->set_src_dtype(v1::BFLOAT16);
  o->set_dst_dtype(v1::BFLOAT16);
  return o;
}

void AddRegion(BeginUpdateRequest* r, int64_t alloc, int64_t offset,
               int64_t rows, int64_t bytes_a_row, int64_t stride = 0) {
  worker::v1::ReceiptRegionSpec* g = r->mutable_receipts()->add_regions();
  g->set_allocation_id(alloc);
  g->set_offset(offset);
  g->set_rows(rows);
  g->set_cols(bytes_a_row / 2);
  g->set_element_size(2);
  g->set_row_stride_bytes(stride ? stride : bytes_a_row);
}

BeginUpdateRequest TwoSenders() {
  // Round 0: a chunk from each trainer rank; round 1: the same.
  BeginUpdateRequest r;
  r.set_staging_buffers(4);
  AddChunk(&r, 4096, 0, 0);
  AddChunk(&r, 4096, 1, 0);
  AddChunk(&r, 4096, 0, 1);
  AddChunk(&r, 2048, 1, 1);
  AddOp(&r, 0, 7, 16, 128, 256, 256);  // contiguous whole chunk: direct
  AddOp(&r, 1, 7, 16, 64, 128, 256);   // strided destination: staged
  AddOp(&r, 1, 7, 16, 64, 128, 256);
  AddOp(&r, 2, 8, 16, 128, 256, 256);  // another GPU's memory: staged
  AddOp(&r, 3, 7, 1, 1024, 2048, 0);   // one row: direct
  return r;
}

TEST(P2pRoundsTest, RoundsAndDirectChunks) {
  auto s = PlanP2pRounds(TwoSenders(), 4, 2, OnMyGpu);
  ASSERT_TRUE(s.ok()) << s.status();
  ASSERT_EQ(s->rounds.size(), 2u);
  EXPECT_EQ(s->rounds[0].first, 0);
  EXPECT_EQ(s->rounds[0].end, 2);
  EXPECT_EQ(s->rounds[1].first, 2);
  EXPECT_EQ(s->rounds[1].end, 4);
  EXPECT_EQ(s->direct, (std::vector<bool>{true, false, false, true}));
  EXPECT_EQ(s->direct_op[0], 0);
  EXPECT_EQ(s->direct_op[3], 4);
  EXPECT_EQ(s->direct_bytes, 4096 + 2048);
  EXPECT_EQ(s->staged_chunks, 2);
}

TEST(P2pRoundsTest, NoRoundsMeansOneChunkARound) {
  BeginUpdateRequest r = TwoSenders();
  r.clear_chunk_rounds();
  auto s = PlanP2pRounds(r, 4, 2, OnMyGpu);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->rounds.size(), 4u);
}

TEST(P2pRoundsTest, ReceiptsDoNotStageAChunk) {
  // The worker sums a region after its chunk's round, in place or staged.
  BeginUpdateRequest r = TwoSenders();
  r.add_receipt_after_chunk(0);
  r.add_receipt_after_chunk(3);
  auto s = PlanP2pRounds(r, 4, 2, OnMyGpu);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->direct, (std::vector<bool>{true, false, false, true}));
}

TEST(P2pRoundsTest, OtherWorkIsNeverDirect) {
  BeginUpdateRequest r = TwoSenders();
  r.add_sparse_pieces()->set_chunk(3);
  r.add_quant_steps()->set_chunk(0);
  auto s = PlanP2pRounds(r, 4, 2, OnMyGpu);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_FALSE(s->direct[0]);
  EXPECT_FALSE(s->direct[3]);
  r = TwoSenders();  // a conversion is staged
  r.mutable_ops(0)->set_dst_dtype(v1::FLOAT32);
  s = PlanP2pRounds(r, 4, 2, OnMyGpu);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_FALSE(s->direct[0]);
  r = TwoSenders();  // part of the chunk only
  r.mutable_ops(0)->set_rows(8);
  s = PlanP2pRounds(r, 4, 2, OnMyGpu);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_FALSE(s->direct[0]);
}

void ExpectRefused(const BeginUpdateRequest& r, const std::string& what) {
  auto s = PlanP2pRounds(r, 4, 2, OnMyGpu);
  ASSERT_FALSE(s.ok()) << what;
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.status().message().find(what), std::string::npos)
      << s.status().message();
}

TEST(P2pRoundsTest, BadRequestsRefusedNamingTheField) {
  BeginUpdateRequest r = TwoSenders();
  r.add_chunk_peers(0);
  ExpectRefused(r, "chunk_peers has 5 entries for 4 chunks");
  r = TwoSenders();
  r.set_chunk_peers(1, 2);
  ExpectRefused(r, "chunk 1 comes from rank 2: not a peer of rank 2");
  r = TwoSenders();
  r.set_chunk_peers(1, 4);
  ExpectRefused(r, "comes from rank 4");
  r = TwoSenders();
  r.set_chunk_rounds(2, 0);
  r.set_chunk_rounds(3, 0);
  r.set_chunk_rounds(1, 1);
  ExpectRefused(r, "chunk_rounds decrease at chunk 2");
  r = TwoSenders();
  r.set_chunk_peers(1, 0);
  ExpectRefused(r, "round 0 has two chunks from rank 0 (chunk 1)");
  r = TwoSenders();
  r.set_staging_buffers(2);  // one staged chunk a round: round 0 has two
  r.mutable_ops(0)->set_rows(8);
  ExpectRefused(r, "round 0 stages 2 chunks; 2 staging buffers take 1 a round");
  r = TwoSenders();
  r.set_staged(true);
  ExpectRefused(r, "not staged, not IPC");
  r = TwoSenders();
  r.set_chunk_sizes(2, 0);
  ExpectRefused(r, "chunk 2 has 0 bytes");
}

TEST(P2pRoundsTest, MoreRefusalsNamingTheField) {
  BeginUpdateRequest r = TwoSenders();
  r.add_chunk_rounds(2);
  ExpectRefused(r, "chunk_rounds has 5 entries for 4 chunks");
  r = TwoSenders();
  r.set_ipc_source_handle("h");
  ExpectRefused(r, "not staged, not IPC");
  r = TwoSenders();
  r.set_ipc_registered_source(true);
  ExpectRefused(r, "not staged, not IPC");
  r = TwoSenders();
  r.set_staging_buffers(1);
  ExpectRefused(r, "at least 2 staging buffers");
  r = TwoSenders();
  r.mutable_ops(2)->set_chunk(4);
  ExpectRefused(r, "op 2 names chunk 4 of 4");
  r = TwoSenders();
  r.mutable_ops(2)->set_chunk(-1);
  ExpectRefused(r, "op 2 names chunk -1 of 4");
  r = TwoSenders();
  r.set_chunk_peers(0, -1);
  ExpectRefused(r, "chunk 0 comes from rank -1");
}

TEST(P2pRoundsTest, EdgesThatAreAccepted) {
  // The last rank of the world is a peer; a chunk of one byte is a chunk;
  // two staging buffers are enough for a round that stages one chunk.
  BeginUpdateRequest r = TwoSenders();
  r.set_chunk_peers(1, 3);
  r.set_chunk_peers(3, 3);
  EXPECT_TRUE(PlanP2pRounds(r, 4, 2, OnMyGpu).ok());
  r = TwoSenders();
  r.set_chunk_sizes(3, 1);
  r.mutable_ops(4)->set_cols(0);  // (the op no longer fills it: staged)
  auto s = PlanP2pRounds(r, 4, 2, OnMyGpu);
  ASSERT_TRUE(s.ok()) << s.status();
  r = TwoSenders();  // each round stages one chunk: two buffers do
  r.set_staging_buffers(2);
  s = PlanP2pRounds(r, 4, 2, OnMyGpu);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->staged_chunks, 2);
}

TEST(P2pRoundsTest, InPlaceOnlyForOneOpThatTakesTheWholeChunk) {
  // Two engines on this GPU need the same bytes: two ops from one chunk.
  BeginUpdateRequest r = TwoSenders();
  AddOp(&r, 0, 7, 16, 128, 256, 256)->set_dst_offset(1 << 20);
  auto s = PlanP2pRounds(r, 4, 2, OnMyGpu);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_FALSE(s->direct[0]);
  // An op that reads from byte 16 of the chunk, or from another allocation
  // (a registered source), is not the chunk received in place.
  r = TwoSenders();
  r.mutable_ops(0)->set_src_offset(16);
  s = PlanP2pRounds(r, 4, 2, OnMyGpu);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_FALSE(s->direct[0]);
  r = TwoSenders();
  r.mutable_ops(0)->set_src_allocation_id(9);
  s = PlanP2pRounds(r, 4, 2, OnMyGpu);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_FALSE(s->direct[0]);
  EXPECT_TRUE(s->direct[3]);
}

TEST(P2pRoundsTest, MostChunksInARound) {
  EXPECT_EQ(MaxChunksPerRound({}), 0);
  EXPECT_EQ(MaxChunksPerRound({4}), 1);
  EXPECT_EQ(MaxChunksPerRound({0, 0, 0, 5, 5}), 3);  // the first round
  EXPECT_EQ(MaxChunksPerRound({0, 1, 1, 1}), 3);     // the last round
  EXPECT_EQ(MaxChunksPerRound({2, 7, 2, 7, 2}), 3);  // unsorted
}

TEST(P2pRoundsTest, EmptyRegionsAndOpsPlaceNothing) {
  // A region of no rows or no columns holds no byte: no op's chunk is its
  // last, whatever the op covers; an op of no rows writes nothing.
  BeginUpdateRequest r;
  for (int k = 0; k < 4; ++k) r.add_chunk_sizes(100);
  AddRegion(&r, 7, 0, 0, 100, /*stride=*/1);  // no rows
  AddRegion(&r, 7, 0, 2, 0, 100);             // no columns
  AddRegion(&r, 7, 1000, 1, 100);
  for (int i = 0; i < 3; ++i) r.add_receipt_after_chunk(3);
  AddOp(&r, 3, 7, 2, 50, 100, 100)->set_dst_offset(0);   // [0, 200)
  AddOp(&r, 2, 7, 0, 50, 100, 1)->set_dst_offset(1000);  // no rows
  AddOp(&r, 1, 7, 1, 50, 100, 100)->set_dst_offset(1000);
  ASSERT_TRUE(PlaceReceipts(&r).ok());
  EXPECT_EQ(std::vector<int64_t>(r.receipt_after_chunk().begin(),
                                 r.receipt_after_chunk().end()),
            (std::vector<int64_t>{0, 0, 1}));
}

TEST(P2pRoundsTest, DaemonOrdersLinkChunksByRound) {
  // The copy plan's order: link (0 -> me) chunks 0, 1, 2, then link
  // (1 -> me) chunks 3, 4; round r = chunk r of every link.
  BeginUpdateRequest r;
  r.set_staging_buffers(2);
  for (int64_t b : {100, 200, 300, 400, 500}) r.add_chunk_sizes(b);
  AddOp(&r, 0, 7, 1, 50, 100, 100)->set_dst_offset(0);
  AddOp(&r, 1, 7, 1, 100, 200, 200)->set_dst_offset(1);
  AddOp(&r, 1, 7, 1, 100, 200, 200)->set_dst_offset(2);
  AddOp(&r, 2, 7, 1, 150, 300, 300)->set_dst_offset(3);
  AddOp(&r, 3, 7, 1, 200, 400, 400)->set_dst_offset(4);
  AddOp(&r, 4, 7, 1, 250, 500, 500)->set_dst_offset(5);
  // One receipt region over every op's bytes: summed after the last chunk.
  AddRegion(&r, 7, 0, 1, 600);
  r.add_receipt_after_chunk(2);
  const std::vector<int32_t> sender = {0, 0, 0, 1, 1};
  const std::vector<int64_t> round = {0, 1, 2, 0, 1};
  ASSERT_TRUE(OrderChunksByRound(sender, round, &r).ok());
  // New order: (r0, s0) 100, (r0, s1) 400, (r1, s0) 200, (r1, s1) 500, (r2)
  // 300.
  EXPECT_EQ(
      std::vector<int64_t>(r.chunk_sizes().begin(), r.chunk_sizes().end()),
      (std::vector<int64_t>{100, 400, 200, 500, 300}));
  EXPECT_EQ(
      std::vector<int32_t>(r.chunk_peers().begin(), r.chunk_peers().end()),
      (std::vector<int32_t>{0, 1, 0, 1, 0}));
  EXPECT_EQ(
      std::vector<int32_t>(r.chunk_rounds().begin(), r.chunk_rounds().end()),
      (std::vector<int32_t>{0, 0, 1, 1, 2}));
  std::vector<std::pair<int64_t, int64_t>> ops;  // (chunk, dst_offset)
  for (const GpuOp& o : r.ops()) ops.push_back({o.chunk(), o.dst_offset()});
  EXPECT_EQ(ops, (std::vector<std::pair<int64_t, int64_t>>{
                     {0, 0}, {1, 4}, {2, 1}, {2, 2}, {3, 5}, {4, 3}}));
  EXPECT_EQ(r.receipt_after_chunk(0), 4);
  EXPECT_EQ(r.staging_buffers(), 4);  // two senders a round: 2 x 2
  // The worker takes what the daemon built (rank 2 of 4).
  auto s = PlanP2pRounds(r, 4, 2, OnMyGpu);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->rounds.size(), 3u);
}

TEST(P2pRoundsTest, EachRegionSummedAfterTheLastChunkWritingIt) {
  // Allocation 7: regions [0, 100), [100, 300), [300, 400), [400, 500)
  // (none written), [1000, 1400) as 2 rows of 100 bytes, 300 apart;
  // allocation 9: one region no op writes.
  BeginUpdateRequest r;
  for (int k = 0; k < 6; ++k) r.add_chunk_sizes(100);
  AddRegion(&r, 7, 0, 1, 100);
  AddRegion(&r, 7, 100, 1, 200);
  AddRegion(&r, 7, 300, 1, 100);
  AddRegion(&r, 7, 400, 1, 100);
  AddRegion(&r, 7, 1000, 2, 100, 300);
  AddRegion(&r, 9, 0, 1, 100);
  for (int i = 0; i < 6; ++i) r.add_receipt_after_chunk(5);
  AddOp(&r, 3, 7, 1, 50, 100, 100)->set_dst_offset(0);     // [0, 100)
  AddOp(&r, 1, 7, 1, 50, 100, 100)->set_dst_offset(100);   // [100, 200)
  AddOp(&r, 4, 7, 1, 50, 100, 100)->set_dst_offset(200);   // [200, 300)
  AddOp(&r, 0, 7, 1, 50, 100, 100)->set_dst_offset(300);   // [300, 400)
  AddOp(&r, 2, 7, 1, 50, 100, 100)->set_dst_offset(1300);  // the 2nd row
  AddOp(&r, 5, 8, 1, 50, 100, 100)->set_dst_offset(0);     // another alloc
  ASSERT_TRUE(PlaceReceipts(&r).ok());
  EXPECT_EQ(std::vector<int64_t>(r.receipt_after_chunk().begin(),
                                 r.receipt_after_chunk().end()),
            (std::vector<int64_t>{3, 4, 0, 0, 2, 0}));
  // Overlapping regions, one inside the other: each gets its own writers.
  r.clear_receipts();
  r.clear_receipt_after_chunk();
  AddRegion(&r, 7, 0, 1, 400);
  AddRegion(&r, 7, 100, 1, 100);
  r.add_receipt_after_chunk(0);
  r.add_receipt_after_chunk(0);
  ASSERT_TRUE(PlaceReceipts(&r).ok());
  EXPECT_EQ(r.receipt_after_chunk(0), 4);
  EXPECT_EQ(r.receipt_after_chunk(1), 1);
  // A strided op covers its rows' gaps too (only ever later): 2 rows of 50
  // bytes from 150, 200 apart, reach [150, 400).
  r.mutable_ops(4)->set_dst_offset(150);
  r.mutable_ops(4)->set_rows(2);
  r.mutable_ops(4)->set_cols(25);
  r.mutable_ops(4)->set_dst_stride(200);
  r.mutable_ops(4)->set_chunk(5);
  ASSERT_TRUE(PlaceReceipts(&r).ok());
  EXPECT_EQ(r.receipt_after_chunk(0), 5);
  EXPECT_EQ(r.receipt_after_chunk(1), 5);
  // Regions and entries that differ in number: refused.
  r.add_receipt_after_chunk(0);
  EXPECT_EQ(PlaceReceipts(&r).code(), absl::StatusCode::kInvalidArgument);
}

TEST(P2pRoundsTest, DaemonOrderRefusesWhatMtoNDoesNotCarry) {
  BeginUpdateRequest r;
  r.add_chunk_sizes(100);
  EXPECT_EQ(OrderChunksByRound({0, 1}, {0, 0}, &r).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(OrderChunksByRound({-1}, {0}, &r).code(),
            absl::StatusCode::kInvalidArgument);
  r.set_staged(true);
  EXPECT_EQ(OrderChunksByRound({0}, {0}, &r).code(),
            absl::StatusCode::kUnimplemented);
  r.set_staged(false);
  r.add_quant_steps()->set_chunk(0);
  EXPECT_EQ(OrderChunksByRound({0}, {0}, &r).code(),
            absl::StatusCode::kUnimplemented);
  // Each table one per chunk; one sparse patch, held ops: not carried.
  r = BeginUpdateRequest();
  r.add_chunk_sizes(100);
  EXPECT_EQ(OrderChunksByRound({0}, {0, 0}, &r).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(OrderChunksByRound({0, 0}, {0}, &r).code(),
            absl::StatusCode::kInvalidArgument);
  r.add_sparse()->set_name("w");
  EXPECT_EQ(OrderChunksByRound({0}, {0}, &r).code(),
            absl::StatusCode::kUnimplemented);
  r.clear_sparse();
  r.set_reuse_ops(true);
  EXPECT_EQ(OrderChunksByRound({0}, {0}, &r).code(),
            absl::StatusCode::kUnimplemented);
  r.set_reuse_ops(false);
  // An op naming a chunk the update does not have.
  AddOp(&r, 1, 7, 1, 50, 100, 100);
  absl::Status s = OrderChunksByRound({0}, {0}, &r);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("op 0 names chunk 1 of 1"), std::string::npos)
      << s.message();
  r.mutable_ops(0)->set_chunk(-1);
  s = OrderChunksByRound({0}, {0}, &r);
  EXPECT_NE(s.message().find("op 0 names chunk -1 of 1"), std::string::npos)
      << s.message();
  r.mutable_ops(0)->set_chunk(0);
  EXPECT_TRUE(OrderChunksByRound({0}, {0}, &r).ok());
}

TEST(P2pRoundsTest, RoundsThatDecreaseAtTheLastChunkAreRefused) {
  BeginUpdateRequest r = TwoSenders();
  r.set_chunk_rounds(0, 0);
  r.set_chunk_rounds(1, 1);
  r.set_chunk_rounds(2, 1);
  r.set_chunk_rounds(3, 0);
  r.set_chunk_peers(2, 0);
  ExpectRefused(r, "chunk_rounds decrease at chunk 3");
}

TEST(P2pRoundsTest, RegionsPlacedAtTheirEdges) {
  // Allocation 7. Regions: A [99, 100) (one byte, the op's last), B [50,
  // 101) (one byte into the second op), C [0, 400) with an empty region D
  // at 155 inside it, E [1, 2) and F [0, 1) listed begin-descending.
  BeginUpdateRequest r;
  for (int k = 0; k < 6; ++k) r.add_chunk_sizes(100);
  auto region = [&](int64_t offset, int64_t bytes) {
    worker::v1::ReceiptRegionSpec* g = r.mutable_receipts()->add_regions();
    g->set_allocation_id(7);
    g->set_offset(offset);
    g->set_rows(bytes > 0 ? 1 : 0);
    g->set_cols(bytes);
    g->set_element_size(1);
    g->set_row_stride_bytes(bytes);
    r.add_receipt_after_chunk(5);
  };
  region(99, 1);   // A
  region(50, 51);  // B
  region(0, 400);  // C
  region(155, 0);  // D
  region(1, 1);    // E
  region(0, 1);    // F
  auto op = [&](int64_t chunk, int64_t offset, int64_t bytes) {
    GpuOp* o = AddOp(&r, chunk, 7, 1, bytes, bytes, bytes);
    o->set_dst_offset(offset);
    o->set_src_dtype(v1::FLOAT8_E4M3FN);  // one byte an element
    o->set_dst_dtype(v1::FLOAT8_E4M3FN);
  };
  op(3, 0, 1);     // [0, 1): F and C
  op(2, 1, 1);     // [1, 2): E and C
  op(1, 2, 98);    // [2, 100): A, B and C
  op(4, 100, 60);  // [100, 160): B by its last byte, C, not D
  op(0, 300, 1);   // [300, 301): C
  ASSERT_TRUE(PlaceReceipts(&r).ok());
  EXPECT_EQ(std::vector<int64_t>(r.receipt_after_chunk().begin(),
                                 r.receipt_after_chunk().end()),
            (std::vector<int64_t>{1, 4, 4, 0, 2, 3}));
  // A region that only its last byte puts in an op, with no longer region
  // before it to keep the walk going.
  BeginUpdateRequest one;
  for (int k = 0; k < 5; ++k) one.add_chunk_sizes(100);
  AddRegion(&one, 7, 50, 1, 51);  // [50, 101) once one-byte elements
  one.mutable_receipts()->mutable_regions(0)->set_cols(51);
  one.mutable_receipts()->mutable_regions(0)->set_element_size(1);
  one.add_receipt_after_chunk(0);
  GpuOp* late = AddOp(&one, 4, 7, 1, 30, 60, 60);  // [100, 160)
  late->set_dst_offset(100);
  ASSERT_TRUE(PlaceReceipts(&one).ok());
  EXPECT_EQ(one.receipt_after_chunk(0), 4);
  // An op of no rows inside a region writes nothing there.
  AddOp(&r, 5, 7, 0, 10, 10, 10)->set_dst_offset(350);
  ASSERT_TRUE(PlaceReceipts(&r).ok());
  EXPECT_EQ(r.receipt_after_chunk(2), 4);
}

}  // namespace
}  // namespace weightsync

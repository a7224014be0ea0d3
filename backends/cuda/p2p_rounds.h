// M->N receives (issue 32): how a GPU worker groups an update's chunks into
// NCCL rounds and which chunks it receives straight into engine memory.
// No CUDA here: the rules are checked on the CPU (p2p_rounds_test).
//
// BeginUpdateRequest.chunk_peers names the NCCL rank each chunk comes from
// (ncclRecv); chunk_rounds groups consecutive chunks into rounds, each
// received in one ncclGroupStart/End. Every rank of the communicator takes
// its transfers in the order of the plan's rounds, so the earliest round
// not finished has every one of its ranks at it: no two ranks wait on each
// other (a round is one NCCL group on every rank that takes part in it).
#ifndef WEIGHTSYNC_BACKENDS_CUDA_P2P_ROUNDS_H_
#define WEIGHTSYNC_BACKENDS_CUDA_P2P_ROUNDS_H_

#include <cstdint>
#include <functional>
#include <vector>

#include "absl/status/statusor.h"
#include "weightsync/worker/v1/gpu_worker.pb.h"

namespace weightsync {

struct P2pRound {
  int64_t first = 0;  // chunks [first, end)
  int64_t end = 0;
};

struct P2pSchedule {
  std::vector<P2pRound> rounds;
  // direct[k]: chunk k is received into engine memory at its op's
  // destination (direct_op[k] is that op's index in request.ops).
  std::vector<bool> direct;
  std::vector<int> direct_op;
  int64_t staged_chunks = 0;
  int64_t direct_bytes = 0;
};

// The rounds and direct chunks of an M->N request, or INVALID_ARGUMENT
// naming the field: chunk_peers and chunk_rounds (if set) one per chunk,
// peers in [0, world) and not `rank`, rounds non-decreasing, no round with
// two chunks from one peer (their order would be NCCL's, not the plan's),
// and at most staging_buffers / 2 staged chunks in a round. Not staged
// (M->N streams), not IPC. `on_my_gpu(allocation_id)` says whether that
// open allocation lives on the worker's GPU (direct receives only there).
absl::StatusOr<P2pSchedule> PlanP2pRounds(
    const worker::v1::BeginUpdateRequest& request, int world, int rank,
    const std::function<bool(int64_t)>& on_my_gpu);

// The daemon's side: `req` holds an update's chunks and ops in the copy
// plan's order (links one after another); puts them in round order, chunk
// k at its place by (round[k], sender[k], k), ops renumbered and in the
// new chunk order (stable), and sets chunk_peers (= sender[k], the NCCL
// rank) and chunk_rounds; receipts placed by PlaceReceipts. The
// worker's staging buffers: at least twice the most chunks of one round.
// INVALID_ARGUMENT for tables of the wrong size or a negative sender;
// UNIMPLEMENTED for what M->N does not carry yet (staged, sparse patches,
// FP8 quant steps, held ops).
absl::Status OrderChunksByRound(const std::vector<int32_t>& sender,
                                const std::vector<int64_t>& round,
                                worker::v1::BeginUpdateRequest* req);

// Each receipt region of `req` summed after the last chunk whose ops write
// into it (ops and regions as the worker gets them; a region no op writes
// after the first chunk), so that the worker sums every region as soon as
// its bytes are in, overlapped with the rounds still arriving, not all of
// them after the last round. INVALID_ARGUMENT if the regions and their
// receipt_after_chunk entries differ in number.
absl::Status PlaceReceipts(worker::v1::BeginUpdateRequest* req);

// The most chunks any round of `round` (one entry per chunk) holds.
int64_t MaxChunksPerRound(const std::vector<int64_t>& round);

}  // namespace weightsync

#endif  // WEIGHTSYNC_BACKENDS_CUDA_P2P_ROUNDS_H_

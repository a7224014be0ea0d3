// The steps weightsync_gpu_trainer's work shares between its files
// (gpu_trainer.cc: the dense updates; gpu_trainer_sparse.cc: the sparse
// series of --sparse_densities). Internal to the tool.
#ifndef WEIGHTSYNC_TOOLS_GPU_TRAINER_STEPS_H_
#define WEIGHTSYNC_TOOLS_GPU_TRAINER_STEPS_H_

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "client/trainer_client.h"
#include "common/chunk_planner.h"
#include "glog/logging.h"
#include "tools/gpu_trainer.h"

#define CHECK_CUDA(x) CHECK_EQ((x), cudaSuccess) << #x
#define CHECK_NCCL(x) CHECK_EQ((x), ncclSuccess) << #x

namespace weightsync {

struct Sent {
  v1::FinishWeightUpdateResponse done;
  double seconds = 0;
  double start_s = 0;  // StartWeightUpdate's round trip
};

// One line per engine: its state and version.
void PrintEngines(TrainerClient& client);

// Where an update's time went, in ms (start, validate, pause, begin,
// transfer, device, commit).
std::string Breakdown(const Sent& s);

// Start, broadcast every chunk of `plan` from `buf`, Finish. With no
// `comm` (the IPC backend) the request names the shared buffer and the
// daemon pulls the bytes itself.
absl::StatusOr<Sent> Send(TrainerClient& client,
                          const v1::StartWeightUpdateRequest& req,
                          const ChunkPlan& plan, uint8_t* buf, ncclComm_t comm,
                          cudaStream_t stream);

// A legacy CUDA IPC handle of `size` bytes at `ptr` on `device`.
v1::Allocation IpcSource(void* ptr, int64_t size, int device);

// The sparse steps of --sparse_densities (gpu_trainer_sparse.cc); returns
// the exit status.
int SparseSeries(const GpuTrainerOptions& o, TrainerClient& client,
                 const std::vector<v1::TensorSpec>& specs,
                 const ChunkPlan& dense_plan, std::vector<uint8_t>& flat,
                 uint8_t* flat_dev, ncclComm_t comm, cudaStream_t stream,
                 int64_t version, const v1::Allocation* dense_source);

}  // namespace weightsync

#endif  // WEIGHTSYNC_TOOLS_GPU_TRAINER_STEPS_H_

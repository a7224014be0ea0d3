// weightsync_gpu_trainer's work (the fake GPU trainer of the NCCL and IPC
// GPU tests; tools/gpu_trainer_main.cc describes it and holds its flags and
// their parsing): the options it runs with, already checked, and the run.
#ifndef WEIGHTSYNC_TOOLS_GPU_TRAINER_H_
#define WEIGHTSYNC_TOOLS_GPU_TRAINER_H_

#include <cstdint>
#include <string>

#include "weightsync/v1/trainer_service.pb.h"

namespace weightsync {

// One field per flag of gpu_trainer_main.cc (same name and meaning; the
// defaults are the flags'), and the checkpoint dtype parsed from --dtype.
struct GpuTrainerOptions {
  std::string target;
  std::string model;
  std::string dtype;
  int32_t updates = 0;
  int64_t first_version = 0;
  int64_t chunk_mib = 0;
  int32_t settle_ms = 0;
  int64_t sparse_chunk_mib = 0;
  int32_t device = 0;
  int32_t die_after_chunks = 0;
  int32_t stall_after_chunks = 0;
  std::string finish_only;
  std::string backend;
  bool baseline_copy = false;
  bool same_data = false;
  int64_t finish_timeout_ms = 0;
  bool pause_series = false;
  std::string stall_phase;
  int32_t ipc_ring_slots = 0;
  std::string memory;
  bool registered_source = false;
  bool receipts = false;
  bool check_receipts = false;
  bool gpu_expectation = false;
  int64_t corrupt_version = 0;
  std::string mode;
  bool allow_streaming_fallback = false;
  std::string sparse_densities;
  std::string sparse_staged_steps;
  int32_t sparse_corrupt_step = 0;
  double sparse_max_density = 0;
  int64_t update_timeout_s = 0;
  v1::DType checkpoint_dtype = v1::FLOAT32;
};

// Runs the trainer: connects, forms the group, sends the updates; returns
// the process's exit status (it may also _exit, raise SIGSTOP or crash on
// purpose, as the fault flags ask).
int RunGpuTrainer(const GpuTrainerOptions& o);

}  // namespace weightsync

#endif  // WEIGHTSYNC_TOOLS_GPU_TRAINER_H_

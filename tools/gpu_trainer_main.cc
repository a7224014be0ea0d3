// weightsync_gpu_trainer: a fake trainer on a GPU for the NCCL backend (or,
// with --backend=ipc, colocated on the engines' GPU). For NCCL it creates the
// NCCL unique id, hands it to weightsyncd in InitWeightTransfer (world size 2,
// daemon at rank 1), joins as rank 0, and per update calls Start, broadcasts
// every chunk of the shared chunk plan, and calls Finish. Its tensors sit in
// one device buffer laid out exactly as the plan packs them, so each chunk is
// broadcast in place. Modes for fault tests:
// --die_after_chunks (exit mid-transfer) and --finish_only (call Finish on
// an update someone else started and report the outcome). Issue 5:
// --receipts asks for receipts (VERIFY_ON) and checks them against what was
// sent (client/receipts.h); --corrupt_version=N flips one bit of the first
// element of the first tensor in the device buffer it broadcasts for
// version N, while the expected receipts come from its uncorrupted host
// copy, so the engines hold a byte the trainer didn't mean to send and the
// check must fail with DATA_LOSS; --mode=staged sends staged updates.
// --sparse_densities=d1,d2,...: after the dense updates, one step per
// density: the weights change at about that fraction of the elements, the
// trainer diffs the new weights against the ones it sent last on the GPU
// (DiffChanged; 4-byte indices), sends a sparse update (tensors whose
// change is too large go dense), then sends the same weights again as a
// dense update: an engine must end up bit for bit the same after both
// (weightsync_gpu_engine --hash prints what to compare). NCCL, or with
// --backend=ipc (one GPU) the patches in a buffer shared by IPC handle.
//
// This file: the flags and their parsing; the work is in gpu_trainer.cc.
#include <string>

#include "gflags/gflags.h"
#include "glog/logging.h"
#include "tools/gpu_trainer.h"

DEFINE_string(target, "", "daemon address");
DEFINE_string(model, "tiny", "synthetic model");
DEFINE_string(dtype, "float32", "checkpoint dtype");
DEFINE_int32(updates, 3, "number of updates");
DEFINE_int64(first_version, 1, "version of the first update");
DEFINE_int64(chunk_mib, 64, "chunk size in MiB (0: the daemon's default)");
DEFINE_int32(settle_ms, 0,
             "sparse steps: idle this long before the sparse update and "
             "before the dense one, so that both start from the same idle "
             "state (an RL trainer computes between updates; a call after "
             "tens of ms idle costs several times a back-to-back one)");
DEFINE_int64(sparse_chunk_mib, 0,
             "chunk size in MiB of the sparse steps' patches (0: "
             "--chunk_mib); smaller chunks let the daemon apply chunk k "
             "while chunk k+1 is on the wire");
DEFINE_int32(device, 0, "CUDA ordinal of the trainer's GPU");
DEFINE_int32(die_after_chunks, -1, "exit after broadcasting this many chunks");
DEFINE_int32(stall_after_chunks, -1,
             "stop itself (SIGSTOP: a frozen trainer) after sending this many "
             "chunks of the first update; the number of chunks or more: "
             "after the last one, before Finish (tests/gpu/gpu_faults.py)");
DEFINE_string(finish_only, "", "only call Finish on this update id");
DEFINE_string(backend, "nccl",
              "nccl (trainer on another GPU) or ipc (colocated: the daemon "
              "copies from the trainer's packed buffer)");
DEFINE_bool(baseline_copy, false,
            "also time a plain on-GPU copy of the same bytes (IPC baseline)");
DEFINE_bool(same_data, false,
            "reuse version first_version's data for every update (benchmarks)");
DEFINE_int64(finish_timeout_ms, 30000, "Finish deadline");
DEFINE_bool(pause_series, false,
            "Pause the engines once before the updates and Resume after");
DEFINE_string(stall_phase, "",
              "stop this process (SIGSTOP) before the first Start, as a "
              "frozen trainer would: 'init' (group formed), 'pause' (group "
              "formed and the engines paused, as --pause_series)");
DEFINE_int32(ipc_ring_slots, 0,
             "--backend=ipc: 0 = share the whole packed update; N >= 2 = "
             "share a ring of N chunk slots, filled chunk by chunk");
DEFINE_string(memory, "ipc",
              "--backend=ipc: how the packed buffer is shared: ipc "
              "(cudaMalloc + cudaIpcGetMemHandle) or vmm (cuMemCreate + fd)");
DEFINE_bool(registered_source, true,
            "--backend=ipc without a ring: register the trainer's tensors "
            "(the buffer holding each at its plan offset) as a source once; "
            "every update is then one StartWeightUpdate{source_id, finish} "
            "call and the daemon copies from the tensors (docs/protocol.md)");
DEFINE_bool(receipts, false,
            "ask for receipts (VERIFY_ON) and check them against what was "
            "sent (exit 5 on a mismatch)");
DEFINE_bool(check_receipts, true,
            "with --receipts: check them against the expectation computed "
            "from the trainer's tensors (on the GPU, see --gpu_expectation)");
DEFINE_bool(gpu_expectation, true,
            "--check_receipts: compute the expectation on the GPU from the "
            "tensors as sent (client/receipts.h ExpectedReceiptRegions, the "
            "daemon's receipt kernel); the host computes what it can't (dtype "
            "conversion, a ring, --corrupt_version's version)");
DEFINE_int64(corrupt_version, -1,
             "flip one bit of the broadcast buffer (not of the host copy the "
             "expected receipts come from) for this version");
DEFINE_string(mode, "streaming", "streaming or staged");
DEFINE_bool(allow_streaming_fallback, false,
            "--mode=staged: stream when over the staging budget");
DEFINE_string(sparse_densities, "",
              "comma-separated densities: a sparse step, then the same "
              "weights dense, per density (NCCL, or IPC without a ring)");
DEFINE_string(sparse_staged_steps, "",
              "comma-separated step numbers (0-based) of --sparse_densities "
              "whose sparse update is sent staged");
DEFINE_int32(sparse_corrupt_step, -1,
             "in this step, set the first index of the first patch outside "
             "its tensor: the update must be refused (printed, not fatal)");
DEFINE_double(sparse_max_density, 0.15,
              "tensors changed at more than this fraction go dense");
DEFINE_int64(update_timeout_s, 120,
             "give up (exit 4) if one update takes longer: a broadcast whose "
             "receiver is gone never returns");

namespace weightsync {
namespace {

// The flags as options; false (logged) where one is out of range.
bool OptionsFromFlags(GpuTrainerOptions* out) {
  GpuTrainerOptions o;
  o.target = FLAGS_target;
  o.model = FLAGS_model;
  o.dtype = FLAGS_dtype;
  o.updates = FLAGS_updates;
  o.first_version = FLAGS_first_version;
  o.chunk_mib = FLAGS_chunk_mib;
  o.settle_ms = FLAGS_settle_ms;
  o.sparse_chunk_mib = FLAGS_sparse_chunk_mib;
  o.device = FLAGS_device;
  o.die_after_chunks = FLAGS_die_after_chunks;
  o.stall_after_chunks = FLAGS_stall_after_chunks;
  o.finish_only = FLAGS_finish_only;
  o.backend = FLAGS_backend;
  o.baseline_copy = FLAGS_baseline_copy;
  o.same_data = FLAGS_same_data;
  o.finish_timeout_ms = FLAGS_finish_timeout_ms;
  o.pause_series = FLAGS_pause_series;
  o.stall_phase = FLAGS_stall_phase;
  o.ipc_ring_slots = FLAGS_ipc_ring_slots;
  o.memory = FLAGS_memory;
  o.registered_source = FLAGS_registered_source;
  o.receipts = FLAGS_receipts;
  o.check_receipts = FLAGS_check_receipts;
  o.gpu_expectation = FLAGS_gpu_expectation;
  o.corrupt_version = FLAGS_corrupt_version;
  o.mode = FLAGS_mode;
  o.allow_streaming_fallback = FLAGS_allow_streaming_fallback;
  o.sparse_densities = FLAGS_sparse_densities;
  o.sparse_staged_steps = FLAGS_sparse_staged_steps;
  o.sparse_corrupt_step = FLAGS_sparse_corrupt_step;
  o.sparse_max_density = FLAGS_sparse_max_density;
  o.update_timeout_s = FLAGS_update_timeout_s;
  if (!o.stall_phase.empty() && o.stall_phase != "init" &&
      o.stall_phase != "pause") {
    LOG(ERROR) << "--stall_phase must be init or pause, not '" << o.stall_phase
               << "'";
    return false;
  }
  o.checkpoint_dtype = o.dtype == "bfloat16"  ? v1::BFLOAT16
                       : o.dtype == "float16" ? v1::FLOAT16
                                              : v1::FLOAT32;
  *out = o;
  return true;
}

}  // namespace
}  // namespace weightsync

int main(int argc, char** argv) {
  gflags::ParseCommandLineFlags(&argc, &argv, true);
  FLAGS_logtostderr = true;
  google::InitGoogleLogging(argv[0]);
  weightsync::GpuTrainerOptions options;
  if (!weightsync::OptionsFromFlags(&options)) return 2;
  return weightsync::RunGpuTrainer(options);
}

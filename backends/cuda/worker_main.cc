// weightsync_gpu_worker: the CUDA/NCCL data plane process. weightsyncd
// starts it, talks to it over a private Unix socket, and kills and
// respawns it if a deadline passes. Not meant to be started by hand.
#include <signal.h>
#include <unistd.h>

#include "backends/cuda/gpu_worker.h"
#include "backends/cuda/worker_env.h"
#include "gflags/gflags.h"
#include "glog/logging.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server_builder.h"

DEFINE_string(socket, "", "Unix socket to serve the worker protocol on");
DEFINE_int32(parent_pid, 0, "exit when this process is gone");
DEFINE_bool(ipc_sm_copies, false,
            "IPC backend: copy same-dtype blocks with a kernel (SMs) instead "
            "of the copy engines");
DEFINE_bool(ipc_fused_receipts, true,
            "IPC backend with receipts: copy and sum in one pass (a kernel) "
            "instead of a copy and then a receipt pass over the destination");
DEFINE_string(fp8_direct_kernel, "lean",
              "FP8 targets quantised straight from a source in GPU memory: "
              "lean (jobs of whole aligned vectors by a kernel of that path "
              "alone, the rest by cvt), regs (1024 threads, per-element "
              "walk), vec (256 threads, 16-byte vectors) or cvt (vec with "
              "the hardware's FP8 rounding below FMAX)");
DEFINE_int32(device, 0,
             "CUDA ordinal that receives and scatters: engine memory on "
             "other GPUs is opened for it, so its copies reach them by peer");

int main(int argc, char** argv) {
  // Before any thread (glibc's arenas are per thread) and before NCCL reads
  // its environment (worker_env.h).
  const weightsync::WorkerEnvDefaults env =
      weightsync::ApplyWorkerEnvDefaults();
  gflags::ParseCommandLineFlags(&argc, &argv, true);
  FLAGS_logtostderr = true;
  google::InitGoogleLogging(argv[0]);
  LOG(INFO) << "process defaults: "
            << weightsync::DescribeWorkerEnvDefaults(env);
  if (FLAGS_socket.empty()) {
    LOG(ERROR) << "--socket is required";
    return 2;
  }
  weightsync::cuda::Fp8DirectKernel fp8_kernel;
  if (!weightsync::cuda::ParseFp8DirectKernel(FLAGS_fp8_direct_kernel.c_str(),
                                              &fp8_kernel)) {
    LOG(ERROR) << "--fp8_direct_kernel must be lean, regs, vec or cvt";
    return 2;
  }
  unlink(FLAGS_socket.c_str());
  weightsync::GpuWorker worker(FLAGS_device, FLAGS_ipc_sm_copies,
                               FLAGS_ipc_fused_receipts, fp8_kernel);
  grpc::ServerBuilder builder;
  builder.SetMaxReceiveMessageSize(256 << 20);
  builder.AddListeningPort("unix:" + FLAGS_socket,
                           grpc::InsecureServerCredentials());
  builder.RegisterService(&worker);
  auto server = builder.BuildAndStart();
  if (server == nullptr) {
    LOG(ERROR) << "cannot listen on " << FLAGS_socket;
    return 1;
  }
  LOG(INFO) << "GPU worker serving on " << FLAGS_socket;
  // The daemon owns us: leave when it is gone.
  while (FLAGS_parent_pid == 0 || getppid() == FLAGS_parent_pid) {
    sleep(1);
  }
  LOG(WARNING) << "daemon gone; GPU worker exits";
  _exit(0);
}

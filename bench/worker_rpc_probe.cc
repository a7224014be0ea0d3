// How long the daemon's BeginUpdate call to its GPU worker takes, by
// request size and by how long both processes were idle before it: no GPU
// needed (without one the worker refuses the update at its first CUDA call,
// after the request has crossed the socket and been parsed, which is what
// this measures). Requests: a dense update's (one chunk, no patches) and a
// 1% sparse Qwen3-8B update's (399 patches, each one use and one piece,
// about 34 KB). Prints the median of --calls calls per size and idle time;
// with --warm_ms, also with the channel warmed that long before the call
// (what the daemon does while it plans and pauses; --warm_by).
//   bazel run //bench:worker_rpc_probe -- --idle_ms=0,50,300 --warm_ms=1,2
#include <algorithm>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "backends/cuda/worker_client.h"
#include "gflags/gflags.h"
#include "grpc/grpc.h"
#include "grpcpp/grpcpp.h"

DEFINE_string(worker, "backends/cuda/weightsync_gpu_worker",
              "the weightsync_gpu_worker binary");
DEFINE_string(idle_ms, "0,50,300",
              "comma-separated idle times before each call, ms");
DEFINE_int32(calls, 21, "calls per size and idle time");
DEFINE_string(warm_ms, "",
              "comma-separated: after the idle time, warm the channel, wait "
              "this many ms, then make the timed call");
DEFINE_string(warm_by, "warm_async",
              "warm_async: GpuWorkerSupervisor::WarmAsync, what the daemon "
              "does at StartWeightUpdate; channel2: a Ping on a second "
              "channel (wakes only the worker's end)");

namespace weightsync {
namespace {

worker::v1::BeginUpdateRequest Request(int patches) {
  worker::v1::BeginUpdateRequest req;
  req.set_chunk_bytes(int64_t{1} << 30);
  req.add_chunk_sizes(int64_t{1} << 29);
  req.set_ipc_source_handle(std::string(64, 'x'));
  for (int p = 0; p < patches; ++p) {
    worker::v1::GpuSparsePatch* g = req.add_sparse();
    g->set_name(absl::StrCat("model.layers.", p / 11, ".mlp.gate_proj.weight"));
    g->set_nnz(123456);
    g->set_numel(12345678);
    g->set_index_bytes(4);
    g->set_dtype(2);
    g->set_cols(4096);
    g->set_payload_bytes(123456 * 6);
    worker::v1::GpuSparseUse* u = g->add_uses();
    u->set_allocation_id(1);
    u->set_param_offset(int64_t{p} * 1000000);
    u->set_dtype(2);
    u->set_implicit(true);
    worker::v1::GpuSparsePiece* piece = req.add_sparse_pieces();
    piece->set_chunk(0);
    piece->set_patch(p);
    piece->set_chunk_offset(int64_t{p} * 1000);
    piece->set_length(123456 * 6);
  }
  return req;
}

int Main() {
  GpuWorkerSupervisor::Options o;
  o.worker_binary = FLAGS_worker;
  o.socket_path = absl::StrCat("/tmp/ws-rpc-probe-", getpid(), ".sock");
  GpuWorkerSupervisor sup(o);
  // Any call starts the worker; this one is refused (a malformed id).
  worker::v1::InitGroupRequest start;
  start.set_nccl_unique_id("x");
  sup.InitGroup(start).IgnoreError();
  // --warm_by=channel2 only: a second channel to the same worker.
  std::unique_ptr<worker::v1::GpuWorker::Stub> warm_stub;
  if (FLAGS_warm_by == "channel2") {
    warm_stub = worker::v1::GpuWorker::NewStub(grpc::CreateChannel(
        "unix:" + o.socket_path, grpc::InsecureChannelCredentials()));
  }
  std::vector<int> warms = {-1};
  for (absl::string_view w :
       absl::StrSplit(FLAGS_warm_ms, ',', absl::SkipEmpty())) {
    int v = 0;
    if (!absl::SimpleAtoi(w, &v)) return 2;
    warms.push_back(v);
  }
  for (absl::string_view idle : absl::StrSplit(FLAGS_idle_ms, ',')) {
    int idle_ms = 0;
    if (!absl::SimpleAtoi(idle, &idle_ms)) return 2;
    for (int warm : warms) {
      for (int patches : {0, 399}) {
        const worker::v1::BeginUpdateRequest req = Request(patches);
        std::vector<double> ms;
        for (int i = 0; i < FLAGS_calls; ++i) {
          absl::SleepFor(absl::Milliseconds(idle_ms));
          std::thread pinger;
          if (warm >= 0) {
            if (warm_stub != nullptr) {
              pinger = std::thread([&] {
                grpc::ClientContext ctx;
                worker::v1::PingRequest preq;
                worker::v1::PingResponse presp;
                warm_stub->Ping(&ctx, preq, &presp).ok();
              });
            } else {
              sup.WarmAsync();
            }
            absl::SleepFor(absl::Milliseconds(warm));
          }
          const absl::Time t = absl::Now();
          sup.BeginUpdate(req, absl::Now() + absl::Seconds(30)).IgnoreError();
          ms.push_back(absl::ToDoubleMilliseconds(absl::Now() - t));
          if (pinger.joinable()) pinger.join();
        }
        std::sort(ms.begin(), ms.end());
        std::printf(
            "idle %4d ms, warm %2d ms before, request %6zu bytes (%3d "
            "patches): median %.3f ms\n",
            idle_ms, warm, req.ByteSizeLong(), patches, ms[ms.size() / 2]);
      }
    }
  }
  return 0;
}

}  // namespace
}  // namespace weightsync

int main(int argc, char** argv) {
  gflags::ParseCommandLineFlags(&argc, &argv, true);
  grpc_init();
  return weightsync::Main();
}

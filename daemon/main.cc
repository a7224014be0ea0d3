// weightsyncd: the per-node weight-sync daemon. See docs/operations.md for
// every flag; `--flagfile=FILE` reads flags from a config file.
#include <pthread.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <iostream>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/time.h"
#include "backends/cuda/cuda_support.h"
#include "backends/cuda/worker_client.h"
#include "common/local_files.h"
#include "common/version.h"
#include "daemon/backends.h"
#include "daemon/config_file.h"
#include "daemon/core/coordinator.h"
#include "daemon/core/nccl_version.h"
#include "daemon/server/metrics.h"
#include "daemon/server/server.h"
#include "daemon/server/shutdown_deadline.h"
#include "daemon/server/systemd_notify.h"
#include "gflags/gflags.h"
#include "glog/logging.h"

DEFINE_string(config, "",
              "configuration file: 'name = value' lines of these flags "
              "(docs/operations.md); flags on the command line win");
DEFINE_bool(dump_config, false,
            "print the effective configuration (every flag below, after "
            "--config) as a configuration file and exit");
DEFINE_string(socket, "",
              "Unix socket path; default $XDG_RUNTIME_DIR/weightsync/"
              "weightsyncd.sock, or /tmp/weightsync-$UID/weightsyncd.sock");
DEFINE_string(tcp, "",
              "host:port to also listen on TCP (off when empty); needs "
              "--tls_cert, --tls_key and --token_file");
DEFINE_string(tls_cert, "", "PEM certificate (chain) of the TCP listener");
DEFINE_string(tls_key, "", "PEM private key of --tls_cert");
DEFINE_string(tls_client_ca, "",
              "PEM CA certificates: TCP clients must present a certificate "
              "they signed (empty: no client certificates)");
DEFINE_string(token_file, "",
              "file holding the bearer token every TCP call must carry "
              "(never logged)");
DEFINE_int32(keepalive_ms, 10000,
             "ping a connection with calls open after this long without "
             "traffic (0: never); clients may ping every keepalive_ms / 2");
DEFINE_int32(keepalive_timeout_ms, 5000,
             "close a connection whose ping is not answered within this "
             "(a peer cut off the network)");
DEFINE_int32(max_connection_idle_ms, 300000,
             "close a connection with no call open for this long (clients "
             "reconnect by themselves; 0: never)");
DEFINE_string(metrics_address, "",
              "host:port to serve Prometheus metrics on (http://.../metrics; "
              "off when empty). Unauthenticated: bind it to an address only "
              "the scraper reaches");
DEFINE_int64(chunk_bytes, 8 << 20, "chunk size when a trainer asks for none");
DEFINE_int64(nccl_chunk_bytes, 64 << 20,
             "chunk size of nccl updates when a trainer asks for none, at "
             "most --max_chunk_bytes (NVLink moves 8 MiB messages at a third "
             "of the speed of 64 MiB ones)");
DEFINE_int64(nccl_plan_chunk_bytes, 256 << 20,
             "chunk size of a transfer plan's (many senders) nccl update "
             "that asks none, when the trainer said its senders are on this "
             "host (InitWeightTransferRequest.senders_on_this_host; else "
             "--nccl_chunk_bytes), lowered to fit --gpu_staging_budget_bytes "
             "(not capped by --max_chunk_bytes: the daemon's own receives, "
             "not a trainer's messages)");
DEFINE_int64(max_chunk_bytes, 64 << 20, "largest chunk a trainer may ask for");
DEFINE_int32(staging_buffers, 4, "host staging buffers (chunks in flight)");
DEFINE_int64(staged_budget_bytes, int64_t{4} << 30,
             "bytes a staged update may hold in daemon memory until commit");
DEFINE_int64(staging_budget_bytes, int64_t{1} << 30,
             "bytes of host staging the daemon never exceeds");
DEFINE_int64(notice_timeout_ms, 10000,
             "default deadline for engines to acknowledge pause/resume");
DEFINE_int64(finish_timeout_ms, 60000,
             "default deadline for Finish to see every byte written");
DEFINE_string(gpu_worker, "",
              "path of weightsync_gpu_worker; default: beside this binary, "
              "else ../libexec/weightsync/ from its directory (the Debian "
              "package). Without it (or without CUDA) the GPU backends are "
              "off");
DEFINE_int32(gpu, 0, "CUDA ordinal of the GPU the daemon's NCCL rank uses");
DEFINE_bool(ipc_sm_copies, false,
            "IPC backend: copy same-dtype blocks with a kernel on the SMs "
            "instead of the copy engines, which leave the engine's SMs alone "
            "(measured no faster on one H200: 832 vs 862 GB/s)");
DEFINE_bool(ipc_fused_receipts, true,
            "IPC backend with receipts on: copy and sum each element in one "
            "pass (a kernel) instead of a copy and then a receipt pass that "
            "reads the engines' memory again");
DEFINE_string(fp8_direct_kernel, "lean",
              "GPU backends: the kernel that quantises FP8 targets straight "
              "from a source in GPU memory: lean (default; jobs of whole "
              "aligned 16-byte vectors by a kernel of that path alone, "
              "bf16/fp16 quotients by Markstein's step checked exhaustively; "
              "the rest by cvt), cvt (16-byte vectors, the hardware's FP8 "
              "rounding below FMAX), vec (the same, integer rounding) or "
              "regs (one 1024-thread block per SM); each bit-exact on an "
              "H100");
DEFINE_bool(gpu_worker_at_launch, true,
            "Start the GPU worker (process, CUDA context) when the daemon "
            "starts, in the background, rather than at first use: the first "
            "engine registration then does not wait ~0.3 s for it");
DEFINE_int32(gpu_staging_buffers, 4, "GPU staging buffers (chunks in flight)");
DEFINE_int64(gpu_staging_budget_bytes, int64_t{4} << 30,
             "bytes of GPU staging the daemon never exceeds");
DEFINE_bool(allow_nccl_version_mismatch, false,
            "accept an nccl group whose trainer's NCCL differs from this "
            "daemon's in major.minor (refused by default: mixed versions in "
            "one communicator may hang)");
DEFINE_int64(shutdown_grace_ms, 2000,
             "on SIGTERM, how long open calls may run before cancellation");
DEFINE_int64(shutdown_timeout_ms, 0,
             "on SIGTERM, the longest the whole stop may take: past it the "
             "daemon logs and exits with status 1 whatever its handlers are "
             "doing. 0: --notice_timeout_ms + --shutdown_grace_ms + 3000 (the "
             "orderly stop's own bounds; 15 s by default)");
DEFINE_int64(update_idle_timeout_ms, 300000,
             "end an update whose trainer shows no sign (no chunk, call or "
             "data-plane progress) for this long; 0: never");
DEFINE_int64(engine_start_grace_ms, 5000,
             "unregister an engine that has not opened its control stream "
             "this long after registering (it never started, or hangs "
             "before it); updates of every engine leave such an engine out "
             "meanwhile; 0: never");
DEFINE_string(allow_uids, "",
              "comma-separated uids allowed to connect to the Unix socket "
              "(besides the daemon's own uid and root)");
DEFINE_string(allow_gids, "",
              "comma-separated gids allowed to connect (besides the daemon's "
              "group and --socket_group)");
DEFINE_int64(socket_group, -1,
             "gid of the socket file and of a socket directory the daemon "
             "creates (-1: the daemon's own)");
DEFINE_bool(allow_open_socket_dir, false,
            "let the socket live in a directory any user can enter");
// Bounds on what peers may hold (docs/security.md, "Limits").
DEFINE_int32(max_streams_per_connection, 100,
             "HTTP/2 streams one connection may have open at once");
DEFINE_int32(max_threads, 256,
             "threads gRPC may run calls on; a call that finds none gets "
             "RESOURCE_EXHAUSTED");
DEFINE_int32(max_metadata_bytes, 16 << 10,
             "largest header block (metadata) of a call, both listeners");
DEFINE_int32(max_calls_per_peer, 64,
             "calls one uid (Unix socket) or the TCP token may have open at "
             "once, Control streams apart");
DEFINE_int32(max_control_streams_per_peer, 64,
             "engine Control streams one uid or the TCP token may have open");
DEFINE_int32(max_engine_reads, 2,
             "CheckEngine reads of whole engines running at once");

namespace weightsync {
namespace {

// The descriptor limit: the soft limit raised to the hard one, so that the
// daemon runs out of descriptors as late as the system lets it; logged.
void RaiseDescriptorLimit() {
  rlimit r{};
  if (getrlimit(RLIMIT_NOFILE, &r) != 0) return;
  const rlim_t before = r.rlim_cur;
  if (r.rlim_cur < r.rlim_max) {
    r.rlim_cur = r.rlim_max;
    if (setrlimit(RLIMIT_NOFILE, &r) != 0) {
      PLOG(WARNING) << "can't raise the descriptor limit (RLIMIT_NOFILE) "
                    << before << " to its hard limit " << r.rlim_max;
      r.rlim_cur = before;
    }
  }
  auto text = [](rlim_t v) {
    return v == RLIM_INFINITY ? std::string("unlimited") : std::to_string(v);
  };
  LOG(INFO) << "descriptor limit (RLIMIT_NOFILE): " << text(r.rlim_cur)
            << (r.rlim_cur != before
                    ? " (raised from " + text(before) + ", the hard limit)"
                    : " (the hard limit)");
}

std::string DefaultSocket() {
  const std::string path = DefaultSocketPath();
  mkdir(path.substr(0, path.rfind('/')).c_str(), 0700);
  return path;
}

// The --allow_uids / --allow_gids list, or false on a bad entry.
template <typename T>
bool ParseIds(const std::string& flag, const char* name, std::vector<T>* out) {
  for (absl::string_view s : absl::StrSplit(flag, ',', absl::SkipEmpty())) {
    int64_t v = -1;
    if (!absl::SimpleAtoi(s, &v) || v < 0 || v > 0xFFFFFFFE) {
      LOG(ERROR) << "--" << name << ": '" << s << "' is not a uid/gid";
      return false;
    }
    out->push_back(static_cast<T>(v));
  }
  return true;
}

// The contents of `path` (trailing whitespace dropped), or false.
bool ReadFlagFile(const std::string& path, const char* flag, std::string* out) {
  if (path.empty()) return true;
  if (!ReadTrimmedFile(path, out)) {
    LOG(ERROR) << "--" << flag << ": can't read " << path;
    return false;
  }
  if (out->empty()) {
    LOG(ERROR) << "--" << flag << ": " << path << " is empty";
    return false;
  }
  return true;
}

bool ValidFlags() {
  if (FLAGS_max_chunk_bytes <= 0 || FLAGS_max_chunk_bytes > (1 << 30) ||
      FLAGS_max_chunk_bytes % 256 != 0) {
    LOG(ERROR) << "--max_chunk_bytes must be a multiple of 256 in (0, 1 GiB]";
    return false;
  }
  if (FLAGS_chunk_bytes <= 0 || FLAGS_chunk_bytes % 256 != 0 ||
      FLAGS_chunk_bytes > FLAGS_max_chunk_bytes) {
    LOG(ERROR) << "--chunk_bytes must be a multiple of 256, at most "
                  "--max_chunk_bytes";
    return false;
  }
  if (FLAGS_nccl_chunk_bytes <= 0 || FLAGS_nccl_chunk_bytes % 256 != 0) {
    LOG(ERROR) << "--nccl_chunk_bytes must be a positive multiple of 256";
    return false;
  }
  if (FLAGS_nccl_plan_chunk_bytes <= 0 ||
      FLAGS_nccl_plan_chunk_bytes > (1 << 30) ||
      FLAGS_nccl_plan_chunk_bytes % 256 != 0) {
    LOG(ERROR) << "--nccl_plan_chunk_bytes must be a multiple of 256 in "
                  "(0, 1 GiB]";
    return false;
  }
  if (FLAGS_gpu_staging_buffers < 2) {
    LOG(ERROR) << "--gpu_staging_buffers must be at least 2 (pipelining)";
    return false;
  }
  if (FLAGS_shutdown_timeout_ms != 0 &&
      FLAGS_shutdown_timeout_ms <= FLAGS_shutdown_grace_ms) {
    LOG(ERROR) << "--shutdown_timeout_ms must be 0 or above "
                  "--shutdown_grace_ms";
    return false;
  }
  for (const auto& [name, value, least] :
       {std::tuple<const char*, int, int>{"max_streams_per_connection",
                                          FLAGS_max_streams_per_connection, 1},
        {"max_threads", FLAGS_max_threads, 16},  // 8 spare + 8 places
        {"max_metadata_bytes", FLAGS_max_metadata_bytes, 1024},
        {"max_calls_per_peer", FLAGS_max_calls_per_peer, 1},
        {"max_control_streams_per_peer", FLAGS_max_control_streams_per_peer, 1},
        {"max_engine_reads", FLAGS_max_engine_reads, 1}}) {
    if (value < least) {
      LOG(ERROR) << "--" << name << " must be at least " << least;
      return false;
    }
  }
  if (FLAGS_staging_buffers < 2) {
    LOG(ERROR) << "--staging_buffers must be at least 2 (pipelining)";
    return false;
  }
  return true;
}

int Main() {
  if (!ValidFlags()) return 2;
  RaiseDescriptorLimit();
  // Block the stop signals in every thread gRPC will start; this thread
  // waits for them with sigwait.
  sigset_t stop;
  sigemptyset(&stop);
  sigaddset(&stop, SIGTERM);
  sigaddset(&stop, SIGINT);
  pthread_sigmask(SIG_BLOCK, &stop, nullptr);

  CoordinatorOptions core_options;
  core_options.default_chunk_bytes = FLAGS_chunk_bytes;
  // At most --max_chunk_bytes (a daemon that caps chunks caps these too).
  core_options.default_nccl_chunk_bytes =
      std::min<int64_t>(FLAGS_nccl_chunk_bytes, FLAGS_max_chunk_bytes);
  core_options.default_plan_chunk_bytes = FLAGS_nccl_plan_chunk_bytes;
  core_options.device_staging_buffers = FLAGS_gpu_staging_buffers;
  core_options.device_staging_budget_bytes = FLAGS_gpu_staging_budget_bytes;
  core_options.max_chunk_bytes = FLAGS_max_chunk_bytes;
  core_options.staged_budget_bytes = FLAGS_staged_budget_bytes;
  core_options.notice_timeout = absl::Milliseconds(FLAGS_notice_timeout_ms);
  core_options.finish_timeout = absl::Milliseconds(FLAGS_finish_timeout_ms);
  core_options.update_idle_timeout =
      absl::Milliseconds(FLAGS_update_idle_timeout_ms);
  core_options.engine_start_grace =
      absl::Milliseconds(FLAGS_engine_start_grace_ms);
  core_options.build_info = CudaBuildInfo();
  // Trainers' NCCL is checked against it at an nccl Init (issue 20).
  core_options.nccl_version = NcclVersionCode();
  core_options.allow_nccl_version_mismatch = FLAGS_allow_nccl_version_mismatch;
  HostDataPlane::Options host;
  host.staging_buffers = FLAGS_staging_buffers;
  host.staging_budget = FLAGS_staging_budget_bytes;
  std::shared_ptr<GpuWorkerSupervisor> gpu;
  std::string worker_dir;
  std::string worker = FLAGS_gpu_worker;
  if (worker.empty()) {
    char self[4096];
    const ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);
    if (n > 0) {
      self[n] = '\0';
      const std::string path(self);
      const std::string dir = path.substr(0, path.rfind('/'));
      // Beside the daemon (a build tree, the image), else where the Debian
      // package puts it: /usr/sbin/weightsyncd ->
      // /usr/libexec/weightsync/weightsync_gpu_worker.
      worker = dir + "/weightsync_gpu_worker";
      const std::string packaged = dir.substr(0, dir.rfind('/')) +
                                   "/libexec/weightsync/weightsync_gpu_worker";
      if (access(worker.c_str(), X_OK) != 0 &&
          access(packaged.c_str(), X_OK) == 0) {
        worker = packaged;
      }
    }
  }
  if (FLAGS_fp8_direct_kernel != "regs" && FLAGS_fp8_direct_kernel != "vec" &&
      FLAGS_fp8_direct_kernel != "cvt" && FLAGS_fp8_direct_kernel != "lean") {
    LOG(ERROR) << "--fp8_direct_kernel must be lean, regs, vec or cvt";
    return 2;
  }
  if (BuiltWithCuda() && access(worker.c_str(), X_OK) == 0) {
    GpuWorkerSupervisor::Options g;
    g.worker_binary = worker;
    g.device = FLAGS_gpu;
    g.ipc_sm_copies = FLAGS_ipc_sm_copies;
    g.ipc_fused_receipts = FLAGS_ipc_fused_receipts;
    g.fp8_direct_kernel = FLAGS_fp8_direct_kernel;
    g.staging_buffers = FLAGS_gpu_staging_buffers;
    g.staging_budget = FLAGS_gpu_staging_budget_bytes;
    // The worker's socket in a directory of the daemon's own (mode 0700):
    // only this uid (and root) can reach it.
    absl::StatusOr<std::string> dir = MakeWorkerDir();
    if (!dir.ok()) {
      LOG(ERROR) << dir.status().message();
      return 1;
    }
    worker_dir = *dir;
    g.socket_path = worker_dir + "/worker.sock";
    gpu = std::make_shared<GpuWorkerSupervisor>(g);
    if (FLAGS_gpu_worker_at_launch) gpu->StartAsync();
    LOG(INFO) << "GPU backends via " << worker
              << (FLAGS_gpu_worker_at_launch ? " (starting now)"
                                             : " (started on first use)");
  }
  Coordinator core(core_options, MakeMemoryMapper(gpu),
                   MakeDataPlaneFactory(host, gpu));

  // Prometheus /metrics (off unless --metrics_address).
  std::unique_ptr<Metrics> metrics;
  if (!FLAGS_metrics_address.empty()) {
    auto m = Metrics::Start(FLAGS_metrics_address, &core);
    if (!m.ok()) {
      LOG(ERROR) << m.status().message();
      return 1;
    }
    metrics = *std::move(m);
    LOG(INFO) << "metrics on http://" << FLAGS_metrics_address << " (port "
              << metrics->port() << ")/metrics";
  }

  ServerOptions server_options;
  server_options.unix_socket =
      FLAGS_socket.empty() ? DefaultSocket() : FLAGS_socket;
  server_options.tcp_address = FLAGS_tcp;
  if (!ReadFlagFile(FLAGS_tls_cert, "tls_cert", &server_options.tls_cert_pem) ||
      !ReadFlagFile(FLAGS_tls_key, "tls_key", &server_options.tls_key_pem) ||
      !ReadFlagFile(FLAGS_tls_client_ca, "tls_client_ca",
                    &server_options.tls_client_ca_pem) ||
      !ReadFlagFile(FLAGS_token_file, "token_file", &server_options.token)) {
    return 2;
  }
  server_options.keepalive_ms = FLAGS_keepalive_ms;
  server_options.keepalive_timeout_ms = FLAGS_keepalive_timeout_ms;
  server_options.max_idle_ms = FLAGS_max_connection_idle_ms;
  server_options.max_message_bytes =
      static_cast<int>(FLAGS_max_chunk_bytes + (1 << 20));
  server_options.max_streams_per_connection = FLAGS_max_streams_per_connection;
  server_options.max_threads = FLAGS_max_threads;
  server_options.max_metadata_bytes = FLAGS_max_metadata_bytes;
  server_options.call_limits.max_calls_per_peer = FLAGS_max_calls_per_peer;
  server_options.call_limits.max_control_streams_per_peer =
      FLAGS_max_control_streams_per_peer;
  server_options.call_limits.max_engine_reads = FLAGS_max_engine_reads;
  server_options.call_limits.max_threads = FLAGS_max_threads;
  PeerPolicy& policy = server_options.peer_policy;
  policy.uids = {getuid(), 0};
  policy.gids = {getgid()};
  if (FLAGS_socket_group >= 0) {
    policy.group = static_cast<gid_t>(FLAGS_socket_group);
    policy.gids.push_back(policy.group);
  }
  policy.allow_open_dir = FLAGS_allow_open_socket_dir;
  if (!ParseIds(FLAGS_allow_uids, "allow_uids", &policy.uids) ||
      !ParseIds(FLAGS_allow_gids, "allow_gids", &policy.gids)) {
    return 2;
  }
  auto server = Server::BuildAndStart(server_options, &core);
  if (!server.ok()) {
    LOG(ERROR) << server.status();
    return 1;
  }
  LOG(INFO) << "weightsyncd " << kVersion
            << " listening on unix:" << server_options.unix_socket
            << (FLAGS_tcp.empty()
                    ? ""
                    : absl::StrCat(" and tcp port ", (*server)->tcp_port()))
            << " (" << core_options.build_info
            << (core_options.nccl_version != 0
                    ? absl::StrCat("; NCCL ",
                                   NcclVersionString(core_options.nccl_version))
                    : "")
            << ")";
  // Type=notify under systemd (no-op without $NOTIFY_SOCKET); the watchdog
  // pings only while a status snapshot, under the lock every request takes,
  // returns in time (docs/deploy.md).
  SystemdNotifier systemd(SystemdNotifier::FromEnvironment(), [&core] {
    core.GetStatus();
    return true;
  });
  systemd.Ready(absl::StrCat("serving on unix:", server_options.unix_socket));

  int sig = 0;
  sigwait(&stop, &sig);
  LOG(INFO) << "signal " << sig << ": shutting down";
  systemd.Stopping(absl::StrCat("shutting down (signal ", sig, ")"));
  // Whatever a handler is stuck in, the daemon is gone within the limit.
  const int64_t stop_ms =
      FLAGS_shutdown_timeout_ms != 0
          ? FLAGS_shutdown_timeout_ms
          : FLAGS_notice_timeout_ms + FLAGS_shutdown_grace_ms + 3000;
  ShutdownDeadline deadline(absl::Milliseconds(stop_ms), [stop_ms] {
    LOG(ERROR) << "shutdown did not finish within " << stop_ms
               << " ms (--shutdown_timeout_ms); exiting with calls open";
    _exit(1);
  });
  // Abort any update and tell the engines while their streams are open,
  // then stop the server and release every mapping.
  core.Shutdown();
  (*server)->Shutdown(absl::Milliseconds(FLAGS_shutdown_grace_ms));
  if (!worker_dir.empty()) {
    unlink((worker_dir + "/worker.sock").c_str());
    rmdir(worker_dir.c_str());
  }
  LOG(INFO) << "weightsyncd stopped";
  return 0;
}

}  // namespace
}  // namespace weightsync

int main(int argc, char** argv) {
  gflags::SetUsageMessage("weightsyncd: moves trained weights into engines");
  // --version prints "weightsyncd version 0.1.0" (/VERSION) and exits.
  gflags::SetVersionString(weightsync::kVersion);
  gflags::ParseCommandLineFlags(&argc, &argv, true);
  FLAGS_logtostderr = true;
  google::InitGoogleLogging(argv[0]);
  if (!FLAGS_config.empty()) {
    const absl::Status s = weightsync::ApplyConfigFile(FLAGS_config);
    if (!s.ok()) {
      LOG(ERROR) << s.message();
      return 2;
    }
  }
  if (FLAGS_dump_config) {
    std::cout << weightsync::DumpConfig("daemon/main.cc");
    return 0;
  }
  return weightsync::Main();
}

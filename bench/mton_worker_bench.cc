// Issue 32's 4-GPU proof at the GPU worker's level: M->N updates through
// weightsync's own receive path (weightsync_gpu_worker: NCCL rounds of
// ncclRecv into staging or straight into engine memory, the scatter into
// the engine), against the same worker's broadcast path (today's single
// sender). One process per rank, all four started by bench/mton_run.py:
//
//   rank 0, 1 (GPUs 0, 1): trainer ranks. Each holds its shard of the
//     checkpoint (the plan's `hold` lines), every element a function of
//     (tensor, row, column, version) (bench/mton_kernels.h), and sends the
//     plan's chunks in the plan's rounds: per round one NCCL group of
//     ncclSend, each chunk packed on a second stream (cudaMemcpy2DAsync, or
//     one copy for a run across whole rows)
//     while the round before it is on the wire, or sent straight from the
//     shard where the chunk is one contiguous piece of it. Broadcast plans
//     (receiver -1): rank 0 broadcasts each chunk, rank 1 takes part as a
//     sink (NCCL's broadcast needs every rank of the communicator).
//   rank 2, 3 (GPUs 2, 3): an engine's memory (one allocation, the plan's
//     `need` rectangles), handed by CUDA IPC to a weightsync_gpu_worker
//     that this process starts and drives as the daemon does
//     (GpuWorkerSupervisor: OpenAllocation, InitGroup, BeginUpdate with
//     chunk_peers/chunk_rounds, WaitUpdate). After each update every
//     needed element is checked against its function value (bit-exact),
//     the engine having been poisoned (0xff bytes) before it.
//
// Every version (--reps + 1, the first a warm-up) starts at a barrier of
// all four processes (files in --sync_dir, spun on), then each rank times
// its part: the update's time is the slowest rank's. Every wait is
// bounded: a watchdog ends the process (exit 3) after --timeout_s.
// Writes one JSON object to --out.
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "backends/cuda/gpu_uuid.h"
#include "backends/cuda/worker_client.h"
#include "bench/mton_kernels.h"
#include "gflags/gflags.h"
#include "nccl.h"

DEFINE_int32(rank, -1, "0, 1: trainer ranks; 2, 3: engine GPUs");
DEFINE_string(plan, "", "plan file (bench/mton_plan.py)");
DEFINE_string(sync_dir, "", "folder for the NCCL id and the barriers");
DEFINE_string(worker, ".dev/bin/weightsync_gpu_worker", "the worker binary");
DEFINE_string(out, "", "JSON results");
DEFINE_int32(reps, 5, "timed updates (after one warm-up)");
DEFINE_int32(timeout_s, 240, "the whole process's bound");
DEFINE_int32(staging_buffers, 4, "the worker's staging buffers");
DEFINE_string(fault, "",
              "kill_start, kill_mid, kill_end, freeze_start, freeze_mid, "
              "freeze_end: what --fault_rank does in version --fault_version "
              "(before its first round, after half its rounds, after its last "
              "round is enqueued); every other rank then ends that update "
              "within --wait_s and says how (ncclCommAbort)");
DEFINE_int32(fault_rank, 1, "the sender that fails");
DEFINE_int32(fault_version, 1, "the version it fails in");
DEFINE_double(wait_s, 5.0, "a rank's bound on one update under --fault");

namespace weightsync {
namespace {

constexpr int kWorld = 4;

[[noreturn]] void Die(const std::string& msg) {
  std::fprintf(stderr, "mton_worker_bench rank %d: FATAL: %s\n", FLAGS_rank,
               msg.c_str());
  std::fflush(stderr);
  _exit(1);
}

#define CK(x)                                              \
  do {                                                     \
    cudaError_t e_ = (x);                                  \
    if (e_ != cudaSuccess)                                 \
      Die(absl::StrCat(#x, ": ", cudaGetErrorString(e_))); \
  } while (0)
#define NK(x)                                              \
  do {                                                     \
    ncclResult_t r_ = (x);                                 \
    if (r_ != ncclSuccess)                                 \
      Die(absl::StrCat(#x, ": ", ncclGetErrorString(r_))); \
  } while (0)

double Now() {
  return std::chrono::duration<double>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

struct Tensor {
  int64_t rows = 0, cols = 0;
};
struct Hold {
  int64_t offset = 0, row0 = 0, rows = 0;  // offset: bytes into the shard
};
struct Rect {
  int tensor = 0;
  int64_t r0 = 0, nr = 0, c0 = 0, nc = 0, off = 0;
};
struct Op {
  int gpu = 0, tensor = 0;
  int64_t r0 = 0, nr = 0, c0 = 0, nc = 0, off = 0, src_stride = 0, dst = 0,
          dst_stride = 0;
};
struct Chunk {
  int64_t round = 0;
  int sender = 0, receiver = 0;
  int64_t bytes = 0;
  std::vector<Rect> packs;
  std::vector<Op> ops;
};
struct Need {
  int tensor = 0;
  int64_t r0 = 0, nr = 0, c0 = 0, nc = 0, dst = 0, stride = 0;
};
struct Plan {
  std::string title;
  std::vector<Tensor> tensors;
  std::map<int, std::map<int, Hold>> holds;  // sender -> tensor -> hold
  std::map<int, int64_t> shard_bytes;
  std::map<int, int64_t> engine_bytes;
  std::map<int, std::vector<Need>> needs;
  std::vector<Chunk> chunks;
};

int64_t I(const std::string& s) {
  int64_t v = 0;
  if (!absl::SimpleAtoi(s, &v)) Die("plan: not a number: " + s);
  return v;
}

Plan ReadPlan(const std::string& path) {
  std::ifstream in(path);
  if (!in) Die("can't read plan " + path);
  Plan p;
  std::string line;
  while (std::getline(in, line)) {
    std::vector<std::string> f = absl::StrSplit(line, ' ', absl::SkipEmpty());
    if (f.empty()) continue;
    const std::string& k = f[0];
    auto need = [&](size_t n) {
      if (f.size() != n) Die("plan: bad line: " + line);
    };
    if (k == "model") {
      p.title = line.substr(6);
    } else if (k == "tensor") {
      need(5);
      if (I(f[1]) != static_cast<int64_t>(p.tensors.size())) Die("plan: ids");
      p.tensors.push_back({I(f[3]), I(f[4])});
    } else if (k == "hold") {
      need(5);
      const int s = I(f[1]), t = I(f[2]);
      Hold h{p.shard_bytes[s], I(f[3]), I(f[4])};
      p.holds[s][t] = h;
      p.shard_bytes[s] += h.rows * p.tensors[t].cols * 2;
    } else if (k == "engine") {
      need(3);
      p.engine_bytes[I(f[1])] = I(f[2]);
    } else if (k == "need") {
      need(9);
      p.needs[I(f[1])].push_back({static_cast<int>(I(f[2])), I(f[3]), I(f[4]),
                                  I(f[5]), I(f[6]), I(f[7]), I(f[8])});
    } else if (k == "chunk") {
      need(6);
      if (I(f[1]) != static_cast<int64_t>(p.chunks.size())) Die("plan: order");
      Chunk c;
      c.round = I(f[2]);
      c.sender = I(f[3]);
      c.receiver = I(f[4]);
      c.bytes = I(f[5]);
      p.chunks.push_back(c);
    } else if (k == "pack") {
      need(8);
      p.chunks.at(I(f[1])).packs.push_back({static_cast<int>(I(f[2])), I(f[3]),
                                            I(f[4]), I(f[5]), I(f[6]),
                                            I(f[7])});
    } else if (k == "op") {
      need(12);
      Op o;
      o.gpu = I(f[2]);
      o.tensor = I(f[3]);
      o.r0 = I(f[4]);
      o.nr = I(f[5]);
      o.c0 = I(f[6]);
      o.nc = I(f[7]);
      o.off = I(f[8]);
      o.src_stride = I(f[9]);
      o.dst = I(f[10]);
      o.dst_stride = I(f[11]);
      p.chunks.at(I(f[1])).ops.push_back(o);
    } else {
      Die("plan: unknown record " + k);
    }
  }
  return p;
}

// All four processes meet at barrier `n` (spinning on stat: ~us skew).
void Barrier(int n) {
  const std::string mine =
      absl::StrCat(FLAGS_sync_dir, "/b", n, ".", FLAGS_rank);
  int fd = open(mine.c_str(), O_CREAT | O_WRONLY, 0644);
  if (fd < 0) Die("barrier file " + mine);
  close(fd);
  for (int r = 0; r < kWorld; ++r) {
    const std::string f = absl::StrCat(FLAGS_sync_dir, "/b", n, ".", r);
    struct stat st;
    while (stat(f.c_str(), &st) != 0) {
    }
  }
}

std::string NcclIdFile() { return FLAGS_sync_dir + "/nccl_id"; }

ncclUniqueId ShareId() {
  ncclUniqueId id;
  const std::string path = NcclIdFile();
  if (FLAGS_rank == 0) {
    NK(ncclGetUniqueId(&id));
    const std::string tmp = path + ".tmp";
    FILE* f = std::fopen(tmp.c_str(), "wb");
    if (f == nullptr || std::fwrite(&id, sizeof(id), 1, f) != 1) Die("id");
    std::fclose(f);
    if (rename(tmp.c_str(), path.c_str()) != 0) Die("id rename");
    return id;
  }
  for (;;) {
    FILE* f = std::fopen(path.c_str(), "rb");
    if (f != nullptr) {
      const bool ok = std::fread(&id, sizeof(id), 1, f) == 1;
      std::fclose(f);
      if (ok) return id;
    }
    absl::SleepFor(absl::Milliseconds(5));
  }
}

// Waits for `s`; false if `deadline` (seconds, Now()) passed first.
bool Sync(cudaStream_t s, double deadline = 1e300) {
  while (true) {
    cudaError_t e = cudaStreamQuery(s);
    if (e == cudaSuccess) return true;
    if (e != cudaErrorNotReady) Die(cudaGetErrorString(e));
    if (Now() > deadline) return false;
  }
}

// The injected failure of this rank at `where` (start, mid, end) of
// version v, if --fault says so.
void MaybeFail(int v, const char* where) {
  if (FLAGS_fault.empty() || FLAGS_rank != FLAGS_fault_rank ||
      v != FLAGS_fault_version) {
    return;
  }
  const std::string f = FLAGS_fault;
  if (f.size() < 5 || f.substr(f.find('_') + 1) != where) return;
  std::fprintf(stderr, "rank %d: injected %s in version %d\n", FLAGS_rank,
               f.c_str(), v);
  std::fflush(stderr);
  if (f.rfind("kill", 0) == 0) raise(SIGKILL);
  raise(SIGSTOP);  // frozen until the launcher kills it
}

struct Rep {
  double wall_s = 0, device_s = 0;
  unsigned long long bad = 0;
};

void WriteOut(const Plan& plan, const std::vector<Rep>& reps,
              const std::string& extra) {
  FILE* f = std::fopen(FLAGS_out.c_str(), "w");
  if (f == nullptr) Die("can't write " + FLAGS_out);
  std::fprintf(f, "{\"rank\": %d, \"plan\": \"%s\", %s\"reps\": [", FLAGS_rank,
               plan.title.c_str(), extra.c_str());
  for (size_t i = 0; i < reps.size(); ++i) {
    std::fprintf(f, "%s{\"wall_s\": %.9f, \"device_s\": %.9f, \"bad\": %llu}",
                 i ? ", " : "", reps[i].wall_s, reps[i].device_s, reps[i].bad);
  }
  std::fprintf(f, "]}\n");
  std::fclose(f);
}

void RunSender(const Plan& plan) {
  const int me = FLAGS_rank;
  CK(cudaSetDevice(me));
  const int64_t shard_bytes = std::max<int64_t>(
      plan.shard_bytes.count(me) ? plan.shard_bytes.at(me) : 0, 2);
  uint8_t* shard = nullptr;
  CK(cudaMalloc(&shard, shard_bytes));
  const bool bcast = !plan.chunks.empty() && plan.chunks[0].receiver < 0;
  // My chunks by round.
  std::vector<std::vector<int>> rounds;
  int64_t max_chunk = 2;
  for (size_t k = 0; k < plan.chunks.size(); ++k) {
    const Chunk& c = plan.chunks[k];
    if (c.sender != 0 && bcast) continue;
    if (!bcast && c.sender != me) continue;
    if (rounds.empty() || plan.chunks[rounds.back()[0]].round != c.round) {
      rounds.push_back({});
    }
    rounds.back().push_back(k);
    max_chunk = std::max(max_chunk, c.bytes);
  }
  size_t per_round = 1;
  for (const auto& r : rounds) per_round = std::max(per_round, r.size());
  // Two slots of send buffers: round i packs into slot i % 2.
  std::vector<uint8_t*> slots[2];
  for (int s = 0; s < 2; ++s) {
    for (size_t j = 0; j < per_round; ++j) {
      uint8_t* b = nullptr;
      CK(cudaMalloc(&b, max_chunk));
      slots[s].push_back(b);
    }
  }
  cudaStream_t pack, wire;
  CK(cudaStreamCreateWithFlags(&pack, cudaStreamNonBlocking));
  CK(cudaStreamCreateWithFlags(&wire, cudaStreamNonBlocking));
  cudaEvent_t packed[2], sent[2];
  for (int s = 0; s < 2; ++s) {
    CK(cudaEventCreateWithFlags(&packed[s], cudaEventDisableTiming));
    CK(cudaEventCreateWithFlags(&sent[s], cudaEventDisableTiming));
  }
  ncclComm_t comm;
  ncclUniqueId id = ShareId();
  NK(ncclCommInitRank(&comm, kWorld, id, me));
  // A chunk that is one piece spanning whole rows of a shard tensor is
  // sent from the shard in place.
  auto in_place = [&](const Chunk& c) -> const uint8_t* {
    // Rank 1 of a broadcast plan holds nothing: it is the broadcast's sink.
    if (c.packs.size() != 1 || !plan.holds.count(me)) return nullptr;
    const Rect& r = c.packs[0];
    const Tensor& t = plan.tensors[r.tensor];
    const bool flat = r.nr == 1 && r.c0 + r.nc > t.cols;  // a run across rows
    if (!flat && (r.c0 != 0 || r.nc != t.cols)) return nullptr;
    const Hold& h = plan.holds.at(me).at(r.tensor);
    return shard + h.offset + ((r.r0 - h.row0) * t.cols + r.c0) * 2;
  };
  int64_t in_place_bytes = 0, sent_bytes = 0;
  for (const auto& r : rounds) {
    for (int k : r) {
      sent_bytes += plan.chunks[k].bytes;
      if (in_place(plan.chunks[k]) != nullptr) {
        in_place_bytes += plan.chunks[k].bytes;
      }
    }
  }
  std::vector<Rep> reps;
  for (int v = 0; v <= FLAGS_reps; ++v) {
    if (plan.holds.count(me)) {
      for (const auto& [t, h] : plan.holds.at(me)) {
        CK(bench::FillRows(reinterpret_cast<uint16_t*>(shard + h.offset),
                           h.rows, plan.tensors[t].cols, h.row0, t, v, pack));
      }
    }
    CK(cudaStreamSynchronize(pack));
    CK(cudaEventRecord(sent[0], wire));
    CK(cudaEventRecord(sent[1], wire));
    Barrier(v);
    const double t0 = Now();
    MaybeFail(v, "start");
    for (size_t i = 0; i < rounds.size(); ++i) {
      if (i == rounds.size() / 2) MaybeFail(v, "mid");
      const int s = i % 2;
      CK(cudaStreamWaitEvent(pack, sent[s], 0));
      std::vector<const uint8_t*> src(rounds[i].size(), nullptr);
      for (size_t j = 0; j < rounds[i].size(); ++j) {
        const Chunk& c = plan.chunks[rounds[i][j]];
        if (bcast && me != 0) continue;
        src[j] = in_place(c);
        if (src[j] != nullptr) continue;
        for (const Rect& r : c.packs) {
          const Tensor& t = plan.tensors[r.tensor];
          const Hold& h = plan.holds.at(me).at(r.tensor);
          const uint8_t* from =
              shard + h.offset + ((r.r0 - h.row0) * t.cols + r.c0) * 2;
          if (r.nr == 1 && r.c0 + r.nc > t.cols) {
            // A flat run (bench/mton_plan.py): the shard's rows are whole.
            CK(cudaMemcpyAsync(slots[s][j] + r.off, from, r.nc * 2,
                               cudaMemcpyDeviceToDevice, pack));
            continue;
          }
          CK(cudaMemcpy2DAsync(slots[s][j] + r.off, r.nc * 2, from, t.cols * 2,
                               r.nc * 2, r.nr, cudaMemcpyDeviceToDevice, pack));
        }
        src[j] = slots[s][j];
      }
      CK(cudaEventRecord(packed[s], pack));
      CK(cudaStreamWaitEvent(wire, packed[s], 0));
      NK(ncclGroupStart());
      for (size_t j = 0; j < rounds[i].size(); ++j) {
        const Chunk& c = plan.chunks[rounds[i][j]];
        if (bcast) {
          void* b = me == 0 ? const_cast<uint8_t*>(src[j]) : slots[s][j];
          NK(ncclBroadcast(b, b, c.bytes, ncclUint8, 0, comm, wire));
        } else {
          NK(ncclSend(src[j], c.bytes, ncclUint8, c.receiver, comm, wire));
        }
      }
      NK(ncclGroupEnd());
      CK(cudaEventRecord(sent[s], wire));
    }
    MaybeFail(v, "end");
    const bool faulty = !FLAGS_fault.empty() && v == FLAGS_fault_version;
    if (!Sync(wire, faulty ? t0 + FLAGS_wait_s : 1e300)) {
      // A peer failed: end this rank's part through ncclCommAbort.
      const double t_abort = Now();
      ncclCommAbort(comm);
      WriteOut(plan, reps,
               absl::StrCat(
                   "\"fault\": \"", FLAGS_fault,
                   "\", \"outcome\": \"aborted\", \"waited_s\": ", t_abort - t0,
                   ", \"abort_s\": ", Now() - t_abort, ", "));
      std::fflush(stdout);
      _exit(0);
    }
    reps.push_back({Now() - t0, 0, 0});
    if (faulty) {
      WriteOut(plan, reps,
               absl::StrCat("\"fault\": \"", FLAGS_fault,
                            "\", \"outcome\": \"completed\", "));
      std::fflush(stdout);
      _exit(0);
    }
  }
  // Every rank stays until every rank is done: a sender that exits while
  // its last bytes are in NCCL's network proxy fails its receivers
  // ("remote process exited").
  Barrier(FLAGS_reps + 1);
  WriteOut(plan, reps,
           absl::StrCat("\"sent_bytes\": ", sent_bytes,
                        ", \"sent_in_place_bytes\": ", in_place_bytes, ", "));
  std::fflush(stdout);
  _exit(0);
}

void RunReceiver(const Plan& plan) {
  const int me = FLAGS_rank;
  CK(cudaSetDevice(me));
  const int64_t bytes = plan.engine_bytes.at(me);
  uint8_t* engine = nullptr;
  CK(cudaMalloc(&engine, bytes));
  cudaIpcMemHandle_t handle;
  CK(cudaIpcGetMemHandle(&handle, engine));
  GpuWorkerSupervisor::Options o;
  o.worker_binary = FLAGS_worker;
  // Short: a unix socket's path has 107 bytes at most.
  o.socket_path = absl::StrCat("/tmp/mton-", getpid(), ".sock");
  o.device = me;
  o.staging_buffers = FLAGS_staging_buffers;
  auto owned = std::make_unique<GpuWorkerSupervisor>(o);
  GpuWorkerSupervisor& worker = *owned;
  v1::Allocation a;
  a.set_kind(v1::MEMORY_CUDA_IPC);
  a.set_handle(
      std::string(reinterpret_cast<const char*>(&handle), sizeof(handle)));
  a.set_size(bytes);
  a.set_device_uuid(GpuUuid(me));
  absl::StatusOr<int64_t> alloc = worker.OpenAllocation(a);
  if (!alloc.ok())
    Die(absl::StrCat("OpenAllocation: ", alloc.status().ToString()));
  ncclUniqueId id = ShareId();
  worker::v1::InitGroupRequest init;
  init.set_nccl_unique_id(
      std::string(reinterpret_cast<const char*>(&id), sizeof(id)));
  init.set_world_size(kWorld);
  init.set_rank(me);
  init.set_device(me);
  init.set_timeout_ms(60000);
  absl::Status s = worker.InitGroup(init);
  if (!s.ok()) Die("InitGroup: " + s.ToString());
  // The request: my chunks in global order.
  worker::v1::BeginUpdateRequest req;
  req.set_staging_buffers(FLAGS_staging_buffers);
  const bool bcast = !plan.chunks.empty() && plan.chunks[0].receiver < 0;
  int64_t chunk_bytes = 0, moved = 0;
  for (const Chunk& c : plan.chunks) {
    if (c.receiver != me && c.receiver >= 0) continue;
    const int64_t k = req.chunk_sizes_size();
    req.add_chunk_sizes(c.bytes);
    if (!bcast) {
      req.add_chunk_peers(c.sender);
      req.add_chunk_rounds(c.round);
    }
    chunk_bytes = std::max(chunk_bytes, c.bytes);
    moved += c.bytes;
    for (const Op& op : c.ops) {
      if (op.gpu != me) continue;
      worker::v1::GpuOp* g = req.add_ops();
      g->set_chunk(k);
      g->set_allocation_id(*alloc);
      g->set_src_offset(op.off);
      g->set_src_stride(op.src_stride);
      g->set_dst_offset(op.dst);
      g->set_dst_stride(op.dst_stride);
      g->set_rows(op.nr);
      g->set_cols(op.nc);
      g->set_src_dtype(v1::BFLOAT16);
      g->set_dst_dtype(v1::BFLOAT16);
    }
  }
  req.set_chunk_bytes(chunk_bytes);
  unsigned long long* bad = nullptr;
  CK(cudaMalloc(&bad, sizeof(*bad)));
  cudaStream_t check;
  CK(cudaStreamCreateWithFlags(&check, cudaStreamNonBlocking));
  std::vector<Rep> reps;
  std::string first_error;
  for (int v = 0; v <= FLAGS_reps; ++v) {
    CK(cudaMemset(engine, 0xff, bytes));
    CK(cudaDeviceSynchronize());
    Barrier(v);
    const double t0 = Now();
    s = worker.BeginUpdate(req, absl::Now() + absl::Seconds(60));
    if (!s.ok()) Die("BeginUpdate: " + s.ToString());
    const bool faulty = !FLAGS_fault.empty() && v == FLAGS_fault_version;
    absl::StatusOr<GpuWorkerSupervisor::Waited> w =
        worker.WaitUpdate(absl::Now() + (faulty ? absl::Seconds(FLAGS_wait_s)
                                                : absl::Seconds(60)));
    if (faulty) {
      // Under a fault: the update either completed (the failure came after
      // this receiver's bytes) or is ended by ncclCommAbort in the worker
      // (AbortUpdate; a worker that can't abort in time is killed and
      // restarted by the supervisor). Then: was the engine left whole
      // (the old version is gone: 0xff poison) or partly written?
      const double t_wait = Now() - t0;
      std::string outcome = w.ok() ? "completed" : "aborted";
      double abort_s = 0;
      if (!w.ok()) {
        const double t_abort = Now();
        worker.AbortUpdate(absl::Now() + absl::Seconds(5));
        abort_s = Now() - t_abort;
      }
      const absl::Status alive = worker.Ping(absl::Now() + absl::Seconds(5));
      CK(cudaMemsetAsync(bad, 0, sizeof(*bad), check));
      for (const Need& n : plan.needs.at(me)) {
        CK(bench::CountMismatches(
            reinterpret_cast<const uint16_t*>(engine + n.dst), n.nr, n.nc,
            n.stride / 2, n.r0, n.c0, n.tensor, v, bad, check));
      }
      unsigned long long wrong = 0;
      CK(cudaMemcpyAsync(&wrong, bad, sizeof(wrong), cudaMemcpyDeviceToHost,
                         check));
      CK(cudaStreamSynchronize(check));
      WriteOut(
          plan, reps,
          absl::StrCat(
              "\"fault\": \"", FLAGS_fault, "\", \"outcome\": \"", outcome,
              "\", \"waited_s\": ", t_wait, ", \"abort_s\": ", abort_s,
              ", \"worker_alive\": ", alive.ok() ? "true" : "false",
              ", \"restarts\": ", worker.restarts(), ", \"wait_error\": \"",
              w.ok() ? ""
                     : std::string(w.status().code() ==
                                           absl::StatusCode::kDeadlineExceeded
                                       ? "deadline"
                                       : "error"),
              "\", \"elements_not_new\": ", wrong, ", "));
      owned.reset();
      std::fflush(stdout);
      _exit(0);
    }
    if (!w.ok()) Die("WaitUpdate: " + w.status().ToString());
    Rep rep{Now() - t0, absl::ToDoubleSeconds(w->device), 0};
    CK(cudaMemsetAsync(bad, 0, sizeof(*bad), check));
    for (const Need& n : plan.needs.at(me)) {
      CK(bench::CountMismatches(
          reinterpret_cast<const uint16_t*>(engine + n.dst), n.nr, n.nc,
          n.stride / 2, n.r0, n.c0, n.tensor, v, bad, check));
    }
    CK(cudaMemcpyAsync(&rep.bad, bad, sizeof(*bad), cudaMemcpyDeviceToHost,
                       check));
    CK(cudaStreamSynchronize(check));
    reps.push_back(rep);
  }
  Barrier(FLAGS_reps + 1);
  WriteOut(plan, reps,
           absl::StrCat("\"received_bytes\": ", moved,
                        ", \"chunks\": ", req.chunk_sizes_size(), ", "));
  owned.reset();  // kills the worker (no NCCL teardown)
  std::fflush(stdout);
  _exit(0);
}

}  // namespace
}  // namespace weightsync

int main(int argc, char** argv) {
  gflags::ParseCommandLineFlags(&argc, &argv, true);
  using weightsync::Die;
  if (FLAGS_rank < 0 || FLAGS_rank >= weightsync::kWorld) Die("--rank 0..3");
  if (FLAGS_plan.empty() || FLAGS_sync_dir.empty() || FLAGS_out.empty()) {
    Die("--plan, --sync_dir and --out are required");
  }
  std::thread([] {
    std::this_thread::sleep_for(std::chrono::seconds(FLAGS_timeout_s));
    std::fprintf(stderr, "mton_worker_bench rank %d: watchdog after %d s\n",
                 FLAGS_rank, FLAGS_timeout_s);
    std::fflush(stderr);
    _exit(3);
  }).detach();
  const weightsync::Plan plan = weightsync::ReadPlan(FLAGS_plan);
  if (FLAGS_rank < 2) weightsync::RunSender(plan);
  weightsync::RunReceiver(plan);
  return 0;
}

#!/usr/bin/env python3
"""Scale on paper (issue 20, part 5): update time of a deployment, predicted
from the schedule weightsync runs and the rates measured in bench/results/.

The schedule (docs/protocol.md, "GPU backends", "Several daemons";
backends/cuda/gpu_worker_update.cc):

* nccl: ONE trainer rank (rank 0) broadcasts every chunk of the packed
  update, in planner order, over ONE communicator whose other members are
  one rank per daemon (GetWorldSize answers 1). Each daemon's worker
  receives chunk k into staging buffer k mod N (recv stream), then scatters
  it into its engines on the scatter stream, peer writes over NVLink for
  engines on the node's other GPUs; the next receive into a buffer waits for
  its previous scatter (N >= 2, --gpu_staging_buffers 4). A daemon whose
  engines use none of a tensor still receives it (it skips only the copy).
  Trainers ask for 256 MiB - 1 GiB chunks (docs/operations.md, "Sizing GPU
  staging"; the daemon's 8 MiB default is for the host backend).
* ipc: one daemon copies from the trainer's buffer on the same GPU into the
  engines (copy engines; one transfer per merged op).
* control per update: Start (validate, auto-pause, worker BeginUpdate),
  the trainer's per-tensor work, Finish (drain, NewVersion + Resume round
  trip); receipts: the daemon's sums overlap the receive chunk by chunk
  (nccl) or are fused with the copy (ipc), the trainer's expectation is one
  read of the sent bytes after the update (Python client); with several
  daemons a plan_only Start round and a prepare/commit split (two more
  round trips, every daemon in parallel).

With N >= 2 buffers the stages overlap (measured: 2 and 4 buffers within
noise, bench/results/gpu_nccl.json), so the bytes take the busiest
resource's time plus one chunk through the other stages (pipeline fill and
drain). Every default below names the file it comes from, or says ASSUMED.

    python3 bench/scale_model.py            # validation and anchor tables
    python3 bench/scale_model.py --markdown # the same as bench/RESULTS.md tables
"""

import argparse
import json
import math
import os
from dataclasses import dataclass, field, replace

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
MiB = 1 << 20
GiB = 1 << 30
GB = 1e9


def load(name):
    with open(os.path.join(RESULTS, name)) as f:
        return json.load(f)


# --------------------------------------------------------------------------
# Measured inputs: read from bench/results/ (or quoted from the RESULTS.md
# paragraph named), never tuned to the checks below.
# --------------------------------------------------------------------------

def fit_nccl_call(model):
    """NCCL broadcast per call: t(m) = alpha + m / B, least squares over the
    raw baselines of one model in gpu_nccl.json (1 GiB, 256 MiB, 16 MiB
    messages of the same bytes)."""
    total = model["bytes"]
    points = [(math.ceil(total / GiB), model["raw_1g_s"]),
              (math.ceil(total / (256 * MiB)), total / (model["raw_256m_GBps"] * GB)),
              (math.ceil(total / (16 * MiB)), total / (model["raw_16m_GBps"] * GB))]
    # t = total/B + calls * alpha: linear in (1/B, alpha).
    n = len(points)
    sx = sum(c for c, _ in points)
    sy = sum(t for _, t in points)
    sxx = sum(c * c for c, _ in points)
    sxy = sum(c * t for c, t in points)
    alpha = (n * sxy - sx * sy) / (n * sxx - sx * sx)
    wire = (sy - alpha * sx) / n
    return alpha, total / wire


@dataclass(frozen=True)
class Gpu:
    name: str
    hbm_copy_GBps: float   # on-GPU copy, bytes counted once
    nvlink_GBps: float     # NVLink per direction, nominal
    source: str


@dataclass(frozen=True)
class Rates:
    """Link and kernel rates. Efficiencies are measured on 2 x H200 and
    carried to other GPUs by their nominal NVLink rate."""
    nccl_call_s: float         # alpha: per broadcast call
    nccl_nvlink_eff: float     # NCCL broadcast over NVLink / nominal NVLink
    peer_write_eff: float      # peer copy over NVLink / nominal NVLink
    receipt_pass_GBps: float   # daemon's receipt pass over installed bytes
    fused_receipt_s_per_GB: float  # ipc: receipts fused with the copy, extra time
    expect_GBps: float         # trainer's Triton expectation (one read)
    expect_fixed_s: float
    copy_call_s: float         # ipc: per copy-engine transfer beyond the bytes
    # ASSUMED (no measurement of ours):
    nic_Gbps: float = 400.0    # one ConnectX-7-class NIC per GPU
    nic_eff: float = 0.90      # NCCL's share of line rate over RDMA
    nics_per_node: int = 8
    pcie_GBps: float = 50.0    # pinned H2D over PCIe 5.0 x16 (64 GB/s nominal)
    hop_s: float = 5e-6        # per-hop latency of an RDMA ring
    nccl_step_bytes: int = 512 * 1024  # NCCL ring step (4 MiB buffer / 8 steps)

    @property
    def nic_GBps(self):
        return self.nic_Gbps / 8 * self.nic_eff


@dataclass(frozen=True)
class Control:
    """Fixed and per-tensor costs of an update (seconds)."""
    start_s: float        # Start: validate, pause round trip, worker begin, RPC
    pause_s: float        # the pause round trip inside start_s
    commit_s: float       # NewVersion + Resume round trip
    drain_s: float        # Start returned -> first receive, last scatter -> Finish sees it
    client_s: float       # the client's own time around the RPCs
    scatter_interference: float  # share of the scatter's time the concurrent receive loses
    per_tensor_s: float   # the trainer client's per-tensor work
    per_daemon_tensor_s: float  # a daemon's Start per manifest entry
    # ASSUMED: a control round trip between nodes (gRPC over TCP+TLS); the
    # same call on one host costs 0.16-0.8 ms (results/worker_rpc_probe.txt).
    round_trip_s: float = 0.5e-3
    # M->N through the daemons: what an update of several senders costs
    # beyond the terms above (the ranks' collectives, the senders starting
    # after the daemons' Begin, the daemons' rounds); calibrated below.
    many_senders_s: float = 0.0


def measured():
    """Every measured input, with where it comes from."""
    nccl = load("gpu_nccl.json")
    q8 = next(m for m in nccl["models"] if m["model"] == "qwen3-8b")
    alpha, wire_Bps = fit_nccl_call(q8)
    pyipc = load("python_ipc.json")
    gpu_ipc = load("gpu_ipc.json")["modes"]["vmm"]
    scale = load("manifest_scale.json")
    ipc_rows = {(r["tensors"], r["receipts"]): r for r in scale["ipc"]["rows"]}
    q8_bytes = q8["bytes"]
    h200 = Gpu("H200", q8["ondevice_copy_GBps"], 450.0,
               "hbm: gpu_nccl.json ondevice_copy_GBps; NVLink 4 nominal 450 GB/s per direction")
    h100 = Gpu("H100", q8_bytes / pyipc["cpp_copy_s"] / GB, 450.0,
               "hbm: python_ipc.json cpp_copy_s (one copy of 16.38 GB); NVLink 4 nominal")
    # ASSUMED: H800 = H100 HBM, NVLink cut to 400 GB/s both ways (public spec).
    h800 = Gpu("H800", h100.hbm_copy_GBps, 200.0,
               "ASSUMED: H100's HBM; NVLink 400 GB/s bidirectional (spec)")
    per_tensor = ((ipc_rows[(100000, "off")]["steady_update_s"]
                   - ipc_rows[(400, "off")]["steady_update_s"]) / (100000 - 400))
    d100k = ipc_rows[(100000, "off")]["last_update_timings"]["client"]["start_to_finish_s"]
    d400 = ipc_rows[(400, "off")]["last_update_timings"]["client"]["start_to_finish_s"]
    rates = Rates(
        nccl_call_s=alpha,
        nccl_nvlink_eff=wire_Bps / GB / h200.nvlink_GBps,
        # DESIGN.md "Numbers to beat": peer copy GPU0 -> GPU1 395 GB/s (2 x H200);
        # no results file holds it.
        peer_write_eff=395.0 / h200.nvlink_GBps,
        # python_ipc.json: C++ receipts as a pass after the copy minus receipts off.
        receipt_pass_GBps=q8_bytes / (pyipc["cpp_update_s_daemon_receipts_unfused"]
                                      - pyipc["cpp_update_s_receipts_off"]) / GB,
        fused_receipt_s_per_GB=(pyipc["cpp_update_s_daemon_receipts"]
                                - pyipc["cpp_update_s_receipts_off"]) / (q8_bytes / GB),
        # python_ipc.json expected_receipts_s: 6.91 ms for 16.38 GB, of which
        # RESULTS.md ("Where the default update's 23.1 ms go") puts ~1 ms in Python.
        expect_GBps=q8_bytes / (pyipc["expected_receipts_s"] - 1e-3) / GB,
        expect_fixed_s=1e-3,
        # python_ipc.json: 399 copy_ (copy_s) against one copy (cpp_copy_s).
        copy_call_s=(pyipc["copy_s"] - pyipc["cpp_copy_s"]) / 399,
    )
    # RESULTS.md "Where the time goes (NCCL)": Qwen3-1.7B, 256 MiB x 2:
    # Start 1.15 ms (pause 0.21), transfer 10.45 ms of which the GPU worked
    # 10.06 ms, commit 0.26 ms, the update 12.0 ms end to end.
    control = Control(
        start_s=1.15e-3, pause_s=0.21e-3, commit_s=0.26e-3,
        drain_s=(10.45 - 10.06) * 1e-3,
        client_s=(12.0 - 1.15 - 10.45 - 0.26) * 1e-3,
        scatter_interference=0.0,  # calibrated below
        per_tensor_s=per_tensor,
        per_daemon_tensor_s=(d100k - d400) / (100000 - 400),
    )
    q17 = next(m for m in nccl["models"] if m["model"] == "qwen3-1.7b")
    control = replace(control, scatter_interference=calibrate_interference(
        q17, rates, h200, 10.06e-3))
    ipc_control = {
        # gpu_ipc.json vmm: the daemon's Start and commit medians (C++ trainer).
        "cpp": (gpu_ipc["start_ms_median"] + gpu_ipc["commit_ms_median"]) * 1e-3,
        # manifest_scale.json ipc: the Python update of 400 tensors of 64 bytes
        # (bytes negligible): its whole control path.
        "python": ipc_rows[(400, "off")]["steady_update_s"],
        "python_receipts": ipc_rows[(400, "on")]["steady_update_s"],
    }
    # results/sparse.json (Qwen3-8B, 1% density, 2 x H200, NCCL): the
    # trainer's diff + pack per dense bf16 byte it reads, and the daemon's
    # whole sparse update on the GPU (receive + apply) per changed element.
    sp = load("sparse.json")
    sparse = {"diff_s_per_byte_h200": sp["trainer_diff_pack_s_median"] / sp["dense_bytes"],
              "apply_s_per_nnz_h200": sp["sparse_device_s_median"] / sp["steps"][0]["nnz"]}
    # results/fp8_wire.json (Qwen3-8B, one H200): the trainer's quantisation
    # of its 252 linear weights in one launch per form (wire_quantize_s), per
    # bf16 byte it reads. Those weights' bf16 bytes: each went from 2 bytes
    # an element to 1 on the wire (their scales, 4 bytes a 128 x 128
    # block, are within 0.03% of it), so twice what the wire saved.
    fw = load("fp8_wire.json")
    quantised_bf16 = 2 * (fw["bytes_sent"] - fw["fp8_wire_update_s_bytes"])
    fp8_wire = {"quantise_s_per_byte_h200": fw["wire_quantize_s"] / quantised_bf16}
    m = {"gpus": {"H200": h200, "H100": h100, "H800": h800}, "rates": rates,
         "sparse": sparse, "fp8_wire": fp8_wire,
         "control": control, "ipc_control": ipc_control, "nccl_wire_GBps": wire_Bps / GB}
    measured_s, d = many_senders_run("tp2")
    m["control"] = replace(control, many_senders_s=max(0.0, measured_s - predict(d, m).total_s))
    return m


def many_senders_run(layout):
    """(measured seconds, Deployment) of issue 32's run 5 (mton.json
    "daemons"): two trainer ranks -> two daemons on 4 x H200, Qwen3-8B,
    256 MiB chunks, receipts on; the median over the three trainer cases.
    The TP=2 engine's row calibrates Control.many_senders_s (one number:
    ~14 ms), the two replicas' row checks it."""
    run5 = load("mton.json")["daemons"]["run5"]["qwen3-8b"]
    times = sorted(x["median_s"] for x in run5 if x.get("layout") == layout
                   and x.get("senders") == 2 and x.get("verify")
                   and x.get("chunk") == 256 * MiB)
    d = Deployment(QWEN3_8B, gpu="H200", same_node=True, engine_gpus_per_node=2,
                   tp=2 if layout == "tp2" else 1, schedule="p2p", senders=2,
                   chunk_bytes=256 * MiB, receipts=True)
    return times[len(times) // 2], d


def chunk_sizes(total, chunk):
    n = math.ceil(total / chunk)
    return [chunk] * (n - 1) + [total - chunk * (n - 1)]


def calibrate_interference(model, rates, gpu, device_s):
    """kappa: the share of the scatter's time that the receive running
    beside it on the same GPU loses (both touch its memory), from ONE
    breakdown (Qwen3-1.7B, 256 MiB x 2: the GPU busy 10.06 ms), so that
    every other run is a check. Over the sweep it would be 0.18-0.92
    (bench/RESULTS.md, "Scale on paper"); a constant per chunk fits worse."""
    chunks = chunk_sizes(model["bytes"], 256 * MiB)
    wire = gpu.nvlink_GBps * rates.nccl_nvlink_eff * GB
    hbm = gpu.hbm_copy_GBps * GB
    predicted = sum(rates.nccl_call_s + c / wire for c in chunks) + chunks[-1] / hbm
    return min(1.0, max(0.0, (device_s - predicted) / (model["bytes"] / hbm)))


# --------------------------------------------------------------------------
# A deployment
# --------------------------------------------------------------------------

@dataclass(frozen=True)
class Weights:
    name: str
    params: float
    tensors: int
    expert_fraction: float = 0.0   # share of parameters in routed experts
    exact_bytes: int = 0           # our measured shapes: their exact bf16 bytes

    def bytes(self, bytes_per_param):
        if self.exact_bytes:
            return self.exact_bytes * bytes_per_param / 2.0
        return self.params * bytes_per_param


@dataclass(frozen=True)
class Deployment:
    weights: Weights
    gpu: str = "H100"                 # the GPUs of both sides
    wire_bytes_per_param: float = 2.0   # bf16; fp8 block-scaled ~1.0
    backend: str = "nccl"             # "nccl" or "ipc"
    senders: int = 1                  # trainer ranks broadcasting disjoint shares (today 1)
    sender_source: str = "gpu"        # "gpu": on the sender's GPU; "host": H2D per chunk
    same_node: bool = False           # sender(s) on the engines' node: NVLink, not RDMA
    nodes: int = 1                    # inference nodes, one daemon each
    gpus_per_node: int = 8
    engine_gpus_per_node: int = 0     # GPUs of a node holding engines (0: all)
    tp: int = 1                       # per engine instance (replica)
    pp: int = 1
    ep: int = 1                       # GPUs the experts are spread over, within a replica
    ranks_per_daemon: int = 1         # NCCL ranks (and NICs) a daemon receives on (today 1)
    per_node_groups: bool = False     # a node receives only the tensors its engines use
    chunk_bytes: int = 256 * MiB
    staging_buffers: int = 4          # --gpu_staging_buffers
    receipts: bool = False
    mode: str = "streaming"           # or "staged" (staging holds the whole update)
    client: str = "python"            # "python" or "cpp" (ipc control, expectation)
    # Issue 32's M->N schedule ("p2p"): every sender sends each inference
    # GPU its own share by ncclSend/ncclRecv on a plan made once; every
    # engine GPU is a receiving rank (ranks_per_daemon and per_node_groups
    # are implied). "broadcast" is today's.
    schedule: str = "broadcast"
    sparse_density: float = 0.0       # p2p: share of elements sent as index+value (0: dense)

    def __post_init__(self):
        if self.staging_buffers < 2:
            raise ValueError("an nccl Start needs at least 2 staging buffers")

    @property
    def engine_gpus(self):
        return self.engine_gpus_per_node or self.gpus_per_node

    @property
    def replica_gpus(self):
        return self.tp * self.pp


def geometry(d):
    """Bytes per node: (used, held). used: the model's bytes the node's
    engines use, at whole-tensor grain (what a per-node group would send
    it); held: the bytes its GPUs hold (what the scatter writes)."""
    total = d.weights.bytes(d.wire_bytes_per_param)
    g = d.replica_gpus
    nodes_per_replica = max(1, math.ceil(g / d.engine_gpus))
    if nodes_per_replica == 1:
        used = total
    else:
        # Stages (PP) and expert groups (EP) split whole tensors over nodes;
        # a TP split across nodes needs a slice of every tensor (whole-tensor
        # grain: all of it).
        pp_nodes = min(d.pp, nodes_per_replica)
        ep_nodes = max(1, min(nodes_per_replica, math.ceil(d.ep / d.engine_gpus)))
        expert = d.weights.expert_fraction
        used = total * ((1 - expert) / pp_nodes + expert / max(pp_nodes, ep_nodes))
    held = d.engine_gpus * total / g   # each GPU ~1/g of its replica
    return total, used, held


@dataclass
class Prediction:
    total_s: float
    bottleneck: str
    parts: dict = field(default_factory=dict)   # name -> seconds (they add to total_s)
    busy: dict = field(default_factory=dict)    # resource -> busy seconds
    wire_bytes: float = 0.0                     # bytes through the bottleneck


def predict(d, m=None):
    """Predicted update time of deployment d (seconds) with its breakdown."""
    m = m or measured()
    if d.backend == "ipc":
        return _predict_ipc(d, m)
    if d.schedule == "p2p":
        return _predict_p2p(d, m)
    return _predict_nccl(d, m)


def _predict_ipc(d, m):
    gpu, r = m["gpus"][d.gpu], m["rates"]
    total = d.weights.bytes(d.wire_bytes_per_param)
    copies = d.weights.tensors if d.client == "python" else 1   # registered source: one per tensor
    copy = total / (gpu.hbm_copy_GBps * GB) + copies * r.copy_call_s
    parts = {}
    if d.client == "python":
        key = "python_receipts" if d.receipts else "python"
        parts["control"] = (m["ipc_control"][key]
                            + m["control"].per_tensor_s * max(0, d.weights.tensors - 400))
    else:
        parts["control"] = m["ipc_control"]["cpp"]
    parts["copy"] = copy
    if d.receipts:
        parts["receipts (daemon)"] = r.fused_receipt_s_per_GB * total / GB
        if d.client == "python":
            parts["receipts (trainer)"] = total / (r.expect_GBps * GB) + r.expect_fixed_s
    return Prediction(sum(parts.values()), "HBM copy", parts, {"hbm": copy}, total)


@dataclass(frozen=True)
class Stage:
    name: str
    busy_s: float       # this resource's time for the whole update
    first_s: float      # one (first) chunk through it alone: pipeline fill
    last_s: float       # the last chunk through it alone: pipeline drain


def _predict_nccl(d, m):
    gpu, r, c = m["gpus"][d.gpu], m["rates"], m["control"]
    total, used, held = geometry(d)
    S, R = d.senders, min(d.ranks_per_daemon, r.nics_per_node)
    link = (gpu.nvlink_GBps * r.nccl_nvlink_eff if d.same_node else r.nic_GBps) * GB
    kind = "NVLink" if d.same_node else "NIC"
    SENDER, DAEMON = f"sender {kind}", f"daemon {kind}"
    peer = gpu.nvlink_GBps * r.peer_write_eff * GB
    hbm = gpu.hbm_copy_GBps * GB
    received = used if d.per_node_groups else total    # bytes into each node
    share = total / S                                  # bytes each sender sends
    chunks = chunk_sizes(share, d.chunk_bytes)
    first, last = chunks[0], chunks[-1]
    per_call = r.nccl_call_s
    # Broadcast calls each receiving rank takes part in (all senders' chunks
    # that reach its node, spread over its R ranks).
    calls_per_rank = len(chunks) * S * (received / total) / R
    local = 1.0 / d.engine_gpus                        # the receiving GPU's own engines
    scatter_per_byte = (held / received) * ((1 - local) / peer + local / hbm)

    stages = []
    if d.sender_source == "host":
        stages.append(Stage("sender PCIe (H2D)", share / (r.pcie_GBps * GB),
                            first / (r.pcie_GBps * GB), last / (r.pcie_GBps * GB)))
    # One NCCL transfer crosses the sender's link and every node's link at
    # once (ring, pipelined in steps): one stage, as slow as its busiest end.
    sender_busy = share / link + len(chunks) * per_call
    scatter_busy = received * scatter_per_byte / R
    # kappa was measured with NCCL over NVLink beside a local copy; applied
    # to an RDMA receive too (conservative: that writes HBM at ~45 GB/s).
    daemon_busy = (received / (R * link) + calls_per_rank * per_call
                   + (c.scatter_interference * scatter_busy if d.mode == "streaming" else 0.0))
    wire_name = SENDER if sender_busy >= daemon_busy else DAEMON
    stages.append(Stage(wire_name, max(sender_busy, daemon_busy),
                        first / link + per_call, last / link + per_call))
    if d.mode == "streaming":
        stages.append(Stage("node scatter", scatter_busy,
                            first * scatter_per_byte, last * scatter_per_byte))
    b = max(range(len(stages)), key=lambda i: stages[i].busy_s)
    fill = sum(s.first_s for s in stages[:b]) + sum(s.last_s for s in stages[b + 1:])
    ring_nodes = 1 if d.same_node else max(1, round(d.nodes * received / total))
    fill += (ring_nodes - 1) * (r.nccl_step_bytes / link + r.hop_s)

    daemons = 1 if d.same_node else d.nodes
    parts = {
        "client": c.client_s + c.per_tensor_s * d.weights.tensors / S,
        "start": c.start_s + c.per_daemon_tensor_s * d.weights.tensors,
        "bytes": stages[b].busy_s,
        "fill": fill,
        "drain": c.drain_s,
        "commit": c.commit_s,
    }
    if d.mode == "staged":
        # Finish: pause, staging -> engines on the GPU, then the commit.
        parts["start"] -= c.pause_s
        parts["staged commit copy"] = c.pause_s + held / R * ((1 - local) / peer + local / hbm)
    if daemons > 1:
        # plan_only Start and the prepare/commit split: two more round trips
        # (every daemon in parallel); ASSUMED: the one client process sends
        # each daemon its manifest in turn (plan_only and Start).
        parts["multi-daemon rounds"] = (2 * c.round_trip_s + 2 * (daemons - 1)
                                        * c.per_daemon_tensor_s * d.weights.tensors)
    if d.receipts:
        # The daemon sums each chunk right after its scatter, overlapped
        # with the next receive: the last chunk's sums remain.
        parts["receipts (daemon)"] = last * (held / received) / (r.receipt_pass_GBps * GB)
        # The trainer's expectation, after prepare: one read of what each
        # sender sent, once per distinct engine layout (replicas share
        # theirs; every layout together covers one replica: the model).
        parts["receipts (trainer)"] = share / (r.expect_GBps * GB) + r.expect_fixed_s
    busy = {s.name: s.busy_s for s in stages}
    busy[SENDER], busy[DAEMON] = sender_busy, daemon_busy
    through = {"sender PCIe (H2D)": share, SENDER: share, DAEMON: received / R,
               "node scatter": held * (1 - local) / R}
    return Prediction(sum(parts.values()), stages[b].name, parts, busy,
                      through[stages[b].name])


def _predict_p2p(d, m):
    """Issue 32's M->N schedule: S senders, each holding 1/S of the bytes
    every engine replica needs, send each inference GPU its own share
    (ncclSend/ncclRecv in groups, one round per chunk, on a plan made once
    and kept by id: a Start names the plan, no per-tensor work). Every
    inference GPU is a receiving rank on its own link (NIC, or NVLink
    when same_node). Stages, pipelined chunk by chunk: the sender's source
    (host: H2D), its GPU pass (fp8: quantise; sparse: diff against the
    previous version), the sender's link, the receiver's link, and the
    receiver's GPU pass (dense: a scatter where the piece is strided or
    converted, overlapped; sparse: the apply). The busiest stage's time
    plus one chunk through the others, plus the control."""
    gpu, r, c = m["gpus"][d.gpu], m["rates"], m["control"]
    link = (gpu.nvlink_GBps * r.nccl_nvlink_eff if d.same_node else r.nic_GBps) * GB
    kind = "NVLink" if d.same_node else "NIC"
    hbm = gpu.hbm_copy_GBps * GB
    h200 = m["gpus"]["H200"].hbm_copy_GBps * GB
    g = d.replica_gpus
    engine_gpus = d.nodes * d.engine_gpus
    dense_gpu = d.weights.bytes(d.wire_bytes_per_param) / g   # one GPU's dense share
    params_gpu = d.weights.bytes(1.0) / g                      # its elements
    if d.sparse_density > 0.0:
        nnz_gpu = d.sparse_density * params_gpu
        wire_gpu = min(dense_gpu, nnz_gpu * (4 + d.wire_bytes_per_param))  # int32 + value
    else:
        nnz_gpu, wire_gpu = 0.0, dense_gpu
    S = d.senders
    share = wire_gpu * engine_gpus / S            # bytes each sender sends
    # What a sender reads of its own bf16 shard (1/S of the model), once
    # whatever the number of replicas its bytes go to.
    bf16_share = d.weights.bytes(2.0) / S
    n_share = max(1, math.ceil(share / d.chunk_bytes))
    n_gpu = max(1, math.ceil(wire_gpu / d.chunk_bytes))
    first_r = wire_gpu / n_gpu
    # Fill and drain: one chunk's worth of elements through every other
    # stage (counted in elements, so that more bytes per element never
    # shortens it).
    n_fill = max(1, math.ceil(d.weights.bytes(2.0) * engine_gpus / g / S / d.chunk_bytes))
    per_call = r.nccl_call_s                      # one group round (ASSUMED: a broadcast call's)

    stages = []

    def stage(name, busy, _n):
        stages.append(Stage(name, busy, busy / n_fill, busy / n_fill))

    if d.sender_source == "host":
        stage("sender PCIe (H2D)", bf16_share / (r.pcie_GBps * GB), n_share)
    if nnz_gpu:
        stage("sender diff (GPU)", bf16_share * m["sparse"]["diff_s_per_byte_h200"] * h200 / hbm,
              n_share)
    elif d.wire_bytes_per_param < 2.0:
        # Quantise its shard once, at the rate measured on an H200 (scaled
        # by HBM): 0.69 TB/s of bf16 read, where HBM at a copy's rate would
        # give 2.8 (it read 2 bytes and wrote 1 an element at 2.1 TB/s).
        stage("sender quantise (GPU)",
              bf16_share * m["fp8_wire"]["quantise_s_per_byte_h200"] * h200 / hbm, n_share)
    stage(f"sender {kind}", share / link + n_share * per_call, n_share)
    recv_busy = wire_gpu / link + n_gpu * per_call
    if nnz_gpu:
        apply = nnz_gpu * m["sparse"]["apply_s_per_nnz_h200"] * h200 / hbm
        stage(f"receiver {kind}", recv_busy, n_gpu)
        stage("receiver apply (GPU)", apply, n_gpu)
    else:
        scatter = wire_gpu / hbm       # ASSUMED: every piece staged and copied (conservative)
        stage(f"receiver {kind}", recv_busy + c.scatter_interference * scatter, n_gpu)
        stage("receiver scatter (GPU)", scatter, n_gpu)
    b = max(range(len(stages)), key=lambda i: stages[i].busy_s)
    fill = sum(s.first_s for s in stages[:b]) + sum(s.last_s for s in stages[b + 1:])
    fill += 0.0 if d.same_node else r.hop_s
    daemons = 1 if d.same_node else d.nodes
    parts = {
        "client": c.client_s + c.per_tensor_s * d.weights.tensors / S,
        "start": c.start_s,
        "bytes": stages[b].busy_s,
        "fill": fill,
        "drain": c.drain_s,
        "commit": c.commit_s,
    }
    if nnz_gpu:
        # Each update's piece sizes differ: one header round before the bytes.
        parts["sparse header round"] = per_call + (0.0 if d.same_node else r.hop_s)
    if S > 1:
        parts["many-sender protocol"] = c.many_senders_s
    if daemons > 1:
        parts["multi-daemon rounds"] = 2 * c.round_trip_s   # prepare, commit; plan by id
    if d.receipts:
        parts["receipts (daemon)"] = first_r / (r.receipt_pass_GBps * GB)
        parts["receipts (trainer)"] = share / (r.expect_GBps * GB) + r.expect_fixed_s
    busy = {s.name: s.busy_s for s in stages}
    busy["node scatter"] = busy.get("receiver scatter (GPU)", busy.get("receiver apply (GPU)"))
    through = {s.name: (share if s.name.startswith("sender") else wire_gpu) for s in stages}
    return Prediction(sum(parts.values()), stages[b].name, parts, busy, through[stages[b].name])


# --------------------------------------------------------------------------
# Validation: our measured runs, predicted from the inputs above
# --------------------------------------------------------------------------

QWEN3_8B = Weights("Qwen3-8B", 8.19e9, 399, exact_bytes=16381470720)
QWEN3_1_7B = Weights("Qwen3-1.7B", 1.72e9, 310, exact_bytes=3441149952)


def two_gpu(weights, **kw):
    """The measured NCCL setup: trainer GPU 0, daemon and one plain bf16
    engine on GPU 1 of the same 2 x H200 host (bench/run_gpu_bench.sh)."""
    return Deployment(weights, gpu="H200", same_node=True, engine_gpus_per_node=1,
                      client="cpp", **kw)


def validation(m=None):
    """[(what, file, measured_s, predicted_s, role)]; role "check" rows are
    predicted from inputs they did not supply; "input" rows supplied one."""
    m = m or measured()
    r = m["rates"]
    rows = []
    nccl = load("gpu_nccl.json")
    for model in nccl["models"]:
        w = QWEN3_8B if model["model"] == "qwen3-8b" else QWEN3_1_7B
        # Raw NCCL: alpha and B were fitted on Qwen3-8B's three baselines.
        role = "input" if w is QWEN3_8B else "check"
        for size, gbps in ((GiB, model["baseline_GBps"]), (256 * MiB, model["raw_256m_GBps"]),
                           (16 * MiB, model["raw_16m_GBps"])):
            pred = sum(r.nccl_call_s + cs / (m["nccl_wire_GBps"] * GB)
                       for cs in chunk_sizes(model["bytes"], size))
            rows.append((f"raw NCCL broadcast, {w.name}, {size // MiB} MiB messages",
                         "gpu_nccl.json", model["bytes"] / (gbps * GB), pred, role))
        for run in model["sweep"]:
            d = two_gpu(w, chunk_bytes=run["chunk_MiB"] * MiB,
                        staging_buffers=run["staging_buffers"])
            role = ("input" if (w is QWEN3_1_7B and run["chunk_MiB"] == 256
                                and run["staging_buffers"] == 2) else "check")
            rows.append((f"weightsync NCCL, {w.name}, {run['chunk_MiB']} MiB x "
                         f"{run['staging_buffers']}", "gpu_nccl.json", run["weightsync_s"],
                         predict(d, m).total_s, role))
    py = load("python_nccl.json")
    for run in py["sweep"]:
        p = predict(two_gpu(QWEN3_8B, chunk_bytes=run["chunk_MiB"] * MiB), m)
        daemon = p.total_s - p.parts["client"]
        rows.append((f"Python NCCL, Qwen3-8B, {run['chunk_MiB']} MiB, daemon's clock",
                     "python_nccl.json", run["daemon_s"], daemon, "check"))
    rec = load("receipts.json")
    for key, on in (("update_s_median_without_receipts", False), ("update_s_median", True)):
        p = predict(two_gpu(QWEN3_8B, chunk_bytes=rec["chunk_bytes"], receipts=on), m)
        t = p.total_s - p.parts.get("receipts (trainer)", 0.0)   # C++ trainer: not timed
        rows.append((f"NCCL, Qwen3-8B, 1 GiB, receipts {'on' if on else 'off'}",
                     "receipts.json", rec[key], t, "check"))
    # M->N through the daemons (issue 32, run 5): the TP=2 row calibrates
    # the one many-senders constant (~14 ms: the daemons' device time runs
    # ~10 ms over raw whatever the bytes, 8 GB or 16 GB, and the ranks'
    # collectives ~5 ms), the replicas row (twice the bytes) checks it.
    for layout in ("tp2", "replicas"):
        measured_s, d = many_senders_run(layout)
        rows.append((f"M->N through the daemons, Qwen3-8B, 2 senders -> {layout}, 256 MiB",
                     "mton.json", measured_s, predict(d, m).total_s,
                     "input" if layout == "tp2" else "check"))
    st = load("staged.json")
    p = predict(two_gpu(QWEN3_8B, chunk_bytes=st["chunk_bytes"], mode="staged"), m)
    rows.append(("staged NCCL, Qwen3-8B: the whole update", "staged.json",
                 st["update_s_median"], p.total_s, "check"))
    rows.append(("staged NCCL, Qwen3-8B: engine paused", "staged.json", st["pause_s_median"],
                 p.parts["staged commit copy"] + m["control"].commit_s, "check"))
    ipc = load("gpu_ipc.json")["modes"]["vmm"]
    rows.append(("IPC, C++, Qwen3-8B, one H200 (VMM)", "gpu_ipc.json", ipc["weightsync_s"],
                 predict(Deployment(QWEN3_8B, gpu="H200", backend="ipc", client="cpp"), m).total_s,
                 "check"))
    pyipc = load("python_ipc.json")
    h100 = dict(gpu="H100", backend="ipc")
    rows += [
        ("IPC, C++, Qwen3-8B, one H100, receipts off", "python_ipc.json",
         pyipc["cpp_update_s_receipts_off"],
         predict(Deployment(QWEN3_8B, client="cpp", **h100), m).total_s, "check"),
        ("IPC, C++, one H100, the daemon's receipts fused", "python_ipc.json",
         pyipc["cpp_update_s_daemon_receipts"],
         predict(Deployment(QWEN3_8B, client="cpp", receipts=True, **h100), m).total_s, "input"),
        ("IPC, Python, Qwen3-8B, one H100, receipts off", "python_ipc.json",
         pyipc["update_s_receipts_off"],
         predict(Deployment(QWEN3_8B, **h100), m).total_s, "check"),
        ("IPC, Python, Qwen3-8B, one H100, receipts on", "python_ipc.json",
         pyipc["update_s_default"],
         predict(Deployment(QWEN3_8B, receipts=True, **h100), m).total_s, "check"),
    ]
    # Control per tensor: linear in the count, fitted on the 400 and 100k
    # rows of a series, checked on its 4k and 40k rows.
    scale = load("manifest_scale.json")
    for label, series in (("host backend, 2-core VM", scale["rows"]),
                          ("ipc, one H200 (75523cb)", scale["ipc_h200_before"]["rows"])):
        for receipts in ("off", "on"):
            pts = {x["tensors"]: x["steady_update_s"] for x in series if x["receipts"] == receipts}
            slope = (pts[100000] - pts[400]) / (100000 - 400)
            for n in (4000, 40000):
                rows.append((f"{n} tensors, {label}, receipts {receipts}", "manifest_scale.json",
                             pts[n], pts[400] + slope * (n - 400), "check"))
    return rows + mton_raw_rows(m)


def mton_raw_rows(m=None):
    """Issue 32's raw NCCL runs on 4 GPUs (results/mton.json, NVLink):
    each pattern predicted as its busiest rank's bytes (in or out) over the
    NCCL rate fitted on 2 x H200, plus one call per message of that rank:
    the M->N schedule's wire stage on its own."""
    m = m or measured()
    path = os.path.join(RESULTS, "mton.json")
    if not os.path.exists(path):
        return []
    rows = []
    for run in ("nvlink", "nvlink256"):
        doc = load("mton.json")["raw"].get(run)
        if not doc:
            continue
        msg = doc["msg_mib"] * MiB
        for name, r in doc["results"].items():
            per = {}
            for link, b in r["flows"].items():
                s, d = (int(x) for x in link.split("->"))
                if r["kind"] == "bcast":
                    per[("out", s)] = b   # one copy leaves the root, whatever the fan-out
                else:
                    per[("out", s)] = per.get(("out", s), 0) + b
                per[("in", d)] = per.get(("in", d), 0) + b
            busiest = max(per.values())
            pred = busiest / (m["nccl_wire_GBps"] * GB) + math.ceil(busiest / msg) * \
                m["rates"].nccl_call_s
            rows.append((f"raw M->N {name}, Qwen3-8B, {doc['msg_mib']} MiB, 4 x H200",
                         "mton.json", r["s_median"], pred, "check"))
    return rows


def error(measured_s, predicted_s):
    return (predicted_s - measured_s) / measured_s


# --------------------------------------------------------------------------
# Anchors: the public figures' setups
# --------------------------------------------------------------------------

def kimi_k2():
    """Kimi-K2: 1.04 T parameters (public), 61 layers of which the first is
    dense, 384 routed experts of width 2048 on a 7168 hidden size (its
    public config.json, recalled here, not checked: no network)."""
    experts = 60 * 384 * 3 * 7168 * 2048           # 1.015 T
    # Per layer ~14 other tensors (MLA projections and norms, router and
    # its bias, the shared expert), plus embeddings, final norm, lm_head.
    tensors = 60 * 384 * 3 + 61 * 14 + 3
    return Weights("Kimi-K2", 1.04e12, tensors, expert_fraction=experts / 1.04e12)


def qwen3_235b():
    """Qwen3-235B-A22B: 235 B parameters (public), 94 layers x 128 experts
    of width 1536 on a 4096 hidden size; 36,945 tensors as named in
    bench/manifest_scale.py --qwen3 (results/manifest_scale.json)."""
    experts = 94 * 128 * 3 * 4096 * 1536           # 227 B
    return Weights("Qwen3-235B-A22B", 235e9, 36945, expert_fraction=experts / 235e9)


def fp8(weights):
    """fp8 block-scaled on the wire: ~1 byte per parameter, and (ASSUMED)
    one scale tensor beside each quantized matrix: twice the tensors."""
    return replace(weights, tensors=2 * weights.tensors)


# Perplexity (research.perplexity.ai, "Weight Transfer for RL Post-Training
# in under 2 seconds", 2025-09-24): Kimi-K2 from 256 training GPUs (bf16)
# to 128 inference GPUs (fp8) in 1.3 s, every training GPU writing its
# share straight into inference GPUs by RDMA WRITE.
PERPLEXITY_S = 1.3
# checkpoint-engine (github.com/MoonshotAI/checkpoint-engine README,
# benchmark table, as stored at 415c320): Qwen3-235B-A22B-Instruct-2507
# bf16, 8 x H800, TP8, broadcast update 6.22 s (6.75 s in the table quoted
# at its release); weights held in the node's host memory, H2D, NCCL
# broadcast among the 8 GPUs, vLLM reloads its share.
CHECKPOINT_ENGINE_S = 6.22

# ASSUMED (not in the post): 16 nodes x 8 GPUs, an engine instance of 16
# GPUs on 2 nodes (1.03 TB of fp8 needs more than one node of 80 GB GPUs),
# split by pipeline stage (each node one stage); 32 training nodes x 8.
KIMI_INFERENCE = dict(gpu="H100", nodes=16, gpus_per_node=8, tp=8, pp=2, ep=8)
TRAINING_GPUS = 256


def kimi_rows():
    k2 = kimi_k2()
    today = Deployment(k2, sender_source="host", **KIMI_INFERENCE)
    f8 = dict(weights=fp8(k2), wire_bytes_per_param=1.0)
    return [
        ("ours today: rank 0 sends bf16 from host memory, one communicator, "
         "one rank per daemon", today),
        ("+ fp8 on the wire", replace(today, **f8)),
        ("+ fp8, per-node groups (each node gets only its stage)",
         replace(today, per_node_groups=True, **f8)),
        ("+ fp8, groups, 8 senders (one trainer node's 8 NICs)",
         replace(today, per_node_groups=True, senders=8, sender_source="gpu", **f8)),
        ("+ fp8, groups, 8 senders, 8 ranks per daemon (one per NIC)",
         replace(today, per_node_groups=True, senders=8, sender_source="gpu",
                 ranks_per_daemon=8, **f8)),
        (f"+ fp8, groups, {TRAINING_GPUS} senders (every training GPU), 8 ranks per daemon",
         replace(today, per_node_groups=True, senders=TRAINING_GPUS, sender_source="gpu",
                 ranks_per_daemon=8, **f8)),
        (f"the same, receipts on", replace(today, per_node_groups=True, senders=TRAINING_GPUS,
                                          sender_source="gpu", ranks_per_daemon=8,
                                          receipts=True, **f8)),
    ]


def kimi_floor(m=None):
    """What every inference GPU must take in, over its own NIC, when every
    training GPU writes straight into it (Perplexity's schedule): one
    GPU's share of an fp8 engine instance."""
    m = m or measured()
    d = Deployment(fp8(kimi_k2()), wire_bytes_per_param=1.0, **KIMI_INFERENCE)
    per_gpu = geometry(d)[2] / d.engine_gpus
    return per_gpu / (m["rates"].nic_GBps * GB), per_gpu


# checkpoint-engine's node: 8 x H800 (ASSUMED: 8 x 400 Gb/s NICs, PCIe 5.0).
QWEN_NODE = dict(gpu="H800", nodes=1, gpus_per_node=8, tp=8)


def qwen_rows():
    q = qwen3_235b()
    return [
        ("ours today: trainer on another node, one NIC", Deployment(q, **QWEN_NODE)),
        ("ours today: bytes in this node's host memory (their benchmark), one trainer "
         "process: H2D, NVLink to the daemon's GPU", Deployment(q, same_node=True,
                                                                sender_source="host", **QWEN_NODE)),
        ("+ 7 senders, each H2D of its share (the 7 GPUs beside the daemon's)",
         Deployment(q, same_node=True, sender_source="host", senders=7, **QWEN_NODE)),
        ("+ 7 senders, 8 ranks per daemon (a rank on every GPU)",
         Deployment(q, same_node=True, sender_source="host", senders=7, ranks_per_daemon=8,
                    **QWEN_NODE)),
    ]


def mton_rows():
    """Issue 32's M->N schedule at the anchors' scale: [(anchor, label, d)]."""
    k2 = fp8(kimi_k2())
    kimi = Deployment(k2, wire_bytes_per_param=1.0, schedule="p2p", senders=TRAINING_GPUS,
                      **KIMI_INFERENCE)
    wide = dict(KIMI_INFERENCE, pp=4)
    q = qwen3_235b()
    qwen = Deployment(q, same_node=True, sender_source="host", schedule="p2p", senders=8,
                      **QWEN_NODE)
    return [
        ("Kimi-K2", f"M->N (issue 32): {TRAINING_GPUS} senders quantise to fp8 and send each "
                    "inference GPU its share; plan by id", kimi),
        ("Kimi-K2", "M->N, sparse patches at 0.3% density (int32 index + fp8 value)",
         replace(kimi, sparse_density=0.003)),
        ("Kimi-K2", "M->N, what lifts the dense row: instances of 32 GPUs (PP4: half the "
                    "bytes per inference GPU)", replace(kimi, **{k: v for k, v in wide.items()
                                                                  if k == "pp"})),
        ("Qwen3-235B", "M->N (issue 32): 8 senders, one per GPU, each H2D of the share it "
                       "sends; every GPU a receiving rank", qwen),
    ]


def anchors(m=None):
    """[(anchor, label, Prediction)] for every anchor row."""
    m = m or measured()
    return ([("Kimi-K2", label, d, predict(d, m)) for label, d in kimi_rows()]
            + [("Qwen3-235B", label, d, predict(d, m)) for label, d in qwen_rows()]
            + [(a, label, d, predict(d, m)) for a, label, d in mton_rows()])


def checkpoint_engine_floor(m=None):
    """checkpoint-engine's broadcast under our rates: each of the 8 GPUs
    copies 1/8 of the weights host -> GPU, then NCCL broadcasts every
    bucket to all 8, so every GPU takes in the 7/8 it did not load over
    its NVLink. Returns the larger of the two busy times (seconds)."""
    m = m or measured()
    r, gpu = m["rates"], m["gpus"][QWEN_NODE["gpu"]]
    total = qwen3_235b().bytes(2.0)
    h2d = total / 8 / (r.pcie_GBps * GB)
    nvlink = total * 7 / 8 / (gpu.nvlink_GBps * r.nccl_nvlink_eff * GB)
    return max(h2d, nvlink)


# --------------------------------------------------------------------------
# Tables
# --------------------------------------------------------------------------

def _control(p):
    return sum(v for k, v in p.parts.items()
               if k in ("client", "start", "drain", "commit", "multi-daemon rounds"))


def validation_table(m=None):
    lines = ["| run | file | measured | predicted | error | |",
             "| --- | --- | --- | --- | --- | --- |"]
    for what, f, me, pr, role in validation(m):
        lines.append(f"| {what} | {f} | {me * 1e3:.2f} ms | {pr * 1e3:.2f} ms | "
                     f"{100 * error(me, pr):+.1f}% | {'' if role == 'check' else 'input'} |")
    return "\n".join(lines)


def anchor_table(m=None):
    m = m or measured()
    lines = ["| anchor | schedule | predicted | bottleneck: bytes through it | fill | "
             "scatter (overlapped) | control | receipts | vs reported |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    floor_s, per_gpu = kimi_floor(m)
    lines.append(f"| Kimi-K2 | **Perplexity, reported** (RDMA WRITE from every training GPU) "
                 f"| **{PERPLEXITY_S:.1f} s** | | | | | | |")
    lines.append(f"| Kimi-K2 | their schedule's floor here: each inference GPU's fp8 share "
                 f"over its own NIC | {floor_s:.2f} s | inference NIC: {per_gpu / GB:.0f} GB | "
                 f"| | | | {floor_s / PERPLEXITY_S:.2f}× |")
    for anchor, label, d, p in anchors(m):
        if anchor == "Qwen3-235B" and label.startswith("ours today: trainer"):
            lines.append(f"| Qwen3-235B | **checkpoint-engine, reported** (8 × H800, TP8, "
                         f"broadcast) | **{CHECKPOINT_ENGINE_S:.2f} s** | | | | | | |")
            lines.append(f"| Qwen3-235B | their schedule's floor here: every GPU takes in "
                         f"7/8 of the weights over NVLink | {checkpoint_engine_floor(m):.2f} s "
                         f"| | | | | | {checkpoint_engine_floor(m) / CHECKPOINT_ENGINE_S:.2f}× |")
        ref = PERPLEXITY_S if anchor == "Kimi-K2" else CHECKPOINT_ENGINE_S
        receipts = (f"{sum(v for k, v in p.parts.items() if k.startswith('receipts')) * 1e3:.1f} ms"
                    if d.receipts else "off")
        lines.append(
            f"| {anchor} | {label} | {p.total_s:.2f} s | {p.bottleneck}: "
            f"{p.wire_bytes / GB:.0f} GB | {p.parts['fill'] * 1e3:.1f} ms | "
            f"{p.busy.get('node scatter', 0.0):.2f} s | {_control(p) * 1e3:.0f} ms | "
            f"{receipts} | {p.total_s / ref:.2f}× |")
    return "\n".join(lines)


def inputs_table(m=None):
    m = m or measured()
    r, c = m["rates"], m["control"]
    rows = [
        ("NCCL broadcast over NVLink, per call", f"{r.nccl_call_s * 1e6:.1f} µs + bytes / "
         f"{m['nccl_wire_GBps']:.1f} GB/s", "fit on gpu_nccl.json raw_1g_s, raw_256m_GBps, "
         "raw_16m_GBps (Qwen3-8B, 2 × H200)"),
        ("... as a share of NVLink's 450 GB/s per direction", f"{r.nccl_nvlink_eff:.3f}",
         "the same; carried to H100 (450) and H800 (200, ASSUMED spec)"),
        ("peer write over NVLink (the scatter to other GPUs)",
         f"{r.peer_write_eff * 450:.0f} GB/s ({r.peer_write_eff:.3f})",
         "../shared/DESIGN.md, 'Numbers to beat' (no results file)"),
        ("on-GPU copy H200 / H100", f"{m['gpus']['H200'].hbm_copy_GBps:.0f} / "
         f"{m['gpus']['H100'].hbm_copy_GBps:.0f} GB/s",
         "gpu_nccl.json ondevice_copy_GBps / python_ipc.json cpp_copy_s"),
        ("receive lost to the scatter beside it (kappa)", f"{c.scatter_interference:.2f} of the "
         "scatter's time", "calibrated on one breakdown: RESULTS.md 'Where the time goes "
         "(NCCL)', Qwen3-1.7B 256 MiB × 2, GPU busy 10.06 ms"),
        ("Start / commit / drain / client (nccl)", f"{c.start_s * 1e3:.2f} / {c.commit_s * 1e3:.2f}"
         f" / {c.drain_s * 1e3:.2f} / {c.client_s * 1e3:.2f} ms", "the same breakdown"),
        ("ipc control, C++ / Python (400 tensors)", f"{m['ipc_control']['cpp'] * 1e3:.2f} / "
         f"{m['ipc_control']['python'] * 1e3:.2f} ms", "gpu_ipc.json start+commit medians / "
         "manifest_scale.json ipc 400 tensors"),
        ("per tensor: client / each daemon's Start", f"{c.per_tensor_s * 1e6:.3f} / "
         f"{c.per_daemon_tensor_s * 1e6:.3f} µs", "manifest_scale.json ipc, 400 vs 100k "
         "tensors (steady_update_s / start_to_finish_s), one H100"),
        ("ipc: per copy transfer", f"{r.copy_call_s * 1e6:.1f} µs",
         "python_ipc.json copy_s (399 copies) − cpp_copy_s (one)"),
        ("receipts: daemon pass / fused / trainer expectation",
         f"{r.receipt_pass_GBps:.0f} GB/s / {r.fused_receipt_s_per_GB * 1e3:.3f} ms per GB / "
         f"{r.expect_GBps:.0f} GB/s + 1 ms", "python_ipc.json cpp_* rows, expected_receipts_s"),
        ("RDMA NIC", f"{r.nic_Gbps:.0f} Gb/s × {r.nic_eff} = {r.nic_GBps:.0f} GB/s, "
         f"{r.nics_per_node} per node", "ASSUMED (ConnectX-7 class, one per GPU)"),
        ("host → GPU (pinned, PCIe 5.0 ×16)", f"{r.pcie_GBps:.0f} GB/s per GPU", "ASSUMED"),
        ("RDMA ring: hop latency, NCCL step", f"{r.hop_s * 1e6:.0f} µs, "
         f"{r.nccl_step_bytes // 1024} KiB", "ASSUMED"),
        ("control round trip between nodes", f"{c.round_trip_s * 1e3:.1f} ms", "ASSUMED "
         "(one host: 0.16-0.8 ms, results/worker_rpc_probe.txt)"),
    ]
    lines = ["| input | value | from |", "| --- | --- | --- |"]
    lines += [f"| {a} | {b} | {f} |" for a, b, f in rows]
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--markdown", action="store_true", help="print the RESULTS.md tables")
    args = ap.parse_args()
    m = measured()
    if args.markdown:
        print(inputs_table(m), validation_table(m), anchor_table(m), sep="\n\n")
        return
    print("validation (predicted vs measured):")
    for what, f, me, pr, role in validation(m):
        print(f"  {what:62s} {me * 1e3:9.2f} {pr * 1e3:9.2f} ms {100 * error(me, pr):+6.1f}%"
              f"{'  (input)' if role != 'check' else ''}")
    print("anchors:")
    for anchor, label, d, p in anchors(m):
        print(f"  {anchor:10s} {p.total_s:8.3f} s  {p.bottleneck:18s} {label}")
        print("             " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in p.parts.items()))


if __name__ == "__main__":
    main()

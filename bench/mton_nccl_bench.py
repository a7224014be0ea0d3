#!/usr/bin/env python3
"""Raw NCCL baselines for issue 32's byte patterns (4 GPUs, torch 2.x).

Four processes, one per GPU: trainer ranks 0, 1 (GPUs 0, 1) and receiver
ranks 2, 3 (GPUs 2, 3, where the engines live). No weightsync code runs:
this is the ceiling a weightsync M->N update of the same bytes is held to.

  bcast_1s_{1,2}r  today's schedule: rank 0 broadcasts the whole model in
                   --msg_mib messages to one receiver rank (one daemon that
                   scatters to both engine GPUs) or to both (two daemons);
  p2p_1s_<layout>  rank 0 alone sends each engine GPU what it needs
                   (send/recv, no broadcast);
  p2p_2s_<case>_<layout>  both trainer ranks send at once, each its own
                   share, in the plan's pattern (bench/mton_patterns.py):
                   per (sender, receiver) flow the bytes of its pieces,
                   packed, in --msg_mib messages; round i of every flow in
                   one ncclGroupStart/End (torch.distributed.batch_isend_irecv).

--wire scales each pattern's bytes: dense (bf16), fp8 (0.5: one byte per
element; block scales are 1/4096 of that and ignored), sparse (0.009: 0.3%
of elements as int32 index + bf16 value). Each figure: the median over
--reps of the slowest rank's wall time (a barrier, then the calls, then
cudaDeviceSynchronize), after one warm-up. After timing, every flow's bytes
are checked on the receiver (int16 sums against the sender's).

    python3 bench/mton_nccl_bench.py --out DIR [--model qwen3-8b] [--reps 5]

prints a table last and writes DIR/mton_raw.json (and each rank's log).
Needs 4 GPUs; each worker exits with os._exit (no process-group teardown,
which hung twice on this machine: ../shared/DEVICE.md); each is bounded by
--timeout_s, and the launcher kills the rest when one fails.
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mton_patterns as mp  # noqa: E402

WIRE = {"dense": 1.0, "fp8": 0.5, "sparse": 0.009}
WORLD = 4


def entries(cfg, wires, cases, layouts):
    """[(name, kind, {(src, dst): bytes}, wire)]: what to time, in order.
    kind: "bcast" (src broadcasts to the dsts of its flows, the same
    bytes) or "p2p"."""
    total = sum(b for *_x, b in mp.pieces(cfg, "replicas", "tp2"))  # one model's bytes
    out = []
    for w in wires:
        f = WIRE[w]

        def scaled(fl):
            return {k: int(v * f) // 2 * 2 for k, v in fl.items()}

        out.append((f"bcast_1s_1r/{w}", "bcast", scaled({(0, 2): total}), w))
        out.append((f"bcast_1s_2r/{w}", "bcast", scaled({(0, 2): total, (0, 3): total}), w))
        for layout in layouts:
            need = mp.needs(cfg, layout)
            one = {(0, g): sum(r[2] * r[4] * 2 for r in need[g]) for g in mp.RECEIVERS}
            out.append((f"p2p_1s_{layout}/{w}", "p2p", scaled(one), w))
            for case in cases:
                fl = mp.flows(mp.pieces(cfg, case, layout))
                out.append((f"p2p_2s_{case}_{layout}/{w}", "p2p", scaled(fl), w))
    return out


# --------------------------------------------------------------------------
# Worker (one per GPU)
# --------------------------------------------------------------------------

def worker(args):
    import torch
    import torch.distributed as dist

    rank = int(os.environ["MTON_RANK"])
    dev = torch.device("cuda", rank)
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", init_method=f"file://{args.rendezvous}", rank=rank,
                            world_size=WORLD, device_id=dev)
    groups = {(0, 2): dist.new_group([0, 2]), (0, 2, 3): dist.new_group([0, 2, 3])}
    cfg = mp.MODELS[args.model]
    msg = args.msg_mib << 20
    results = {}
    sums = {}

    def sync_all():
        t = torch.zeros(1, device=dev)
        dist.all_reduce(t)
        torch.cuda.synchronize()

    for name, kind, fl, wire in entries(cfg, args.wire, args.cases, args.layouts):
        mine_out = [(k, v) for k, v in sorted(fl.items()) if k[0] == rank]
        mine_in = [(k, v) for k, v in sorted(fl.items()) if k[1] == rank]
        if kind == "bcast":
            # One buffer, the same bytes to every destination.
            nbytes = max(fl.values())
            dsts = tuple(sorted(d for _s, d in fl))
            group = groups[(0,) + dsts]
            member = rank == 0 or rank in dsts
            buf = torch.empty(nbytes if member else 2, dtype=torch.uint8, device=dev)
            if rank == 0:
                buf.random_()

            def run():
                if not member:
                    return
                works = [dist.broadcast(buf[o:o + msg], src=0, group=group, async_op=True)
                         for o in range(0, nbytes, msg)]
                for w in works:
                    w.wait()
        else:
            out_off, o = {}, 0
            for k, v in mine_out:
                out_off[k], o = o, o + v
            src = torch.empty(max(o, 2), dtype=torch.uint8, device=dev)
            src.random_()
            in_off, o = {}, 0
            for k, v in mine_in:
                in_off[k], o = o, o + v
            dst = torch.empty(max(o, 2), dtype=torch.uint8, device=dev)
            rounds = max([(v + msg - 1) // msg for v in fl.values()] + [0])

            def run():
                works = []
                for i in range(rounds):
                    ops = []
                    for (s, d), v in sorted(fl.items()):
                        lo = i * msg
                        if lo >= v:
                            continue
                        n = min(msg, v - lo)
                        if s == rank:
                            b = out_off[(s, d)] + lo
                            ops.append(dist.P2POp(dist.isend, src[b:b + n], d))
                        elif d == rank:
                            b = in_off[(s, d)] + lo
                            ops.append(dist.P2POp(dist.irecv, dst[b:b + n], s))
                    if ops:
                        works += dist.batch_isend_irecv(ops)
                for w in works:
                    w.wait()

        times = []
        for rep in range(args.reps + 1):
            sync_all()
            t0 = time.perf_counter()
            run()
            torch.cuda.synchronize()
            dt = torch.tensor([time.perf_counter() - t0], device=dev, dtype=torch.float64)
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)
            if rep:
                times.append(dt.item())
        times.sort()
        moved = sum(fl.values())
        results[name] = {"kind": kind, "wire": wire, "s_median": times[len(times) // 2],
                         "s_all": times, "bytes_total": moved,
                         "flows": {f"{s}->{d}": v for (s, d), v in sorted(fl.items())}}
        # Checksums of every flow, on both ends.
        s = {}
        if kind == "bcast":
            if rank == 0 or rank in [d for _s, d in fl]:
                s["all"] = int(buf.view(torch.int16).sum(dtype=torch.int64).item())
        else:
            for k, v in mine_out:
                b = out_off[k]
                s[f"{k[0]}->{k[1]}"] = int(src[b:b + v].view(torch.int16)
                                          .sum(dtype=torch.int64).item())
            for k, v in mine_in:
                b = in_off[k]
                s[f"{k[0]}->{k[1]}"] = int(dst[b:b + v].view(torch.int16)
                                          .sum(dtype=torch.int64).item())
        sums[name] = s
        buf = src = dst = None  # noqa: F841
        torch.cuda.empty_cache()
        if rank == 0:
            print(f"{name:34s} {results[name]['s_median'] * 1e3:9.2f} ms "
                  f"{moved / results[name]['s_median'] / 1e9:8.1f} GB/s", flush=True)
    with open(os.path.join(args.out, f"mton_raw.rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "results": results, "sums": sums}, f)
    sys.stdout.flush()
    os._exit(0)


# --------------------------------------------------------------------------
# Launcher
# --------------------------------------------------------------------------

def check_sums(docs):
    """[problem] where a receiver's sum differs from its sender's."""
    bad = []
    for name in docs[0]["sums"]:
        per = [d["sums"].get(name, {}) for d in docs]
        keys = set().union(*per)
        for k in keys:
            vals = {d["rank"]: d["sums"][name][k] for d in docs if k in d["sums"].get(name, {})}
            if len(set(vals.values())) != 1:
                bad.append(f"{name} {k}: {vals}")
    return bad


def launch(args):
    os.makedirs(args.out, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix="mton-")
    rdv = os.path.join(tmp, "rendezvous")
    procs = []
    env0 = dict(os.environ, NCCL_NVLS_ENABLE="0", PYTHONUNBUFFERED="1")
    for r in range(WORLD):
        env = dict(env0, MTON_RANK=str(r))
        cmd = ["timeout", "-k", "5", str(args.timeout_s), sys.executable, __file__,
               "--worker", "--rendezvous", rdv, "--out", args.out, "--model", args.model,
               "--reps", str(args.reps), "--msg_mib", str(args.msg_mib),
               "--wire", *args.wire, "--cases", *args.cases, "--layouts", *args.layouts]
        log = open(os.path.join(args.out, f"mton_raw.rank{r}.log"), "w")
        procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                      start_new_session=True))
    rcs = [None] * WORLD
    while any(rc is None for rc in rcs):
        for i, p in enumerate(procs):
            if rcs[i] is None:
                rcs[i] = p.poll()
        if any(rc not in (None, 0) for rc in rcs):
            for i, p in enumerate(procs):
                if rcs[i] is None:
                    os.killpg(p.pid, signal.SIGKILL)
                    rcs[i] = p.wait()
            break
        time.sleep(0.2)
    if any(rcs):
        print(f"FAILED: ranks' exit codes {rcs} (124 = timeout); logs in {args.out}")
        for r in range(WORLD):
            with open(os.path.join(args.out, f"mton_raw.rank{r}.log")) as f:
                print(f"--- rank {r}:", "".join(f.readlines()[-15:]))
        return 1
    docs = [json.load(open(os.path.join(args.out, f"mton_raw.rank{r}.json")))
            for r in range(WORLD)]
    bad = check_sums(docs)
    res = docs[0]["results"]
    doc = {"model": args.model, "msg_mib": args.msg_mib, "reps": args.reps,
           "nccl_env": {k: v for k, v in os.environ.items() if k.startswith("NCCL_")},
           "verified": not bad, "mismatches": bad[:20], "results": res}
    with open(os.path.join(args.out, "mton_raw.json"), "w") as f:
        json.dump(doc, f, indent=1)
    base = {w: res.get(f"bcast_1s_1r/{w}", {}).get("s_median") for w in args.wire}
    print(f"=== raw NCCL, {args.model}, {args.msg_mib} MiB messages, median of {args.reps} "
          f"(verified: {'yes' if not bad else 'NO'}) ===")
    print(f"{'pattern':34s} {'bytes':>9s} {'time':>10s} {'GB/s':>7s} {'vs bcast_1s_1r':>14s}")
    for name, r in res.items():
        b = base.get(r["wire"])
        print(f"{name:34s} {r['bytes_total'] / 1e9:7.2f}GB {r['s_median'] * 1e3:8.2f}ms "
              f"{r['bytes_total'] / r['s_median'] / 1e9:7.1f} "
              f"{(b / r['s_median']) if b else float('nan'):13.2f}x")
    return 0 if not bad else 1


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="qwen3-8b", choices=sorted(mp.MODELS))
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--msg_mib", type=int, default=1024)
    ap.add_argument("--wire", nargs="+", default=["dense"], choices=sorted(WIRE))
    ap.add_argument("--cases", nargs="+", default=list(mp.CASES), choices=mp.CASES)
    ap.add_argument("--layouts", nargs="+", default=list(mp.LAYOUTS), choices=mp.LAYOUTS)
    ap.add_argument("--timeout_s", type=int, default=240)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--rendezvous", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
    sys.exit(launch(args))


if __name__ == "__main__":
    main()

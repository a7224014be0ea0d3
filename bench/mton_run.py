#!/usr/bin/env python3
"""Issue 32's 4-GPU proof at the GPU worker's level: every case and engine
layout through weightsync_gpu_worker, against today's broadcast and the
raw NCCL baseline of the same bytes (bench/mton_nccl_bench.py, run by
bench/run_mton.sh in the same call).

For each configuration: writes the plan (bench/mton_plan.py), starts the
four ranks of bench/mton_worker_bench (trainer ranks 0, 1 on GPUs 0, 1;
engine GPUs 2, 3, each with its own weightsync_gpu_worker), each bounded
by `timeout`, kills the rest if one fails, and reads their JSON. An
update's time is the slowest rank's (they start at one barrier); the
figure is the median over --reps timed versions after a warm-up; every
version (the warm-up too) is checked element by element on both engine
GPUs.

    python3 bench/mton_run.py --bin .dev/bin --out DIR [--model qwen3-8b]
        [--raw DIR/mton_raw.json]

prints a table last and writes DIR/mton_worker.json.
"""

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import mton_patterns as mp  # noqa: E402
import mton_plan  # noqa: E402

MiB = 1 << 20


def configs(cases, layouts):
    """[(name, case, layout, mode)]: today's broadcast, one sender by
    send/recv, then two senders, per layout."""
    out = []
    for layout in layouts:
        out.append((f"bcast_1s_{layout}", "one", layout, "bcast"))
        out.append((f"p2p_1s_{layout}", "one", layout, "p2p"))
        for case in cases:
            out.append((f"p2p_2s_{case}_{layout}", case, layout, "p2p"))
    return out


FAULTS = ("kill_start", "kill_mid", "kill_end", "freeze_start", "freeze_mid", "freeze_end")


def run_one(args, name, case, layout, mode, work, extra=()):
    cfg = mp.MODELS[args.model]
    plan_path = os.path.join(work, f"{name}.plan")
    lines = mton_plan.plan(cfg, case, layout, mode, args.chunk_mib * MiB, 0,
                           args.planner if mode == "p2p" else "bench")
    with open(plan_path, "w") as f:
        f.write("\n".join(lines) + "\n")
    sync = tempfile.mkdtemp(prefix="sync-", dir=work)
    procs, outs = [], []
    env = dict(os.environ, NCCL_NVLS_ENABLE="0")
    for r in range(4):
        out = os.path.join(work, f"{name}.rank{r}.json")
        outs.append(out)
        log = open(os.path.join(work, f"{name}.rank{r}.log"), "w")
        cmd = ["timeout", "-k", "5", str(args.timeout_s + 10),
               os.path.join(args.bin, "mton_worker_bench"), f"--rank={r}",
               f"--plan={plan_path}", f"--sync_dir={sync}", f"--out={out}",
               f"--worker={os.path.join(args.bin, 'weightsync_gpu_worker')}",
               f"--reps={args.reps}", f"--timeout_s={args.timeout_s}",
               f"--staging_buffers={args.staging_buffers}", *extra]
        procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                      start_new_session=True))
    rcs = [None] * 4
    t_start = time.time()
    while any(rc is None for rc in rcs):
        for i, p in enumerate(procs):
            if rcs[i] is None:
                rcs[i] = p.poll()
        if extra and all(rc is not None for i, rc in enumerate(rcs) if i != args.fault_rank):
            # A fault run: every other rank has ended; the failed sender is
            # killed (or was), a frozen one is stopped for good.
            p = procs[args.fault_rank]
            if rcs[args.fault_rank] is None:
                os.killpg(p.pid, signal.SIGKILL)
                rcs[args.fault_rank] = p.wait()
            break
        if extra and time.time() - t_start > args.timeout_s:
            for i, p in enumerate(procs):
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
                rcs[i] = p.wait()
            return {"name": name, "ok": False, "rcs": rcs, "error": ["hung past the bound"]}
        if not extra and any(rc not in (None, 0) for rc in rcs):
            time.sleep(1.0)  # let the others say why, then stop them
            for i, p in enumerate(procs):
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
                rcs[i] = p.wait()
            break
        time.sleep(0.05)
    shutil.rmtree(sync, ignore_errors=True)
    if extra:
        docs = {}
        for r, o in enumerate(outs):
            if os.path.exists(o):
                docs[r] = json.load(open(o))
        return {"name": name, "ok": True, "rcs": rcs, "seconds": time.time() - t_start,
                "ranks": docs}
    if any(rcs):
        tails = []
        for r in range(4):
            with open(os.path.join(work, f"{name}.rank{r}.log")) as f:
                tails.append(f"rank {r} rc {rcs[r]}: " + " | ".join(f.read().splitlines()[-4:]))
        return {"name": name, "ok": False, "rcs": rcs, "error": tails}
    docs = [json.load(open(o)) for o in outs]
    reps = len(docs[0]["reps"])
    walls = [max(d["reps"][i]["wall_s"] for d in docs) for i in range(reps)]
    timed = sorted(walls[1:])
    bad = [sum(d["reps"][i]["bad"] for d in docs[2:]) for i in range(reps)]
    dev = sorted(max(d["reps"][i]["device_s"] for d in docs[2:]) for i in range(1, reps))
    return {"name": name, "ok": True, "case": case, "layout": layout, "mode": mode,
            "s_median": timed[len(timed) // 2], "s_all": walls,
            "device_s_median": dev[len(dev) // 2],
            "versions": reps, "mismatches_per_version": bad, "bit_exact": not any(bad),
            "received_bytes": [d.get("received_bytes") for d in docs[2:]],
            "chunks": [d.get("chunks") for d in docs[2:]],
            "sent_bytes": [d.get("sent_bytes") for d in docs[:2]],
            "sent_in_place_bytes": [d.get("sent_in_place_bytes") for d in docs[:2]]}


def faults(args, work):
    """Sender rank 1 killed or frozen at the start, middle or end of the
    second version (the first is a clean warm-up), two senders (rows ->
    tp2). Every other rank must end within its bound, the receivers'
    workers through ncclCommAbort (AbortUpdate), no process left behind."""
    out, ok = [], True
    for fault in FAULTS:
        extra = (f"--fault={fault}", "--fault_rank=1", "--fault_version=1",
                 f"--wait_s={args.wait_s}")
        saved = args.reps
        args.reps = 1
        r = run_one(args, f"fault_{fault}", "rows", "tp2", "p2p", work, extra)
        args.reps = saved
        out.append(dict(r, fault=fault))
        recv = [r.get("ranks", {}).get(g, {}) for g in (2, 3)]
        good = r["ok"] and all(x.get("worker_alive") for x in recv) and \
            all("outcome" in x for x in recv) and "outcome" in r.get("ranks", {}).get(0, {})
        ok = ok and good
        line = f"{fault:13s} {'ok' if good else 'FAILED'} {r.get('seconds', 0):5.1f} s: " + \
            "; ".join(f"rank {g}: {x.get('outcome')} after {x.get('waited_s', 0):.2f} s"
                      f" (abort {x.get('abort_s', 0):.2f} s, worker alive {x.get('worker_alive')},"
                      f" elements not new {x.get('elements_not_new')})"
                      for g, x in zip((2, 3), recv)) + \
            f"; sender 0: {r.get('ranks', {}).get(0, {}).get('outcome')}"
        print(line, flush=True)
    with open(os.path.join(args.out, "mton_faults.json"), "w") as f:
        json.dump({"model": args.model, "wait_s": args.wait_s, "faults": out}, f, indent=1)
    return 0 if ok else 1


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bin", required=True, help="mton_worker_bench and weightsync_gpu_worker")
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="qwen3-8b", choices=sorted(mp.MODELS))
    ap.add_argument("--cases", nargs="+", default=list(mp.CASES), choices=mp.CASES)
    ap.add_argument("--layouts", nargs="+", default=list(mp.LAYOUTS), choices=mp.LAYOUTS)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--chunk_mib", type=int, default=256)
    ap.add_argument("--staging_buffers", type=int, default=4)
    ap.add_argument("--timeout_s", type=int, default=120)
    ap.add_argument("--raw", help="mton_raw.json of the same run (the baseline)")
    ap.add_argument("--label", default="")
    ap.add_argument("--planner", default="transfer_plan", choices=("bench", "transfer_plan"),
                    help="who cuts the links into chunks (bench/mton_plan.py); the "
                         "2026-11-28 run (b88a5b1) used bench")
    ap.add_argument("--faults", action="store_true",
                    help="the two-sender faults (rows -> tp2) instead of the table")
    ap.add_argument("--wait_s", type=float, default=3.0)
    ap.add_argument("--fault_rank", type=int, default=1, help=argparse.SUPPRESS)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    work = os.path.join(args.out, "work")
    os.makedirs(work, exist_ok=True)
    args.bin = os.path.abspath(args.bin)
    if args.faults:
        sys.exit(faults(args, work))
    results = []
    for name, case, layout, mode in configs(args.cases, args.layouts):
        t = time.time()
        r = run_one(args, name, case, layout, mode, work)
        results.append(r)
        print(f"{name:28s} " + (f"{r['s_median'] * 1e3:8.2f} ms  bit-exact {r['bit_exact']}"
                                if r["ok"] else f"FAILED {r['error']}")
              + f"  ({time.time() - t:.1f} s)", flush=True)
    raw = {}
    if args.raw and os.path.exists(args.raw):
        raw = json.load(open(args.raw))["results"]
    doc = {"model": args.model, "chunk_mib": args.chunk_mib, "reps": args.reps,
           "planner": args.planner,
           "staging_buffers": args.staging_buffers, "label": args.label,
           "nccl_env": {k: v for k, v in os.environ.items() if k.startswith("NCCL_")},
           "results": results}
    with open(os.path.join(args.out, "mton_worker.json"), "w") as f:
        json.dump(doc, f, indent=1)
    by = {r["name"]: r for r in results if r["ok"]}
    print(f"=== weightsync worker M->N, {args.model}, {args.chunk_mib} MiB chunks, median of "
          f"{args.reps} {args.label} ===")
    print(f"{'pattern':28s} {'weightsync':>10s} {'raw':>9s} {'vs raw':>7s} "
          f"{'vs bcast':>8s} {'bit-exact':>9s}")
    ok = True
    for r in results:
        if not r["ok"]:
            ok = False
            print(f"{r['name']:28s} FAILED")
            continue
        rawname = r["name"] + "/dense"
        if r["mode"] == "bcast":
            rawname = "bcast_1s_2r/dense"
        rw = raw.get(rawname, {}).get("s_median")
        base = by.get(f"bcast_1s_{r['layout']}", {}).get("s_median")
        ok = ok and r["bit_exact"]
        print(f"{r['name']:28s} {r['s_median'] * 1e3:8.2f}ms "
              + (f"{rw * 1e3:7.2f}ms {rw / r['s_median']:7.3f}" if rw else f"{'':9s} {'':7s}")
              + (f" {base / r['s_median']:7.2f}x" if base else f" {'':8s}")
              + f" {str(r['bit_exact']):>9s}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()

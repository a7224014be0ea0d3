#!/usr/bin/env python3
"""Many senders on the host backend, dense, sparse and into FP8 engines
(issue 32), against one sender in the same run: `update()` on rank 0 from
call to return, the real daemon over its Unix socket, engines in their own
process, receipts on (the default).

    WEIGHTSYNCD=bazel-bin/daemon/weightsyncd python3 bench/mton_host_bench.py \\
        [--updates 3] [--json bench/results/mton_host.json]

A Qwen-shaped model (hidden 1024, 4 layers, vocab 8192: 256 MB in
float32) into a TP=2 engine pair, first bfloat16, then FP8 (e4m3, 128 x
128 block scales). Rows: one sender (Trainer.update) dense; two ranks of
FSDP row shards (ManySenders, threads of this process, each with its own
Trainer) dense; the same two ranks with 0.3% of the elements changed per
version, each piece that changed little sent as a sparse patch against
the version before (and the same with receipts off, to show what they
cost: they stay whole, each rank summing its pieces' new values); into
the FP8 pair the sparse rows patch only what feeds no FP8 target (norms,
embeddings; the daemon refuses a patch into an FP8-fed tensor, whose
blocks' scales would go stale), the linear weights going dense, and one
sender and two ranks send with fp8_on_wire=True (the trainer quantises in
numpy, a byte an element travels), also sparse. Each row: the median of --updates updates, its ratio
to the one-sender row of the same engines, the bytes the ranks put on the
wire against dense, and the bytes the daemon took in (daemon_bytes).

The host backend's ranks here share one machine's cores with the daemon
and the engines (and one Python process: numpy and gRPC release the GIL,
packing does not), so two ranks are not two machines' links: the row says
what the protocol costs and what the sparse path saves, not the speed of
a cluster.
"""

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
CLIENT = os.path.join(HERE, "..", "client", "python")
sys.path.insert(0, CLIENT)
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

import numpy as np  # noqa: E402

import weightsync  # noqa: E402
from weightsync import layouts  # noqa: E402
from weightsync.senders.many import ManySenders  # noqa: E402
from fp8_host_test import ENGINES  # noqa: E402
from mton_fp8_host_test import ThreadCollective, run_ranks  # noqa: E402
from mton_sparse_host_test import local_of  # noqa: E402

CONFIG = dict(model_type="qwen3", vocab_size=8192, hidden_size=1024, num_attention_heads=16,
              num_key_value_heads=8, head_dim=64, num_hidden_layers=4,
              intermediate_size=2816, tie_word_embeddings=False)
RANKS = 2
DENSITY = 0.003


def checkpoints(n):
    """n versions: random, then DENSITY of each tensor's elements changed
    per version."""
    rng = np.random.default_rng(11)
    ck = {name: rng.standard_normal(shape).astype(np.float32)
          for name, shape in layouts.checkpoint_shapes(CONFIG)}
    out = [ck]
    for _ in range(n - 1):
        ck = {k: a.copy() for k, a in ck.items()}
        for a in ck.values():
            flat = a.reshape(-1)
            at = rng.choice(flat.size, max(1, int(flat.size * DENSITY)), replace=False)
            flat[at] += 1e-3
        out.append(ck)
    return out


class Daemon:
    def __init__(self, work):
        self.work = work
        sock = os.path.join(work, "d.sock")
        self.proc = subprocess.Popen([os.environ["WEIGHTSYNCD"], f"--socket={sock}"],
                                     stderr=open(os.path.join(work, "daemon.log"), "w"))
        for _ in range(300):
            if os.path.exists(sock):
                break
            time.sleep(0.02)
        self.target = "unix:" + sock
        self.engines = None

    def engines_up(self, specs):
        """Starts an engine process holding `specs`; stops the last one."""
        self.engines_down()
        path = os.path.join(self.work, "engines.json")
        with open(path, "w") as f:
            json.dump(specs, f)
        self.engines = subprocess.Popen(
            [sys.executable, "-c", ENGINES.format(client=CLIENT), self.target, path],
            stdout=subprocess.PIPE, stderr=open(os.path.join(self.work, "engines.log"), "a"),
            text=True)
        line = self.engines.stdout.readline()
        assert line.startswith("ready"), line
        self.shm = json.loads(line.split(" ", 1)[1])
        probe = weightsync.Trainer(self.target, timeout=30)
        for _ in range(300):
            up = {s.engine_id for s in probe.status().engines if s.connected}
            if up >= set(self.shm):
                break
            time.sleep(0.02)
        probe.close()

    def engines_down(self):
        if self.engines is None:
            return
        self.engines.terminate()
        self.engines.wait(30)
        self.engines.stdout.close()
        for name in self.shm.values():
            try:
                os.unlink("/dev/shm/" + name)
            except FileNotFoundError:
                pass
        self.engines = None

    def close(self):
        self.engines_down()
        self.proc.terminate()
        self.proc.wait(30)


# The bytes the daemon took in, per update of the last row (its committed
# FinishWeightUpdateResponse.bytes).
LAST_BYTES = []


def one_sender(target, cks, first_version, wire=False):
    """Seconds of each Trainer.update of cks, versions from first_version
    (wire: fp8_on_wire=True)."""
    t = weightsync.Trainer(target, timeout=120)
    LAST_BYTES.clear()
    try:
        t.init_host()
        out = []
        for k, ck in enumerate(cks):
            t0 = time.perf_counter()
            got = t.update(list(ck.items()), version=first_version + k, fp8_on_wire=wire)
            out.append(time.perf_counter() - t0)
            LAST_BYTES.append(got.bytes)
        return out
    finally:
        t.close()


def many_senders(target, cks, first_version, sparse, verify=True, wire=False):
    """(seconds of rank 0's updates, [wire figures per update]) of RANKS
    rank threads; with `sparse` every update after the first patches
    the one before; `wire`: fp8_on_wire=True."""
    room = {"n": RANKS, "slots": [None] * RANKS, "barrier": threading.Barrier(RANKS, timeout=300)}
    times, phases, wires, errors = [], [], [[] for _ in range(RANKS)], []
    LAST_BYTES.clear()

    def rank_main(r):
        trainer = weightsync.Trainer(target, timeout=120)
        try:
            if r == 0:
                trainer.init_host()
            s = ManySenders(trainer._link, ThreadCollective(room, r),
                            basis_bytes=None if sparse else 0, fp8_on_wire=wire)
            for k, ck in enumerate(cks):
                v = first_version + k
                base = v - 1 if sparse and k > 0 else None
                local = local_of(r, ck)
                t0 = time.perf_counter()
                got = s.update(MANIFEST, local, v, base_version=base, max_density=0.05,
                               verify=verify)
                if r == 0:
                    times.append(time.perf_counter() - t0)
                    LAST_BYTES.append(sum(c.bytes for c in got))
                    phases.append(dict(s.last_timings))
                wires[r].append(dict(s.last_wire))
        except BaseException as e:  # noqa: BLE001 - raised below
            errors.append(e)
        finally:
            trainer.close()
    run_ranks(RANKS, rank_main, timeout=900)
    if errors:
        raise errors[0]
    per_update = [{key: sum(w[k][key] for w in wires) for key in wires[0][k]}
                  for k in range(len(cks))]
    for k, p in enumerate(phases):
        per_update[k]["phases"] = p
    return times, per_update


MANIFEST = [{"name": n, "dtype": "FLOAT32", "shape": list(s)}
            for n, s in layouts.checkpoint_shapes(CONFIG)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--updates", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args()
    n = args.updates
    cks = checkpoints(n + 1)
    mb = sum(a.nbytes for a in cks[0].values()) / 1e6
    work = tempfile.mkdtemp(prefix="ws-mton-bench.", dir="/tmp")
    d = Daemon(work)
    rows, version = [], 0
    try:
        bf16 = [(f"tp{r}",) + tuple(layouts.llama_engine_layout(CONFIG, r, 2)) + ({},)
                for r in range(2)]
        fp8 = [(f"tp{r}",) + tuple(layouts.llama_fp8_engine_layout(CONFIG, r, 2))
               for r in range(2)]
        for engines, specs in (("bf16 TP=2", bf16), ("fp8 e4m3 128x128 TP=2", fp8)):
            d.engines_up(specs)
            base = None
            for row in ("one sender", "2 ranks dense", "2 ranks sparse 0.3%",
                        "2 ranks sparse 0.3%, receipts off", "one sender, fp8_on_wire",
                        "2 ranks, fp8_on_wire", "2 ranks sparse 0.3%, fp8_on_wire"):
                on_wire = "fp8_on_wire" in row
                if on_wire and "fp8" not in engines:
                    continue   # nothing to quantise
                if row.startswith("one sender"):
                    times, wire = one_sender(d.target, cks[:n], version + 1, on_wire), None
                elif "sparse" not in row:
                    times, wire = many_senders(d.target, cks[:n], version + 1, False,
                                               wire=on_wire)
                else:
                    # The first update of the row (dense) is its basis, not
                    # timed. Into FP8 engines only what feeds no FP8 target
                    # goes as a patch (norms, embeddings); the linear
                    # weights go dense, quantised with fp8_on_wire.
                    times, wire = many_senders(d.target, cks[:n + 1], version + 1, True,
                                               verify="off" not in row, wire=on_wire)
                    times, wire = times[1:], wire[1:]
                    version += 1
                version += n
                med = statistics.median(times)
                if base is None:
                    base = med
                r = {"engines": engines, "row": row, "median_s": round(med, 4),
                     "times_s": [round(t, 4) for t in times], "vs_one_sender": round(base / med, 3),
                     "daemon_bytes": LAST_BYTES[-1]}
                if wire:
                    r["wire_vs_dense"] = round(
                        statistics.median(w["wire_bytes"] / w["dense_bytes"] for w in wire), 4)
                    r["patched_pieces"] = wire[-1]["patched_pieces"]
                    # rank 0's phases (weightsync.senders.many.ManySenders.last_timings)
                    r["phases_s"] = {k: round(statistics.median(w["phases"][k] for w in wire), 4)
                                     for k in wire[0]["phases"]}
                rows.append(r)
                print(json.dumps(r), flush=True)
    finally:
        d.close()
        shutil.rmtree(work, ignore_errors=True)
    result = {"bench": "mton_host_bench", "model_mb_float32": round(mb, 1), "ranks": RANKS,
              "updates_per_row": n, "density": DENSITY, "machine": platform.node(),
              "cpus": os.cpu_count(), "date": time.strftime("%Y-%m-%d"),
              "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE,
                                       capture_output=True, text=True).stdout.strip(),
              "rows": rows}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Update latency under concurrent readers (issue 35), host backend, the real
daemon over its Unix socket: one engine process (host shared memory), one
trainer process sending dense updates with receipts on (the default), and a
reader process of N threads that each loop CheckEngine + GetStatus + health
as fast as the daemon answers. For N in 0 (the unloaded baseline of the
same run) and the given counts: the updates' median / p90 seconds, the
ratio to the baseline, what the readers got (OK / refused), and the daemon's
threads and RSS before, at peak and after.

    WEIGHTSYNCD=bazel-bin/daemon/weightsyncd python3 bench/load_bench.py \\
        [--mib 64] [--updates 8] [--readers 8,64,256] [--load readers,...] \\
        [--json bench/results/load.json]

Each row also says where the CPU went: the cores each process (daemon,
engine, trainer, the load) used over the row's updates. --load picks what
runs beside the updates (several: one row each, then an unloaded row
again): the readers above; cheap_readers (GetStatus + health only, no
engine reads); idle_readers (the reader process at SCHED_IDLE); burn (one
busy-loop process, no calls); idle_burn (the same at SCHED_IDLE).

The readers run in one Python process (so at most about one core of client
CPU whatever N is); the trainer in another. On a 2-core machine the three
processes and the daemon share both cores: say so with the figures.
"""

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
CLIENT = os.path.join(HERE, "..", "client", "python")

ENGINE = r"""
import sys, time
sys.path.insert(0, {client!r})
import weightsync
e = weightsync.Engine("e0", sys.argv[1], timeout=30)
e.register_host([(n, "FLOAT32", s) for n, s in {params!r}])
e.start()
print("ready", flush=True)
while True:
    time.sleep(1)
"""

TRAINER = r"""
import sys, time
sys.path.insert(0, {client!r})
import numpy as np, weightsync
target, first, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
t = weightsync.Trainer(target, timeout=60)
t.init_host()
rng = np.random.default_rng(first)
tensors = [(n, rng.standard_normal(s).astype(np.float32)) for n, s in {params!r}]
print("ready", flush=True)
sys.stdin.readline()
c0 = time.process_time()
for v in range(first, first + count):
    t0 = time.perf_counter()
    t.update(tensors, v)
    print("update", time.perf_counter() - t0, flush=True)
print("done", time.process_time() - c0, flush=True)
"""

READERS = r"""
import sys, threading, time
sys.path.insert(0, {client!r})
import grpc
from weightsync._proto import v1
target, n, cheap = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "cheap"
stop = threading.Event()
counts = {{"ok": 0, "refused": 0, "other": 0}}
others = {{}}
lock = threading.Lock()
def reader():
    ch = grpc.insecure_channel(target)
    check = ch.unary_unary("/weightsync.v1.TrainerService/CheckEngine",
                           request_serializer=v1.CheckEngineRequest.SerializeToString,
                           response_deserializer=v1.CheckEngineResponse.FromString)
    status = ch.unary_unary("/weightsync.v1.TrainerService/GetStatus",
                            request_serializer=v1.GetStatusRequest.SerializeToString,
                            response_deserializer=v1.GetStatusResponse.FromString)
    health = ch.unary_unary("/grpc.health.v1.Health/Check",
                            request_serializer=lambda x: x, response_deserializer=lambda r: r)
    calls = [lambda: check(v1.CheckEngineRequest(engine_id="e0"), timeout=30),
             lambda: status(v1.GetStatusRequest(), timeout=30),
             lambda: health(b"", timeout=30)]
    if cheap:  # no whole-engine reads: GetStatus + health only
        calls = calls[1:]
    i = 0
    while not stop.is_set():
        try:
            calls[i % len(calls)]()
            k = "ok"
        except grpc.RpcError as e:
            k = "refused" if e.code() in (grpc.StatusCode.RESOURCE_EXHAUSTED,
                                          grpc.StatusCode.FAILED_PRECONDITION) else "other"
            if k == "other":
                others[e.code().name] = others.get(e.code().name, 0) + 1
        i += 1
        with lock:
            counts[k] += 1
threads = [threading.Thread(target=reader, daemon=True) for _ in range(n)]
for t in threads:
    t.start()
print("ready", flush=True)
sys.stdin.readline()
stop.set()
print("counts", counts["ok"], counts["refused"], counts["other"], others, flush=True)
"""


def params_for(mib):
    """float32 tensors totalling `mib` MiB, a few shapes."""
    rows = mib * (1 << 20) // 4 // 1024 // 4
    return [(f"w{i}", (rows, 1024)) for i in range(4)]


def proc_stats(pid):
    with open(f"/proc/{pid}/status") as f:
        text = f.read()
    threads = int(re.search(r"^Threads:\s+(\d+)", text, re.M).group(1))
    rss = int(re.search(r"^VmRSS:\s+(\d+)", text, re.M).group(1)) / 1024
    return threads, rss


class Sampler:
    """Peak threads and RSS (MiB) of `pid`, sampled every 20 ms."""

    def __init__(self, pid):
        self.pid, self.peak_threads, self.peak_rss = pid, 0, 0.0
        self.stop = threading.Event()
        self.t = threading.Thread(target=self.run, daemon=True)
        self.t.start()

    def run(self):
        while not self.stop.is_set():
            th, rss = proc_stats(self.pid)
            self.peak_threads, self.peak_rss = max(self.peak_threads, th), max(self.peak_rss, rss)
            time.sleep(0.02)

    def done(self):
        self.stop.set()
        self.t.join()


def spawn(script, *args, stdin=False, idle=False):
    def lower():
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    return subprocess.Popen([sys.executable, "-c", script, *args], stdout=subprocess.PIPE,
                            stdin=subprocess.PIPE if stdin else None, text=True,
                            preexec_fn=lower if idle else None)


def wait_line(p, prefix, timeout=60):
    end = time.time() + timeout
    while time.time() < end:
        line = p.stdout.readline()
        if not line:
            break
        if line.startswith(prefix):
            return line.split()
    raise RuntimeError(f"no '{prefix}' line")


def percentile(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


BURN = r"""
import sys
print("ready", flush=True)
x = 0
while True:
    x += 1
"""

LOADS = {"readers": "reader threads (CheckEngine + GetStatus + health) in one process",
         "cheap_readers": "reader threads calling only GetStatus + health (no engine reads)",
         "idle_readers": "the reader process at SCHED_IDLE (client CPU only from idle cores)",
         "burn": "no calls: one busy-loop process (one core the update can't use)",
         "idle_burn": "no calls: one busy-loop process at SCHED_IDLE (idle CPU only)"}


def cpu_s(pid):
    """User + system CPU seconds of `pid`, its exited threads included."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(target, daemon_pid, params, readers, updates, first_version, load="readers",
            engine_pid=None):
    """Runs `updates` updates with `readers` reader threads hammering (or,
    load "burn", one busy-loop process). Where the CPU went while they ran:
    cores each process used over the updates' wall time."""
    fmt = dict(client=CLIENT, params=params)
    trainer = spawn(TRAINER.format(**fmt), target, str(first_version), str(updates), stdin=True)
    wait_line(trainer, "ready")
    before = proc_stats(daemon_pid)
    sampler = Sampler(daemon_pid)
    rp = None
    if readers:
        idle = load.startswith("idle_")
        if load.endswith("burn"):
            rp = spawn(BURN, stdin=True, idle=idle)
        else:
            which = "cheap" if load == "cheap_readers" else "all"
            rp = spawn(READERS.format(**fmt), target, str(readers), which, stdin=True,
                       idle=idle)
        wait_line(rp, "ready")
        time.sleep(0.5)  # the readers get going
    pids = {"daemon": daemon_pid, "engine": engine_pid, "load": rp.pid if rp else None}
    c0 = {k: cpu_s(p) for k, p in pids.items() if p}
    t0 = time.perf_counter()
    trainer.stdin.write("go\n")
    trainer.stdin.flush()
    times = []
    for _ in range(updates):
        times.append(float(wait_line(trainer, "update", timeout=300)[1]))
    trainer_cpu = float(wait_line(trainer, "done")[1])
    wall = time.perf_counter() - t0
    cpu = {k: cpu_s(p) - c0[k] for k, p in pids.items() if p}
    cpu["trainer"] = trainer_cpu
    trainer.wait()
    got = None
    if rp is not None and load.endswith("burn"):
        rp.kill()
        rp.wait()
    elif rp is not None:
        rp.stdin.write("stop\n")
        rp.stdin.flush()
        words = wait_line(rp, "counts")
        got = {"ok": int(words[1]), "refused": int(words[2]), "other": int(words[3]),
               "other_codes": " ".join(words[4:])}
        rp.wait()
    sampler.done()
    time.sleep(1.0)  # idle handler threads wind down
    after = proc_stats(daemon_pid)
    # The first update of a fresh trainer pays its connection and warm-up.
    steady = times[1:] if len(times) > 2 else times
    return {"readers": readers, "load": load if readers else None, "updates": len(times),
            "seconds": [round(t, 4) for t in times],
            "median_s": round(percentile(steady, 0.5), 4),
            "p90_s": round(percentile(steady, 0.9), 4), "reader_calls": got,
            "cores_used": {k: round(v / wall, 2) for k, v in sorted(cpu.items())},
            "threads": {"before": before[0], "peak": sampler.peak_threads, "after": after[0]},
            "rss_mib": {"before": round(before[1], 1), "peak": round(sampler.peak_rss, 1),
                        "after": round(after[1], 1)}}


def start_daemon(work, extra=()):
    sock = os.path.join(work, "d.sock")
    log = open(os.path.join(work, "daemon.log"), "w")
    d = subprocess.Popen([os.environ["WEIGHTSYNCD"], f"--socket={sock}", *extra], stderr=log)
    for _ in range(400):
        if os.path.exists(sock):
            break
        time.sleep(0.025)
    return d, "unix:" + sock


def run(mib, updates, reader_counts, daemon_args=(), load="readers"):
    """Rows: unloaded, then each reader count under each load in `load`
    (a name of LOADS or a list of them); with several loads, one more
    unloaded row at the end (how much the machine's own load drifted)."""
    loads = [load] if isinstance(load, str) else list(load)
    plan = [(0, None)] + [(n, ld) for ld in loads for n in reader_counts]
    if len(loads) > 1:
        plan.append((0, None))
    work = tempfile.mkdtemp(prefix="ws-load-")
    os.chmod(work, 0o750)
    params = params_for(mib)
    daemon, target = start_daemon(work, daemon_args)
    engine = spawn(ENGINE.format(client=CLIENT, params=params), target)
    rows = []
    try:
        wait_line(engine, "ready")
        version = 1
        for n, ld in plan:
            rows.append(measure(target, daemon.pid, params, n, updates, version,
                                ld or "readers", engine.pid))
            version += updates
            base = rows[0]["median_s"]
            r = rows[-1]
            r["ratio_to_unloaded"] = round(r["median_s"] / base, 2)
            print(f"{ld or 'unloaded':>13} {n:4d}: median {r['median_s']:.3f} s p90 {r['p90_s']:.3f} s "
                  f"({r['ratio_to_unloaded']:.2f}x), threads {r['threads']}, "
                  f"RSS MiB {r['rss_mib']}, reader calls {r['reader_calls']}, "
                  f"cores used {r['cores_used']}", flush=True)
    finally:
        engine.kill()
        engine.wait()
        daemon.terminate()
        daemon.wait(20)
        shutil.rmtree(work, ignore_errors=True)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--updates", type=int, default=8)
    ap.add_argument("--readers", default="8,64,256")
    ap.add_argument("--load", default="readers",
                    help="what runs beside the updates in the rows past the first: "
                         "comma-separated, of " + ", ".join(sorted(LOADS)))
    ap.add_argument("--json")
    ap.add_argument("--note", default="")
    a = ap.parse_args()
    counts = [int(x) for x in a.readers.split(",") if x]
    loads = a.load.split(",")
    for ld in loads:
        if ld not in LOADS:
            ap.error(f"--load {ld}: not one of {', '.join(sorted(LOADS))}")
    rows = run(a.mib, a.updates, counts, load=loads)
    if a.json:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, cwd=HERE).stdout.strip()
        out = {"what": "host-backend update latency under N concurrent readers "
                       "(CheckEngine + GetStatus + health, one reader process), "
                       "Unix socket, receipts on; ratio against the unloaded baseline "
                       "of the same run; each row's load is one of 'loads'; cores_used: "
                       "CPU seconds of each process over the row's updates / their wall time",
               "loads": {ld: LOADS[ld] for ld in loads}, "engine_mib": a.mib, "updates_per_row": a.updates,
               "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "commit": commit,
               "machine": f"{platform.node()}: {os.cpu_count()} cores, {platform.machine()}",
               "note": a.note, "rows": rows}
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()

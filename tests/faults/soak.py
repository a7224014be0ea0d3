#!/usr/bin/env python3
"""Leak check on the host backend (issue 6): one daemon, two engine
processes, CYCLES verified updates (receipts on), and every 10th cycle a
trainer killed in mid-transfer (its update is failed and superseded by the
next Init). After every cycle the daemon's open file descriptors, threads
and resident memory are read from /proc; the slope (least squares over the
cycles after the first 50, which warm up allocators and caches) must be
about zero:

    WEIGHTSYNCD=bazel-bin/daemon/weightsyncd python3 tests/faults/soak.py [CYCLES=200] [--json OUT]

Limits: fds grow by less than 1 over the measured cycles (slope < 0.01
per cycle) and the median of the last 20 cycles is at most one above that
of the first 20 (a single sample may catch a connection still closing, and
gRPC grows its poller pool once under a burst, a thread and its
descriptor); threads the same (slope < 0.02), resident memory by less than
16 KiB per cycle. Prints the slopes and exits 1 if one is over.
"""

import json
import os
import shutil
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import faults as F  # noqa: E402
import weightsync  # noqa: E402


def proc_stats(pid):
    fds = len(os.listdir(f"/proc/{pid}/fd"))
    threads = rss = 0
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("Threads:"):
                threads = int(line.split()[1])
            elif line.startswith("VmRSS:"):
                rss = int(line.split()[1])  # KiB
    return fds, threads, rss


def slope(ys):
    n = len(ys)
    mx = (n - 1) / 2
    my = sum(ys) / n
    num = sum((i - mx) * (y - my) for i, y in enumerate(ys))
    den = sum((i - mx) ** 2 for i in range(n))
    return num / den if den else 0.0


def main():
    cycles = int(next((a for a in sys.argv[1:] if a.isdigit()), "200"))
    out = sys.argv[sys.argv.index("--json") + 1] if "--json" in sys.argv else None
    work = tempfile.mkdtemp(prefix="ws-soak.", dir="/tmp")
    sock = os.path.join(work, "d.sock")
    client = os.path.join(HERE, "..", "..", "client", "python")
    daemon = F.start_daemon(os.environ["WEIGHTSYNCD"], sock, os.path.join(work, "daemon.log"))
    procs = []
    try:
        target = "unix:" + sock
        for eid in ("e0", "e1"):
            procs.append(F.start_engine(eid, target, os.path.join(work, f"{eid}.log")))
        time.sleep(0.3)
        samples, faults, t0 = [], 0, time.time()
        version = 0
        for c in range(cycles):
            if c % 10 == 9:
                trainer = F.Proc([sys.executable, "-c", F.TRAINER.format(
                    client=client, params=F.PARAMS, chunk=F.CHUNK), target, "mid",
                    str(version + 1)],
                    os.path.join(work, "trainer.log"))
                trainer.wait_line("at")
                trainer.reap()  # SIGKILL mid-transfer
                faults += 1
                # Until the daemon sees the stream break (milliseconds; more
                # under ASan) the update is still receiving and a new Init
                # is refused: wait for that, as a restarted trainer would.
                stub = weightsync.Trainer(target, timeout=10)._stub
                end = time.time() + 10
                while (time.time() < end and
                       F.status(stub).update.phase == "receiving"):
                    time.sleep(0.01)
            t = weightsync.Trainer(target, timeout=10)
            t.init_host()  # supersedes a failed update
            version += 2
            r = t.update(F.weights(c), version=version, chunk_bytes=F.CHUNK, verify=True)
            t.close()
            if r.version != version or len([e for e in r.engines if not e.lost]) != 2:
                raise RuntimeError(f"cycle {c}: update v{version} -> {r}")
            samples.append(proc_stats(daemon.pid))
        elapsed = time.time() - t0
    finally:
        daemon_exit = F.stop_all(procs, daemon)
    warm = samples[50:] if len(samples) > 60 else samples
    names = ("fds", "threads", "rss_kib")
    result = {"cycles": cycles, "faults": faults, "seconds": round(elapsed, 1)}
    ok = True
    for i, name in enumerate(names):
        ys = [s[i] for s in warm]
        result[name] = {"first": samples[0][i], "warm": ys[0], "last": ys[-1],
                        "max": max(ys), "slope_per_cycle": round(slope(ys), 4)}
    # A sample can catch a connection that is still closing (one fd more):
    # compare the medians of the first and last 20 measured cycles. gRPC's
    # synchronous server grows its pool of poller threads by one when a
    # burst needs it (seen once in ~10 runs, 18 -> 19 mid-run, then flat):
    # threads may end one above where they started; a leak (a thread per
    # cycle, or per fault every 10 cycles: +15) is far beyond that. The new
    # poller brings its descriptor (2026-11-28 at aecb15e: threads 19 -> 20
    # and fds 11 -> 12 mid-run, then flat for the rest of 200 cycles; 3
    # reruns PASS), so fds may end one above too; their slope still catches
    # one leaked per fault (0.05 a cycle).
    for name, i, slack, max_slope in (("fds", 0, 1, 0.01), ("threads", 1, 1, 0.02)):
        ys = [s[i] for s in warm]
        head, tail = sorted(ys[:20]), sorted(ys[-20:])
        result[name]["median_first_20"] = head[len(head) // 2]
        result[name]["median_last_20"] = tail[len(tail) // 2]
        ok &= (result[name]["slope_per_cycle"] < max_slope and
               tail[len(tail) // 2] <= head[len(head) // 2] + slack)
    # Under AddressSanitizer freed memory sits in its quarantine, so resident
    # memory says nothing there (LeakSanitizer checks the daemon instead).
    result["rss_judged"] = "ASAN_OPTIONS" not in os.environ
    if result["rss_judged"]:
        ok &= result["rss_kib"]["slope_per_cycle"] < 16
    # A clean shutdown; under --config=asan, also no leak at exit.
    result["daemon_exit"] = daemon_exit
    ok &= daemon_exit == 0
    result["ok"] = ok
    print(json.dumps(result))
    result["rss_kib_per_cycle"] = [s[2] for s in samples]
    if out:
        with open(out, "w") as f:
            json.dump(result, f, indent=1)
    print(f"soak: {cycles} verified updates, {faults} trainers killed mid-transfer, "
          f"{elapsed:.1f} s: fds {result['fds']['warm']}->{result['fds']['last']}, threads "
          f"{result['threads']['warm']}->{result['threads']['last']}, rss slope "
          f"{result['rss_kib']['slope_per_cycle']} KiB/cycle: {'PASS' if ok else 'FAIL'}")
    if ok:
        shutil.rmtree(work, ignore_errors=True)  # kept when something failed
    else:
        print(f"logs in {work}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

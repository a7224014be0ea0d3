#!/usr/bin/env python3
"""Judges the samples tests/gpu/run_leak_checks.sh took after each round
(LOG/samples.txt: round, worker pid, fds, threads, resident KiB, GPU MiB,
driver mappings) and writes LOG/gpu_leak.json:

    python3 tests/gpu/leak_figures.py LOG COMMIT KIND ROUNDS OK_UPDATES DIED [BACKEND]

Rounds repeat with a period of 4 (three trainers that finish, one that dies
mid-transfer), and GPU memory follows that period (IPC sources mapped and
released), so a straight-line slope over a window that ends high is not a
leak. The test: over each metric, the maximum of the last period against
the maximum of the first half of the run after the first period (rounds 5
to ROUNDS/2, at least one period): growth must stay within the limits
below. A leak grows without bound, so the second half climbs over the
first; a warm-up that settles does not. (The first rule took rounds 5-8
alone and failed the NCCL worker on a plateau it reached by round 16:
+1.3 MiB over rounds 5-8, then flat to round 40; bench/results/
gpu_leak_nccl_arena_40.json.) With 40 rounds a steady leak of more than
~60 KiB of resident memory a round fails. Slopes are reported as well.

BACKEND (ipc, the default, or nccl): on NCCL the daemon may replace its GPU
worker when aborting a dead trainer's communicator hangs (DESIGN.md,
invariant 5). Replacements are counted; the figures then judge the last
worker alone, which must have been sampled for two periods at least.
"""
import datetime
import json
import sys

log, commit, kind, rounds, ok_updates, died = sys.argv[1:7]
backend = sys.argv[7] if len(sys.argv) > 7 else "ipc"
all_rows = [list(map(int, line.split())) for line in open(f"{log}/samples.txt")]
pids = sorted({r[1] for r in all_rows}, key=lambda p: [r[1] for r in all_rows].index(p))
# Judge the last worker's samples (all of them when it never changed).
rows = [r for r in all_rows if r[1] == pids[-1]]
names = ["fds", "threads", "rss_kib", "gpu_mib", "nvidia_maps"]
limits = {"fds": 0, "threads": 0, "rss_kib": 1024, "gpu_mib": 2, "nvidia_maps": 0}
PERIOD = 4


def slope(ys):
    n = len(ys)
    mx, my = (n - 1) / 2, sum(ys) / n
    den = sum((i - mx) ** 2 for i in range(n))
    return sum((i - mx) * (y - my) for i, y in enumerate(ys)) / den if den else 0.0


out = {"date": datetime.date.today().isoformat(), "kind": kind, "commit": commit,
       "backend": {"ipc": "ipc (one GPU)", "nccl": "nccl (two GPUs)"}.get(backend, backend),
       "rounds": int(rounds), "verified_updates": int(ok_updates),
       "trainers_died_mid_transfer": int(died), "worker_pids": pids,
       "worker_replacements": len(pids) - 1, "judged_worker": pids[-1], "judged_samples": len(rows),
       "method": "max of the last 4 rounds minus max of rounds 5 to ROUNDS/2 (a period is 4 rounds: "
                 "three trainers finishing, one dying mid-transfer), per metric of the GPU worker "
                 "process",
       "growth_limits": limits}
# IPC: one worker throughout. NCCL: replacements allowed, but the judged
# worker needs a warm-up period and two more.
ok = ((len(pids) == 1 or backend == "nccl") and len(rows) >= 3 * PERIOD
      and int(ok_updates) >= 10 * (int(rounds) - int(died)))
for i, n in enumerate(names):
    col = [r[2 + i] for r in rows]
    first, last = col[PERIOD:max(2 * PERIOD, len(col) // 2)], col[-PERIOD:]
    growth = max(last) - max(first)
    out[n] = {"round1": col[0], "first_half_max": max(first), "last_period_max": max(last),
              "growth": growth, "slope_per_round": round(slope(col[PERIOD:]), 3),
              "samples": col}
    ok &= growth <= limits[n]
out["ok"] = ok
json.dump(out, open(f"{log}/gpu_leak.json", "w"), indent=1)
print(("PASS" if ok else "FAIL") + f" GPU leak check: {rounds} trainers ({died} died "
      f"mid-transfer), {ok_updates} updates, {backend}, worker {out['worker_pids']} "
      f"({len(pids) - 1} replaced; judged {pids[-1]}, {len(rows)} samples): " +
      ", ".join(f"{n} {out[n]['first_half_max']}->{out[n]['last_period_max']}" for n in names))
sys.exit(0 if ok else 1)

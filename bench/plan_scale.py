#!/usr/bin/env python3
"""How long one trainer rank takes to make the transfer plan (issue 32),
as the ranks of a job grow: Qwen3-8B's 399 checkpoint tensors in FSDP row
shards over M ranks (torch.chunk's cut), sent to E engines of tensor
parallel size T (N = E x T receivers, vLLM's shards of weightsync.layouts).

Each rank makes the plan from the same spec (weightsync.senders.many);
since 2026-11-28 only its own pieces (build_plan(spec, sender=rank)),
against the whole plan (every sender's pieces) measured in the same run.
Standard library only, no GPU:

    python3 bench/plan_scale.py                      # the table
    python3 bench/plan_scale.py --json bench/results/plan_scale.json
"""

import argparse
import json
import os
import platform
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "client", "python"))
sys.path.insert(0, HERE)
from weightsync import layouts, transfer_plan as tp  # noqa: E402
import mton_patterns  # noqa: E402

CASES = ((2, 1, 2), (8, 1, 4), (64, 2, 8), (256, 4, 8))


def spec(ranks, engines, tp_size, config=mton_patterns.QWEN3_8B):
    shapes = layouts.checkpoint_shapes(config)
    whole = dict(shapes)
    tensors = [{"name": n, "dtype": "BFLOAT16", "shape": list(s)} for n, s in shapes]
    senders = [{"holds": [b for b in (tp.shard(n, s, 0, i, ranks) for n, s in shapes) if b]}
               for i in range(ranks)]
    receivers = []
    for e in range(engines):
        for r in range(tp_size):
            params, segs = layouts.llama_engine_layout(config, tp_rank=r, tp_size=tp_size)
            needs = []
            for name, _dtype, _shape in params:
                if name not in segs:
                    needs.append(tp.whole(name, whole[name]))
                    continue
                needs += [tp.block(s["source"], s["row_begin"], s["row_count"], s["col_begin"],
                                   s["col_count"]) for s in segs[name]]
            receivers.append({"name": f"engine{e}/tp{r}", "needs": needs})
    return {"tensors": tensors, "senders": senders, "receivers": receivers}


def timed(fn):
    t, c = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - t, time.process_time() - c


def measure(ranks, engines, tp_size):
    s = spec(ranks, engines, tp_size)
    whole, whole_s, whole_cpu = timed(lambda: tp.build_plan(s))
    row = {"ranks": ranks, "receivers": engines * tp_size, "engines": engines, "tp": tp_size,
           "whole_s": round(whole_s, 3), "whole_cpu_s": round(whole_cpu, 3),
           "whole_pieces": len(whole.pieces)}
    worst = None
    for rank in sorted({0, ranks - 1}):
        one, one_s, one_cpu = timed(lambda: tp.build_plan(s, sender=rank))
        # The same pieces as the whole plan's (the bench checks what it times).
        assert one.id == whole.id and one.sender_bytes == whole.sender_bytes
        assert one.pieces == [p for p in whole.pieces if p.sender == rank]
        if worst is None or one_cpu > worst[2]:
            worst = (rank, one_s, one_cpu, len(one.pieces))
    _, id_s, _ = timed(lambda: tp.plan_id(s))
    row.update(rank_s=round(worst[1], 3), rank_cpu_s=round(worst[2], 3), rank_pieces=worst[3],
               plan_id_s=round(id_s, 3), speedup_cpu=round(whole_cpu / worst[2], 2))
    del whole
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="write the rows and the machine here")
    ap.add_argument("--cases", default=",".join("x".join(map(str, c)) for c in CASES),
                    help="M x E x T cases, comma-separated (default: %(default)s)")
    args = ap.parse_args()
    cases = [tuple(int(x) for x in c.split("x")) for c in args.cases.split(",")]
    rows = []
    print("ranks receivers | whole plan s (cpu) pieces | one rank's s (cpu) pieces | "
          "plan id s | cpu ratio")
    for m, e, t in cases:
        r = measure(m, e, t)
        rows.append(r)
        print(f"{r['ranks']:5} {r['receivers']:9} | {r['whole_s']:7.2f} ({r['whole_cpu_s']:.2f}) "
              f"{r['whole_pieces']:9} | {r['rank_s']:6.2f} ({r['rank_cpu_s']:.2f}) "
              f"{r['rank_pieces']:7} | {r['plan_id_s']:6.2f} | {r['speedup_cpu']:5.1f}x",
              flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"what": "transfer plan time per rank, Qwen3-8B FSDP rows -> TP engines",
                       "machine": f"{platform.machine()}, {os.cpu_count()} cores, "
                                  f"Python {platform.python_version()}",
                       "date": time.strftime("%Y-%m-%d"), "rows": rows}, f, indent=1)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

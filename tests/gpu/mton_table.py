#!/usr/bin/env python3
"""The same-run table of a run_mton_checks.sh call, from its JSON:

    python3 tests/gpu/mton_table.py DAEMON_JSON RAW_1GIB_JSON [RAW_64MIB_JSON]

(test_mton_gpu.py's mton_daemon.json and bench/mton_nccl_bench.py's
mton_raw.json). One row per engine layout x trainer case x (chunk,
receipts): today's single sender and two senders, rank 0's median call to
return, their ratio, the raw p2p of the same bytes, raw / two senders."""

import json
import sys


def main():
    d = json.load(open(sys.argv[1]))
    raws = [json.load(open(p))["results"] for p in sys.argv[2:4]]
    rows = {(r["layout"], r["case"], r["senders"], r["verify"], r["chunk"]): r["median_s"] * 1e3
            for r in d["rows"] if "layout" in r}
    chunks = sorted({k[4] for k in rows})
    # What "default" meant: the daemons' own chunk size, one sender's and
    # (recorded since run 9) the many senders' (their timings' chunk_bytes).
    taken = {r["chunk"]: r["timings"][0]["chunk_bytes"] for r in d["rows"]
             if r.get("senders") == 2 and r.get("timings") and "chunk_bytes" in r["timings"][0]}
    print("| layout | case | chunk | receipts | one sender ms | two senders ms (rank 0) "
          "| two vs one | raw p2p ms (" + " / ".join(["1 GiB", "64 MiB"][:len(raws)])
          + ") | raw 1 GiB / two |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for lay in ("tp2", "replicas"):
        for case in ("rows", "layers", "replicas"):
            for ch in chunks:
                for v in (True, False):
                    key = (lay, case, 2, v, ch)
                    if key not in rows:
                        continue
                    one, two = rows[(lay, "full", 1, v, ch)], rows[key]
                    raw = [r[f"p2p_2s_{case}_{lay}/dense"]["s_median"] * 1e3 for r in raws]
                    name = (f"{ch >> 20} MiB" if ch else "default (64 MiB" +
                            (f"; two senders {taken[0] >> 20} MiB)" if 0 in taken else ")"))
                    print(f"| {lay} | {case} | {name} | {'on' if v else 'off'} | {one:.1f} | "
                          f"{two:.1f} | {one / two:.2f}x | {' / '.join(f'{x:.1f}' for x in raw)} "
                          f"| {raw[0] / two:.2f} |")
    for r in d["rows"]:
        if "fault" in r:
            print(f"fault {r['fault']}: {r['error']['code']} in {r['seconds']:.2f} s, engines "
                  f"{r['engines']}, repaired: {r['repaired']}")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""The transfer plan that bench/mton_worker_bench.cc runs (issue 32, the
4-GPU proof at the GPU worker's level), written as text, one record a line.

Built from bench/mton_patterns.py (which sender sends which rectangle of
which tensor to which engine GPU) and the engine layouts of
weightsync.layouts (where each rectangle lands in the engine's memory):

  tensor  ID NAME ROWS COLS                    checkpoint tensors (bf16)
  hold    SENDER ID ROW0 NROWS                 a sender's shard: these rows,
                                               all columns, stored in the
                                               order of the hold lines
  engine  GPU BYTES                            one allocation per engine GPU
  need    GPU ID R0 NR C0 NC DST STRIDE        what the engine GPU must hold
                                               (to verify), bytes / bytes
  chunk   K ROUND SENDER RECEIVER BYTES        in global order; RECEIVER -1:
                                               broadcast to every receiver
  pack    K ID R0 NR C0 NC OFFSET              the sender packs this
                                               rectangle at OFFSET of chunk K
  op      K GPU ID R0 NR C0 NC OFFSET SRC_STRIDE DST DST_STRIDE
                                               the receiver copies it from
                                               chunk K into its engine

A `pack` or `op` of one row whose columns run past the tensor's width is
a flat run of NC elements from (R0, C0) on, wrapping rows (the tensor's
rows are whole in the shard, and the engine rectangle is contiguous).

Planners (p2p): "bench" (below) or "transfer_plan": the project's plan
(weightsync.transfer_plan, docs/transfer_plan.md: replicas water-filled by
rows) with each link's stream cut by the chunk planner (pieces cut at any
element, so a chunk may hold parts of rows: one pack/op per part, runs
merged where both sides are contiguous).

Modes: p2p (the plan's M->N: each flow (sender, receiver) packs its pieces
into chunks; a piece contiguous in the engine and at least --direct_mib and a chunk
gets whole chunks of its own, which the worker receives in place, the
rest packed with the pieces after it; every chunk of a flow but its last is
within a row of --chunk_mib, so that a round's transfers match; round i holds
chunk i of every flow) and bcast (today: rank 0 packs every tensor whole
in model order and broadcasts each chunk; every receiver takes what its
engine needs). Case "one": rank 0 holds everything (one sender, p2p).

    python3 bench/mton_plan.py --case rows --layout tp2 --mode p2p > plan.txt
"""

import argparse
import importlib.util
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mton_patterns as mp  # noqa: E402

MiB = 1 << 20


def engine_rects(cfg, layout):
    """({gpu: [(tensor, r0, nr, c0, nc, dst, dst_stride)]}, {gpu: bytes}):
    the engine's parameters laid out one after another (bf16)."""
    lay = mp._layouts()
    shapes = dict(lay.checkpoint_shapes(cfg))
    rects, sizes = {}, {}
    for i, gpu in enumerate(mp.RECEIVERS):
        tp_rank, tp_size = (i, 2) if layout == "tp2" else (0, 1)
        params, segments = lay.llama_engine_layout(cfg, tp_rank=tp_rank, tp_size=tp_size)
        off, out = 0, []
        for name, _dtype, shape in params:
            n = 1
            for s in shape:
                n *= s
            if name in segments:
                for s in segments[name]:
                    stride = s["dest_row_stride"] or s["col_count"]
                    out.append((s["source"], s["row_begin"], s["row_count"], s["col_begin"],
                                s["col_count"], off + 2 * s["dest_offset"], 2 * stride))
            else:
                r, c = mp._rows_cols(shapes[name])
                out.append((name, 0, r, 0, c, off, 2 * c))
            off += 2 * n
            off = (off + 255) // 256 * 256
        rects[gpu], sizes[gpu] = out, off
    return rects, sizes


def holdings(cfg, case):
    if case == "one":
        lay = mp._layouts()
        return {n: {0: (0, mp._rows_cols(s)[0])} for n, s in lay.checkpoint_shapes(cfg)}
    return mp.holdings(cfg, case)


def p2p_pieces(cfg, case, layout):
    """[(sender, receiver, tensor, r0, nr, c0, nc, dst, dst_stride)]."""
    if case == "one":
        rects, _ = engine_rects(cfg, layout)
        return [(0, g) + r for g in mp.RECEIVERS for r in rects[g]]
    rects, _ = engine_rects(cfg, layout)
    where = {}
    for g in mp.RECEIVERS:
        for t, r0, nr, c0, nc, dst, ds in rects[g]:
            where.setdefault((g, t, c0, nc), []).append((r0, nr, dst, ds))
    out = []
    for s, g, t, lo, n, c0, nc, _b in mp.pieces(cfg, case, layout):
        for r0, nr, dst, ds in where[(g, t, c0, nc)]:
            if r0 <= lo and lo + n <= r0 + nr:
                out.append((s, g, t, lo, n, c0, nc, dst + (lo - r0) * ds, ds))
                break
        else:
            raise AssertionError(f"piece {t} rows {lo}+{n} of GPU {g} has no engine rectangle")
    return out


def _tp_module(name):
    path = os.path.join(mp.HERE, "..", "client", "python", "weightsync", name + ".py")
    spec = importlib.util.spec_from_file_location("ws_" + name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def transfer_plan_chunks(cfg, case, layout, chunk_bytes, ids, cols):
    """{(sender, receiver): [[bytes, packs, ops]]} from the project's plan:
    weightsync.transfer_plan over the same holdings and needs, each link's
    stream cut by weightsync.planner (standard library only, loaded from
    the tree without the package)."""
    planner = _tp_module("planner")
    sys.modules["planner"] = planner
    tp = _tp_module("transfer_plan")
    lay = mp._layouts()
    shapes = lay.checkpoint_shapes(cfg)
    held = holdings(cfg, case)
    rects, _ = engine_rects(cfg, layout)
    spec = {"tensors": [{"name": n, "dtype": "BFLOAT16", "shape": list(sh)} for n, sh in shapes],
            "senders": [{"holds": [tp.block(n, h[s][0], h[s][1], 0, cols[n])
                                   for n, h in held.items() if s in h]} for s in mp.SENDERS],
            "receivers": [{"name": f"gpu{g}", "needs": [tp.block(t, r0, nr, c0, nc)
                                                       for t, r0, nr, c0, nc, _d, _s in rects[g]]}
                          for g in mp.RECEIVERS]}
    plan = tp.build_plan(spec)
    need_of = {}
    for g in mp.RECEIVERS:
        for t, r0, nr, c0, nc, dst, ds in rects[g]:
            need_of.setdefault((g, t), []).append((r0, nr, c0, nc, dst, ds))
    names = [n for n, _sh in shapes]
    out = {}
    for si, s in enumerate(mp.SENDERS):
        for ri, g in enumerate(mp.RECEIVERS):
            pieces = plan.link_pieces(si, ri)
            if not pieces:
                continue
            chunks = planner.plan_chunks(tp.link_manifest(plan, si, ri), chunk_bytes)
            fl = []
            for c in chunks["chunks"]:
                packs, ops = [], []
                for part in c["pieces"]:
                    p = pieces[part["tensor"]]
                    t = names[p.tensor]
                    e0 = part["tensor_offset"] // 2
                    e1 = e0 + part["length"] // 2
                    off = part["chunk_offset"]
                    # The piece's rows are p.col_count wide: split [e0, e1)
                    # into a partial row, whole rows, a partial row.
                    w = p.col_count
                    segs = []
                    e = e0
                    while e < e1:
                        i, j = divmod(e, w)
                        if j or e1 - e < w:
                            n = min(w - j, e1 - e)
                            segs.append((i, 1, j, n))
                            e += n
                        else:
                            k = (e1 - e) // w
                            segs.append((i, k, 0, w))
                            e += k * w
                    for i, k, j, n in segs:
                        r, c0 = p.row_begin + i, p.col_begin + j
                        packs.append((ids[t], r, k, c0, n, off))
                        for nr0, nnr, nc0, nnc, dst, ds in need_of[(g, t)]:
                            if not (nr0 <= r and r + k <= nr0 + nnr and nc0 <= c0
                                    and c0 + n <= nc0 + nnc):
                                continue
                            ops.append((g, ids[t], r, k, c0, n, off, w * 2,
                                        dst + (r - nr0) * ds + (c0 - nc0) * 2, ds))
                            break
                        else:
                            raise AssertionError(f"{t} rows {r}+{k} cols {c0}+{n}: no need of "
                                                 f"GPU {g} holds it")
                        off += k * n * 2
                fl.append([c["size"], _merge_runs(packs, cols, names, True),
                           _merge_runs(ops, cols, names, False)])
            out[(s, g)] = fl
    return out


def _merge_runs(items, cols, names, pack):
    """Adjacent parts of one chunk that continue each other on both sides
    become one flat run (one row, columns past the width) where that run is
    contiguous: the shard's rows are whole (a pack: the part spans the
    tensor's width, or is a row's tail or head); the engine's rectangle is
    contiguous (an op: dst_stride is its row)."""
    out = []
    for it in items:
        if out:
            a = out[-1]
            if pack:
                t, r, k, c0, n, off = it
                at, ar, ak, ac0, an, aoff = a
                full = cols[names[t]]
                a_end = ar * full + ac0 + (ak * an if ak > 1 else an)
                flat_a = ak == 1 or (ac0 == 0 and an == full)
                flat_b = k == 1 or (c0 == 0 and n == full)
                if (t == at and flat_a and flat_b and r * full + c0 == a_end
                        and off == aoff + ak * an * 2):
                    out[-1] = (at, ar, 1, ac0, (ak * an) + k * n, aoff)
                    continue
            else:
                g, t, r, k, c0, n, off, ss, dst, ds = it
                ag, at, ar, ak, ac0, an, aoff, ass, adst, ads = a
                full = cols[names[t]]
                row = n * 2
                # Each part contiguous in the engine; adjacency is checked next.
                contiguous = (ds == row or k == 1) and (ads == an * 2 or ak == 1)
                a_bytes = ak * an * 2
                if (g == ag and t == at and contiguous and dst == adst + a_bytes
                        and off == aoff + a_bytes and r * full + c0 == ar * full + ac0 + ak * an
                        and (k == 1 or c0 == 0) and (ak == 1 or ac0 == 0)):
                    out[-1] = (ag, at, ar, 1, ac0, ak * an + k * n, aoff, a_bytes + k * n * 2,
                               adst, a_bytes + k * n * 2)
                    continue
        out.append(it)
    return out


def plan(cfg, case, layout, mode, chunk_bytes, direct_bytes, planner="bench"):
    lay = mp._layouts()
    shapes = lay.checkpoint_shapes(cfg)
    ids = {n: i for i, (n, _s) in enumerate(shapes)}
    cols = {n: mp._rows_cols(s)[1] for n, s in shapes}
    lines = [f"model {case} {layout} {mode}"]
    for n, s in shapes:
        r, c = mp._rows_cols(s)
        lines.append(f"tensor {ids[n]} {n} {r} {c}")
    held = holdings(cfg, case if mode == "p2p" else "one")
    for s in mp.SENDERS:
        for n, _s in shapes:
            if s in held[n]:
                r0, nr = held[n][s]
                lines.append(f"hold {s} {ids[n]} {r0} {nr}")
    rects, sizes = engine_rects(cfg, layout)
    for g in mp.RECEIVERS:
        lines.append(f"engine {g} {sizes[g]}")
        for t, r0, nr, c0, nc, dst, ds in rects[g]:
            lines.append(f"need {g} {ids[t]} {r0} {nr} {c0} {nc} {dst} {ds}")
    chunks = []   # (round, sender, receiver, bytes, packs, ops)
    if mode == "bcast":
        cur, used, k = None, 0, 0
        segs = []   # (chunk, tensor, r0, nr, offset)
        for n, s in shapes:
            r, c = mp._rows_cols(s)
            row = c * 2
            lo = 0
            while lo < r:
                if cur is None or used + row > chunk_bytes:
                    if cur is not None:
                        chunks.append(cur)
                    cur, used = [len(chunks), 0, -1, 0, [], []], 0
                take = min(r - lo, (chunk_bytes - used) // row)
                cur[4].append((ids[n], lo, take, 0, c, used))
                segs.append((len(chunks), n, lo, take, used))
                used += take * row
                cur[3] = used
                lo += take
        chunks.append(cur)
        for g in mp.RECEIVERS:
            by_t = {}
            for t, r0, nr, c0, nc, dst, ds in rects[g]:
                by_t.setdefault(t, []).append((r0, nr, c0, nc, dst, ds))
            for k, n, lo, take, off in segs:
                for r0, nr, c0, nc, dst, ds in by_t.get(n, ()):
                    a, b = max(lo, r0), min(lo + take, r0 + nr)
                    if a >= b:
                        continue
                    chunks[k][5].append((g, ids[n], a, b - a, c0, nc,
                                         off + (a - lo) * cols[n] * 2 + c0 * 2, cols[n] * 2,
                                         dst + (a - r0) * ds, ds))
    elif planner == "transfer_plan":
        per_flow = transfer_plan_chunks(cfg, case, layout, chunk_bytes, ids, cols)
        rounds = max(len(f) for f in per_flow.values())
        for i in range(rounds):
            for (s, g), fl in sorted(per_flow.items()):
                if i < len(fl):
                    b, packs, ops = fl[i]
                    chunks.append([i, s, g, b, packs, ops])
    else:
        flows = {}
        for p in p2p_pieces(cfg, case, layout):
            flows.setdefault((p[0], p[1]), []).append(p)
        per_flow = {}
        for (s, g), ps in sorted(flows.items()):
            fl = []   # [bytes, packs, ops]
            cur = None
            for _s, _g, t, lo, n, c0, nc, dst, ds in ps:
                row = nc * 2
                contiguous = ds == row or n == 1
                step = max(1, chunk_bytes // row)
                if contiguous and n * row >= max(direct_bytes, step * row):
                    # Whole chunks of their own, received in place; the
                    # rest (under a chunk) is packed with what follows.
                    if cur is not None:
                        fl.append(cur)
                        cur = None
                    whole = n // step * step
                    for a in range(lo, lo + whole, step):
                        fl.append([step * row, [(ids[t], a, step, c0, nc, 0)],
                                   [(g, ids[t], a, step, c0, nc, 0, row, dst + (a - lo) * ds, ds)]])
                    dst += whole * ds
                    lo += whole
                    n -= whole
                    if n == 0:
                        continue
                a = lo
                while a < lo + n:
                    if cur is None or cur[0] + row > chunk_bytes:
                        if cur is not None:
                            fl.append(cur)
                        cur = [0, [], []]
                    m = min(lo + n - a, (chunk_bytes - cur[0]) // row)
                    cur[1].append((ids[t], a, m, c0, nc, cur[0]))
                    cur[2].append((g, ids[t], a, m, c0, nc, cur[0], row, dst + (a - lo) * ds, ds))
                    cur[0] += m * row
                    a += m
            if cur is not None:
                fl.append(cur)
            per_flow[(s, g)] = fl
        rounds = max(len(f) for f in per_flow.values())
        for i in range(rounds):
            for (s, g), fl in sorted(per_flow.items()):
                if i < len(fl):
                    b, packs, ops = fl[i]
                    chunks.append([i, s, g, b, packs, ops])
    for k, (rnd, s, g, b, packs, ops) in enumerate(chunks):
        lines.append(f"chunk {k} {rnd} {s} {g} {b}")
        for t, r0, nr, c0, nc, off in packs:
            lines.append(f"pack {k} {t} {r0} {nr} {c0} {nc} {off}")
        for op in ops:
            lines.append("op {} ".format(k) + " ".join(str(x) for x in op))
    return lines


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen3-8b", choices=sorted(mp.MODELS))
    ap.add_argument("--case", default="rows", choices=list(mp.CASES) + ["one"])
    ap.add_argument("--layout", default="tp2", choices=mp.LAYOUTS)
    ap.add_argument("--mode", default="p2p", choices=("p2p", "bcast"))
    ap.add_argument("--chunk_mib", type=int, default=256)
    ap.add_argument("--direct_mib", type=int, default=0)
    ap.add_argument("--planner", default="bench", choices=("bench", "transfer_plan"))
    ap.add_argument("--out", default="-")
    args = ap.parse_args()
    lines = plan(mp.MODELS[args.model], args.case, args.layout, args.mode,
                 args.chunk_mib * MiB, args.direct_mib * MiB, args.planner)
    text = "\n".join(lines) + "\n"
    if args.out == "-":
        sys.stdout.write(text)
    else:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()

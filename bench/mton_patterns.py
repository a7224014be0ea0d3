#!/usr/bin/env python3
"""The byte patterns of issue 32's 4-GPU proof, computed without a GPU.

Two trainer ranks (GPUs 0, 1) hold Qwen3-8B (or another Llama/Qwen config)
in one of three ways, and engines on GPUs 2, 3 need their parameters:

  trainer cases                        engine layouts
  (a) rows:     Shard(0) of every        tp2:      one TP=2 engine across
      tensor (FSDP2's row split)                   GPUs 2-3 (vLLM's shards,
  (b) layers:   layers split between               weightsync.layouts)
      the two ranks (pipeline style)     replicas: two TP=1 engines, one
  (c) replicas: both ranks hold                    whole model on each GPU
      everything (two DP replicas)

`pieces(case, layout)` maps every byte an engine GPU needs to exactly one
sending rank: the needed rectangle (checkpoint tensor, rows, columns) of
each engine parameter, intersected with what each rank holds (row ranges);
where both ranks hold it (replicas), the rectangle goes whole to the rank
with fewer bytes so far (largest first: balanced by bytes, no piece cut).
`flows()` sums them per (sender, receiver GPU). The raw NCCL bench
(bench/mton_nccl_bench.py) moves exactly these bytes; this file needs
no torch, so CI checks the patterns (bench/mton_patterns_test.py).

    python3 bench/mton_patterns.py            # the flow table of every case
"""

import importlib.util
import os

HERE = os.path.dirname(os.path.abspath(__file__))
SENDERS = (0, 1)     # trainer ranks = GPUs 0, 1
RECEIVERS = (2, 3)   # engine GPUs
CASES = ("rows", "layers", "replicas")
LAYOUTS = ("tp2", "replicas")

QWEN3_8B = {"vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 12288,
            "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
            "head_dim": 128, "model_type": "qwen3", "tie_word_embeddings": False}
QWEN3_1_7B = {"vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144,
              "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
              "head_dim": 128, "model_type": "qwen3", "tie_word_embeddings": True}
MODELS = {"qwen3-8b": QWEN3_8B, "qwen3-1.7b": QWEN3_1_7B}


def _layouts():
    """weightsync.layouts without importing the package (no grpc needed)."""
    path = os.path.join(HERE, "..", "client", "python", "weightsync", "layouts.py")
    spec = importlib.util.spec_from_file_location("ws_layouts", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _rows_cols(shape):
    rows = shape[0]
    cols = 1
    for s in shape[1:]:
        cols *= s
    return rows, cols


def needs(config, layout):
    """{engine GPU: [(tensor, row0, nrows, col0, ncols)]}: the checkpoint
    rectangles each engine GPU's parameters are made of."""
    lay = _layouts()
    shapes = dict(lay.checkpoint_shapes(config))
    out = {}
    for i, gpu in enumerate(RECEIVERS):
        tp_rank, tp_size = (i, 2) if layout == "tp2" else (0, 1)
        params, segments = lay.llama_engine_layout(config, tp_rank=tp_rank, tp_size=tp_size)
        rects = []
        for name, _dtype, _shape in params:
            if name in segments:
                for s in segments[name]:
                    r, c = _rows_cols(s["source_shape"])
                    assert s["col_begin"] + s["col_count"] <= c
                    rects.append((s["source"], s["row_begin"], s["row_count"],
                                  s["col_begin"], s["col_count"]))
            else:
                r, c = _rows_cols(shapes[name])
                rects.append((name, 0, r, 0, c))
        out[gpu] = rects
    return out


def _layer(name):
    parts = name.split(".")
    if len(parts) > 2 and parts[1] == "layers":
        return int(parts[2])
    return None


def holdings(config, case):
    """{tensor: {sender: (row0, nrows)}}: the rows of each checkpoint
    tensor each trainer rank holds (all columns)."""
    lay = _layouts()
    layers = config["num_hidden_layers"]
    out = {}
    for name, shape in lay.checkpoint_shapes(config):
        rows, _ = _rows_cols(shape)
        if case == "rows":
            half = -(-rows // 2)   # torch.chunk: the first rank gets the ceiling
            out[name] = {0: (0, half), 1: (half, rows - half)}
        elif case == "layers":
            l = _layer(name)
            if l is None:
                owner = 0 if name.startswith("model.embed") else 1
            else:
                owner = 0 if l < layers // 2 else 1
            out[name] = {owner: (0, rows)}
        elif case == "replicas":
            out[name] = {0: (0, rows), 1: (0, rows)}
        else:
            raise ValueError(f"unknown case {case!r} (one of {CASES})")
    return out


def pieces(config, case, layout):
    """[(sender, receiver, tensor, row0, nrows, col0, ncols, bytes)]: every
    needed byte once, per receiver in model order (bf16). Rectangles that
    both ranks hold whole (replicas) are given out largest first, each to
    the rank with the fewest bytes to that receiver so far (then overall,
    then the lower rank): balanced per link and per sender, no piece cut."""
    need = needs(config, layout)
    held = holdings(config, case)
    out = []
    load = {s: 0 for s in SENDERS}
    for gpu in RECEIVERS:
        link = {s: 0 for s in SENDERS}
        owner = {}
        shared = [i for i, (t, *_r) in enumerate(need[gpu])
                  if len(held[t]) > 1 and len(set(held[t].values())) == 1]
        for i in sorted(shared, key=lambda i: (-need[gpu][i][2] * need[gpu][i][4], i)):
            _t, _r0, nr, _c0, nc = need[gpu][i]
            s = min(SENDERS, key=lambda x: (link[x], load[x], x))
            link[s] += nr * nc * 2
            load[s] += nr * nc * 2
            owner[i] = s
        for i, (tensor, r0, nr, c0, nc) in enumerate(need[gpu]):
            if i in owner:
                out.append((owner[i], gpu, tensor, r0, nr, c0, nc, nr * nc * 2))
                continue
            owners = held[tensor]
            covered = 0
            for s in SENDERS:
                if s not in owners:
                    continue
                h0, hn = owners[s]
                lo, hi = max(r0, h0), min(r0 + nr, h0 + hn)
                if hi <= lo:
                    continue
                b = (hi - lo) * nc * 2
                load[s] += b
                covered += hi - lo
                out.append((s, gpu, tensor, lo, hi - lo, c0, nc, b))
            if covered != nr:
                raise ValueError(f"{tensor}: rows {r0}+{nr} of engine GPU {gpu} covered "
                                 f"{covered} times over ranks {sorted(owners)}")
    return out


def flows(ps):
    """{(sender, receiver): bytes}."""
    out = {}
    for p in ps:
        out[(p[0], p[1])] = out.get((p[0], p[1]), 0) + p[7]
    return out


def all_patterns(config):
    """{(case, layout): flows} for every case and layout."""
    return {(c, l): flows(pieces(config, c, l)) for c in CASES for l in LAYOUTS}


def main():
    import argparse
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen3-8b", choices=sorted(MODELS))
    args = ap.parse_args()
    cfg = MODELS[args.model]
    for (case, layout), f in all_patterns(cfg).items():
        ps = pieces(cfg, case, layout)
        sent = {s: sum(b for (x, _), b in f.items() if x == s) for s in SENDERS}
        print(f"{case:9s} -> {layout:9s} pieces {len(ps):5d}  "
              + "  ".join(f"{s}->{r} {b / 1e9:6.3f} GB" for (s, r), b in sorted(f.items()))
              + f"  senders {sent[0] / 1e9:.3f}/{sent[1] / 1e9:.3f} GB")


if __name__ == "__main__":
    main()

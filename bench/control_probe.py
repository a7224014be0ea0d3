"""What a per-update check of 100k torch tensors costs, one way each.

The registered source (docs/protocol.md, "Registered sources") must know
before each update that every tensor is still where it was registered.
This times the candidate checks on one GPU, 100k tensors of 16 float32
(views of one buffer, as bench/manifest_scale.py's trainer holds them, and
separate allocations), median of 7, and prints one line per way. It only
reads: no daemon. Run: python3 bench/control_probe.py [--tensors N].
"""

import argparse
import json
import operator
import statistics
import sys
import time


def timed(fn, reps=7):
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return statistics.median(out) * 1e3


def main():
    import torch
    ap = argparse.ArgumentParser()
    ap.add_argument("--tensors", type=int, default=100_000)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    n = args.tensors
    T = torch.Tensor
    backing = torch.zeros(n * 16, device="cuda:0")
    kinds = {
        "views": [(f"model.layers.{i // 1000}.mlp.experts.{i % 1000}.w", backing[i * 16:(i + 1) * 16])
                  for i in range(n)],
        "separate": [(f"model.layers.{i // 1000}.mlp.experts.{i % 1000}.w",
                      torch.zeros(16, device="cuda:0")) for i in range(n)],
    }
    rows = {}
    helper = getattr(torch._C, "_tensors_data_ptrs_at_indices_equal", None)
    for kind, pairs in kinds.items():
        tensors = [t for _, t in pairs]
        names = [nm for nm, _ in pairs]
        ptrs = [t.data_ptr() for t in tensors]
        nbytes = [t.nbytes for t in tensors]
        idx = list(range(n))
        same_tuples = list(pairs)
        new_tuples = [(a, b) for a, b in pairs]
        first, second = operator.itemgetter(0), operator.itemgetter(1)
        ways = {
            "names tuple(map(itemgetter))": lambda: tuple(map(first, pairs)),
            "tensors tuple(map(itemgetter))": lambda: tuple(map(second, pairs)),
            "zip(*pairs)": lambda: tuple(zip(*pairs)),
            "names list == cached": lambda: list(map(first, pairs)) == names,
            "pairs == cached (same tuples)": lambda: pairs == same_tuples,
            "pairs == cached (new tuples)": lambda: new_tuples == same_tuples,
            "identity all(map(is_))": lambda: all(map(operator.is_, map(second, pairs), tensors)),
            "data_ptr map": lambda: tuple(map(T.data_ptr, tensors)),
            "numel map": lambda: tuple(map(T.numel, tensors)),
            "nbytes getter map": lambda: tuple(map(T.nbytes.__get__, tensors)),
            "len map": lambda: tuple(map(len, tensors)),
            "set(map(type))": lambda: set(map(type, tensors)),
        }
        if helper is not None:
            ways["torch._C._tensors_data_ptrs_at_indices_equal"] = (
                lambda: helper(tensors, ptrs, idx))
        ways["nbytes tuple == cached"] = lambda: list(map(T.nbytes.__get__, tensors)) == nbytes
        for way, fn in ways.items():
            rows[f"{kind}: {way}"] = round(timed(fn), 2)
    print(f"torch {torch.__version__}, {n} tensors, ms (median of 7):")
    for k, v in rows.items():
        print(f"  {v:8.2f}  {k}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"tensors": n, "torch": torch.__version__, "ms": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

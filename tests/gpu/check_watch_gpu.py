#!/usr/bin/env python3
"""weightsync._watch.MemoryWatch on real torch tensors (CUDA), one GPU:
the C-level check says nothing while every tensor is where it was
registered, names a tensor whose data moved (p.data = clone) and one whose
storage was freed (untyped_storage().resize_(0), as FSDP frees), and its
cost for Qwen3-8B's 399 tensors (it runs before a pause's Ack).

    python3 tests/gpu/check_watch_gpu.py
Prints PASS/FAIL lines and the median cost; exits 1 on a failure."""

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                "client", "python"))
import torch  # noqa: E402
from weightsync import layouts  # noqa: E402
from weightsync._watch import MemoryWatch, _pointers  # noqa: E402

QWEN3_8B = {"vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 12288,
            "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
            "head_dim": 128, "model_type": "qwen3", "tie_word_embeddings": False}
failed = []


def check(ok, what):
    print(("PASS " if ok else "FAIL ") + what, flush=True)
    if not ok:
        failed.append(what)


dev = torch.device("cuda", 0)
shapes = layouts.checkpoint_shapes(QWEN3_8B)
params = {n: torch.nn.Parameter(torch.empty(s, dtype=torch.bfloat16, device=dev),
                                requires_grad=False) for n, s in shapes}
w = MemoryWatch(params)
check(w._torch is not None, f"{len(params)} torch parameters take the C-level path")
check(w.changed() is None, "nothing moved: changed() is None")
cost = []
for _ in range(50):
    t = time.perf_counter()
    w.changed()
    cost.append(time.perf_counter() - t)
old = [time.perf_counter()]
for _ in range(50):
    t = time.perf_counter()
    list(map(_pointers, w._objs))
    old.append(time.perf_counter() - t)
print(f"changed() over {len(params)} tensors: median {statistics.median(cost) * 1e6:.0f} us "
      f"(a Python call per tensor: {statistics.median(old[1:]) * 1e6:.0f} us)", flush=True)
name = "model.layers.3.mlp.down_proj.weight"
params[name].data = params[name].data.clone()
why = w.changed()
check(why is not None and name in why and "data pointer" in why, f"p.data = clone: {why}")
w = MemoryWatch(params)
other = "model.layers.7.self_attn.q_proj.weight"
params[other].untyped_storage().resize_(0)
why = w.changed()
check(why is not None and other in why, f"storage resized to 0: {why}")
print("check_watch_gpu: " + ("PASS" if not failed else f"FAIL ({len(failed)})"), flush=True)
sys.exit(1 if failed else 0)

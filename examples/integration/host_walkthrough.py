#!/usr/bin/env python3
"""docs/integration.md on the host backend: no GPU, no torch, one command.

    python3 examples/integration/host_walkthrough.py path/to/weightsyncd

* Four engine "workers" (one tensor-parallel group, TP=4, fused qkv and
  gate_up, vLLM's vocab padding via vllm_layout.py) register their weights
  in shared memory and serve fake forward passes behind a step gate that
  the pause/resume hooks drive.
* A trainer pushes: v1 dense (streaming), v2 staged, v3 sparse patches
  against v2, then v4 and v5 as two partial updates inside one explicit
  pause (the per-layer pattern for a trainer that can't hold the whole
  model at once), and a retry of an already used version
  (FAILED_PRECONDITION).
* After each update every engine's memory is compared with the checkpoint
  mapped through its segments; receipts (on by default) check it too.
  No forward pass may run while an engine is paused.

Prints PASS/FAIL lines; exits non-zero on failure.
"""

import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "..", "client", "python"))

import numpy as np  # noqa: E402

import weightsync  # noqa: E402
from segments import expected_param  # noqa: E402
from step_gate import StepGate  # noqa: E402
from weightsync import layouts, sparse  # noqa: E402
from vllm_layout import vllm_llama_layout  # noqa: E402

CONFIG = dict(vocab_size=1100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=8, num_key_value_heads=4, head_dim=8, model_type="qwen3")
TP = 4


def checkpoint(seed):
    rng = np.random.default_rng(seed)
    return {n: rng.standard_normal(s).astype(np.float32)
            for n, s in layouts.checkpoint_shapes(CONFIG)}


def expected(shape, segs, ckpt, name):
    return expected_param(shape, segs, ckpt.__getitem__, name,
                          np.full(int(np.prod(shape)), np.nan, np.float32))


def main():
    daemon_bin = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("WEIGHTSYNCD", "")
    if not os.path.exists(daemon_bin):
        sys.exit(f"usage: {sys.argv[0]} path/to/weightsyncd")
    ok = True

    def check(cond, what):
        nonlocal ok
        print(f"{'PASS' if cond else 'FAIL'} {what}", flush=True)
        ok = ok and bool(cond)

    tmp = tempfile.mkdtemp(prefix="ws-int.")
    sock = os.path.join(tmp, "d.sock")
    daemon = subprocess.Popen([daemon_bin, f"--socket={sock}", "--update_idle_timeout_ms=20000"],
                              stdout=subprocess.DEVNULL, stderr=open(os.path.join(tmp, "log"), "w"))
    engines, stop = [], threading.Event()
    try:
        for _ in range(200):
            if os.path.exists(sock):
                break
            time.sleep(0.05)
        target = "unix:" + sock

        # -- engine side: one Engine per TP rank --------------------------------
        for rank in range(TP):
            params, segments = vllm_llama_layout(CONFIG, tp_rank=rank, tp_size=TP,
                                                 dtype="FLOAT32")
            engine = weightsync.Engine(f"node0.r0.tp{rank}", target)
            weights = engine.register_host(params, segments=segments)
            gate = StepGate()
            engine.start(on_pause=gate.on_pause, on_resume=gate.on_resume,
                         on_new_version=gate.on_new_version)
            engines.append((engine, weights, segments, gate))
        check(engines[0][1]["model.embed_tokens.weight"].shape == (288, 64),
              "rank 0 embedding shard has vLLM's 288 rows (1100 padded to 1152, / 4)")

        def serve(weights, gate):       # fake forward passes reading the weights
            while not stop.is_set():
                gate.step(lambda: float(weights["model.norm.weight"].sum()))
                time.sleep(0.001)

        for _, weights, _, gate in engines:
            threading.Thread(target=serve, args=(weights, gate), daemon=True).start()

        def verify(ckpt, version, names=None):
            bad = []
            for engine, weights, segments, _ in engines:
                engine.wait_for_version(version, 5)
                for n, arr in weights.items():
                    segs = segments.get(n)
                    if names is not None and not any(s["source"] in names for s in (segs or [])) \
                            and n not in names:
                        continue
                    want = expected(arr.shape, segs, ckpt, n)
                    mask = ~np.isnan(want)
                    if not np.array_equal(arr[mask], want[mask]):
                        bad.append(f"{engine.engine_id}:{n}")
            return bad

        # -- trainer side --------------------------------------------------------
        trainer = weightsync.Trainer(target)
        trainer.init_host()

        c1 = checkpoint(1)
        r = trainer.update(list(c1.items()), version=1)          # streaming, verify=True
        check(r.version == 1 and len(r.engines) == TP, f"v1 dense: {len(r.engines)} engines")
        check(not verify(c1, 1), "v1 in every engine's memory, through the TP segments")

        c2 = checkpoint(2)
        r = trainer.update(list(c2.items()), version=2, mode="staged")
        check(not verify(c2, 2), f"v2 staged (engines paused {r.pause_seconds * 1e3:.1f} ms)")

        c3 = {n: t.copy() for n, t in c2.items()}
        for t in c3.values():
            t.reshape(-1)[::97] += 1.0                          # ~1% of the elements
        items = [(n, sparse.diff(c2[n], t, max_density=0.05) or t) for n, t in c3.items()]
        r = trainer.update(items, version=3, base_version=2)
        check(not verify(c3, 3), f"v3 sparse patches against v2 "
              f"({sum(isinstance(t, sparse.SparsePatch) for _, t in items)} patches)")

        c4 = checkpoint(4)
        names = list(c4)
        halves = [names[:len(names) // 2], names[len(names) // 2:]]
        for g in engines:
            g[3].events.clear()
        with trainer.paused(mode="keep"):
            for i, part in enumerate(halves):
                trainer.update([(n, c4[n]) for n in part], version=4 + i)
        check(not verify(c4, 5), "v4 + v5: two partial updates inside one pause = the whole model")
        ev = engines[0][3].events
        check(ev == ["pause PAUSE_MODE_KEEP", "version 4", "version 5", "resume"],
              f"one pause around both parts, no resume in between ({ev})")

        try:
            trainer.update(list(c4.items()), version=5)
            check(False, "a used version is refused")
        except weightsync.WeightSyncError as e:
            check(e.code == "FAILED_PRECONDITION", f"a used version is refused: {e.code}: "
                  f"{e.message[:70]}...")

        status = trainer.status()
        top = max(e.version for e in status.engines)
        check(top == 5, f"GetStatus: engines at {[e.version for e in status.engines]}; "
              f"a restarted trainer continues at {top + 1}")
        check(all(g.violations == 0 for _, _, _, g in engines),
              "no forward pass ran while an engine was paused")
        trainer.close()
    finally:
        stop.set()
        for engine, *_ in engines:
            engine.close()
        daemon.terminate()
        daemon.wait(10)
        shutil.rmtree(tmp, ignore_errors=True)
    print("host_walkthrough:", "PASS" if ok else "FAIL", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

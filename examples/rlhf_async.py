#!/usr/bin/env python3
"""Asynchronous RLHF weight sync through weightsyncd, on two GPUs (the
weightsync version of vLLM's rlhf_async_new_apis.py).

* The engine process (GPU 1, random weights) generates greedily, one token
  at a time; its on_pause hook parks the generation loop between two
  tokens (keep mode: the sequence so far is kept) and acknowledges only
  once it is parked; on_resume lets it continue.
* Once the engine has produced PAUSE_AFTER tokens, the trainer (GPU 0, one
  optimizer step on a differently initialised model) pauses the engines in
  keep mode, updates the weights by NCCL through the daemon and resumes.
* The tokens before the pause follow the old weights; the tokens after it
  equal the trainer model's greedy continuation of the same prefix; every
  engine parameter equals the trainer's bitwise.

    python3 examples/rlhf_async.py path/to/weightsyncd path/to/weightsync_gpu_worker

Prints PASS/FAIL lines; exits non-zero on failure.
"""

import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402

PROMPT = [3, 141, 59, 26, 535]
TOTAL_TOKENS = 40
PAUSE_AFTER = 10
TOKEN_DELAY_S = 0.1   # after PAUSE_AFTER, so the pause lands mid-generation


class Gate:
    """Pause/resume between tokens, driven by the engine's control hooks."""

    def __init__(self):
        self.cv = threading.Condition()
        self.pause_requested = False
        self.parked = False
        self.generating = False
        self.paused_at = []
        self.modes = []

    def on_pause(self, mode):
        with self.cv:
            self.modes.append(mode)
            self.pause_requested = True
            self.cv.notify_all()
            if not self.cv.wait_for(lambda: self.parked or not self.generating, timeout=30):
                self.pause_requested = False
                raise RuntimeError("generation did not reach a token boundary in 30 s")

    def on_resume(self):
        with self.cv:
            self.pause_requested = False
            self.cv.notify_all()

    def between_tokens(self, i):
        with self.cv:
            if self.pause_requested:
                self.parked = True
                self.paused_at.append(i)
                self.cv.notify_all()
                self.cv.wait_for(lambda: not self.pause_requested)
                self.parked = False


def engine_main(conn, target):
    C.deterministic()
    import torch
    import weightsync
    dev = torch.device("cuda", 1)
    torch.cuda.set_device(dev)
    cfg = C.small_config(tie=False)
    model = C.build_model(cfg, seed=4321, device=dev)
    old_reference = C.greedy(model, PROMPT, TOTAL_TOKENS)   # what the old weights say
    gate = Gate()
    engine = weightsync.Engine("rlhf-async-engine", target, timeout=60)
    engine.register_torch(model)
    engine.start(on_pause=gate.on_pause, on_resume=gate.on_resume)
    C.send(conn, {"ready": True})
    C.recv(conn, 600, "the go-ahead to generate")

    def step(i):
        if i == PAUSE_AFTER:
            C.send(conn, {"threshold": i})
        if i >= PAUSE_AFTER:
            time.sleep(TOKEN_DELAY_S)
        gate.between_tokens(i)

    with gate.cv:
        gate.generating = True
    tokens = C.greedy(model, PROMPT, TOTAL_TOKENS, between_tokens=step)
    with gate.cv:
        gate.generating = False
        gate.cv.notify_all()
    C.send(conn, {"tokens": tokens, "old_reference": old_reference,
                  "paused_at": gate.paused_at, "modes": gate.modes, "version": engine.version,
                  "digests": C.digests(model.named_parameters())})
    C.recv(conn, 60, "the end")


def trainer_main(conn, target):
    C.deterministic()
    import torch
    import weightsync
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    cfg = C.small_config(tie=False)
    model = C.build_model(cfg, seed=77, device=dev)
    C.train_step(model, cfg, seed=8)
    trainer = weightsync.Trainer(target, timeout=120)
    trainer.init_nccl(device=0)
    C.send(conn, {"ready": True})
    C.recv(conn, 600, "the go-ahead to update")
    t0 = time.perf_counter()
    with trainer.paused(mode="keep"):
        result = trainer.update(model.named_parameters(), version=1)
    seconds = time.perf_counter() - t0
    C.send(conn, {"version": result.version, "seconds": seconds})
    msg = C.recv(conn, 600, "the prefix to continue")
    cont = C.greedy(model, msg["prefix"], msg["n"])
    C.send(conn, {"continuation": cont, "digests": C.digests(model.named_parameters())})
    C.recv(conn, 60, "the end")


def main():
    daemon_bin, worker_bin = C.binaries(sys.argv)
    check = C.Checks()

    daemon = C.Daemon(daemon_bin, worker_bin, gpu=1)
    engine = trainer = None
    try:
        engine = C.Worker(engine_main, daemon.target)
        trainer = C.Worker(trainer_main, daemon.target)
        engine.recv(600, "the engine's registration")
        trainer.recv(600, "the trainer's NCCL group")
        engine.send({"generate": True})
        engine.recv(600, "the engine's first tokens")
        trainer.send({"update": True})
        t = trainer.recv(600, "the trainer's update")
        print(f"trainer: paused (keep), updated to v{t['version']}, resumed in "
              f"{t['seconds']:.3f} s")
        e = engine.recv(600, "the engine's generation")
        check(len(e["paused_at"]) == 1, f"generation paused once mid-way, before token "
              f"{e['paused_at']} of {TOTAL_TOKENS} (modes {e['modes']})")
        k = e["paused_at"][0] if e["paused_at"] else TOTAL_TOKENS
        check(PAUSE_AFTER <= k < TOTAL_TOKENS, f"the pause landed after the threshold "
              f"({PAUSE_AFTER}) and before the end ({k})")
        check(e["modes"][:1] == ["PAUSE_MODE_KEEP"], "the pause was in keep mode")
        check(e["version"] == 1, f"engine at version {e['version']}")
        tokens = e["tokens"]
        print(f"  engine tokens: {tokens[:k]} | {tokens[k:]}")
        check(tokens[:k] == e["old_reference"][:k],
              f"the {k} tokens before the pause follow the old weights")
        trainer.send({"prefix": PROMPT + tokens[:k], "n": TOTAL_TOKENS - k})
        c = trainer.recv(600, "the trainer's continuation")
        print(f"  trainer continuation of the same prefix: {c['continuation']}")
        check(tokens[k:] == c["continuation"], "the tokens after the pause equal the trainer "
              "model's greedy continuation (new weights)")
        check(tokens[k:] != e["old_reference"][k:],
              "and differ from what the old weights would have said")
        bad, missing = C.compare_digests(e["digests"], c["digests"])
        check(not bad and not missing, f"every engine parameter equals the trainer's bitwise "
              f"({len(e['digests'])} parameters; differing {bad[:5]})")
        for w in (engine, trainer):
            w.send({"end": True})
    except Exception as ex:
        check(False, f"{type(ex).__name__}: {ex}")
    finally:
        for w in (engine, trainer):
            if w is not None:
                w.proc.join(10)
                w.stop()
        daemon.stop()
    return check.finish("rlhf_async")


if __name__ == "__main__":
    sys.exit(main())

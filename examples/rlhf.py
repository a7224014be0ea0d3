#!/usr/bin/env python3
"""RLHF weight sync through weightsyncd, on two GPUs (the weightsync version
of vLLM's examples/offline_inference/new_weight_syncing/rlhf.py).

* An "engine" process on GPU 1 holds a small Qwen3-style transformers model
  with random weights (tied embeddings) and generates gibberish.
* A trainer process on GPU 0 holds the same architecture, initialised
  differently, and takes one optimizer step.
* weightsyncd (NCCL rank on GPU 1) moves the trainer's weights into the
  engine's parameters in place: the engine registered them by CUDA IPC
  (Engine.register_torch), the trainer broadcasts by NCCL (Trainer.init_nccl
  / update).
* Afterwards every engine parameter equals the trainer's bit for bit and
  the engine's greedy generation equals the trainer model's.

    python3 examples/rlhf.py path/to/weightsyncd path/to/weightsync_gpu_worker
    # or WEIGHTSYNCD=... WEIGHTSYNC_GPU_WORKER=... python3 examples/rlhf.py

Prints PASS/FAIL lines; exits non-zero on failure.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402

NEW_TOKENS = 16


def engine_main(conn, target):
    C.deterministic()
    import torch
    import weightsync
    dev = torch.device("cuda", 1)
    torch.cuda.set_device(dev)
    cfg = C.small_config(tie=True)
    model = C.build_model(cfg, seed=1234, device=dev)
    engine = weightsync.Engine("rlhf-engine", target, timeout=60)
    events = []
    registered = engine.register_torch(model, version=0)
    engine.start(on_pause=lambda mode: events.append(f"pause {mode}"),
                 on_resume=lambda: events.append("resume"),
                 on_new_version=lambda v: events.append(f"version {v}"))
    before = [C.greedy(model, p, NEW_TOKENS) for p in C.PROMPTS]
    C.send(conn, {"ready": True, "params": len(registered), "aliases": engine.aliases,
                  "before": before})
    msg = C.recv(conn, 600, "the go-ahead to check")
    if not engine.wait_for_version(msg["version"], 60):
        raise RuntimeError(f"engine still at version {engine.version}")
    after = [C.greedy(model, p, NEW_TOKENS) for p in C.PROMPTS]
    C.send(conn, {"after": after, "digests": C.digests(model.named_parameters()),
                  "version": engine.version, "events": events})
    C.recv(conn, 60, "the end")


def trainer_main(conn, target):
    C.deterministic()
    import torch
    import weightsync
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    cfg = C.small_config(tie=True)
    model = C.build_model(cfg, seed=99, device=dev)
    loss = C.train_step(model, cfg, seed=7)
    expected = [C.greedy(model, p, NEW_TOKENS) for p in C.PROMPTS]
    C.recv(conn, 600, "the go-ahead to sync")
    trainer = weightsync.Trainer(target, timeout=120)
    trainer.init_nccl(device=0)
    # state_dict() names lm_head.weight and embed_tokens.weight for the one
    # tied tensor: the client sends it once, as the engine registered it.
    result = trainer.update(model.state_dict().items(), version=1)
    C.send(conn, {"loss": loss, "expected": expected, "digests": C.digests(model.named_parameters()),
                  "version": result.version, "engines": [e.engine_id for e in result.engines],
                  "timings": trainer.last_timings, "seconds": result.seconds})
    C.recv(conn, 60, "the end")


def main():
    daemon_bin, worker_bin = C.binaries(sys.argv)
    check = C.Checks()

    daemon = C.Daemon(daemon_bin, worker_bin, gpu=1)
    engine = trainer = None
    try:
        engine = C.Worker(engine_main, daemon.target)
        trainer = C.Worker(trainer_main, daemon.target)
        ready = engine.recv(600, "the engine's registration")
        print(f"engine: {ready['params']} parameters registered by CUDA IPC on GPU 1 "
              f"(aliases left out: {ready['aliases']})")
        for p, toks in zip(C.PROMPTS, ready["before"]):
            print(f"  before sync: {p} -> {toks}")
        trainer.send({"go": True})
        t = trainer.recv(600, "the trainer's update")
        print(f"trainer: one training step (loss {t['loss']:.3f}), update v{t['version']} to "
              f"{t['engines']} in {t['seconds']:.3f} s (daemon), client timings "
              f"{ {k: round(v, 4) for k, v in t['timings'].items()} }")
        engine.send({"version": 1})
        e = engine.recv(600, "the engine's check")
        check(e["version"] == 1, f"engine at version {e['version']} (want 1)")
        bad, missing = C.compare_digests(e["digests"], t["digests"])
        check(not bad and not missing and len(t["digests"]) == len(e["digests"]),
              f"every engine parameter equals the trainer's bitwise ({len(e['digests'])} "
              f"parameters; differing {bad[:5]}, unknown {missing[:5]})")
        check(ready["before"] != t["expected"], "the engine's generation before the sync "
              "differs from the trained model's (random weights: gibberish)")
        for p, got, want in zip(C.PROMPTS, e["after"], t["expected"]):
            print(f"  after sync:  {p} -> {got}")
            check(got == want, f"greedy generation equals the trainer model's for prompt {p}")
        check("pause PAUSE_MODE_KEEP" in e["events"] and "resume" in e["events"],
              f"the engine was paused and resumed around the update ({e['events']})")
        for w in (engine, trainer):
            w.send({"end": True})
    except Exception as ex:  # a worker failed or timed out
        check(False, f"{type(ex).__name__}: {ex}")
    finally:
        for w in (engine, trainer):
            if w is not None:
                w.proc.join(10)
                w.stop()
        daemon.stop()
    return check.finish("rlhf")


if __name__ == "__main__":
    sys.exit(main())

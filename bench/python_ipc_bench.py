#!/usr/bin/env python3
"""The Python user's colocated update on ONE GPU, from where the user
stands: Qwen3-8B-shaped bf16 tensors (399, 16.4 GB) in a trainer process,
the same shapes registered by an engine process (Engine.register_torch), the
daemon's IPC data plane on the same GPU. In one run:

  copy_s                 plain on-GPU copy of the same bytes (per tensor
                         copy_ in the trainer process): the ceiling
  update_s_receipts_off  Trainer.update(..., verify=False), call to return
  update_s_default       Trainer.update(...) as documented (receipts on)
  packed_s_receipts_off  the packed path (init_ipc(packed=True)) for comparison
  expected_receipts_s    the trainer's expected receipt for the manifest alone
  first_update_s         the first Trainer.update(...) as documented (receipts
                         on) right after init_ipc(), in a fresh process: what
                         the user waits for once (issue 30's warm start: at
                         most 2x update_s_default); init_ipc_s is the init
                         that warms the kernels, first_update_ratio the two
                         updates' ratio
  first_update_prepared_s the same in a second trainer process that passes
                         its tensors to init_ipc(tensors=...) (registered
                         with their receipt tables in init; Triton's cache
                         is warm by then); first_update_prepared_ratio
                         against that process's own steady
                         update_s_default_prepared

medians of REPEATS updates after a first one (which registers the source).

    python3 bench/python_ipc_bench.py WEIGHTSYNCD WEIGHTSYNC_GPU_WORKER [OUT_JSON]

Writes OUT_JSON (default bench/results/python_ipc.json) with the fields the
issue names; BENCH_MODEL=small for a quick dry run.
"""

import datetime
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
import _common as C  # noqa: E402

QWEN3_8B = {"vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 12288,
            "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
            "head_dim": 128, "model_type": "qwen3", "tie_word_embeddings": False}
MODEL = os.environ.get("BENCH_MODEL", "qwen3-8b")
REPEATS = int(os.environ.get("BENCH_REPEATS", "7"))
GPU = 0


def model_config(model=MODEL):
    """Qwen3-8B's config, or a small one of the same family (BENCH_MODEL=small)."""
    cfg = dict(QWEN3_8B)
    if model == "small":
        cfg.update(vocab_size=8192, hidden_size=512, intermediate_size=1024,
                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    return cfg


def shapes():
    from weightsync import layouts
    return layouts.checkpoint_shapes(model_config())


def engine_main(conn, target):
    import torch
    import weightsync
    dev = torch.device("cuda", GPU)
    torch.cuda.set_device(dev)
    params = [(n, torch.zeros(s, dtype=torch.bfloat16, device=dev)) for n, s in shapes()]
    engine = weightsync.Engine("bench-engine", target, timeout=120)
    t = time.perf_counter()
    engine.register_torch(params)
    reg = time.perf_counter() - t
    engine.start()
    C.send(conn, {"ready": True, "register_s": reg})
    C.recv(conn, 1800, "the end")
    C.send(conn, {"version": engine.version})


def timed_cuda(fn, dev):
    import torch
    torch.cuda.synchronize(dev)
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize(dev)
    return time.perf_counter() - t


def trainer_main(conn, target):
    import torch
    import weightsync
    from weightsync import receipts
    dev = torch.device("cuda", GPU)
    torch.cuda.set_device(dev)
    pairs = []
    for i, (n, s) in enumerate(shapes()):
        t = torch.empty(s, dtype=torch.bfloat16, device=dev)
        t.normal_(generator=torch.Generator(device=dev).manual_seed(i + 1))
        pairs.append((n, t))
    nbytes = sum(t.numel() * t.element_size() for _, t in pairs)
    out = {"bytes": nbytes, "tensors": len(pairs)}
    # The ceiling: the same bytes copied once on the GPU.
    dst = [torch.empty_like(t) for _, t in pairs]

    def copy_all():
        for d, (_, t) in zip(dst, pairs):
            d.copy_(t)
    copy_all()
    out["copy_s"] = statistics.median(timed_cuda(copy_all, dev) for _ in range(REPEATS))
    del dst
    torch.cuda.empty_cache()
    trainer = weightsync.Trainer(target, timeout=300)
    version = [0]

    def series(verify, key):
        times, timings = [], []
        for i in range(REPEATS + 1):
            version[0] += 1
            torch.cuda.synchronize(dev)
            t = time.perf_counter()
            trainer.update(pairs, version=version[0], verify=verify)
            dt = time.perf_counter() - t
            if i:   # the first registers the source / warms the worker
                times.append(dt)
                timings.append(trainer.last_timings)
            else:
                out[key + "_first"] = dt
        out[key] = statistics.median(times)
        out[key + "_all"] = times
        out[key + "_timings"] = timings[len(timings) // 2]

    t = time.perf_counter()
    trainer.init_ipc(device=GPU)
    out["init_ipc_s"] = time.perf_counter() - t
    out["warmed"] = trainer.warmed
    # Receipts on first: the first update of the process is the user's.
    series(True, "update_s_default")
    out["first_update_s"] = out["update_s_default_first"]
    out["first_update_ratio"] = out["first_update_s"] / out["update_s_default"]
    series(False, "update_s_receipts_off")
    # The trainer holding a pause across updates (trainer.paused()): no
    # pause or resume round trip to the engines per update.
    with trainer.paused():
        series(False, "held_pause_s_receipts_off")
        series(True, "held_pause_s_default")
    out["daemon_timings_default"] = str(trainer.last_results[0].timings).replace("\n", " ")
    # The trainer's expectation alone, for the layout the engine registered.
    layout = trainer.status().engines  # noqa: F841 (warms the channel)
    layouts = {e.engine_id: e.layout for e in
               trainer._stub.call("GetStatus", include_layouts=True).engines}
    from weightsync._gpu import dtype_name, flat_bytes, elements
    sent = {n: (dtype_name(n, t), list(t.shape), elements(flat_bytes(n, t),
                                                          dtype_name(n, t)))
            for n, t in pairs}
    exp = []
    for _ in range(3):
        torch.cuda.synchronize(dev)
        t = time.perf_counter()
        receipts.expected_receipt_arrays(layouts["bench-engine"], sent)
        torch.cuda.synchronize(dev)
        exp.append(time.perf_counter() - t)
    out["expected_receipts_s"] = statistics.median(exp)
    trainer.init_ipc(device=GPU, packed=True)
    series(False, "packed_s_receipts_off")
    out["version"] = version[0]
    C.send(conn, out)
    C.recv(conn, 60, "the end")


def prepared_trainer_main(conn, target):
    """A second trainer process, as the warm start documents it: the same
    tensors passed to init_ipc(tensors=...), which registers them and builds
    their receipt tables; then the first update and REPEATS more, timed."""
    import torch
    import weightsync
    dev = torch.device("cuda", GPU)
    torch.cuda.set_device(dev)
    version = C.recv(conn, 1800, "the first version")["version"]
    pairs = []
    for i, (n, s) in enumerate(shapes()):
        t = torch.empty(s, dtype=torch.bfloat16, device=dev)
        t.normal_(generator=torch.Generator(device=dev).manual_seed(i + 7))
        pairs.append((n, t))
    trainer = weightsync.Trainer(target, timeout=120)
    torch.cuda.synchronize(dev)
    t = time.perf_counter()
    trainer.init_ipc(device=GPU, tensors=pairs)
    out = {"init_ipc_prepared_s": time.perf_counter() - t, "prepared": trainer.prepared}
    times = []
    for i in range(REPEATS + 1):
        torch.cuda.synchronize(dev)
        t = time.perf_counter()
        trainer.update(pairs, version=version + i)
        times.append(time.perf_counter() - t)
    out["first_update_prepared_s"] = times[0]
    out["update_s_default_prepared"] = statistics.median(times[1:])
    out["first_update_prepared_ratio"] = times[0] / out["update_s_default_prepared"]
    C.send(conn, out)
    C.recv(conn, 60, "the end")


def main():
    daemon_bin, worker_bin = C.binaries(sys.argv)
    out_path = sys.argv[3] if len(sys.argv) > 3 else os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "results", "python_ipc.json")
    d = C.Daemon(daemon_bin, worker_bin, gpu=GPU)
    engine = trainer = None
    try:
        engine = C.Worker(engine_main, d.target)
        e = engine.recv(600, "the engine's registration")
        trainer = C.Worker(trainer_main, d.target)
        r = trainer.recv(1800, "the trainer's figures")
        trainer.send({"end": True})
        trainer.stop()
        trainer = C.Worker(prepared_trainer_main, d.target)
        trainer.send({"version": r["version"] + 1})
        r.update(trainer.recv(1800, "the prepared trainer's figures"))
        trainer.send({"end": True})
        engine.send({"end": True})
        engine.recv(60, "the engine's version")
    finally:
        for w in (trainer, engine):
            if w is not None:
                w.stop()
        d.stop()
    kind = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                          capture_output=True, text=True).stdout.strip()
    commit = os.environ.get("COMMIT") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    res = {"date": datetime.date.today().isoformat(), "kind": kind, "commit": commit,
           "model": f"{MODEL} bf16 shapes -> bf16 engine, one GPU, ipc", **r,
           "engine_register_s": e["register_s"]}
    res["ratio_receipts_off"] = res["copy_s"] / res["update_s_receipts_off"]
    res["ratio_default"] = res["copy_s"] / res["update_s_default"]
    res["ratio_packed_receipts_off"] = res["copy_s"] / res["packed_s_receipts_off"]
    res["ratio_held_pause_receipts_off"] = res["copy_s"] / res["held_pause_s_receipts_off"]
    res["ratio_held_pause_default"] = res["copy_s"] / res["held_pause_s_default"]
    res.setdefault("cpp_ratio_receipts_off", None)
    res.setdefault("cpp_ratio_default", None)
    os.makedirs(os.path.dirname(out_path), exist_ok=True)
    with open(out_path, "w") as f:
        json.dump(res, f, indent=1)
    print(f"{res['tensors']} tensors, {res['bytes'] / 1e9:.2f} GB on {kind}")
    print(f"copy (ceiling)            {res['copy_s'] * 1e3:8.2f} ms")
    for k in ("update_s_receipts_off", "update_s_default",
              "held_pause_s_receipts_off",
              "held_pause_s_default", "packed_s_receipts_off"):
        print(f"{k:25s} {res[k] * 1e3:8.2f} ms  ratio {res['copy_s'] / res[k]:.3f}"
              f"  (first {res[k + '_first'] * 1e3:.1f} ms)")
    print(f"expected receipts alone   {res['expected_receipts_s'] * 1e3:8.2f} ms")
    print(f"first update (receipts on) {res['first_update_s'] * 1e3:7.2f} ms = "
          f"{res['first_update_ratio']:.2f}x steady; init_ipc {res['init_ipc_s']:.2f} s "
          f"(warmed {res['warmed']})")
    print(f"first update after init_ipc(tensors=...) {res['first_update_prepared_s'] * 1e3:7.2f} "
          f"ms = {res['first_update_prepared_ratio']:.2f}x its steady "
          f"{res['update_s_default_prepared'] * 1e3:.2f} ms; init_ipc "
          f"{res['init_ipc_prepared_s']:.2f} s (prepared {res['prepared']})")
    print(f"wrote {out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

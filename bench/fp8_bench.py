#!/usr/bin/env python3
"""FP8 targets on one GPU (issue 17's benchmark), from where the user stands:
Qwen3-8B-shaped bf16 tensors in a trainer process; two engine processes on
the same GPU with the same llama layout (fused qkv and gate_up): one all
bf16, one whose linear layers are float8_e4m3fn with 128x128 block scales
(layouts.llama_fp8_engine_layout). The daemon's IPC data plane copies
(bf16 engine) or quantises (FP8 engine) from the trainer's registered
tensors. In one run, medians of REPEATS updates after a first one, each
update aimed at one engine (`engine_ids`):

  bf16_update_s / fp8_update_s          Trainer.update(...), receipts on (default)
  bf16_update_s_receipts_off / fp8_...  the same with verify=False
  fp8_wire_update_s[_receipts_off]      the FP8 engine, update(fp8_on_wire=True): the
                                        trainer quantises the linear weights on its
                                        GPU and the packed path carries a byte an
                                        element (`*_bytes`: what the daemon took in)
  wire_quantize_s                       that quantisation alone
  torch_quantize_s                      the trainer-side quantisation frameworks do
                                        today (per 128x128 block amax, scale, cast
                                        to float8_e4m3fn in torch) of the same
                                        linear weights, on the same GPU

    python3 bench/fp8_bench.py WEIGHTSYNCD WEIGHTSYNC_GPU_WORKER [OUT_JSON]

Writes OUT_JSON (default bench/results/fp8.json); BENCH_MODEL=small for a
quick dry run; BENCH_CHUNK_BYTES asks for another chunk size. Each series
also records the medians of the trainer's own timings (`*_parts`: prepare,
start_to_finish, receipts).
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

MODEL = os.environ.get("BENCH_MODEL", "qwen3-8b")
REPEATS = int(os.environ.get("BENCH_REPEATS", "5"))
CHUNK_BYTES = int(os.environ.get("BENCH_CHUNK_BYTES", "0"))   # 0: the daemon's default
GPU = 0
TORCH_DT = {"BFLOAT16": "bfloat16", "FLOAT32": "float32", "FLOAT8_E4M3FN": "float8_e4m3fn"}


def config():
    from python_ipc_bench import model_config
    return model_config(MODEL)


def engine_main(conn, target, kind):
    import torch
    import weightsync
    from weightsync import layouts
    dev = torch.device("cuda", GPU)
    torch.cuda.set_device(dev)
    if kind == "fp8":
        params, segments, quant = layouts.llama_fp8_engine_layout(config())
    else:
        params, segments = layouts.llama_engine_layout(config())
        quant = None
    pairs = [(n, torch.zeros(s, dtype=getattr(torch, TORCH_DT[dt]), device=dev))
             for n, dt, s in params]
    engine = weightsync.Engine(f"engine-{kind}", target, timeout=120)
    t = time.perf_counter()
    engine.register_torch(pairs, segments=segments, quantization=quant)
    reg = time.perf_counter() - t
    engine.start()
    C.send(conn, {"ready": True, "register_s": reg,
                  "bytes": sum(t.numel() * t.element_size() for _, t in pairs),
                  "fp8_bytes": sum(t.numel() for _, t in pairs if t.element_size() == 1)})
    C.recv(conn, 1800, "the end")
    C.send(conn, {"version": engine.version})


def torch_quantize(weights, block=128, fmax=448.0):
    """What trainers do today before sending FP8: per block amax over the
    weight, scale = amax / 448, cast to float8_e4m3fn (saturated)."""
    import torch
    out = []
    for w in weights:
        rows, cols = w.shape
        pr, pc = -rows % block, -cols % block
        x = torch.nn.functional.pad(w.float(), (0, pc, 0, pr))
        xb = x.view((rows + pr) // block, block, (cols + pc) // block, block)
        amax = xb.abs().amax(dim=(1, 3), keepdim=True)
        scale = torch.where(amax > 0, amax / fmax, torch.ones_like(amax))
        q = (xb / scale).clamp(-fmax, fmax).to(torch.float8_e4m3fn)
        out.append((q.view(rows + pr, cols + pc)[:rows, :cols], scale.squeeze()))
    return out


def trainer_main(conn, target):
    import torch
    import weightsync
    from weightsync import layouts
    dev = torch.device("cuda", GPU)
    torch.cuda.set_device(dev)
    pairs = []
    for i, (n, s) in enumerate(layouts.checkpoint_shapes(config())):
        t = torch.empty(s, dtype=torch.bfloat16, device=dev)
        t.normal_(generator=torch.Generator(device=dev).manual_seed(i + 1))
        pairs.append((n, t))
    out = {"bytes_sent": sum(t.numel() * t.element_size() for _, t in pairs),
           "tensors": len(pairs)}
    linear = [t for n, t in pairs if t.dim() == 2 and n.endswith(
        ("proj.weight",)) and "embed" not in n]
    torch_quantize(linear[:2])
    print("trainer: tensors ready", file=sys.stderr, flush=True)
    times = []
    for _ in range(REPEATS):
        torch.cuda.synchronize(dev)
        t = time.perf_counter()
        torch_quantize(linear)
        torch.cuda.synchronize(dev)
        times.append(time.perf_counter() - t)
    out["torch_quantize_s"] = statistics.median(times)
    out["torch_quantize_weights"] = len(linear)
    torch.cuda.empty_cache()
    trainer = weightsync.Trainer(target, timeout=600)
    trainer.init_ipc(device=GPU)
    version = [0]

    def series(engine, verify, key, wire=False):
        times, parts = [], {}
        for i in range(REPEATS + 1):
            version[0] += 1
            torch.cuda.synchronize(dev)
            t = time.perf_counter()
            r = trainer.update(pairs, version=version[0], verify=verify,
                               engine_ids=[f"engine-{engine}"], chunk_bytes=CHUNK_BYTES,
                               fp8_on_wire=wire)
            dt = time.perf_counter() - t
            out[key + "_bytes"] = r.bytes   # what the daemon took in (source or stream)
            if i:
                times.append(dt)
                for k, v in (trainer.last_timings or {}).items():
                    parts.setdefault(k, []).append(v)
            else:
                out[key + "_first"] = dt
        out[key] = statistics.median(times)
        out[key + "_all"] = times
        # Where the time went (the trainer's timings: prepare, Start to
        # Finish on the daemon, the receipts' expectation), medians.
        out[key + "_parts"] = {k: statistics.median(v) for k, v in parts.items()}
        print(f"{key}: {out[key] * 1e3:.2f} ms (first {out[key + '_first'] * 1e3:.1f})",
              file=sys.stderr, flush=True)

    # Interleaved by setting, so a drift of the machine hits both engines.
    series("bf16", False, "bf16_update_s_receipts_off")
    series("fp8", False, "fp8_update_s_receipts_off")
    series("fp8", False, "fp8_wire_update_s_receipts_off", wire=True)
    if os.environ.get("BENCH_RECEIPTS", "on") == "on":
        series("bf16", True, "bf16_update_s")
        series("fp8", True, "fp8_update_s")
        series("fp8", True, "fp8_wire_update_s", wire=True)
    # FP8 on the wire's own part: the trainer's quantisation of every
    # tensor it sends quantised (one Triton launch each), alone.
    from weightsync import wire_fp8
    plan = trainer._wire_plans.plan(trainer._link, ["engine-fp8"], pairs)
    times = []
    for _ in range(REPEATS):
        torch.cuda.synchronize(dev)
        t = time.perf_counter()
        wire_fp8.on_the_wire(pairs, plan)
        torch.cuda.synchronize(dev)
        times.append(time.perf_counter() - t)
    out["wire_quantize_s"] = statistics.median(times)
    out["wire_tensors"] = len(plan)
    out["wire_triton_failed"] = list(wire_fp8._TRITON_FAILED)
    C.send(conn, out)
    C.recv(conn, 60, "the end")


def main():
    daemon_bin, worker_bin = C.binaries(sys.argv)
    out_path = sys.argv[3] if len(sys.argv) > 3 else os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "results", "fp8.json")
    d = C.Daemon(daemon_bin, worker_bin, gpu=GPU)
    engines, trainer = {}, None
    try:
        reg = {}
        for kind in ("bf16", "fp8"):
            engines[kind] = C.Worker(engine_main, d.target, kind)
            reg[kind] = engines[kind].recv(600, f"the {kind} engine's registration")
        trainer = C.Worker(trainer_main, d.target)
        r = trainer.recv(3000, "the trainer's figures")
        trainer.send({"end": True})
        for w in engines.values():
            w.send({"end": True})
            w.recv(60, "the engine's version")
    finally:
        for w in [trainer] + list(engines.values()):
            if w is not None:
                w.stop()
        d.stop()
    kind = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                          capture_output=True, text=True).stdout.strip()
    commit = os.environ.get("COMMIT") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    res = {"date": datetime.date.today().isoformat(), "kind": kind, "commit": commit,
           "model": f"{MODEL} shapes, bf16 trainer tensors -> bf16 engine vs FP8 "
                    "(e4m3fn, 128x128 blocks) engine, one GPU, ipc registered source",
           **r,
           "engine_bytes_bf16": reg["bf16"]["bytes"], "engine_bytes_fp8": reg["fp8"]["bytes"],
           "engine_register_s": {k: v["register_s"] for k, v in reg.items()}}
    if "fp8_update_s" in res:
        res["ratio"] = res["fp8_update_s"] / res["bf16_update_s"]
    res["ratio_receipts_off"] = res["fp8_update_s_receipts_off"] / res["bf16_update_s_receipts_off"]
    # FP8 on the wire against the daemon quantising (the default), same engine.
    if "fp8_wire_update_s" in res:
        res["wire_ratio"] = res["fp8_wire_update_s"] / res["fp8_update_s"]
    res["wire_ratio_receipts_off"] = (res["fp8_wire_update_s_receipts_off"]
                                      / res["fp8_update_s_receipts_off"])
    os.makedirs(os.path.dirname(out_path), exist_ok=True)
    with open(out_path, "w") as f:
        json.dump(res, f, indent=1)
    print(f"{res['tensors']} tensors, {res['bytes_sent'] / 1e9:.2f} GB sent, on {kind}")
    print(f"engine bytes: bf16 {res['engine_bytes_bf16'] / 1e9:.2f} GB, "
          f"fp8 {res['engine_bytes_fp8'] / 1e9:.2f} GB")
    for k in ("bf16_update_s_receipts_off", "fp8_update_s_receipts_off",
              "fp8_wire_update_s_receipts_off", "bf16_update_s", "fp8_update_s",
              "fp8_wire_update_s"):
        if k in res:
            parts = ", ".join(f"{p} {v * 1e3:.2f}" for p, v in res.get(k + "_parts", {}).items())
            print(f"{k:31s} {res[k] * 1e3:9.2f} ms  {res[k + '_bytes'] / 1e9:6.2f} GB  "
                  f"(first {res[k + '_first'] * 1e3:.1f} ms; {parts})")
    print(f"FP8 on the wire: {res['wire_tensors']} tensors quantised by the trainer in "
          f"{res['wire_quantize_s'] * 1e3:.2f} ms (Triton fell back: "
          f"{res['wire_triton_failed'] or 'no'})")
    print(f"ratio fp8/bf16: receipts on {res.get('ratio', float('nan')):.3f}, "
          f"off {res['ratio_receipts_off']:.3f}")
    print(f"ratio fp8 on the wire / daemon quantising: receipts on "
          f"{res.get('wire_ratio', float('nan')):.3f}, off {res['wire_ratio_receipts_off']:.3f}")
    print(f"torch quantisation of the {res['torch_quantize_weights']} linear weights: "
          f"{res['torch_quantize_s'] * 1e3:.2f} ms")
    print(f"wrote {out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

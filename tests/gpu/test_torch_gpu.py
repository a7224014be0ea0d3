#!/usr/bin/env python3
"""GPU test of the Python client's torch halves, on two GPUs:

* engines on GPU 1 register torch tensors by CUDA IPC (Engine.register_torch):
  "plain" (bf16, one torch tensor per parameter, Hugging Face names) and a
  tensor-parallel pair "tp0"/"tp1" (bf16, every parameter a view into one
  flat buffer, fused qkv/gate_up, row/column shards and padded vocab from
  weightsync.layouts); each in its own process;
* a trainer process sends Qwen3-style checkpoint tensors: v1 bf16 by NCCL
  with 1 MiB chunks (many chunks, ring reuse, in-place chunks), v2 bf16 by
  NCCL with the daemon's default chunks, v3 float32 by NCCL (the bf16
  engines convert, round to nearest even), v4 bf16 by CUDA IPC from GPU 1;
* after each version every engine compares every parameter, bit for bit,
  with the expected contents computed on the CPU (through the segments for
  the TP engines; padding rows must keep their sentinel).

    python3 tests/gpu/test_torch_gpu.py WEIGHTSYNCD WEIGHTSYNC_GPU_WORKER
"""

import os
import sys
import zlib

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                "examples"))
import _common as C  # noqa: E402

CONFIG = {"vocab_size": 1000, "hidden_size": 256, "intermediate_size": 512,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "head_dim": 64, "model_type": "qwen3", "tie_word_embeddings": False}
SENTINEL = 7.0
# version -> (checkpoint dtype, how it travels)
PLAN = [(1, "bfloat16", "nccl", 1 << 20), (2, "bfloat16", "nccl", 0),
        (3, "float32", "nccl", 4 << 20), (4, "bfloat16", "ipc", 0)]


def checkpoint(version, dtype):
    """{name: CPU tensor}: deterministic contents per (name, version)."""
    import torch
    from weightsync import layouts
    out = {}
    for name, shape in layouts.checkpoint_shapes(CONFIG):
        g = torch.Generator().manual_seed(zlib.crc32(name.encode()) * 1000 + version)
        out[name] = torch.randn(shape, generator=g).to(getattr(torch, dtype))
    return out


def expected_param(shape, segs, ckpt, name):
    import torch
    if not segs:
        return ckpt[name].to(torch.bfloat16)
    flat = torch.full((int(torch.tensor(shape).prod()),), SENTINEL, dtype=torch.bfloat16)
    for s in segs:
        src = ckpt[s["source"]].to(torch.bfloat16)
        src2 = src.reshape(src.shape[0], -1) if src.dim() else src.reshape(1, 1)
        block = src2[s["row_begin"]:s["row_begin"] + s["row_count"],
                     s["col_begin"]:s["col_begin"] + s["col_count"]]
        stride = s["dest_row_stride"] or s["col_count"]
        for i in range(s["row_count"]):
            o = s["dest_offset"] + i * stride
            flat[o:o + s["col_count"]] = block[i]
    return flat.reshape(shape)


def engine_main(conn, target, engine_id, layout):
    import torch
    import weightsync
    from weightsync import layouts
    dev = torch.device("cuda", 1)
    torch.cuda.set_device(dev)
    results = []
    if layout == "plain":
        shapes = layouts.checkpoint_shapes(CONFIG)
        params = [(n, torch.full(s, SENTINEL, dtype=torch.bfloat16, device=dev))
                  for n, s in shapes]
        segments = {}
    else:
        rank = int(layout[-1])
        specs, segments = layouts.llama_engine_layout(CONFIG, tp_rank=rank, tp_size=2,
                                                      dtype="BFLOAT16")
        sizes = [int(torch.tensor(s).prod()) for _, _, s in specs]
        # One flat buffer, each parameter a view at a 256-element boundary.
        offs, o = [], 0
        for n in sizes:
            offs.append(o)
            o = (o + n + 255) // 256 * 256
        flat = torch.full((o,), SENTINEL, dtype=torch.bfloat16, device=dev)
        params = [(name, flat[a:a + n].view(shape))
                  for (name, _, shape), a, n in zip(specs, offs, sizes)]
    shapes = {n: tuple(t.shape) for n, t in params}

    def verify(version):
        _, dtype, _, _ = next(p for p in PLAN if p[0] == version)
        ckpt = checkpoint(version, dtype)
        bad = [n for n, t in params
               if not torch.equal(t.detach().cpu().view(torch.int16),
                                  expected_param(shapes[n], segments.get(n), ckpt, n)
                                  .view(torch.int16))]
        results.append({"version": version, "bad": bad[:5], "nbad": len(bad)})

    engine = weightsync.Engine(engine_id, target, timeout=60)
    engine.register_torch(params, segments=segments)
    engine.start(on_new_version=verify)
    C.send(conn, {"ready": True, "params": len(params)})
    C.recv(conn, 900, "the end")
    C.send(conn, {"results": results, "version": engine.version})


def trainer_main(conn, target):
    import torch
    import weightsync
    trainer = weightsync.Trainer(target, timeout=120)
    out = []
    backend = None
    for version, dtype, how, chunk in PLAN:
        dev = torch.device("cuda", 0 if how == "nccl" else 1)
        torch.cuda.set_device(dev)
        if how != backend:
            (trainer.init_nccl if how == "nccl" else trainer.init_ipc)(device=dev)
            backend = how
        tensors = [(n, t.to(dev)) for n, t in checkpoint(version, dtype).items()]
        r = trainer.update(tensors, version=version, chunk_bytes=chunk)
        out.append({"version": version, "committed": r.version, "how": how, "dtype": dtype,
                    "engines": sorted(e.engine_id for e in r.engines if not e.lost),
                    "timings": trainer.last_timings})
    # An error carries the daemon's message: versions only go up.
    try:
        trainer.update([(n, t.to(dev)) for n, t in checkpoint(4, "bfloat16").items()],
                       version=2)
        err = None
    except weightsync.WeightSyncError as e:
        err = [e.code, e.message]
    C.send(conn, {"updates": out, "stale_version_error": err})
    C.recv(conn, 60, "the end")


def main():
    daemon_bin, worker_bin = C.binaries(sys.argv)
    check = C.Checks()

    daemon = C.Daemon(daemon_bin, worker_bin, gpu=1)
    workers = []
    try:
        engines = {eid: C.Worker(engine_main, daemon.target, eid, layout)
                   for eid, layout in (("plain", "plain"), ("tp0", "tp0"), ("tp1", "tp1"))}
        workers += list(engines.values())
        for eid, w in engines.items():
            r = w.recv(600, f"engine {eid}'s registration")
            print(f"engine {eid}: {r['params']} parameters registered")
        trainer = C.Worker(trainer_main, daemon.target)
        workers.append(trainer)
        t = trainer.recv(900, "the trainer's updates")
        for u in t["updates"]:
            check(u["committed"] == u["version"] and u["engines"] == ["plain", "tp0", "tp1"],
                  f"v{u['version']} ({u['dtype']} by {u['how']}) committed on "
                  f"{u['engines']}; {({k: round(v, 4) for k, v in u['timings'].items()})}")
        err = t["stale_version_error"]
        check(err is not None and err[0] == "FAILED_PRECONDITION" and "version" in err[1],
              f"a stale version raises WeightSyncError with the daemon's message ({err})")
        for eid, w in engines.items():
            w.send({"end": True})
            r = w.recv(300, f"engine {eid}'s results")
            for res in r["results"]:
                check(res["nbad"] == 0, f"engine {eid} v{res['version']}: every parameter "
                      f"bit-exact ({res['nbad']} differ: {res['bad']})")
            check(len(r["results"]) == len(PLAN), f"engine {eid} verified "
                  f"{len(r['results'])} of {len(PLAN)} versions")
        trainer.send({"end": True})
    except Exception as ex:
        check(False, f"{type(ex).__name__}: {ex}")
    finally:
        for w in workers:
            w.proc.join(10)
            w.stop()
        daemon.stop()
    return check.finish("test_torch_gpu")


if __name__ == "__main__":
    sys.exit(main())

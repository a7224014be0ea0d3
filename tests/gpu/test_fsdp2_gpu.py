#!/usr/bin/env python3
"""GPU proof of weightsync.fsdp.send_fsdp2 (issue 16 part 5), on ONE GPU:
an FSDP2 trainer (torch.distributed.fsdp.fully_shard) sends a small
transformers Qwen3/Llama-style model tensor by tensor, gathered with
DTensor.full_tensor() as the bytes are needed, into an engine process that
registered the same model (Engine.register_torch, bfloat16) on GPU 0,
through the daemon's ipc backend (the lazy path: a ring of chunk slots,
IpcChunks).

    python3 tests/gpu/test_fsdp2_gpu.py WEIGHTSYNCD WEIGHTSYNC_GPU_WORKER
    python3 tests/gpu/test_fsdp2_gpu.py .dev/bin          # a folder holding both

Two trainer set-ups, one after the other against the same engine
(WS_FSDP_MODES=gloo2,nccl1 by default; either alone works):
  * gloo2: two trainer processes, torch.distributed on gloo, the model
    (float32) sharded over both on the CPU; rank 0 holds the Trainer
    (init_ipc on GPU 0) and the gathered tensors are copied to GPU 0 one
    window at a time. This is the case where ranks must gather in step.
    The "training step" between versions changes every shard in place
    (no forward pass on gloo).
  * nccl1: one trainer process, torch.distributed on NCCL with world size
    1, the model sharded on GPU 0 (full_tensor on CUDA DTensors), a real
    optimizer step (AdamW on a next-token loss) between versions.

Checks, each a PASS/FAIL line:
  * every version (three per set-up): one Start .. Finish (the engine saw
    exactly one pause and one resume per version), committed, receipts
    checked (verify=True, summed tensor by tensor as the gathers came);
  * every engine parameter bit for bit equal to the trainer's full tensor
    rounded to bfloat16 (the daemon converts float32 -> bfloat16, round to
    nearest even, as torch's .to(torch.bfloat16) does);
  * each lazy tensor gathered once, and no more than one window of them
    (the tensors one chunk spans) held at a time (Trainer.last_lazy);
  * the trainer's peak GPU memory during the send (torch.cuda.
    max_memory_allocated, reset just before, minus what was allocated
    then) below the full model's bytes, and within the ring plus twice the
    largest window of tensors one chunk spans plus receipt scratch
    (peak_bound);
  * gloo2: a refused update (a version the engine already has) raises
    WeightSyncError FAILED_PRECONDITION on BOTH ranks, and the next update
    lands (no rank left in a collective).

Prints PASS/FAIL lines and "test_fsdp2_gpu: PASS|FAIL"; exits non-zero on
failure.
"""

import os
import socket
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                "examples"))
import _common as C  # noqa: E402  (also puts client/python on sys.path)

GPU = 0
CHUNK = 2 << 20          # 2 MiB chunks: the model is ~112 MB in float32
VERSIONS_PER_MODE = 3


def config():
    """A Qwen3-style config (Llama-style without Qwen3) big enough that one
    chunk's tensors are a small part of it: 8 layers, ~112 MB in float32,
    the largest tensor (the embedding) 8 MiB."""
    kw = dict(vocab_size=4096, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
              num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=256,
              tie_word_embeddings=False)
    try:
        from transformers import Qwen3Config
        cfg = Qwen3Config(head_dim=64, **kw)
    except ImportError:
        from transformers import LlamaConfig
        cfg = LlamaConfig(**kw)
    cfg._attn_implementation = "eager"
    return cfg


def engine_main(conn, target):
    import torch
    import weightsync
    dev = torch.device("cuda", GPU)
    torch.cuda.set_device(dev)
    model = C.build_model(config(), seed=1234, device=dev)   # bf16, other weights
    events = []
    engine = weightsync.Engine("engine-0", target, timeout=120)
    engine.register_torch(model)
    engine.start(on_pause=lambda mode: events.append("pause"),
                 on_resume=lambda: events.append("resume"),
                 on_new_version=lambda v: events.append(f"v{v}"))
    C.send(conn, {"ready": True, "params": len(list(model.parameters()))})
    while True:
        cmd = C.recv(conn, 1800, "a command")
        if cmd["op"] == "state":
            ok = engine.wait_for_version(cmd["version"], 60)
            torch.cuda.synchronize(dev)
            C.send(conn, {"version": engine.version, "reached": ok, "events": list(events),
                          "digests": C.digests(model.named_parameters())})
        else:
            C.send(conn, {"bye": True})
            return


def _fully_shard():
    try:
        from torch.distributed.fsdp import fully_shard   # torch >= 2.6
    except ImportError:
        from torch.distributed._composable.fsdp import fully_shard   # 2.4, 2.5
    return fully_shard


def _perturb(model, version):
    """gloo2's "training step": every shard changed in place, the same on
    every rank (elementwise ops on DTensors act on the local shards)."""
    import torch
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.mul_(0.97).add_(1e-3 * ((version * 7 + i) % 13 - 6))


def _train(model, cfg, version, report):
    """nccl1's training step: forward, backward, AdamW through FSDP2; the
    in-place change of gloo2 if this torch/transformers can't (said in the
    report)."""
    try:
        loss = C.train_step(model, cfg, seed=version)
        report.setdefault("steps", []).append(f"v{version}: AdamW step, loss {loss:.4f}")
    except Exception as e:  # noqa: BLE001 - a world of one: no rank can be left behind
        report.setdefault("steps", []).append(f"v{version}: AdamW step failed ({type(e).__name__}:"
                                              f" {e}); changed in place instead")
        _perturb(model, version)


def trainer_main(conn, mode, rank, world, port, target, versions):
    import time
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    import weightsync
    from weightsync.fsdp import send_fsdp2
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    gpu = torch.device("cuda", GPU)
    if mode == "nccl1":
        torch.cuda.set_device(gpu)
        dist.init_process_group("nccl", rank=rank, world_size=world)
        mesh = init_device_mesh("cuda", (world,))
        where = gpu
    else:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        mesh = init_device_mesh("cpu", (world,))
        where = torch.device("cpu")
        if rank == 0:
            torch.cuda.set_device(gpu)
    cfg = config()
    model = C.build_model(cfg, seed=5, device=where, dtype_name="float32")
    fully_shard = _fully_shard()
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    named = list(model.named_parameters())
    from weightsync.receipts import gpu as receipts_gpu
    report = {"rank": rank, "mode": mode, "triton": receipts_gpu.available(),
              "dtensors": sum(1 for _, p in named if callable(getattr(p, "full_tensor", None))),
              "params": len(named),
              "model_bytes": sum(int(torch.Size(p.shape).numel()) * p.element_size()
                                 for _, p in named),
              "largest_bytes": max(int(torch.Size(p.shape).numel()) * p.element_size()
                                   for _, p in named)}
    trainer = None
    if rank == 0:
        trainer = weightsync.Trainer(target, timeout=300)
        trainer.init_ipc(device=GPU)

    def full_bf16():
        """Every parameter gathered again (a collective: every rank), as
        the engine must hold it."""
        out = []
        with torch.no_grad():
            for n, p in model.named_parameters():
                t = p.full_tensor() if callable(getattr(p, "full_tensor", None)) else p
                out.append((n, t.detach().to(torch.bfloat16)))
        return out

    for k, v in enumerate(versions):
        if k:
            if mode == "nccl1":
                _train(model, cfg, v, report)
            else:
                _perturb(model, v)
        if rank == 0:
            torch.cuda.synchronize(gpu)
            base = torch.cuda.memory_allocated(gpu)
            torch.cuda.reset_peak_memory_stats(gpu)
        t0 = time.perf_counter()
        error = None
        try:
            r = send_fsdp2(trainer, model, v, chunk_bytes=CHUNK, verify=True)
        except weightsync.WeightSyncError as e:
            r, error = None, f"{e.code}: {e.message}"
        seconds = time.perf_counter() - t0
        if rank == 0:   # before the gathers below, which are the check's, not the send's
            torch.cuda.synchronize(gpu)
            peak = torch.cuda.max_memory_allocated(gpu) - base
        expect = full_bf16()
        if rank == 0:
            C.send(conn, {"version": v, "error": error,
                          "committed": r.version if r is not None else None,
                          "receipts": sum(1 for e in r.engines if e.HasField("receipt"))
                          if r is not None else 0,
                          "seconds": seconds, "peak_bytes": peak, "base_bytes": base,
                          "lazy": dict(trainer.last_lazy), "timings": trainer.last_timings,
                          "digests": C.digests(expect),
                          "nonzero": sum(1 for _, t in expect if t.numel())})
            C.recv(conn, 900, "go on")
        else:
            report.setdefault("returned", []).append(error or repr(r))
        del expect
        dist.barrier()
    if mode == "gloo2":
        # A version the engine already has: refused at Start on rank 0,
        # raised on every rank with rank 0's code; then the next lands.
        codes = []
        try:
            send_fsdp2(trainer, model, versions[-1], chunk_bytes=CHUNK)
            codes.append("no error")
        except weightsync.WeightSyncError as e:
            codes.append(e.code)
        try:
            r = send_fsdp2(trainer, model, versions[-1] + 1, chunk_bytes=CHUNK)
            codes.append("ok" if rank else f"ok v{r.version}")
        except weightsync.WeightSyncError as e:
            codes.append(f"{e.code}: {e.message}")
        report["refused_then"] = codes
        dist.barrier()
    report["names"] = [n for n, _ in named[:3]]
    C.send(conn, report)
    C.recv(conn, 900, "the end")
    dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def peak_bound(lazy_info, largest, triton):
    """What the send may hold on the GPU at most: the ring, twice the
    largest window of tensors one chunk spans (a window, and the copies a
    gather or a move to the GPU makes of it), and the receipts' scratch
    (Triton: small tables; torch int64 ops: several int64 arrays of a
    tensor's size)."""
    scratch = (16 << 20) + (2 if triton else 12) * largest
    return lazy_info.get("ring_bytes", 0) + 2 * lazy_info.get("window_bytes", 0) + scratch


def main():
    daemon_bin, worker_bin = C.binaries(sys.argv)
    modes = [m for m in os.environ.get("WS_FSDP_MODES", "gloo2,nccl1").split(",") if m]
    check = C.Checks()
    d = C.Daemon(daemon_bin, worker_bin, gpu=GPU)
    engine = None
    workers = []
    try:
        engine = C.Worker(engine_main, d.target)
        ready = engine.recv(600, "the engine's registration")
        check(ready["params"] > 0, f"engine registered {ready['params']} parameters")
        version = 1
        seen = 0   # engine events already looked at
        for mode in modes:
            if mode not in ("gloo2", "nccl1"):
                check(False, f"unknown mode {mode!r} (WS_FSDP_MODES: gloo2, nccl1)")
                continue
            world = 2 if mode == "gloo2" else 1
            versions = list(range(version, version + VERSIONS_PER_MODE))
            port = free_port()
            workers = [C.Worker(trainer_main, mode, r, world, port, d.target, versions)
                       for r in range(world)]
            sends = []
            for v in versions:
                t = workers[0].recv(1800, f"{mode} v{v}")
                engine.send({"op": "state", "version": v})
                e = engine.recv(300, "the engine's state")
                tag = f"{mode} v{v}"
                check(t["error"] is None and t["committed"] == v and e["version"] == v,
                      f"{tag}: committed, engine at v{e['version']} ({t['error']})")
                bad, missing = C.compare_digests(e["digests"], t["digests"])
                check(not bad and not missing,
                      f"{tag}: every engine parameter bit for bit the trainer's full tensor in "
                      f"bf16 ({len(bad)} differ, e.g. {bad[:3]}; {len(missing)} not sent)")
                new = e["events"][seen:]
                seen = len(e["events"])
                check([x for x in new if x in ("pause", "resume")] == ["pause", "resume"],
                      f"{tag}: one pause and one resume for the whole model ({new})")
                check(t["receipts"] == 1, f"{tag}: receipts checked")
                lz = t["lazy"]
                check(lz.get("made") == t["nonzero"],
                      f"{tag}: each of {t['nonzero']} tensors gathered once ({lz.get('made')})")
                check(lz.get("peak_bytes", 1 << 62) <= lz.get("window_bytes", 0),
                      f"{tag}: at most one window of gathered tensors held at a time "
                      f"({lz.get('peak_bytes')} <= {lz.get('window_bytes')} bytes)")
                print(f"  {tag}: {t['seconds']:.3f} s, peak GPU memory of the send "
                      f"{t['peak_bytes'] / 2**20:.1f} MiB (allocated before: "
                      f"{t['base_bytes'] / 2**20:.1f} MiB), lazy {lz}, timings {t['timings']}",
                      flush=True)
                sends.append(t)
                workers[0].send({"go": True})
            reports = [w.recv(900, f"{mode} rank {i}'s report") for i, w in enumerate(workers)]
            r0 = reports[0]
            print(f"  {mode}: {r0['params']} parameters ({r0['dtensors']} DTensors), model "
                  f"{r0['model_bytes'] / 2**20:.1f} MiB in float32, largest tensor "
                  f"{r0['largest_bytes'] / 2**20:.1f} MiB, Triton receipts {r0['triton']}; "
                  f"names {r0['names']}; {r0.get('steps', '')}", flush=True)
            check(r0["dtensors"] == r0["params"], f"{mode}: every parameter is a DTensor")
            for t in sends:
                peak, lz = t["peak_bytes"], t["lazy"]
                check(peak < r0["model_bytes"],
                      f"{mode} v{t['version']}: peak GPU memory of the send "
                      f"{peak / 2**20:.1f} MiB below the whole model's "
                      f"{r0['model_bytes'] / 2**20:.1f} MiB")
                bound = peak_bound(lz, r0["largest_bytes"], r0["triton"])
                check(peak <= bound,
                      f"{mode} v{t['version']}: peak {peak / 2**20:.1f} MiB within ring "
                      f"{lz.get('ring_bytes', 0) / 2**20:.1f} + 2 x window "
                      f"{lz.get('window_bytes', 0) / 2**20:.1f} + receipt scratch = "
                      f"{bound / 2**20:.1f} MiB")
            for i, r in enumerate(reports[1:], 1):
                check(all(x == "None" for x in r.get("returned", [])),
                      f"{mode} rank {i}: send_fsdp2 returned None every time "
                      f"({r.get('returned')})")
            version = versions[-1] + 1
            if mode == "gloo2":
                codes = [r["refused_then"] for r in reports]
                check(all(c[0] == "FAILED_PRECONDITION" for c in codes),
                      f"gloo2: a refused version raises FAILED_PRECONDITION on both ranks "
                      f"({[c[0] for c in codes]})")
                check(all(c[1].startswith("ok") for c in codes),
                      f"gloo2: the next version lands on both ranks ({[c[1] for c in codes]})")
                engine.send({"op": "state", "version": version})
                seen = len(engine.recv(300, "the engine's state")["events"])
                version += 1
            for w in workers:
                w.send({"end": True})
            for w in workers:
                w.proc.join(60)
                w.stop()
            workers = []
    except Exception as ex:  # noqa: BLE001 - report, then clean up
        check(False, f"{type(ex).__name__}: {ex}")
    finally:
        for w in workers + ([engine] if engine is not None else []):
            try:
                w.send({"op": "end", "end": True})
            except Exception:  # noqa: BLE001
                pass
            w.stop()
        d.stop()
    return check.finish("test_fsdp2_gpu")


if __name__ == "__main__":
    sys.exit(main())

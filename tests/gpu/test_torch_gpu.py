#!/usr/bin/env python3
"""GPU test of the Python client's torch halves, on two GPUs:

* engines on GPU 1 register torch tensors by CUDA IPC (Engine.register_torch):
  "plain" (bf16, one torch tensor per parameter, Hugging Face names) and a
  tensor-parallel pair "tp0"/"tp1" (bf16, every parameter a view into one
  flat buffer, fused qkv/gate_up, row/column shards and padded vocab from
  weightsync.layouts); each in its own process;
* a trainer process sends Qwen3-style checkpoint tensors: v1 bf16 by NCCL
  with 1 MiB chunks (many chunks, ring reuse, in-place chunks), v2 bf16 by
  NCCL with the daemon's default chunks, v3 sparse patches against v2 by
  NCCL (diffed on the GPU by weightsync.sparse.diff, ~1% of the elements
  changed, one tensor changed whole goes dense, one unchanged goes as a
  one-element patch; 16 KiB chunks), v4 float32 by NCCL (the bf16 engines
  convert, round to nearest even), v5 bf16 by CUDA IPC from GPU 1, v6
  sparse patches against v5 by IPC; v3..v6 with verify=True, so the
  trainer checks every engine's receipt against the expectation it
  computes on its GPU; and a corrupted expectation must raise DATA_LOSS;
* after each version every engine compares every parameter, bit for bit,
  with the expected contents computed on the CPU (through the segments for
  the TP engines; padding rows must keep their sentinel);
* before that, without a daemon, on GPU 0: a GPU sparse diff at ~1% density
  round-trips (before with the patch applied == after, bitwise) and its
  payload is the host diff's; the GPU receipt function
  (receipts.expected_receipt_arrays on CUDA tensors) equals the host one
  (receipts.expected_receipt) on random bit patterns (NaNs, infinities,
  subnormals) of float32/bfloat16/float16 through the TP and plain
  layouts of bfloat16/float16/float32 engines.

    python3 tests/gpu/test_torch_gpu.py WEIGHTSYNCD WEIGHTSYNC_GPU_WORKER

With WS_GPUS=1 (a machine with one GPU) everything runs on GPU 0 and every
version travels by IPC instead (the same six versions, patches and
receipts); tests/gpu/run_python_checks.sh sets it from nvidia-smi.
"""

import os
import sys
import time
import zlib

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                "examples"))
import _common as C  # noqa: E402

CONFIG = {"vocab_size": 1000, "hidden_size": 256, "intermediate_size": 512,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "head_dim": 64, "model_type": "qwen3", "tie_word_embeddings": False}
SENTINEL = 7.0
# (version, checkpoint dtype, how it travels, chunk bytes, base version of
# its sparse patches (0: dense), verify receipts)
PLAN = [(1, "bfloat16", "nccl", 1 << 20, 0, False), (2, "bfloat16", "nccl", 0, 0, False),
        (3, "bfloat16", "nccl", 16 << 10, 2, True), (4, "float32", "nccl", 4 << 20, 0, True),
        (5, "bfloat16", "ipc", 0, 0, True), (6, "bfloat16", "ipc", 0, 5, True)]
ONE_GPU = os.environ.get("WS_GPUS", "2") == "1"
if ONE_GPU:
    PLAN = [(v, d, "ipc", c, b, r) for v, d, _, c, b, r in PLAN]
ENGINE_GPU = 0 if ONE_GPU else 1
MAX_DENSITY = 0.05
CHANGED_WHOLE = "model.norm.weight"                       # a patch would be dense: dense
UNCHANGED = "model.layers.0.input_layernorm.weight"       # a one-element patch


def checkpoint(version, dtype):
    """{name: CPU tensor}: deterministic contents per (name, version). A
    sparse version is its base version with ~1% of each tensor's elements
    new (CHANGED_WHOLE all of them, UNCHANGED none)."""
    import torch
    from weightsync import layouts
    base = next((p[4] for p in PLAN if p[0] == version), 0)
    if base:
        out = checkpoint(base, dtype)
        for name, t in out.items():
            if name == UNCHANGED:
                continue
            g = torch.Generator().manual_seed(zlib.crc32(name.encode()) * 1000 + version)
            flat = t.view(-1)
            n = flat.numel()
            k = n if name == CHANGED_WHOLE else max(1, n // 100)
            idx = torch.randperm(n, generator=g)[:k]
            flat[idx] = torch.randn(k, generator=g).to(t.dtype)
        return out
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
    dev = torch.device("cuda", ENGINE_GPU)
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
        dtype = next(p[1] for p in PLAN if p[0] == version)
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
    from weightsync import receipts, sparse
    trainer = weightsync.Trainer(target, timeout=120)
    out = []
    backend = None
    sent = {}   # what the previous version sent: the base of the patches
    corrupt = None
    for version, dtype, how, chunk, base, verify in PLAN:
        dev = torch.device("cuda", 0 if how == "nccl" else ENGINE_GPU)
        torch.cuda.set_device(dev)
        if how != backend:
            (trainer.init_nccl if how == "nccl" else trainer.init_ipc)(device=dev)
            backend = how
        tensors = [(n, t.to(dev)) for n, t in checkpoint(version, dtype).items()]
        items, kinds = tensors, {}
        if base:
            items = []
            for n, t in tensors:
                p = sparse.diff(sent[n], t, max_density=MAX_DENSITY)
                kinds[n] = ("dense" if p is None else
                            f"patch {p.nnz} {p.index_bytes} {type(p).__name__} "
                            f"{p.indices.device.type}")
                items.append((n, t if p is None else p))
        r = trainer.update(items, version=version, chunk_bytes=chunk, base_version=base,
                           verify=verify)
        sent = dict(tensors)
        out.append({"version": version, "committed": r.version, "how": how, "dtype": dtype,
                    "engines": sorted(e.engine_id for e in r.engines if not e.lost),
                    "timings": trainer.last_timings, "base": base, "verify": verify,
                    "receipts": sum(1 for e in r.engines if e.HasField("receipt")),
                    "bytes": int(r.bytes),
                    "dense_bytes": sum(t.numel() * t.element_size() for _, t in tensors),
                    "kinds": kinds})
        if version == 5:
            # weightsyncctl check's RPC: the daemon reads each engine's GPU
            # memory now; after this full dense update it must give the
            # receipt the update returned.
            checks = {}
            for e in r.engines:
                c = trainer.check(e.engine_id)
                checks[e.engine_id] = [c.receipt.checksum == e.receipt.checksum,
                                       c.version, round(c.seconds, 4)]
            out[-1]["checks"] = checks
            # The receipts just matched (verify=True); an expectation from a
            # tensor with one flipped bit must not: the trainer raises
            # DATA_LOSS naming the engine.
            name = "model.layers.0.mlp.down_proj.weight"   # element 0: on tp0 and plain
            bad = {n: (_dtype_name(t), list(t.shape), t.reshape(-1)) for n, t in tensors}
            flipped = bad[name][2].clone()
            flipped.view(torch.int16)[0] ^= 1 << 9
            bad[name] = (bad[name][0], bad[name][1], flipped)
            try:
                trainer._link.check_receipts(
                    [r], lambda layout: receipts.expected_receipt_arrays(layout, bad))
                corrupt = None
            except weightsync.WeightSyncError as e:
                corrupt = [e.code, e.message]
    # An error carries the daemon's message: versions only go up.
    try:
        trainer.update([(n, t.to(dev)) for n, t in checkpoint(4, "bfloat16").items()],
                       version=2)
        err = None
    except weightsync.WeightSyncError as e:
        err = [e.code, e.message]
    C.send(conn, {"updates": out, "stale_version_error": err, "corrupt_error": corrupt})
    C.recv(conn, 60, "the end")


def _dtype_name(t):
    return {"torch.bfloat16": "BFLOAT16", "torch.float32": "FLOAT32",
            "torch.float16": "FLOAT16"}[str(t.dtype)]


def local_main(conn):
    """No daemon, GPU 0: the GPU sparse diff and the GPU receipt function
    against the host implementations (numpy) on the same data. Sends
    {"checks": [[ok, what], ...]}."""
    import numpy as np
    import torch
    from weightsync import layouts, receipts, sparse
    from weightsync._proto import v1
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    checks = []
    ints = {2: torch.int16, 4: torch.int32}
    g = torch.Generator().manual_seed(5)
    for dtype in (torch.bfloat16, torch.float32, torch.float16):
        es = torch.empty(0, dtype=dtype).element_size()
        before = torch.randn(1000, 999, generator=g).to(dtype).to(dev)
        after = before.clone()
        n = after.numel()
        pos = torch.randperm(n, generator=g)[:n // 100].to(dev)
        after.view(ints[es]).view(-1)[pos] ^= 1   # ~1% of the elements, each changed
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        patch = sparse.diff(before, after, max_density=MAX_DENSITY)
        torch.cuda.synchronize()
        diff_s = time.perf_counter() - t0
        ok = (isinstance(patch, sparse.TorchSparsePatch) and patch.indices.is_cuda
              and patch.values.is_cuda and patch.index_bytes == 4 and patch.nnz == n // 100)
        checks.append([ok, f"GPU diff {dtype}: a TorchSparsePatch on the GPU, nnz "
                       f"{patch.nnz if patch is not None else None} of {n} (want {n // 100}), "
                       f"4-byte indices; {diff_s * 1e3:.2f} ms"])
        if patch is None:
            continue
        patched = before.clone()
        patched.view(-1)[patch.indices] = patch.values
        checks.append([torch.equal(patched.view(ints[es]), after.view(ints[es])),
                       f"GPU diff {dtype}: before + patch == after, bit for bit"])
        checks.append([torch.equal(patch.indices, torch.sort(pos).values),
                       f"GPU diff {dtype}: indices are the changed positions, increasing"])
        host = sparse.diff(before.view(ints[es]).cpu().numpy().view(f"u{es}"),
                           after.view(ints[es]).cpu().numpy().view(f"u{es}"),
                           max_density=MAX_DENSITY)
        checks.append([np.array_equal(patch.payload().cpu().numpy(), host.payload()),
                       f"GPU diff {dtype}: payload (uint32 indices, values) == the host "
                       f"diff's ({patch.payload().numel()} bytes)"])
        dense = after.clone()
        dense.view(ints[es])[::2] ^= 1
        same = sparse.diff(after, after.clone())
        checks.append([sparse.diff(after, dense, max_density=MAX_DENSITY) is None
                       and same.nnz == 1 and int(same.indices[0]) == 0,
                       f"GPU diff {dtype}: 50% changed -> None (dense); unchanged -> one "
                       "element"])

    rng = np.random.default_rng(7)
    shapes = layouts.checkpoint_shapes(CONFIG)
    np_ints = {2: np.int16, 4: np.int32}
    names = {"float32": "FLOAT32", "bfloat16": "BFLOAT16", "float16": "FLOAT16"}
    for src, es in (("float32", 4), ("bfloat16", 2), ("float16", 2)):
        sent_gpu, sent_host = {}, {}
        for name, shape in shapes:
            numel = 1
            for d in shape:
                numel *= d
            raw = rng.integers(0, 256, numel * es, dtype=np.uint8)   # any bits: NaN, inf, ...
            t = torch.from_numpy(raw.view(np_ints[es]).copy()).to(dev).view(getattr(torch, src))
            sent_gpu[name] = (names[src], list(shape), t)
            sent_host[name] = (names[src], list(shape), raw)
        for engine_dtype in ("BFLOAT16", "FLOAT16", "FLOAT32"):
            cases = [("plain", [v1.Parameter(name=n, dtype=getattr(v1, engine_dtype),
                                             shape=list(s)) for n, s in shapes])]
            for rank in (0, 1):
                specs, segs = layouts.llama_engine_layout(CONFIG, tp_rank=rank, tp_size=2,
                                                          dtype=engine_dtype)
                layout = []
                for name, dt, shape in specs:
                    p = v1.Parameter(name=name, dtype=getattr(v1, dt), shape=list(shape))
                    for seg in segs.get(name, []):
                        p.segments.add(**seg)
                    layout.append(p)
                cases.append((f"tp{rank}", layout))
            for what, layout in cases:
                want = receipts.expected_receipt(layout, sent_host)
                t0 = time.perf_counter()
                got = receipts.expected_receipt_arrays(layout, sent_gpu)
                gpu_s = time.perf_counter() - t0
                blocked = receipts.expected_receipt_arrays(layout, sent_gpu, block=4093)
                checks.append([got == want == blocked and want[1] > 0,
                               f"GPU receipt == host receipt: {src} -> {engine_dtype} "
                               f"{what}: {got[0]:016x} {got[1]} params {got[2]} bytes "
                               f"(host {want[0]:016x}; {gpu_s * 1e3:.1f} ms on the GPU)"])
    C.send(conn, {"checks": checks})


def main():
    daemon_bin, worker_bin = C.binaries(sys.argv)
    check = C.Checks()

    workers = []
    try:   # the GPU halves of sparse and receipts against the host code, no daemon
        local = C.Worker(local_main)
        workers.append(local)
        for ok, what in local.recv(600, "the local GPU checks")["checks"]:
            check(ok, what)
    except Exception as ex:
        check(False, f"local GPU checks: {type(ex).__name__}: {ex}")

    daemon = C.Daemon(daemon_bin, worker_bin, gpu=ENGINE_GPU)
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
                  f"v{u['version']} ({u['dtype']} by {u['how']}"
                  f"{', sparse against v%d' % u['base'] if u['base'] else ''}"
                  f"{', receipts checked' if u['verify'] else ''}) committed on "
                  f"{u['engines']}; {({k: round(v, 4) for k, v in u['timings'].items()})}")
            if u["verify"]:
                check(u["receipts"] == 3, f"v{u['version']}: every engine returned a receipt "
                      f"({u['receipts']} of 3) and the trainer's GPU expectation matched it")
            if u["base"]:
                kinds = u["kinds"]
                patches = [n for n, k in kinds.items() if k.startswith("patch")]
                check(kinds.get(CHANGED_WHOLE) == "dense"
                      and kinds.get(UNCHANGED, "").startswith("patch 1 ")
                      and len(patches) == len(kinds) - 1
                      and all(kinds[n].endswith("TorchSparsePatch cuda") for n in patches)
                      and all(kinds[n].split()[2] == "4" for n in patches),
                      f"v{u['version']}: {len(patches)} of {len(kinds)} tensors as GPU patches "
                      f"(4-byte indices), '{CHANGED_WHOLE}' dense, '{UNCHANGED}' one element "
                      f"({kinds.get(CHANGED_WHOLE)}; {kinds.get(UNCHANGED)})")
                check(u["bytes"] < 0.1 * u["dense_bytes"],
                      f"v{u['version']}: {u['bytes']} bytes sent, "
                      f"{100 * u['bytes'] / u['dense_bytes']:.2f}% of the dense "
                      f"{u['dense_bytes']}")
        v5 = next(u for u in t["updates"] if u["version"] == 5)
        check(sorted(v5.get("checks", {})) == ["plain", "tp0", "tp1"] and
              all(ok and v == 5 for ok, v, _ in v5["checks"].values()),
              f"CheckEngine (weightsyncctl check) reads each engine's GPU memory: "
              f"the receipt v5's update returned ({v5.get('checks')})")
        err = t["corrupt_error"]
        check(err is not None and err[0] == "DATA_LOSS" and "engine '" in err[1],
              f"an expectation one bit off raises DATA_LOSS naming the engine ({err})")
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

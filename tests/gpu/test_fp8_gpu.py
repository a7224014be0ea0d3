#!/usr/bin/env python3
"""GPU proof of FP8 targets on the GPU backends (issue 17), on ONE GPU (NCCL
too where a second GPU is visible: NCCL refuses two ranks on one GPU).

    python3 tests/gpu/test_fp8_gpu.py exact WEIGHTSYNCD WEIGHTSYNC_GPU_WORKER
    python3 tests/gpu/test_fp8_gpu.py model WEIGHTSYNCD WEIGHTSYNC_GPU_WORKER

exact: an engine process on GPU 0 holds FP8 weights and scales in torch
  tensors (e4m3 128x128 blocks with partial edges, e5m2 per row, DEQUANT and
  RECIPROCAL scales, a fused q/k/v parameter fed by three tensors, and a
  plain bf16 parameter); a trainer process sends float32 / bfloat16 /
  float16 tensors (NaN, +-inf, a zero block, tiny values) through every GPU
  path: IPC from a registered source, IPC from a packed buffer, IPC staged
  (quantised at the commit), an IPC ring (LazyTensors: chunks arrive one
  slot at a time, as NCCL chunks do), FP8 on the wire (fp8_on_wire=True:
  the trainer quantises on its GPU, the daemon copies bytes and scales as
  they are) streaming and staged, each with small chunk_bytes so blocks
  are cut across chunks; and NCCL streaming, staged and on the wire from
  GPU 1 where there is one. Receipts on (the trainer checks them). Every FP8 byte and
  scale must equal weightsync.fp8 (numpy) applied to the trainer's tensors.
model: a small transformers model (Qwen3/Llama-style config, random init,
  no downloads): the engine's linear layers hold e4m3 weights + 128x128
  block scales, dequantised in their forward (w = fp8.float() * scale);
  the trainer (bf16) updates them by IPC three times with a training step
  between; every FP8 weight and scale equals the reference quantisation of
  the trainer's weights, and the engine's greedy generation equals that of
  the trainer's model with its linear weights quantised and dequantised by
  weightsync.fp8.

Prints PASS/FAIL lines and a verdict; exit 0 only if all pass.
"""

import hashlib
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                "examples"))
import _common as C  # noqa: E402

GPU = 0
PROMPT = [1, 17, 33, 101, 7]
TOKENS = 12
E4 = "FLOAT8_E4M3FN"
E5 = "FLOAT8_E5M2"
DEQ = "SCALE_FORM_DEQUANT"
REC = "SCALE_FORM_RECIPROCAL"

# (name, shape, format, block (None: per row), scale form)
SYN = [
    ("a.weight", (300, 520), E4, (128, 128), DEQ),
    ("b.weight", (200, 384), E5, None, REC),
    ("c.weight", (256, 256), E4, (128, 128), REC),
    ("d.weight", (130, 200), E5, (128, 128), DEQ),
]
FUSED = ("qkv.weight", [("q.weight", 128), ("k.weight", 128), ("v.weight", 128)], 256)
# Experts stacked as a fused MoE layer holds them: [2, 256, 256], each
# expert's gate rows then up rows, scales per matrix [2, 2, 2].
STACKED = ("experts.w13", [("x0.gate", 128), ("x0.up", 128), ("x1.gate", 128),
                           ("x1.up", 128)], 256, 2)
PLAIN = ("n.weight", (1000,))
DTYPES = ["float32", "bfloat16", "float16"]


def sha(raw):
    return hashlib.sha256(raw).hexdigest()


def scale_name(name):
    return name + "_scale_inv"


def scale_shape(shape, block):
    rows, cols = shape
    if block is None:
        return (rows, 1)
    return (-(-rows // block[0]), -(-cols // block[1]))


def quant_fields(name, fmt, block, form):
    from weightsync.receipts import fp8
    return fp8.quantization_fields(fmt, scale_name(name), block, form == REC)


def syn_layout():
    """[(name, shape, torch dtype name)], {segments}, {quantization}."""
    params, segments, quant = [], {}, {}
    for name, shape, fmt, block, form in SYN:
        params.append((name, shape, fmt))
        params.append((scale_name(name), scale_shape(shape, block), "FLOAT32"))
        quant[name] = quant_fields(name, fmt, block, form)
    # The fused weight [rows, cols] and the stacked one [experts, n, cols]:
    # their sources' rows one after another, scales per matrix.
    for name, parts, cols, experts in (FUSED + (1,), STACKED):
        n = sum(r for _, r in parts) // experts
        shape = (n, cols) if experts == 1 else (experts, n, cols)
        params.append((name, shape, E4))
        params.append((scale_name(name), shape[:-2] + scale_shape((n, cols), (128, 128)),
                       "FLOAT32"))
        quant[name] = quant_fields(name, E4, (128, 128), DEQ)
        segs, at = [], 0
        for src, r in parts:
            segs.append({"source": src, "row_begin": 0, "row_count": r, "col_begin": 0,
                         "col_count": cols, "dest_offset": at * cols, "dest_row_stride": cols})
            at += r
        segments[name] = segs
    params.append((PLAIN[0], PLAIN[1], "BFLOAT16"))
    return params, segments, quant


def syn_sources():
    """[(tensor name, shape)] the trainer sends."""
    out = [(name, shape) for name, shape, _, _, _ in SYN]
    out += [(src, (r, FUSED[2])) for src, r in FUSED[1]]
    out += [(src, (r, STACKED[2])) for src, r in STACKED[1]]
    out.append(PLAIN)
    return out


def make_tensors(round_, dev):
    """The trainer's tensors of round `round_`: dtypes rotate per round."""
    import torch
    g = torch.Generator(device="cpu").manual_seed(100 + round_)
    out = {}
    for i, (name, shape) in enumerate(syn_sources()):
        dt = getattr(torch, DTYPES[(i + round_) % 3])
        x = torch.randn(shape, generator=g, dtype=torch.float32) * (10.0 ** (i % 5 - 2))
        if name != PLAIN[0]:
            x[0, 0] = float("nan")
            x[0, 1] = float("inf")
            x[1, 2] = -float("inf")
            x[2, 3] = -float("nan")
            if shape[0] > 128 and shape[1] > 128:
                x[128:256, :128] = 0.0            # a zero block: scale 1
            x[:, -5:] *= 1e-30                     # tiny (fp16: zeros)
            x[3, 4] = 1e30                          # saturates in fp32 blocks
        out[name] = x.to(dt).to(dev).contiguous()
    return out


def f32(t):
    """A tensor's elements widened to float32 on the host, bit by bit as
    common/dtype.cc does: a NaN keeps its sign and payload. (torch's CUDA
    float16 -> float32 conversion gives every NaN as 0x7FFFFFFF, dropping
    the sign that the daemon keeps: the first reference, built with
    .float() on the GPU, differed from the engine in exactly those bytes.)"""
    import numpy as np
    import torch
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.float16:
        return t.view(torch.int16).numpy().view(np.float16).astype(np.float32)
    if t.dtype == torch.bfloat16:
        bits = t.view(torch.int16).numpy().view(np.uint16).astype(np.uint32) << 16
        return bits.view(np.float32)
    return t.float().numpy()


def reference(tensors):
    """{engine parameter name: sha256 of its bytes} that the daemon must
    install from `tensors`, by weightsync.fp8 (numpy)."""
    import numpy as np
    import torch
    from weightsync.receipts import fp8

    ref = {}
    for name, shape, fmt, block, form in SYN:
        br, bc = block or (1, shape[1])
        enc, st = fp8.quantize(f32(tensors[name]), br, bc, fmt, form == REC)
        ref[name] = sha(np.ascontiguousarray(enc, np.uint8).tobytes())
        ref[scale_name(name)] = sha(np.ascontiguousarray(st, "<f4").tobytes())
    # The fused and the stacked weight: the matrix of their rows (the
    # stacked one's scales [2, 2, 2] are the same bytes as [4, 2]).
    for fused, parts in ((FUSED[0], FUSED[1]), (STACKED[0], STACKED[1])):
        x = np.concatenate([f32(tensors[src]) for src, _ in parts], axis=0)
        enc, st = fp8.quantize(x, 128, 128, E4, False)
        ref[fused] = sha(np.ascontiguousarray(enc, np.uint8).tobytes())
        ref[scale_name(fused)] = sha(np.ascontiguousarray(st, "<f4").tobytes())
    n = tensors[PLAIN[0]].to(torch.bfloat16).view(torch.int16).cpu().numpy()
    ref[PLAIN[0]] = sha(n.tobytes())
    return ref


def reference_detail(tensors):
    """{FP8 weight name: (its encodings' bytes, its source as float32 bytes,
    source dtype)} for the synthetic weights (not the fused one): what a
    mismatch report compares element by element."""
    import numpy as np
    from weightsync.receipts import fp8
    out = {}
    for name, shape, fmt, block, form in SYN:
        br, bc = block or (1, shape[1])
        x = f32(tensors[name])
        enc, _ = fp8.quantize(x, br, bc, fmt, form == REC)
        out[name] = (np.ascontiguousarray(enc, np.uint8).tobytes().hex(),
                     np.ascontiguousarray(x, "<f4").tobytes().hex(), str(tensors[name].dtype))
    return out


def engine_digests(pairs):
    import torch
    out = {}
    for name, t in pairs:
        flat = t.detach().contiguous().reshape(-1)
        out[name] = sha(flat.view(torch.uint8).cpu().numpy().tobytes())
    return out


# -- exact ---------------------------------------------------------------------

def exact_engine(conn, target):
    import torch
    import weightsync
    dev = torch.device("cuda", GPU)
    torch.cuda.set_device(dev)
    params, segments, quant = syn_layout()
    pairs = [(name, torch.zeros(shape, dtype=getattr(torch, C_DT[dt]), device=dev))
             for name, shape, dt in params]
    engine = weightsync.Engine("fp8-exact", target, timeout=60)
    engine.register_torch(pairs, segments=segments, quantization=quant)
    engine.start()
    C.send(conn, {"ready": True})
    while True:
        cmd = C.recv(conn, 900, "a command")
        if cmd["op"] == "bytes":   # a mismatch's details: the named tensors' bytes
            torch.cuda.synchronize(dev)
            C.send(conn, {n: t.detach().contiguous().reshape(-1).view(torch.uint8).cpu()
                          .numpy().tobytes().hex() for n, t in pairs if n in cmd["names"]})
            continue
        if cmd["op"] != "state":
            C.send(conn, {"bye": True})
            return
        torch.cuda.synchronize(dev)
        C.send(conn, {"version": engine.version, "digests": engine_digests(pairs)})


C_DT = {E4: "float8_e4m3fn", E5: "float8_e5m2", "FLOAT32": "float32", "BFLOAT16": "bfloat16"}


def exact_rounds(n_gpus):
    """(tag, backend, how, chunk_bytes) in order."""
    rounds = [("ipc source, 64 KiB chunks", "ipc", "source", 64 << 10),
              ("ipc source, default chunks", "ipc", "source", 0),
              ("ipc packed, 48 KiB chunks", "ipc", "packed", 48 << 10),
              ("ipc packed staged, 40 KiB chunks", "ipc", "staged", 40 << 10),
              ("ipc ring (lazy), 32 KiB chunks", "ipc", "ring", 32 << 10),
              # FP8 on the wire (fp8_on_wire=True): the trainer quantises
              # every FP8 weight on its GPU (Triton), the daemon copies the
              # bytes and scales as they are (the packed path).
              ("ipc FP8 on the wire, 48 KiB chunks", "ipc", "wire", 48 << 10),
              ("ipc FP8 on the wire staged, 40 KiB chunks", "ipc", "wire staged", 40 << 10)]
    if n_gpus >= 2:
        rounds += [("nccl from GPU 1, 64 KiB chunks", "nccl", "stream", 64 << 10),
                   ("nccl from GPU 1 staged, 40 KiB chunks", "nccl", "staged", 40 << 10),
                   ("nccl from GPU 1, FP8 on the wire, 64 KiB chunks", "nccl", "wire",
                    64 << 10)]
    return rounds


def exact_trainer(conn, target, n_gpus):
    import torch
    import weightsync
    from weightsync.lazy import LazyTensor
    trainer = weightsync.Trainer(target, timeout=120)
    backend_now = None
    for i, (tag, backend, how, chunk) in enumerate(exact_rounds(n_gpus)):
        version = i + 1
        dev_index = 1 if backend == "nccl" else GPU
        dev = torch.device("cuda", dev_index)
        torch.cuda.set_device(dev)
        key = (backend, how == "packed" or how == "staged")
        if key != backend_now:
            if backend == "nccl":
                trainer.init_nccl(device=dev_index)
            else:
                trainer.init_ipc(device=dev_index, packed=key[1])
            backend_now = key
        tensors = make_tensors(version, dev)
        items = list(tensors.items())
        if how == "ring":
            items = [(n, LazyTensor(n, t.dtype, t.shape, (lambda t=t: t), device=dev))
                     for n, t in items]
        mode = "staged" if how.endswith("staged") else "streaming"
        err = None
        try:
            r = trainer.update(items, version=version, chunk_bytes=chunk, mode=mode,
                               fp8_on_wire=how.startswith("wire"))
            receipts = sum(1 for e in r.engines if e.HasField("receipt"))
        except weightsync.WeightSyncError as e:
            err, receipts = f"{e.code}: {e.message}", 0
        torch.cuda.synchronize(dev)
        # How many tensors travelled quantised (the plan update() used).
        wired = (len(trainer._wire_plans.plan(trainer._link, (), items))
                 if how.startswith("wire") else 0)
        C.send(conn, {"tag": tag, "version": version, "update_error": err, "receipts": receipts,
                      "wired": wired,
                      "dtypes": {n: str(t.dtype) for n, t in tensors.items()},
                      "expect": reference(tensors), "detail": reference_detail(tensors)})
        C.recv(conn, 600, "go on")
    C.send(conn, {"done": True})
    C.recv(conn, 60, "the end")


def run_exact(daemon_bin, worker_bin):
    import torch
    n_gpus = torch.cuda.device_count()
    check = C.Checks()
    d = C.Daemon(daemon_bin, worker_bin, gpu=GPU)
    engine = trainer = None
    rows = []
    try:
        engine = C.Worker(exact_engine, d.target)
        engine.recv(300, "the engine's registration")
        trainer = C.Worker(exact_trainer, d.target, n_gpus)
        while True:
            t = trainer.recv(900, "an update")
            if t.get("done"):
                break
            engine.send({"op": "state"})
            e = engine.recv(300, "the engine's state")
            tag = t["tag"]
            bad = sorted(n for n in t["expect"] if e["digests"].get(n) != t["expect"][n])
            ok_update = t["update_error"] is None
            check(ok_update, f"{tag}: update v{t['version']} ({t['update_error']})")
            check(e["version"] == t["version"], f"{tag}: engine at version {t['version']}")
            check(not bad, f"{tag}: every FP8 byte, scale and plain element equals "
                           f"weightsync.fp8's ({len(bad)} differ: {bad[:4]})")
            detail = [n for n in bad if n in t["detail"]]
            if detail:
                import numpy as np
                engine.send({"op": "bytes", "names": detail})
                got = engine.recv(300, "the engine's bytes")
                for n in detail:
                    ref, src, dt = t["detail"][n]
                    a = np.frombuffer(bytes.fromhex(got[n]), np.uint8)
                    b = np.frombuffer(bytes.fromhex(ref), np.uint8)
                    x = np.frombuffer(bytes.fromhex(src), "<u4")
                    idx = np.flatnonzero(a != b)
                    print(f"  {n} ({dt}): {idx.size} of {a.size} bytes differ; first: " +
                          ", ".join(f"[{i}] engine {a[i]:#04x} ref {b[i]:#04x} "
                                    f"src {x[i]:#010x}" for i in idx[:6]), flush=True)
            check(t["receipts"] == 1, f"{tag}: receipts checked by the trainer")
            if "on the wire" in tag:   # every FP8 weight's source: SYN, q/k/v, the experts
                want = len(SYN) + len(FUSED[1]) + len(STACKED[1])
                check(t["wired"] == want, f"{tag}: {t['wired']} of {want} FP8 weights' "
                                          "sources travelled quantised")
            rows.append((tag, ok_update and not bad and t["receipts"] == 1,
                         ",".join(sorted(set(t["dtypes"].values())))))
            trainer.send({"go": True})
        if n_gpus < 2:
            print("SKIP nccl: one GPU visible (NCCL refuses two ranks on one GPU); the ipc "
                  "ring round feeds the worker chunk by chunk as NCCL does", flush=True)
    finally:
        for w in (trainer, engine):
            if w is not None:
                try:
                    w.send({"op": "end"})
                except Exception:
                    pass
                w.stop()
        d.stop()
    print("\npath                                      result  source dtypes")
    for tag, ok, dts in rows:
        print(f"{tag:<42}{'PASS' if ok else 'FAIL':<8}{dts}")
    return check.finish("test_fp8_gpu exact")


# -- model ---------------------------------------------------------------------

LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
BLOCK = 128


def linear_names(model):
    return [n for n, m in model.named_modules() if n.split(".")[-1] in LINEAR]


def expand(scale, rows, cols):
    return scale.repeat_interleave(BLOCK, 0)[:rows].repeat_interleave(BLOCK, 1)[:, :cols]


def model_engine(conn, target):
    import torch
    import weightsync
    C.deterministic()
    dev = torch.device("cuda", GPU)
    torch.cuda.set_device(dev)
    cfg = C.small_config()
    model = C.build_model(cfg, seed=1234, device=dev)

    class Fp8Linear(torch.nn.Module):
        """e4m3 weight + 128x128 block scales (DEQUANT), dequantised in
        the forward."""

        def __init__(self, lin):
            super().__init__()
            rows, cols = lin.weight.shape
            self.rows, self.cols = rows, cols
            self.register_buffer("qweight", torch.zeros(
                (rows, cols), dtype=torch.float8_e4m3fn, device=dev))
            self.register_buffer("scale", torch.ones(
                (-(-rows // BLOCK), -(-cols // BLOCK)), dtype=torch.float32, device=dev))
            self.bias = lin.bias

        def dequantized(self, dtype):
            w = self.qweight.to(torch.float32) * expand(self.scale, self.rows, self.cols)
            return w.to(dtype)

        def forward(self, x):
            return torch.nn.functional.linear(x, self.dequantized(x.dtype), self.bias)

    names = linear_names(model)
    fp8_mods = {}
    for name in names:
        parent, _, leaf = name.rpartition(".")
        holder = model.get_submodule(parent)
        fp8_mods[name] = Fp8Linear(getattr(holder, leaf))
        setattr(holder, leaf, fp8_mods[name])
    pairs = [(n, p) for n, p in model.named_parameters()]
    quant = {}
    for name, m in fp8_mods.items():
        pairs.append((name + ".weight", m.qweight))
        pairs.append((name + ".weight_scale_inv", m.scale))
        quant[name + ".weight"] = {"format": E4, "scale_parameter": name + ".weight_scale_inv",
                                   "scheme": "QUANT_SCHEME_BLOCK", "block_rows": BLOCK,
                                   "block_cols": BLOCK, "scale_form": DEQ}
    engine = weightsync.Engine("fp8-model", target, timeout=60)
    engine.register_torch(pairs, quantization=quant)
    engine.start()
    C.send(conn, {"ready": True, "linears": len(fp8_mods)})
    while True:
        cmd = C.recv(conn, 900, "a command")
        if cmd["op"] != "state":
            C.send(conn, {"bye": True})
            return
        torch.cuda.synchronize(dev)
        dq = {n + ".weight": engine_digests([("w", m.dequantized(torch.bfloat16))])["w"]
              for n, m in fp8_mods.items()}
        C.send(conn, {"version": engine.version, "digests": engine_digests(pairs),
                      "dequantized": dq, "greedy": C.greedy(model, PROMPT, TOKENS)})


def model_trainer(conn, target):
    import copy
    import numpy as np
    import torch
    import weightsync
    from weightsync.receipts import fp8
    C.deterministic()
    dev = torch.device("cuda", GPU)
    torch.cuda.set_device(dev)
    cfg = C.small_config()
    model = C.build_model(cfg, seed=1, device=dev)
    trainer = weightsync.Trainer(target, timeout=120)
    trainer.init_ipc(device=GPU)
    lin = set(n + ".weight" for n in linear_names(model))
    for version in (1, 2, 3):
        loss = None
        if version > 1:
            loss = C.train_step(model, cfg, seed=version)
        err = None
        try:
            r = trainer.update(model.named_parameters(), version=version)
            receipts = sum(1 for e in r.engines if e.HasField("receipt"))
        except weightsync.WeightSyncError as e:
            err, receipts = f"{e.code}: {e.message}", 0
        # The reference: linear weights quantised and dequantised by
        # weightsync.fp8 (numpy), everything else as trained.
        ref_model = copy.deepcopy(model)
        expect, dq = {}, {}
        named = dict(ref_model.named_parameters())
        for name, p in model.named_parameters():
            if name not in lin:
                expect.update(engine_digests([(name, p)]))
                continue
            x = f32(p)
            enc, d = fp8.quantize(x, BLOCK, BLOCK, E4, False)
            expect[name] = sha(np.ascontiguousarray(enc, np.uint8).tobytes())
            expect[name + "_scale_inv"] = sha(np.ascontiguousarray(d, "<f4").tobytes())
            w = torch.from_numpy(fp8.dequantize(enc, d, BLOCK, BLOCK, E4)).to(dev)
            with torch.no_grad():
                named[name].copy_(w.to(torch.bfloat16))
            dq[name] = engine_digests([("w", named[name])])["w"]
        C.send(conn, {"tag": f"v{version}", "version": version, "update_error": err,
                      "receipts": receipts, "expect": expect, "dequantized": dq,
                      "loss": loss, "greedy_ref": C.greedy(ref_model, PROMPT, TOKENS),
                      "greedy_bf16": C.greedy(model, PROMPT, TOKENS)})
        del ref_model
        C.recv(conn, 600, "go on")
    C.send(conn, {"done": True})
    C.recv(conn, 60, "the end")


def run_model(daemon_bin, worker_bin):
    check = C.Checks()
    d = C.Daemon(daemon_bin, worker_bin, gpu=GPU)
    engine = trainer = None
    rows = []
    try:
        engine = C.Worker(model_engine, d.target)
        ready = engine.recv(300, "the engine's registration")
        check(ready.get("linears", 0) > 0, f"engine serves {ready.get('linears')} FP8 linears")
        trainer = C.Worker(model_trainer, d.target)
        while True:
            t = trainer.recv(900, "an update")
            if t.get("done"):
                break
            engine.send({"op": "state"})
            e = engine.recv(300, "the engine's state")
            tag = t["tag"]
            bad = sorted(n for n in t["expect"] if e["digests"].get(n) != t["expect"][n])
            bad_dq = sorted(n for n in t["dequantized"]
                            if e["dequantized"].get(n) != t["dequantized"][n])
            check(t["update_error"] is None, f"{tag}: update ({t['update_error']})")
            check(e["version"] == t["version"], f"{tag}: engine at version {t['version']}")
            check(not bad, f"{tag}: every FP8 weight, scale and bf16 parameter equals the "
                           f"reference ({len(bad)} differ: {bad[:4]})")
            check(not bad_dq, f"{tag}: the engine's dequantised weights equal "
                              f"weightsync.fp8.dequantize's ({len(bad_dq)} differ)")
            check(e["greedy"] == t["greedy_ref"],
                  f"{tag}: engine greedy {e['greedy']} == reference {t['greedy_ref']}")
            check(t["receipts"] == 1, f"{tag}: receipts checked by the trainer")
            if "on the wire" in tag:   # every FP8 weight's source: SYN, q/k/v, the experts
                want = len(SYN) + len(FUSED[1]) + len(STACKED[1])
                check(t["wired"] == want, f"{tag}: {t['wired']} of {want} FP8 weights' "
                                          "sources travelled quantised")
            print(f"  {tag}: loss {t['loss']}; the bf16 trainer's own greedy "
                  f"{t['greedy_bf16']} ({'same' if t['greedy_bf16'] == t['greedy_ref'] else 'differs'})",
                  flush=True)
            rows.append((tag, t["update_error"] is None and not bad and not bad_dq
                         and e["greedy"] == t["greedy_ref"], e["greedy"]))
            trainer.send({"go": True})
    finally:
        for w in (trainer, engine):
            if w is not None:
                try:
                    w.send({"op": "end"})
                except Exception:
                    pass
                w.stop()
        d.stop()
    print("\nversion  result  engine greedy")
    for tag, ok, g in rows:
        print(f"{tag:<9}{'PASS' if ok else 'FAIL':<8}{g}")
    return check.finish("test_fp8_gpu model")


def main():
    if len(sys.argv) < 2 or sys.argv[1] not in ("exact", "model"):
        sys.exit(f"usage: {sys.argv[0]} exact|model [WEIGHTSYNCD [WEIGHTSYNC_GPU_WORKER]]")
    what = sys.argv.pop(1)
    daemon_bin, worker_bin = C.binaries(sys.argv)
    return run_exact(daemon_bin, worker_bin) if what == "exact" else run_model(daemon_bin,
                                                                                 worker_bin)


if __name__ == "__main__":
    sys.exit(main())

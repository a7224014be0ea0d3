"""FP8 on the wire (docs/protocol.md, "FP8 on the wire"): the trainer
quantises a tensor whose every use is an FP8 target of the same blocks,
with the one FP8 function (weightsync.receipts.fp8.quantize, bit for bit
the daemon's), and sends its FP8 elements and scales: a byte per element
instead of two (bf16) or four (float32). The daemon copies them as they
are; an engine holds exactly what the daemon quantising the tensor gives.

    trainer.update(named_tensors, version, fp8_on_wire=True)   # all of it, or:
    plan = wire_plan(layouts, shapes)     # {name: Quantization fields}
    pairs = on_the_wire(named_tensors, plan)

`wire_plan` mirrors the daemon's check (daemon/core/copy_plan.cc,
CheckWireUse): every use of the tensor, in every engine, is an FP8 target
of one format, block and scale form, through a rectangle on whole blocks
of the tensor. Anything else is sent as it is and quantised by the daemon,
as before; a layout that changed under a plan is refused by the daemon
before anything pauses (INVALID_ARGUMENT naming the tensor)."""

import numpy as np

from weightsync.planner import wire_payload_bytes
from weightsync.transfer_plan import view_2d
from weightsync.receipts.fp8 import CHUNK, block_shape, enum_name, quantize, widened

__all__ = ["WireFp8", "WirePlans", "wire_plan", "quantize_on_wire", "on_the_wire",
           "payload_bytes"]


def _matrix(shape):
    """(rows, cols) of a tensor's 2-D view as segments see it."""
    return view_2d([int(d) for d in shape])


def _segment_rect(cols, s):
    """The parameter rectangle (r0, r1, c0, c1) segment `s` writes in a
    parameter of `cols` columns, or None (quant_layout.cc SegmentRect)."""
    stride = s.dest_row_stride or s.col_count
    r0, c0 = divmod(s.dest_offset, cols)
    if stride == cols and s.col_count <= cols - c0:
        return r0, r0 + s.row_count, c0, c0 + s.col_count
    if s.row_count != 1 and stride != s.col_count:
        return None
    n = s.row_count * s.col_count
    if n <= cols - c0:
        return r0, r0 + 1, c0, c0 + n
    if c0 == 0 and n % cols == 0:
        return r0, r0 + n // cols, 0, cols
    return None


def _form(p):
    """(format, per_row, block_rows, block_cols, reciprocal) of a quantised
    Parameter: what a tensor quantised for it must match."""
    qz = p.quantization
    br, bc, _, _ = block_shape(p)
    per_row = enum_name("QuantScheme", qz.scheme) == "QUANT_SCHEME_PER_ROW"
    return (enum_name("DType", qz.format), per_row, None if per_row else br,
            None if per_row else bc,
            enum_name("ScaleForm", qz.scale_form) == "SCALE_FORM_RECIPROCAL")


def _fits(p, s, rows, cols, form):
    """Whether use (p, s) of a rows x cols tensor copies as it is when the
    tensor is quantised in `form` (copy_plan.cc CheckWireUse)."""
    _, per_row, br, bc, _ = form
    _, _, q_rows, q_cols = block_shape(p)
    if per_row:
        br, bc = 1, cols
    if s is None:   # the parameter is the tensor itself
        if (rows, cols) != (q_rows, q_cols):
            return False
        rb, rc, cb, cc = 0, rows, 0, cols
        rect = (0, q_rows, 0, q_cols)
    else:
        rb, rc, cb, cc = s.row_begin, s.row_count, s.col_begin, s.col_count
        rect = _segment_rect(q_cols, s)
        if rect is None:
            return False
    r0, r1, c0, c1 = rect
    return (r1 - r0 == rc and c1 - c0 == cc and rb % br == 0 and cb % bc == 0
            and ((rb + rc) % br == 0 or rb + rc == rows)
            and ((cb + cc) % bc == 0 or cb + cc == cols)
            and (not per_row or (c0 == 0 and c1 == q_cols)))


def wire_plan(layouts, shapes):
    """{tensor name: weightsync.v1.Quantization fields} of the tensors of
    `shapes` ({name: shape}) that can travel quantised to every engine of
    `layouts` (an iterable of layouts: lists of weightsync.v1.Parameter,
    as GetStatus(include_layouts) returns them): each is used at least
    once, every use is an FP8 target of one format, block and scale form,
    on whole blocks of the tensor."""
    uses = {}   # name -> [(parameter, segment or None)]
    for layout in layouts:
        for p in layout:
            if p.segments:
                for s in p.segments:
                    uses.setdefault(s.source, []).append((p, s))
            else:
                uses.setdefault(p.name, []).append((p, None))
    plan = {}
    for name, shape in shapes.items():
        found = uses.get(name)
        if not found or not all(p.HasField("quantization") for p, _ in found):
            continue
        forms = {_form(p) for p, _ in found}
        if len(forms) != 1:
            continue
        form = forms.pop()
        rows, cols = _matrix(shape)
        if rows * cols == 0 or not all(_fits(p, s, rows, cols, form) for p, s in found):
            continue
        fmt, per_row, br, bc, reciprocal = form
        fields = {"format": fmt, "scale_form": "SCALE_FORM_RECIPROCAL" if reciprocal
                  else "SCALE_FORM_DEQUANT"}
        if per_row:
            fields["scheme"] = "QUANT_SCHEME_PER_ROW"
        else:
            fields.update(scheme="QUANT_SCHEME_BLOCK", block_rows=br, block_cols=bc)
        plan[name] = fields
    return plan


def payload_bytes(shape, fields):
    """Bytes of a tensor quantised as `fields` says on the wire: its FP8
    elements, rounded up to 4, then a float32 scale per block (per row:
    per row)."""
    return wire_payload_bytes(shape, fields)


class WireFp8:
    """A tensor quantised for the wire: `source` (as given, for receipts),
    `shape`, `fields` (its Quantization), `elements` (uint8 FP8 encodings,
    [rows, cols]) and `scales` (float32 stored scales of its blocks)."""

    __slots__ = ("source", "shape", "fields", "elements", "scales", "_payload")

    def __init__(self, source, shape, fields, elements, scales, payload=None):
        self.source, self.shape, self.fields = source, tuple(shape), fields
        self.elements, self.scales = elements, scales
        self._payload = payload   # made with them (the Triton path), or None

    @property
    def dtype(self):
        return self.fields["format"]

    def payload(self):
        """The payload as the daemon reads it: flat uint8 (numpy arrays) or
        a flat torch.uint8 tensor on the elements' device."""
        if self._payload is not None:
            return self._payload
        n = self.elements.reshape(-1).shape[0]
        pad = -n % 4
        if isinstance(self.elements, np.ndarray):
            parts = [self.elements.reshape(-1), np.zeros(pad, np.uint8),
                     np.ascontiguousarray(self.scales, np.float32).reshape(-1).view(np.uint8)]
            return np.concatenate(parts)
        import torch
        flat = self.elements.reshape(-1)
        scales = self.scales.contiguous().reshape(-1).view(torch.uint8)
        return torch.cat([flat, flat.new_zeros(pad), scales])


# Why the Triton kernel failed, once it did: the torch path carries on.
_TRITON_FAILED = []


def _triton_for(raw):
    """Whether `raw` (a torch tensor) takes fp8_wire_kernel: on a CUDA
    device, Triton present, neither WEIGHTSYNC_FP8_TRITON nor
    WEIGHTSYNC_WIRE_TRITON "0", and the kernel never failed here."""
    import os
    if (_TRITON_FAILED or not getattr(raw, "is_cuda", False)
            or os.environ.get("WEIGHTSYNC_WIRE_TRITON", "1") == "0"):
        return False
    from weightsync.receipts import fp8_gpu
    return fp8_gpu.enabled()


def quantize_on_wire(name, tensor, fields, ops=None):
    """WireFp8 of `tensor` (a float numpy array, or a torch tensor with
    `ops` = weightsync._xp.TorchOps(), quantised on its device) quantised
    as `fields` (a wire_plan entry) says, whole, from its top-left block.
    A CUDA tensor goes through one Triton launch (fp8_wire_kernel) where
    Triton is present, else through torch ops; both give
    weightsync.receipts.fp8.quantize's bytes."""
    from weightsync._xp import NumpyOps
    from weightsync._tensors import describe
    ops = ops or NumpyOps()
    shape = tuple(int(d) for d in tensor.shape)
    rows, cols = _matrix(shape)
    if isinstance(ops, NumpyOps):   # numpy arrays, CPU torch tensors
        dtype, _, raw = describe(name, tensor)
    else:
        from weightsync._gpu import dtype_name
        dtype, raw = dtype_name(name, tensor), tensor
    if dtype not in ("FLOAT32", "BFLOAT16", "FLOAT16"):
        raise ValueError(f"tensor '{name}': {dtype} can't be quantised on the wire "
                         "(float32, bfloat16 or float16)")
    br, bc, reciprocal = _blocks(fields, cols)
    if _triton_for(raw):
        from weightsync.receipts import fp8_gpu
        try:
            payload, enc, stored = fp8_gpu.quantize_gpu(
                raw.contiguous().reshape(rows, cols), dtype, br, bc, fields["format"],
                reciprocal)
            return WireFp8(tensor, shape, dict(fields), enc, stored, payload)
        except Exception as e:  # noqa: BLE001 - the torch path below is exact too
            _TRITON_FAILED.append(f"{type(e).__name__}: {e}")
    enc, stored = _quantized(widened(raw, dtype, ops).reshape(rows, cols), br, bc,
                             fields["format"], reciprocal, ops)
    return WireFp8(tensor, shape, dict(fields), enc, stored)


def _blocks(fields, cols):
    """(block rows, block cols, reciprocal) of Quantization `fields` for a
    matrix of `cols` columns (per row: 1 x cols)."""
    per_row = fields.get("scheme") == "QUANT_SCHEME_PER_ROW"
    return (1 if per_row else fields.get("block_rows") or 128,
            cols if per_row else fields.get("block_cols") or 128,
            fields.get("scale_form") == "SCALE_FORM_RECIPROCAL")


def _quantized(x, br, bc, fmt, reciprocal, ops):
    """quantize(x, ...) of a float32 [rows, cols] matrix, rows of blocks
    CHUNK elements at a time (quantize holds several int64 temporaries an
    element)."""
    rows, cols = x.shape
    step = br * max(1, CHUNK // max(br * cols, 1))
    if step >= rows:
        return quantize(x, br, bc, fmt, reciprocal, ops)
    parts = [quantize(x[r0:r0 + step], br, bc, fmt, reciprocal, ops)
             for r0 in range(0, rows, step)]
    cat = np.concatenate if isinstance(x, np.ndarray) else __import__("torch").cat
    return cat([e for e, _ in parts]), cat([s for _, s in parts])


def quantize_raw(raw, dtype, rows, cols, fields):
    """The payload (bytes) of `raw`, the row-major bytes of a rows x cols
    float32 / bfloat16 / float16 matrix of `dtype`, quantised as `fields`
    says (numpy): a transfer plan's piece sent quantised, its blocks
    counted from its own top-left corner (weightsync.senders.many_wire)."""
    from weightsync._xp import NumpyOps
    br, bc, reciprocal = _blocks(fields, cols)
    ops = NumpyOps()
    x = widened(np.frombuffer(raw, np.uint8), dtype, ops).reshape(rows, cols)
    enc, stored = _quantized(x, br, bc, fields["format"], reciprocal, ops)
    return WireFp8(None, (rows, cols), dict(fields), enc, stored).payload().tobytes()


def quantization_message(fields):
    """weightsync.v1.Quantization of Quantization `fields` (a wire_plan
    entry), or None for none."""
    if not fields:
        return None
    from google.protobuf import json_format
    from weightsync._proto import v1
    return json_format.ParseDict(dict(fields), v1.Quantization())


def _ops(tensor):
    """TorchOps for a CUDA tensor (quantised on its device), else NumpyOps
    (numpy arrays, CPU torch tensors: through numpy)."""
    from weightsync import _xp
    return _xp.TorchOps() if getattr(tensor, "is_cuda", False) else _xp.NumpyOps()


def on_the_wire(named_tensors, plan, ops=None):
    """(name, tensor or WireFp8) pairs: the tensors `plan` (wire_plan)
    names quantised (with `ops`, default by where each tensor is), the
    rest as given (a SparsePatch or a WireFp8 too)."""
    if not plan:
        return list(named_tensors)
    from weightsync.sparse import SparsePatch
    out = list(named_tensors)
    batch = []   # CUDA tensors for one Triton launch per form
    for i, (n, t) in enumerate(out):
        if n not in plan or isinstance(t, (SparsePatch, WireFp8)):
            continue
        if ops is None and _triton_for(t):
            batch.append(i)
        else:
            out[i] = (n, quantize_on_wire(n, t, plan[n], ops or _ops(t)))
    if batch:
        _on_gpu(out, batch, plan)
    return out


def _on_gpu(pairs, batch, plan):
    """Replaces pairs[i] for i in `batch` (CUDA tensors) by their WireFp8,
    quantised by fp8_gpu.quantize_gpu_many in a launch per form; one by
    one (quantize_on_wire) where that fails."""
    from weightsync._gpu import dtype_name
    from weightsync.receipts import fp8_gpu
    items, shapes = [], []
    for i in batch:
        n, t = pairs[i]
        shape = tuple(int(d) for d in t.shape)
        rows, cols = _matrix(shape)
        br, bc, reciprocal = _blocks(plan[n], cols)
        items.append((t.contiguous().reshape(rows, cols), dtype_name(n, t), br, bc,
                      plan[n]["format"], reciprocal))
        shapes.append(shape)
    for i, (_, dt, *_) in zip(batch, items):
        if dt not in ("FLOAT32", "BFLOAT16", "FLOAT16"):
            raise ValueError(f"tensor '{pairs[i][0]}': {dt} can't be quantised on the wire "
                             "(float32, bfloat16 or float16)")
    try:
        done = fp8_gpu.quantize_gpu_many(items)
    except Exception as e:  # noqa: BLE001 - one by one: exact too, or its own error
        _TRITON_FAILED.append(f"{type(e).__name__}: {e}")
        for i in batch:
            n, t = pairs[i]
            pairs[i] = (n, quantize_on_wire(n, t, plan[n], _ops(t)))
        return
    for i, shape, (payload, enc, stored) in zip(batch, shapes, done):
        n, t = pairs[i]
        pairs[i] = (n, WireFp8(t, shape, dict(plan[n]), enc, stored, payload))


class WirePlans:
    """Trainer.update(fp8_on_wire=True)'s plans, kept by the engines'
    layout ids and the tensors' names and shapes: an update of the same
    tensors into the same layouts plans nothing again (one GetStatus
    without layouts a call). Thread-compatible, like the Trainer."""

    def __init__(self, keep=8):
        self._plans = {}
        self._keep = keep

    def plan(self, link, engine_ids, pairs):
        """The wire_plan of (name, tensor) `pairs` into the engines an
        update of `engine_ids` writes (weightsync.senders.base.Link)."""
        wanted = set(engine_ids)
        statuses = link.each(lambda i, stub: stub.call("GetStatus", include_layouts=False))
        ids = tuple(sorted(e.layout_id for st in statuses for e in st.engines
                           if not wanted or e.engine_id in wanted))
        shapes = tuple((n, tuple(int(d) for d in t.shape)) for n, t in pairs)
        key = (ids, shapes)
        found = self._plans.get(key) if all(ids) else None
        if found is None:
            _, layouts = link.engine_layouts(engine_ids)
            found = wire_plan(layouts.values(), dict(shapes))
            if all(ids):
                if len(self._plans) >= self._keep:
                    self._plans.clear()
                self._plans[key] = found
        return found

"""Receipts, trainer side: the checksum an engine must report for an
update, computed from what was sent, mapped through the engine's segments
and converted to its dtypes (docs/protocol.md, "Receipts"; the same
function as common/checksum.h and client/receipts.cc; the vectors of
tests/vectors/receipts.json, from tools/receipt_vectors.py, bind them).

    s          = lo32(FNV-1a 64 of the name) ^ hi32(it)
    key(p, i)  = s + lo32(i) * 0x9E3779B1 + hi32(i) * 0x85EBCA77   (mod 2^32)
    mix32(x)   = y ^ (y >> 16),  y = x * 0x85EBCA6B                 (mod 2^32)
    term(p, i) = mix32(bits32(p[i]) ^ key(p, i)),  checksum = sum mod 2^64

expected_receipt: numpy, on the host (receipts.host) (the host backend): segments of many
  small tensors are gathered into one run of numpy operations, large ones
  go through it in blocks.
expected_receipt_arrays: the same on torch tensors where they are (the
  nccl/ipc backends: on the trainer's GPU, one fused Triton kernel per
  dtype pair, weightsync.receipts.triton; torch int64 ops without Triton), or
  on numpy arrays, which is how CI checks the torch code against
  expected_receipt.
expected_receipts_gpu: several layouts at once, on a given CUDA stream."""

import collections
import threading

from weightsync import _xp
from weightsync.receipts import host
from weightsync.receipts.arrays import receipt_by_ops

def expected_receipt(layout, sent, block=host.BLOCK, layout_key=None):
    """(checksum, parameters, bytes) for an engine registered with `layout`
    (weightsync.v1.Parameter messages) after an update that sent `sent`:
    {name: (dtype enum name, shape, flat uint8 array)}, or a Manifest's
    sent() view (weightsync._tensors: its key is the signature, its
    payloads the arrays in send order, so a repeated update builds nothing
    per tensor).

    layout_key: a hashable that names `layout` exactly (the daemon's
    EngineResult.layout_id: a new id for every registration). With it, the
    walk through the layout's segments (regions, salts, element indices,
    what depends on the layout and on the sent names, dtypes and shapes but
    not on the values) is kept for the next update that sends the same
    names, dtypes and shapes in the same order, so a repeated update costs
    a few array passes over the sent elements and no Python work per
    tensor (a mixture of experts sends 100k tensors every step). Without
    it nothing is kept.

    FP8 targets (docs/protocol.md, "FP8 targets") count what the daemon
    installs: the sent values quantised by weightsync.fp8, FP8 elements and
    the scales of the blocks written."""
    quantized = _quantized_part(layout, layout_key)
    if quantized is not None:
        plain, quant = quantized
        key = None if layout_key is None else ("plain", layout_key)
        checksum, params, nbytes = expected_receipt(plain, sent, block, key)
        from weightsync.receipts import fp8
        q_sum, q_params, q_bytes = fp8.quantized_receipt(quant, sent)
        return (checksum + q_sum) & _xp.MASK64, params + q_params, nbytes + q_bytes
    return host.plain_receipt(layout, sent, block, layout_key)


# layout_key -> (plain parameters, FP8 targets) or None, for the last few
# layouts (the split is a pass over every parameter).
_SPLITS = collections.OrderedDict()
_splits_lock = threading.Lock()


def _quantized_part(layout, layout_key):
    """(plain parameters, FP8 targets) of a layout with FP8 targets, None
    for one without (weightsync.fp8.split_layout; kept by layout_key)."""
    if layout_key is not None:
        with _splits_lock:
            if layout_key in _SPLITS:
                return _SPLITS[layout_key]
    if any(p.HasField("quantization") for p in layout):
        from weightsync.receipts import fp8
        plain, quant, _ = fp8.split_layout(layout)
        split = (plain, quant)
    else:
        split = None
    if layout_key is not None:
        with _splits_lock:
            _SPLITS[layout_key] = split
            while len(_SPLITS) > 8:
                _SPLITS.popitem(last=False)
    return split


def expected_receipt_arrays(layout, sent, ops=None, block=1 << 22):
    """expected_receipt computed where the data is: `sent` maps a name to
    (dtype enum name, shape, flat elements) with the elements a torch
    tensor or a numpy array of the dtype's storage type
    (weightsync._tensors.STORAGE). CUDA tensors, no `ops`, Triton present:
    the fused kernel (weightsync.receipts.gpu) on the current stream;
    otherwise int64 array ops (`block` elements at a time) with `ops` or
    those of the data. Returns (checksum, parameters, bytes). FP8 targets
    (a GPU engine's, quantised by the daemon on its GPU): the rest of the
    layout as above, the quantised parameters by weightsync.receipts.fp8 where the
    tensors that feed them are: torch ops on their GPU for CUDA tensors,
    numpy (on host copies) otherwise."""
    if has_fp8(layout):
        from weightsync.receipts import fp8
        plain, quant, _ = fp8.split_layout(layout)
        checksum, params, nbytes = expected_receipt_arrays(plain, sent, ops, block)
        q_sum, q_params, q_bytes = quantized_where_sent(quant, sent)
        return (checksum + q_sum) & _xp.MASK64, params + q_params, nbytes + q_bytes
    if ops is None and all_cuda(sent):
        from weightsync.receipts import gpu
        if gpu.available():
            return gpu.expected_receipts_gpu({0: layout}, sent)[0]
    return receipt_by_ops(layout, sent, ops, block)


def has_fp8(layout):
    """True if `layout` has FP8 targets (docs/protocol.md, "FP8 targets")."""
    return any(p.HasField("quantization") for p in layout)


def quantized_where_sent(quantized, sent):
    """weightsync.fp8.quantized_receipt of FP8 targets where their sources
    are: a parameter whose sent sources are all CUDA tensors of one device
    is quantised and summed there by the fused Triton kernel
    (weightsync.receipts.fp8_gpu) where Triton is present and WEIGHTSYNC_FP8_TRITON
    is not "0", else (and for what its tables can't express) with torch ops
    (the same code as numpy's, bit for bit the same sums); the others by
    numpy on host copies."""
    from weightsync.receipts import fp8
    on_gpu, on_host, acc = [], [], []
    for p in quantized:
        feeds = [sent[n][2] for n in fp8.sources(p) if n in sent]
        if not feeds:
            continue
        cuda = all(_xp.is_torch(e) and e.is_cuda for e in feeds)
        (on_gpu if cuda and len({e.device for e in feeds}) == 1 else on_host).append(p)
    total, params, nbytes = fp8.quantized_receipt(on_host, _on_host(on_host, sent))
    if on_gpu:
        on_gpu = _quantized_by_triton(on_gpu, sent, acc.append)
        for g_sum, g_params, g_bytes in acc:
            total, params, nbytes = total + g_sum, params + g_params, nbytes + g_bytes
    if on_gpu:
        g_sum, g_params, g_bytes = fp8.quantized_receipt(on_gpu, sent, ops=_xp.TorchOps())
        total, params, nbytes = total + g_sum, params + g_params, nbytes + g_bytes
    return total & _xp.MASK64, params, nbytes


_fp8_triton_failed = []


def fp8_triton_failed():
    """The failures of the fused FP8 receipt kernel so far (repr of each);
    once it failed, the torch path takes its work. The list itself: a
    check may clear it."""
    return _fp8_triton_failed


def note_fp8_triton_failure(error):
    """Records that the fused FP8 receipt kernel failed with `error`."""
    _fp8_triton_failed.append(repr(error))


def _quantized_by_triton(quantized, sent, add):
    """The fused kernel (weightsync.receipts.fp8_gpu) for FP8 targets fed by CUDA
    tensors, one device at a time, where Triton is present and
    WEIGHTSYNC_FP8_TRITON is not "0": add((sum, parameters, bytes)) for
    what it summed; returns the parameters left for the torch path (those
    its tables can't express, or all of them if the kernel failed: then a
    warning, once, and the torch path from then on)."""
    from weightsync.receipts import fp8, fp8_gpu
    if _fp8_triton_failed or not fp8_gpu.enabled():
        return quantized
    by_device = collections.OrderedDict()
    for p in quantized:
        device = next(sent[n][2].device for n in fp8.sources(p) if n in sent)
        by_device.setdefault(device, []).append(p)
    rest = []
    for device, params in by_device.items():
        try:
            import torch
            with torch.cuda.device(device):
                total, n, nbytes, left = fp8_gpu.quantized_receipt_gpu(params, sent)
        except Exception as e:  # noqa: BLE001 - the torch path is exact too
            import warnings
            warnings.warn(f"weightsync: the FP8 receipt kernel failed ({e!r}); "
                          "using the torch path")
            _fp8_triton_failed.append(repr(e))
            rest += params
            continue
        add((total, n, nbytes))
        rest += left
    return rest


def _on_host(quantized, sent):
    """The entries of `sent` that feed the quantised parameters, their
    elements as numpy arrays (torch tensors, CUDA ones too, copied)."""
    names = set()
    for p in quantized:
        names.update([s.source for s in p.segments] or [p.name])
    out = {}
    for name in names:
        if name not in sent:
            continue
        dtype, shape, elements = sent[name][:3]
        if _xp.is_torch(elements):
            import torch
            flat = elements.detach().contiguous().reshape(-1)
            elements = flat.view(torch.uint8).cpu().numpy()
        out[name] = (dtype, shape, elements)
    return out


def all_cuda(sent):
    """True if every entry of `sent` is a CUDA tensor."""
    return bool(sent) and all(_xp.is_torch(e) and e.is_cuda for _, _, e in sent.values())



def expected_receipts_gpu(layouts, sent, stream=None):
    """{key: (checksum, parameters, bytes)} for every layout of `layouts`
    ({key: weightsync.v1.Parameter messages}) from `sent` (torch CUDA
    tensors, as expected_receipt_arrays takes them), on `stream` (a
    torch.cuda.Stream; None: the current one). See weightsync.receipts.gpu."""
    from weightsync.receipts import gpu
    return gpu.expected_receipts_gpu(layouts, sent, stream)

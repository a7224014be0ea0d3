"""Receipts, trainer side, in numpy: the checksum an engine must report for
an update, computed from what was sent, mapped through the engine's
segments and converted to its dtypes (docs/protocol.md, "Receipts"; the
same function as common/checksum.h and client/receipts.cc)."""

import numpy as np

from weightsync._tensors import STORAGE

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _splitmix(x):
    with np.errstate(over="ignore"):
        x = x + _GOLDEN
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def parameter_salt(name):
    h = 0xCBF29CE484222325
    for c in name.encode():
        h = ((h ^ c) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return np.uint64(h)


def _to_float32(raw, dtype):
    if dtype == "FLOAT32":
        return raw.view(np.float32)
    if dtype == "FLOAT16":
        return raw.view(np.float16).astype(np.float32)
    if dtype == "BFLOAT16":
        return (raw.view(np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)
    raise ValueError(dtype)


def convert_bits(raw, src, dst):
    """Element bits (uint64) of `raw` bytes of dtype `src` stored as `dst`,
    rounding to nearest even like common/dtype.cc."""
    if src == dst:
        return raw.view(STORAGE[dst]).view(f"u{np.dtype(STORAGE[dst]).itemsize}").astype(np.uint64)
    f = _to_float32(raw, src)
    if dst == "FLOAT32":
        return f.view(np.uint32).astype(np.uint64)
    if dst == "FLOAT16":
        return f.astype(np.float16).view(np.uint16).astype(np.uint64)
    if dst == "BFLOAT16":
        u = f.view(np.uint32).astype(np.uint64)
        rounded = (u + np.uint64(0x7FFF) + ((u >> np.uint64(16)) & np.uint64(1))) >> np.uint64(16)
        nan = np.isnan(f)
        rounded[nan] = (u[nan] >> np.uint64(16)) | np.uint64(0x40)
        return rounded & np.uint64(0xFFFF)
    raise ValueError(f"can't convert {src} to {dst}")


def expected_receipt(layout, sent):
    """(checksum, parameters, bytes) for an engine registered with `layout`
    (weightsync.v1.Parameter messages) after an update that sent `sent`:
    {name: (dtype enum name, shape, flat uint8 array)}."""
    from weightsync._proto import v1
    total = np.uint64(0)
    params = nbytes = 0
    for p in layout:
        dst = v1.enum_name("DType", p.dtype)
        esize = np.dtype(STORAGE[dst]).itemsize
        salt = parameter_salt(p.name)
        segments = list(p.segments)
        if not segments and p.name in sent:
            n = int(np.prod(p.shape)) if len(p.shape) else 1
            segments = [None]
        touched = False
        for s in segments:
            if s is None:
                src_dtype, _, raw = sent[p.name]
                src_idx = np.arange(n, dtype=np.int64)
                dst_idx = src_idx
            else:
                if s.source not in sent:
                    continue
                src_dtype, shape, raw = sent[s.source]
                cols = int(np.prod(shape[1:])) if len(shape) > 1 else 1
                stride = s.dest_row_stride or s.col_count
                r = np.arange(s.row_count, dtype=np.int64)[:, None]
                c = np.arange(s.col_count, dtype=np.int64)[None, :]
                src_idx = ((s.row_begin + r) * cols + s.col_begin + c).reshape(-1)
                dst_idx = (s.dest_offset + r * stride + c).reshape(-1)
            ses = np.dtype(STORAGE[src_dtype]).itemsize
            picked = raw.reshape(-1, ses)[src_idx].reshape(-1)
            bits = convert_bits(picked, src_dtype, dst)
            with np.errstate(over="ignore"):
                terms = _splitmix(((salt + dst_idx.astype(np.uint64)) * _GOLDEN) ^ bits)
                total = total + terms.sum(dtype=np.uint64)
            nbytes += len(dst_idx) * esize
            touched = True
        params += touched
    return int(total), params, nbytes

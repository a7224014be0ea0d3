"""Sparse patches: send only the elements that changed since the version
the engines hold (docs/protocol.md, "Sparse patches").

    patch = weightsync.sparse.diff(sent_before, now, max_density=0.05)
    trainer.update([(name, patch if patch is not None else now)],
                   version=v + 1, base_version=v)

numpy arrays give a SparsePatch on the host; torch tensors (CUDA ones on
their GPU) give a TorchSparsePatch whose indices, values and payload stay
on the tensors' device, for the nccl/ipc backends (or the host backend,
which copies the payload to the host).
"""

import numpy as np

from weightsync import _xp


class SparsePatch:
    """(flat indices, values) of a tensor of `shape`. Indices travel as
    uint32 (4 bytes) when the tensor has at most 2^32 elements, else int64;
    index_bytes=8 forces int64."""

    def __init__(self, indices, values, shape, index_bytes=None):
        self.indices = np.ascontiguousarray(indices, dtype=np.int64).reshape(-1)
        self.values = np.ascontiguousarray(values).reshape(-1)
        self.shape = tuple(shape)
        self._check(index_bytes)

    def _check(self, index_bytes):
        if len(self.indices) != len(self.values):
            raise ValueError("a patch needs as many values as indices")
        self.index_bytes = _index_width(self.shape, index_bytes)

    def index_payload(self):
        """The indices as they travel: little-endian uint32 or int64."""
        return self.indices.astype("<u4" if self.index_bytes == 4 else "<i8").view(np.uint8)

    def payload(self):
        """The tensor's bytes in the update stream: the indices
        (index_payload), then the values in the tensor's dtype."""
        return np.concatenate([self.index_payload(), self.values.view(np.uint8)])

    @property
    def nnz(self):
        return len(self.indices)

    @property
    def density(self):
        return self.nnz / max(1, _numel(self.shape))


class TorchSparsePatch(SparsePatch):
    """A patch whose indices (int64, increasing) and values stay where
    weightsync.sparse.diff computed them: torch tensors, on the GPU for CUDA
    tensors (numpy arrays when built by the same code on numpy, as in CI).
    `source_key` identifies the tensor it was computed from, so that tied
    names (one memory under two names) send one patch, as dense tensors do."""

    def __init__(self, indices, values, shape, index_bytes=None, ops=None, source_key=None):
        self._ops = ops or _xp.ops_for(values)
        self.indices = indices
        self.values = values
        self.shape = tuple(shape)
        self.source_key = source_key
        self._check(index_bytes)

    def index_payload(self):
        """Little-endian uint32 or int64 indices as uint8, on the device:
        a uint32 index is the low half of its int64 (every CUDA GPU and
        host this runs on is little-endian)."""
        ops, idx = self._ops, self.indices
        if self.index_bytes == 8:
            return ops.contiguous(idx).view(ops.uint8)
        return ops.contiguous(idx.view(ops.int32).reshape(-1, 2)[:, 0]).view(ops.uint8)

    def payload(self):
        ops = self._ops
        return ops.cat([self.index_payload(), ops.contiguous(self.values).view(ops.uint8)])


def _numel(shape):
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _index_width(shape, index_bytes):
    small = _numel(shape) <= 2 ** 32
    if index_bytes is None:
        index_bytes = 4 if small else 8
    if index_bytes not in (4, 8) or (index_bytes == 4 and not small):
        raise ValueError(f"index_bytes {index_bytes}: 4 (tensors of at most 2^32 "
                         "elements) or 8")
    return index_bytes


def changed_elements(ops, before, after, max_density):
    """(indices, values) of the elements of `after` whose bits differ from
    `before` (flat, int64 indices increasing), or None when more than
    `max_density` of them changed. Bitwise: NaN == NaN when the bits are
    equal, -0 != +0. Nothing changed: element 0 alone (unchanged), so the
    update still carries the patch and its base-version check (an empty
    patch would read as a dense tensor on the wire). Written once for numpy
    and torch (weightsync._xp)."""
    a = ops.flat(after)
    b = ops.flat(before)
    n = a.shape[0]
    if n == 0:
        return None
    bits = ops.int_dtype(ops.itemsize(a))
    mask = b.view(bits) != a.view(bits)
    nnz = ops.count(mask)   # before listing them: no index list of a dense change
    if nnz > max_density * n:
        return None
    idx = ops.nonzero(mask) if nnz else ops.arange(1, like=a)
    return idx, a[idx]


def diff(before, after, max_density=0.1, index_bytes=None):
    """The patch that turns `before` into `after` (two arrays of one shape
    and dtype: numpy arrays, or torch tensors on one device, compared on
    that device), or None when more than `max_density` of the elements
    changed (send `after` dense then: a patch costs 4 bytes of index per
    element on top of its value, 8 for tensors above 2^32 elements). A
    tensor that did not change gives a patch of one unchanged element."""
    if _xp.is_torch(after) or _xp.is_torch(before):
        return diff_torch(before, after, max_density, index_bytes)
    before = np.ascontiguousarray(before)
    after = np.ascontiguousarray(after)
    if before.shape != after.shape or before.dtype != after.dtype:
        raise ValueError("diff needs two tensors of one shape and dtype")
    found = changed_elements(_xp.NumpyOps(), before, after, max_density)
    if found is None:
        return None
    return SparsePatch(found[0], found[1], after.shape, index_bytes)


def diff_torch(before, after, max_density=0.1, index_bytes=None):
    """diff for torch tensors, computed where they are (on the GPU for CUDA
    tensors: a comparison of the raw bits, a count, the list of the changed
    positions, a gather). Returns a TorchSparsePatch on that device, or
    None above max_density."""
    if not (_xp.is_torch(before) and _xp.is_torch(after)):
        raise ValueError("diff_torch needs two torch tensors")
    if tuple(before.shape) != tuple(after.shape) or before.dtype != after.dtype:
        raise ValueError(f"diff needs two tensors of one shape and dtype, not "
                         f"{tuple(before.shape)} {before.dtype} and "
                         f"{tuple(after.shape)} {after.dtype}")
    if before.device != after.device:
        raise ValueError(f"diff needs two tensors on one device, not {before.device} "
                         f"and {after.device}")
    from weightsync._gpu import alias_key
    found = changed_elements(_xp.TorchOps(), before, after, max_density)
    if found is None:
        return None
    key = alias_key(after) if after.numel() else None
    return TorchSparsePatch(found[0], found[1], tuple(after.shape), index_bytes,
                            _xp.TorchOps(), key)


diff_gpu = diff_torch

"""Sparse patches: send only the elements that changed since the version
the engines hold (docs/protocol.md, "Sparse patches").

    patch = weightsync.sparse.diff(sent_before, now, max_density=0.05)
    trainer.update([(name, patch if patch is not None else now)],
                   version=v + 1, base_version=v)
"""

import numpy as np


class SparsePatch:
    """(flat indices, values) of a tensor of `shape`. Indices travel as
    uint32 (4 bytes) when the tensor has at most 2^32 elements, else int64;
    index_bytes=8 forces int64."""

    def __init__(self, indices, values, shape, index_bytes=None):
        self.indices = np.ascontiguousarray(indices, dtype=np.int64).reshape(-1)
        self.values = np.ascontiguousarray(values).reshape(-1)
        self.shape = tuple(shape)
        if len(self.indices) != len(self.values):
            raise ValueError("a patch needs as many values as indices")
        small = int(np.prod(self.shape)) <= 2 ** 32
        if index_bytes is None:
            index_bytes = 4 if small else 8
        if index_bytes not in (4, 8) or (index_bytes == 4 and not small):
            raise ValueError(f"index_bytes {index_bytes}: 4 (tensors of at most 2^32 "
                             "elements) or 8")
        self.index_bytes = index_bytes

    def index_payload(self):
        """The indices as they travel: little-endian uint32 or int64."""
        return self.indices.astype("<u4" if self.index_bytes == 4 else "<i8").view(np.uint8)

    @property
    def density(self):
        return len(self.indices) / max(1, int(np.prod(self.shape)))


def diff(before, after, max_density=0.1):
    """The patch that turns `before` into `after` (numpy arrays of one
    shape and dtype), or None when more than `max_density` of the elements
    changed (send `after` dense then: a patch costs 4 bytes of index per
    element on top of its value, 8 for tensors above 2^32 elements)."""
    before = np.ascontiguousarray(before)
    after = np.ascontiguousarray(after)
    if before.shape != after.shape or before.dtype != after.dtype:
        raise ValueError("diff needs two tensors of one shape and dtype")
    a = after.reshape(-1)
    bits = f"u{a.itemsize}"  # compare bit patterns: NaN == NaN, -0 != +0
    changed = np.flatnonzero(before.reshape(-1).view(bits) != a.view(bits))
    if len(changed) > max_density * a.size:
        return None
    return SparsePatch(changed, a[changed], after.shape)

"""Sparse patches: send only the elements that changed since the version
the engines hold (docs/protocol.md, "Sparse patches").

    patch = weightsync.sparse.diff(sent_before, now, max_density=0.05)
    trainer.update([(name, patch if patch is not None else now)],
                   version=v + 1, base_version=v)
"""

import numpy as np


class SparsePatch:
    """(flat int64 indices, values) of a tensor of `shape`."""

    def __init__(self, indices, values, shape):
        self.indices = np.ascontiguousarray(indices, dtype=np.int64).reshape(-1)
        self.values = np.ascontiguousarray(values).reshape(-1)
        self.shape = tuple(shape)
        if len(self.indices) != len(self.values):
            raise ValueError("a patch needs as many values as indices")

    @property
    def density(self):
        return len(self.indices) / max(1, int(np.prod(self.shape)))


def diff(before, after, max_density=0.1):
    """The patch that turns `before` into `after` (numpy arrays of one
    shape and dtype), or None when more than `max_density` of the elements
    changed (send `after` dense then: a patch costs 8 bytes of index per
    element on top of its value)."""
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

"""The receipt function on torch tensors (on their GPU) or numpy arrays.

Written once with operators numpy int64 arrays and torch int64 tensors
share (weightsync._xp): it is the GPU's fallback where Triton is missing
(weightsync.receipts.triton is the fast path); in CI the numpy run of this
very code is checked bit for bit against the numpy host path
(weightsync.receipts.host)."""

from weightsync import _xp
from weightsync.receipts.core import (ESIZE, KEY_HI, KEY_LO, M32, bits32_of,
                                      convert_element_bits, mix32_bits, layout_regions, salt32)


def receipt_by_ops(layout, sent, ops, block):
    """(checksum, parameters, bytes) of `layout` from `sent` with array ops
    `ops` (None: those of the data), `block` elements at a time."""
    from weightsync.planner import ELEMENT_SIZES
    total, params, nbytes = 0, 0, 0
    for name, dst, regions in layout_regions(layout, sent):
        if regions is None:
            continue
        esize = ELEMENT_SIZES[dst]
        salt = salt32(name)
        for source, rows, cols, rb, cb, rc, cc, dest, stride in regions:
            src_dtype, _, elements = sent[source]
            o = ops or _xp.ops_for(elements)
            nbytes += rc * cc * esize
            if rc * cc == 0:
                continue
            if rows * cols != elements.shape[0]:
                elements = elements[:rows * cols]   # an unsegmented parameter
            grid = elements.reshape(rows, cols)
            acc = 0
            step_c = min(cc, block)
            step_r = max(1, block // step_c)
            for r0 in range(0, rc, step_r):
                r1 = min(rc, r0 + step_r)
                for c0 in range(0, cc, step_c):
                    c1 = min(cc, c0 + step_c)
                    piece = grid[rb + r0:rb + r1, cb + c0:cb + c1].reshape(-1)
                    bits = bits32_of(convert_element_bits(o, piece, src_dtype, dst),
                                     ESIZE[dst])
                    index = (dest + c0 + (o.arange(r1 - r0, like=piece)[:, None] + r0) * stride
                             + o.arange(c1 - c0, like=piece)[None, :]).reshape(-1)
                    key = (salt + (index & M32) * KEY_LO + _xp.shr(index, 32) * KEY_HI) & M32
                    # Terms are < 2^32: an int64 sum of a block (<= 2^31
                    # elements) can't overflow.
                    acc += o.to_int(mix32_bits(bits ^ key).sum())
            total = (total + acc) & _xp.MASK64
        params += 1
    return total, params, nbytes

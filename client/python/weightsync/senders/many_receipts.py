"""Receipts of an update of many senders (weightsync.senders.many): no rank
holds every tensor, but the checksum is a sum of one term per installed
element (docs/protocol.md, "Receipts"), so each rank sums the terms of the
elements it sends and the leader adds the ranks' partial sums (mod 2^64)
before it compares them with what each daemon read back.

A rank's part for one engine is the engine's layout seen through the
rank's pieces: every segment (a parameter without segments: the whole
tensor) intersected with each piece of its source tensor becomes a segment
of that piece, summed by weightsync.receipts.expected_receipt over the
piece's bytes.
"""

import numpy as np

from weightsync import transfer_plan
from weightsync._proto import v1
from weightsync.receipts import expected_receipt, expected_receipt_arrays

__all__ = ["link_views", "partial_receipts", "add_partials"]

_M64 = (1 << 64) - 1


def _view(layout, pieces, names):
    """The parameters of `layout` restricted to `pieces` [(pseudo name,
    piece)], their segments naming the pieces."""
    by_tensor = {}
    for pseudo, p in pieces:
        by_tensor.setdefault(names[p.tensor], []).append((pseudo, p))
    scales = {p.quantization.scale_parameter for p in layout if p.HasField("quantization")}
    out = []
    for param in layout:
        if param.name in scales:
            continue
        if param.segments:
            segs = [(s.source, s.row_begin, s.row_count, s.col_begin, s.col_count, s.dest_offset,
                     s.dest_row_stride or s.col_count) for s in param.segments]
        else:
            rows, cols = transfer_plan.view_2d(list(param.shape))
            segs = [(param.name, 0, rows, 0, cols, 0, cols)]
        view = v1.Parameter(name=param.name, dtype=param.dtype, shape=param.shape)
        for source, r0, rn, c0, cn, dest, stride in segs:
            for pseudo, p in by_tensor.get(source, ()):
                a0, a1 = max(r0, p.row_begin), min(r0 + rn, p.row_begin + p.row_count)
                b0, b1 = max(c0, p.col_begin), min(c0 + cn, p.col_begin + p.col_count)
                if a1 <= a0 or b1 <= b0:
                    continue
                view.segments.add(source=pseudo, row_begin=a0 - p.row_begin, row_count=a1 - a0,
                                  col_begin=b0 - p.col_begin, col_count=b1 - b0,
                                  dest_offset=dest + (a0 - r0) * stride + (b0 - c0),
                                  dest_row_stride=stride)
        if view.segments:
            out.append(view)
    return out


def link_views(plan, rank, daemon, engines):
    """{engine id: its layout seen through link (rank, daemon)} for the
    engines `engines` ({engine id: layout}) that take any of its pieces,
    and the link's manifest (the pieces' pseudo tensors)."""
    names = [t["name"] if isinstance(t, dict) else t.name for t in plan.tensors]
    manifest = transfer_plan.link_manifest(plan, rank, daemon)
    pieces = [(m["name"], p) for m, p in zip(manifest, plan.link_pieces(rank, daemon))]
    views = {}
    for engine_id, layout in engines.items():
        view = _view(layout, pieces, names)
        if view:
            views[engine_id] = view
    return views, manifest


def partial_receipts(plan, rank, daemon, engines, payloads, on_gpu=False):
    """{engine id: [checksum (str), bytes]} of what rank `rank` sends
    daemon `daemon` (its receiver index): `engines` {engine id: layout
    (v1.Parameter messages)} of that daemon, `payloads` the link's piece
    bytes in link order: bytes objects, or with `on_gpu` flat uint8 torch
    CUDA tensors, summed where they are (weightsync.receipts'
    expected_receipt_arrays: the Triton kernel, else torch ops)."""
    views, manifest = link_views(plan, rank, daemon, engines)
    if on_gpu:
        from weightsync._gpu import elements
        sent = {m["name"]: (m["dtype"], tuple(m["shape"]), elements(data, m["dtype"]))
                for m, data in zip(manifest, payloads)}
        receipt = expected_receipt_arrays
    else:
        sent = {m["name"]: (m["dtype"], tuple(m["shape"]), np.frombuffer(data, np.uint8))
                for m, data in zip(manifest, payloads)}
        receipt = expected_receipt
    out = {}
    for engine_id, view in views.items():
        checksum, _, nbytes = receipt(view, sent)
        out[engine_id] = [str(int(checksum)), int(nbytes)]
    return out


def add_partials(parts):
    """{engine id: (checksum, bytes)}: the ranks' parts summed mod 2^64."""
    total = {}
    for part in parts:
        for engine_id, (checksum, nbytes) in (part or {}).items():
            c, b = total.get(engine_id, (0, 0))
            total[engine_id] = ((c + int(checksum)) & _M64, b + nbytes)
    return total

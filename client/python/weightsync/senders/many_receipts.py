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

FP8 targets (docs/protocol.md, "FP8 targets"): the daemon quantises each
block with the amax of the whole block, which a rank holding part of it
(row shards off the block rows, column shards, replicas whose rows the
plan splits anywhere) cannot know; given the amax, quantisation is
elementwise. So each rank reports, for every block it sends part of but
not all, its part's amax and element count (fp8_block_parts); the ranks
gather those in one exchange, combine_block_parts makes each block's amax
(the max of the parts': exact) and its owner (the lowest rank that sends
part of it), and partial_receipts quantises this rank's elements with
those amax and counts a block's scale (4 bytes) on its owner only. A block
that one rank sends whole is reported by nobody: an engine's element is
written once, so that rank is its only sender, its own amax is the
block's, and it counts the scale.
"""

import numpy as np

from weightsync import _xp, transfer_plan
from weightsync._errors import WeightSyncError
from weightsync._proto import v1
from weightsync.receipts import expected_receipt, expected_receipt_arrays, fp8

__all__ = ["link_views", "partial_receipts", "add_partials", "has_fp8_targets",
           "fp8_block_parts", "combine_block_parts", "exchanged_fp8_partials"]

_M64 = (1 << 64) - 1


def _view(layout, pieces, names):
    """The parameters of `layout` restricted to `pieces` [(pseudo name,
    piece)], their segments naming the pieces. FP8 targets keep their
    quantisation (their blocks are the whole parameter's); their scale
    parameters are left out (the daemon writes them, partial_receipts
    counts them)."""
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
        if param.HasField("quantization"):
            view.quantization.CopyFrom(param.quantization)
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
    names = plan.tensor_names
    manifest = transfer_plan.link_manifest(plan, rank, daemon)
    pieces = [(m["name"], p) for m, p in zip(manifest, plan.link_pieces(rank, daemon))]
    views = {}
    for engine_id, layout in engines.items():
        view = _view(layout, pieces, names)
        if view:
            views[engine_id] = view
    return views, manifest


def partial_receipts(plan, rank, daemon, engines, payloads, on_gpu=False, fp8_amax=None,
                     fp8_owner=None):
    """{engine id: [checksum (str), bytes]} of what rank `rank` sends
    daemon `daemon` (its receiver index): `engines` {engine id: layout
    (v1.Parameter messages)} of that daemon, `payloads` the link's piece
    bytes in link order: bytes objects, or with `on_gpu` flat uint8 torch
    CUDA tensors, summed where they are (weightsync.receipts'
    expected_receipt_arrays: the Triton kernel, else torch ops).

    FP8 targets: the FP8 elements this rank sends, quantised with each
    block's amax, and the scale of each block it writes that it owns;
    fp8_amax and fp8_owner, combine_block_parts' of every rank's
    fp8_block_parts for this daemon, name the blocks ranks share (a block
    they do not name: this rank's own amax, and its scale). Without them:
    what a rank that is the only sender of its blocks sends. Summed with
    numpy, on host copies with `on_gpu` too (verify only; the GPU daemon
    takes no FP8 target in a plan yet)."""
    views, manifest = link_views(plan, rank, daemon, engines)
    if on_gpu:
        from weightsync._gpu import elements
        sent = {m["name"]: (m["dtype"], tuple(m["shape"]), elements(data, m["dtype"]))
                for m, data in zip(manifest, payloads)}
        receipt = expected_receipt_arrays
    else:
        sent = _host_sent(manifest, payloads)
        receipt = expected_receipt
    shared = _by_parameter(fp8_amax or {}, fp8_owner or {}, rank)
    out, host = {}, None if on_gpu else sent
    for engine_id, view in views.items():
        plain, quantized, _ = fp8.split_layout(view)
        checksum = nbytes = 0
        if plain:
            checksum, _, nbytes = receipt(plain, sent)
        if quantized:
            if host is None:
                host = _host_sent(manifest, payloads)
            q_sum, q_bytes = _fp8_part(engine_id, quantized, host, shared)
            checksum, nbytes = (int(checksum) + q_sum) & _M64, nbytes + q_bytes
        out[engine_id] = [str(int(checksum)), int(nbytes)]
    return out


def has_fp8_targets(engines):
    """True if an engine of `engines` ([{engine id: layout}], one dict a
    daemon) has an FP8 target: its partial receipts need fp8_block_parts."""
    return any(p.HasField("quantization") for daemon in engines for layout in daemon.values()
               for p in layout)


def fp8_block_parts(plan, rank, daemon, engines, payloads):
    """{"engine id/parameter/block": [amax, count]} of the blocks of FP8
    targets of daemon `daemon`'s engines that rank `rank` sends part of
    but not all (arguments as partial_receipts'; torch payloads are copied
    to the host): the amax of its elements of the block (a float32 value,
    weightsync.receipts.fp8.block_amax: max |x| over the finite ones) and
    how many it sends. Blocks are numbered row-major in the parameter's
    grid of blocks (fp8.block_shape, edge blocks partial). Strings, floats
    and ints only: what a collective gathers."""
    views, manifest = link_views(plan, rank, daemon, engines)
    out, host = {}, None
    for engine_id, view in views.items():
        quantized = fp8.split_layout(view)[1]
        if not quantized:
            continue
        if host is None:
            host = _host_sent(manifest, payloads)
        by_name = {p.name: p for p in quantized}
        for name, (amax, counts) in fp8.block_stats(quantized, host).items():
            counts = counts.reshape(-1)
            cut = np.flatnonzero((counts > 0) & (counts < _block_sizes(by_name[name])))
            for b, a, n in zip(cut.tolist(), amax.reshape(-1)[cut].tolist(),
                               counts[cut].tolist()):
                out[f"{engine_id}/{name}/{b}"] = [a, n]
    return out


def combine_block_parts(parts):
    """(fp8_amax {key: amax}, fp8_owner {key: rank}) for partial_receipts
    of every rank's fp8_block_parts for one daemon (rank r's at index r;
    None or {} when it has none): each block's amax, the max of its parts'
    (exact), and its owner, the lowest rank that sends part of it (it
    counts the block's scale)."""
    amax, owner = {}, {}
    for rank, part in enumerate(parts):
        for key, (a, n) in (part or {}).items():
            if n <= 0:
                continue
            if key in owner:
                amax[key] = max(amax[key], float(a))
            else:
                amax[key], owner[key] = float(a), rank
    return amax, owner


def _host_sent(manifest, payloads):
    """{pseudo name: (dtype, shape, flat uint8 numpy array)} of a link's
    payloads (bytes, or torch tensors copied to the host)."""
    out = {}
    for m, data in zip(manifest, payloads):
        if _xp.is_torch(data):
            data = data.detach().contiguous().reshape(-1).cpu().numpy()
        out[m["name"]] = (m["dtype"], tuple(m["shape"]), np.frombuffer(data, np.uint8))
    return out


def _block_sizes(param):
    """Elements of each block of FP8 target `param`, flat (edge blocks
    partial)."""
    br, bc, rows, cols = fp8.block_shape(param)
    r = np.minimum(br, rows - np.arange(0, rows, br))
    c = np.minimum(bc, cols - np.arange(0, cols, bc))
    return (r[:, None] * c[None, :]).reshape(-1)


def _by_parameter(amax, owner, rank):
    """{"engine id/parameter": (blocks, amax, owned by `rank`)} of
    combine_block_parts' maps."""
    out = {}
    for key, a in amax.items():
        prefix, block = key.rsplit("/", 1)
        blocks, values, owned = out.setdefault(prefix, ([], [], []))
        blocks.append(int(block))
        values.append(a)
        owned.append(owner.get(key, rank) == rank)
    return out


def _fp8_part(engine_id, quantized, sent, shared):
    """(checksum, bytes) of the FP8 targets `quantized` of this rank's view
    of engine `engine_id` (numpy `sent`): fp8.quantized_receipt with the
    shared blocks' amax and owners (_by_parameter) over the parameters'
    own."""
    named = [p for p in quantized if f"{engine_id}/{p.name}" in shared]
    amax, scales = {}, {}
    for name, (own, counts) in fp8.block_stats(named, sent).items():
        blocks, values, owned = shared[f"{engine_id}/{name}"]
        a = own.reshape(-1).copy()
        a[blocks] = values
        counted = counts.reshape(-1) > 0
        counted[blocks] = owned
        amax[name], scales[name] = a.reshape(own.shape), counted.reshape(own.shape)
    checksum, _, nbytes = fp8.quantized_receipt(quantized, sent, amax=amax, scales=scales)
    return int(checksum), int(nbytes)


def add_partials(parts):
    """{engine id: (checksum, bytes)}: the ranks' parts summed mod 2^64."""
    total = {}
    for part in parts:
        for engine_id, (checksum, nbytes) in (part or {}).items():
            c, b = total.get(engine_id, (0, 0))
            total[engine_id] = ((c + int(checksum)) & _M64, b + nbytes)
    return total


def exchanged_fp8_partials(collective, plan, rank, engines, payloads):
    """[partial receipts of each daemon] of rank `rank`'s part of an update
    with FP8 targets. `payloads`: what it sent each daemon (its piece bytes,
    0 for none); `engines`: [{engine id: layout}] per daemon. One
    all_gather of every rank's fp8_block_parts (the blocks it sends part
    of), then its partial receipts with the blocks' amax and owners
    (combine_block_parts). Every rank calls it once an update, in step:
    payloads None when its sends failed (it reports nothing; then, and when
    another rank reported nothing, it returns []: the failed rank's outcome
    aborts the update)."""
    parts, error = None, None
    if payloads is not None:
        try:
            parts = {str(i): fp8_block_parts(plan, rank, i, engines[i], p)
                     for i, p in enumerate(payloads) if p}
        except Exception as e:  # noqa: BLE001 - reported after the exchange
            error = WeightSyncError("INTERNAL", f"FP8 block parts: {e!r}")
    try:
        gathered = collective.all_gather(parts)
    except Exception as e:  # a rank gone: the collective timed out
        raise WeightSyncError("ABORTED", "the ranks' FP8 block parts were not "
                              f"gathered ({e})") from None
    if error is not None:
        raise error
    if payloads is None or any(g is None for g in gathered):
        return []
    out = []
    for i, p in enumerate(payloads):
        if p:
            amax, owner = combine_block_parts(g.get(str(i)) for g in gathered)
            p = partial_receipts(plan, rank, i, engines[i], p, fp8_amax=amax, fp8_owner=owner)
        out.append(p)
    return out

"""FP8 on the wire through a transfer plan (issue 32, item 3;
docs/transfer_plan.md, "FP8 on the wire"): every rank quantises its own
pieces of the tensors that can travel quantised, with the one FP8
function, and sends a byte an element plus the scales of their blocks.

A tensor travels quantised when weightsync.wire_fp8.wire_plan admits it
into every engine of every daemon (each use an FP8 target of one format,
block and scale form, on whole blocks of it) and every piece of it, on
every rank, lies on whole blocks of it, so that each piece's blocks are
the tensor's. Where a shard cuts a block, that tensor goes as it is and
the daemons quantise it (a block cut between senders needs all of its
elements in one place). The ranks agree once per plan in one exchange:
each names the tensors its own pieces cut. The Start names the tensors
(plan_wire); each piece's payload is its rectangle quantised as a tensor
of its own (weightsync.wire_fp8.quantize_raw).
"""

from weightsync import transfer_plan
from weightsync._proto import v1
from weightsync.wire_fp8 import quantization_message, quantize_raw, wire_plan

__all__ = ["agreed", "link_manifest", "payloads", "plan_wire_messages"]

_FLOAT = ("FLOAT32", "BFLOAT16", "FLOAT16")


def _name(t):
    return t["name"] if isinstance(t, dict) else t.name


def _on_blocks(piece, shape, fields):
    """Whether `piece` of a tensor of `shape` lies on whole blocks of it."""
    rows, cols = transfer_plan.view_2d(shape)
    per_row = fields.get("scheme") == "QUANT_SCHEME_PER_ROW"
    br = 1 if per_row else fields.get("block_rows") or 128
    bc = cols if per_row else fields.get("block_cols") or 128

    def on(begin, count, block, end):
        return begin % block == 0 and ((begin + count) % block == 0 or begin + count == end)
    return (on(piece.row_begin, piece.row_count, br, rows)
            and on(piece.col_begin, piece.col_count, bc, cols))


def agreed(coll, plan, rank, manifest, engines):
    """{tensor name: Quantization fields} of the tensors every rank sends
    quantised on `plan` (this rank's pieces: build_plan(sender=rank)):
    `manifest` the global tensors [{"name", "dtype", "shape"}], `engines`
    [{engine id: layout}] of every daemon. One all_gather of `coll`; every
    rank gets the same answer."""
    shapes = {_name(t): list(t["shape"]) for t in manifest if t["dtype"] in _FLOAT}
    fit = wire_plan([layout for daemon in engines for layout in daemon.values()], shapes)
    names = plan.tensor_names
    cut = set()
    for i in range(plan.num_receivers):
        for p in plan.link_pieces(rank, i):
            name = names[p.tensor]
            if name in fit and not _on_blocks(p, shapes[name], fit[name]):
                cut.add(name)
    everywhere = set()
    for found in coll.all_gather(sorted(cut)):
        everywhere.update(found)
    return {n: f for n, f in sorted(fit.items()) if n not in everywhere}


def plan_wire_messages(wire):
    """The Start's plan_wire entries of `wire` (agreed)."""
    return [v1.PlanWireTensor(tensor=n, quantization=quantization_message(f))
            for n, f in sorted(wire.items())]


def link_manifest(plan, rank, daemon, wire):
    """transfer_plan.link_manifest of link (rank, daemon) with the pieces of
    `wire`'s tensors quantised, as the daemon plans them: the FP8 format
    for dtype and the Quantization fields."""
    manifest = transfer_plan.link_manifest(plan, rank, daemon)
    if not wire:
        return manifest
    names = plan.tensor_names
    for k, p in enumerate(plan.link_pieces(rank, daemon)):
        fields = wire.get(names[p.tensor])
        if fields is not None:
            manifest[k] = dict(manifest[k], dtype=fields["format"], quantization=fields,
                               source_dtype=manifest[k]["dtype"])
    return manifest


def payloads(manifest, data, patched=()):
    """Each piece's bytes as they travel: `data` (the pieces' row-major
    bytes, in `manifest` order: link_manifest's), a quantised piece's
    replaced by its FP8 payload (pieces in `patched` travel as their
    patch: left as they are)."""
    out = []
    for k, (m, d) in enumerate(zip(manifest, data)):
        fields = m.get("quantization")
        if fields is None or k in patched:
            out.append(d)
            continue
        rows, cols = m["shape"]
        out.append(quantize_raw(d, m["source_dtype"], rows, cols, fields))
    return out

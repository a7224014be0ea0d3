"""Sparse patches through a transfer plan (issue 32; docs/transfer_plan.md,
"Sparse patches"): each rank diffs its own pieces against what it sent
last, on the same plan, and sends each piece that changed little as a
patch (its changed elements' flat indices into the piece, then their
values), every other piece dense.

The daemons learn which pieces are patches from the leader's Start
(StartWeightUpdateRequest.plan_sparse, one entry per patched piece), so
every rank's list reaches the leader in the exchange that precedes the
Start (weightsync.senders.many). A rank without a basis for the base
version (its first update on this plan, a failed last update, a piece
over the basis budget) sends dense; dense and patched pieces mix freely.
"""

import numpy as np

from weightsync import sparse
from weightsync._proto import v1
from weightsync.receipts.core import bits32_np, layout_regions, salt32, terms32
from weightsync.senders.many_receipts import link_views

__all__ = ["Basis", "fp8_fed", "patch_entries", "link_manifest_with_patches",
           "receipt_deltas", "wire_figures"]

_M64 = (1 << 64) - 1


class Basis:
    """What this rank sent last: the bytes of each of its pieces, by
    (daemon, piece index of its link), for one (plan id, version); pieces
    beyond `budget` bytes (None: no bound) are not kept and go dense."""

    def __init__(self, budget=None):
        self.budget = budget
        self.clear()

    def clear(self):
        self.plan_id, self.version, self.pieces = None, None, {}
        # {daemon: this rank's partial receipts of its link} at that version
        # (receipts on), so that a patched update sums only what changed.
        self.receipts = {}

    def keep(self, plan_id, version, payloads, receipts=None):
        """After an update committed: `payloads` {daemon: [piece bytes]},
        `receipts` {daemon: partial receipts} where they were summed."""
        self.clear()
        self.receipts = dict(receipts or {})
        left = self.budget
        for daemon, pieces in payloads.items():
            for k, data in enumerate(pieces):
                if left is not None and len(data) > left:
                    continue
                self.pieces[(daemon, k)] = data
                left = None if left is None else left - len(data)
        self.plan_id, self.version = plan_id, version

    def after(self, plan_id, version, payloads, committed, receipts=None):
        """After an update: keep what it sent if it committed, else
        nothing."""
        if committed:
            self.keep(plan_id, version, payloads, receipts)
        else:
            self.clear()

    def link_patches(self, plan, rank, base_version, payloads, max_density, fed):
        """{daemon: {piece index: SparsePatch}} of rank `rank`'s links
        (payloads: {daemon: [piece bytes]}), the links with none left out.
        `fed` [the names fp8_fed gives of daemon i's engines]: a piece of a
        tensor that feeds an FP8 target of daemon i goes dense to it (the
        daemon refuses its patch: the blocks' scales would go stale),
        quantised where it travels so."""
        names = plan.tensor_names
        out = {}
        for i, data in payloads.items():
            pieces = [None if names[p.tensor] in fed[i] else p
                      for p in plan.link_pieces(rank, i)]
            found = self.patches(plan.id, base_version, i, pieces, data, max_density)
            if found:
                out[i] = found
        return out

    def receipts_of(self, plan, rank, daemon, engines, payloads):
        """This rank's partial receipts of link `daemon` after it sends
        `payloads`, from those it kept and the terms of the elements that
        changed (receipt_deltas), or None where it kept none or lacks a
        piece's basis."""
        kept = self.receipts.get(daemon)
        before = [self.pieces.get((daemon, k)) for k in range(len(payloads))]
        if kept is None or any(b is None or len(b) != len(p) for b, p in zip(before, payloads)):
            return None
        deltas = receipt_deltas(plan, rank, daemon, engines, before, payloads)
        if set(deltas) != set(kept):
            return None
        return {e: [str((int(c) + deltas[e]) & _M64), n] for e, (c, n) in kept.items()}

    def patches(self, plan_id, base_version, daemon, pieces, payloads, max_density):
        """{piece index: SparsePatch} of link `daemon` where a piece changed
        in at most max_density of its elements since base_version (a piece
        given as None goes dense)."""
        if plan_id != self.plan_id or base_version != self.version:
            return {}
        out = {}
        for k, (piece, data) in enumerate(zip(pieces, payloads)):
            before = self.pieces.get((daemon, k))
            if piece is None or before is None or len(before) != len(data) or not data:
                continue
            width = len(data) // (piece.row_count * piece.col_count)
            view = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[width]
            patch = sparse.diff(np.frombuffer(before, view), np.frombuffer(data, view),
                                max_density=max_density)
            if patch is not None and patch.nnz > 0:
                out[k] = patch
        return out


def fp8_fed(layouts):
    """Names of the tensors that feed an FP8 target of `layouts` (layouts:
    lists of weightsync.v1.Parameter): a quantised parameter's segments'
    sources, or its own name where it has none."""
    out = set()
    for layout in layouts:
        for p in layout:
            if p.HasField("quantization"):
                out.update([s.source for s in p.segments] if p.segments else [p.name])
    return out


def patch_entries(rank, patches):
    """The Start's plan_sparse entries of this rank's patches
    {daemon: {piece index: SparsePatch}} (plain lists: they travel through
    the collective)."""
    return [[rank, int(daemon), k, int(p.nnz), int(p.index_bytes)]
            for daemon, by_piece in patches.items() for k, p in sorted(by_piece.items())]


def plan_sparse_messages(entries):
    """v1.PlanSparsePiece messages of every rank's entries."""
    return [v1.PlanSparsePiece(sender=s, receiver=r, piece=k, nnz=n, index_bytes=b)
            for s, r, k, n, b in entries]


def link_manifest_with_patches(manifest, patches):
    """The link manifest with each patched piece's sparse_nnz and index
    width, as the daemon plans it."""
    out = []
    for k, m in enumerate(manifest):
        p = patches.get(k)
        out.append(m if p is None else dict(m, sparse_nnz=int(p.nnz),
                                            sparse_index_bytes=int(p.index_bytes)))
    return out


def receipt_deltas(plan, rank, daemon, engines, before, after):
    """{engine id: the change (mod 2^64) of rank `rank`'s partial receipt of
    link `daemon` (weightsync.senders.many_receipts.partial_receipts) when
    its pieces' bytes go from `before` to `after`}: the checksum is a sum of
    one term per installed element, keyed by its place, so only the
    elements whose bits changed count, new term minus old. Plain
    parameters only (no FP8 target takes a patch)."""
    views, manifest = link_views(plan, rank, daemon, engines)
    changed, sent = {}, {}
    for m, old, new in zip(manifest, before, after):
        numel = m["shape"][0] * m["shape"][1]
        if not numel:
            continue
        width = len(new) // numel
        o = np.frombuffer(old, f"u{width}")
        n = np.frombuffer(new, f"u{width}")
        idx = np.flatnonzero(o != n)
        if idx.size:
            changed[m["name"]] = (m["dtype"], idx, o[idx], n[idx])
            sent[m["name"]] = (m["dtype"], tuple(m["shape"]), None)
    out = {}
    for engine_id, view in views.items():
        total = 0
        for name, dst, regions in layout_regions(view, sent):
            for source, _, cols, rb, cb, rc, cc, dest, stride in regions or ():
                src, idx, o, n = changed[source]
                r, c = idx // cols, idx % cols
                keep = (r >= rb) & (r < rb + rc) & (c >= cb) & (c < cb + cc)
                if not keep.any():
                    continue
                at = dest + (r[keep] - rb) * stride + (c[keep] - cb)
                salt = salt32(name)
                for values, sign in ((n[keep], 1), (o[keep], -1)):
                    bits = bits32_np(np.ascontiguousarray(values).view(np.uint8), src, dst)
                    total += sign * int(terms32(bits, at, salt).sum(dtype=np.uint64))
        out[engine_id] = total & _M64
    return out


def wire_figures(payloads, wire, patches, from_deltas=0):
    """What a rank's pieces ({daemon: [bytes]}) weigh dense and as they
    travel (`wire` {daemon: [bytes]}: patches, FP8 payloads, dense bytes),
    how many went as patches (`patches` {daemon: {piece: SparsePatch}}),
    and how many links' receipts came from deltas (`from_deltas`, counted
    by the sender): ManySenders.last_wire, for tests and benchmarks."""
    return {"dense_bytes": sum(len(d) for p in payloads.values() for d in p),
            "wire_bytes": sum(len(d) for p in wire.values() for d in p),
            "patched_pieces": sum(len(p) for p in patches.values()),
            "receipts_from_deltas": from_deltas}

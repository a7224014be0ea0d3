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

__all__ = ["Basis", "patch_entries", "link_manifest_with_patches"]


class Basis:
    """What this rank sent last: the bytes of each of its pieces, by
    (daemon, piece index of its link), for one (plan id, version); pieces
    beyond `budget` bytes (None: no bound) are not kept and go dense."""

    def __init__(self, budget=None):
        self.budget = budget
        self.clear()

    def clear(self):
        self.plan_id, self.version, self.pieces = None, None, {}

    def keep(self, plan_id, version, payloads):
        """After an update committed: `payloads` {daemon: [piece bytes]}."""
        self.clear()
        left = self.budget
        for daemon, pieces in payloads.items():
            for k, data in enumerate(pieces):
                if left is not None and len(data) > left:
                    continue
                self.pieces[(daemon, k)] = data
                left = None if left is None else left - len(data)
        self.plan_id, self.version = plan_id, version

    def after(self, plan_id, version, payloads, committed):
        """After an update: keep what it sent if it committed, else
        nothing."""
        if committed:
            self.keep(plan_id, version, payloads)
        else:
            self.clear()

    def link_patches(self, plan, rank, base_version, payloads, max_density):
        """{daemon: {piece index: SparsePatch}} of rank `rank`'s links
        (payloads: {daemon: [piece bytes]}), the links with none left out."""
        out = {}
        for i, data in payloads.items():
            found = self.patches(plan.id, base_version, i, plan.link_pieces(rank, i), data,
                                 max_density)
            if found:
                out[i] = found
        return out

    def patches(self, plan_id, base_version, daemon, pieces, payloads, max_density):
        """{piece index: SparsePatch} of link `daemon` where a piece changed
        in at most max_density of its elements since base_version."""
        if plan_id != self.plan_id or base_version != self.version:
            return {}
        out = {}
        for k, (piece, data) in enumerate(zip(pieces, payloads)):
            before = self.pieces.get((daemon, k))
            if before is None or len(before) != len(data) or not data:
                continue
            width = len(data) // (piece.row_count * piece.col_count)
            view = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[width]
            patch = sparse.diff(np.frombuffer(before, view), np.frombuffer(data, view),
                                max_density=max_density)
            if patch is not None and patch.nnz > 0:
                out[k] = patch
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

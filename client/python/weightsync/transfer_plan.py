#!/usr/bin/env python3
"""Reference implementation of the transfer plan (issue 32): which trainer
rank sends which bytes of which checkpoint tensor to which receiver when
every trainer rank sends its own share (M senders -> N receivers).

The specification is docs/transfer_plan.md; the C++ implementation is
common/transfer_plan.{h,cc}. Both must agree on every case of
tests/vectors/transfer_plan.json, which this module generates:

    python3 client/python/weightsync/transfer_plan.py --write tests/vectors/transfer_plan.json
    python3 client/python/weightsync/transfer_plan.py --check tests/vectors/transfer_plan.json

A spec is a mapping (or a weightsync.v1.TransferPlanSpec message):
``{"tensors": [TensorSpec...], "senders": [{"holds": [block...]}...],
"receivers": [{"name": str, "needs": [block...]}...]}`` where a block is
``{"tensor": name, "row_begin", "row_count", "col_begin", "col_count"}``
over the tensor's 2-D view [shape[0], prod(shape[1:])]. `block()`,
`whole()`, `shard()` and `holds_by_pattern()` build blocks from what a
rank holds. Standard library only; `build_plan` is a pure function.
"""

import fnmatch
import hashlib
import json
import random
import sys

try:
    from weightsync import planner
except ImportError:  # run as a script (--write / --check)
    import planner

__all__ = [
    "SPEC_VERSION",
    "TransferPlanError",
    "Piece",
    "Plan",
    "block",
    "whole",
    "shard",
    "holds_by_pattern",
    "view_2d",
    "plan_id",
    "build_plan",
    "link_manifest",
]

SPEC_VERSION = 2  # 2: the plan id is SHA-256, not FNV-1a 64
_MAX_BYTES = 2**62
_MAX_CELLS_PER_TENSOR = 2**22


class TransferPlanError(ValueError):
    """A spec the plan refuses (the C++ plan's INVALID_ARGUMENT); the
    message names the tensor and the ranks concerned."""


def _get(obj, snake, camel=None, default=None):
    if isinstance(obj, dict):
        if snake in obj:
            return obj[snake]
        if camel is not None and camel in obj:
            return obj[camel]
        return default
    return getattr(obj, snake, default)


def view_2d(shape):
    """The 2-D view [rows, cols] segments and blocks index: [shape[0],
    prod(shape[1:])], a scalar [1, 1]."""
    shape = list(shape)
    if not shape:
        return 1, 1
    cols = 1
    for d in shape[1:]:
        cols *= d
    return shape[0], cols


def block(tensor, row_begin, row_count, col_begin, col_count):
    return {"tensor": tensor, "row_begin": int(row_begin), "row_count": int(row_count),
            "col_begin": int(col_begin), "col_count": int(col_count)}


def whole(tensor, shape):
    """The whole tensor (Replicate, or a rank that holds all of it)."""
    rows, cols = view_2d(shape)
    return block(tensor, 0, rows, 0, cols)


def shard(tensor, shape, dim, index, count):
    """Shard `index` of `count` along `dim` (0: rows, 1: columns of the 2-D
    view), cut as torch.chunk / DTensor's Shard(dim) does: ceil(n / count)
    per shard, the last ones shorter or empty (None when empty)."""
    shape = list(shape)
    rows, cols = view_2d(shape)
    if dim not in (0, 1) or (dim == 1 and len(shape) < 2):
        raise TransferPlanError(f"tensor '{tensor}': shard along dim {dim} of shape {shape} "
                                f"is not a block of its 2-D view (dims 0 and 1 only)")
    n = shape[dim] if shape else 1
    step = -(-n // count) if count else 0
    lo, hi = min(n, index * step), min(n, (index + 1) * step)
    if hi <= lo:
        return None
    if dim == 0:
        return block(tensor, lo, hi - lo, 0, cols)
    inner = cols // shape[1] if shape[1] else 0
    return block(tensor, 0, rows, lo * inner, (hi - lo) * inner)


def holds_by_pattern(tensors, rules):
    """Blocks of `tensors` (TensorSpecs or mappings) chosen by name
    patterns, for layouts without DTensors (Megatron TP shards, expert
    subsets). `rules` is a list of (fnmatch pattern, placement) where
    placement is "whole", ("shard", dim, index, count) or None (not held);
    the first rule that matches a name decides."""
    out = []
    for t in tensors:
        name, shape = _get(t, "name"), list(_get(t, "shape", default=[]))
        for pattern, placement in rules:
            if not fnmatch.fnmatchcase(name, pattern):
                continue
            if placement == "whole":
                out.append(whole(name, shape))
            elif placement is not None:
                _, dim, index, count = placement
                b = shard(name, shape, dim, index, count)
                if b is not None:
                    out.append(b)
            break
    return out


class Piece(tuple):
    """(tensor, row_begin, row_count, col_begin, col_count, sender,
    receiver, bytes): rows x cols of manifest tensor `tensor` sent by
    `sender` to `receiver`, row-major in the tensor's dtype on the wire."""
    __slots__ = ()
    _fields = ("tensor", "row_begin", "row_count", "col_begin", "col_count",
               "sender", "receiver", "bytes")

    def __new__(cls, *values):
        return tuple.__new__(cls, values)

    tensor = property(lambda self: self[0])
    row_begin = property(lambda self: self[1])
    row_count = property(lambda self: self[2])
    col_begin = property(lambda self: self[3])
    col_count = property(lambda self: self[4])
    sender = property(lambda self: self[5])
    receiver = property(lambda self: self[6])
    bytes = property(lambda self: self[7])


class Plan:
    """The plan of a spec: `pieces` ordered by (sender, receiver, tensor,
    row_begin, col_begin); `links[s][r]` the indices of link (s, r)'s
    pieces in stream order; bytes per sender and receiver (of the whole
    plan); `unused` the tensors no receiver needs. `sender`: None, or the
    one sender whose pieces this plan holds (build_plan(spec, sender=s):
    the other senders' links are empty, their bytes still counted)."""

    def __init__(self, pid, tensors, num_senders, num_receivers, pieces, unused,
                 sender_bytes, receiver_bytes, sender=None):
        self.id = pid
        self.tensors = tensors
        # Each tensor's name, by index (tensors are manifest dicts or
        # TensorSpec messages).
        self.tensor_names = [t["name"] if isinstance(t, dict) else t.name for t in tensors]
        self.num_senders = num_senders
        self.num_receivers = num_receivers
        self.pieces = pieces
        self.unused = unused
        self.sender = sender
        self.links = [[[] for _ in range(num_receivers)] for _ in range(num_senders)]
        for k, p in enumerate(pieces):
            self.links[p[5]][p[6]].append(k)
        self.sender_bytes = sender_bytes
        self.receiver_bytes = receiver_bytes

    def link_pieces(self, sender, receiver):
        return [self.pieces[k] for k in self.links[sender][receiver]]


def _dtype_number(dtype):
    if isinstance(dtype, int) and not isinstance(dtype, bool):
        return dtype
    for number, name in _DTYPES.items():
        if name == dtype:
            return number
    return -1


_DTYPES = {1: "FLOAT32", 2: "BFLOAT16", 3: "FLOAT16", 4: "FLOAT64", 5: "INT64", 6: "INT32",
           7: "INT16", 8: "INT8", 9: "UINT8", 10: "BOOL", 11: "FLOAT8_E4M3FN", 12: "FLOAT8_E5M2"}


def _dtype_name(dtype):
    if isinstance(dtype, int) and not isinstance(dtype, bool):
        return _DTYPES.get(dtype, str(dtype))
    return dtype


def _blocks(obj, field):
    return list(_get(obj, field, default=[]) or [])


def _block_tuple(b):
    if type(b) is dict and len(b) == 5 and "col_count" in b:   # block()'s
        try:
            return (b["tensor"], int(b["row_begin"]), int(b["row_count"]),
                    int(b["col_begin"]), int(b["col_count"]))
        except KeyError:
            pass
    return (_get(b, "tensor", default=""), int(_get(b, "row_begin", "rowBegin", 0)),
            int(_get(b, "row_count", "rowCount", 0)), int(_get(b, "col_begin", "colBegin", 0)),
            int(_get(b, "col_count", "colCount", 0)))


def plan_id(spec):
    """The first 8 bytes of the SHA-256 of the spec's canonical text, in hex
    (docs/transfer_plan.md)."""
    h = hashlib.sha256(f"weightsync transfer plan {SPEC_VERSION}\n".encode())
    for t in _get(spec, "tensors", default=[]):
        name = _get(t, "name", default="")
        shape = ",".join(str(int(d)) for d in _get(t, "shape", default=[]))
        nnz = int(_get(t, "sparse_nnz", "sparseNnz", 0))
        h.update(f"T {len(name.encode())}:{name} {_dtype_number(_get(t, 'dtype'))} "
                 f"{shape} {nnz}\n".encode())
    for s, sender in enumerate(_get(spec, "senders", default=[])):
        h.update(f"S {s}\n".encode())
        h.update("".join(_block_text("H", _block_tuple(b))
                         for b in _blocks(sender, "holds")).encode())
    for r, receiver in enumerate(_get(spec, "receivers", default=[])):
        name = _get(receiver, "name", default="")
        h.update(f"R {r} {len(name.encode())}:{name}\n".encode())
        h.update("".join(_block_text("N", _block_tuple(b))
                         for b in _blocks(receiver, "needs")).encode())
    return f"tp{SPEC_VERSION}-{h.hexdigest()[:16]}"


def _block_text(tag, b):
    name = b[0]
    return f"{tag} {len(name.encode())}:{name} {b[1]} {b[2]} {b[3]} {b[4]}\n"


def _rect_str(r):
    return f"rows [{r[0]}, {r[0] + r[1]}) cols [{r[2]}, {r[2] + r[3]})"


class _Tensor:
    __slots__ = ("name", "shape", "rows", "cols", "esize", "empty", "held", "needed")


def _collect(spec):
    senders = list(_get(spec, "senders", default=[]))
    receivers = list(_get(spec, "receivers", default=[]))
    if not senders:
        raise TransferPlanError("transfer plan: no senders")
    if not receivers:
        raise TransferPlanError("transfer plan: no receivers")
    tensors, index = [], {}
    for i, t in enumerate(_get(spec, "tensors", default=[])):
        name = _get(t, "name", default="")
        if not name:
            raise TransferPlanError(f"tensor {i}: empty name")
        if name in index:
            raise TransferPlanError(f"tensor '{name}' appears twice")
        esize = planner.element_size(_dtype_name(_get(t, "dtype")))
        shape = [int(d) for d in _get(t, "shape", default=[])]
        if esize is None:
            raise TransferPlanError(f"tensor '{name}': unknown dtype {_get(t, 'dtype')}")
        if any(d < 0 for d in shape) or planner.numel(shape) * esize > _MAX_BYTES:
            raise TransferPlanError(f"tensor '{name}': bad shape {shape}")
        if int(_get(t, "sparse_nnz", "sparseNnz", 0)) != 0:
            raise TransferPlanError(f"tensor '{name}': a transfer plan carries dense tensors "
                                    "(sparse patches follow the plan's pieces, not its spec)")
        info = _Tensor()
        info.name, info.shape, info.esize = name, shape, esize
        info.rows, info.cols = view_2d(shape)
        info.empty = planner.numel(shape) == 0
        info.held, info.needed = [], []
        index[name] = i
        tensors.append(info)

    def add(b, who, rank, held):
        name, r0, rn, c0, cn = _block_tuple(b)
        if name not in index:
            raise TransferPlanError(f"{who} declares tensor '{name}', not in the manifest")
        t = tensors[index[name]]
        fits = (r0 >= 0 and c0 >= 0 and rn >= 0 and cn >= 0 and r0 + rn <= t.rows
                and c0 + cn <= t.cols and (t.empty or (rn > 0 and cn > 0)))
        if not fits:
            raise TransferPlanError(
                f"tensor '{name}': {who}'s block rows [{r0} +{rn}) cols [{c0} +{cn}) does not fit "
                f"the tensor's 2-D view [{t.rows}, {t.cols}] (shape {t.shape}) or is empty")
        if not t.empty:
            (t.held if held else t.needed).append(((r0, rn, c0, cn), rank))

    for s, sender in enumerate(senders):
        for b in _blocks(sender, "holds"):
            add(b, f"sender {s}", s, True)
    for r, receiver in enumerate(receivers):
        who = f"receiver {r} ('{_get(receiver, 'name', default='')}')"
        for b in _blocks(receiver, "needs"):
            add(b, who, r, False)
    return tensors, senders, receivers


def _cuts(end, t, axis):
    cuts = {0, end}
    for lst in (t.held, t.needed):
        for rect, _ in lst:
            cuts.add(rect[axis])
            cuts.add(rect[axis] + rect[axis + 1])
    return sorted(cuts)


class _Out:
    """What the planning appends to: the pieces of `sender` (None: of
    every sender) and the bytes of every sender and receiver."""

    def __init__(self, sender, num_senders, num_receivers):
        self.sender = sender
        self.pieces = []
        self.load = [0] * num_senders
        self.receiver_bytes = [0] * num_receivers

    def add(self, ti, r0, rn, c0, cn, s, r, nbytes):
        self.load[s] += nbytes
        self.receiver_bytes[r] += nbytes
        if self.sender is None or self.sender == s:
            self.pieces.append(Piece(ti, r0, rn, c0, cn, s, r, nbytes))


def _plan_tensor(ti, t, receivers, out, shared):
    groups = []  # [(rect, [holders])] sorted by (r0, c0, rn, cn)
    for rect, s in sorted(t.held, key=lambda x: ((x[0][0], x[0][2], x[0][1], x[0][3]), x[1])):
        if groups and groups[-1][0] == rect:
            if groups[-1][1][-1] == s:
                raise TransferPlanError(
                    f"tensor '{t.name}': sender {s} declares {_rect_str(rect)} twice")
            groups[-1][1].append(s)
        else:
            groups.append((rect, [s]))
    rc, cc = _cuts(t.rows, t, 0), _cuts(t.cols, t, 2)
    ri = {v: i for i, v in enumerate(rc)}
    ci = {v: i for i, v in enumerate(cc)}
    nr, nc = len(rc) - 1, len(cc) - 1
    if nr * nc > _MAX_CELLS_PER_TENSOR:
        raise TransferPlanError(f"tensor '{t.name}': its blocks cut it into {nr} x {nc} cells, "
                                f"more than {_MAX_CELLS_PER_TENSOR}")
    owner = [-1] * (nr * nc)
    for g, (rect, holders) in enumerate(groups):
        j0, j1 = ci[rect[2]], ci[rect[2] + rect[3]]
        for a, a1 in _runs(ri[rect[0]], ri[rect[0] + rect[1]], j0, j1, nc):
            if max(owner[a:a1]) >= 0:
                o = next(o for o in owner[a:a1] if o >= 0)
                raise TransferPlanError(
                    f"tensor '{t.name}': the block {_rect_str(groups[o][0])} of sender(s) "
                    f"{','.join(map(str, groups[o][1]))} overlaps the block {_rect_str(rect)} "
                    f"of sender(s) {','.join(map(str, holders))}; only identical blocks "
                    "(replicas) may overlap")
            owner[a:a1] = [g] * (a1 - a)
    # need[cell]: a bit per receiver that needs it (receiver r: bit r).
    need = [0] * (nr * nc)
    for rect, who in t.needed:
        bit = 1 << who
        for a, a1 in _runs(ri[rect[0]], ri[rect[0] + rect[1]], ci[rect[2]],
                           ci[rect[2] + rect[3]], nc):
            need[a:a1] = [n | bit for n in need[a:a1]]
    used = False
    load, mask_bytes = out.load, {}
    mine = out.sender
    for i in range(nr):
        a = i * nc
        for j in range(nc):
            n = need[a + j]
            if not n:
                continue
            o = owner[a + j]
            if o < 0:
                first = (n & -n).bit_length() - 1
                name = _get(receivers[first], "name", default="")
                cell = (rc[i], rc[i + 1] - rc[i], cc[j], cc[j + 1] - cc[j])
                raise TransferPlanError(
                    f"tensor '{t.name}': {_rect_str(cell)} needed by receiver {first} ('{name}') "
                    "are held by no sender")
            used = True
            holders = groups[o][1]
            if len(holders) > 1:
                shared.append((ti, (rc[i], rc[i + 1] - rc[i], cc[j], cc[j + 1] - cc[j]),
                               holders, _bits(n)))
                continue
            # One holder: every sender's bytes count; only `mine`'s pieces are made.
            s = holders[0]
            nbytes = (rc[i + 1] - rc[i]) * (cc[j + 1] - cc[j]) * t.esize
            load[s] += nbytes * bin(n).count("1")
            mask_bytes[n] = mask_bytes.get(n, 0) + nbytes
            if mine is None or mine == s:
                out.pieces.extend(Piece(ti, rc[i], rc[i + 1] - rc[i], cc[j], cc[j + 1] - cc[j],
                                        s, r, nbytes) for r in _bits(n))
    for n, nbytes in mask_bytes.items():
        for r in _bits(n):
            out.receiver_bytes[r] += nbytes
    return used


def _runs(i0, i1, j0, j1, nc):
    """The cells of grid rows [i0, i1) x columns [j0, j1) (row-major, nc
    columns) as runs [a, a1) of cell indices: one run when the columns
    are whole, in row-major order."""
    if j0 == 0 and j1 == nc:
        return [(i0 * nc, i1 * nc)]
    return [(i * nc + j0, i * nc + j1) for i in range(i0, i1)]


def _bits(mask):
    """The receivers of a need mask, in increasing order."""
    out, r = [], 0
    while mask:
        if mask & 1:
            out.append(r)
        mask >>= 1
        r += 1
    return out


def _water_fill(cell_job, esize, out):
    ti, rect, holders, receivers = cell_job
    k = len(holders)
    load = out.load
    row_cost = rect[3] * esize * len(receivers)
    total = row_cost * rect[1]
    order = sorted(holders, key=lambda s: (load[s], s))
    j, total_load = 1, load[order[0]]
    while j < k and load[order[j]] * j - total_load < total:
        total_load += load[order[j]]
        j += 1
    rows = [0] * k
    for i in range(j):
        rows[i] = (total_load + total - j * load[order[i]]) // (j * row_cost)
    given = sum(rows)
    by_result = sorted(range(j), key=lambda i: (load[order[i]] + rows[i] * row_cost, order[i]))
    for x in range(rect[1] - given):
        rows[by_result[x]] += 1
    r0 = rect[0]
    for s, n in sorted(zip(order, rows)):
        if n == 0:
            continue
        for r in receivers:
            out.add(ti, r0, n, rect[2], rect[3], s, r, n * rect[3] * esize)
        r0 += n


def _merge(pieces):
    pieces.sort(key=lambda p: (p[5], p[6], p[0], p[1], p[3]))
    out = []
    for p in pieces:
        q = out[-1] if out else None
        if (q is not None and q[5:7] == p[5:7] and q[0] == p[0] and q[1] == p[1]
                and q[2] == p[2] and q[3] + q[4] == p[3]):
            out[-1] = Piece(q[0], q[1], q[2], q[3], q[4] + p[4], q[5], q[6], q[7] + p[7])
        else:
            out.append(p)
    out.sort(key=lambda p: (p[5], p[6], p[0], p[3], p[4], p[1]))
    merged = []
    for p in out:
        q = merged[-1] if merged else None
        if (q is not None and q[5:7] == p[5:7] and q[0] == p[0] and q[3] == p[3]
                and q[4] == p[4] and q[1] + q[2] == p[1]):
            merged[-1] = Piece(q[0], q[1], q[2] + p[2], q[3], q[4], q[5], q[6], q[7] + p[7])
        else:
            merged.append(p)
    merged.sort(key=lambda p: (p[5], p[6], p[0], p[1], p[3]))
    return merged


def build_plan(spec, sender=None):
    """The plan of `spec` (see the module docstring); TransferPlanError
    naming the tensor and ranks for a bad declaration. With `sender`, the
    plan holds only that sender's pieces (what one trainer rank sends:
    the same pieces as the whole plan's, made in a fraction of the time
    and memory where there are many senders)."""
    tensors, senders, receivers = _collect(spec)
    if sender is not None and not 0 <= sender < len(senders):
        raise TransferPlanError(f"sender {sender}: the spec has {len(senders)} senders")
    out = _Out(sender, len(senders), len(receivers))
    shared, unused = [], []
    for ti, t in enumerate(tensors):
        if t.empty or not _plan_tensor(ti, t, receivers, out, shared):
            unused.append(t.name)
    # Largest shared cells first, so the small ones even out what is left.
    shared.sort(key=lambda c: (-c[1][1] * c[1][3] * tensors[c[0]].esize * len(c[3]), c[0],
                               c[1][0], c[1][2]))
    for job in shared:
        _water_fill(job, tensors[job[0]].esize, out)
    specs = list(_get(spec, "tensors", default=[]))
    return Plan(plan_id(spec), specs, len(senders), len(receivers), _merge(out.pieces), unused,
                out.load, out.receiver_bytes, sender)


def link_manifest(plan, sender, receiver):
    """The manifest of link (sender, receiver)'s stream: piece k is pseudo
    tensor k "<tensor>[r0:r1,c0:c1]" of shape [row_count, col_count], so
    planner.plan_chunks cuts the link's stream as it cuts an update's."""
    out = []
    for p in plan.link_pieces(sender, receiver):
        t = plan.tensors[p.tensor]
        out.append({"name": f"{_get(t, 'name')}[{p.row_begin}:{p.row_begin + p.row_count},"
                            f"{p.col_begin}:{p.col_begin + p.col_count}]",
                    "dtype": _dtype_name(_get(t, "dtype")), "shape": [p.row_count, p.col_count]})
    return out


# ---- shared test vectors (tests/vectors/transfer_plan.json) ----

def _t(name, shape, dtype="BFLOAT16"):
    return {"name": name, "dtype": dtype, "shape": list(shape)}


def _model():
    """A two-layer model with the shapes that matter: a vocab embedding,
    2-D projections, a 1-D norm, a 3-D expert stack and a scalar."""
    return [_t("embed", [50, 8]), _t("l0.qkv", [24, 8]), _t("l0.o", [8, 8]),
            _t("l0.norm", [8], "FLOAT32"), _t("l0.experts", [4, 6, 8]),
            _t("l1.qkv", [24, 8]), _t("l1.o", [8, 8]), _t("l1.norm", [8], "FLOAT32"),
            _t("l1.experts", [4, 6, 8]), _t("scale", [], "FLOAT32")]


def _all(tensors):
    return [whole(t["name"], t["shape"]) for t in tensors]


def _rows(tensors, index, count):
    return [b for b in (shard(t["name"], t["shape"], 0, index, count) for t in tensors) if b]


def _tp(tensors, index, count):
    """A TP engine shard: projections cut by columns (the o/row-parallel
    ones) or rows, norms and scalars whole."""
    out = []
    for t in tensors:
        dim = 1 if t["name"].endswith(".o") else 0
        if len(t["shape"]) < 2 or t["name"] == "scale":
            out.append(whole(t["name"], t["shape"]))
        else:
            out.append(shard(t["name"], t["shape"], dim, index, count))
    return out


def _layer(tensors, prefixes):
    return [whole(t["name"], t["shape"]) for t in tensors
            if any(t["name"].startswith(p) for p in prefixes)]


def _spec(tensors, senders, receivers):
    return {"tensors": tensors, "senders": [{"holds": h} for h in senders],
            "receivers": [{"name": n, "needs": b} for n, b in receivers]}


def vector_specs():
    m = _model()
    tp2_tp1 = [("tp2/0", _tp(m, 0, 2)), ("tp2/1", _tp(m, 1, 2)),
               ("tp1/a", _all(m)), ("tp1/b", _all(m))]
    layers = [_layer(m, ("embed", "l0.", "scale")), _layer(m, ("l1.",))]
    return [
        ("fsdp_rows_one_receiver", _spec(m, [_rows(m, 0, 2), _rows(m, 1, 2)],
                                         [("daemon", _all(m))])),
        ("fsdp_rows_tp2_and_replicas", _spec(m, [_rows(m, 0, 2), _rows(m, 1, 2)], tp2_tp1)),
        ("uneven_three_way_rows", _spec(m, [_rows(m, i, 3) for i in range(3)], tp2_tp1)),
        ("layers_split", _spec(m, layers, tp2_tp1)),
        ("dp_replicas", _spec(m, [_all(m), _all(m)], tp2_tp1)),
        ("dp_replicas_one_receiver", _spec(m, [_all(m), _all(m), _all(m)],
                                           [("daemon", _all(m))])),
        ("hsdp_two_by_two", _spec(m, [_rows(m, 0, 2), _rows(m, 1, 2), _rows(m, 0, 2),
                                      _rows(m, 1, 2)], tp2_tp1)),
        ("megatron_patterns", _spec(m, [
            holds_by_pattern(m, [("*.o", ("shard", 1, 0, 2)), ("*.experts", None),
                                 ("*", ("shard", 0, 0, 2))]) + [whole("l0.experts", [4, 6, 8])],
            holds_by_pattern(m, [("*.o", ("shard", 1, 1, 2)), ("*.experts", None),
                                 ("*", ("shard", 0, 1, 2))]) + [whole("l1.experts", [4, 6, 8])],
        ], tp2_tp1)),
        ("column_shards_of_3d", _spec([_t("w", [4, 6, 8])],
                                      [[shard("w", [4, 6, 8], 1, i, 3)] for i in range(3)],
                                      [("r0", [block("w", 0, 2, 0, 48)]),
                                       ("r1", [block("w", 1, 3, 10, 20)])])),
        # Sender 0's own tensor counts before the replicas' cell is split:
        # the shared rows go mostly to sender 1.
        ("sole_holder_then_replicas", _spec([_t("a", [4, 8]), _t("b", [32, 8])],
                                            [[whole("a", [4, 8]), whole("b", [32, 8])],
                                             [whole("b", [32, 8])]],
                                            [("r", [whole("a", [4, 8]), whole("b", [32, 8])])])),
        ("first_tensor_unused", _spec([_t("unused", [4, 4]), _t("a", [4, 4])],
                                      [[whole("unused", [4, 4]), whole("a", [4, 4])]],
                                      [("r", [whole("a", [4, 4]), block("a", 0, 2, 0, 4)])])),
        ("unused_and_empty", _spec([_t("a", [4, 4]), _t("unused", [4, 4]), _t("empty", [0, 4])],
                                   [[whole("a", [4, 4]), whole("unused", [4, 4]),
                                     block("empty", 0, 0, 0, 4)]],
                                   [("r", [whole("a", [4, 4]), block("empty", 0, 0, 0, 4)])])),
    ]


def _random_cuts(rng, n):
    """0 = c_0 < c_1 < ... < c_k = n, a few random cuts of [0, n)."""
    inner = sorted(rng.sample(range(1, n), min(n - 1, rng.randint(0, 3)))) if n > 1 else []
    return [0] + inner + [n]


def _random_spec(rng):
    """A layout no one wrote by hand: each tensor's 2-D view tiled at random
    cuts, each tile held by a random set of senders (one holder, or
    replicas whose prior loads differ), receivers needing random
    rectangles (overlapping each other and themselves), 1-, 2- and 4-byte
    dtypes so that cells of a byte's difference exist, some tensors needed
    by no one."""
    senders, receivers = rng.randint(1, 4), rng.randint(1, 3)
    tensors, holds, needs = [], [[] for _ in range(senders)], [[] for _ in range(receivers)]
    for i in range(rng.randint(1, 5)):
        shape = rng.choice([[rng.randint(1, 9), rng.randint(1, 7)], [rng.randint(1, 12)], [],
                            [rng.randint(1, 4), rng.randint(1, 3), rng.randint(1, 3)]])
        t = _t(f"t{i}", shape, rng.choice(["BFLOAT16", "FLOAT32", "UINT8", "FLOAT8_E4M3FN"]))
        tensors.append(t)
        rows, cols = view_2d(shape)
        rc, cc = _random_cuts(rng, rows), _random_cuts(rng, cols)
        for a, b in zip(rc, rc[1:]):
            for c, d in zip(cc, cc[1:]):
                for s in rng.sample(range(senders), rng.randint(1, senders)):
                    holds[s].append(block(t["name"], a, b - a, c, d - c))
        if rng.random() < 0.2:
            continue  # needed by no one
        for r in range(receivers):
            for _ in range(rng.choice([0, 1, 1, 2])):
                r0 = rng.randrange(rows)
                c0 = rng.randrange(cols)
                needs[r].append(block(t["name"], r0, rng.randint(1, rows - r0),
                                      c0, rng.randint(1, cols - c0)))
    if not any(needs):
        needs[0].append(whole(tensors[0]["name"], tensors[0]["shape"]))
    return _spec(tensors, holds, [(f"r{r}", n) for r, n in enumerate(needs)])


def random_vector_specs(seed=32, count=40):
    rng = random.Random(seed)
    return [(f"random_{k}", _random_spec(rng)) for k in range(count)]


def vector_errors():
    m = [_t("w", [8, 4]), _t("b", [8], "FLOAT32")]
    rcv = [("r", [whole("w", [8, 4]), whole("b", [8])])]
    return [
        ("no_senders", _spec(m, [], rcv), "no senders"),
        ("no_receivers", _spec(m, [_all(m)], []), "no receivers"),
        ("overlapping_shards", _spec(m, [[block("w", 0, 5, 0, 4), whole("b", [8])],
                                         [block("w", 4, 4, 0, 4)]], rcv),
         "tensor 'w': the block rows [0, 5) cols [0, 4) of sender(s) 0 overlaps the block "
         "rows [4, 8) cols [0, 4) of sender(s) 1"),
        ("replicas_overlapped", _spec(m, [[block("w", 0, 5, 0, 4), whole("b", [8])],
                                          [block("w", 0, 5, 0, 4)], [block("w", 4, 4, 0, 4)]],
                                      rcv),
         "tensor 'w': the block rows [0, 5) cols [0, 4) of sender(s) 0,1 overlaps the block "
         "rows [4, 8) cols [0, 4) of sender(s) 2"),
        ("byte_held_by_no_one", _spec(m, [[block("w", 0, 4, 0, 4), whole("b", [8])],
                                          [block("w", 5, 3, 0, 4)]], rcv),
         "tensor 'w': rows [4, 5) cols [0, 4) needed by receiver 0 ('r') are held by no sender"),
        ("shard_outside_shape", _spec(m, [[block("w", 0, 4, 0, 4), whole("b", [8])],
                                          [block("w", 4, 5, 0, 4)]], rcv),
         "tensor 'w': sender 1's block rows [4 +5) cols [0 +4) does not fit"),
        ("need_outside_shape", _spec(m, [_all(m)], [("r", [block("w", 0, 8, 0, 5)])]),
         "tensor 'w': receiver 0 ('r')'s block"),
        ("empty_block", _spec(m, [_all(m) + [block("w", 0, 0, 0, 4)]], rcv),
         "tensor 'w': sender 0's block rows [0 +0)"),
        ("unknown_tensor", _spec(m, [_all(m) + [whole("v", [8, 4])]], rcv),
         "sender 0 declares tensor 'v', not in the manifest"),
        ("same_block_twice", _spec(m, [_all(m) + [whole("w", [8, 4])]], rcv),
         "tensor 'w': sender 0 declares rows [0, 8) cols [0, 4) twice"),
        ("sparse_tensor", _spec([dict(_t("w", [8, 4]), sparse_nnz=3)], [_all(m[:1])], rcv[:0] + [
            ("r", [whole("w", [8, 4])])]), "tensor 'w': a transfer plan carries dense tensors"),
        ("duplicate_tensor", _spec([_t("w", [8, 4]), _t("w", [8, 4])], [_all(m[:1])], rcv),
         "tensor 'w' appears twice"),
    ]


def _block_json(b):
    out = {"tensor": b["tensor"]}
    for snake, camel in (("row_begin", "rowBegin"), ("row_count", "rowCount"),
                         ("col_begin", "colBegin"), ("col_count", "colCount")):
        if b[snake]:
            out[camel] = b[snake]
    return out


def _spec_json(spec):
    tensors = []
    for t in spec["tensors"]:
        j = {"name": t["name"], "dtype": t["dtype"], "shape": t["shape"]}
        if t.get("sparse_nnz"):
            j["sparseNnz"] = t["sparse_nnz"]
        tensors.append(j)
    return {"tensors": tensors,
            "senders": [{"holds": [_block_json(b) for b in s["holds"]]} for s in spec["senders"]],
            "receivers": [{"name": r["name"], "needs": [_block_json(b) for b in r["needs"]]}
                          for r in spec["receivers"]]}


def build_vectors():
    cases = []
    for name, spec in vector_specs() + random_vector_specs():
        plan = build_plan(spec)
        cases.append({"name": name, "spec": _spec_json(spec), "planId": plan.id,
                      "pieces": [dict(zip(("tensor", "rowBegin", "rowCount", "colBegin",
                                           "colCount", "sender", "receiver", "bytes"), p))
                                 for p in plan.pieces],
                      "senderBytes": plan.sender_bytes, "receiverBytes": plan.receiver_bytes,
                      "unused": plan.unused})
    errors = []
    for name, spec, contains in vector_errors():
        try:
            build_plan(spec)
        except TransferPlanError as e:
            if contains not in str(e):
                raise AssertionError(f"{name}: {e!s} lacks {contains!r}") from None
        else:
            raise AssertionError(f"{name}: accepted")
        errors.append({"name": name, "spec": _spec_json(spec), "errorContains": contains})
    return {"specVersion": SPEC_VERSION, "cases": cases, "errors": errors}


def render_vectors():
    return json.dumps(build_vectors(), indent=1) + "\n"


def main(argv=None):
    try:
        from weightsync.planner import vectors_cli
    except ImportError:   # run as a script: its folder is on the path
        from planner import vectors_cli
    return vectors_cli(argv, __doc__, render_vectors,
                       "client/python/weightsync/transfer_plan.py")


if __name__ == "__main__":
    sys.exit(main())

"""Lazy tensors: an update whose tensors are made only when their bytes
are needed (an FSDP2 trainer gathers each DTensor with full_tensor()), so
that the trainer never holds the whole model at once.

    from weightsync import LazyTensor
    items = [(name, LazyTensor(name, p.dtype, p.shape, p.full_tensor))
             for name, p in model.named_parameters()]
    trainer.update(items, version=v)          # one Start .. Finish, one pause

The manifest needs only names, dtypes and shapes, which a LazyTensor
carries; `materialize()` is called once per update, just before the first
chunk that holds a byte of the tensor, and the result is dropped after the
last chunk that reads it. The chunk plan is a pure function of the
manifest and the chunk size (weightsync.planner), so the order is too:
`materialize_order(plan)` says, per chunk, which tensors to make before it
and which to let go after it. Tensors are laid out in manifest order, so
they are always made in manifest order (`materialize_sequence`), whatever
the chunk size: what lets every rank of an FSDP group run the same
collectives in the same order (weightsync.fsdp).

Receipts can't be computed after such an update (the tensors are gone);
the checksum is a sum over elements, each of one sent tensor, so
`ProgressiveReceipts` adds each tensor's share as it is made, for every
engine layout registered when the update started; parameter and byte
counts depend on names and shapes only and are computed from the manifest.

Everything here is plain Python (numpy for dtypes): CI tests it without
torch; weightsync.gpu_trainer and weightsync.trainer drive it with torch
tensors.
"""

import collections
import operator

from weightsync import planner
from weightsync._errors import WeightSyncError

__all__ = ["LazyTensor", "Feed", "ProgressiveReceipts", "is_lazy", "materialize_order",
           "materialize_sequence", "window_bytes", "wire_dtype_of"]

MASK64 = (1 << 64) - 1


def wire_dtype_of(name, dtype):
    """The weightsync.v1.DType enum name of `dtype`: an enum name
    ("BFLOAT16"), a torch dtype (or its str, "torch.bfloat16"), or anything
    numpy.dtype() takes. ValueError naming the tensor otherwise."""
    from weightsync._gpu import TORCH_DTYPES
    if isinstance(dtype, str):
        if dtype in planner.ELEMENT_SIZES:
            return dtype
        torch_name = dtype if dtype.startswith("torch.") else "torch." + dtype
        if torch_name in TORCH_DTYPES:
            return TORCH_DTYPES[torch_name]
    else:
        text = str(dtype)
        if text in TORCH_DTYPES:
            return TORCH_DTYPES[text]
        if text.startswith("torch."):
            raise ValueError(f"tensor '{name}': dtype {text} is not supported "
                             f"(supported: {', '.join(sorted(TORCH_DTYPES))})")
    try:
        import numpy as np
        from weightsync._tensors import wire_dtype
        wire = wire_dtype(np.dtype(dtype))
    except TypeError:
        wire = None
    if wire is None:
        raise ValueError(f"tensor '{name}': dtype {dtype!r} is not supported")
    return wire


class LazyTensor:
    """A tensor of an update made only when its bytes are needed.

    name: the tensor's name (for messages; the manifest uses the name of
      the (name, tensor) pair it is passed in).
    dtype: a torch dtype, numpy dtype or weightsync dtype name.
    shape: the full (global) shape.
    materialize: a function of no arguments returning the full tensor
      (a torch tensor; on the host backend a numpy array or CPU torch
      tensor) of exactly that dtype and shape. Called at most once per
      update, on the thread that called Trainer.update, in manifest order
      (materialize_sequence); a DTensor's full_tensor() is a collective,
      which every rank of its group must call in the same order
      (weightsync.fsdp does that).
    device: where the result will be, if known (informational).
    """

    __slots__ = ("name", "dtype", "shape", "device", "_materialize")

    def __init__(self, name, dtype, shape, materialize, device=None):
        if not callable(materialize):
            raise TypeError(f"LazyTensor '{name}': materialize must be callable")
        self.name = name
        self.dtype = wire_dtype_of(name, dtype)
        self.shape = tuple(int(d) for d in shape)
        if any(d < 0 for d in self.shape):
            raise ValueError(f"LazyTensor '{name}': negative dimension in {self.shape}")
        self.device = device
        self._materialize = materialize

    @property
    def numel(self):
        return planner.numel(self.shape)

    @property
    def nbytes(self):
        return self.numel * planner.ELEMENT_SIZES[self.dtype]

    def materialize(self):
        return self._materialize()

    def __repr__(self):
        return f"LazyTensor({self.name!r}, {self.dtype}, {list(self.shape)})"


def is_lazy(pairs):
    """True if any tensor of the (name, tensor) pairs is a LazyTensor (one
    C-level pass over the distinct types; False for entries that are not
    pairs, which the update reports as it always did)."""
    try:
        types = set(map(type, map(operator.itemgetter(1), pairs)))
    except (TypeError, IndexError, KeyError):
        return False
    return any(issubclass(t, LazyTensor) for t in types)


def check_materialized(name, lazy, dtype, shape):
    """Raises ValueError when what materialize() returned (its weightsync
    dtype name and shape) is not what the manifest said."""
    if dtype != lazy.dtype or tuple(int(d) for d in shape) != lazy.shape:
        raise ValueError(f"tensor '{name}': materialize() returned {dtype} "
                         f"{list(shape)}; the manifest says {lazy.dtype} {list(lazy.shape)}")


def materialize_sequence(manifest):
    """Indices of the tensors of `manifest` (dicts with name, dtype, shape,
    optionally sparse_nnz) that are made, in the order they are made:
    those with a payload, in manifest order. The same for every chunk size
    (the planner lays tensors out in manifest order); an empty tensor is
    never made (no chunk reads it)."""
    return [i for i, m in enumerate(manifest)
            if planner.payload_bytes(m["dtype"], m["shape"], m.get("sparse_nnz", 0),
                                     m.get("sparse_index_bytes", 0))]


def materialize_order(plan, lazy=None):
    """Per chunk of `plan` (planner.plan_chunks): (tensors to make before
    the chunk is packed or sent, tensors no later chunk reads, to let go
    once the chunk is sent), as two lists of tensor indices each in
    manifest order. lazy: a set (or per-tensor flags) of the indices that
    are lazy; default every tensor. A tensor appears once in the first
    lists (the chunk of its first piece) and once in the second (the chunk
    of its last piece); tensors without a piece (empty) appear in neither.
    A pure function of the plan, hence of the manifest and chunk size."""
    chunks = plan["chunks"]
    if lazy is None:
        wanted = None
    elif isinstance(lazy, (set, frozenset, dict)):
        wanted = lazy
    else:
        wanted = {i for i, flag in enumerate(lazy) if flag}
    first, last = {}, {}
    for c in chunks:
        k = c["index"]
        for p in c["pieces"]:
            t = p["tensor"]
            if wanted is not None and t not in wanted:
                continue
            if t not in first:
                first[t] = k
            last[t] = k
    make = [[] for _ in chunks]
    drop = [[] for _ in chunks]
    for t in sorted(first):
        make[first[t]].append(t)
        drop[last[t]].append(t)
    return list(zip(make, drop))


def window_bytes(plan, lazy=None):
    """Per chunk: payload bytes of the lazy tensors alive while it is
    packed and sent (made at or before it, let go at or after it). Its
    maximum is the least memory an update of `plan` can hold tensors in
    (the rest of the peak is the chunk ring and the collectives' own
    buffers)."""
    order = materialize_order(plan, lazy)
    sizes = plan["payload_bytes"]
    out, live = [], 0
    for make, drop in order:
        live += sum(sizes[t] for t in make)
        out.append(live)
        live -= sum(sizes[t] for t in drop)
    return out


class Feed:
    """Makes and lets go of the lazy tensors of one update, chunk by chunk.

    plan: the update's chunk plan; lazy: {tensor index: LazyTensor}.
    make(i, entry) -> payload: materializes entry i as the sender packs it
      (a flat byte view), raising on a dtype or shape it didn't promise.
    release(i, payload) -> token or None: called after the last chunk that
      reads tensor i was enqueued; returns something `wait(token)` blocks
      on until the device no longer reads the payload (a CUDA event), or
      None when it is already unused.
    budget: bytes of made tensors the sender may hold before it waits for
      released ones to be done with (None: never waits). The default the
      trainer uses is the largest window (window_bytes): the least that
      lets a chunk's tensors be alive together.

    before(k, payloads) makes chunk k's new tensors into payloads[i] and
    returns their indices; after(k, payloads) lets go of those chunk k
    read last (payloads[i] = None). `peak_bytes` is the most made-and-not-
    yet-done bytes it held; `made` counts materialize() calls."""

    def __init__(self, plan, lazy, make, release=None, wait=None, budget=None):
        self.order = materialize_order(plan, set(lazy))
        self.sizes = plan["payload_bytes"]
        self.lazy = lazy
        self._make = make
        self._release = release
        self._wait = wait
        self.budget = budget
        self.live = 0          # made, and not known to be done with
        self.peak_bytes = 0
        self.made = 0
        self.released = 0
        self._pending = collections.deque()   # (token, bytes) released, maybe in use

    def _room(self, nbytes):
        while (self.budget is not None and self._pending
               and self.live + nbytes > self.budget):
            token, size = self._pending.popleft()
            if self._wait is not None:
                self._wait(token)
            self.live -= size

    def before(self, k, payloads):
        made = self.order[k][0]
        for i in made:
            self._room(self.sizes[i])
            payloads[i] = self._make(i, self.lazy[i])
            self.made += 1
            self.live += self.sizes[i]
            self.peak_bytes = max(self.peak_bytes, self.live)
        return made

    def after(self, k, payloads):
        for i in self.order[k][1]:
            token = self._release(i, payloads[i]) if self._release is not None else None
            payloads[i] = None
            self.released += 1
            if token is None:
                self.live -= self.sizes[i]
            else:
                self._pending.append((token, self.sizes[i]))

    def settle(self):
        """Waits for every released payload (the end of an update)."""
        while self._pending:
            token, size = self._pending.popleft()
            if self._wait is not None:
                self._wait(token)
            self.live -= size


def receipt_counts(layout, shapes):
    """(parameters, bytes) of a receipt for an engine of `layout` after an
    update of the tensors `shapes` ({name: (dtype, shape, anything)}): they
    depend on names and shapes only (docs/protocol.md, "Receipts")."""
    from weightsync import receipts
    if not receipts.has_fp8(layout):
        params, nbytes, _ = receipts.layout_runs(layout, shapes)
        return params, nbytes
    # FP8 targets: their counts (FP8 elements and the scales of the blocks
    # written) from weightsync.fp8's walk of the tensors' shapes (nothing
    # quantised: the masks of what they write only).
    from weightsync.receipts import fp8
    plain, quant, _ = fp8.split_layout(layout)
    params, nbytes, _ = receipts.layout_runs(plain, shapes)
    feeds = {s.source for p in quant for s in p.segments} | {p.name for p in quant}
    named = {n: (d, s, None) for n, (d, s, _) in shapes.items() if n in feeds}
    _, q_params, q_bytes = fp8.quantized_receipt(quant, named, values=False)
    return params + q_params, nbytes + q_bytes


class ProgressiveReceipts:
    """The receipts an update must get, summed tensor by tensor as the
    tensors are made (lazy updates: they are gone afterwards).

    layouts: {key: layout (weightsync.v1.Parameter messages)}, the distinct
      layouts of the engines the update may write, read before Start.
    manifest: the update's manifest (dicts); its dense tensors are what
      receipts cover (patches are not).
    compute(layouts, sent) -> {key: checksum}: the checksum of the subset
      `sent` ({name: (dtype, shape, elements)}) for each layout
      (weightsync.receipts.expected_receipt and friends: a segment counts
      only when its source is in `sent`, so the shares of disjoint subsets
      add up to the whole, mod 2^64).

    add(sent) adds a subset's share (each dense tensor with a payload
    exactly once); expected(key) returns (checksum, parameters, bytes) once
    every such tensor was added."""

    def __init__(self, layouts, manifest, compute):
        self.layouts = dict(layouts)
        dense = [m for m in manifest if not m.get("sparse_nnz")]
        shapes = {m["name"]: (m["dtype"], list(m["shape"]), None) for m in dense}
        self.counts = {k: receipt_counts(layout, shapes) for k, layout in self.layouts.items()}
        self.sums = {k: 0 for k in self.layouts}
        self._compute = compute
        self._owed = {m["name"] for m in dense
                      if planner.payload_bytes(m["dtype"], m["shape"])}
        self._added = set()

    def add(self, sent):
        if not sent:
            return
        again = self._added.intersection(sent)
        if again:
            raise ValueError(f"receipts: tensor '{sorted(again)[0]}' added twice")
        self._added.update(sent)
        if not self.layouts:
            return
        for key, checksum in self._compute(self.layouts, sent).items():
            self.sums[key] = (self.sums[key] + int(checksum)) & MASK64

    def complete(self):
        return self._owed <= self._added

    def expected(self, key):
        if not self.complete():
            missing = sorted(self._owed - self._added)
            raise WeightSyncError("INTERNAL", f"receipts: {len(missing)} tensors were never "
                                  f"added (e.g. '{missing[0]}')")
        return (self.sums[key],) + self.counts[key]


def layout_key(layout):
    """A key naming a layout's content (replicas on several daemons share
    it): the serialized parameters, hashed."""
    import hashlib
    h = hashlib.sha256()
    for p in layout:
        h.update(p.SerializeToString(deterministic=True))
        h.update(b"\0")
    return h.digest()


def engines_and_layouts(statuses, engine_ids=(), cached=None):
    """From each daemon's GetStatus (with layouts where `cached` lacks
    them): ([{engine id: (layout id, key)} per daemon], {key: layout}).
    statuses: [GetStatusResponse]; cached: {layout id: layout}."""
    wanted = set(engine_ids)
    per_daemon, layouts = [], {}
    for status in statuses:
        engines = {}
        for e in status.engines:
            if wanted and e.engine_id not in wanted:
                continue
            layout = list(e.layout) if len(e.layout) or not e.parameters else None
            if layout is None and cached is not None and e.layout_id in cached:
                layout = cached[e.layout_id]
            if layout is None:
                raise KeyError(e.layout_id)
            key = layout_key(layout)
            layouts.setdefault(key, layout)
            engines[e.engine_id] = (e.layout_id, key)
        per_daemon.append(engines)
    return per_daemon, layouts


def check_receipts(results, engines, expected, names=None):
    """Compares the receipts of `results` (one FinishWeightUpdateResponse
    or PrepareWeightUpdateResponse per daemon) with expected(key) ->
    (checksum, parameters, bytes), for the layouts `engines` ([{engine id:
    (layout id, key)}] per daemon, read when the update started). An engine
    whose layout is not the one it had then (it registered again during the
    update) can't be checked (the tensors are gone): FAILED_PRECONDITION.
    A mismatch: DATA_LOSS naming the engine. names: daemon names for
    messages."""
    for d, (finished, known) in enumerate(zip(results, engines)):
        where = f" on {names[d]}" if names and len(results) > 1 else ""
        for r in finished.engines:
            if not r.HasField("receipt") or r.lost:
                continue
            if r.engine_id not in known or (r.layout_id and r.layout_id != known[r.engine_id][0]):
                then = known.get(r.engine_id, ("not registered",))[0] or "unknown"
                raise WeightSyncError(
                    "FAILED_PRECONDITION",
                    f"engine '{r.engine_id}'{where} has layout {r.layout_id or '?'}, not the "
                    f"one it had when this lazy update started ({then}): it registered "
                    "during the update, and its receipt can't be checked (the expectation "
                    "was summed per layout as the tensors were made, and they are gone). "
                    "The update's bytes went out; send a dense update to re-verify")
            checksum, _, nbytes = expected(known[r.engine_id][1])
            if checksum != r.receipt.checksum or nbytes != r.receipt.bytes:
                raise WeightSyncError(
                    "DATA_LOSS", f"engine '{r.engine_id}'{where} receipt "
                    f"{r.receipt.checksum:016x} over {r.receipt.bytes} bytes does not "
                    f"match {checksum:016x} over {nbytes} bytes computed from what was "
                    "sent")

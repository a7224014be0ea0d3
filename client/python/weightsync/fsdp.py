"""FSDP2 (DTensor) trainers: one update of a sharded model, gathered tensor
by tensor as its bytes are sent, never the whole model on one GPU.

    # on EVERY rank of the FSDP group, after the optimizer step:
    from weightsync.fsdp import send_fsdp2
    send_fsdp2(trainer if rank == 0 else None, model, version=step)

Rank 0 (the one that holds a weightsync.Trainer after init_nccl() or
init_ipc(); `rank=` names another) sends one update, one Start .. Finish,
so the engines are paused once: every parameter is a LazyTensor
(weightsync.lazy) whose global dtype and shape the DTensor knows without
gathering; the trainer gathers it (DTensor.full_tensor(), an all-gather
over the parameter's mesh) just before the first chunk that holds its
bytes and drops it after the last. The other ranks build the same list of
parameters and call full_tensor() on the same tensors in the same order
(manifest order: weightsync.lazy.materialize_sequence, the same for every
chunk size), dropping the results, so the collectives match. Then rank 0
broadcasts the outcome over `group` and every rank returns (rank 0: the
update's result; the others: None) or raises WeightSyncError with rank
0's code, so a retry loop around send_fsdp2 runs in step on every rank.
If rank 0 fails before it has gathered everything, it gathers (and drops)
the rest first, so no rank is left waiting in a collective.

Names: the model's parameter names with wrapper components removed
(`_fsdp_wrapped_module`, `_orig_mod` of torch.compile,
`_checkpoint_wrapped_module` of activation checkpointing; FSDP2's
fully_shard adds none), then `names` (a dict from those names, or a
function; None: skip the parameter) maps them to the engines' checkpoint
(Hugging Face) names. The mapping is computed once per model (and per
`names` object) and reused while the parameter names stay the same.

Memory on rank 0: about the largest run of tensors one chunk spans (the
tensors alive while it is sent: window_bytes), plus the chunk ring (NCCL:
pack_buffers x chunk_bytes; IPC: ring_slots x chunk_bytes), plus what an
all-gather holds while it runs. Choose chunk_bytes well below the model
size: one chunk of a whole small model is the whole model.

torch is imported only when a real group is used, so the name mapping and
the protocol are tested in CI with stand-ins.
"""

import contextlib
import sys
import weakref

from weightsync._errors import WeightSyncError
from weightsync.lazy import LazyTensor, materialize_sequence

__all__ = ["send_fsdp2", "lazy_parameters", "checkpoint_name", "checkpoint_names",
           "WRAPPER_COMPONENTS"]

# Module names wrappers insert into parameter names.
WRAPPER_COMPONENTS = ("_fsdp_wrapped_module", "_orig_mod", "_checkpoint_wrapped_module")

# google.rpc.Code numbers, by name: how rank 0's error travels to the others.
CODES = ("OK", "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "NOT_FOUND",
         "ALREADY_EXISTS", "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION",
         "ABORTED", "OUT_OF_RANGE", "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE", "DATA_LOSS",
         "UNAUTHENTICATED")


def checkpoint_name(name, components=WRAPPER_COMPONENTS):
    """`name` without the wrapper components (anywhere in the dotted
    path): "_orig_mod.model.layers.0._checkpoint_wrapped_module.mlp.w" ->
    "model.layers.0.mlp.w"."""
    parts = name.split(".")
    kept = [p for p in parts if p not in components]
    return ".".join(kept) if len(kept) != len(parts) else name


def checkpoint_names(param_names, names=None):
    """[(index into param_names, checkpoint name)] of the parameters to
    send, in order. Each name loses its wrapper components
    (checkpoint_name), then `names` maps it: a dict (looked up by that
    name, then by the raw one; absent: kept; a value of None: skipped) or
    a function (returning the name, or None to skip). ValueError when two
    parameters map to one name, or a name is not a non-empty str."""
    out, seen = [], {}
    for i, raw in enumerate(param_names):
        base = checkpoint_name(raw)
        if names is None:
            target = base
        elif callable(names):
            target = names(base)
        elif base in names:
            target = names[base]
        else:
            target = names.get(raw, base)
        if target is None:
            continue
        if not isinstance(target, str) or not target:
            raise ValueError(f"parameter '{raw}' maps to {target!r}, not a non-empty name")
        if target in seen:
            raise ValueError(f"parameters '{param_names[seen[target]]}' and '{raw}' both map to "
                             f"'{target}'")
        seen[target] = i
        out.append((i, target))
    return out


# model -> (parameter names, names argument, checkpoint_names result)
_mappings = weakref.WeakKeyDictionary()


def _mapping(model, param_names, names):
    key = tuple(param_names)
    try:
        hit = _mappings.get(model)
    except TypeError:   # not weakly referenceable: no cache
        return checkpoint_names(key, names)
    if hit is not None and hit[1] is names and hit[0] == key:
        return hit[2]
    mapping = checkpoint_names(key, names)
    _mappings[model] = (key, names, mapping)
    return mapping


def _no_grad():
    torch = sys.modules.get("torch")
    return torch.no_grad() if torch is not None else contextlib.nullcontext()


def _gathered(p):
    """The full tensor of a DTensor parameter (an all-gather: a collective
    every rank of its mesh runs), detached."""
    with _no_grad():
        t = p.full_tensor()
        if type(t).__name__ == "AsyncCollectiveTensor" and hasattr(t, "wait"):
            t = t.wait()
    return t.detach() if hasattr(t, "detach") else t


def _local(p):
    return p.detach() if hasattr(p, "detach") else p


def lazy_parameters(model, names=None):
    """[(checkpoint name, LazyTensor)] of `model.named_parameters()`: a
    DTensor (anything with full_tensor()) is made by full_tensor() with
    its global dtype and shape; a plain tensor is itself. The names as
    checkpoint_names makes them (computed once per model and `names`)."""
    named = list(model.named_parameters())
    mapping = _mapping(model, [n for n, _ in named], names)
    out = []
    for i, target in mapping:
        p = named[i][1]
        make = (lambda p=p: _gathered(p)) if callable(getattr(p, "full_tensor", None)) else \
            (lambda p=p: _local(p))
        out.append((target, LazyTensor(target, p.dtype, tuple(p.shape), make)))
    return out


class _TorchGroup:
    """The ranks of `group` (torch.distributed; None: the default group)
    and how the outcome travels: a one-element int64 broadcast from rank
    `src` (a rank of the group), on the GPU for an NCCL group."""

    def __init__(self, group, src):
        import torch
        import torch.distributed as dist
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("send_fsdp2: torch.distributed is not initialised "
                               "(init_process_group first)")
        self._torch, self._dist, self._group = torch, dist, group
        self.rank = dist.get_rank(group) if group is not None else dist.get_rank()
        self.size = dist.get_world_size(group) if group is not None else dist.get_world_size()
        if not 0 <= src < self.size:
            raise ValueError(f"send_fsdp2: rank {src} is not a rank of the group "
                             f"(size {self.size})")
        self.src = src
        self._src_global = src
        if group is not None and group is not getattr(dist.group, "WORLD", None):
            get = getattr(dist, "get_global_rank", None) or getattr(
                dist.distributed_c10d, "_get_global_rank")
            self._src_global = get(group, src)
        backend = str(dist.get_backend(group) if group is not None else dist.get_backend())
        if "nccl" in backend.lower() and "gloo" not in backend.lower():
            self._device = torch.device("cuda", torch.cuda.current_device())
        else:
            self._device = torch.device("cpu")

    @property
    def world_size(self):
        return self.size

    def all_gather(self, obj):
        out = [None] * self.size
        self._dist.all_gather_object(out, obj, group=self._group)
        return out

    def broadcast(self, obj, src=0):
        box = [obj]
        src_global = src if self._group is None else self._dist.get_global_rank(self._group, src)
        self._dist.broadcast_object_list(box, src=src_global, group=self._group)
        return box[0]

    def outcome(self, code=0):
        """Every rank: rank src's `code`, broadcast."""
        t = self._torch.tensor([int(code)], dtype=self._torch.int64, device=self._device)
        if self._group is None:
            self._dist.broadcast(t, src=self._src_global)
        else:
            self._dist.broadcast(t, src=self._src_global, group=self._group)
        return int(t.item())


# Made per call: (group, sender rank) -> an object with rank, src and
# outcome(code). Tests replace it with a stand-in.
_group_factory = _TorchGroup


def _code_of(error):
    if error is None:
        return 0
    if isinstance(error, WeightSyncError) and error.code in CODES:
        return CODES.index(error.code)
    return CODES.index("UNKNOWN")


class _Lockstep:
    """The sender's lazy tensors, made only in `sequence` order (what the
    other ranks do); drain() makes the ones the update did not."""

    def __init__(self, items, sequence):
        self._sources = [t for _, t in items]
        self._sequence = sequence
        self._next = 0
        self.broken = None   # an exception out of a collective: stop
        self.items = [(name, LazyTensor(t.name, t.dtype, t.shape, self._maker(i, name)))
                      for i, (name, t) in enumerate(items)]

    def _maker(self, i, name):
        def make():
            if self.broken is not None:
                raise RuntimeError(f"weightsync.fsdp: a gather failed earlier ({self.broken})")
            if self._next >= len(self._sequence) or self._sequence[self._next] != i:
                want = (f"'{self.items[self._sequence[self._next]][0]}'"
                        if self._next < len(self._sequence) else "nothing more")
                raise RuntimeError(f"weightsync.fsdp: '{name}' was asked for out of order "
                                   f"(expected {want}); the other ranks gather in manifest "
                                   "order (a bug in the sender: please report it)")
            self._next += 1
            try:
                return self._sources[i].materialize()
            except BaseException as e:
                self.broken = e
                raise
        return make

    def drain(self):
        """Makes (and drops) what is left of the sequence, so the other
        ranks' collectives are matched. Returns the exception of a gather
        that failed (the group is then broken), or None."""
        while self.broken is None and self._next < len(self._sequence):
            i = self._sequence[self._next]
            self._next += 1
            try:
                self._sources[i].materialize()
            except BaseException as e:  # noqa: BLE001 - reported to the caller
                self.broken = e
        return self.broken


def shard_block(name, global_shape, local_shape, offset):
    """The TensorBlock of a DTensor's local shard (its global offset and
    local shape, as torch's compute_local_shape_and_global_offset gives
    them) in the tensor's 2-D view, or None for an empty shard: rows for a
    shard along dim 0, columns for one along dim 1; ValueError naming the
    tensor for a shard that is not a rectangle of the view (Shard(2) and
    beyond, or sharded along two dims of which one is not dim 0)."""
    from weightsync import transfer_plan
    global_shape, local_shape = list(global_shape), list(local_shape)
    if any(n == 0 for n in local_shape):
        return None
    if not global_shape:
        return transfer_plan.whole(name, global_shape)
    cut = [d for d in range(len(global_shape)) if local_shape[d] != global_shape[d]]
    rows, cols = transfer_plan.view_2d(global_shape)
    if not cut or cut == [0]:
        return transfer_plan.block(name, offset[0], local_shape[0], 0, cols)
    if cut == [1]:
        inner = cols // global_shape[1]
        return transfer_plan.block(name, 0, rows, offset[1] * inner, local_shape[1] * inner)
    raise ValueError(f"tensor '{name}': the local shard {local_shape} at {list(offset)} of "
                     f"{global_shape} is not a block of its 2-D view (only Shard(0) and "
                     "Shard(1) are); send this model with own_shards=False (gathered)")


def _own_shards(model, names):
    """(manifest, [(block, CPU tensor)]) of this rank's shards of `model`."""
    import torch
    named = list(model.named_parameters())
    mapping = _mapping(model, [n for n, _ in named], names)
    from weightsync._tensors import describe
    manifest, local = [], []
    for i, target in mapping:
        p = named[i][1]
        dtype = describe(target, torch.empty(0, dtype=p.dtype))[0]
        manifest.append({"name": target, "dtype": dtype, "shape": list(p.shape)})
        if callable(getattr(p, "to_local", None)):
            from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
            shape, offset = compute_local_shape_and_global_offset(
                tuple(p.shape), p.device_mesh, p.placements)
            data = p.to_local()
        else:
            shape, offset, data = tuple(p.shape), (0,) * p.dim(), p
        b = shard_block(target, p.shape, shape, offset)
        if b is not None:
            with _no_grad():
                local.append((b, data.detach().contiguous().cpu()))
    return manifest, local


def send_fsdp2(trainer, model, version, names=None, rank=None, group=None, chunk_bytes=0,
               verify=True, own_shards=None, **update_kwargs):
    """Sends `model`'s parameters as weight version `version`.

    Every rank sends its own shard (own_shards, the default when every
    rank passes a Trainer; issue 32): no full_tensor() gather, each rank's
    local shards (Shard(0) rows, Shard(1) columns, Replicate split between
    the replicas) go straight to the daemons on one transfer plan
    (Trainer.update_sharded: the host backend, or nccl after
    init_nccl(collective=...) on every rank). own_shards=False, or a rank
    passing trainer=None, selects the gathered path: parameters gathered
    one by one and sent by one rank (see the module docstring).

    Gathered path: call on every rank of `group`
    (a torch.distributed group containing every rank that holds a shard;
    None: the default group) with the same arguments; `trainer` matters
    only on the sending rank `rank` (a rank of `group`, default 0), where
    it is a weightsync.Trainer after init_nccl() or init_ipc() (or
    init_host(), for CPU tensors). chunk_bytes, verify and the other
    keywords go to Trainer.update. Returns the update's result on the
    sender, None elsewhere; raises WeightSyncError (the sender's code) on
    every rank if the update failed."""
    comm = _group_factory(group, 0 if rank is None else int(rank))
    if own_shards is not False and hasattr(comm, "all_gather"):
        every = all(comm.all_gather(trainer is not None))
        if own_shards and not every:
            raise ValueError("send_fsdp2(own_shards=True): every rank needs a Trainer")
        if every:
            manifest, local = _own_shards(model, names)
            # On nccl the ranks agree through the collective the group was
            # formed with (update_sharded refuses another one).
            joined = getattr(trainer, "sharded_collective", None)
            return trainer.update_sharded(manifest, local, version,
                                          collective=joined or comm,
                                          chunk_bytes=chunk_bytes, verify=verify)
    items = lazy_parameters(model, names)
    sequence = materialize_sequence([{"name": n, "dtype": t.dtype, "shape": list(t.shape)}
                                     for n, t in items])
    if comm.rank != comm.src:
        for i in sequence:
            items[i][1].materialize()   # the collective; the result is dropped
        code = comm.outcome()
        if code:
            name = CODES[code] if code < len(CODES) else "UNKNOWN"
            raise WeightSyncError(name, f"the update of version {version} failed on rank "
                                  f"{comm.src} (the sender: its exception says why)")
        return None
    step = _Lockstep(items, sequence)
    result = error = None
    try:
        if trainer is None:
            raise ValueError(f"send_fsdp2: rank {comm.src} sends, and has no Trainer")
        result = trainer.update(step.items, version, chunk_bytes=chunk_bytes, verify=verify,
                                **update_kwargs)
    except BaseException as e:  # noqa: BLE001 - every rank hears of it, then re-raised
        error = e
    broken = step.drain()
    if broken is None:
        comm.outcome(_code_of(error))
    elif error is None:
        error = broken
    if error is not None:
        raise error
    return result

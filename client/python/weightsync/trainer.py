"""Trainer side: push named tensors through weightsyncd into engines.

    trainer = weightsync.Trainer()              # the local daemon's socket
    trainer.init_host()                          # host backend (no GPU)
    with trainer.paused():                       # optional: engines paused
        result = trainer.update(model.state_dict().items(), version=step)

On GPUs (torch CUDA tensors, see weightsync.gpu_trainer):

    trainer.init_nccl(device=0)      # trainer GPU 0 joins the daemons' NCCL group
    trainer.init_ipc(device=0)       # or: colocated, the daemon reads our buffer
    trainer.update(model.named_parameters(), version=step)

`Trainer([target_a, target_b])` drives several daemons (one per node), on
the host and nccl backends: the NCCL group has the trainer at rank 0 and
each daemon's ranks (GetWorldSize) after those of the daemons before it;
update() sends one manifest, each daemon applies what its engines use
(on the host backend it is sent only those bytes), and the update commits
on every daemon or on none (prepare, then commit: docs/protocol.md,
"Several daemons"; weightsync._multi). pause/resume go to all of them.

Thread-compatible: one update at a time per Trainer. Every call has a
deadline; errors raise WeightSyncError with the daemon's code and message.
"""

import contextlib
import operator
import os
import sys
import threading
import time
import uuid

from weightsync import _multi, lazy as _lazy, planner
from weightsync._errors import WeightSyncError
from weightsync._proto import Stub, channel, default_target, v1
from weightsync._tensors import build_manifest, describe
from weightsync.host_source import HostSource
from weightsync.lazy import LazyTensor
from weightsync.sparse import SparsePatch, TorchSparsePatch


def _has_patches(named_tensors):
    """True if any tensor of the (name, tensor) pairs is a SparsePatch: one
    pass over the distinct types, not an isinstance per tensor."""
    types = set(map(type, map(_second, named_tensors)))
    return any(issubclass(t, SparsePatch) for t in types)


_first = operator.itemgetter(0)
_second = operator.itemgetter(1)
_data_ptr = operator.methodcaller("data_ptr")
_stride = operator.methodcaller("stride")
_dtype = operator.attrgetter("dtype")
_shape = operator.attrgetter("shape")


def _moved_signature(pairs):
    """What a registered source depends on, of every (name, tensor), built
    by C-level passes (a mixture of experts sends 100k tensors every step;
    a generator per tensor cost ~230 ms there): names and data pointers for
    torch tensors (each torch accessor costs 13-21 ms per 100k tensors on
    an H100 host, bench/results/control_probe.json, so one is read). A
    tensor that moved has a new data pointer; what this doesn't see is a
    tensor given the same first byte under another dtype, shape, strides or
    element count (p.data = p.data.view(...), .t() of a square matrix,
    p.data = p.data[:k]), whose registered bytes the daemon still copies
    from memory the registration keeps alive (docs/protocol.md, "Registered
    sources"). None when an entry is not a tensor (the caller then never
    reuses a source)."""
    try:
        names = tuple(map(_first, pairs))
        tensors = tuple(map(_second, pairs))
        torch = sys.modules.get("torch")
        if torch is not None and tensors and isinstance(tensors[0], torch.Tensor):
            return (names, tuple(map(torch.Tensor.data_ptr, tensors)))
        return (names, tuple(map(_data_ptr, tensors)), tuple(map(_dtype, tensors)),
                tuple(map(_shape, tensors)), tuple(map(_stride, tensors)))
    except (AttributeError, TypeError):
        return None


class _SourcePairs:
    """The (name, tensor) pairs a registered source was last used with, kept
    so that the next update of the very same objects costs two C-level
    passes: the list compared with the kept one (item by item, identity
    first: 0.2 ms per 100k pairs when the tuples are the same, 2.4 ms when
    only their contents are) and the data pointers read again. It holds the
    tensors, so their memory outlives any use the daemon makes of it."""

    def __init__(self, pairs, source, data_ptr=None, numel=None):
        if data_ptr is None:   # torch's, unbound (tests pass their fakes')
            import torch
            data_ptr, numel = torch.Tensor.data_ptr, torch.Tensor.numel
        self._data_ptr = data_ptr
        self.pairs = list(pairs)
        self.tensors = list(map(_second, self.pairs))
        self.ptrs = tuple(map(data_ptr, self.tensors))
        # Where the list comparison could call a tensor "equal" by value:
        # a non-identical tensor is compared with torch's ==, whose truth
        # raises for more than one element but not for one.
        self.one_element = [i for i, n in enumerate(map(numel, self.tensors)) if n <= 1]
        self.source = source

    def same(self, pairs):
        """True if `pairs` are these pairs' very objects, in order, and no
        tensor has a new data pointer."""
        try:
            if not pairs == self.pairs:
                return False
        except Exception:   # a tensor compared by value: another object
            return False
        if any(pairs[i][1] is not self.tensors[i] for i in self.one_element):
            return False
        return tuple(map(self._data_ptr, self.tensors)) == self.ptrs


def _start_request(update_id, version, chunk_bytes, engine_ids, mode,
                   allow_streaming_fallback, verify, **fields):
    """The StartWeightUpdateRequest fields every update sets, plus `fields`."""
    return v1.StartWeightUpdateRequest(
        update_id=update_id, target_version=version, chunk_bytes=chunk_bytes,
        engine_ids=list(engine_ids),
        mode={"streaming": v1.UPDATE_MODE_STREAMING, "staged": v1.UPDATE_MODE_STAGED}[mode],
        allow_streaming_fallback=allow_streaming_fallback,
        verify=v1.VERIFY_ON if verify else v1.VERIFY_OFF, **fields)


def _nccl_version(nccl):
    """This trainer's NCCL as ncclGetVersion encodes it (InitWeightTransfer
    .nccl_version): the library that joins the group (weightsync.nccl finds
    the one torch loaded first), else torch.cuda.nccl.version(); 0 if
    neither says (the daemon then checks nothing)."""
    try:
        return int(nccl.version())
    except Exception:   # no libnccl to load here: ask torch
        pass
    try:
        import torch
        v = torch.cuda.nccl.version()
        if isinstance(v, tuple):
            major, minor, patch = (list(v) + [0, 0, 0])[:3]
            return major * 10000 + minor * 100 + patch
        return int(v)
    except Exception:
        return 0


def _describe_host(named_tensors):
    """(payloads, manifest dicts) of host (name, tensor) pairs: numpy
    arrays, CPU torch tensors or SparsePatches."""
    data, manifest = [], []
    for name, tensor in named_tensors:
        if isinstance(tensor, SparsePatch):
            if not tensor.nnz:
                raise ValueError(f"tensor '{name}': an empty patch (sparse_nnz 0 means a "
                                 "dense tensor on the wire); leave the tensor out or "
                                 "send it dense (weightsync.sparse.diff never returns one)")
            payload = tensor.payload()
            if isinstance(tensor, TorchSparsePatch):
                from weightsync._gpu import dtype_name
                dtype = dtype_name(name, tensor.values)
                if hasattr(payload, "cpu"):
                    payload = payload.cpu().numpy()
            else:
                dtype = describe(name, tensor.values)[0]
            data.append(payload)
            manifest.append({"name": name, "dtype": dtype, "shape": list(tensor.shape),
                             "sparse_nnz": int(tensor.nnz),
                             "sparse_index_bytes": tensor.index_bytes})
            continue
        dtype, shape, raw = describe(name, tensor)
        data.append(raw)
        manifest.append({"name": name, "dtype": dtype, "shape": list(shape)})
    return data, manifest


def _gpu_partial_receipts(layouts, sent):
    """{layout key: checksum} of the tensors `sent` (torch, on the GPU) for
    each layout: one Triton launch per dtype pair over all of them, else
    torch int64 ops per layout (weightsync.receipts)."""
    from weightsync import receipts, receipts_gpu
    # FP8 layouts: their quantised part by weightsync.fp8 (the kernel has none).
    fp8 = {k: layout for k, layout in layouts.items() if receipts.has_fp8(layout)}
    out = {k: receipts.expected_receipt_arrays(layout, sent)[0] for k, layout in fp8.items()}
    rest = {k: layout for k, layout in layouts.items() if k not in fp8}
    if rest and receipts._all_cuda(sent) and receipts_gpu.available():
        gpu = receipts_gpu.expected_receipts_gpu(rest, sent, keep=False)
        out.update({k: v[0] for k, v in gpu.items()})
        return out
    out.update({k: receipts.expected_receipt_arrays(layout, sent)[0]
                for k, layout in rest.items()})
    return out


def _specs(manifest):
    """TensorSpecs of manifest dicts."""
    return [v1.TensorSpec(name=m["name"], dtype=getattr(v1, m["dtype"]), shape=m["shape"],
                          sparse_nnz=m.get("sparse_nnz", 0),
                          sparse_index_bytes=m.get("sparse_index_bytes", 0))
            for m in manifest]


def _sent(manifest, data):
    """{name: (dtype, shape, payload)} of the dense tensors (what receipts
    cover)."""
    return {m["name"]: (m["dtype"], m["shape"], d) for m, d in zip(manifest, data)
            if not m.get("sparse_nnz")}


class Trainer:
    def __init__(self, target=None, timeout=30.0, stream_timeout=600.0):
        targets = [target] if target is None or isinstance(target, str) else list(target)
        if not targets:
            raise ValueError("no daemon target")
        self._targets = [t or default_target() for t in targets]
        self._channels = [channel(t) for t in self._targets]
        self._stubs = [Stub(c, "TrainerService", timeout) for c in self._channels]
        self._group = _multi.Group(self._stubs, self._targets)
        # Tests only: called with "pushed" (bytes sent, before prepare) and
        # "prepared" (every daemon prepared, receipts checked, before the
        # commit) in an update of several daemons.
        self._on_phase = None
        self._channel, self._stub = self._channels[0], self._stubs[0]
        self._timeout = timeout
        self._stream_timeout = stream_timeout
        self._backend = None
        self._gpu = None
        self._ipc_packed = False
        self._host_manifest = None   # the last host update's Manifest
        self._host_source_id = None  # and its registered source
        self._host_sources = []      # HostSource objects (host_tensors)
        self._source = None    # (key, source_id, manifest, flats) of the registered source
        self._source_raw = None  # _moved_signature of the pairs it was made from
        self._source_pairs = None  # _SourcePairs: the last pairs sent from it
        self._source_gen = 0     # registrations made (a process-unique number each)
        self._layouts = {}     # layout_id -> layout (for receipts)
        self._layout_fp8 = {}  # layout_id -> whether it has FP8 targets
        self._layout_split = {}  # layout_id -> (plain, quantised) parameters
        # (plan_key, layout_id) -> weightsync.fp8_gpu.prepared_receipt_gpu's
        # handle (None: that path can't take the layout's FP8 targets)
        self._fp8_prepared = {}
        self._ipc_ring_slots = 2
        self.last_results = []
        self.last_starts = []  # several daemons: each one's Start answer
        # Lazy updates (LazyTensor): the most bytes of made tensors the NCCL
        # path holds before it waits for sent ones (None: the largest run
        # of tensors one chunk spans), and what the last one did.
        self.lazy_budget_bytes = None
        self.last_lazy = {}

    def close(self):
        if self._gpu is not None:
            self._gpu.abort_comm()
        for src in self._host_sources:
            src.close()
        self._host_sources = []
        for c in self._channels:
            c.close()

    @property
    def last_timings(self):
        """Seconds spent in the last GPU update: prepare_s (manifest, views,
        IPC: packing), start_to_finish_s (Start call to Finish answered and
        broadcasts done), total_s, and for NCCL start_s and enqueue_s."""
        return dict(self._gpu.last_timings) if self._gpu is not None else {}

    def init_host(self):
        """Forms a host-backend transfer group; returns its id (a list of
        ids, one per daemon, for several daemons: each then receives only
        the bytes of the tensors its engines use, docs/protocol.md,
        "Several daemons")."""
        results = self._group.each(
            lambda i, stub: stub.call("InitWeightTransfer", backend=v1.BACKEND_HOST))
        for i, r in enumerate(results):
            if isinstance(r, WeightSyncError):
                raise WeightSyncError(r.code, f"{self._group.name(i)}: {r.message}")
        self._backend = "host"
        self._host_source_id = None   # a new group keeps no sources
        for src in self._host_sources:
            src.source_id = None
            src.source_ids = {}
        ids = [r.group_id for r in results]
        return ids[0] if len(ids) == 1 else ids

    def host_tensors(self, params):
        """Host backend (after init_host): lays out `params` [(name, dtype
        enum name, shape)] in shared memory this trainer owns, registers
        them with the daemon once as a source with memory and returns a
        weightsync.host_source.HostSource, a mapping {name: numpy array}
        in that order. Train into the arrays in place; then
        `update(source, version)` (or an update of exactly these arrays) is
        one call in which the daemon copies from them: nothing is packed
        or streamed, and with 100,000 tensors an update costs what the
        daemon's copy costs (bench/manifest_scale.py --host-source). The
        memory lives until close() (of the source or the Trainer)."""
        if self._backend != "host":
            raise ValueError("host_tensors is for the host backend: call init_host() first")
        from weightsync.engine import lay_out_shared
        params = params if isinstance(params, (list, tuple)) else list(params)
        shm, offsets, _, arrays = lay_out_shared(params, f"weightsync-trainer-{os.getpid()}",
                                                 track=True)
        if len(arrays) != len(params):
            shm.unlink()
            raise ValueError("host_tensors: a tensor name appears twice")
        source = HostSource(shm, offsets, arrays)
        try:
            if len(self._stubs) > 1:
                # Every daemon opens the same shared memory (the host
                # backend's daemons share this host's /dev/shm).
                source.source_ids = {i: self._register_host_memory(source, stub)
                                     for i, stub in enumerate(self._stubs)}
            else:
                self._register_host_memory(source)
        except BaseException:
            source.close()
            raise
        self._host_sources.append(source)
        return source

    def _register_host_memory(self, source, stub=None):
        """Registers `source` with the daemon of `stub` (default the first)
        and returns its id there (also source.source_id for the first)."""
        m = source.manifest
        request = v1.RegisterSourceRequest(
            tensors=[v1.TensorSpec(name=n, dtype=getattr(v1, d), shape=sh)
                     for n, d, sh in zip(m.names, m.dtypes, m.shapes)])
        request.allocations.add(kind=v1.MEMORY_HOST_SHM, handle=source.handle.encode(),
                                size=source.size, device_uuid="host")
        add = request.placements.add
        for off in source.offsets.tolist():
            add(allocation=0, offset=off)
        source_id = (stub or self._stub).call("RegisterSource", request).source_id
        if stub is None or stub is self._stub:
            source.source_id = source_id
        return source_id

    def init_nccl(self, device=None, pack_buffers=2, timeout_ms=0):
        """Forms an NCCL transfer group with every daemon: makes an NCCL
        unique id, asks each daemon how many ranks it contributes
        (GetWorldSize for BACKEND_NCCL), calls InitWeightTransfer(world_size
        = 1 + all their ranks, rank_offset = 1 + the ranks of the daemons
        before it, nccl_version = this process's NCCL) on each, then joins
        as rank 0 on CUDA `device` (default: the current one) through
        libnccl (ctypes, weightsync.nccl). Blocks until every daemon's rank
        has joined. Call again after an update failed with ABORTED.
        Returns the group ids."""
        import torch
        from weightsync import nccl
        from weightsync.gpu_trainer import GpuSender, _device
        dev = _device(device)
        if self._gpu is not None:
            self._gpu.abort_comm()
        uid = nccl.get_unique_id()
        sizes = self.world_sizes("nccl")
        world = 1 + sum(sizes)
        offsets = [1 + sum(sizes[:i]) for i in range(len(sizes))]
        version = _nccl_version(nccl)
        groups = [stub.call("InitWeightTransfer", backend=v1.BACKEND_NCCL, world_size=world,
                            rank_offset=offsets[i], nccl_unique_id=uid, timeout_ms=timeout_ms,
                            nccl_version=version).group_id
                  for i, stub in enumerate(self._stubs)]
        with torch.cuda.device(dev):
            try:
                comm = nccl.Communicator(world, uid, 0)
            except nccl.NcclError as e:
                raise WeightSyncError("UNAVAILABLE", f"joining the NCCL group as rank 0 "
                                      f"on {dev}: {e}") from None
        if self._gpu is not None and self._gpu.device == dev and self._gpu.backend == "nccl":
            self._gpu.comm = comm
        else:
            self._gpu = GpuSender("nccl", dev, comm, pack_buffers)
        self._backend = "nccl"
        return groups

    def init_ipc(self, device=None, packed=False, ring_slots=2):
        """Forms an IPC transfer group (trainer on the engines' GPU). By
        default the trainer's tensors are a registered source: update()
        registers them with the daemon once (CUDA IPC handles of their
        caching-allocator blocks, offsets, dtypes, shapes), and each update
        is then one call in which the daemon copies straight from them into
        the engines' tensors, with no pack buffer; tensors that moved (a new
        data pointer, dtype or shape) are registered again before the
        update. Sparse patches, staged mode, non-contiguous tensors and
        packed=True take the packed path: each update is packed into one
        CUDA buffer whose IPC handle goes with StartWeightUpdate. Updates
        of LazyTensors go through a ring of `ring_slots` chunk slots
        instead (IpcChunks), so the trainer never holds the whole update."""
        if ring_slots < 2:
            raise ValueError(f"ring_slots must be at least 2, got {ring_slots}")
        self._ipc_packed = packed
        self._ipc_ring_slots = ring_slots
        self._source = None
        from weightsync.gpu_trainer import GpuSender, _device
        if len(self._stubs) > 1:
            raise ValueError("the ipc backend talks to the local daemon only")
        dev = _device(device)
        r = self._stub.call("InitWeightTransfer", backend=v1.BACKEND_IPC)
        if self._gpu is not None:
            self._gpu.abort_comm()
        self._gpu = GpuSender("ipc", dev)
        self._backend = "ipc"
        return [r.group_id]

    def world_size(self, backend=None):
        """Ranks of the daemons' groups, summed over every daemon; with
        `backend` ("host", "nccl", "ipc"), the ranks they would contribute
        to a group of that backend (answered before init too)."""
        return sum(self.world_sizes(backend))

    def world_sizes(self, backend=None):
        """[ranks of daemon i], as world_size()."""
        b = {None: v1.BACKEND_UNSPECIFIED, "host": v1.BACKEND_HOST, "nccl": v1.BACKEND_NCCL,
             "ipc": v1.BACKEND_IPC}[backend]
        out = self._group.each(lambda i, stub: stub.call("GetWorldSize", backend=b).world_size)
        for i, r in enumerate(out):
            if isinstance(r, WeightSyncError):
                raise WeightSyncError(r.code, f"{self._group.name(i)}: {r.message}")
        return out

    def status(self):
        """GetStatus of the first daemon (statuses() asks every one)."""
        return self._stub.call("GetStatus")

    def statuses(self):
        """[GetStatus of daemon i] for every daemon."""
        out = self._group.each(lambda i, stub: stub.call("GetStatus"))
        for i, r in enumerate(out):
            if isinstance(r, WeightSyncError):
                raise WeightSyncError(r.code, f"{self._group.name(i)}: {r.message}")
        return out

    def finish_prepared(self):
        """After a trainer died between prepare and commit (several
        daemons): commits an update still prepared on some daemons if
        another daemon committed it, aborts it where it is committed
        nowhere (its engines then stay DIRTY until a dense update).
        Returns {update_id: "committed" | "aborted"} (empty: nothing was
        left prepared). Call before the daemons' idle deadline
        (--update_idle_timeout_ms) ends the prepared updates themselves."""
        return _multi.finish_prepared(self._group, self.statuses())

    def check(self, engine_id):
        """Reads `engine_id`'s memory now and returns a CheckEngineResponse
        (version, state, receipt: the checksum of everything it holds, as a
        full update's receipt would be), on host or GPU memory."""
        return self._stub.call("CheckEngine", engine_id=engine_id)

    def pause(self, mode="keep", timeout=10.0, engine_ids=()):
        mode_value = {"abort": v1.PAUSE_MODE_ABORT, "wait": v1.PAUSE_MODE_WAIT,
                      "keep": v1.PAUSE_MODE_KEEP}[mode]
        out = [stub.call("Pause", mode=mode_value, timeout_ms=int(timeout * 1000),
                         engine_ids=list(engine_ids)) for stub in self._stubs]
        return out[0] if len(out) == 1 else out

    def resume(self, allow_dirty=False, timeout=10.0, engine_ids=()):
        out = [stub.call("Resume", allow_dirty=allow_dirty, timeout_ms=int(timeout * 1000),
                         engine_ids=list(engine_ids)) for stub in self._stubs]
        return out[0] if len(out) == 1 else out

    @contextlib.contextmanager
    def paused(self, mode="keep", timeout=10.0):
        """Engines paused inside the block, resumed after it (also on error,
        unless they are dirty: then Resume needs allow_dirty)."""
        self.pause(mode, timeout)
        try:
            yield self
        finally:
            self.resume(timeout=timeout)

    def update(self, named_tensors, version, chunk_bytes=0, update_id=None, engine_ids=(),
               mode="streaming", allow_streaming_fallback=False, verify=True,
               base_version=0):
        """Sends every (name, tensor) as weight version `version` (host
        backend: numpy arrays or CPU torch tensors). Returns the daemon's
        FinishWeightUpdateResponse (per-engine results, pause_seconds). The
        manifest is planned with the shared chunk planner, exactly as the
        daemon plans it. mode="staged": engines keep serving while the bytes
        arrive and pause only for the commit copy. verify=True: the daemon
        returns receipts and this client recomputes them from what it sent
        (through every engine's segments), raising DATA_LOSS on a mismatch;
        on the nccl/ipc backends the expectation is computed on the GPU
        where the tensors are (torch int64 ops). On by default;
        verify=False turns it off on both sides (VERIFY_OFF): the check
        costs some twenty int64 passes over the weights (on the host
        backend in numpy, on GPUs in torch; see bench/RESULTS.md). A tensor may be a weightsync.sparse.SparsePatch (numpy, or a
        TorchSparsePatch from sparse.diff of torch tensors, on the GPU):
        only its elements travel, and the update applies only on engines at
        `base_version`. A tensor may be a weightsync.LazyTensor (name,
        dtype, shape and a function that makes it): it is made just before
        its bytes are sent and let go right after (weightsync.lazy; on
        nccl/ipc in weightsync.gpu_trainer), receipts summed as it is
        made."""
        update_id = update_id or f"update-{version}-{uuid.uuid4().hex[:8]}"
        fast = self._source_pairs
        if (fast is not None and mode == "streaming" and type(named_tensors) is list
                and self._backend == "ipc" and not self._ipc_packed
                and fast.source is self._source and fast.same(named_tensors)):
            # The registered source's own tensors, none moved: nothing per
            # tensor beyond that check (no lazy or sparse entries among them).
            return self._update_from_source(named_tensors, version, chunk_bytes, update_id,
                                            engine_ids, verify, time.perf_counter(),
                                            unchanged=True)
        if not isinstance(named_tensors, HostSource):
            if not isinstance(named_tensors, list):
                named_tensors = list(named_tensors)
            if _lazy.is_lazy(named_tensors):
                return self._update_lazy(named_tensors, version, chunk_bytes, update_id,
                                          engine_ids, mode, allow_streaming_fallback, verify,
                                          base_version)
        if self._backend in ("nccl", "ipc"):
            return self._update_gpu(named_tensors, version, chunk_bytes, update_id, engine_ids,
                                    mode, allow_streaming_fallback, verify, base_version)
        if len(self._stubs) > 1:
            return self._update_host_multi(named_tensors, version, chunk_bytes, update_id,
                                           engine_ids, mode, allow_streaming_fallback, verify,
                                           base_version)
        if isinstance(named_tensors, HostSource):
            source = named_tensors   # no per-tensor work at all
            if mode == "streaming":
                return self._update_host_memory(source, version, chunk_bytes, update_id,
                                                engine_ids, verify)
            named_tensors = list(zip(source.names, source.tensors))
        else:
            named_tensors = list(named_tensors)
            source = next((s for s in self._host_sources if s.same_pairs(named_tensors)), None)
        if source is not None and mode == "streaming":
            return self._update_host_memory(source, version, chunk_bytes, update_id,
                                            engine_ids, verify)
        if not _has_patches(named_tensors):
            return self._update_host_source(named_tensors, version, chunk_bytes, update_id,
                                            engine_ids, mode, allow_streaming_fallback,
                                            verify)
        data, manifest = _describe_host(named_tensors)
        request = _start_request(
            update_id, version, chunk_bytes, engine_ids, mode, allow_streaming_fallback,
            verify, sparse_base_version=base_version, tensors=_specs(manifest))
        started = self._stub.call("StartWeightUpdate", request)
        plan = planner.plan_chunks(manifest, started.chunk_bytes)
        return self._push_and_finish(update_id, plan, data, _sent(manifest, data) if verify else None)

    # -- lazy tensors (weightsync.lazy) -----------------------------------------

    def _update_lazy(self, pairs, version, chunk_bytes, update_id, engine_ids, mode,
                     allow_streaming_fallback, verify, base_version):
        """An update with LazyTensors among its tensors: one Start .. Finish
        (the engines are paused once), each lazy tensor made just before
        the first chunk that needs it and let go after the last."""
        if self._backend in ("nccl", "ipc"):
            return self._update_gpu_lazy(pairs, version, chunk_bytes, update_id, engine_ids,
                                         mode, allow_streaming_fallback, verify, base_version)
        if len(self._stubs) > 1:
            raise ValueError("LazyTensors on the host backend go to one daemon; with several "
                             "daemons (each sent only what its engines use, from its own "
                             "thread) make the tensors first, or use the nccl backend")
        return self._update_host_lazy(pairs, version, chunk_bytes, update_id, engine_ids, mode,
                                      allow_streaming_fallback, verify, base_version)

    def _lazy_layouts(self, engine_ids):
        """([{engine id: (layout id, layout key)} per daemon], {layout key:
        layout}) of the engines an update may write, as registered now:
        layout ids from GetStatus, the layouts themselves from this
        client's cache or, for one not seen yet, GetStatus(include_layouts)."""
        def ask(include):
            out = self._group.each(lambda i, stub: stub.call("GetStatus",
                                                             include_layouts=include))
            for i, r in enumerate(out):
                if isinstance(r, WeightSyncError):
                    raise WeightSyncError(r.code, f"{self._group.name(i)}: {r.message}")
            return out

        try:
            return _lazy.engines_and_layouts(ask(False), engine_ids, self._layouts)
        except KeyError:
            pass
        statuses = ask(True)
        for status in statuses:
            for e in status.engines:
                if e.layout_id:
                    if len(self._layouts) > 64:
                        self._layouts.clear()
                    self._layouts[e.layout_id] = list(e.layout)
        return _lazy.engines_and_layouts(statuses, engine_ids)

    def _lazy_receipts(self, engine_ids, manifest, compute):
        engines, layouts = self._lazy_layouts(engine_ids)
        return engines, _lazy.ProgressiveReceipts(layouts, manifest, compute)

    def _check_lazy_receipts(self, results, engines, progress, stubs=None):
        stubs = stubs or self._stubs
        names = [self._group.name(self._stubs.index(s)) for s in stubs]
        _lazy.check_receipts(results, engines, progress.expected, names)

    def _update_host_lazy(self, pairs, version, chunk_bytes, update_id, engine_ids, mode,
                          allow_streaming_fallback, verify, base_version):
        """Host backend: the chunks are packed on this thread as the stream
        takes them (two ahead at most), each lazy tensor made (a numpy
        array or CPU torch tensor) before the first chunk holding its bytes
        and dropped after the last."""
        data, manifest, lazy = [], [], {}
        for i, (name, t) in enumerate(pairs):
            if isinstance(t, LazyTensor):
                lazy[i] = t
                data.append(None)
                manifest.append({"name": name, "dtype": t.dtype, "shape": list(t.shape)})
            else:
                d, m = _describe_host([(name, t)])
                data += d
                manifest += m
        engines = progress = None
        if verify:
            from weightsync.receipts import expected_receipt
            engines, progress = self._lazy_receipts(engine_ids, manifest, lambda layouts, sent: {
                k: expected_receipt(layout, sent)[0] for k, layout in layouts.items()})
            progress.add({m["name"]: (m["dtype"], m["shape"], d)
                          for i, (m, d) in enumerate(zip(manifest, data))
                          if i not in lazy and not m.get("sparse_nnz")})
        request = _start_request(
            update_id, version, chunk_bytes, engine_ids, mode, allow_streaming_fallback,
            verify, sparse_base_version=base_version, tensors=_specs(manifest))
        started = self._stub.call("StartWeightUpdate", request)
        plan = planner.plan_chunks(manifest, started.chunk_bytes)

        def make(i, entry):
            name = manifest[i]["name"]
            dtype, shape, raw = describe(name, entry.materialize())
            _lazy.check_materialized(name, entry, dtype, shape)
            if progress is not None:
                progress.add({name: (dtype, list(shape), raw)})
            return raw

        feed = _lazy.Feed(plan, lazy, make)
        finished = self._push_lazy(update_id, plan, data, feed)
        self.last_results = [finished]
        self.last_lazy = {"made": feed.made, "peak_bytes": feed.peak_bytes,
                          "window_bytes": max(_lazy.window_bytes(plan, set(lazy)), default=0)}
        if verify:
            self._check_lazy_receipts([finished], engines, progress)
        return finished

    def _push_lazy(self, update_id, plan, payloads, feed):
        """Streams the chunks of `plan` (PushChunks), each packed on this
        thread (where feed makes the lazy tensors: an FSDP gather belongs
        on the thread that runs the collectives) and handed to gRPC's
        sending thread through a queue of two; then Finish. A failure here
        cancels the stream and aborts the update; one of the stream lets
        the daemon end the update and raises its error."""
        import grpc
        import queue
        pending = queue.Queue(maxsize=2)
        end = object()

        def requests():
            while True:
                item = pending.get()
                if item is end:
                    return
                yield item

        method = self._stub._method("PushChunks")[0]
        future = method.future(requests(), timeout=self._stream_timeout)

        def put(item):
            while not future.done():
                try:
                    pending.put(item, timeout=0.05)
                    return True
                except queue.Full:
                    pass
            return False

        try:
            for chunk in plan["chunks"]:
                k = chunk["index"]
                feed.before(k, payloads)
                data = planner.pack_chunk(chunk, payloads)
                feed.after(k, payloads)
                if not put(v1.PushChunksRequest(update_id=update_id, chunk_index=k, data=data)):
                    break
            put(end)
        except BaseException as e:
            future.cancel()
            self._abort_started(update_id, 1, f"trainer: {type(e).__name__}: {e}")
            raise
        try:
            future.result()
        except grpc.FutureCancelledError:
            pushed = WeightSyncError("CANCELLED", "the chunk stream was cancelled")
        except grpc.RpcError as e:
            pushed = WeightSyncError(e.code().name, e.details())
        else:
            return self.finish(update_id)
        try:   # let the daemon end the update (and say which engines are dirty)
            self.finish(update_id)
        except WeightSyncError as finished:
            raise finished from pushed
        raise pushed

    def _update_gpu_lazy(self, pairs, version, chunk_bytes, update_id, engine_ids, mode,
                         allow_streaming_fallback, verify, base_version):
        """nccl / ipc update with LazyTensors (weightsync.gpu_trainer): on
        nccl the broadcast loop makes each lazy tensor before its first
        chunk and lets it go after its last, holding at most
        lazy_budget_bytes of them (default: the largest run one chunk
        spans); on ipc the chunks go through a ring of chunk slots
        (IpcChunks). Receipts are summed on the GPU as tensors are made."""
        from weightsync._gpu import elements
        gpu = self._gpu
        t0 = time.perf_counter()
        names, flats, manifest, _ = gpu.manifest(pairs)
        lazy = {i: f for i, f in enumerate(flats) if isinstance(f, LazyTensor)}
        for i in lazy:
            flats[i] = None
        engines = progress = None
        if verify:
            engines, progress = self._lazy_receipts(engine_ids, manifest, _gpu_partial_receipts)
            progress.add({m["name"]: (m["dtype"], m["shape"], elements(f, m["dtype"]))
                          for i, (m, f) in enumerate(zip(manifest, flats))
                          if i not in lazy and not m.get("sparse_nnz")})

        def on_made(indices):
            if progress is not None:
                progress.add({manifest[i]["name"]: (manifest[i]["dtype"], manifest[i]["shape"],
                                                    elements(flats[i], manifest[i]["dtype"]))
                              for i in indices})

        request = _start_request(
            update_id, version, chunk_bytes, engine_ids, mode, allow_streaming_fallback, verify,
            sparse_base_version=base_version, tensors=_specs(manifest))
        if gpu.backend == "ipc":
            return self._update_ipc_ring(request, names, flats, manifest, lazy, engines,
                                         progress, on_made, chunk_bytes, update_id, t0)
        multi = len(self._stubs) > 1
        started, plan, t_start, t_started = self._start_nccl(request, names, manifest,
                                                             update_id)
        windows = _lazy.window_bytes(plan, set(lazy))
        budget = self.lazy_budget_bytes or max(windows, default=0)
        feed = gpu.lazy_feed(names, plan, lazy, budget=budget, timeout=self._timeout)
        try:
            done, keep = gpu.enqueue_nccl(plan, flats, (), feed=feed, on_made=on_made)
        except Exception as e:   # NcclError, CUDA errors, a tensor that could not be made
            gpu.abort_comm()
            detail = self._abort_started(update_id, len(started), f"trainer: {e}")
            raise WeightSyncError("ABORTED", f"update '{update_id}': sending failed on the "
                                  f"trainer: {type(e).__name__}: {e}{detail}; init_nccl() "
                                  "again") from None
        t_enqueued = time.perf_counter()
        self.last_lazy = {"made": feed.made, "peak_bytes": feed.peak_bytes,
                          "window_bytes": max(windows, default=0), "budget_bytes": budget,
                          "ring_bytes": len(gpu._ring) * gpu._ring_chunk}
        check = (lambda results, stubs=None: self._check_lazy_receipts(
            results, engines, progress, stubs)) if verify else None
        if multi:
            return self._finish_nccl_multi(update_id, manifest, flats, done, keep, False, t0,
                                           t_start, t_started, t_enqueued, check=check)
        return self._finish_nccl(update_id, done, keep, check,
                                 (t0, t_start, t_started, t_enqueued))

    def _update_ipc_ring(self, request, names, flats, manifest, lazy, engines, progress,
                         on_made, chunk_bytes, update_id, t0):
        """An IPC update through a ring of chunk slots (docs/protocol.md,
        "Ring mode"): Start with ipc_source = the slots and ipc_ring_slots;
        per chunk, wait until the daemon copied the chunk that was in its
        slot, make the lazy tensors it needs, pack it, announce it
        (IpcChunks); then Finish."""
        from weightsync.gpu_trainer import RING_CHUNK_BYTES, RingStream, ring_send
        gpu = self._gpu
        slots = self._ipc_ring_slots
        if not chunk_bytes:
            total = gpu.plan(manifest, 1 << 30)["total_bytes"]
            chunk_bytes = min(RING_CHUNK_BYTES, planner.align_up(max(total, 1)))
        buf, handle = gpu.ipc_buffer(slots * chunk_bytes)
        request.chunk_bytes = chunk_bytes
        request.ipc_source.CopyFrom(gpu.ipc_source(handle, buf.numel()))
        request.ipc_ring_slots = slots
        t_start = time.perf_counter()
        started = self._stub.call("StartWeightUpdate", request)
        plan = gpu.plan(manifest, started.chunk_bytes)
        if (started.chunk_bytes != chunk_bytes or started.total_bytes != plan["total_bytes"]
                or started.num_chunks != len(plan["chunks"])):
            self._abort_started(update_id, 1, "chunk plan mismatch")
            raise WeightSyncError(
                "INTERNAL", f"daemon plans {started.total_bytes} bytes in {started.num_chunks} "
                f"chunks of {started.chunk_bytes}, this client {plan['total_bytes']} in "
                f"{len(plan['chunks'])} of {chunk_bytes}")
        feed = gpu.lazy_feed(names, plan, lazy, timeout=self._timeout, synchronous=True)
        ring = RingStream(self._stub, update_id, self._stream_timeout)
        try:
            ring_send(plan, slots, ring,
                      lambda c, slot: gpu.pack_slot(c, flats, buf, slot * chunk_bytes),
                      feed, flats, on_made)
        except WeightSyncError as e:
            ring.cancel()
            try:   # the daemon's verdict on the update
                self.finish(update_id)
            except WeightSyncError as finished:
                raise finished from e
            raise
        except BaseException as e:
            ring.cancel()
            self._abort_started(update_id, 1, f"trainer: {type(e).__name__}: {e}")
            raise
        t_sent = time.perf_counter()
        finished = self.finish(update_id)
        t1 = time.perf_counter()
        gpu.last_timings = {"prepare_s": t_start - t0, "send_s": t_sent - t_start,
                            "start_to_finish_s": t1 - t_start}
        self.last_results = [finished]
        self.last_lazy = {"made": feed.made, "peak_bytes": feed.peak_bytes,
                          "window_bytes": max(_lazy.window_bytes(plan, set(lazy)), default=0),
                          "ring_bytes": int(buf.numel())}   # slots x chunk, rounded up
        if progress is not None:
            t = time.perf_counter()
            self._check_lazy_receipts([finished], engines, progress)
            gpu.last_timings["receipts_s"] = time.perf_counter() - t
        gpu.last_timings["total_s"] = time.perf_counter() - t0
        return finished

    def _update_host_multi(self, named_tensors, version, chunk_bytes, update_id, engine_ids,
                           mode, allow_streaming_fallback, verify, base_version):
        """Host update of several daemons (weightsync._multi_host); returns
        one FinishWeightUpdateResponse per daemon of the update."""
        from weightsync import _multi_host
        return _multi_host.update(self, named_tensors, version, chunk_bytes, update_id,
                                  engine_ids, mode, allow_streaming_fallback, verify,
                                  base_version)

    def _push_and_finish(self, update_id, plan, payloads, sent, parts=None):
        """Host backend: streams the planned chunks packed from `payloads`
        (or joined from `parts`, one list per chunk: planner.chunk_parts),
        finishes the update and, unless `sent` is None, checks the receipts
        against `sent` ({name: (dtype, shape, bytes)} or Manifest.sent())."""
        def chunks():
            for i, chunk in enumerate(plan["chunks"]):
                data = (b"".join(parts[i]) if parts is not None
                        else planner.pack_chunk(chunk, payloads))
                yield v1.PushChunksRequest(update_id=update_id, chunk_index=chunk["index"],
                                           data=data)

        try:
            self._stub.call("PushChunks", chunks(), timeout=self._stream_timeout)
        except WeightSyncError as pushed:
            # Let the daemon end the update (and say which engines are dirty).
            try:
                self.finish(update_id)
            except WeightSyncError as finished:
                raise finished from pushed
            raise
        finished = self.finish(update_id)
        if sent is not None:
            from weightsync.receipts import expected_receipt
            self._check_receipts([finished], lambda layout, key: expected_receipt(
                layout, sent, layout_key=key), keyed=True)
        return finished

    def _host_source(self, named_tensors):
        """(Manifest, source id) of a dense host update: the manifest is
        described with per-dtype work done once (build_manifest) and
        registered with the daemon once; an update of the same names, dtypes
        and shapes reuses the registered source, so neither side describes,
        validates nor plans it again."""
        prev = self._host_manifest
        m = build_manifest(named_tensors, previous=prev)
        if self._host_source_id is None or not m.same_as(prev):
            request = v1.RegisterSourceRequest(tensors=[
                v1.TensorSpec(name=n, dtype=getattr(v1, d), shape=sh)
                for n, d, sh in zip(m.names, m.dtypes, m.shapes)])
            self._host_source_id = self._stub.call("RegisterSource", request).source_id
        self._host_manifest = m
        return m, self._host_source_id

    def _update_host_source(self, named_tensors, version, chunk_bytes, update_id, engine_ids,
                            mode, allow_streaming_fallback, verify):
        """A dense host-backend update from a registered source (manifest
        only): Start names the source, the chunks are packed from the
        manifest's byte views with the cached chunk plan."""
        for attempt in (0, 1):
            m, source_id = self._host_source(named_tensors)
            request = _start_request(update_id, version, chunk_bytes, engine_ids, mode,
                                     allow_streaming_fallback, verify, source_id=source_id)
            try:
                started = self._stub.call("StartWeightUpdate", request)
                break
            except WeightSyncError as e:
                # A new group (Init) or an evicted source: register again.
                if e.code != "NOT_FOUND" or attempt:
                    raise
                self._host_source_id = None
        plan = planner.plan_chunks_cached(m, m, started.chunk_bytes)
        return self._push_and_finish(update_id, plan, m.payloads, m.sent() if verify else None,
                                     parts=m.chunk_parts(plan))

    def _update_host_memory(self, source, version, chunk_bytes, update_id, engine_ids,
                            verify):
        """A host update from a HostSource: one call (Start with finish);
        the daemon copies the bytes from the source's shared memory. With
        receipts, the expectation for the layouts the engines had last time
        is computed on a thread while the daemon copies (the tensors don't
        change during update()); a layout not seen before is computed
        after."""
        if source.source_id is None and source.manifest is None:
            raise ValueError(f"{source!r} is closed")
        from weightsync.receipts import expected_receipt
        ahead, worker = {}, None
        known = [(k, self._layouts[k]) for k in source.layout_ids if k in self._layouts]
        if verify and known:
            def expect():
                for key, layout in known:
                    ahead[key] = expected_receipt(layout, source.sent(), layout_key=key)
            worker = threading.Thread(target=expect, name="weightsync-receipts", daemon=True)
            worker.start()
        try:
            for attempt in (0, 1):
                if source.source_id is None:
                    self._register_host_memory(source)
                try:
                    finished = self._start_finished(update_id, version, chunk_bytes,
                                                    engine_ids, verify, source.source_id)
                    break
                except WeightSyncError as e:
                    # A new group (Init) or an evicted source: register again.
                    if e.code != "NOT_FOUND" or attempt:
                        raise
                    source.source_id = None
        finally:
            if worker is not None:
                worker.join()
        self.last_results = [finished]
        if verify:
            source.layout_ids = {r.layout_id for r in finished.engines if r.layout_id}
            self._check_receipts([finished], lambda layout, key: ahead.get(key) or
                                 expected_receipt(layout, source.sent(), layout_key=key),
                                 keyed=True)
        return finished

    def _start_finished(self, update_id, version, chunk_bytes, engine_ids, verify, source_id):
        """A one-call streaming update (Start with finish) from the
        registered source `source_id`, whose memory the daemon copies from;
        returns its FinishWeightUpdateResponse. The daemon waits two thirds
        of our deadline for the copy, so its answer arrives before we give
        up."""
        request = _start_request(update_id, version, chunk_bytes, engine_ids, "streaming",
                                 False, verify, source_id=source_id, finish=True,
                                 finish_timeout_ms=int(self._timeout * 1000 * 2 / 3))
        return self._stub.call("StartWeightUpdate", request).finished

    def _update_gpu(self, named_tensors, version, chunk_bytes, update_id, engine_ids, mode,
                    allow_streaming_fallback, verify, base_version=0):
        """NCCL / IPC update of torch tensors (see weightsync.gpu_trainer).
        Returns the FinishWeightUpdateResponse (a list of them, one per
        daemon, for several daemons); self.last_results holds the list."""
        gpu = self._gpu
        t0 = time.perf_counter()
        ipc_packed = self._ipc_packed
        if gpu.backend == "ipc" and mode == "streaming" and not ipc_packed:
            named_tensors = list(named_tensors)
            out = self._update_from_source(named_tensors, version, chunk_bytes, update_id,
                                           engine_ids, verify, t0)
            if out is not None:
                return out
        names, flats, manifest, _ = gpu.manifest(named_tensors)
        request = _start_request(
            update_id, version, chunk_bytes, engine_ids, mode, allow_streaming_fallback,
            verify,
            sparse_base_version=base_version,
            tensors=[v1.TensorSpec(name=m["name"], dtype=getattr(v1, m["dtype"]),
                                   shape=m["shape"], sparse_nnz=m.get("sparse_nnz", 0),
                                   sparse_index_bytes=m.get("sparse_index_bytes", 0))
                     for m in manifest])
        if gpu.backend == "ipc":
            # Offsets and total size don't depend on the chunk size.
            layout = gpu.plan(manifest, chunk_bytes or (1 << 30))
            buf, handle = gpu.ipc_buffer(layout["total_bytes"])
            gpu.pack_all(layout, flats, buf)
            request.ipc_source.CopyFrom(gpu.ipc_source(handle, buf.numel()))
            t_packed = time.perf_counter()
            self._stub.call("StartWeightUpdate", request)
            finished = self.finish(update_id)   # the daemon copied; buf may change now
            t1 = time.perf_counter()
            gpu.last_timings = {"prepare_s": t_packed - t0, "start_to_finish_s": t1 - t_packed}
            self.last_results = [finished]
            if verify:
                self._check_gpu_receipts([finished], manifest, flats)
            gpu.last_timings["total_s"] = time.perf_counter() - t0
            return finished
        # With the chunk size known, the first chunks are packed while Start
        # runs on the daemons.
        prepacked = set()
        if chunk_bytes:
            try:
                prepacked = gpu.prepack(gpu.plan(manifest, chunk_bytes), flats)
            except Exception:
                prepacked = set()   # planning errors are the daemon's to report
        multi = len(self._stubs) > 1
        names = [m["name"] for m in manifest]
        started, plan, t_start, t_started = self._start_nccl(request, names, manifest,
                                                             update_id)
        if started[0].chunk_bytes != chunk_bytes:
            prepacked = set()   # packed for another chunk size: pack again
        try:
            done, keep = gpu.enqueue_nccl(plan, flats, prepacked)
        except Exception as e:   # NcclError, CUDA errors
            gpu.abort_comm()
            detail = self._abort_started(update_id, len(started), f"trainer: {e}")
            raise WeightSyncError("ABORTED", f"update '{update_id}': sending failed on the "
                                  f"trainer: {e}{detail}; init_nccl() again") from None
        t_enqueued = time.perf_counter()
        if multi:
            return self._finish_nccl_multi(update_id, manifest, flats, done, keep, verify, t0,
                                           t_start, t_started, t_enqueued)
        check = (lambda results: self._check_gpu_receipts(results, manifest, flats)) \
            if verify else None
        return self._finish_nccl(update_id, done, keep, check,
                                 (t0, t_start, t_started, t_enqueued))

    def _start_nccl(self, request, names, manifest, update_id):
        """Starts an NCCL update on every daemon: with several
        (docs/protocol.md, "Several daemons"), a tensor no daemon uses is
        refused before any daemon pauses, and each skips the copies of what
        its engines don't use (it still takes part in every broadcast).
        Returns (started, the chunk plan every daemon agreed to, t Start
        called, t answered); a daemon planning otherwise aborts the update
        (INTERNAL)."""
        gpu = self._gpu
        multi = len(self._stubs) > 1
        if multi:
            _multi.plan(self._group, [request] * len(self._stubs), names)
        started = []
        t_start = time.perf_counter()
        try:
            if multi:
                started = _multi.start(self._group, [request] * len(self._stubs), names)
            else:
                started.append(self._stub.call("StartWeightUpdate", request))
        except WeightSyncError:
            if multi:
                gpu.abort_comm()   # the daemons that started abort their communicators
            raise
        self.last_starts = started
        t_started = time.perf_counter()
        plan = gpu.plan(manifest, started[0].chunk_bytes)
        for s in started:
            if s.total_bytes != plan["total_bytes"] or s.num_chunks != len(plan["chunks"]):
                self._abort_started(update_id, len(started), "chunk plan mismatch")
                gpu.abort_comm()
                raise WeightSyncError(
                    "INTERNAL", f"daemon plans {s.total_bytes} bytes in {s.num_chunks} chunks, "
                    f"this client {plan['total_bytes']} in {len(plan['chunks'])}")
        return started, plan, t_start, t_started

    def _finish_nccl(self, update_id, done, keep, check, times):
        """The end of an NCCL update of one daemon: Finish (the daemon waits
        for its bytes), then the trainer's own broadcasts, the timings and
        check(results) (the receipts, unless None). times: (t0, Start
        called, Start answered, last broadcast enqueued)."""
        gpu = self._gpu
        t0, t_start, t_started, t_enqueued = times
        try:
            results = [self.finish(update_id)]
        except WeightSyncError:
            gpu.abort_comm()   # a broadcast whose receiver is gone never ends
            raise
        gpu.wait(done, self._timeout)
        keep.clear()   # the broadcasts are done: their sources may go
        t1 = time.perf_counter()
        gpu.last_timings = {"prepare_s": t_start - t0, "start_s": t_started - t_start,
                            "enqueue_s": t_enqueued - t_started,
                            "start_to_finish_s": t1 - t_start}
        self.last_results = results
        if check is not None:
            check(results)
        gpu.last_timings["total_s"] = time.perf_counter() - t0
        return results[0]

    def _finish_nccl_multi(self, update_id, manifest, flats, done, keep, verify, t0, t_start,
                           t_started, t_enqueued, check=None):
        """The end of an NCCL update of several daemons: prepare on every
        daemon, the receipts checked, then the commit on every daemon
        (weightsync._multi); any failure before the commit aborts the
        update everywhere. Returns the commits, one per daemon. check:
        checks the prepared receipts instead (a lazy update's)."""
        gpu = self._gpu
        try:
            prepared = _multi.prepare(self._group, update_id,
                                      int(self._timeout * 1000 * 2 / 3))
        except WeightSyncError:
            gpu.abort_comm()   # a broadcast whose receiver is gone never ends
            raise
        gpu.wait(done, self._timeout)
        del keep
        t1 = time.perf_counter()
        gpu.last_timings = {"prepare_s": t_start - t0, "start_s": t_started - t_start,
                            "enqueue_s": t_enqueued - t_started,
                            "start_to_finish_s": t1 - t_start}
        if verify or check is not None:
            try:
                if check is not None:
                    check(prepared)
                else:
                    self._check_gpu_receipts(prepared, manifest, flats)
            except WeightSyncError as e:
                gpu.abort_comm()   # the daemons' Abort drops their communicators
                _multi.fail_everywhere(self._group, update_id, None, e, "receipts do not match")
        if self._on_phase is not None:
            self._on_phase("prepared")
        results = _multi.commit(self._group, update_id)
        self.last_results = results
        gpu.last_timings["total_s"] = time.perf_counter() - t0
        return results

    def _source_for(self, pairs):
        """The registered source for (name, tensor) `pairs`: the one already
        registered if every tensor is where it was (same data pointer,
        dtype, shape), else a new registration. None where the packed path
        must carry the update (a sparse patch, a non-contiguous tensor)."""
        key = []
        for name, t in pairs:
            if not hasattr(t, "data_ptr") or not t.is_contiguous() or t.device != self._gpu.device:
                return None
            key.append((name, t.data_ptr(), t.dtype, t.shape))
        key = tuple(key)
        if self._source is not None and self._source[0] == key:
            return self._source
        from weightsync._gpu import allocation_table, dtype_names, flat_bytes, ipc_locations
        dts = dtype_names(pairs)
        entries = [(name,) + loc for (name, _), loc in zip(pairs, ipc_locations(pairs))]
        manifest = [{"name": name, "dtype": dt, "shape": [int(s) for s in t.shape]}
                    for (name, t), dt in zip(pairs, dts)]
        flats = [flat_bytes(name, t) for name, t in pairs]
        allocations, placements = allocation_table(entries)
        request = v1.RegisterSourceRequest(
            tensors=[v1.TensorSpec(name=m["name"], dtype=getattr(v1, m["dtype"]),
                                   shape=m["shape"]) for m in manifest],
            allocations=[v1.Allocation(kind=v1.MEMORY_CUDA_IPC, handle=a["handle"],
                                       size=a["size"], device_uuid=a["device_uuid"])
                         for a in allocations],
            placements=[v1.SourcePlacement(allocation=i, offset=o) for _, i, o in placements])
        if self._source is not None:
            # The old source's mappings of our memory go first: the daemon
            # holds no view of tensors that moved.
            try:
                self._stub.call("UnregisterSource", source_id=self._source[1])
            except WeightSyncError:
                pass   # already dropped (a new group, or evicted)
            self._source = None
        source_id = self._stub.call("RegisterSource", request).source_id
        self._source_gen += 1   # names this registration in receipt plan keys
        self._source = (key, source_id, manifest, flats, self._source_gen)
        return self._source

    def _update_from_source(self, named_tensors, version, chunk_bytes, update_id, engine_ids,
                            verify, t0, unchanged=False):
        """One-call IPC update from the registered source (init_ipc): the
        daemon copies from the trainer's tensors in place. Returns None
        where the packed path must carry it. unchanged: the caller found
        `named_tensors` to be the source's own pairs, none moved
        (_SourcePairs.same)."""
        import torch
        from weightsync._gpu import dedupe_aliases
        pairs = named_tensors if isinstance(named_tensors, list) else list(named_tensors)
        if not unchanged and _has_patches(pairs):
            return None
        gpu = self._gpu
        raw = None if unchanged else _moved_signature(pairs)
        for attempt in (0, 1):
            if attempt == 0 and unchanged:
                source = self._source
            elif (attempt == 0 and raw is not None and self._source is not None
                    and self._source_raw == raw):
                source = self._source   # every tensor where it was: no per-tensor work
            else:
                self._source_raw = None
                self._source_pairs = None
                source = self._source_for(dedupe_aliases(pairs)[0])
                if source is not None:
                    raw = raw if raw is not None else _moved_signature(pairs)
                    if raw is not None and len(raw) == 2:   # torch tensors
                        # The next update of these very pairs: _SourcePairs.same.
                        self._source_pairs = _SourcePairs(pairs, source)
            if source is not None:
                self._source_raw = raw
            if source is None:
                return None
            # The daemon's worker reads these tensors from another process:
            # the work that wrote them must be done first.
            torch.cuda.current_stream(gpu.device).synchronize()
            t_ready = time.perf_counter()
            try:
                finished = self._start_finished(update_id, version, chunk_bytes, engine_ids,
                                                verify, source[1])
                break
            except WeightSyncError as e:
                # The group was initialised again or the source dropped.
                if e.code != "NOT_FOUND" or attempt:
                    raise
                self._source = None
        t1 = time.perf_counter()
        gpu.last_timings = {"prepare_s": t_ready - t0, "start_to_finish_s": t1 - t_ready}
        self.last_results = [finished]
        if verify:
            # After the update, not beside it: the GPU time-slices the two
            # processes, so an expectation computed during the daemon's copy
            # only lengthened it, and one started before Start too (23.6 ms
            # after, 24.4 ahead: bench/RESULTS.md).
            self._check_gpu_receipts([finished], source[2], source[3], plan_key=source[4])
        gpu.last_timings["total_s"] = time.perf_counter() - t0
        return finished

    def _check_gpu_receipts(self, results, manifest, flats, plan_key=None):
        """Receipts of a GPU update, the expectation computed on the GPU
        from the tensors as sent (weightsync.receipts.expected_receipt_arrays
        on torch tensors, on the current stream of their device: after the
        work that produced them, before update() returns and they may
        change). plan_key: names the tensors' placement exactly (a
        registered source's registration number, which changes whenever a
        tensor moves): with the engine's layout id it keys the Triton
        kernel's tables, so an update of a source already checked against
        that layout builds nothing per tensor. Adds receipts_s to
        last_timings."""
        from weightsync._gpu import elements
        from weightsync.receipts import expected_receipt_arrays
        t = time.perf_counter()
        built = []

        def sent():
            if not built:
                built.append({m["name"]: (m["dtype"], m["shape"], elements(f, m["dtype"]))
                              for m, f in zip(manifest, flats) if not m.get("sparse_nnz")})
            return built[0]

        fast = None
        if plan_key is not None and flats and getattr(flats[0], "is_cuda", False):
            from weightsync import receipts_gpu
            if receipts_gpu.available():
                fast = receipts_gpu
        from weightsync.receipts import has_fp8

        def fp8_of(layout, layout_id):
            # Once per layout id (a pass over 100k parameters cost ~50 ms).
            if not layout_id:
                return has_fp8(layout)
            if layout_id not in self._layout_fp8:
                self._layout_fp8[layout_id] = has_fp8(layout)
            return self._layout_fp8[layout_id]
        def fp8_expected(layout, layout_id):
            # The plain parameters by the receipts kernel with the plan
            # cached as for a layout without FP8 targets (keyed: nothing per
            # tensor), the quantised ones by weightsync.fp8_gpu; the split
            # once per layout id.
            from weightsync import fp8
            from weightsync.receipts import quantized_where_sent
            split = self._layout_split.get(layout_id) if layout_id else None
            if split is None:
                split = fp8.split_layout(layout)[:2]
                if layout_id:
                    self._layout_split[layout_id] = split
            plain, quant = split
            # The FP8 kernels' tables keyed like the plain plan (nothing per
            # tensor on a repeated update), started before the plain part.
            wait = fp8_started(quant, (plan_key, layout_id)) if layout_id else None
            c, n, b = fast.expected_receipts_gpu({0: plain}, sent, plan_key=(
                plan_key, layout_id, "plain") if layout_id else None)[0]
            if wait is not None:
                q_sum, q_params, q_bytes = wait()
            else:
                q_sum, q_params, q_bytes = quantized_where_sent(quant, sent())
            return (c + q_sum) & 0xFFFFFFFFFFFFFFFF, n + q_params, b + q_bytes

        def fp8_started(quant, key):
            from weightsync import fp8_gpu, receipts
            if receipts._fp8_triton_failed:
                return None
            try:
                if key not in self._fp8_prepared:
                    if len(self._fp8_prepared) > 16:
                        self._fp8_prepared.clear()
                    self._fp8_prepared[key] = fp8_gpu.prepared_receipt_gpu(quant, sent())
                handle = self._fp8_prepared[key]
                return None if handle is None else fp8_gpu.start_prepared(handle)
            except Exception as e:  # noqa: BLE001 - the general path is exact too
                receipts._fp8_triton_failed.append(repr(e))
                return None
        try:
            if fast is None:
                self._check_receipts(results, lambda layout: expected_receipt_arrays(
                    layout, sent()))
            else:
                self._check_receipts(results, lambda layout, layout_id: (
                    fp8_expected(layout, layout_id) if fp8_of(layout, layout_id) else
                    fast.expected_receipts_gpu({0: layout}, sent, plan_key=(
                        plan_key, layout_id) if layout_id else None)[0]), keyed=True)
        finally:
            self._gpu.last_timings["receipts_s"] = time.perf_counter() - t

    def _abort_started(self, update_id, count, reason):
        detail = ""
        for stub in self._stubs[:count]:
            try:
                stub.call("AbortWeightUpdate", update_id=update_id, reason=reason)
            except WeightSyncError as e:
                detail += f"; abort on a daemon: {e}"
        return detail

    def _layouts_of(self, stub, engine_results):
        """{engine id: registered layout} of the engines in `engine_results`:
        from this client's cache when the daemon's layout_id says the layout
        is one already fetched, else from GetStatus(include_layouts) (an
        engine registered again has a new layout_id)."""
        cached = {r.engine_id: self._layouts[r.layout_id] for r in engine_results
                  if r.layout_id and r.layout_id in self._layouts}
        if len(cached) == sum(1 for r in engine_results if not r.lost):
            return cached
        layouts = {}
        for e in stub.call("GetStatus", include_layouts=True).engines:
            layouts[e.engine_id] = e.layout
            if e.layout_id:
                if len(self._layouts) > 64:
                    self._layouts.clear()
                self._layouts[e.layout_id] = e.layout
        return layouts

    def _check_receipts(self, results, expected, keyed=False, stubs=None):
        """Compares every engine's receipt in `results` (one
        FinishWeightUpdateResponse or PrepareWeightUpdateResponse per
        daemon, in `stubs` order, default self._stubs) with
        expected(layout) -> (checksum, parameters, bytes) for the layout
        the engine registered; raises DATA_LOSS naming the engine. Engines
        with one layout (replicas) are computed once. keyed: expected takes
        (layout, layout_id) and may keep work per layout id."""
        cache = {}
        for stub, finished in zip(stubs or self._stubs, results):
            if not any(r.HasField("receipt") for r in finished.engines):
                continue
            layouts = self._layouts_of(stub, finished.engines)
            for r in finished.engines:
                if not r.HasField("receipt") or r.lost or r.engine_id not in layouts:
                    continue
                layout = layouts[r.engine_id]
                key = r.layout_id or tuple(p.SerializeToString(deterministic=True)
                                           for p in layout)
                if key not in cache:
                    cache[key] = (expected(layout, r.layout_id or None) if keyed
                                  else expected(layout))
                checksum, _, nbytes = cache[key]
                if checksum != r.receipt.checksum or nbytes != r.receipt.bytes:
                    raise WeightSyncError(
                        "DATA_LOSS", f"engine '{r.engine_id}' receipt "
                        f"{r.receipt.checksum:016x} over {r.receipt.bytes} bytes does not "
                        f"match {checksum:016x} over {nbytes} bytes computed from what was "
                        "sent")

    def finish(self, update_id):
        # The daemon waits two thirds of our deadline for the bytes, so its
        # answer (even an abort) arrives before we give up.
        return self._stub.call("FinishWeightUpdate", update_id=update_id,
                               timeout_ms=int(self._timeout * 1000 * 2 / 3))

    def abort(self, update_id, reason=""):
        return self._stub.call("AbortWeightUpdate", update_id=update_id, reason=reason)

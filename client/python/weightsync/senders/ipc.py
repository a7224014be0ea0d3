"""IPC backend: the trainer on the engines' GPU, the daemon's worker reading
the trainer's memory through CUDA IPC handles. Three ways:

registered source  (default) the trainer's tensors are registered with the
                   daemon once (IPC handles of their caching-allocator
                   blocks, offsets, dtypes, shapes); an update is one call
                   in which the daemon copies straight from them. Tensors
                   that moved (a new data pointer, dtype or shape) are
                   registered again first.
packed             sparse patches, staged mode, non-contiguous tensors and
                   packed=True: the update is packed into one CUDA buffer
                   whose handle goes with StartWeightUpdate.
ring               updates with LazyTensors: a ring of chunk slots, each
                   chunk packed when the daemon copied the one before it
                   in its slot (docs/protocol.md, "Ring mode"), so the
                   trainer never holds the whole update.
"""

import itertools
import operator
import sys
import time

from weightsync import lazy as _lazy
from weightsync import planner
from weightsync._errors import WeightSyncError
from weightsync._proto import v1
from weightsync.gpu_trainer import RING_CHUNK_BYTES, GpuSender, RingStream, cuda_device, ring_send
from weightsync.senders.base import Job, Sender, specs
from weightsync.senders.gpu_lazy import describe_lazy
from weightsync.senders.gpu_receipts import GpuReceipts
from weightsync.senders.host_stream import has_patches

_first = operator.itemgetter(0)
_second = operator.itemgetter(1)
_data_ptr = operator.methodcaller("data_ptr")
_stride = operator.methodcaller("stride")
_dtype = operator.attrgetter("dtype")
_shape = operator.attrgetter("shape")
# Registrations made in this process: each names its tensors' placement in
# the receipt kernels' table keys.
_registrations = itertools.count(1)


def moved_signature(pairs):
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


class SourcePairs:
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


class Registered:
    """A registered source: `key` (name, data pointer, dtype, shape of each
    tensor), the daemon's `source_id`, its `manifest` and byte views
    `flats`, and `number`, unique in the process (the receipts' plan key)."""

    def __init__(self, key, source_id, manifest, flats):
        self.key, self.source_id = key, source_id
        self.manifest, self.flats = manifest, flats
        self.number = next(_registrations)


class IpcSender(Sender):
    """Updates over CUDA IPC to the local daemon (module docstring)."""

    backend = "ipc"

    def __init__(self, link, gpu, packed=False, ring_slots=2):
        super().__init__(link)
        self.gpu = gpu
        self.packed = packed
        self.ring_slots = ring_slots
        self.source = None        # Registered
        self._source_raw = None   # moved_signature of the pairs it was made from
        self._source_pairs = None  # SourcePairs: the last pairs sent from it
        self._receipts = GpuReceipts()

    @classmethod
    def join(cls, link, previous, device=None, packed=False, ring_slots=2):
        """Forms the group (Trainer.init_ipc); returns (sender, group ids)."""
        if ring_slots < 2:
            raise ValueError(f"ring_slots must be at least 2, got {ring_slots}")
        if link.multi:
            raise ValueError("the ipc backend talks to the local daemon only")
        dev = cuda_device(device)
        r = link.stub.call("InitWeightTransfer", backend=v1.BACKEND_IPC)
        if previous is not None:
            previous.close()
        return cls(link, GpuSender("ipc", dev), packed, ring_slots), [r.group_id]

    def close(self):
        self.gpu.abort_comm()

    def update(self, u):
        fast = self._source_pairs
        if (fast is not None and u.mode == "streaming" and type(u.named_tensors) is list
                and not self.packed and fast.source is self.source
                and fast.same(u.named_tensors)):
            # The registered source's own tensors, none moved: nothing per
            # tensor beyond that check (no lazy or sparse entries among them).
            return self.run(u, self._from_source(u, time.perf_counter(), unchanged=True))
        return super().update(u)

    def describe(self, u):
        t0 = time.perf_counter()
        if u.mode == "streaming" and not self.packed:
            job = self._from_source(u, t0)
            if job is not None:
                return job
        return self._packed(u, t0)

    # -- registered source --------------------------------------------------------

    def prepare(self, pairs, verify=True):
        """Registers `pairs` (a list of (name, tensor)) as the source ahead
        of the first update (Trainer.init_ipc(tensors=...)) and, with
        receipts on, builds the receipt tables for every engine layout the
        warm start fetched, so that the first update of these very tensors
        does only what a steady one does. False where updates of them would
        not come from a registered source (packed=True, sparse patches,
        LazyTensors, tensors not contiguous on this GPU): nothing is done."""
        if self.packed or has_patches(pairs) or _lazy.is_lazy(pairs):
            return False
        source, raw = self._pick_source(pairs, None, False, False)
        if source is None:
            return False
        self._source_raw = raw
        if verify:
            self._receipts.prepare(self.link, source.manifest, source.flats, source.number)
        return True

    def _register(self, pairs):
        """The registered source for (name, tensor) `pairs`: the one already
        registered if every tensor is where it was (same data pointer,
        dtype, shape), else a new registration. None where the packed path
        must carry the update (a sparse patch, a non-contiguous tensor)."""
        key = []
        for name, t in pairs:
            if not hasattr(t, "data_ptr") or not t.is_contiguous() or t.device != self.gpu.device:
                return None
            key.append((name, t.data_ptr(), t.dtype, t.shape))
        key = tuple(key)
        if self.source is not None and self.source.key == key:
            return self.source
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
        if self.source is not None:
            # The old source's mappings of our memory go first: the daemon
            # holds no view of tensors that moved.
            try:
                self.link.stub.call("UnregisterSource", source_id=self.source.source_id)
            except WeightSyncError:
                pass   # already dropped (a new group, or evicted)
            self.source = None
        source_id = self.link.stub.call("RegisterSource", request).source_id
        self.source = Registered(key, source_id, manifest, flats)
        return self.source

    def _pick_source(self, pairs, raw, first, unchanged):
        """(source, raw): the registered source to update from, the kept
        one if the caller or `raw` (moved_signature) says nothing moved,
        else one registered now (None: the packed path)."""
        from weightsync._gpu import dedupe_aliases
        if first and unchanged:
            return self.source, raw
        if first and raw is not None and self.source is not None and self._source_raw == raw:
            return self.source, raw   # every tensor where it was: no per-tensor work
        self._source_raw = None
        self._source_pairs = None
        source = self._register(dedupe_aliases(pairs)[0])
        if source is not None:
            raw = raw if raw is not None else moved_signature(pairs)
            if raw is not None and len(raw) == 2:   # torch tensors
                # The next update of these very pairs: SourcePairs.same.
                self._source_pairs = SourcePairs(pairs, source)
        return source, raw

    def _from_source(self, u, t0, unchanged=False):
        """The Job of a one-call update from the registered source; None
        where the packed path must carry it. unchanged: the caller found
        the tensors to be the source's own pairs, none moved."""
        import torch
        pairs = u.pairs()
        if not unchanged and has_patches(pairs):
            return None
        raw = None if unchanged else moved_signature(pairs)
        job = Job(None, t0=t0, one_call=True)

        def request(first):
            nonlocal raw
            source, raw = self._pick_source(pairs, raw, first, unchanged)
            if source is None:
                return None
            self._source_raw = raw
            # The daemon's worker reads these tensors from another process:
            # the work that wrote them must be done first.
            torch.cuda.current_stream(self.gpu.device).synchronize()
            job.t_ready = time.perf_counter()
            job.source = source
            return u.one_call_request(source.source_id, self.link.daemon_wait_ms())

        def retry():   # the group was initialised again or the source dropped
            self.source = None
            return request(False)

        job.request, job.retry = request(True), retry
        if job.request is None:
            return None
        if u.verify:
            # After the update, not beside it: the GPU time-slices the two
            # processes, so an expectation computed during the daemon's copy
            # only lengthened it, and one started before Start too (23.6 ms
            # after, 24.4 ahead: bench/RESULTS.md).
            job.check = lambda results: self._receipts.check(
                self.link, results, job.source.manifest, job.source.flats,
                plan_key=job.source.number, timings=self.gpu.last_timings)
        return job

    # -- packed -------------------------------------------------------------------

    def _packed(self, u, t0):
        gpu = self.gpu
        names, flats, manifest, _ = gpu.manifest(u.pairs())
        request = u.request(sparse_base_version=u.base_version, tensors=specs(manifest))
        # Offsets and total size don't depend on the chunk size.
        layout = gpu.plan(manifest, u.chunk_bytes or (1 << 30))
        buf, handle = gpu.ipc_buffer(layout["total_bytes"])
        gpu.pack_all(layout, flats, buf)
        request.ipc_source.CopyFrom(gpu.ipc_source(handle, buf.numel()))
        job = Job(request, t0=t0, t_ready=time.perf_counter())
        if u.verify:
            sent = gpu.receipt_inputs(u.pairs(), manifest, flats)
            job.check = lambda results: self._receipts.check(
                self.link, results, *sent, timings=gpu.last_timings)
        return job

    # -- ring (LazyTensors) ---------------------------------------------------------

    def describe_lazy(self, u):
        job = describe_lazy(self.link, self.gpu, u)
        gpu, slots, chunk_bytes = self.gpu, self.ring_slots, u.chunk_bytes
        if not chunk_bytes:
            total = gpu.plan(job.manifest, 1 << 30)["total_bytes"]
            chunk_bytes = min(RING_CHUNK_BYTES, planner.align_up(max(total, 1)))
        job.buf, handle = gpu.ipc_buffer(slots * chunk_bytes)
        job.request.chunk_bytes = job.chunk_bytes = chunk_bytes
        job.request.ipc_source.CopyFrom(gpu.ipc_source(handle, job.buf.numel()))
        job.request.ipc_ring_slots = slots
        job.ring = True
        return job

    def start(self, u, job):
        if not getattr(job, "ring", False):
            return super().start(u, job)
        job.t_ready = time.perf_counter()
        started = super().start(u, job)
        s = started[0]
        job.plan = plan = self.gpu.plan(job.manifest, s.chunk_bytes)
        if (s.chunk_bytes != job.chunk_bytes or s.total_bytes != plan["total_bytes"]
                or s.num_chunks != len(plan["chunks"])):
            self.link.abort_started(u.update_id, 1, "chunk plan mismatch")
            raise WeightSyncError(
                "INTERNAL", f"daemon plans {s.total_bytes} bytes in {s.num_chunks} "
                f"chunks of {s.chunk_bytes}, this client {plan['total_bytes']} in "
                f"{len(plan['chunks'])} of {job.chunk_bytes}")
        return started

    def send(self, u, job, started):
        """Ring: per chunk, wait until the daemon copied the chunk that was
        in its slot, make the lazy tensors it needs, pack it, announce it
        (IpcChunks)."""
        if not getattr(job, "ring", False):
            return
        gpu, buf, chunk_bytes = self.gpu, job.buf, job.chunk_bytes
        feed = gpu.lazy_feed(job.names, job.plan, job.lazy, timeout=self.link.timeout,
                             synchronous=True)
        ring = RingStream(self.link.stub, u.update_id, self.link.stream_timeout)
        try:
            ring_send(job.plan, self.ring_slots, ring,
                      lambda c, slot: gpu.pack_slot(c, job.flats, buf, slot * chunk_bytes),
                      feed, job.flats, job.on_made)
        except WeightSyncError as e:
            ring.cancel()
            self.link.finish_after_failure(u.update_id, e)   # the daemon's verdict
        except BaseException as e:
            ring.cancel()
            self.link.abort_started(u.update_id, 1, f"trainer: {type(e).__name__}: {e}")
            raise
        job.t_sent = time.perf_counter()
        self.link.last_lazy = {"made": feed.made, "peak_bytes": feed.peak_bytes,
                               "window_bytes": max(_lazy.window_bytes(job.plan, set(job.lazy)),
                                                   default=0),
                               "ring_bytes": int(buf.numel())}   # slots x chunk, rounded up

    def finish(self, u, job, started):
        results = super().finish(u, job, started)
        t1 = time.perf_counter()
        timings = {"prepare_s": job.t_ready - job.t0}
        if getattr(job, "ring", False):
            timings["send_s"] = job.t_sent - job.t_ready
        timings["start_to_finish_s"] = t1 - job.t_ready
        self.gpu.last_timings = timings
        return results

    def check(self, u, job, results):
        if job.check is None:
            return
        if getattr(job, "ring", False):
            t = time.perf_counter()
            job.check(results)
            self.gpu.last_timings["receipts_s"] = time.perf_counter() - t
        else:
            job.check(results)

    def commit(self, u, job, results):
        self.gpu.last_timings["total_s"] = time.perf_counter() - job.t0
        return results[0]


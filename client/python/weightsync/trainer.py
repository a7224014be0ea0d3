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
import uuid

from weightsync import _liveness, _multi, _warm
from weightsync import lazy as _lazy
from weightsync._errors import WeightSyncError
from weightsync._proto import Stub, channel, default_target, v1
from weightsync._usage import tensor_pairs
from weightsync.host_source import HostSource
from weightsync.senders.base import Link, Update
from weightsync.senders.host_source import HostSourceSender
from weightsync.senders.host_stream import HostStreamSender
from weightsync.senders.multi_host import MultiHostSender
from weightsync.wire_fp8 import WirePlans, on_the_wire


class Trainer:
    """The trainer's side of weightsyncd: the connection to one daemon or
    several, the transfer group, and update(). Each update is carried by
    one sender (weightsync.senders): the host backend's stream or shared
    memory, several host daemons, NCCL or IPC."""

    def __init__(self, target=None, timeout=30.0, stream_timeout=600.0):
        targets = [target] if target is None or isinstance(target, str) else list(target)
        if not targets:
            raise ValueError("no daemon target")
        self._targets = [t or default_target() for t in targets]
        self._channels = [channel(t) for t in self._targets]
        self._stubs = [Stub(c, "TrainerService", timeout, target=t)
                       for c, t in zip(self._channels, self._targets)]
        self._channel, self._stub = self._channels[0], self._stubs[0]
        self._link = Link(self._stubs, _multi.Group(self._stubs, self._targets), timeout,
                          stream_timeout)
        self._backend = None
        self._host_stream = HostStreamSender(self._link)
        self._host_sources = HostSourceSender(self._link)
        self._multi_host = MultiHostSender(self._link, self._host_sources)
        self._gpu = None   # the NcclSender or IpcSender of the last init_nccl / init_ipc
        # update_sharded: (collective id, engine ids) -> senders.many.ManySenders
        self._many_senders = {}
        # init_nccl(collective=...): (collective, many_nccl.NcclLinks)
        self._sharded_nccl = None
        # Each daemon's hold on the group it formed for this trainer
        # (weightsync._liveness): this process dying ends its update there.
        self._liveness = _liveness.Holds(timeout)
        # (source, engine) dtype pairs whose receipt kernels init_nccl() /
        # init_ipc() compiled (weightsync._warm): no compilation in update().
        self.warmed = []
        self.prepared = False
        self._wire_plans = WirePlans()   # update(fp8_on_wire=True)

    # What the last update left (weightsync.senders.base.Link).
    last_results = property(lambda self: self._link.last_results,
                            lambda self, v: setattr(self._link, "last_results", v))
    last_starts = property(lambda self: self._link.last_starts,
                           doc="several daemons: each one's Start answer")
    last_lazy = property(lambda self: self._link.last_lazy,
                         doc="a lazy update: tensors made, peak bytes held, windows")
    lazy_budget_bytes = property(
        lambda self: self._link.lazy_budget_bytes,
        lambda self, v: setattr(self._link, "lazy_budget_bytes", v),
        doc="lazy updates on nccl: the most bytes of made tensors held before "
            "waiting for sent ones (None: the largest run one chunk spans)")
    # Tests only: called with "pushed" (bytes sent, before prepare) and
    # "prepared" (every daemon prepared, receipts checked, before the
    # commit) in an update of several daemons.
    _on_phase = property(lambda self: self._link.on_phase,
                         lambda self, v: setattr(self._link, "on_phase", v))

    def close(self):
        self._liveness.close()
        self._close_sharded()
        if self._gpu is not None:
            self._gpu.close()
        self._host_sources.close()
        for s in self._stubs:
            s.close()   # its channel: the first, or one it made since (weightsync._retry)

    @property
    def last_timings(self):
        """Seconds spent in the last GPU update: prepare_s (manifest, views,
        IPC: packing), start_to_finish_s (Start call to Finish answered and
        broadcasts done), total_s, and for NCCL start_s and enqueue_s."""
        return dict(self._gpu.gpu.last_timings) if self._gpu is not None else {}

    # -- transfer groups --------------------------------------------------------

    def init_host(self):
        """Forms a host-backend transfer group; returns its id (a list of
        ids, one per daemon, for several daemons: each then receives only
        the bytes of the tensors its engines use, docs/protocol.md,
        "Several daemons")."""
        results = self._link.each(
            lambda i, stub: stub.call("InitWeightTransfer", backend=v1.BACKEND_HOST))
        self._close_sharded()
        self._backend = "host"
        self.prepared = False
        self._host_stream.reset()    # a new group keeps no sources
        self._host_sources.reset()
        ids = [r.group_id for r in results]
        self._liveness.replace(self._stubs, ids)
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
        return self._host_sources.make(params)

    def init_nccl(self, device=None, pack_buffers=2, timeout_ms=0, collective=None):
        """Forms an NCCL transfer group with every daemon: makes an NCCL
        unique id, asks each daemon how many ranks it contributes
        (GetWorldSize for BACKEND_NCCL), calls InitWeightTransfer(world_size
        = 1 + all their ranks, rank_offset = 1 + the ranks of the daemons
        before it, nccl_version = this process's NCCL) on each, then joins
        as rank 0 on CUDA `device` (default: the current one) through
        libnccl (ctypes, weightsync.nccl). Blocks until every daemon's rank
        has joined. Call again after an update failed with ABORTED.
        Returns the group ids.

        With a `collective` of several ranks (a sharded trainer, issue 32),
        call it on every rank: the group then has every trainer rank (rank
        r of the collective is NCCL rank r) before the daemons' ranks, and
        update_sharded sends each rank's share point to point
        (weightsync.senders.many_nccl); update() is refused."""
        if collective is not None and collective.world_size > 1:
            return self._init_nccl_sharded(device, pack_buffers, timeout_ms, collective)
        from weightsync.senders.nccl import NcclSender
        self._close_sharded()
        self._gpu, groups = NcclSender.join(self._link, self._gpu, device, pack_buffers,
                                            timeout_ms)
        self._liveness.replace(self._stubs, groups)
        self._backend = "nccl"
        self.prepared = False   # init_ipc(tensors=...) registered for another group
        self.warmed = _warm.warm_receipts(self._stub, self._gpu.gpu.device,
                                          self._link.remember_layout)
        return groups

    def _init_nccl_sharded(self, device, pack_buffers, timeout_ms, collective):
        from weightsync.senders.many_nccl import NcclLinks
        if self._gpu is not None:
            self._gpu.close()
            self._gpu = None
        self._close_sharded()
        links, groups = NcclLinks.join(self._link, collective, device, max(pack_buffers, 4),
                                       timeout_ms)
        # Every rank holds the group: any rank dying ends the update on
        # every daemon at once (its sends' receivers would wait for ever).
        self._liveness.replace(self._stubs, groups)
        self._sharded_nccl = (collective, links)
        self._backend = "nccl"
        return groups

    def _close_sharded(self):
        if self._sharded_nccl is not None:
            self._sharded_nccl[1].close()
            self._sharded_nccl = None
        self._many_senders = {}

    def init_ipc(self, device=None, packed=False, ring_slots=2, tensors=None, verify=True):
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
        instead (IpcChunks), so the trainer never holds the whole update.

        tensors: what update() will send (model.named_parameters(), a
        state_dict, a list of pairs), registered now, with the receipt
        tables for the engines' layouts (verify=False: not those), so that
        the first update costs what a steady one does (warm start;
        docs/python.md). update() of the same tensors then uses this
        registration; tensors that moved since are registered again, as
        always. self.prepared says whether it was done (not for packed=True,
        sparse patches, LazyTensors or tensors not contiguous on the GPU)."""
        from weightsync.senders.ipc import IpcSender
        self._close_sharded()
        self._gpu, groups = IpcSender.join(self._link, self._gpu, device, packed, ring_slots)
        self._liveness.replace(self._stubs, groups)
        self._backend = "ipc"
        self.warmed = _warm.warm_receipts(self._stub, self._gpu.gpu.device,
                                          self._link.remember_layout)
        self.prepared = (tensors is not None
                         and self._gpu.prepare(tensor_pairs(tensors, "init_ipc(tensors=...)"), verify=verify))
        return groups

    def world_size(self, backend=None):
        """Ranks of the daemons' groups, summed over every daemon; with
        `backend` ("host", "nccl", "ipc"), the ranks they would contribute
        to a group of that backend (answered before init too)."""
        return sum(self.world_sizes(backend))

    def world_sizes(self, backend=None):
        """[ranks of daemon i], as world_size()."""
        return self._link.world_sizes(backend)

    # -- the daemons' state -------------------------------------------------------

    def status(self):
        """GetStatus of the first daemon (statuses() asks every one)."""
        return self._stub.call("GetStatus")

    def statuses(self):
        """[GetStatus of daemon i] for every daemon."""
        return self._link.each(lambda i, stub: stub.call("GetStatus"))

    def finish_prepared(self):
        """After a trainer died between prepare and commit (several
        daemons): commits an update still prepared on some daemons if
        another daemon committed it, aborts it where it is committed
        nowhere (its engines then stay DIRTY until a dense update).
        Returns {update_id: "committed" | "aborted"} (empty: nothing was
        left prepared). Call before the daemons' idle deadline
        (--update_idle_timeout_ms) ends the prepared updates themselves."""
        return _multi.finish_prepared(self._link.group, self.statuses())

    def check(self, engine_id):
        """Reads `engine_id`'s memory now and returns a CheckEngineResponse
        (version, state, receipt: the checksum of everything it holds, as a
        full update's receipt would be), on host or GPU memory."""
        return self._stub.call("CheckEngine", engine_id=engine_id)

    def pause(self, mode="keep", timeout=10.0, engine_ids=()):
        mode_value = {"abort": v1.PAUSE_MODE_ABORT, "wait": v1.PAUSE_MODE_WAIT,
                      "keep": v1.PAUSE_MODE_KEEP}[mode]
        self._liveness.hold_pauses(self._stubs)   # before any group: hold the pauses
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

    # -- updates --------------------------------------------------------------------

    def update(self, named_tensors, version, chunk_bytes=0, update_id=None, engine_ids=(),
               mode="streaming", allow_streaming_fallback=False, verify=True,
               base_version=0, fp8_on_wire=False):
        """Sends every (name, tensor) as weight version `version` (host
        backend: numpy arrays or CPU torch tensors): a list of pairs, any
        iterable of them, or a {name: tensor} mapping such as
        model.state_dict(), in send order. Returns the daemon's
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
        backend in numpy, on GPUs in torch; see bench/RESULTS.md). A tensor
        may be a weightsync.sparse.SparsePatch (numpy, or a
        TorchSparsePatch from sparse.diff of torch tensors, on the GPU):
        only its elements travel, and the update applies only on engines at
        `base_version`. A tensor may be a weightsync.LazyTensor (name,
        dtype, shape and a function that makes it): it is made just before
        its bytes are sent and let go right after (weightsync.lazy; on
        nccl/ipc in weightsync.gpu_trainer), receipts summed as it is
        made. With several daemons the answer is a list, one per daemon.

        fp8_on_wire=True: each tensor whose every use, in every engine the
        update writes, is an FP8 target of one format, block and scale
        form on whole blocks of it is quantised here, where it is (a CUDA
        tensor on its GPU: one Triton launch), and travels as a byte an
        element plus its blocks' scales; the engines then hold exactly
        what the daemon quantising it gives (weightsync.wire_fp8,
        docs/protocol.md "FP8 on the wire"). The rest travel as they are.
        Off by default: it pays where the link binds (NCCL across nodes),
        not where the daemon reads the trainer's memory itself (IPC on the
        same GPU, the host backend): bench/RESULTS.md, "FP8 on the wire"."""
        if not isinstance(named_tensors, HostSource):
            named_tensors = tensor_pairs(named_tensors)   # a state_dict too; not empty
        if fp8_on_wire:
            named_tensors = self._on_the_wire(named_tensors, engine_ids)
        u = Update(named_tensors, version, chunk_bytes,
                   update_id or f"update-{version}-{uuid.uuid4().hex[:8]}", engine_ids, mode,
                   allow_streaming_fallback, verify, base_version)
        return self._sender_for(u).update(u)

    def _on_the_wire(self, pairs, engine_ids):
        """`pairs` with the tensors that can travel quantised quantised
        (update(fp8_on_wire=True))."""
        if isinstance(pairs, HostSource):
            raise ValueError("fp8_on_wire: the daemon copies a HostSource from its shared "
                             "memory (nothing travels to quantise); update a list of "
                             "arrays instead")
        pairs = list(pairs)
        if _lazy.is_lazy(pairs):
            raise ValueError("fp8_on_wire: LazyTensors are made as their chunks go and "
                             "can't be quantised ahead; make the tensors first")
        return on_the_wire(pairs, self._wire_plans.plan(self._link, engine_ids, pairs))

    def _sender_for(self, u):
        """The sender that carries update `u`."""
        if self._backend in ("nccl", "ipc"):
            if self._gpu is None:
                raise WeightSyncError(
                    "FAILED_PRECONDITION", "this Trainer joined the NCCL group as one rank of "
                    "a sharded trainer (init_nccl(collective=...)): call update_sharded on "
                    "every rank, or init_nccl() without a collective for update()")
            return self._gpu
        if len(self._stubs) > 1:
            return self._multi_host
        if not u.lazy and self._host_sources.takes(u):
            return self._host_sources
        return self._host_stream

    @property
    def sharded_collective(self):
        """The collective init_nccl(collective=...) formed the NCCL group
        with (every update_sharded of this Trainer uses it), or None."""
        return None if self._sharded_nccl is None else self._sharded_nccl[0]

    def update_sharded(self, manifest, local, version, collective=None, chunk_bytes=0,
                       update_id=None, engine_ids=None, verify=True, base_version=None,
                       max_density=0.1, basis_bytes=0, fp8_on_wire=False):
        """Every rank of a sharded or replicated trainer sends its own share
        (issue 32; docs/transfer_plan.md): call on every rank, each with a
        Trainer of every daemon (host backend: init_host() on rank 0 only),
        the same `manifest` (global [{"name", "dtype", "shape"}]) and
        version, and `local` [(block, array)] of what this rank holds
        (weightsync.senders.many.shard_of / weightsync.transfer_plan.whole).
        `collective`: how the ranks agree (default: torch.distributed's
        default group). The plan is made once and reused while neither the
        holdings nor the engines change. `verify`: each rank sums the
        receipt terms of what it sent and rank 0 checks the daemons'
        receipts against the sum (DATA_LOSS, aborted everywhere, on a
        mismatch). Returns every daemon's commit on every rank, or raises
        the same WeightSyncError on every rank. Sparse patches (host
        backend): with basis_bytes (None: no bound) each rank keeps what
        it sent, and a later update_sharded(base_version=v) sends each
        piece that changed in at most max_density of its elements since
        version v as a patch (docs/transfer_plan.md, "Sparse patches").
        fp8_on_wire=True (host backend): each rank quantises its pieces of
        the tensors that can travel quantised (as update()'s, and every
        piece on whole blocks; weightsync.senders.many_wire) and sends a
        byte an element; a tensor a shard cuts goes as it is. Keep it the
        same on every rank and across updates (it is part of the plan)."""
        from weightsync.senders import many as many_senders
        nccl = None
        if self._sharded_nccl is not None:
            joined, nccl = self._sharded_nccl
            collective = joined if collective is None else collective
            if collective is not joined:
                raise ValueError("update_sharded: the collective differs from the one "
                                 "init_nccl(collective=...) formed the NCCL group with")
        elif self._backend in ("nccl", "ipc"):
            raise WeightSyncError(
                "FAILED_PRECONDITION", f"update_sharded on the {self._backend} backend needs "
                "every rank in the group: init_nccl(collective=...) on every rank (or "
                "init_host() on rank 0 for the host backend)")
        if fp8_on_wire and nccl is not None:
            raise ValueError("update_sharded(fp8_on_wire=True) sends quantised pieces on "
                             "the host backend only for now; on nccl the daemons quantise")
        key = (id(collective), tuple(engine_ids) if engine_ids is not None else None,
               bool(fp8_on_wire))
        senders = self._many_senders.get(key)
        if senders is None:
            coll = collective if collective is not None else many_senders.TorchCollective()
            senders = many_senders.ManySenders(self._link, coll, engine_ids, nccl=nccl,
                                               basis_bytes=basis_bytes,
                                               fp8_on_wire=fp8_on_wire)
            self._many_senders[key] = senders
        return senders.update(manifest, local, version, chunk_bytes=chunk_bytes,
                              update_id=update_id, verify=verify, base_version=base_version,
                              max_density=max_density)

    def finish(self, update_id):
        """FinishWeightUpdate of an update this process started."""
        return self._link.finish(update_id)

    def abort(self, update_id, reason=""):
        return self._stub.call("AbortWeightUpdate", update_id=update_id, reason=reason)

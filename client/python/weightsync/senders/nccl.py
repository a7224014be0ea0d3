"""NCCL backend: the trainer is rank 0 of a group with every daemon's ranks
and broadcasts each chunk (weightsync.gpu_trainer.GpuSender packs and
enqueues them on its streams). One daemon: Start, the broadcasts, Finish.
Several daemons (docs/protocol.md, "Several daemons"): a tensor no daemon
uses is refused before any daemon pauses, each daemon skips the copies of
what its engines don't use (it still takes part in every broadcast), and
the update is prepared everywhere, its receipts checked, then committed
everywhere (weightsync._multi). LazyTensors are made just before their
first chunk and let go after their last, holding at most
Link.lazy_budget_bytes of them.
"""

import time

from weightsync import _multi
from weightsync import lazy as _lazy
from weightsync._errors import WeightSyncError
from weightsync._proto import v1
from weightsync.gpu_trainer import GpuSender, cuda_device
from weightsync.senders.base import Job, Sender, specs
from weightsync.senders.gpu_lazy import describe_lazy
from weightsync.senders.gpu_receipts import GpuReceipts


def nccl_version(nccl):
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


def init_daemons(link, senders, timeout_ms=0, senders_on_this_host=False):
    """Asks every daemon into a new NCCL group whose first `senders` ranks
    are the trainer's: a fresh unique id, each daemon's rank count
    (GetWorldSize), then InitWeightTransfer with world_size = senders +
    all their ranks and rank_offset = senders + the ranks of the daemons
    before it, and this process's NCCL version (and, for many senders,
    whether they all run on the daemons' host: local_links). Returns
    (unique id, world size, each daemon's rank_offset, group ids); the
    trainer ranks join after."""
    from weightsync import nccl
    sizes = link.world_sizes("nccl")
    uid = nccl.get_unique_id()
    world = senders + sum(sizes)
    offsets = [senders + sum(sizes[:i]) for i in range(len(sizes))]
    version = nccl_version(nccl)
    groups = [stub.call("InitWeightTransfer", backend=v1.BACKEND_NCCL, world_size=world,
                        rank_offset=offsets[i], nccl_unique_id=uid, timeout_ms=timeout_ms,
                        nccl_version=version,
                        senders_on_this_host=senders_on_this_host).group_id
              for i, stub in enumerate(link.stubs)]
    return uid, world, offsets, groups


def local_links(targets, ranks):
    """True when NCCL carries every sender's bytes to every daemon inside
    one host, by NVLink or PCIe (the daemons' default chunk size for such
    groups is larger: InitWeightTransferRequest.senders_on_this_host):
    every daemon reached by a Unix socket, every rank (its (hostname,
    NCCL_P2P_DISABLE, NCCL_SHM_DISABLE), `ranks`) on one host, and no rank
    keeping NCCL off its peer-to-peer and shared-memory transports."""
    if not targets or not ranks:
        return False
    on = lambda v: (v or "").strip() not in ("", "0")  # noqa: E731 - NCCL reads "1"
    return (all(t.startswith("unix:") for t in targets)
            and len({host for host, _, _ in ranks}) == 1
            and not any(on(p2p) or on(shm) for _, p2p, shm in ranks))


def this_host():
    """(hostname, NCCL_P2P_DISABLE, NCCL_SHM_DISABLE) of this process: what
    local_links compares across ranks."""
    import os
    import socket
    return (socket.gethostname(), os.environ.get("NCCL_P2P_DISABLE"),
            os.environ.get("NCCL_SHM_DISABLE"))


class NcclSender(Sender):
    """Updates over an NCCL group (module docstring). `gpu`: the
    GpuSender holding the communicator, streams and pack buffers."""

    backend = "nccl"

    def __init__(self, link, gpu):
        super().__init__(link)
        self.gpu = gpu
        self._receipts = GpuReceipts()

    @classmethod
    def join(cls, link, previous, device=None, pack_buffers=2, timeout_ms=0):
        """Forms the group (Trainer.init_nccl): an NCCL unique id, each
        daemon's rank count and InitWeightTransfer, then this process joins
        as rank 0 on `device`. `previous`: the Trainer's GPU sender, whose
        communicator is dropped (and whose buffers are kept if it is an
        NcclSender on the same device). Returns (sender, group ids)."""
        import torch
        from weightsync import nccl
        dev = cuda_device(device)
        if previous is not None:
            previous.close()
        uid, world, _, groups = init_daemons(link, 1, timeout_ms)
        with torch.cuda.device(dev):
            try:
                comm = nccl.Communicator(world, uid, 0)
            except nccl.NcclError as e:
                raise WeightSyncError("UNAVAILABLE", f"joining the NCCL group as rank 0 "
                                      f"on {dev}: {e}") from None
        if isinstance(previous, cls) and previous.gpu.device == dev:
            previous.gpu.comm = comm
            return previous, groups
        return cls(link, GpuSender("nccl", dev, comm, pack_buffers)), groups

    def close(self):
        self.gpu.abort_comm()

    # -- describe ---------------------------------------------------------------

    def describe(self, u):
        gpu = self.gpu
        t0 = time.perf_counter()
        names, flats, manifest, _ = gpu.manifest(u.pairs())
        request = u.request(sparse_base_version=u.base_version, tensors=specs(manifest))
        # With the chunk size known, the first chunks are packed while Start
        # runs on the daemons.
        prepacked = set()
        if u.chunk_bytes:
            try:
                prepacked = gpu.prepack(gpu.plan(manifest, u.chunk_bytes), flats)
            except Exception:
                prepacked = set()   # planning errors are the daemon's to report
        job = Job(request, t0=t0, names=[m["name"] for m in manifest], flats=flats,
                  manifest=manifest, lazy=None, prepacked=prepacked, on_made=None, early=None,
                  timings={})
        # What the receipts take: a tensor quantised on the wire as its source.
        job.sent = gpu.receipt_inputs(u.pairs(), manifest, flats)
        if u.verify:
            job.check = lambda results: self._receipts.check(
                self.link, results, *job.sent, timings=gpu.last_timings, early=job.early)
        return job

    def describe_lazy(self, u):
        return describe_lazy(self.link, self.gpu, u)

    # -- the steps that differ --------------------------------------------------

    def start(self, u, job):
        """Start on every daemon (several: plan first); the chunk plan every
        daemon agreed to goes in job.plan; a daemon planning otherwise
        aborts the update (INTERNAL)."""
        gpu, link = self.gpu, self.link
        requests = [job.request] * len(link.stubs)
        if link.multi:
            _multi.plan(link.group, requests, job.names)
        started = []
        job.t_start = time.perf_counter()
        try:
            if link.multi:
                started = _multi.start(link.group, requests, job.names)
            else:
                started.append(link.stub.call("StartWeightUpdate", job.request))
        except WeightSyncError:
            if link.multi:
                gpu.abort_comm()   # the daemons that started abort their communicators
            raise
        link.last_starts = started
        job.t_started = time.perf_counter()
        job.plan = plan = gpu.plan(job.manifest, started[0].chunk_bytes)
        for s in started:
            if s.total_bytes != plan["total_bytes"] or s.num_chunks != len(plan["chunks"]):
                link.abort_started(u.update_id, len(started), "chunk plan mismatch")
                gpu.abort_comm()
                raise WeightSyncError(
                    "INTERNAL", f"daemon plans {s.total_bytes} bytes in {s.num_chunks} chunks, "
                    f"this client {plan['total_bytes']} in {len(plan['chunks'])}")
        return started

    def send(self, u, job, started):
        """Enqueues every broadcast (making lazy tensors as they are due);
        a failure tears the communicator down and aborts the update."""
        gpu, plan = self.gpu, job.plan
        feed = None
        if job.lazy is not None:
            windows = _lazy.window_bytes(plan, set(job.lazy))
            budget = self.link.lazy_budget_bytes or max(windows, default=0)
            feed = gpu.lazy_feed(job.names, plan, job.lazy, budget=budget,
                                 timeout=self.link.timeout)
        elif started[0].chunk_bytes != u.chunk_bytes:
            job.prepacked = set()   # packed for another chunk size: pack again
        try:
            job.done, job.keep = gpu.enqueue_nccl(plan, job.flats, job.prepacked, feed=feed,
                                                  on_made=job.on_made)
        except Exception as e:   # NcclError, CUDA errors, a tensor that could not be made
            gpu.abort_comm()
            detail = self.link.abort_started(u.update_id, len(started), f"trainer: {e}")
            what = f"{type(e).__name__}: {e}" if feed is not None else str(e)
            raise WeightSyncError("ABORTED", f"update '{u.update_id}': sending failed on the "
                                  f"trainer: {what}{detail}; init_nccl() again") from None
        job.t_enqueued = time.perf_counter()
        if job.check is not None and feed is None:
            # The expectation of the layouts the engines had last time, while
            # the broadcasts run (it read the tensors after the step, as they do).
            job.early = self._receipts.early(self.link, *job.sent, timings=job.timings)
        if feed is not None:
            self.link.last_lazy = {"made": feed.made, "peak_bytes": feed.peak_bytes,
                                   "window_bytes": max(windows, default=0),
                                   "budget_bytes": budget, "ring_bytes": gpu.ring_bytes()}

    def finish(self, u, job, started):
        """Finish (several daemons: prepare everywhere), then the trainer's
        own broadcasts; the daemons wait for their bytes."""
        gpu, link = self.gpu, self.link
        try:
            if link.multi:
                results = _multi.prepare(link.group, u.update_id, link.daemon_wait_ms())
            else:
                results = [link.finish(u.update_id)]
        except WeightSyncError:
            gpu.abort_comm()   # a broadcast whose receiver is gone never ends
            raise
        gpu.wait(job.done, link.timeout)
        job.keep.clear()   # the broadcasts are done: their sources may go
        t1 = time.perf_counter()
        gpu.last_timings = {"prepare_s": job.t_start - job.t0,
                            "start_s": job.t_started - job.t_start,
                            "enqueue_s": job.t_enqueued - job.t_started,
                            "start_to_finish_s": t1 - job.t_start,
                            **getattr(job, "timings", {})}
        if not link.multi:
            link.last_results = results
        return results

    def check(self, u, job, results):
        if job.check is None:
            return
        if not self.link.multi:
            job.check(results)
            return
        try:
            job.check(results)
        except WeightSyncError as e:
            self.gpu.abort_comm()   # the daemons' Abort drops their communicators
            _multi.fail_everywhere(self.link.group, u.update_id, None, e,
                                   "receipts do not match")

    def commit(self, u, job, results):
        """Several daemons: commit everywhere (the commits, one per
        daemon); one daemon: its Finish answer."""
        if self.link.multi:
            self.link.phase("prepared")
            results = _multi.commit(self.link.group, u.update_id)
            self.link.last_results = results
        self.gpu.last_timings["total_s"] = time.perf_counter() - job.t0
        return results if self.link.multi else results[0]

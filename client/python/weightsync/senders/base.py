"""The sender interface and the steps every sender shares (see
weightsync.senders for the contract a new transport implements).

`Update` is one call of Trainer.update; `Link` is what a Trainer lends its
senders (the daemons' stubs, deadlines, the registered-layout cache and
the last update's answers); `Job` is what a sender's describe() makes of
an update; `Sender.run` is the one sequence describe -> start -> send ->
finish -> receipts -> commit that every transport goes through.
"""

from weightsync import lazy as _lazy
from weightsync._errors import WeightSyncError
from weightsync._proto import v1
from weightsync.wire_fp8 import quantization_message

_MODES = {"streaming": v1.UPDATE_MODE_STREAMING, "staged": v1.UPDATE_MODE_STAGED}


class Update:
    """The arguments of one Trainer.update call. `pairs()` is the (name,
    tensor) list (a HostSource stays as it is); `lazy` says whether a
    LazyTensor is among them. Both are worked out on first use, so a
    sender's fast path that recognises the tensors costs nothing more."""

    def __init__(self, named_tensors, version, chunk_bytes, update_id, engine_ids, mode,
                 allow_streaming_fallback, verify, base_version):
        self.named_tensors = named_tensors
        self.version = version
        self.chunk_bytes = chunk_bytes
        self.update_id = update_id
        self.engine_ids = engine_ids
        self.mode = mode
        self.allow_streaming_fallback = allow_streaming_fallback
        self.verify = verify
        self.base_version = base_version
        self._lazy = None

    def pairs(self):
        """named_tensors as a list (made once), a HostSource as it is."""
        from weightsync.host_source import HostSource
        if not isinstance(self.named_tensors, (list, HostSource)):
            self.named_tensors = list(self.named_tensors)
        return self.named_tensors

    @property
    def lazy(self):
        if self._lazy is None:
            from weightsync.host_source import HostSource
            pairs = self.pairs()
            self._lazy = not isinstance(pairs, HostSource) and _lazy.is_lazy(pairs)
        return self._lazy

    def request(self, engine_ids=None, **fields):
        """The StartWeightUpdateRequest of this update with `fields`
        (engine_ids: another list than the update's)."""
        return start_request(self.update_id, self.version, self.chunk_bytes,
                             self.engine_ids if engine_ids is None else engine_ids, self.mode,
                             self.allow_streaming_fallback, self.verify, **fields)

    def one_call_request(self, source_id, finish_timeout_ms):
        """Start with finish of a streaming update from the registered
        source `source_id`, whose memory the daemon copies from; the daemon
        waits `finish_timeout_ms` for the copy (two thirds of our deadline,
        so that its answer arrives before we give up)."""
        return start_request(self.update_id, self.version, self.chunk_bytes, self.engine_ids,
                             "streaming", False, self.verify, source_id=source_id, finish=True,
                             finish_timeout_ms=finish_timeout_ms)


def start_request(update_id, version, chunk_bytes, engine_ids, mode, allow_streaming_fallback,
                  verify, **fields):
    """The StartWeightUpdateRequest fields every update sets, plus `fields`."""
    return v1.StartWeightUpdateRequest(
        update_id=update_id, target_version=version, chunk_bytes=chunk_bytes,
        engine_ids=list(engine_ids), mode=_MODES[mode],
        allow_streaming_fallback=allow_streaming_fallback,
        verify=v1.VERIFY_ON if verify else v1.VERIFY_OFF, **fields)


def specs(manifest):
    """TensorSpecs of manifest dicts ({name, dtype, shape[, sparse_nnz,
    sparse_index_bytes]})."""
    return [v1.TensorSpec(name=m["name"], dtype=getattr(v1, m["dtype"]), shape=m["shape"],
                          sparse_nnz=m.get("sparse_nnz", 0),
                          sparse_index_bytes=m.get("sparse_index_bytes", 0),
                          quantization=quantization_message(m.get("quantization")))
            for m in manifest]


def sent_of(manifest, data, sources=None):
    """{name: (dtype, shape, payload)} of the dense tensors (what receipts
    cover); a tensor quantised on the wire as `sources` ({name: (dtype,
    shape, payload)} of the tensors before quantisation) gives it: the
    receipts' expectation quantises it as the trainer did."""
    sources = sources or {}
    return {m["name"]: sources.get(m["name"]) or (m["dtype"], m["shape"], d)
            for m, d in zip(manifest, data) if not m.get("sparse_nnz")}


class Link:
    """A Trainer's daemons as its senders use them: `stubs` (the first is
    `stub`), `group` (weightsync._multi.Group of them), the unary deadline
    `timeout` and the stream deadline `stream_timeout`; the registered
    layouts seen so far (`layouts`, by layout id); and what the last update
    left: `last_results`, `last_starts`, `last_lazy`. Owned by one Trainer;
    thread-compatible like it."""

    def __init__(self, stubs, group, timeout, stream_timeout):
        self.stubs = list(stubs)
        self.stub = self.stubs[0]
        self.group = group
        self.timeout = timeout
        self.stream_timeout = stream_timeout
        self.layouts = {}
        self.last_results = []
        self.last_starts = []
        self.last_lazy = {}
        # Lazy updates on nccl: the most bytes of made tensors held before
        # waiting for sent ones (None: the largest run one chunk spans).
        self.lazy_budget_bytes = None
        # Tests only: called with "pushed" and "prepared" in an update of
        # several daemons.
        self.on_phase = None

    @property
    def multi(self):
        return len(self.stubs) > 1

    def world_sizes(self, backend=None):
        """[ranks of daemon i] for a group of `backend` ("host", "nccl",
        "ipc"; None: the group each daemon has now)."""
        b = {None: v1.BACKEND_UNSPECIFIED, "host": v1.BACKEND_HOST, "nccl": v1.BACKEND_NCCL,
             "ipc": v1.BACKEND_IPC}[backend]
        return self.each(lambda i, stub: stub.call("GetWorldSize", backend=b).world_size)

    def phase(self, name):
        if self.on_phase is not None:
            self.on_phase(name)

    def each(self, fn):
        """[fn(i, stub)] for every daemon, in parallel; the first error
        raised naming its daemon."""
        out = self.group.each(fn)
        for i, r in enumerate(out):
            if isinstance(r, WeightSyncError):
                raise WeightSyncError(r.code, f"{self.group.name(i)}: {r.message}")
        return out

    def finish(self, update_id):
        # The daemon waits two thirds of our deadline for the bytes, so its
        # answer (even an abort) arrives before we give up.
        return self.stub.call("FinishWeightUpdate", update_id=update_id,
                              timeout_ms=self.daemon_wait_ms())

    def daemon_wait_ms(self):
        """How long a daemon may wait for bytes or a copy inside one call:
        two thirds of our deadline, so that its answer arrives first."""
        return int(self.timeout * 1000 * 2 / 3)

    def abort_started(self, update_id, count, reason):
        """Aborts the update on the first `count` daemons; returns what
        failed, for the caller's message."""
        detail = ""
        for stub in self.stubs[:count]:
            try:
                stub.call("AbortWeightUpdate", update_id=update_id, reason=reason)
            except WeightSyncError as e:
                detail += f"; abort on a daemon: {e}"
        return detail

    def finish_after_failure(self, update_id, failure):
        """After the bytes failed to go: lets the daemon end the update (and
        say which engines are dirty) and raises its verdict, else
        `failure`."""
        try:
            self.finish(update_id)
        except WeightSyncError as finished:
            raise finished from failure
        raise failure

    def remember_layout(self, layout_id, layout):
        if layout_id:
            if len(self.layouts) > 64:
                self.layouts.clear()
            self.layouts[layout_id] = layout

    def layouts_of(self, stub, engine_results):
        """{engine id: registered layout} of the engines in `engine_results`:
        from the cache when the daemon's layout_id says the layout is one
        already fetched, else from GetStatus(include_layouts) (an engine
        registered again has a new layout_id)."""
        cached = {r.engine_id: self.layouts[r.layout_id] for r in engine_results
                  if r.layout_id and r.layout_id in self.layouts}
        if len(cached) == sum(1 for r in engine_results if not r.lost):
            return cached
        layouts = {}
        for e in stub.call("GetStatus", include_layouts=True).engines:
            layouts[e.engine_id] = e.layout
            self.remember_layout(e.layout_id, e.layout)
        return layouts

    def check_receipts(self, results, expected, keyed=False, stubs=None):
        """Compares every engine's receipt in `results` (one
        FinishWeightUpdateResponse or PrepareWeightUpdateResponse per
        daemon, in `stubs` order, default every daemon) with
        expected(layout) -> (checksum, parameters, bytes) for the layout
        the engine registered; raises DATA_LOSS naming the engine. Engines
        with one layout (replicas) are computed once. keyed: expected takes
        (layout, layout_id) and may keep work per layout id."""
        cache = {}
        for stub, finished in zip(stubs or self.stubs, results):
            if not any(r.HasField("receipt") for r in finished.engines):
                continue
            layouts = self.layouts_of(stub, finished.engines)
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

    def engine_layouts(self, engine_ids=()):
        """([{engine id: (layout id, key)} per daemon], {key: layout}) of
        the engines an update of `engine_ids` (empty: every engine) may
        write, as registered now: ids from GetStatus, the layouts from the
        cache or, for one not seen yet, GetStatus(include_layouts)."""
        try:
            return _lazy.engines_and_layouts(
                self.each(lambda i, stub: stub.call("GetStatus", include_layouts=False)),
                engine_ids, self.layouts)
        except KeyError:
            statuses = self.each(lambda i, stub: stub.call("GetStatus", include_layouts=True))
            for status in statuses:
                for e in status.engines:
                    self.remember_layout(e.layout_id, list(e.layout))
            return _lazy.engines_and_layouts(statuses, engine_ids)

    def lazy_receipts(self, engine_ids, manifest, compute):
        """(engines, weightsync.lazy.ProgressiveReceipts) for an update with
        LazyTensors: the layouts of the engines it may write, as registered
        now (engine_layouts)."""
        engines, layouts = self.engine_layouts(engine_ids)
        return engines, _lazy.ProgressiveReceipts(layouts, manifest, compute)

    def check_lazy_receipts(self, results, engines, progress, stubs=None):
        stubs = stubs or self.stubs
        names = [self.group.name(self.stubs.index(s)) for s in stubs]
        _lazy.check_receipts(results, engines, progress.expected, names)


class Job:
    """What a sender's describe() makes of one update, for the shared steps:

    request   the StartWeightUpdateRequest (a list: one per daemon of
              `group`, a sub-group of the Trainer's daemons)
    retry     None, or a function called once when Start answers NOT_FOUND
              (a new group or an evicted registered source): it registers
              again and returns the request to start with
    one_call  Start carries finish=True: its answer holds the result and
              there is nothing to send or finish
    check     None, or check(results): the receipts (raises DATA_LOSS)

    A sender adds any field of its own (manifest, payloads, buffers)."""

    def __init__(self, request, retry=None, one_call=False, check=None, group=None, **fields):
        self.request = request
        self.retry = retry
        self.one_call = one_call
        self.check = check
        self.group = group
        self.__dict__.update(fields)


class Sender:
    """One transport. A subclass supplies describe() and, where it moves
    bytes itself, send(); the other steps have shared defaults that a
    transport overrides only where it differs (several daemons prepare and
    commit; NCCL waits for its broadcasts). Thread-compatible: one update
    at a time, like the Trainer that owns it."""

    backend = "host"

    def __init__(self, link):
        self.link = link

    # -- the interface --------------------------------------------------------

    def update(self, u):
        """Sends Update `u`; returns the FinishWeightUpdateResponse (a list,
        one per daemon, for several daemons)."""
        if u.lazy:
            return self.run(u, self.describe_lazy(u))
        return self.run(u, self.describe(u))

    def describe(self, u):
        """The Job of update `u`: its manifest or registered source, the
        Start request, the receipts' expectation."""
        raise NotImplementedError

    def describe_lazy(self, u):
        """The Job of an update with LazyTensors among its tensors."""
        raise ValueError(f"LazyTensors are not sent by the {type(self).__name__}")

    def send(self, u, job, started):
        """Moves the bytes after Start answered (`started`: one answer per
        daemon). Default: nothing (the daemon copies from a registered
        source, or the Start request carried them)."""

    def close(self):
        """Releases what the sender holds (communicators, buffers)."""

    # -- the shared steps -----------------------------------------------------

    def run(self, u, job):
        """describe (done) -> start -> send -> finish -> receipts -> commit."""
        started = self.start(u, job)
        self.send(u, job, started)
        results = self.finish(u, job, started)
        self.check(u, job, results)
        return self.commit(u, job, results)

    def start(self, u, job):
        """StartWeightUpdate on the daemon (registering again once if the
        source it names is gone); returns [its answer]."""
        for attempt in (0, 1):
            try:
                return [self.link.stub.call("StartWeightUpdate", job.request)]
            except WeightSyncError as e:
                if e.code != "NOT_FOUND" or attempt or job.retry is None:
                    raise
                job.request = job.retry()
                if job.request is None:
                    raise

    def finish(self, u, job, started):
        """FinishWeightUpdate (the one-call Start's answer already is it);
        returns [the answer]."""
        if job.one_call:
            results = [started[0].finished]
        else:
            results = [self.link.finish(u.update_id)]
        self.link.last_results = results
        return results

    def check(self, u, job, results):
        if job.check is not None:
            job.check(results)

    def commit(self, u, job, results):
        """The update's answer: the one daemon's, or every daemon's list."""
        return results[0]

    # -- helpers for senders --------------------------------------------------

    def receipts(self, expected, keyed=True, stubs=None):
        """A Job.check comparing the daemons' receipts with `expected`."""
        return lambda results: self.link.check_receipts(results, expected, keyed=keyed,
                                                        stubs=stubs)


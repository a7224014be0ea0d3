"""Host backend, several daemons (issue 20): one manifest, each daemon sent
only the bytes of the tensors its engines use, the daemons' streams pushed
in parallel, then prepare, receipts and commit on all (weightsync._multi
has the protocol). A HostSource's memory works too: each daemon copies its
share from the same shared memory.
"""

from weightsync import _multi, planner
from weightsync._errors import WeightSyncError
from weightsync._proto import v1
from weightsync.senders.base import Job, Sender, sent_of, specs
from weightsync.senders.host_source import register_host_memory
from weightsync.senders.host_stream import describe_host, expect_host, wire_sources


def engines_by_daemon(link, engine_ids):
    """{daemon index: [its engine ids]} for an update of `engine_ids` (all
    daemons, None each, when empty). NOT_FOUND for an id no daemon has."""
    if not engine_ids:
        return {i: None for i in range(len(link.stubs))}
    where = {}
    for i, st in enumerate(link.each(lambda i, stub: stub.call("GetStatus"))):
        for e in st.engines:
            where.setdefault(e.engine_id, i)
    out = {}
    for e in dict.fromkeys(engine_ids):
        if e not in where:
            raise WeightSyncError("NOT_FOUND", f"engine '{e}' is registered with none of the "
                                  f"{len(link.stubs)} daemons")
        out.setdefault(where[e], []).append(e)
    return out


def per_daemon(base, selected, source_ids=None):
    """One StartWeightUpdateRequest per selected daemon: `base` with that
    daemon's engine ids (and registered source)."""
    out = []
    for i, ids in selected.items():
        r = v1.StartWeightUpdateRequest()
        r.CopyFrom(base)
        if ids is not None:
            del r.engine_ids[:]
            r.engine_ids.extend(ids)
        if source_ids is not None:
            r.source_id = source_ids[i]
        out.append(r)
    return out


class MultiHostSender(Sender):
    """Host updates of several daemons (module docstring). `host_sources`:
    the HostSourceSender whose sources an update may name."""

    def __init__(self, link, host_sources):
        super().__init__(link)
        self._host_sources = host_sources

    def describe_lazy(self, u):
        raise ValueError("LazyTensors on the host backend go to one daemon; with several "
                         "daemons (each sent only what its engines use, from its own "
                         "thread) make the tensors first, or use the nccl backend")

    def describe(self, u):
        selected = engines_by_daemon(self.link, u.engine_ids)
        group = self.link.group.sub(list(selected))
        stubs = group.stubs
        if self._host_sources.takes(u):
            return self._describe_memory(u, selected, group)
        data, manifest = describe_host(u.pairs())
        base = u.request((), sparse_base_version=u.base_version, tensors=specs(manifest))
        sent = sent_of(manifest, data, wire_sources(u.pairs()))
        return Job(per_daemon(base, selected), group=group, manifest=manifest, payloads=data,
                   names=[m["name"] for m in manifest],
                   check=self.receipts(expect_host(sent), stubs=stubs) if u.verify else None)

    def _describe_memory(self, u, selected, group):
        """A streaming update of a HostSource: each daemon copies the
        tensors its engines use straight from the trainer's shared memory."""
        source = u.source
        if source.manifest is None:
            raise ValueError(f"{source!r} is closed")
        base = u.request((), sparse_base_version=u.base_version)

        def requests():
            for i in selected:
                if source.source_ids.get(i) is None:
                    source.source_ids[i] = register_host_memory(self.link.stubs[i], source)
                    if i == 0:
                        source.source_id = source.source_ids[i]
            return per_daemon(base, selected, source.source_ids)

        def retry():   # a new group (Init) or an evicted source: register again, once
            source.source_ids = {}
            return requests()

        return Job(requests(), retry=retry, group=group, manifest=None,
                   names=list(source.names),
                   check=self.receipts(lambda layout, key: expect_host(source.sent())(
                       layout, key), stubs=group.stubs) if u.verify else None)

    def start(self, u, job):
        """Plan everywhere (a tensor no daemon uses is refused before any
        daemon pauses), then Start everywhere."""
        for attempt in (0, 1):
            try:
                _multi.plan(job.group, job.request, job.names)
                break
            except WeightSyncError as e:
                if e.code != "NOT_FOUND" or attempt or job.retry is None:
                    raise
                job.request = job.retry()
        started = _multi.start(job.group, job.request, job.names)
        self.link.last_starts = started
        return started

    def send(self, u, job, started):
        """Streams daemon i the chunks it asked for (started[i]) in parallel
        threads; aborts everywhere on a failure."""
        if job.manifest is None:
            return   # the daemons copy from the HostSource
        manifest, data = job.manifest, job.payloads

        def push(i, stub):
            s = started[i]
            unused = set(s.unused_tensors) if s.stream_omits_unused else ()
            keep = [k for k, m in enumerate(manifest) if m["name"] not in unused]
            sub = [manifest[k] for k in keep]
            payloads = [data[k] for k in keep]
            plan = planner.plan_chunks(sub, s.chunk_bytes)
            if plan["total_bytes"] != s.total_bytes or len(plan["chunks"]) != s.num_chunks:
                raise WeightSyncError(
                    "INTERNAL", f"the daemon plans {s.total_bytes} bytes in {s.num_chunks} "
                    f"chunks, this client {plan['total_bytes']} in {len(plan['chunks'])}")
            if not plan["chunks"]:
                return 0   # none of its engines uses a tensor of this update

            def chunks():
                for c in plan["chunks"]:
                    yield v1.PushChunksRequest(update_id=u.update_id, chunk_index=c["index"],
                                               data=planner.pack_chunk(c, payloads))
            stub.call("PushChunks", chunks(), timeout=self.link.stream_timeout)
            return plan["total_bytes"]

        for i, r in enumerate(job.group.each(push)):
            if isinstance(r, WeightSyncError):
                _multi.fail_everywhere(job.group, u.update_id, i, r, "sending failed")

    def finish(self, u, job, started):
        self.link.phase("pushed")
        return _multi.prepare(job.group, u.update_id, self.link.daemon_wait_ms())

    def check(self, u, job, results):
        if job.check is None:
            return
        try:
            job.check(results)
        except WeightSyncError as e:
            _multi.fail_everywhere(job.group, u.update_id, None, e, "receipts do not match")

    def commit(self, u, job, results):
        self.link.phase("prepared")
        committed = _multi.commit(job.group, u.update_id)
        self.link.last_results = committed
        return committed

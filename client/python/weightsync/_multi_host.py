"""A host-backend update of several daemons (issue 20): one manifest, each
daemon sent only the bytes of the tensors its engines use, the daemons'
streams pushed in parallel, then prepare, receipts and commit on all
(weightsync._multi has the protocol). Trainer.update calls this when the
Trainer has several targets; Trainer.host_tensors memory works too (each
daemon copies its share from the same shared memory)."""

from weightsync import _multi, planner
from weightsync._errors import WeightSyncError
from weightsync._proto import v1


def engines_by_daemon(trainer, engine_ids):
    """{daemon index: [its engine ids]} for an update of `engine_ids` (all
    daemons, None each, when empty). NOT_FOUND for an id no daemon has."""
    if not engine_ids:
        return {i: None for i in range(len(trainer._stubs))}
    where = {}
    for i, st in enumerate(trainer.statuses()):
        for e in st.engines:
            where.setdefault(e.engine_id, i)
    out = {}
    for e in dict.fromkeys(engine_ids):
        if e not in where:
            raise WeightSyncError("NOT_FOUND", f"engine '{e}' is registered with none of the "
                                  f"{len(trainer._stubs)} daemons")
        out.setdefault(where[e], []).append(e)
    return out


def _requests(base, selected, source_ids=None):
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


def _push(trainer, group, update_id, started, manifest, data):
    """Streams daemon i the chunks it asked for (started[i]) in parallel
    threads; aborts everywhere on a failure."""
    def push(i, stub):
        s = started[i]
        unused = set(s.unused_tensors) if s.stream_omits_unused else ()
        keep = [k for k, m in enumerate(manifest) if m["name"] not in unused]
        sub = [manifest[k] for k in keep]
        payloads = [data[k] for k in keep]
        plan = planner.plan_chunks(sub, s.chunk_bytes)
        if plan["total_bytes"] != s.total_bytes or len(plan["chunks"]) != s.num_chunks:
            raise WeightSyncError(
                "INTERNAL", f"the daemon plans {s.total_bytes} bytes in {s.num_chunks} chunks, "
                f"this client {plan['total_bytes']} in {len(plan['chunks'])}")
        if not plan["chunks"]:
            return 0   # none of its engines uses a tensor of this update

        def chunks():
            for c in plan["chunks"]:
                yield v1.PushChunksRequest(update_id=update_id, chunk_index=c["index"],
                                           data=planner.pack_chunk(c, payloads))
        stub.call("PushChunks", chunks(), timeout=trainer._stream_timeout)
        return plan["total_bytes"]

    sent = group.each(push)
    for i, r in enumerate(sent):
        if isinstance(r, WeightSyncError):
            _multi.fail_everywhere(group, update_id, i, r, "sending failed")
    return sent


def _finish(trainer, group, update_id, expected):
    """Prepare everywhere, check the receipts against `expected(layout,
    key)` (None: not verified), commit everywhere; returns the commits."""
    hook = trainer._on_phase or (lambda phase: None)
    hook("pushed")
    prepared = _multi.prepare(group, update_id, int(trainer._timeout * 1000 * 2 / 3))
    if expected is not None:
        try:
            trainer._check_receipts(prepared, expected, keyed=True, stubs=group.stubs)
        except WeightSyncError as e:
            _multi.fail_everywhere(group, update_id, None, e, "receipts do not match")
    hook("prepared")
    committed = _multi.commit(group, update_id)
    trainer.last_results = committed
    return committed


def update(trainer, named_tensors, version, chunk_bytes, update_id, engine_ids, mode,
           allow_streaming_fallback, verify, base_version):
    """Trainer.update on the host backend with several daemons."""
    from weightsync.host_source import HostSource
    from weightsync.trainer import _describe_host, _sent, _specs, _start_request
    selected = engines_by_daemon(trainer, engine_ids)
    group = trainer._group.sub(list(selected))
    source = named_tensors if isinstance(named_tensors, HostSource) else None
    if source is None:
        named_tensors = list(named_tensors)
        source = next((s for s in trainer._host_sources if s.same_pairs(named_tensors)), None)
    elif mode != "streaming":
        named_tensors = list(zip(source.names, source.tensors))
    base = _start_request(update_id, version, chunk_bytes, (), mode, allow_streaming_fallback,
                          verify, sparse_base_version=base_version)
    if source is not None and mode == "streaming":
        return _update_from_memory(trainer, group, selected, source, base, verify)
    data, manifest = _describe_host(named_tensors)
    base.tensors.extend(_specs(manifest))
    names = [m["name"] for m in manifest]
    requests = _requests(base, selected)
    _multi.plan(group, requests, names)
    started = _multi.start(group, requests, names)
    trainer.last_starts = started
    _push(trainer, group, update_id, started, manifest, data)
    expected = None
    if verify:
        from weightsync.receipts import expected_receipt
        sent = _sent(manifest, data)
        expected = lambda layout, key: expected_receipt(layout, sent, layout_key=key)  # noqa: E731
    return _finish(trainer, group, update_id, expected)


def _update_from_memory(trainer, group, selected, source, base, verify):
    """Streaming update of a HostSource: each daemon copies the tensors its
    engines use straight from the trainer's shared memory."""
    if source.manifest is None:
        raise ValueError(f"{source!r} is closed")
    names = list(source.names)
    for attempt in (0, 1):
        for i in selected:
            if source.source_ids.get(i) is None:
                source.source_ids[i] = trainer._register_host_memory(source, trainer._stubs[i])
        requests = _requests(base, selected, source.source_ids)
        try:
            _multi.plan(group, requests, names)
            break
        except WeightSyncError as e:
            # A new group (Init) or an evicted source: register again, once.
            if "NOT_FOUND" not in (e.code,) or attempt:
                raise
            source.source_ids = {}
    started = _multi.start(group, requests, names)
    trainer.last_starts = started
    expected = None
    if verify:
        from weightsync.receipts import expected_receipt
        expected = lambda layout, key: expected_receipt(  # noqa: E731
            layout, source.sent(), layout_key=key)
    return _finish(trainer, group, base.update_id, expected)

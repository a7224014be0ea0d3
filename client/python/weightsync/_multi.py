"""Several daemons, one update: the trainer's side of the commit protocol
(issue 20; docs/protocol.md, "Several daemons").

Every backend runs the same steps around its own way of moving bytes:

1. plan: Start(plan_only, skip_unused) on every daemon, in parallel. A
   tensor that no daemon uses is refused here (INVALID_ARGUMENT naming
   it), before any daemon pauses an engine or receives a byte.
2. start: Start(skip_unused) on every daemon; each answers what it does
   not use and the stream it expects (stream_omits_unused: the used
   tensors only). A failure aborts the daemons that started.
3. the bytes (the caller: one PushChunks stream per daemon on the host
   backend, NCCL broadcasts to all).
4. prepare: PrepareWeightUpdate on every daemon; every byte is then in
   engine memory and each daemon's receipts are read. The caller checks
   the receipts. Any failure (or a receipt mismatch) aborts the update on
   every daemon: nothing is committed anywhere.
5. commit: CommitWeightUpdate on every daemon. Once one daemon committed,
   the update can't be taken back: a daemon that fails to commit keeps its
   engines paused (prepared, or DIRTY once it ends), never serving the old
   weights beside the new; the error names the daemons of each kind.

Calls to the daemons run in parallel threads (gRPC releases the GIL).
"""

import concurrent.futures
import threading

from weightsync._errors import WeightSyncError

_pool = None
_pool_lock = threading.Lock()


def _executor():
    """One thread pool for every Group of the process (idle threads cost
    nothing; a Group is made per Trainer and per partial update)."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = concurrent.futures.ThreadPoolExecutor(
                max_workers=32, thread_name_prefix="weightsync-daemon")
        return _pool


class Group:
    """The daemons of one Trainer: `stubs` and their `targets`, in order."""

    def __init__(self, stubs, targets):
        self.stubs = list(stubs)
        self.targets = list(targets)

    def sub(self, indices):
        """The daemons `indices` as a Group of their own."""
        return Group([self.stubs[i] for i in indices], [self.targets[i] for i in indices])

    def each(self, fn, indices=None):
        """[fn(i, stub) or the WeightSyncError it raised] for daemon i in
        `indices` (default all), run in parallel."""
        indices = range(len(self.stubs)) if indices is None else list(indices)

        def run(i):
            try:
                return fn(i, self.stubs[i])
            except WeightSyncError as e:
                return e
        return list(_executor().map(run, indices))

    def name(self, i):
        return f"daemon {i} ({self.targets[i]})"


def _first_error(group, results, indices=None):
    """(daemon index, error) of the first failed call, or (None, None)."""
    indices = range(len(results)) if indices is None else list(indices)
    for i, r in zip(indices, results):
        if isinstance(r, WeightSyncError):
            return i, r
    return None, None


def unused_everywhere(group, started, names):
    """The tensors of `names` that every daemon's Start answer lists as
    unused, in manifest order."""
    unused = None
    for s in started:
        u = set(s.unused_tensors)
        unused = u if unused is None else unused & u
    return [n for n in names if n in (unused or ())]


def refuse_unused(group, started, names):
    """INVALID_ARGUMENT naming the tensors no daemon uses, if any."""
    nowhere = unused_everywhere(group, started, names)
    if nowhere:
        shown = ", ".join(f"'{n}'" for n in nowhere[:8])
        more = f" and {len(nowhere) - 8} more" if len(nowhere) > 8 else ""
        raise WeightSyncError(
            "INVALID_ARGUMENT",
            f"tensor(s) {shown}{more} are not a parameter or segment source of any engine "
            f"on any of the {len(group.stubs)} daemons ({', '.join(group.targets)}); "
            "nothing was sent")


def _copy(request, **fields):
    out = type(request)()
    out.CopyFrom(request)
    for k, v in fields.items():
        setattr(out, k, v)
    return out


def plan(group, requests, names):
    """Step 1: plan_only Start on every daemon (requests[i] to daemon i);
    refuses a tensor no daemon uses."""
    dry = [_copy(r, plan_only=True, skip_unused=True) for r in requests]
    results = group.each(lambda i, stub: stub.call("StartWeightUpdate", dry[i]))
    i, err = _first_error(group, results)
    if err is not None:
        raise WeightSyncError(err.code, f"{group.name(i)}: {err.message}")
    refuse_unused(group, results, names)
    return results


def start(group, requests, names):
    """Step 2: Start on every daemon; returns their answers. On a failure
    the daemons that started are aborted (their engines untouched: no
    byte moved yet) and the first error is raised, naming its daemon."""
    update_id = requests[0].update_id
    requests = [_copy(r, skip_unused=True) for r in requests]
    results = group.each(lambda i, stub: stub.call("StartWeightUpdate", requests[i]))
    i, err = _first_error(group, results)
    started = [j for j, r in enumerate(results) if not isinstance(r, WeightSyncError)]
    if err is not None:
        abort(group, update_id, f"Start failed on {group.name(i)}", started)
        raise WeightSyncError(err.code, f"{group.name(i)}: {err.message}")
    try:
        # Engines may have registered since step 1: check again.
        refuse_unused(group, results, names)
    except WeightSyncError:
        abort(group, update_id, "a tensor no daemon uses", started)
        raise
    return results


def abort(group, update_id, reason, indices=None):
    """AbortWeightUpdate on the daemons `indices` (default all); an update
    already ended there (FAILED_PRECONDITION) or a daemon gone is fine.
    Returns the abort answers (or errors)."""
    return group.each(lambda i, stub: stub.call("AbortWeightUpdate", update_id=update_id,
                                                reason=reason[:1000]), indices)


def _dirty(result):
    from weightsync._proto import v1
    if isinstance(result, WeightSyncError):
        return []
    return [e.engine_id for e in result.engines if e.state == v1.ENGINE_DIRTY]


def fail_everywhere(group, update_id, i, err, what):
    """Aborts the update on every daemon after `err` on daemon `i` (None:
    the trainer's own failure) and raises a WeightSyncError with err's
    code naming the daemon and the engines left dirty."""
    aborted = abort(group, update_id, f"{what}: {err.message if err else ''}")
    dirty = [e for r in aborted for e in _dirty(r)]
    where = group.name(i) + ": " if i is not None else ""
    raise WeightSyncError(
        err.code if err is not None else "ABORTED",
        f"update '{update_id}': {what}: {where}{err.message if err else ''}; aborted on every "
        f"daemon, committed nowhere" +
        (f"; engines left DIRTY (paused until a dense update): {', '.join(dirty)}"
         if dirty else "; engines untouched"))


def prepare(group, update_id, timeout_ms):
    """Step 4: PrepareWeightUpdate everywhere; returns the answers. Any
    failure aborts the update on every daemon and raises."""
    results = group.each(lambda i, stub: stub.call("PrepareWeightUpdate", update_id=update_id,
                                                   timeout_ms=timeout_ms))
    i, err = _first_error(group, results)
    if err is not None:
        fail_everywhere(group, update_id, i, err, "prepare failed")
    return results


def commit(group, update_id):
    """Step 5: CommitWeightUpdate everywhere; returns the answers. If any
    daemon did not commit, raises ABORTED naming the daemons that did and
    the ones whose engines stay paused (prepared, DIRTY once it ends)."""
    results = group.each(lambda i, stub: stub.call("CommitWeightUpdate", update_id=update_id))
    failed = [(i, r) for i, r in enumerate(results) if isinstance(r, WeightSyncError)]
    if not failed:
        return results
    done = [group.name(i) for i, r in enumerate(results) if not isinstance(r, WeightSyncError)]
    raise WeightSyncError(
        "ABORTED",
        f"update '{update_id}' committed on {', '.join(done) or 'no daemon'} but not on " +
        "; ".join(f"{group.name(i)} ({e.code}: {e.message})" for i, e in failed) +
        ": the engines there stay paused (DIRTY once the update ends) and never serve the "
        "old weights beside the new; a dense update at a higher version repairs them "
        "(Trainer.finish_prepared() commits daemons still prepared)")


def finish_prepared(group, statuses):
    """Ends updates left prepared by a trainer that died between prepare and
    commit. `statuses`: GetStatus of every daemon. An update committed on at
    least one daemon is committed on the daemons where it is still
    prepared; one committed nowhere is aborted (its engines DIRTY until a
    dense update). Returns {update_id: "committed" | "aborted"}."""
    prepared, committed = {}, set()
    for i, st in enumerate(statuses):
        u = st.update
        if u.phase == "prepared":
            prepared.setdefault(u.update_id, []).append(i)
        elif u.phase == "committed":
            committed.add(u.update_id)
    out = {}
    for update_id, indices in prepared.items():
        if update_id in committed:
            results = group.each(lambda i, stub: stub.call("CommitWeightUpdate",
                                                           update_id=update_id), indices)
            j, err = _first_error(group, results, indices)
            if err is not None:
                raise WeightSyncError(err.code, f"{group.name(j)}: {err.message}")
            out[update_id] = "committed"
        else:
            abort(group, update_id, "finish_prepared: committed on no daemon", indices)
            out[update_id] = "aborted"
    return out

"""Every trainer rank sends its own share (issue 32): the M -> N sender of
the host backend, on a transfer plan made once (weightsync.transfer_plan,
docs/transfer_plan.md).

Each rank of a training job calls `ManySenders.update` with the same
version; each sends only what the plan gives it, straight to the daemons
that need it, all ranks at once. Rank 0 (the leader) also drives the
daemons: registers the plan, starts the update, and after every rank sent
its links, prepares and commits on every daemon (docs/protocol.md, "Several
daemons"), or aborts everywhere when any rank failed.

    from weightsync.senders.many import shard_of
    # trainer: a Trainer of every daemon; rank 0 called init_host()
    # what this rank holds: (block, array whose row-major bytes are the block)
    local = [shard_of(name, global_shape, dim=0, index=rank, count=world, array=shard)
             for name, global_shape, shard in my_shards]
    trainer.update_sharded(manifest, local, version)   # on every rank

The ranks agree through a `collective` (rank, world_size, all_gather(obj),
broadcast(obj)): TorchCollective wraps torch.distributed; any object with
the same four members works (tests use files). Objects exchanged are plain
lists, dicts and strings.

On the nccl backend (Trainer.init_nccl(collective=...) on every rank) the
bytes go point to point over one NCCL group of every trainer rank and every
daemon (weightsync.senders.many_nccl); on the host backend, one PushChunks
stream per (rank, daemon) link.

This is the M -> N sender of weightsync.senders. Its update is not the
shared one-rank sequence of base.Sender (describe, start, send, finish,
commit): the ranks meet between the steps, so ManySenders runs the same
steps itself, on the Trainer's Link (Trainer.update_sharded forwards here).
"""

import time
import uuid

from weightsync import _multi, planner, transfer_plan
from weightsync._errors import WeightSyncError
from weightsync._proto import v1
from weightsync._tensors import describe
from weightsync.senders import many_sparse, many_wire
from weightsync.senders.many_receipts import (add_partials, exchanged_fp8_partials,
                                              has_fp8_targets, partial_receipts)

__all__ = ["ManySenders", "TorchCollective", "shard_of", "needs_of_status"]


class TorchCollective:
    """torch.distributed as a collective (the default process group, or
    `group`)."""

    def __init__(self, group=None):
        import torch.distributed as dist
        self._dist, self._group = dist, group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)

    def all_gather(self, obj):
        out = [None] * self.world_size
        self._dist.all_gather_object(out, obj, group=self._group)
        return out

    def broadcast(self, obj, src=0):
        box = [obj]
        self._dist.broadcast_object_list(box, src=src, group=self._group)
        return box[0]


def shard_of(name, shape, dim, index, count, array):
    """(block, array) of shard `index` of `count` along `dim` (DTensor's
    Shard(dim), torch.chunk cut), or None for an empty shard."""
    b = transfer_plan.shard(name, shape, dim, index, count)
    return None if b is None else (b, array)


def needs_of_status(status, engine_ids=None):
    """The blocks the engines of one daemon use (a GetStatusResponse with
    layouts): every segment's source rectangle; a parameter registered
    without segments is its whole tensor. FP8 scale parameters feed
    nothing."""
    out = []
    for e in status.engines:
        if engine_ids is not None and e.engine_id not in engine_ids:
            continue
        quant_scales = {p.quantization.scale_parameter for p in e.layout
                        if p.HasField("quantization")}
        for p in e.layout:
            if p.name in quant_scales:
                continue
            if not p.segments:
                out.append(transfer_plan.whole(p.name, list(p.shape)))
                continue
            for s in p.segments:
                out.append(transfer_plan.block(s.source, s.row_begin, s.row_count,
                                               s.col_begin, s.col_count))
    return out


def _field(t, key):
    return t[key] if isinstance(t, dict) else getattr(t, key)


def _piece_bytes(piece, held):
    """The row-major bytes of `piece` out of the held block containing it."""
    for b, rows in held:
        if (b["row_begin"] <= piece.row_begin and
                piece.row_begin + piece.row_count <= b["row_begin"] + b["row_count"] and
                b["col_begin"] <= piece.col_begin and
                piece.col_begin + piece.col_count <= b["col_begin"] + b["col_count"]):
            es = rows.shape[1] // b["col_count"] if b["col_count"] else 0
            r0 = piece.row_begin - b["row_begin"]
            c0 = (piece.col_begin - b["col_begin"]) * es
            return rows[r0:r0 + piece.row_count, c0:c0 + piece.col_count * es].tobytes()
    raise WeightSyncError("INTERNAL", f"the plan gives this rank {piece} it does not hold")


def _link_payloads(plan, rank, local, daemons):
    """{daemon: [the row-major bytes of each piece of rank `rank`'s link to
    it]} out of the blocks it holds, `local`."""
    held = {}
    for b, array in local:
        _, _, raw = describe(b["tensor"], array)
        rows = raw.reshape(b["row_count"], -1) if b["row_count"] else raw.reshape(0, 0)
        held.setdefault(b["tensor"], []).append((b, rows))
    names = plan.tensor_names
    out = {}
    for i in range(daemons):
        pieces = plan.link_pieces(rank, i)
        if pieces:
            out[i] = [_piece_bytes(p, held.get(names[p.tensor], ())) for p in pieces]
    return out


class ManySenders:
    """One rank's side of updates of many senders. Not thread-safe; one
    object per rank, every rank calling `update` in step."""

    def __init__(self, link, collective, engine_ids=None, nccl=None, basis_bytes=0,
                 fp8_on_wire=False):
        self._link = link
        # FP8 on the wire (many_wire): asked for, and the tensors the ranks
        # agreed to send quantised on the current plan.
        self.fp8_on_wire, self.wire = fp8_on_wire, {}
        # What this rank sent last, for sparse patches against it
        # (update(base_version=...)): at most basis_bytes (None: no bound;
        # 0: nothing kept, every update dense).
        self._basis = many_sparse.Basis(basis_bytes) if basis_bytes != 0 else None
        self._coll = collective
        self._engine_ids = engine_ids
        # The nccl backend's wire (weightsync.senders.many_nccl.NcclLinks),
        # None on the host backend (one PushChunks stream per link).
        self.nccl = nccl
        self._plan = None
        self._plan_key = None
        self.last_plan = None
        # Tests only: called with (daemon index, chunk index) before each
        # chunk this rank sends.
        self._on_chunk = None
        self.last_checked = []   # leader: engines whose receipts it checked
        # Seconds of each phase of the last update on this rank (plan_start:
        # the plan check and the leader's Start until every rank has its
        # answer; push: the sends enqueued and the partial receipts;
        # gather: every rank's outcome; finish: the leader's prepare, receipt
        # check and commit until every rank has the result; wait: this
        # rank's sends done). The leader also has start_s, prepare_s and
        # commit_s, its calls to the daemons.
        self.last_timings = {}
        self._sent = {}   # {daemon: [piece bytes]} this rank sent in its last push
        self.last_wire = {}

    @property
    def rank(self):
        return self._coll.rank

    def _receivers(self):
        """Leader: one receiver per daemon, what its engines use, and the
        key of the engines' layouts (a re-registration changes it)."""
        out, key = [], []
        ids = None if self._engine_ids is None else set(self._engine_ids)
        for i, st in enumerate(self._statuses(include_layouts=True)):
            out.append({"name": self._link.group.name(i),
                        "needs": needs_of_status(st, ids)})
            key.append(sorted(e.layout_id for e in st.engines
                              if ids is None or e.engine_id in ids))
        return out, key

    def _layout_key(self):
        """Leader: the key _receivers returns, from statuses without the
        layouts (cheap: checked every update)."""
        ids = None if self._engine_ids is None else set(self._engine_ids)
        return [sorted(e.layout_id for e in st.engines if ids is None or e.engine_id in ids)
                for st in self._statuses()]

    def _statuses(self, **request):
        """Every daemon's GetStatus, asked side by side (one round
        trip an update, not one a daemon after another); raises the first
        daemon's failure."""
        if not self._link.multi:
            return [self._link.stub.call("GetStatus", **request)]
        out = self._link.group.each(lambda i, stub: stub.call("GetStatus", **request))
        for r in out:
            if isinstance(r, WeightSyncError):
                raise r
        return out

    def _agreed(self, call):
        """The leader's `call()` on every rank ({"error": [code, message]}
        of its WeightSyncError raises on every rank)."""
        answer = None
        if self.rank == 0:
            try:
                answer = call()
            except WeightSyncError as e:
                answer = {"error": [e.code, e.message]}
        answer = self._coll.broadcast(answer)
        if "error" in answer:
            raise WeightSyncError(*answer["error"])
        return answer

    def plan(self, manifest, local):
        """The transfer plan of (every rank's `local` blocks, the daemons'
        engines), made on every rank from the same spec and registered
        with every daemon by the leader; reused while neither side
        changes (checked by one exchange of each rank's fingerprint of
        what it holds and the engines' layout ids). A refusal
        (TransferPlanError naming tensor and ranks) raises on every rank
        before anything pauses."""
        return self._plan_and_start(manifest, local, None, [])[0]

    def _patches(self, local, base_version, max_density):
        """({daemon: [piece bytes]}, {daemon: {piece: SparsePatch}}) of this
        rank's links on the current plan against its basis of base_version
        (host backend); (None, {}) without one."""
        basis, plan = self._basis, self._plan
        if base_version is None or basis is None or plan is None or self.nccl is not None \
                or basis.version != base_version or basis.plan_id != plan.id:
            return None, {}
        payloads = _link_payloads(plan, self.rank, local, len(self._link.stubs))
        return payloads, basis.link_patches(plan, self.rank, base_version, payloads, max_density,
                                            self._fp8_fed)

    def _plan_and_start(self, manifest, local, start, entries):
        """(plan, Start answer or None, whether the plan was reused).
        `start(plan, entries)`: the leader's Start (a dict, {"error": ...}
        on failure) with every rank's sparse `entries` (patch_entries, of
        the current plan: used only where it is reused); with the plan
        unchanged the leader starts in the same exchange that tells every
        rank so (one round of the collective fewer per update)."""
        holds = [b for b, _ in local]
        # Each rank's own hash (compared only with what the same ranks
        # gathered before: every rank decides alike).
        fingerprint = hash((tuple((_field(t, "name"), str(_field(t, "dtype")),
                                   tuple(_field(t, "shape"))) for t in manifest),
                            tuple(tuple(sorted(b.items())) for b in holds)))
        gathered = self._coll.all_gather([fingerprint, entries])
        fingerprints = tuple(g[0] for g in gathered)
        every_entry = [e for g in gathered for e in g[1]]

        def check():
            layout_key = self._layout_key()
            answer = {"layout_key": layout_key}
            if start is not None and (fingerprints, repr(layout_key)) == self._plan_key:
                answer["started"] = start(self._plan, every_entry)
            return answer
        answer = self._agreed(check)
        key = (fingerprints, repr(answer["layout_key"]))
        if "started" in answer:
            if key != self._plan_key:   # every rank has the leader's history
                raise WeightSyncError("INTERNAL", f"rank {self.rank}: the plan the leader "
                                      "reuses is not this rank's")
            return self._plan, answer["started"], True
        reused = key == self._plan_key
        if not reused:
            self._replan(manifest, holds, key)
        started = None
        if start is not None:
            started = self._coll.broadcast(
                start(self._plan, every_entry if reused else []) if self.rank == 0 else None)
        return self._plan, started, reused

    def _replan(self, manifest, holds, key):
        spec_parts = self._coll.all_gather(holds)
        receivers = self._agreed(lambda: {"receivers": self._receivers()[0]})["receivers"]
        spec = {"tensors": list(manifest), "senders": [{"holds": h} for h in spec_parts],
                "receivers": receivers}
        # Only this rank's pieces: every rank makes the same plan, and sends
        # only its own links (Qwen3-8B, 256 ranks -> 32 receivers: 3.7 s of
        # CPU against 16.8 s for the whole plan, bench/plan_scale.py).
        plan = transfer_plan.build_plan(spec, sender=self.rank)
        registered = None
        if self.rank == 0:
            registered = self._register(spec, plan)
        registered = self._coll.broadcast(registered)
        if registered is not None:
            raise WeightSyncError(*registered)
        self._engines = self._engine_layouts()
        self._fp8_fed = [many_sparse.fp8_fed(e.values()) for e in self._engines]
        self.wire = many_wire.agreed(self._coll, plan, self.rank, manifest,
                                     self._engines) if self.fp8_on_wire else {}
        self._plan, self._plan_key, self.last_plan = plan, key, plan

    def _engine_layouts(self):
        """[{engine id: layout}] of every daemon (what this rank's partial
        receipts walk), read once per plan."""
        ids = None if self._engine_ids is None else set(self._engine_ids)
        out = []
        for st in self._statuses(include_layouts=True):
            out.append({e.engine_id: list(e.layout) for e in st.engines
                        if ids is None or e.engine_id in ids})
        return out

    def _register(self, spec, plan):
        """Leader: RegisterTransferPlan on every daemon; None or [code,
        message] of the first failure."""
        request_spec = _spec_message(spec)

        def register(i, stub):
            r = stub.call("RegisterTransferPlan", spec=request_spec, receivers=[i])
            if r.plan_id != plan.id:
                raise WeightSyncError("INTERNAL", f"daemon {i} made plan {r.plan_id}, this "
                                      f"client {plan.id}: the plan functions disagree")
            return r
        for i, r in enumerate(self._link.group.each(register)):
            if isinstance(r, WeightSyncError):
                return [r.code, f"{self._link.group.name(i)}: {r.message}"]
        return None

    def update(self, manifest, local, version, chunk_bytes=0, update_id=None, mode="streaming",
               verify=True, base_version=None, max_density=0.1):
        """Sends this rank's share of version `version` and returns every
        daemon's commit (FinishWeightUpdateResponse list, the same on
        every rank). `manifest`: the global tensors [{"name", "dtype",
        "shape"}] (the same on every rank); `local`: [(block, array)]
        this rank holds (None entries ignored). Any rank's failure aborts
        the update on every daemon and raises on every rank. base_version:
        pieces that changed in at most max_density of their elements since
        then go as sparse patches (many_sparse; host backend)."""
        local = [x for x in local if x is not None]
        group = self._link.group
        leader = self.rank == 0
        update_id = update_id or f"mton-{version}-{uuid.uuid4().hex[:8]}"
        self.last_timings = timings = {}
        t = [time.perf_counter()]

        def phase(name):
            now = time.perf_counter()
            timings[name + "_s"] = now - t[0]
            t[0] = now
        payloads, patches = self._patches(local, base_version, max_density)
        plan, started, reused = self._plan_and_start(
            manifest, local,
            lambda p, entries: self._start(p, update_id, version, chunk_bytes, mode, verify,
                                           entries, base_version),
            many_sparse.patch_entries(self.rank, patches))
        if not reused:   # the patches were of the last plan: this one goes dense
            payloads, patches = None, {}
        phase("plan_start")
        if "error" in started:
            raise WeightSyncError(*started["error"])
        try:
            if self.nccl is not None:
                sent = {"partials": self.nccl.push(
                    plan, self.rank, local, started, self._engines, verify,
                    watch=lambda: _watch(self._link, started["update_id"]),
                    timeout=self._link.timeout)}
            else:
                sent = {"partials": self._push(plan, local, started, verify, payloads,
                                               patches)}
        except WeightSyncError as e:
            sent = {"error": [e.code, f"rank {self.rank}: {e.message}"]}
        phase("push")
        try:
            outcomes = self._coll.all_gather(sent)
        except Exception as e:  # a rank gone: the collective timed out
            if self.nccl is not None:
                self.nccl.abort()
            if leader:
                _multi.abort(group, started["update_id"], f"a sender did not report: {e}")
            raise WeightSyncError("ABORTED", f"update '{started['update_id']}': a sender did "
                                  f"not report ({e}); aborted on every daemon") from None
        phase("gather")
        result = None
        if leader:
            result = self._finish(group, started["update_id"], outcomes)
        result = self._coll.broadcast(result)
        phase("finish")
        if self.nccl is not None:
            if "error" in result:
                self.nccl.abort()   # a send whose receiver gave up never ends
            else:
                self.nccl.wait(self._link.timeout)   # the daemons have every byte
            phase("wait")
            # The push's own figures only where this update's push set them
            # (a failed one leaves the last update's).
            pushed = self.nccl.last_timings if "error" not in sent else {}
            self.nccl.last_timings = {**pushed, **timings}
            # The chunk size the daemons took (the largest: a daemon whose
            # staging budget fits less lowers its own).
            self.nccl.last_timings["chunk_bytes"] = max(started["chunk_bytes"], default=0)
        if self._basis is not None:   # after a failure what the engines hold is not known
            self._basis.after(plan.id, version, self._sent, "error" not in result,
                              {int(i): p for i, p in (sent.get("partials") or {}).items()})
            self._sent = {}   # the basis keeps what its budget allows
        if "error" in result:
            raise WeightSyncError(*result["error"])
        return [v1.FinishWeightUpdateResponse.FromString(bytes.fromhex(h))
                for h in result["committed"]]

    def _check_receipts(self, group, update_id, prepared, outcomes):
        """Leader: each daemon's receipts against the ranks' summed parts;
        a mismatch aborts everywhere (DATA_LOSS)."""
        self.last_checked = []
        for i, p in enumerate(prepared):
            self.last_checked += [e.engine_id for e in p.engines if any(
                e.engine_id in (o["partials"].get(str(i)) or {}) for o in outcomes)]
            bad = _receipt_mismatch(p, outcomes, i)
            if bad is not None:
                _multi.fail_everywhere(group, update_id, i, WeightSyncError("DATA_LOSS", bad),
                                       "receipts do not match")

    def _start(self, plan, update_id, version, chunk_bytes, mode, verify, entries=(),
               base_version=None):
        group = self._link.group
        # VERIFY_ON asks a GPU daemon to sum its receipts as the chunks land
        # (unset, it read every engine back after the transfer: 4.4 ms for
        # Qwen3-8B's half on an H200); VERIFY_OFF: no receipts at all.
        request = v1.StartWeightUpdateRequest(
            update_id=update_id, target_version=version, chunk_bytes=chunk_bytes,
            verify=v1.VERIFY_ON if verify else v1.VERIFY_OFF,
            transfer_plan_id=plan.id,
            mode=v1.UPDATE_MODE_STAGED if mode == "staged" else v1.UPDATE_MODE_STREAMING,
            plan_sparse=many_sparse.plan_sparse_messages(entries),
            plan_wire=many_wire.plan_wire_messages(self.wire))
        if entries:
            request.sparse_base_version = base_version
        if self._engine_ids is not None:
            request.engine_ids.extend(self._engine_ids)
        t0 = time.perf_counter()
        results = group.each(lambda i, stub: stub.call("StartWeightUpdate", request))
        self.last_timings["start_s"] = time.perf_counter() - t0
        for i, r in enumerate(results):
            if isinstance(r, WeightSyncError):
                ok = [j for j, s in enumerate(results) if not isinstance(s, WeightSyncError)]
                _multi.abort(group, update_id, f"daemon {i} refused the start", ok)
                return {"error": [r.code, f"{group.name(i)}: {r.message}"]}
        return {"update_id": update_id, "chunk_bytes": [r.chunk_bytes for r in results]}

    def _push(self, plan, local, started, verify, payloads=None, patches=None):
        """This rank's links, one PushChunks stream per daemon, in parallel;
        returns {daemon index (str): its partial receipts} (verify). With an
        FP8 target on any daemon, the receipts wait for one more exchange
        of every rank (many_receipts.exchanged_fp8_partials)."""
        me, update_id = self.rank, started["update_id"]
        fp8 = verify and has_fp8_targets(self._engines)
        if payloads is None:
            payloads = _link_payloads(plan, me, local, len(self._link.stubs))
        patches = patches or {}
        self._sent = payloads if self._basis is not None else {}   # held only for a basis
        travels = {}   # {daemon: each piece's bytes as they travel}
        from_deltas = []   # links whose receipts came from deltas

        def push(i, stub):
            if i not in payloads:
                return 0
            mine = patches.get(i, {})
            pieces = many_wire.link_manifest(plan, me, i, self.wire)
            chunks = planner.plan_chunks(many_sparse.link_manifest_with_patches(pieces, mine),
                                         started["chunk_bytes"][i])
            # Patched pieces travel as their patch, those of self.wire
            # quantised; receipts sum the pieces whole, as they were (the
            # daemons read back what the engines then hold).
            wire = travels[i] = many_wire.payloads(
                pieces, [mine[k].payload().tobytes() if k in mine else d
                         for k, d in enumerate(payloads[i])], mine)

            def requests():
                for c in chunks["chunks"]:
                    if self._on_chunk is not None:
                        self._on_chunk(i, c["index"])
                    yield v1.PushChunksRequest(update_id=update_id, chunk_index=c["index"],
                                               data=planner.pack_chunk(c, wire),
                                               sender=me, receiver=i)
            stub.call("PushChunks", requests(), timeout=self._link.stream_timeout)
            if fp8:
                return payloads[i]   # summed once every rank's block parts are in
            if not verify:
                return {}
            # A patched update sums only the elements that changed.
            kept = self._basis.receipts_of(plan, me, i, self._engines[i], payloads[i]) \
                if i in patches else None
            if kept:
                from_deltas.append(i)
            return kept or partial_receipts(plan, me, i, self._engines[i], payloads[i])
        results = list(self._link.group.each(push))
        self.last_wire = many_sparse.wire_figures(payloads, travels, patches, len(from_deltas))
        for i, r in enumerate(results):
            if isinstance(r, WeightSyncError):
                if fp8:   # the ranks' exchange stays in step; this error is the one told
                    try:
                        exchanged_fp8_partials(self._coll, plan, me, self._engines, None)
                    except WeightSyncError:
                        pass
                raise WeightSyncError(r.code, f"{self._link.group.name(i)}: {r.message}")
        if fp8:
            results = exchanged_fp8_partials(self._coll, plan, me, self._engines, results)
        return {str(i): r for i, r in enumerate(results)}

    def _finish(self, group, update_id, outcomes):
        """Leader: abort everywhere if a rank failed, else prepare and
        commit on every daemon."""
        for rank, outcome in enumerate(outcomes):
            failed = outcome.get("error")
            if failed is not None:
                _multi.abort(group, update_id, f"sender {rank} failed: {failed[1]}")
                return {"error": [failed[0], f"sender {rank} failed; the update was aborted "
                                  f"on every daemon: {failed[1]}"]}
        try:
            t0 = time.perf_counter()
            prepared = _multi.prepare(group, update_id, self._link.daemon_wait_ms())
            self._check_receipts(group, update_id, prepared, outcomes)
            t1 = time.perf_counter()
            committed = _multi.commit(group, update_id)
            self.last_timings.update(prepare_s=t1 - t0, commit_s=time.perf_counter() - t1)
        except WeightSyncError as e:
            return {"error": [e.code, e.message]}
        self._link.last_results = committed
        return {"committed": [c.SerializeToString().hex() for c in committed]}


def _watch(link, update_id):
    """Raises WeightSyncError when `update_id` is no longer in progress on
    some daemon of `link` (a rank died: its Liveness hold ended it there;
    or the daemon's watchdog ended it): this rank's sends to it would wait
    for ever."""
    for i, stub in enumerate(link.stubs):
        u = stub.call("GetStatus").update
        if u.update_id != update_id or u.phase == "failed":
            raise WeightSyncError("ABORTED", f"{link.group.name(i)}: update '{update_id}' "
                                  "ended there" + (f" ({u.error})" if u.error else ""))


def _receipt_mismatch(prepared, outcomes, i):
    """The first engine of daemon `i` whose receipt differs from the sum of
    the ranks' parts, as a message; None when all match."""
    want = add_partials(o["partials"].get(str(i)) for o in outcomes)
    for e in prepared.engines:
        if e.engine_id not in want or not e.HasField("receipt"):
            continue
        checksum, nbytes = want[e.engine_id]
        if (e.receipt.checksum, e.receipt.bytes) != (checksum, nbytes):
            return (f"engine '{e.engine_id}' read back checksum {e.receipt.checksum:#x} over "
                    f"{e.receipt.bytes} bytes; the senders sent {checksum:#x} over {nbytes}")
    return None


def _spec_message(spec):
    msg = v1.TransferPlanSpec()
    for t in spec["tensors"]:
        dtype = t["dtype"] if isinstance(t, dict) else t.dtype
        shape = t["shape"] if isinstance(t, dict) else list(t.shape)
        name = t["name"] if isinstance(t, dict) else t.name
        msg.tensors.add(name=name, dtype=dtype, shape=shape)
    for s in spec["senders"]:
        m = msg.senders.add()
        for b in s["holds"]:
            m.holds.add(**b)
    for r in spec["receivers"]:
        m = msg.receivers.add(name=r["name"])
        for b in r["needs"]:
            m.needs.add(**b)
    return msg

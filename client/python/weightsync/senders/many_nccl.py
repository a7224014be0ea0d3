"""Every trainer rank sends its own share over NCCL (issue 32): the wire of
weightsync.senders.many on the nccl backend.

One communicator holds the M trainer ranks (rank r of the training job is
NCCL rank r) and every daemon's ranks after them (daemon i: M + the ranks
of the daemons before it). Each rank sends, point to point, only the
pieces the transfer plan gives it (docs/transfer_plan.md), straight from
its own GPU memory where a chunk is one contiguous run of one piece, else
packed into a ring of chunk buffers. Link (rank, daemon i)'s stream is cut
by the ordinary chunk planner at daemon i's chunk size; round k is chunk k
of every link, one NCCL group per round, rounds in order: the daemons
receive in the same order (daemon/core/link_plan.h ChunksByRound, the
worker's ncclRecv rounds), so every pair of ranks matches its transfers
and no rank waits on another's later round.

    trainer = weightsync.Trainer(daemon_targets)          # on every rank
    trainer.init_nccl(device=local_rank, collective=coll)  # every rank joins
    trainer.update_sharded(manifest, local, version)       # every rank sends

`local` holds torch CUDA tensors here: (block, tensor whose row-major
bytes are the block), e.g. an FSDP2 parameter's local shard.
"""

import time

from weightsync import nccl as _nccl
from weightsync import planner, transfer_plan
from weightsync._errors import WeightSyncError
from weightsync.gpu_trainer import cuda_device
from weightsync.senders.many_receipts import link_views
from weightsync.senders.nccl import init_daemons, local_links, this_host

__all__ = ["NcclLinks", "direct_source", "link_rounds", "pack_ops", "piece_views", "refresh"]


def _field(t, key):
    return t[key] if isinstance(t, dict) else getattr(t, key)


def link_rounds(chunk_plans):
    """The send order of one rank: [[(daemon, chunk)]] per round, round k
    holding chunk k of every link that has one (`chunk_plans`: {daemon:
    planner.plan_chunks of the link}), daemons in index order."""
    rounds = max((len(p["chunks"]) for p in chunk_plans.values()), default=0)
    return [[(i, chunk_plans[i]["chunks"][k]) for i in sorted(chunk_plans)
             if k < len(chunk_plans[i]["chunks"])] for k in range(rounds)]


def direct_source(chunk):
    """(piece index, byte offset) when `chunk` is one contiguous run of one
    piece's bytes (sent from where it lies), else None (packed)."""
    pieces = chunk["pieces"]
    if len(pieces) == 1 and pieces[0]["length"] == chunk["size"] and \
            pieces[0]["chunk_offset"] == 0:
        return pieces[0]["tensor"], pieces[0]["tensor_offset"]
    return None


def pack_ops(chunk):
    """(padded, [(chunk offset, piece, piece offset, length)]): how a chunk
    not sent in place is packed; padded: some of its bytes are padding
    (zeroed first, as the host path's planner.pack_chunk leaves them)."""
    copies = [(p["chunk_offset"], p["tensor"], p["tensor_offset"], p["length"])
              for p in chunk["pieces"]]
    return sum(c[3] for c in copies) != chunk["size"], copies


def piece_views(pieces, held, element_size, alloc):
    """(flats, copies): the row-major bytes of each piece as a flat uint8
    tensor, and the copies that fill them. A piece that spans its held
    block's full rows (FSDP row shards, layers) is a view of the block's
    memory; one that cuts columns (a row-parallel TP shard of a row shard)
    is a buffer from `alloc(nbytes)`, filled by `refresh(copies)` before
    every send. `held`: {tensor index: [(block, rows)]}, rows the block's
    bytes as [row_count, col_count * element size] uint8; `element_size`:
    {tensor index: bytes}."""
    flats, copies = [], []
    for p in pieces:
        es = element_size[p.tensor]
        for b, rows in held.get(p.tensor, ()):
            if (b["row_begin"] <= p.row_begin and
                    p.row_begin + p.row_count <= b["row_begin"] + b["row_count"] and
                    b["col_begin"] <= p.col_begin and
                    p.col_begin + p.col_count <= b["col_begin"] + b["col_count"]):
                r0, c0 = p.row_begin - b["row_begin"], (p.col_begin - b["col_begin"]) * es
                part = rows[r0:r0 + p.row_count, c0:c0 + p.col_count * es]
                if part.is_contiguous():
                    flats.append(part.reshape(-1))
                else:
                    buf = alloc(p.row_count * p.col_count * es)
                    flats.append(buf)
                    copies.append((buf.view(p.row_count, p.col_count * es), part))
                break
        else:
            raise WeightSyncError("INTERNAL", f"the plan gives this rank {p} it does not hold")
    return flats, copies


def refresh(copies):
    """Fills the column-cut pieces' buffers from their blocks (on the
    current stream)."""
    for dst, src in copies:
        dst.copy_(src)


class _Program:
    """One rank's sends of one (plan, local tensors, chunk sizes), made
    once and replayed by every update of the same tensors (the cached
    path pays nothing per piece but the copies it must make)."""

    def __init__(self, flats, copies, rounds, keep):
        self.flats = flats        # {daemon: [piece bytes]}
        self.copies = copies      # column-cut pieces: refreshed each update
        self.rounds = rounds      # [[("direct", peer, ptr, size) | ("pack", peer, op)]]
        self.keep = keep          # what the views need alive
        self.receipts = {}        # daemon -> (views, sent) of the partial receipts


class NcclLinks:
    """One trainer rank's NCCL side of many-sender updates: the
    communicator, each daemon's first NCCL rank, the streams and the ring
    of pack buffers. Made by `join` on every rank."""

    backend = "nccl"

    def __init__(self, comm, device, peers, pack_buffers):
        import torch
        self.comm = comm
        self.device = device
        self.peers = peers              # daemon index -> its NCCL rank
        self.pack_buffers = pack_buffers
        with torch.cuda.device(device):
            self.pack_stream = torch.cuda.Stream(device)
            self.comm_stream = torch.cuda.Stream(device)
        self._ring = []                 # [(buffer, packed event, free event)]
        self._ring_chunk = 0
        self._chunks = {}               # (plan id, daemon, chunk bytes) -> chunk plan
        # The last _Program by its key: one, because a program holds its
        # tensors (a trainer that sends new tensors every step must not have
        # the last step's kept alive).
        self._programs = {}
        self._pending = None            # (done event, tensors to keep) of the last update
        self.last_timings = {}
        # Tests only: called with each round's index after its sends are
        # enqueued (tests/gpu/test_mton_gpu.py kills a sender there).
        self.on_round = None

    @classmethod
    def join(cls, link, collective, device=None, pack_buffers=4, timeout_ms=0):
        """Forms the group on every rank: the leader (rank 0) makes the
        unique id and calls InitWeightTransfer on every daemon (world =
        trainer ranks + every daemon's ranks; daemon i's rank_offset after
        the trainer ranks and the daemons before it); every rank then joins
        as its own rank. Returns (links, group ids); raises the leader's
        error on every rank."""
        import torch
        dev = cuda_device(device)
        m = collective.world_size
        # Where the ranks run (one host, NVLink/PCIe: the daemons take
        # larger chunks by default): asked once, when the group forms.
        hosts = collective.all_gather(this_host())
        answer = None
        if collective.rank == 0:
            try:
                uid, world, offsets, groups = init_daemons(
                    link, m, timeout_ms,
                    senders_on_this_host=local_links(link.group.targets, hosts))
                answer = {"uid": uid.hex(), "world": world, "offsets": offsets,
                          "groups": groups}
            except WeightSyncError as e:
                answer = {"error": [e.code, e.message]}
            except Exception as e:  # noqa: BLE001 - no libnccl here: every rank must hear
                answer = {"error": ["UNAVAILABLE", f"rank 0 forming the NCCL group: "
                                    f"{type(e).__name__}: {e}"]}
        answer = collective.broadcast(answer)
        if "error" in answer:
            raise WeightSyncError(*answer["error"])
        with torch.cuda.device(dev):
            try:
                comm = _nccl.Communicator(answer["world"], bytes.fromhex(answer["uid"]),
                                          collective.rank)
            except _nccl.NcclError as e:
                raise WeightSyncError("UNAVAILABLE", f"rank {collective.rank} joining the NCCL "
                                      f"group on {dev}: {e}") from None
        links = cls(comm, dev, dict(enumerate(answer["offsets"])),
                    max(pack_buffers, 2 * len(answer["offsets"])))
        return links, answer["groups"]

    def close(self):
        self.abort()

    def abort(self):
        """Ends this rank's sends (ncclCommAbort): after a failed update a
        send whose receiver is gone never completes. init_nccl again."""
        if self.comm is not None:
            self.comm.abort()
            self.comm = None
        self._pending = None

    # -- one update --------------------------------------------------------------

    # Rounds enqueued ahead of the GPU: a send waits for its receiver, and
    # a CUDA stream takes only so many launches before the next one blocks
    # the CPU; past this window the sender waits, watching the update.
    WINDOW_ROUNDS = 32

    def _ensure_ring(self, size):
        import torch
        if self._ring and self._ring_chunk >= size and len(self._ring) >= self.pack_buffers:
            return
        self.comm_stream.synchronize()
        self.pack_stream.synchronize()
        self._ring = [(torch.empty(size, dtype=torch.uint8, device=self.device),
                       torch.cuda.Event(), torch.cuda.Event()) for _ in range(self.pack_buffers)]
        self._ring_chunk = size
        self._programs.clear()   # their packs name the old buffers

    def _chunk_plan(self, plan, rank, daemon, chunk_bytes):
        key = (plan.id, rank, daemon, chunk_bytes)
        p = self._chunks.get(key)
        if p is None:
            if len(self._chunks) > 64:
                self._chunks.clear()
            p = planner.plan_chunks(transfer_plan.link_manifest(plan, rank, daemon), chunk_bytes)
            self._chunks[key] = p
        return p

    def _program(self, plan, rank, local, chunk_bytes):
        """The cached _Program of this update, or a new one. Keyed by the
        local tensors' memory: the program holds them, so memory at the
        same address with the same shape is the same tensor."""
        import torch
        if all(t.is_contiguous() for _, t in local):
            key = (plan.id, rank, tuple(chunk_bytes),
                   tuple((b["tensor"], b["row_begin"], b["row_count"], b["col_begin"],
                          b["col_count"], t.data_ptr(), t.numel(), str(t.dtype))
                         for b, t in local))
            hit = self._programs.get(key)
            if hit is not None:
                return hit
        else:
            key = None   # copied below on every update: nothing to keep
        self._programs.clear()   # let the last tensors go before making more
        index = {_field(t, "name"): k for k, t in enumerate(plan.tensors)}
        sizes = {k: planner.element_size(_field(t, "dtype")) for k, t in enumerate(plan.tensors)}
        held = {}
        for b, t in local:
            if not hasattr(t, "is_cuda") or not t.is_cuda:
                raise WeightSyncError("INVALID_ARGUMENT", f"tensor '{b['tensor']}': the nccl "
                                      "backend sends torch CUDA tensors")
            flat = t.detach().contiguous().reshape(-1).view(torch.uint8)
            rows = flat.view(b["row_count"], -1) if b["row_count"] else flat.view(0, 0)
            held.setdefault(index[b["tensor"]], []).append((b, rows))

        def alloc(n):
            return torch.empty(n, dtype=torch.uint8, device=self.device)
        flats, copies, plans = {}, [], {}
        for i in self.peers:
            pieces = plan.link_pieces(rank, i)
            if pieces:
                flats[i], cut = piece_views(pieces, held, sizes, alloc)
                copies += cut
                plans[i] = self._chunk_plan(plan, rank, i, chunk_bytes[i])
        biggest = max((c["size"] for p in plans.values() for c in p["chunks"]), default=0)
        if biggest:
            self._ensure_ring(biggest)
        program = _Program(flats, copies, self._schedule(link_rounds(plans), flats), held)
        if key is not None:
            self._programs[key] = program
        return program

    def _schedule(self, rounds, flats):
        """Each round's sends, resolved once: a chunk that is one contiguous
        run of one piece is sent from where it lies; any other is packed
        into the next ring slot (reused once the send that read it is
        done) from prepared views."""
        out, slot = [], 0
        for round_ in rounds:
            ops = []
            for i, c in round_:
                direct = direct_source(c)
                if direct is not None:
                    ops.append(("direct", self.peers[i],
                                flats[i][direct[0]].data_ptr() + direct[1], c["size"]))
                    continue
                index = slot % len(self._ring)
                buf = self._ring[index][0]
                padded, copies = pack_ops(c)
                views = [(buf[at:at + length], flats[i][piece][begin:begin + length])
                         for at, piece, begin, length in copies]
                ops.append(("pack", self.peers[i], {
                    "slot": index, "reuse": slot >= len(self._ring), "size": c["size"],
                    "zero": buf[:c["size"]] if padded else None, "views": views,
                    "ptr": buf.data_ptr()}))
                slot += 1
            out.append(ops)
        return out

    def push(self, plan, rank, local, started, engines, verify, watch=None, timeout=600.0):
        """Enqueues this rank's sends of one update (returns before they
        are done: `wait` after the daemons answered) and, with `verify`,
        sums the receipt terms of what it sends to each daemon on its GPU.
        At most WINDOW_ROUNDS rounds run ahead of the GPU; while it waits
        for them it calls `watch()` every half second (raises when the
        update ended on a daemon: another rank died) and gives up after
        `timeout` s. Returns {daemon index (str): partial receipts}."""
        import torch
        if self.comm is None:
            raise WeightSyncError("FAILED_PRECONDITION", "no NCCL communicator (never formed, "
                                  "or aborted after a failed update): call init_nccl() again")
        t0 = time.perf_counter()
        program = self._program(plan, rank, local, started["chunk_bytes"])
        current = torch.cuda.current_stream(self.device)
        refresh(program.copies)                 # on the current stream, after the step
        self.pack_stream.wait_stream(current)   # the tensors are written (optimizer step)
        self.comm_stream.wait_stream(current)
        try:
            self._send_rounds(program.rounds, watch, time.monotonic() + timeout)
        except _nccl.NcclError as e:
            self.abort()
            raise WeightSyncError("ABORTED", f"sending failed on trainer rank {rank}: {e}; "
                                  "init_nccl() again") from None
        for flats in program.flats.values():
            for f in flats:
                f.record_stream(self.comm_stream)
        done = torch.cuda.Event()
        done.record(self.comm_stream)
        self._pending = (done, program)
        t1 = time.perf_counter()
        partials = {}
        if verify:
            for i in program.flats:
                partials[str(i)] = self._partials(program, plan, rank, i, engines)
        self.last_timings = {"enqueue_s": t1 - t0, "receipts_s": time.perf_counter() - t1,
                             "rounds": len(program.rounds)}
        return partials

    def _partials(self, program, plan, rank, i, engines):
        """{engine id: [checksum, bytes]} of what this rank sends daemon i,
        summed on the GPU; the views and the elements' table are made once
        per program and engine layouts."""
        from weightsync._gpu import elements
        from weightsync.receipts import expected_receipt_arrays
        from weightsync.receipts import gpu as receipts_gpu
        cached = program.receipts.get(i)
        if cached is None or cached[0] is not engines[i]:
            views, manifest = link_views(plan, rank, i, engines[i])
            sent = {m["name"]: (m["dtype"], tuple(m["shape"]), elements(f, m["dtype"]))
                    for m, f in zip(manifest, program.flats[i])}
            cached = (engines[i], views, sent)
            program.receipts[i] = cached
        _, views, sent = cached
        if views and receipts_gpu.available():
            sums = receipts_gpu.expected_receipts_gpu(
                views, sent, plan_key=(id(program), i, id(engines[i])))
        else:
            sums = {e: expected_receipt_arrays(v, sent) for e, v in views.items()}
        return {e: [str(int(c)), int(b)] for e, (c, _, b) in sums.items()}

    def _send_rounds(self, rounds, watch, deadline):
        """Enqueues every round of a program: its packs on the pack stream,
        then one NCCL group of its sends on the comm stream; a round
        starts once the round WINDOW_ROUNDS before it is done."""
        import torch
        stream_ptr = self.comm_stream.cuda_stream
        sent = []   # an event after each round's sends
        for k, ops in enumerate(rounds):
            if k >= self.WINDOW_ROUNDS:
                self._await(sent[k - self.WINDOW_ROUNDS], deadline, watch)
            sends = []
            for op in ops:
                if op[0] == "direct":
                    sends.append((op[1], op[2], op[3], None))
                    continue
                pack = op[2]
                _, packed, free = self._ring[pack["slot"]]
                if pack["reuse"]:
                    self.pack_stream.wait_event(free)
                with torch.cuda.stream(self.pack_stream):
                    if pack["zero"] is not None:
                        pack["zero"].zero_()   # padding is zeros on the wire
                    for dst, src in pack["views"]:
                        dst.copy_(src, non_blocking=True)
                    packed.record(self.pack_stream)
                self.comm_stream.wait_event(packed)
                sends.append((op[1], pack["ptr"], pack["size"], free))
            self.comm.group_start()
            try:
                for peer, ptr, size, _ in sends:
                    self.comm.send(ptr, size, peer, stream_ptr)
            finally:
                self.comm.group_end()
            for _, _, _, free in sends:
                if free is not None:
                    free.record(self.comm_stream)
            done = torch.cuda.Event()
            done.record(self.comm_stream)
            sent.append(done)
            if self.on_round is not None:
                self.on_round(k)

    def _await(self, event, deadline, watch=None):
        """Waits for `event`, watching the communicator and (every half
        second) `watch`; on an NCCL error, a watch that raises or the
        deadline, aborts the communicator and raises ABORTED."""
        sleep, next_watch = 0.00005, time.monotonic() + 0.5
        while not event.query():
            err = self.comm.async_error() if self.comm is not None else None
            now = time.monotonic()
            why = None
            if err is not None:
                why = f"NCCL error: {err}"
            elif now > deadline:
                why = "sends not done by the deadline"
            elif watch is not None and now > next_watch:
                next_watch = now + 0.5
                try:
                    watch()
                except WeightSyncError as e:
                    why = e.message
            if why is not None:
                self.abort()
                raise WeightSyncError("ABORTED", f"{why}; communicator aborted "
                                      "(init_nccl() again)")
            time.sleep(sleep)
            sleep = min(sleep * 2, 0.002)

    def wait(self, timeout, watch=None):
        """Waits until this rank's sends of the last update are done
        (_await's rules)."""
        if self._pending is None:
            return
        self._await(self._pending[0], time.monotonic() + timeout, watch)
        self._pending = None

"""Trainer data planes on GPUs: NCCL (trainer on its own GPU, the daemons'
ranks receive) and CUDA IPC (trainer on the engine's GPU, the daemon copies
from the trainer's packed buffer). Used by weightsync.Trainer after
init_nccl() / init_ipc(); needs torch with CUDA.

NCCL, per update (mirrors tools/gpu_trainer.cc): StartWeightUpdate on
every daemon, then for every chunk k of the shared chunk plan one
ncclBroadcast (root 0, ncclUint8) of the packed bytes [offset, offset+size)
of the update, then FinishWeightUpdate. Chunks are packed on a side stream
into a ring of reusable chunk buffers while earlier chunks are broadcast
(pack k+1 overlaps broadcast k); a chunk that is one slice of one
contiguous tensor on the trainer's GPU is broadcast straight from the
tensor. Finish is called as soon as the last broadcast is enqueued (the
daemon waits for its bytes), then the trainer waits for its own stream.

IPC: the whole update is packed into one buffer that starts at a
caching-allocator segment base (the daemon opens the handle and reads
from offset 0); StartWeightUpdate carries its handle as ipc_source, the
daemon copies, Finish returns when done; the buffer is not touched until
Finish returns.

Lazy tensors (weightsync.lazy.LazyTensor, e.g. FSDP2 parameters gathered
with full_tensor()): each is made just before the first chunk that needs
it and let go after the last chunk that reads it (weightsync.lazy.Feed),
so the trainer holds about one chunk's tensors at a time. On NCCL they
join the broadcast loop above; on IPC they go through a ring of chunk
slots (docs/protocol.md, "Ring mode": IpcChunks), not one buffer of the
whole update.

Sparse patches (weightsync.sparse.diff of torch tensors, computed on the
GPU) travel in both: a patch's payload (indices, then values) takes the
tensor's place in the packed stream, on the GPU. Receipts (verify=True)
are checked after Finish against an expectation computed on the GPU from
the tensors as sent (weightsync.receipts.expected_receipt_arrays).
"""

import queue
import time

from weightsync import planner
from weightsync._errors import WeightSyncError
from weightsync._gpu import dedupe_aliases, dtype_name, flat_bytes, gpu_uuid, parse_storage_handle
from weightsync._proto import v1
from weightsync._tensors import describe
from weightsync.lazy import Feed, LazyTensor, check_materialized
from weightsync.sparse import SparsePatch, TorchSparsePatch
from weightsync.wire_fp8 import WireFp8

# Chunk size of a lazy IPC update (the ring's slots) when the caller asks
# for none: the daemon's default --max_chunk_bytes.
RING_CHUNK_BYTES = 64 << 20


def chunk_schedule(plan, direct_ok, ring_size):
    """How each chunk of `plan` is sent: a list of {"chunk", "direct",
    "slot", "wait_free"}. direct = (tensor index, byte offset) when the
    chunk is one slice of one tensor that can be broadcast in place
    (direct_ok[tensor]); otherwise the chunk is packed into ring buffer
    `slot` (round robin over the packed chunks), after waiting for that
    buffer's previous broadcast when wait_free. Pure logic (tested in CI)."""
    ops, slot, used = [], 0, [False] * max(1, ring_size)
    for c in plan["chunks"]:
        pieces = c["pieces"]
        if len(pieces) == 1 and pieces[0]["length"] == c["size"] and direct_ok[pieces[0]["tensor"]]:
            ops.append({"chunk": c, "direct": (pieces[0]["tensor"], pieces[0]["tensor_offset"]),
                        "slot": None, "wait_free": False})
            continue
        ops.append({"chunk": c, "direct": None, "slot": slot, "wait_free": used[slot]})
        used[slot] = True
        slot = (slot + 1) % len(used)
    return ops


class RingStream:
    """The trainer's end of IpcChunks (an IPC ring update): ready(k)
    announces chunk k (in slot k % slots); wait_done(n) blocks until the
    daemon reports n chunks copied out of their slots; close() ends the
    announcements and returns once the daemon has answered them all.
    Errors raise WeightSyncError with the daemon's code and message."""

    def __init__(self, stub, update_id, timeout):
        self._queue = queue.Queue()
        self._update_id = update_id
        self._first = True
        self._closed = False
        self.done = 0
        self._responses = stub.stream("IpcChunks", self._requests(), timeout=timeout)

    def _requests(self):
        while True:
            request = self._queue.get()
            if request is None:
                return
            yield request

    def ready(self, k):
        request = v1.IpcChunksRequest(chunk_index=k)
        if self._first:
            request.update_id = self._update_id
            self._first = False
        self._queue.put(request)

    def _next(self):
        import grpc
        try:
            return next(self._responses)
        except StopIteration:
            return None
        except grpc.RpcError as e:
            raise WeightSyncError(e.code().name, e.details()) from None

    def wait_done(self, n):
        while self.done < n:
            r = self._next()
            if r is None:
                raise WeightSyncError("ABORTED", f"the daemon ended the IPC chunk stream after "
                                      f"{self.done} chunks copied")
            self.done = max(self.done, r.chunks_done)

    def close(self):
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        while True:
            r = self._next()
            if r is None:
                return
            self.done = max(self.done, r.chunks_done)

    def cancel(self):
        if not self._closed:
            self._closed = True
            self._queue.put(None)
        try:
            self._responses.cancel()
        except Exception:  # noqa: BLE001 - already ended
            pass


def ring_send(plan, slots, ring, pack, feed=None, payloads=None, on_made=None):
    """An IPC ring update's loop (docs/protocol.md, "Ring mode"): for each
    chunk k, once the daemon has copied chunk k - slots out of slot k %
    slots (ring.wait_done), make its lazy tensors (feed.before), pack it
    into its slot and wait for the copy (pack(chunk, slot)), announce it
    (ring.ready), sum the receipts of the tensors just made (on_made(new
    indices)) and let go of those no later chunk reads (feed.after); then
    ring.close(). Pure control flow (tested in CI with numpy)."""
    for c in plan["chunks"]:
        k = c["index"]
        if k >= slots:
            ring.wait_done(k - slots + 1)
        new = feed.before(k, payloads) if feed is not None else ()
        pack(c, k % slots)
        ring.ready(k)
        if new and on_made is not None:
            on_made(new)
        if feed is not None:
            feed.after(k, payloads)
    ring.close()


def cuda_device(device):
    """`device` (None: the current one, an index, a name) as a torch CUDA
    device with its index."""
    import torch
    if device is None:
        return torch.device("cuda", torch.cuda.current_device())
    if isinstance(device, int):
        return torch.device("cuda", device)
    d = torch.device(device)
    if d.type != "cuda":
        raise ValueError(f"device {device} is not a CUDA device")
    return torch.device("cuda", d.index if d.index is not None else torch.cuda.current_device())


class GpuSender:
    """Per-Trainer GPU state: device, streams, communicator, buffers."""

    def __init__(self, backend, device, comm=None, pack_buffers=2):
        import torch
        self.backend = backend
        self.device = cuda_device(device)
        self.comm = comm
        self.pack_buffers = max(1, pack_buffers)
        with torch.cuda.device(self.device):
            # Above the default priority: the receipts' kernels on the
            # tensors' stream, beside the transfer, must not keep NCCL's and
            # the packs' blocks waiting for SMs.
            self.pack_stream = torch.cuda.Stream(self.device, priority=-1)
            self.comm_stream = torch.cuda.Stream(self.device, priority=-1)
        self._ring = []          # [(tensor, packed event, free event)]
        self._ring_chunk = 0
        self._plans = {}
        self._ipc_buffer = None  # (tensor, handle)
        self.last_timings = {}

    # -- manifest -------------------------------------------------------------

    def manifest(self, named_tensors):
        """(names, flat uint8 payloads, manifest dicts, {dropped alias:
        kept name}). A SparsePatch's payload (indices, then values) goes in
        the stream in place of the tensor: a TorchSparsePatch's stays on its
        device, a numpy one is copied to the trainer's GPU. A LazyTensor
        stays in `flats` as it is (the caller makes it: lazy_feed)."""
        import torch
        pairs, dropped = dedupe_aliases(list(named_tensors))
        names, flats, manifest = [], [], []
        for name, t in pairs:
            if isinstance(t, LazyTensor):
                names.append(name)
                flats.append(t)
                manifest.append({"name": name, "dtype": t.dtype, "shape": list(t.shape)})
                continue
            if isinstance(t, WireFp8):   # FP8 on the wire: elements, then scales
                payload = t.payload()
                if not hasattr(payload, "is_cuda"):
                    payload = torch.from_numpy(payload).to(self.device)
                names.append(name)
                flats.append(payload)
                manifest.append({"name": name, "dtype": t.dtype,
                                 "shape": [int(s) for s in t.shape], "quantization": t.fields})
                continue
            if isinstance(t, SparsePatch):
                if not t.nnz:
                    raise ValueError(f"tensor '{name}': an empty patch (sparse_nnz 0 means a "
                                     "dense tensor on the wire); leave the tensor out or "
                                     "send it dense (weightsync.sparse.diff never returns one)")
                payload = t.payload()
                if isinstance(t, TorchSparsePatch):
                    dt = dtype_name(name, t.values)
                else:
                    dt = describe(name, t.values)[0]
                    payload = torch.from_numpy(payload).to(self.device)
                names.append(name)
                flats.append(payload)
                manifest.append({"name": name, "dtype": dt, "shape": [int(s) for s in t.shape],
                                 "sparse_nnz": int(t.nnz), "sparse_index_bytes": t.index_bytes})
                continue
            if not hasattr(t, "untyped_storage"):
                raise ValueError(f"tensor '{name}': the {self.backend} backend sends torch "
                                 f"tensors, not {type(t).__name__}")
            dt = dtype_name(name, t)
            names.append(name)
            flats.append(flat_bytes(name, t))
            manifest.append({"name": name, "dtype": dt, "shape": [int(s) for s in t.shape]})
        return names, flats, manifest, dropped

    @staticmethod
    def receipt_inputs(pairs, manifest, flats):
        """(manifest, flats) the receipts' expectation takes: as sent, but
        a tensor quantised on the wire (WireFp8) counts as the tensor it
        was quantised from, which the expectation quantises as the engine's
        FP8 target says (weightsync.receipts), exactly as the trainer did."""
        wired = {n: t for n, t in pairs if isinstance(t, WireFp8)}
        if not wired:
            return manifest, flats
        out_m, out_f = [], []
        for m, f in zip(manifest, flats):
            w = wired.get(m["name"])
            if w is not None:
                m = {"name": m["name"], "dtype": dtype_name(m["name"], w.source),
                     "shape": m["shape"]}
                f = flat_bytes(m["name"], w.source)
            out_m.append(m)
            out_f.append(f)
        return out_m, out_f

    def plan(self, manifest, chunk_bytes):
        key = (chunk_bytes, tuple((m["name"], m["dtype"], tuple(m["shape"]),
                                   m.get("sparse_nnz", 0), m.get("sparse_index_bytes", 0),
                                   tuple(sorted(m.get("quantization", {}).items())))
                                  for m in manifest))
        p = self._plans.get(key)
        if p is None:
            if len(self._plans) > 8:
                self._plans.clear()
            p = planner.plan_chunks(manifest, chunk_bytes)
            self._plans[key] = p
        return p

    # -- NCCL ------------------------------------------------------------------

    def _ensure_ring(self, chunk_bytes):
        import torch
        if self._ring and self._ring_chunk >= chunk_bytes:
            return
        self.comm_stream.synchronize()
        self.pack_stream.synchronize()
        self._ring = []
        for _ in range(self.pack_buffers):
            buf = torch.zeros(chunk_bytes, dtype=torch.uint8, device=self.device)
            self._ring.append((buf, torch.cuda.Event(), torch.cuda.Event()))
        torch.cuda.synchronize(self.device)
        self._ring_chunk = chunk_bytes

    def _pack(self, op, flats):
        import torch
        buf, packed, _ = self._ring[op["slot"]]
        with torch.cuda.stream(self.pack_stream):
            for p in op["chunk"]["pieces"]:
                src = flats[p["tensor"]]
                buf[p["chunk_offset"]:p["chunk_offset"] + p["length"]].copy_(
                    src[p["tensor_offset"]:p["tensor_offset"] + p["length"]],
                    non_blocking=True)
            packed.record(self.pack_stream)

    def prepack(self, plan, flats):
        """Packs the chunks that go first into each ring buffer, before
        StartWeightUpdate (packing needs no daemon), so the first broadcast
        leaves as soon as Start returns. Returns their chunk indices; pass
        them to enqueue_nccl. The previous update's broadcasts must be done
        (update() waits for them)."""
        import torch
        chunks = plan["chunks"]
        if not chunks:
            return set()
        self._ensure_ring(max(c["size"] for c in chunks))
        self.pack_stream.wait_stream(torch.cuda.current_stream(self.device))
        direct_ok = [f.device == self.device for f in flats]
        packed = set()
        for op in chunk_schedule(plan, direct_ok, len(self._ring)):
            if op["direct"] is not None:
                continue
            if op["wait_free"]:
                break
            self._pack(op, flats)
            packed.add(op["chunk"]["index"])
        return packed

    def lazy_feed(self, names, plan, lazy, budget=None, timeout=600.0, synchronous=False):
        """A weightsync.lazy.Feed for the lazy entries `lazy` ({index:
        LazyTensor}) of an update of `plan`: each is made on the current
        stream (materialize(), checked against its dtype and shape, copied
        to this GPU if it is elsewhere) as a flat byte view; when let go it
        is marked used by the pack and comm streams (record_stream: the
        caching allocator reuses its memory only after they are done) and
        an event on the comm stream says when. With a `budget` (bytes), the
        feed waits for such events (watching the communicator, as wait()
        does) before it makes more than that. synchronous: every chunk's
        reads are waited for before the next (the IPC ring: pack_slot), so
        a tensor let go is done with at once."""
        import torch

        def make(i, entry):
            with torch.no_grad():
                t = entry.materialize()
            if type(t).__name__ == "AsyncCollectiveTensor" and hasattr(t, "wait"):
                t = t.wait()   # a functional collective's result: its data
            if not torch.is_tensor(t):
                raise ValueError(f"tensor '{names[i]}': materialize() returned "
                                 f"{type(t).__name__}, not a torch tensor")
            check_materialized(names[i], entry, dtype_name(names[i], t), tuple(t.shape))
            if t.device != self.device:
                t = t.to(self.device)
            return flat_bytes(names[i], t)

        def release(i, flat):
            flat.record_stream(self.pack_stream)
            if synchronous:
                return None
            flat.record_stream(self.comm_stream)
            done = torch.cuda.Event()
            done.record(self.comm_stream)
            return done

        return Feed(plan, lazy, make, release, lambda e: self.wait(e, timeout), budget)

    def enqueue_nccl(self, plan, flats, prepacked=(), feed=None, on_made=None):
        """Packs (unless in `prepacked`) and broadcasts every chunk; returns
        the event recorded after the last broadcast and the objects to keep
        alive until it fires. feed: a lazy_feed, whose tensors are made into
        `flats` before the first chunk that needs them (the streams then
        wait for the current one, where they were made) and let go after
        the last; on_made(indices) runs after the chunk that made them was
        enqueued (receipts)."""
        import torch
        if self.comm is None:
            raise WeightSyncError("FAILED_PRECONDITION", "no NCCL communicator (never formed, "
                                  "or aborted after a failed update): call init_nccl() again")
        chunks = plan["chunks"]
        if not chunks:
            return None, []
        self._ensure_ring(max(c["size"] for c in chunks))
        current = torch.cuda.current_stream(self.device)
        self.pack_stream.wait_stream(current)   # tensors are ready (optimizer step)
        self.comm_stream.wait_stream(current)
        # Zero-copy chunks read the tensor on the comm stream: tell the
        # caching allocator so a freed tensor isn't reused too early. A lazy
        # tensor (None until made) is made on this GPU.
        direct_ok = [f is None or f.device == self.device for f in flats]
        keep = []
        stream_ptr = self.comm_stream.cuda_stream
        for op in chunk_schedule(plan, direct_ok, len(self._ring)):
            c = op["chunk"]
            made = ()
            if feed is not None:
                made = feed.before(c["index"], flats)
                if made:   # made on the current stream
                    self.pack_stream.wait_stream(current)
                    self.comm_stream.wait_stream(current)
            if op["direct"] is not None:
                tensor, offset = op["direct"]
                src = flats[tensor]
                src.record_stream(self.comm_stream)
                self.comm.broadcast(src.data_ptr() + offset, c["size"], 0, stream_ptr)
            else:
                buf, packed, free = self._ring[op["slot"]]
                if c["index"] not in prepacked:
                    if op["wait_free"]:
                        self.pack_stream.wait_event(free)   # the chunk that used this buffer is sent
                    self._pack(op, flats)
                self.comm_stream.wait_event(packed)
                self.comm.broadcast(buf.data_ptr(), c["size"], 0, stream_ptr)
                free.record(self.comm_stream)
            if feed is not None:
                if made and on_made is not None:
                    on_made(made)
                feed.after(c["index"], flats)
        done = torch.cuda.Event()
        done.record(self.comm_stream)
        keep.append(flats)
        return done, keep

    def wait(self, event, timeout):
        """Waits for `event`, watching the communicator; raises
        WeightSyncError("ABORTED") on an NCCL error or the deadline (after
        aborting the communicator so nothing stays blocked)."""
        if event is None:
            return
        deadline = time.monotonic() + timeout
        sleep = 0.00005
        while not event.query():
            err = self.comm.async_error() if self.comm is not None else None
            if err is not None:
                self.abort_comm()
                raise WeightSyncError("ABORTED", f"NCCL error on the trainer: {err}")
            if time.monotonic() > deadline:
                self.abort_comm()
                raise WeightSyncError("ABORTED", f"broadcasts not done after {timeout:.0f} s; "
                                      "communicator aborted (init_nccl() again)")
            time.sleep(sleep)
            sleep = min(sleep * 2, 0.002)

    def ring_bytes(self):
        """Bytes of the NCCL path's ring of pack buffers."""
        return len(self._ring) * self._ring_chunk

    def abort_comm(self):
        if self.comm is not None:
            self.comm.abort()
            self.comm = None

    # -- IPC -------------------------------------------------------------------

    def ipc_buffer(self, total):
        """A packed buffer of at least `total` bytes that starts at its
        caching-allocator segment's base, and its 64-byte IPC handle."""
        import torch
        if self._ipc_buffer is not None and self._ipc_buffer[0].numel() >= total:
            return self._ipc_buffer
        self._ipc_buffer = None
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()   # whole free segments back: a fresh one is likely
        held, found = [], None
        # A segment of its own, a whole number of 2 MiB pages: the caching
        # allocator gives requests of 10 MiB and more their own cudaMalloc
        # (offset 0 of its IPC handle), and legacy IPC mappings of sizes that
        # aren't 2 MiB multiples copy at half speed (bench/RESULTS.md).
        size = max(-(-max(total, 1) // (2 << 20)) * (2 << 20), 12 << 20)
        for _ in range(4):
            t = torch.empty(size, dtype=torch.uint8, device=self.device)
            shared = t.untyped_storage()._share_cuda_()
            if int(shared[3]) == 0:
                found = (t, parse_storage_handle(shared[1]))
                break
            held.append(t)   # keep it so the next try can't land in the same block
        del held
        if found is None:
            raise WeightSyncError(
                "FAILED_PRECONDITION",
                f"could not get a {total}-byte CUDA buffer at the start of its allocation "
                "(the daemon reads the packed update from offset 0 of the IPC handle); "
                "free cached GPU memory (torch.cuda.empty_cache()) and retry")
        self._ipc_buffer = found
        return found

    def pack_all(self, plan, flats, buf):
        """Packs the whole update into `buf` (tensor at its stream offset)
        and waits for it: the daemon reads it from another process."""
        import torch
        self.pack_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.pack_stream):
            for off, n, f in zip(plan["tensor_offsets"], plan["payload_bytes"], flats):
                if n:
                    buf[off:off + n].copy_(f, non_blocking=True)
        self.pack_stream.synchronize()

    def pack_slot(self, chunk, flats, buf, offset):
        """Packs one chunk's pieces into buf[offset:] (an IPC ring slot) on
        the pack stream, after the work queued on the current stream (where
        tensors were made or written), and waits for it: the daemon reads
        the slot from another process once the chunk is announced."""
        import torch
        self.pack_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.pack_stream):
            for p in chunk["pieces"]:
                src = flats[p["tensor"]]
                at = offset + p["chunk_offset"]
                buf[at:at + p["length"]].copy_(
                    src[p["tensor_offset"]:p["tensor_offset"] + p["length"]], non_blocking=True)
        self.pack_stream.synchronize()

    def ipc_source(self, handle, size):
        a = v1.Allocation(kind=v1.MEMORY_CUDA_IPC, handle=handle, size=size,
                          device_uuid=gpu_uuid(self.device))
        return a

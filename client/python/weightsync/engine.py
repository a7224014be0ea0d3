"""Engine side: offer an engine worker's weights to weightsyncd.

Host backend: the parameters live in one POSIX shared-memory object this
client creates; `register_host` returns numpy views of them, which the
engine uses as its weights (or copies from). A background thread serves the
control stream: it runs the pause/resume hooks, records the committed
version (tag responses with `engine.version`) and acknowledges each notice.

    engine = weightsync.Engine("worker-0")
    weights = engine.register_host([("w", "FLOAT32", (4, 8))])
    engine.start(on_pause=pause_generation, on_resume=resume_generation)

GPU (torch CUDA parameters, registered in place by CUDA IPC handle):

    engine.register_torch(model)          # or model.named_parameters()
    engine.start(on_pause=..., on_resume=...)
"""

import itertools
import math
import operator
import os
import re
import queue
import threading
import time
import numpy as np

from weightsync import _shm
from weightsync._dtypes import normalise_params
from weightsync._errors import UsageError, WeightSyncError
from weightsync._proto import Stub, channel, default_target, v1
from weightsync._tensors import STORAGE
from weightsync._watch import MemoryWatch
from weightsync import planner


def lay_out_shared(params, prefix, track=False):
    """Lays out `params` [(name, dtype enum name, shape)] 256-byte aligned
    in a new shared-memory object named prefix-<random>. Returns (region,
    offsets, {dtype name: v1 enum}, {name: numpy array over the region}),
    the region a weightsync._shm.SharedRegion: every array keeps its
    mapping alive, whatever happens to the region or its owner.
    Offsets by numpy over columns (each parameter starts at the previous
    one's start plus its size rounded up to the alignment), the dtype work
    once per distinct dtype; what is left per parameter is its numpy view
    (bench/manifest_scale.py). ValueError naming an unsupported dtype.
    `track`: as weightsync._shm.create's."""
    names, dtypes, shapes = zip(*params) if params else ((), (), ())
    n = len(names)
    esizes = {}
    for dtype in set(dtypes):
        esize = planner.element_size(dtype)
        if esize is None or dtype not in STORAGE:
            name = names[dtypes.index(dtype)]
            raise UsageError(f"parameter '{name}': dtype {dtype!r} is not supported")
        esizes[dtype] = esize
    counts = np.fromiter(map(math.prod, shapes), np.int64, n)
    nbytes = counts * np.fromiter(map(esizes.__getitem__, dtypes), np.int64, n)
    align = planner.ALIGNMENT - 1
    ends = np.cumsum((nbytes + align) & ~align)
    offsets = np.concatenate(([0], ends[:-1])) if n else ends
    total = int(offsets[-1] + nbytes[-1]) if n else 0
    shm = _shm.create(prefix, total, track)
    enums = {d: getattr(v1, d) for d in esizes}
    storage = {d: np.dtype(STORAGE[d]) for d in esizes}
    offsets = offsets.tolist()
    arrays = dict(zip(names, shm.arrays(shapes, map(storage.__getitem__, dtypes), offsets)))
    if not counts.all():
        # numpy views no bytes of an empty shape over a buffer: own arrays.
        for i in np.flatnonzero(counts == 0).tolist():
            arrays[names[i]] = np.zeros(shapes[i], storage[dtypes[i]])
    return shm, offsets, enums, arrays


def _take(seq, indices):
    """[seq[i] for i in indices] by one C-level call."""
    indices = indices.tolist()
    if len(indices) == 1:
        return [seq[indices[0]]]
    return list(operator.itemgetter(*indices)(seq)) if indices else []


def _fill_parameters(request, names, dtypes, shapes, allocations, offsets, segments,
                     quantization):
    """Adds the parameters, given as columns (registered names, dtype enum
    names, shapes, allocation indices, byte offsets; sequences or numpy
    arrays of one entry each), to `request`: those named in `segments` or
    `quantization` as Parameter messages, every other one as a row of
    request.parameter_table (docs/protocol.md, "Parameter table"), which
    the daemon reads as the same Parameter. The rows are built by C-level
    passes (map, extend, numpy), not a Python step per parameter: 100k
    rows are a few hundredths of a second where 100k messages took
    tenths."""
    names = list(names)
    n = len(names)
    allocations = np.asarray(allocations, np.int32).reshape(n)
    offsets = np.asarray(offsets, np.int64).reshape(n)
    enums = {d: getattr(v1, d) for d in set(dtypes)}
    special = set(segments or ()) | set(quantization or ())
    if special:
        is_special = np.fromiter(map(special.__contains__, names), bool, n)
        for i in np.flatnonzero(is_special).tolist():
            name = names[i]
            p = request.parameters.add(name=name, dtype=enums[dtypes[i]], shape=shapes[i],
                                       allocation=int(allocations[i]), offset=int(offsets[i]))
            for seg in (segments or {}).get(name, ()):
                p.segments.add(**seg)
            if quantization and name in quantization:
                _set_quantization(p, quantization[name])
        rows = np.flatnonzero(~is_special)
        names, dtypes, shapes = (_take(c, rows) for c in (names, dtypes, shapes))
        allocations, offsets = allocations[rows], offsets[rows]
    if len(names) == 0:
        return
    t = request.parameter_table
    t.names.extend(names)
    t.dtypes.extend(map(enums.__getitem__, dtypes))
    t.ranks.extend(map(len, shapes))
    t.dims.extend(itertools.chain.from_iterable(shapes))
    t.allocations.extend(allocations.tolist())
    t.offsets.extend(offsets.tolist())


def _set_quantization(parameter, fields):
    """Fills parameter.quantization from a dict of Quantization fields
    (enum values by name or number)."""
    from google.protobuf import json_format
    json_format.ParseDict(dict(fields), parameter.quantization)


class Engine:
    def __init__(self, engine_id, target=None, timeout=30.0, trainer_uids=()):
        """`trainer_uids`: only trainers running as these uids (or root)
        may update this engine (empty: any trainer the daemon admits)."""
        self.engine_id = engine_id
        self._trainer_uids = list(trainer_uids)
        self._channel = channel(target or default_target())
        self._stub = Stub(self._channel, "EngineService", timeout,
                          target=target or default_target())
        self._shm = None
        self._outbox = None
        self._thread = None
        self._responses = None
        self._lock = threading.Condition()
        self.version = 0
        self.paused = False
        self.dirty = False
        self.aliases = {}
        self._torch_params = None
        self._registration = None
        self._watch = None    # weightsync._watch.MemoryWatch of what was registered
        self.lost = None      # why the engine told the daemon its memory is gone
        self._closing = False
        self.reconnects = 0   # re-registrations after the daemon went away

    def register_host(self, params, version=0, segments=None, quantization=None):
        """Lays out `params` [(name, dtype, shape)] in shared memory
        (256-byte aligned), registers them and returns {name: numpy
        array}; each array keeps its memory mapped for as long as it
        lives. A dtype is the wire's enum name ("BFLOAT16") or a numpy or
        torch spelling ("bfloat16", np.float16, torch.float32). `segments` maps a parameter name to a list of
        weightsync.v1.Segment field dicts (checkpoint layout, see
        docs/protocol.md); without, each parameter is the checkpoint tensor
        of the same name and shape. `quantization` maps the name of an FP8
        parameter to weightsync.v1.Quantization fields (enum values by
        name), e.g. from layouts.llama_fp8_engine_layout: the daemon
        quantises what feeds it and writes the scales into the parameter
        named by scale_parameter (docs/protocol.md, "FP8 targets"); FP8
        arrays hold the encodings as uint8."""
        params = normalise_params(params)
        segments = segments or {}
        quantization = quantization or {}
        # Shared-memory names allow no "/" and Python's resource tracker
        # splits on ":", both legal in engine ids: anything but [\w.-]
        # becomes "_" (the id itself is sent as it is).
        safe_id = re.sub(r"[^\w.-]", "_", self.engine_id)
        self._shm, offsets, enums, arrays = lay_out_shared(
            params, f"weightsync-{safe_id}-{os.getpid()}")
        request = v1.RegisterEngineRequest(engine_id=self.engine_id, version=version,
                                           trainer_uids=self._trainer_uids)
        request.allocations.add(kind=v1.MEMORY_HOST_SHM, handle=self._shm.handle.encode(),
                                size=self._shm.size, device_uuid="host")
        names, dtypes, shapes = zip(*params) if params else ((), (), ())
        _fill_parameters(request, names, dtypes, shapes, np.zeros(len(params), np.int32),
                         offsets, segments, quantization)
        try:
            self._stub.call("RegisterEngine", request)
        except BaseException:
            # Refused (or unreachable): leave no shared memory behind.
            arrays.clear()
            self._shm.unlink()
            self._shm = None
            raise
        self._registration = request
        self._watch = MemoryWatch(arrays)
        self.lost = None
        self.version = version
        return arrays

    def register_torch(self, params, version=0, segments=None, names=None, quantization=None):
        """Registers torch CUDA tensors in place: the daemon writes straight
        into them. `params` is a torch.nn.Module (its named_parameters()) or
        (name, tensor) pairs. Each tensor must be contiguous. Parameters are
        grouped by the caching-allocator segment they live in (one
        Allocation per segment: its CUDA IPC handle from torch's storage
        sharing, the GPU's UUID); each Parameter points at its byte offset
        in the segment. A name whose tensor is the same memory as an
        earlier one (tied embeddings) is left out (see `self.aliases`):
        the trainer sends the tensor once under the kept name.
        `segments` maps a parameter name to Segment dicts (checkpoint
        layout, e.g. from weightsync.layouts); without, each parameter is
        the checkpoint tensor of the same name and shape. `names` maps a
        parameter name to the name it is registered under. `quantization`:
        as register_host's: FP8 weights (torch.float8_e4m3fn / float8_e5m2
        tensors) and their float32 scale tensors, which the daemon's GPU
        backends quantise into and write on the GPU. Returns
        {registered name: tensor}."""
        import torch
        from weightsync._gpu import allocation_columns, dedupe_aliases, dtype_names
        from weightsync._gpu import ipc_location_columns
        if hasattr(params, "named_parameters"):
            params = params.named_parameters()
        pairs, self.aliases = dedupe_aliases(params)
        if not pairs:
            raise ValueError("no parameters to register")
        # Columns, each by one C-level pass (a 100k-tensor mixture of experts
        # pays no Python step per parameter).
        regs = list(map(operator.itemgetter(0), pairs))
        if names:
            regs = list(map(names.get, regs, regs))
        tensors = list(map(operator.itemgetter(1), pairs))
        dts = dtype_names(pairs)
        devices = set(map(torch.Tensor.device.__get__, tensors))
        keys, group, offsets, nbytes = ipc_location_columns(pairs)
        shapes = list(map(torch.Tensor.shape.__get__, tensors))
        for d in devices:
            torch.cuda.synchronize(d)   # initialised before the daemon may write
        allocations, alloc_index, offsets = allocation_columns(regs, keys, group, offsets, nbytes)
        request = v1.RegisterEngineRequest(engine_id=self.engine_id, version=version,
                                           trainer_uids=self._trainer_uids)
        for a in allocations:
            request.allocations.add(kind=v1.MEMORY_CUDA_IPC, handle=a["handle"], size=a["size"],
                                    device_uuid=a["device_uuid"])
        _fill_parameters(request, regs, dts, shapes, alloc_index, offsets, segments,
                         quantization)
        out = dict(zip(regs, tensors))
        self._stub.call("RegisterEngine", request)
        self._registration = request
        self._torch_params = out   # keep the memory alive while registered
        self._watch = MemoryWatch(out)
        self.lost = None
        self.version = version
        return out

    def start(self, on_pause=None, on_resume=None, on_new_version=None, on_dirty=None):
        """Opens the control stream and serves notices on a daemon thread.
        A hook that raises refuses the notice (the daemon sees the message).

        If the stream breaks because the daemon went away (it crashed or
        was restarted), the thread re-registers the same memory with the
        engine's current version, then reopens the stream, retrying with
        backoff until close(). An engine paused for an update when its
        daemon vanished may hold part of that update: it re-registers as
        dirty (RegisterEngineRequest.dirty) and stays paused until an
        update cleans it."""
        hooks = {"pause": on_pause, "resume": on_resume, "new_version": on_new_version,
                 "dirty": on_dirty}
        self._open_stream()

        def serve():
            backoff = 0.05
            while not self._closing:
                try:
                    for notice in self._responses:
                        backoff = 0.05
                        kind = notice.WhichOneof("kind")
                        if kind == "pause":
                            # Before the Ack: no byte of the update is written
                            # to memory that is gone (docs/protocol.md, Control).
                            self._check_memory()
                        ok, message = True, ""
                        try:
                            self._apply(kind, notice, hooks.get(kind))
                        except Exception as e:  # the engine refuses: tell the daemon
                            ok, message = False, f"{type(e).__name__}: {e}"
                        ack = v1.EngineMessage()
                        ack.ack.notice_id = notice.notice_id
                        ack.ack.ok = ok
                        ack.ack.message = message
                        self._outbox.put(ack)
                        if kind == "resume":
                            self._check_memory()
                except Exception:
                    pass  # stream broken (close(), or the daemon went away)
                # The daemon went away: register again and reopen the stream.
                while not self._closing:
                    time.sleep(backoff)
                    backoff = min(2.0, backoff * 2)
                    try:
                        self._reregister()
                        self._open_stream()
                        self.reconnects += 1
                        break
                    except Exception:
                        continue

        self._thread = threading.Thread(target=serve, name=f"weightsync-{self.engine_id}",
                                        daemon=True)
        self._thread.start()

    def _check_memory(self):
        """At a pause (before its Ack) or a resume (after it): if a
        registered tensor no longer holds the registered memory, tell the
        daemon (a refused Ack of notice 0: docs/protocol.md, "Control"): it
        unregisters the engine and names why. The engine does not
        re-register that memory; register again to come back."""
        why = self._watch.changed() if self._watch is not None else None
        if why is None or self.lost is not None:
            return
        self.lost = why
        self._registration = None   # never re-register memory that is gone
        message = v1.EngineMessage()
        message.ack.notice_id = 0   # no notice has id 0: "my memory is gone"
        message.ack.ok = False
        message.ack.message = why
        self._outbox.put(message)

    def _open_stream(self):
        if self._outbox is not None:
            self._outbox.put(None)  # ends the old request iterator
        outbox = queue.Queue()
        hello = v1.EngineMessage()
        hello.hello.engine_id = self.engine_id
        outbox.put(hello)

        def requests():
            while True:
                m = outbox.get()
                if m is None:
                    return
                yield m

        self._outbox = outbox
        self._responses = self._stub.stream("Control", requests())

    def _reregister(self):
        if self._registration is None:
            raise WeightSyncError("FAILED_PRECONDITION", "never registered")
        request = v1.RegisterEngineRequest()
        request.CopyFrom(self._registration)
        request.version = self.version
        # Paused for an update when the daemon vanished: maybe half written.
        request.dirty = self.dirty or self.paused
        self._stub.call("RegisterEngine", request)
        if request.dirty:
            self.dirty = True

    def _apply(self, kind, notice, hook):
        if kind == "pause":
            if hook:
                hook(v1.enum_name("PauseMode", notice.pause.mode))
            self.paused = True
        elif kind == "resume":
            if hook:
                hook()
            self.paused = False
        elif kind == "new_version":
            with self._lock:
                self.version = notice.new_version.version
                self.dirty = False
                self._lock.notify_all()
            if hook:
                hook(notice.new_version.version)
        elif kind == "dirty":
            self.dirty = True
            if hook:
                hook(notice.dirty.reason)

    def wait_for_version(self, version, timeout=10.0):
        """Blocks until the committed version is at least `version`: True,
        or False after `timeout` seconds (docs/python.md)."""
        with self._lock:
            return self._lock.wait_for(lambda: self.version >= version, timeout)

    def unregister(self, timeout=5.0):
        """Tells the daemon to forget this engine (no update reaches it
        after this returns) and ends the control stream; the shared
        memory's name goes too. Arrays and tensors it returned stay valid
        memory. The engine may register again. Idempotent: an engine not
        registered (never, or expired by the daemon for want of a start())
        is left as it is."""
        registered, self._registration = self._registration is not None, None
        self._stop_serving()
        if registered:
            try:
                self._stub.call("UnregisterEngine", engine_id=self.engine_id,
                                timeout=min(self._stub.timeout, timeout))
            except WeightSyncError as e:
                # Gone already (its stream closed, or it expired); a daemon
                # that is down forgets it on its own.
                if e.code not in ("NOT_FOUND", "UNAVAILABLE"):
                    raise
        self._torch_params = None
        if self._shm is not None:
            # The name goes; the memory stays mapped while any array the
            # engine was given still views it (weightsync._shm).
            self._shm.unlink()
            self._shm = None

    def _stop_serving(self):
        self._closing = True
        if self._outbox is not None:
            self._outbox.put(None)
        if self._responses is not None:
            self._responses.cancel()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        self._thread = self._responses = self._outbox = None
        self._closing = False

    def close(self):
        """Unregisters the engine (see unregister()), ends the control
        stream and the connection. Nothing stays registered."""
        try:
            self.unregister(timeout=1.0)   # a daemon that is down is not waited for
        finally:
            self._closing = True
            self._stub.close()

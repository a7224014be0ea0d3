"""Trainer side: push named tensors through weightsyncd into engines.

    trainer = weightsync.Trainer()              # the local daemon's socket
    trainer.init_host()                          # host backend (no GPU)
    with trainer.paused():                       # optional: engines paused
        result = trainer.update(model.state_dict().items(), version=step)

Thread-compatible: one update at a time per Trainer. Every call has a
deadline; errors raise WeightSyncError with the daemon's code and message.
"""

import contextlib
import itertools
import uuid

from weightsync import planner
from weightsync._errors import WeightSyncError
from weightsync._proto import Stub, channel, default_target, v1
from weightsync._tensors import describe
from weightsync.sparse import SparsePatch

import numpy as np


class Trainer:
    def __init__(self, target=None, timeout=30.0, stream_timeout=600.0):
        self._channel = channel(target or default_target())
        self._stub = Stub(self._channel, "TrainerService", timeout)
        self._timeout = timeout
        self._stream_timeout = stream_timeout

    def close(self):
        self._channel.close()

    def init_host(self):
        """Forms a host-backend transfer group; returns its id."""
        r = self._stub.call("InitWeightTransfer", backend=v1.BACKEND_HOST)
        return r.group_id

    def world_size(self):
        return self._stub.call("GetWorldSize").world_size

    def status(self):
        return self._stub.call("GetStatus")

    def pause(self, mode="keep", timeout=10.0, engine_ids=()):
        mode_value = {"abort": v1.PAUSE_MODE_ABORT, "wait": v1.PAUSE_MODE_WAIT,
                      "keep": v1.PAUSE_MODE_KEEP}[mode]
        return self._stub.call("Pause", mode=mode_value, timeout_ms=int(timeout * 1000),
                               engine_ids=list(engine_ids))

    def resume(self, allow_dirty=False, timeout=10.0, engine_ids=()):
        return self._stub.call("Resume", allow_dirty=allow_dirty,
                               timeout_ms=int(timeout * 1000), engine_ids=list(engine_ids))

    @contextlib.contextmanager
    def paused(self, mode="keep", timeout=10.0):
        """Engines paused inside the block, resumed after it (also on error,
        unless they are dirty: then Resume needs allow_dirty)."""
        self.pause(mode, timeout)
        try:
            yield self
        finally:
            self.resume(timeout=timeout)

    def update(self, named_tensors, version, chunk_bytes=0, update_id=None, engine_ids=(),
               mode="streaming", allow_streaming_fallback=False, verify=False,
               base_version=0):
        """Sends every (name, tensor) as weight version `version` (host
        backend: numpy arrays or CPU torch tensors). Returns the daemon's
        FinishWeightUpdateResponse (per-engine results, pause_seconds). The
        manifest is planned with the shared chunk planner, exactly as the
        daemon plans it. mode="staged": engines keep serving while the bytes
        arrive and pause only for the commit copy. verify=True: the daemon
        returns receipts and this client recomputes them from what it sent
        (through every engine's segments), raising DATA_LOSS on a mismatch;
        off by default here because on the host backend it costs several
        times the update (see bench/RESULTS.md). A tensor may be a
        weightsync.sparse.SparsePatch: only its elements travel, and the
        update applies only on engines at `base_version`."""
        update_id = update_id or f"update-{version}-{uuid.uuid4().hex[:8]}"
        names, data, manifest = [], [], []
        for name, tensor in named_tensors:
            if isinstance(tensor, SparsePatch):
                dtype, _, values = describe(name, tensor.values)
                names.append(name)
                data.append(np.concatenate([tensor.indices.astype("<i8").view(np.uint8),
                                            values]))
                manifest.append({"name": name, "dtype": dtype, "shape": list(tensor.shape),
                                 "sparse_nnz": len(tensor.indices)})
                continue
            dtype, shape, raw = describe(name, tensor)
            names.append(name)
            data.append(raw)
            manifest.append({"name": name, "dtype": dtype, "shape": list(shape)})
        request = v1.StartWeightUpdateRequest(
            update_id=update_id, target_version=version, chunk_bytes=chunk_bytes,
            engine_ids=list(engine_ids),
            mode={"streaming": v1.UPDATE_MODE_STREAMING,
                  "staged": v1.UPDATE_MODE_STAGED}[mode],
            allow_streaming_fallback=allow_streaming_fallback,
            verify=v1.VERIFY_ON if verify else v1.VERIFY_OFF,
            sparse_base_version=base_version,
            tensors=[v1.TensorSpec(name=m["name"], dtype=getattr(v1, m["dtype"]),
                                   shape=m["shape"], sparse_nnz=m.get("sparse_nnz", 0))
                     for m in manifest])
        started = self._stub.call("StartWeightUpdate", request)
        plan = planner.plan_chunks(manifest, started.chunk_bytes)

        def chunks():
            for chunk in plan["chunks"]:
                buf = bytearray(chunk["size"])  # padding stays zero
                for p in chunk["pieces"]:
                    src = data[p["tensor"]]
                    buf[p["chunk_offset"]:p["chunk_offset"] + p["length"]] = \
                        src[p["tensor_offset"]:p["tensor_offset"] + p["length"]].tobytes()
                yield v1.PushChunksRequest(update_id=update_id, chunk_index=chunk["index"],
                                           data=bytes(buf))

        try:
            self._stub.call("PushChunks", chunks(), timeout=self._stream_timeout)
        except WeightSyncError as pushed:
            # Let the daemon end the update (and say which engines are dirty).
            try:
                self.finish(update_id)
            except WeightSyncError as finished:
                raise finished from pushed
            raise
        finished = self.finish(update_id)
        if verify:
            self._check_receipts(finished, names, manifest, data)
        return finished

    def _check_receipts(self, finished, names, manifest, data):
        from weightsync.receipts import expected_receipt
        sent = {m["name"]: (m["dtype"], m["shape"], d) for m, d in zip(manifest, data)
                if not m.get("sparse_nnz")}  # receipts cover dense tensors
        layouts = {e.engine_id: e.layout
                   for e in self._stub.call("GetStatus", include_layouts=True).engines}
        for r in finished.engines:
            if not r.HasField("receipt") or r.lost or r.engine_id not in layouts:
                continue
            checksum, _, nbytes = expected_receipt(layouts[r.engine_id], sent)
            if checksum != r.receipt.checksum or nbytes != r.receipt.bytes:
                raise WeightSyncError(
                    "DATA_LOSS", f"engine '{r.engine_id}' receipt {r.receipt.checksum:016x} "
                    f"over {r.receipt.bytes} bytes does not match {checksum:016x} over "
                    f"{nbytes} bytes computed from what was sent")

    def finish(self, update_id):
        # The daemon waits two thirds of our deadline for the bytes, so its
        # answer (even an abort) arrives before we give up.
        return self._stub.call("FinishWeightUpdate", update_id=update_id,
                               timeout_ms=int(self._timeout * 1000 * 2 / 3))

    def abort(self, update_id, reason=""):
        return self._stub.call("AbortWeightUpdate", update_id=update_id, reason=reason)

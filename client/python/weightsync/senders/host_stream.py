"""Host backend, one daemon: the bytes streamed (PushChunks).

A dense update is described once per set of names, dtypes and shapes
(weightsync._tensors.build_manifest) and registered with the daemon as a
source without memory; a repeated update names that source, and both sides
reuse the chunk plan. An update with SparsePatches sends its manifest with
Start. An update with LazyTensors packs each chunk on the caller's thread,
making each tensor just before the first chunk that holds its bytes.
"""

import operator

from weightsync import lazy as _lazy
from weightsync import planner
from weightsync._errors import WeightSyncError
from weightsync._proto import v1
from weightsync._tensors import build_manifest, describe
from weightsync.lazy import LazyTensor
from weightsync.senders.base import Job, Sender, sent_of, specs
from weightsync.sparse import SparsePatch, TorchSparsePatch
from weightsync.wire_fp8 import WireFp8

_second = operator.itemgetter(1)


def has_patches(named_tensors):
    """True if any tensor of the (name, tensor) pairs is a SparsePatch or
    a WireFp8 (described with Start, not registered): one pass over the
    distinct types, not an isinstance per tensor."""
    types = set(map(type, map(_second, named_tensors)))
    return any(issubclass(t, (SparsePatch, WireFp8)) for t in types)


def describe_host(named_tensors):
    """(payloads, manifest dicts) of host (name, tensor) pairs: numpy
    arrays, CPU torch tensors or SparsePatches."""
    data, manifest = [], []
    for name, tensor in named_tensors:
        if isinstance(tensor, WireFp8):
            payload = tensor.payload()
            if hasattr(payload, "cpu"):
                payload = payload.cpu().numpy()
            data.append(payload)
            manifest.append({"name": name, "dtype": tensor.dtype, "shape": list(tensor.shape),
                             "quantization": tensor.fields})
            continue
        if isinstance(tensor, SparsePatch):
            if not tensor.nnz:
                raise ValueError(f"tensor '{name}': an empty patch (sparse_nnz 0 means a "
                                 "dense tensor on the wire); leave the tensor out or "
                                 "send it dense (weightsync.sparse.diff never returns one)")
            payload = tensor.payload()
            if isinstance(tensor, TorchSparsePatch):
                from weightsync._gpu import dtype_name
                dtype = dtype_name(name, tensor.values)
                if hasattr(payload, "cpu"):
                    payload = payload.cpu().numpy()
            else:
                dtype = describe(name, tensor.values)[0]
            data.append(payload)
            manifest.append({"name": name, "dtype": dtype, "shape": list(tensor.shape),
                             "sparse_nnz": int(tensor.nnz),
                             "sparse_index_bytes": tensor.index_bytes})
            continue
        dtype, shape, raw = describe(name, tensor)
        data.append(raw)
        manifest.append({"name": name, "dtype": dtype, "shape": list(shape)})
    return data, manifest


def wire_sources(named_tensors):
    """{name: (dtype, shape, bytes)} of the tensors given quantised on the
    wire (WireFp8), as they were before quantisation: what the receipts
    expect the engines' FP8 targets to hold."""
    return {name: describe(name, t.source) for name, t in named_tensors
            if isinstance(t, WireFp8)}


def expect_host(sent):
    """expected(layout, key) of host bytes `sent` ({name: (dtype, shape,
    bytes)} or a Manifest's sent())."""
    from weightsync.receipts import expected_receipt
    return lambda layout, key: expected_receipt(layout, sent, layout_key=key)


class HostStreamSender(Sender):
    """Streams host updates to one daemon (see the module docstring)."""

    def __init__(self, link):
        super().__init__(link)
        self._manifest = None    # the last dense update's Manifest
        self._source_id = None   # and its registered source

    def reset(self):
        """A new group keeps no sources."""
        self._source_id = None

    def describe(self, u):
        pairs = u.pairs()
        if not has_patches(pairs):
            return self._describe_dense(u, pairs)
        data, manifest = describe_host(pairs)
        request = u.request(sparse_base_version=u.base_version, tensors=specs(manifest))
        return Job(request, manifest=manifest, payloads=data,
                   plan=lambda chunk_bytes: (planner.plan_chunks(manifest, chunk_bytes), None),
                   check=self.receipts(expect_host(sent_of(manifest, data, wire_sources(pairs))))
                   if u.verify else None)

    def _registered(self, named_tensors):
        """(Manifest, source id) of a dense host update: the manifest is
        described with per-dtype work done once (build_manifest) and
        registered with the daemon once; an update of the same names, dtypes
        and shapes reuses the registered source, so neither side describes,
        validates nor plans it again."""
        prev = self._manifest
        m = build_manifest(named_tensors, previous=prev)
        if self._source_id is None or not m.same_as(prev):
            request = v1.RegisterSourceRequest(tensors=[
                v1.TensorSpec(name=n, dtype=getattr(v1, d), shape=sh)
                for n, d, sh in zip(m.names, m.dtypes, m.shapes)])
            self._source_id = self.link.stub.call("RegisterSource", request).source_id
        self._manifest = m
        return m, self._source_id

    def _describe_dense(self, u, pairs):
        """A dense update from a registered source (manifest only): Start
        names the source, the chunks are packed from the manifest's byte
        views with the cached chunk plan."""
        m, source_id = self._registered(pairs)
        job = Job(u.request(source_id=source_id), manifest=m, payloads=m.payloads)

        def retry():   # a new group (Init) or an evicted source: register again
            self._source_id = None
            job.manifest, source_id = self._registered(pairs)
            job.payloads = job.manifest.payloads
            return u.request(source_id=source_id)

        def plan(chunk_bytes):
            cached = planner.plan_chunks_cached(job.manifest, job.manifest, chunk_bytes)
            return cached, job.manifest.chunk_parts(cached)

        job.retry, job.plan = retry, plan
        if u.verify:
            job.check = lambda results: self.link.check_receipts(
                results, expect_host(job.manifest.sent()), keyed=True)
        return job

    def send(self, u, job, started):
        """Streams the planned chunks, packed from the payloads (or joined
        from the plan's parts, one list per chunk: planner.chunk_parts)."""
        if job.plan is None:   # a lazy update: packed as the stream takes them
            return self._send_lazy(u, job, started)
        plan, parts = job.plan(started[0].chunk_bytes)
        payloads = job.payloads

        def chunks():
            for i, chunk in enumerate(plan["chunks"]):
                data = (b"".join(parts[i]) if parts is not None
                        else planner.pack_chunk(chunk, payloads))
                yield v1.PushChunksRequest(update_id=u.update_id, chunk_index=chunk["index"],
                                           data=data)

        try:
            self.link.stub.call("PushChunks", chunks(), timeout=self.link.stream_timeout)
        except WeightSyncError as pushed:
            self.link.finish_after_failure(u.update_id, pushed)

    # -- lazy tensors ---------------------------------------------------------

    def describe_lazy(self, u):
        """The chunks are packed on this thread as the stream takes them
        (two ahead at most), each lazy tensor made (a numpy array or CPU
        torch tensor) before the first chunk holding its bytes and dropped
        after the last."""
        data, manifest, lazy = [], [], {}
        for i, (name, t) in enumerate(u.pairs()):
            if isinstance(t, LazyTensor):
                lazy[i] = t
                data.append(None)
                manifest.append({"name": name, "dtype": t.dtype, "shape": list(t.shape)})
            else:
                d, m = describe_host([(name, t)])
                data += d
                manifest += m
        job = Job(None, manifest=manifest, payloads=data, lazy=lazy, plan=None, progress=None)
        if u.verify:
            from weightsync.receipts import expected_receipt
            engines, job.progress = self.link.lazy_receipts(
                u.engine_ids, manifest, lambda layouts, sent: {
                    k: expected_receipt(layout, sent)[0] for k, layout in layouts.items()})
            job.progress.add({m["name"]: (m["dtype"], m["shape"], d)
                              for i, (m, d) in enumerate(zip(manifest, data))
                              if i not in lazy and not m.get("sparse_nnz")})
            job.check = lambda results: self.link.check_lazy_receipts(results, engines,
                                                                      job.progress)
        job.request = u.request(sparse_base_version=u.base_version, tensors=specs(manifest))
        return job

    def _send_lazy(self, u, job, started):
        manifest, progress = job.manifest, job.progress
        plan = planner.plan_chunks(manifest, started[0].chunk_bytes)

        def make(i, entry):
            name = manifest[i]["name"]
            dtype, shape, raw = describe(name, entry.materialize())
            _lazy.check_materialized(name, entry, dtype, shape)
            if progress is not None:
                progress.add({name: (dtype, list(shape), raw)})
            return raw

        feed = _lazy.Feed(plan, job.lazy, make)
        self._push_lazy(u.update_id, plan, job.payloads, feed)
        self.link.last_lazy = {"made": feed.made, "peak_bytes": feed.peak_bytes,
                               "window_bytes": max(_lazy.window_bytes(plan, set(job.lazy)),
                                                   default=0)}

    def _push_lazy(self, update_id, plan, payloads, feed):
        """Streams the chunks of `plan` (PushChunks), each packed on this
        thread (where feed makes the lazy tensors: an FSDP gather belongs
        on the thread that runs the collectives) and handed to gRPC's
        sending thread through a queue of two. A failure here cancels the
        stream and aborts the update; one of the stream lets the daemon end
        the update and raises its error."""
        import grpc
        import queue
        pending = queue.Queue(maxsize=2)
        end = object()

        def requests():
            while True:
                item = pending.get()
                if item is end:
                    return
                yield item

        future = self.link.stub.future("PushChunks", requests(), self.link.stream_timeout)

        def put(item):
            while not future.done():
                try:
                    pending.put(item, timeout=0.05)
                    return True
                except queue.Full:
                    pass
            return False

        try:
            for chunk in plan["chunks"]:
                k = chunk["index"]
                feed.before(k, payloads)
                data = planner.pack_chunk(chunk, payloads)
                feed.after(k, payloads)
                if not put(v1.PushChunksRequest(update_id=update_id, chunk_index=k, data=data)):
                    break
            put(end)
        except BaseException as e:
            future.cancel()
            self.link.abort_started(update_id, 1, f"trainer: {type(e).__name__}: {e}")
            raise
        try:
            future.result()
        except grpc.FutureCancelledError:
            pushed = WeightSyncError("CANCELLED", "the chunk stream was cancelled")
        except grpc.RpcError as e:
            pushed = WeightSyncError(e.code().name, e.details())
        else:
            return
        self.link.finish_after_failure(update_id, pushed)

"""Host backend: updates from a HostSource (Trainer.host_tensors), shared
memory this trainer owns and registered with the daemon once. An update is
one call (Start with finish) in which the daemon copies from that memory:
nothing is packed or streamed. With receipts, the expectation for the
layouts the engines had last time is computed on a thread while the daemon
copies (the tensors don't change during update()); a layout not seen
before is computed after.
"""

import os
import threading

from weightsync._proto import v1
from weightsync.host_source import HostSource
from weightsync.senders.base import Job, Sender


def register_host_memory(stub, source):
    """Registers HostSource `source` (its names, dtypes, shapes and offsets
    in its shared memory) with the daemon of `stub`; returns the source id
    there."""
    m = source.manifest
    request = v1.RegisterSourceRequest(
        tensors=[v1.TensorSpec(name=n, dtype=getattr(v1, d), shape=sh)
                 for n, d, sh in zip(m.names, m.dtypes, m.shapes)])
    request.allocations.add(kind=v1.MEMORY_HOST_SHM, handle=source.handle.encode(),
                            size=source.size, device_uuid="host")
    add = request.placements.add
    for off in source.offsets.tolist():
        add(allocation=0, offset=off)
    return stub.call("RegisterSource", request).source_id


class HostSourceSender(Sender):
    """Makes HostSources and sends updates from them (module docstring).
    Owns the sources it made: close() closes them."""

    def __init__(self, link):
        super().__init__(link)
        self.sources = []

    def reset(self):
        """A new group keeps no sources: each registers again on use."""
        for src in self.sources:
            src.source_id = None
            src.source_ids = {}

    def close(self):
        for src in self.sources:
            src.close()
        self.sources = []

    def make(self, params):
        """Lays out `params` [(name, dtype enum name, shape)] in shared
        memory, registers it with every daemon (each opens the same memory:
        the host backend's daemons share this host's /dev/shm) and returns
        the HostSource."""
        from weightsync._dtypes import normalise_params
        from weightsync.engine import lay_out_shared
        params = normalise_params(params)   # numpy/torch dtype spellings too
        shm, offsets, _, arrays = lay_out_shared(params, f"weightsync-trainer-{os.getpid()}",
                                                 track=True)
        if len(arrays) != len(params):
            shm.unlink()
            raise ValueError("host_tensors: a tensor name appears twice")
        source = HostSource(shm, offsets, arrays)
        try:
            if self.link.multi:
                source.source_ids = {i: register_host_memory(stub, source)
                                     for i, stub in enumerate(self.link.stubs)}
                source.source_id = source.source_ids[0]
            else:
                source.source_id = register_host_memory(self.link.stub, source)
        except BaseException:
            source.close()
            raise
        self.sources.append(source)
        return source

    def find(self, pairs):
        """The HostSource whose arrays `pairs` are, in order, or None."""
        return next((s for s in self.sources if s.same_pairs(pairs)), None)

    def takes(self, u):
        """Whether this sender carries `u` (a streaming update of a
        HostSource or of exactly its arrays); sets u.source. A staged
        update of a HostSource becomes its (name, array) pairs."""
        pairs = u.named_tensors
        if isinstance(pairs, HostSource):
            u.source = pairs
            if u.mode != "streaming":
                u.named_tensors = list(zip(pairs.names, pairs.tensors))
        else:
            u.source = self.find(u.pairs())
        return u.source is not None and u.mode == "streaming"

    def describe(self, u):
        source = u.source
        if source.source_id is None and source.manifest is None:
            raise ValueError(f"{source!r} is closed")
        from weightsync.receipts import expected_receipt
        ahead, worker = {}, None
        known = [(k, self.link.layouts[k]) for k in source.layout_ids if k in self.link.layouts]
        if u.verify and known:
            def expect():
                for key, layout in known:
                    ahead[key] = expected_receipt(layout, source.sent(), layout_key=key)
            worker = threading.Thread(target=expect, name="weightsync-receipts", daemon=True)
            worker.start()

        def request():
            if source.source_id is None:
                source.source_id = register_host_memory(self.link.stub, source)
            return u.one_call_request(source.source_id, self.link.daemon_wait_ms())

        def retry():   # a new group (Init) or an evicted source: register again
            source.source_id = None
            return request()

        def check(results):
            source.layout_ids = {r.layout_id for r in results[0].engines if r.layout_id}
            self.link.check_receipts(results, lambda layout, key: ahead.get(key) or
                                     expected_receipt(layout, source.sent(), layout_key=key),
                                     keyed=True)

        try:
            return Job(request(), retry=retry, one_call=True, worker=worker,
                       check=check if u.verify else None)
        except BaseException:
            if worker is not None:
                worker.join()
            raise

    def start(self, u, job):
        try:
            return super().start(u, job)
        finally:
            if job.worker is not None:
                job.worker.join()

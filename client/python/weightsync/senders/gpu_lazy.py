"""The part of a GPU update with LazyTensors that nccl and ipc share: the
manifest (a LazyTensor keeps its place, its bytes made later), and the
receipts summed on the GPU as tensors are made (weightsync.lazy's
ProgressiveReceipts over senders.gpu_receipts.partial_receipts)."""

import time

from weightsync.lazy import LazyTensor
from weightsync.senders.base import Job, specs
from weightsync.senders.gpu_receipts import partial_receipts


def describe_lazy(link, gpu, u):
    """The Job of a GPU update with LazyTensors: manifest, names, flats
    (None where a tensor is still to be made), lazy ({index: LazyTensor}),
    progress and on_made(indices) (the receipts' running sums, None
    without verify), and the Start request."""
    from weightsync._gpu import elements
    t0 = time.perf_counter()
    names, flats, manifest, _ = gpu.manifest(u.pairs())
    lazy = {i: f for i, f in enumerate(flats) if isinstance(f, LazyTensor)}
    for i in lazy:
        flats[i] = None
    job = Job(u.request(sparse_base_version=u.base_version, tensors=specs(manifest)),
              t0=t0, names=names, flats=flats, manifest=manifest, lazy=lazy, progress=None,
              prepacked=(), on_made=None)
    if not u.verify:
        return job
    engines, progress = link.lazy_receipts(u.engine_ids, manifest, partial_receipts)
    progress.add({m["name"]: (m["dtype"], m["shape"], elements(f, m["dtype"]))
                  for i, (m, f) in enumerate(zip(manifest, flats))
                  if i not in lazy and not m.get("sparse_nnz")})

    def on_made(indices):
        progress.add({manifest[i]["name"]: (manifest[i]["dtype"], manifest[i]["shape"],
                                            elements(flats[i], manifest[i]["dtype"]))
                      for i in indices})

    job.progress, job.on_made = progress, on_made
    job.check = lambda results, stubs=None: link.check_lazy_receipts(results, engines,
                                                                      progress, stubs)
    return job

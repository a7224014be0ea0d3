"""A host trainer's weights in its own shared memory, registered once.

`Trainer.host_tensors(params)` lays the trainer's tensors out in a POSIX
shared-memory object (as `Engine.register_host` does for an engine),
registers them with the daemon as a source with memory and returns a
HostSource: a read-only mapping {name: numpy array} the trainer trains
into in place. `Trainer.update(source, version)` is then one RPC (Start
with finish): the daemon gathers the bytes from the trainer's memory and
writes the engines, with nothing packed, streamed or described in Python
(docs/protocol.md, "Registered sources"; docs/python.md).

Write into the arrays (`a[...] = ...`, `a += ...`), never rebind them;
after `close()` (or the Trainer's) they are no longer sent, but stay
readable memory for as long as Python holds them. Between update() calls
only; the daemon reads them while update() runs.
"""

import collections.abc
import operator

import numpy as np

from weightsync._tensors import SentView, build_manifest


class HostSource(collections.abc.Mapping):
    """{name: numpy array in the trainer's shared memory}, in send order.

    Attributes: `source_id` (the daemon's id while registered; with several
    daemons `source_ids`, one per daemon index), `manifest`
    (a weightsync._tensors.Manifest of the arrays: names, dtypes, shapes,
    byte views)."""

    def __init__(self, shm, offsets, arrays):
        self._shm = shm
        self._arrays = arrays
        self.names = tuple(arrays)
        self.tensors = tuple(arrays.values())
        self.offsets = np.asarray(offsets, np.int64)
        self.manifest = build_manifest(list(zip(self.names, self.tensors)))
        self.source_id = None
        self.source_ids = {}     # several daemons: {daemon index: source id}
        self.layout_ids = set()  # the engines' layouts at the last verified update
        self._sent = None

    @property
    def handle(self):
        """The shared-memory object's name, as the daemon opens it."""
        return self._shm.handle

    @property
    def size(self):
        return self._shm.size

    @property
    def buffer(self):
        """The whole shared memory as a flat uint8 numpy array (the tensors
        256-byte aligned in send order, padding between them): for bulk
        writes such as loading a checkpoint at once."""
        return self._shm.array((self._shm.size,), np.uint8)

    def same_pairs(self, pairs):
        """True if `pairs` [(name, tensor)] are exactly this source's arrays
        (the same objects, names and order): a few C-level passes."""
        if len(pairs) != len(self.names):
            return False
        return (tuple(map(_first, pairs)) == self.names
                and all(map(operator.is_, map(_second, pairs), self.tensors)))

    def sent(self):
        """The receipts' view of what an update sends (SentView) with a
        `gather` over the shared memory: weightsync.receipts reads every
        tensor's elements with one index into the buffer instead of joining
        100k small arrays."""
        if self._sent is None:
            self._sent = _GatherView(self)
        return self._sent

    def close(self):
        """Drops the arrays and removes the shared memory (the Trainer
        unregisters the source first)."""
        if self._shm is None:
            return
        self._arrays = {}
        self.tensors = ()
        self.manifest = None
        self._sent = None
        shm, self._shm = self._shm, None
        shm.unlink()   # arrays a caller still holds keep the mapping (_shm)

    def __getitem__(self, name):
        return self._arrays[name]

    def __iter__(self):
        return iter(self._arrays)

    def __len__(self):
        return len(self._arrays)

    def __repr__(self):
        return (f"HostSource({len(self.names)} tensors, {self.size} bytes in "
                f"{self.handle!r}, source {self.source_id})")


class _Gather:
    """The element indices receipts need, into one uint8 buffer: `u8` (the
    whole shared memory), `offsets` and `nbytes` per tensor in send order,
    and `cache` {id(entry key): (key, index)} kept across updates."""

    __slots__ = ("u8", "offsets", "nbytes", "cache")

    def __init__(self, source):
        self.u8 = source.buffer
        self.offsets = source.offsets
        self.nbytes = np.asarray(source.manifest.nbytes, np.int64)
        self.cache = {}


class _GatherView(SentView):
    __slots__ = ("gather",)

    def __init__(self, source):
        super().__init__(source.manifest)
        self.gather = _Gather(source)


_first = operator.itemgetter(0)
_second = operator.itemgetter(1)

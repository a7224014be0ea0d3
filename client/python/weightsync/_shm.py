"""POSIX shared memory the client creates and hands out views of.

Every numpy array made over a SharedRegion keeps the region's mapping
alive: its base chain ends at the region's `mmap.mmap`, which this module
never closes. The mapping goes when the last array (and the region) goes,
so dropping an Engine, a HostSource or a Trainer never leaves an array
pointing at unmapped memory (issue 30: `multiprocessing.shared_memory`
unmaps its buffer on close() and in __del__ even while numpy arrays view
it, and reading such an array killed the process with SIGSEGV).

The object is created with O_EXCL under /dev/shm (what shm_open uses on
Linux). An engine's object is not handed to Python's resource tracker: it
is the daemon's to reap when the engine dies (daemon/server/shm_reaper.h,
and the expiry of engines that never open their control stream), and the
tracker would only warn about "leaked" objects that are not leaked. A
trainer's source memory, which no daemon reaps, is (`track=True`).
"""

import mmap
import os
import secrets

import numpy as np

from weightsync._errors import WeightSyncError

SHM_DIR = "/dev/shm"


class SharedRegion:
    """A shared-memory object this process created, mapped read-write.

    `name` (without the leading "/"), `size` in bytes, `handle` (the
    "/name" the daemon opens). `array(shape, dtype, offset)` makes a view
    that holds the mapping. `unlink()` removes the name; the memory lives
    on while any view does."""

    __slots__ = ("name", "size", "_map", "_tracked")

    def __init__(self, name, size, mapping, tracked=False):
        self.name = name
        self.size = size
        self._map = mapping
        self._tracked = tracked

    @property
    def handle(self):
        return "/" + self.name

    def array(self, shape, dtype, offset=0):
        """A numpy array over the mapping (its .base chain holds it)."""
        return np.ndarray(shape, dtype, self._map, offset)

    def arrays(self, shapes, dtypes, offsets):
        """Arrays for columns of shapes, numpy dtypes and offsets, by one
        C-level map (no Python step per array)."""
        buf = self._map
        return map(lambda s, d, o: np.ndarray(s, d, buf, o), shapes, dtypes, offsets)

    def unlink(self):
        """Removes the name (idempotent). Mapped views stay valid."""
        try:
            os.unlink(os.path.join(SHM_DIR, self.name))
        except FileNotFoundError:
            pass
        if self._tracked:
            self._tracked = False
            from multiprocessing import resource_tracker
            resource_tracker.unregister(self.handle, "shared_memory")

    def __repr__(self):
        return f"SharedRegion({self.handle!r}, {self.size} bytes)"


def create(prefix, size, track=False):
    """A new SharedRegion named prefix-<random> of `size` bytes (at least
    1). The pid in a prefix is not enough: processes in different pid
    namespaces (two containers, two sandboxed tests) share /dev/shm and can
    have the same pid. An existing name is never taken over (it may be a
    live engine's, which its daemon may be about to open): a name that
    exists is skipped (O_EXCL) and another drawn. `track`: Python's
    resource tracker removes the object if this process ends without
    unlink()."""
    size = max(int(size), 1)
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
    for _ in range(8):
        name = f"{prefix}-{secrets.token_hex(4)}"
        path = os.path.join(SHM_DIR, name)
        try:
            fd = os.open(path, flags, 0o600)
        except FileExistsError:
            continue
        try:
            os.ftruncate(fd, size)
            mapping = mmap.mmap(fd, size)
        except BaseException:
            os.unlink(path)
            raise
        finally:
            os.close(fd)
        if track:
            from multiprocessing import resource_tracker
            resource_tracker.register("/" + name, "shared_memory")
        return SharedRegion(name, size, mapping, track)
    raise WeightSyncError("ALREADY_EXISTS", f"no free shared-memory name {prefix}-<random> "
                          "after 8 tries: is /dev/shm full of stale weightsync objects?")

"""Is an engine's registered memory still its weights? (issue 30)

The contract is "unregister before freeing": the daemon writes the memory
an engine registered, and an engine that frees its parameters (or moves
them: `param.data = ...`, an offload, a re-allocation) would otherwise go
on being called READY while serving weights the daemon no longer writes.
MemoryWatch records, at registration, every registered tensor's data
pointer and its storage's; `changed()` compares them again (the engine's
control thread asks at each pause and resume) and says which parameter
moved. Numpy arrays over the engine's shared memory can't move (they
keep their mapping, weightsync._shm); torch tensors can.

Cost: for torch tensors, three C-level passes over the tensors (data
pointers; storages; their pointers), no Python step per tensor unless
something changed. The check runs before the pause's Ack, on the update's
critical path: 100 us for Qwen3-8B's 399 tensors against 267 us with a
Python call per tensor (tests/gpu/check_watch_gpu.py, one H200,
2026-11-28).
"""

import operator
import sys

_NUMPY_PTR = operator.itemgetter(0)


def _pointers(obj):
    """(data pointer, storage pointer) of a torch tensor or numpy array."""
    ptr = getattr(obj, "data_ptr", None)
    if ptr is not None:   # torch (or a stand-in with its methods)
        storage = obj.untyped_storage() if hasattr(obj, "untyped_storage") else None
        return ptr(), storage.data_ptr() if storage is not None else None
    iface = getattr(obj, "__array_interface__", None)
    if iface is not None:
        return _NUMPY_PTR(iface["data"]), None
    return None, None


class MemoryWatch:
    """The registered tensors {name: tensor} and where they were."""

    __slots__ = ("_names", "_objs", "_where", "_fixed", "_torch", "_torch_where")

    def __init__(self, named):
        self._names = list(named)
        self._objs = list(named.values())
        self._where = list(map(_pointers, self._objs))
        # Numpy arrays never move their memory: nothing to check.
        self._fixed = all(hasattr(o, "__array_interface__") and not hasattr(o, "data_ptr")
                          for o in self._objs)
        torch = sys.modules.get("torch")
        self._torch = (torch if torch is not None and self._objs
                       and all(isinstance(o, torch.Tensor) for o in self._objs) else None)
        self._torch_where = self._torch_pointers() if self._torch is not None else None

    def _torch_pointers(self):
        """(data pointers, storage pointers) of every tensor, C-level."""
        t = self._torch
        return (tuple(map(t.Tensor.data_ptr, self._objs)),
                tuple(map(t.UntypedStorage.data_ptr, map(t.Tensor.untyped_storage, self._objs))))

    def changed(self):
        """None while every tensor is where it was registered; else a
        sentence naming the first parameter that is not."""
        if self._fixed:
            return None
        if self._torch is not None and self._torch_pointers() == self._torch_where:
            return None
        now = list(map(_pointers, self._objs))
        if now == self._where:
            return None
        for name, (p0, s0), (p1, s1) in zip(self._names, self._where, now):
            if (p0, s0) != (p1, s1):
                what = "its data pointer" if p0 != p1 else "its storage"
                return (f"parameter '{name}': {what} moved from 0x{(p0 if p0 != p1 else s0) or 0:x} "
                        f"to 0x{(p1 if p0 != p1 else s1) or 0:x} (freed or re-allocated since "
                        "registration)")
        return None

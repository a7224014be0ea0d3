"""A CPU stand-in for the few torch calls weightsync.senders.many_nccl
makes (tests only): tensors are numpy arrays (data_ptr is their real
address, so bytes "sent" by a fake communicator can be read back), streams
run everything at once, and events are done unless a test holds them
(`Event.held = True`: a receiver that never takes the sends).

    sys.modules["torch"] = fake_torch    # before the code under test imports torch
"""

import contextlib

import numpy as np

uint8 = np.dtype(np.uint8)
int16 = np.dtype(np.int16)
bfloat16 = np.dtype(np.int16)   # elements are only counted and moved here
float32 = np.dtype(np.float32)


class Tensor:
    is_cuda = True

    def __init__(self, a):
        self.a = a

    # shape and memory
    @property
    def shape(self):
        return self.a.shape

    @property
    def dtype(self):
        return self.a.dtype

    def numel(self):
        return self.a.size

    def data_ptr(self):
        return self.a.ctypes.data

    def is_contiguous(self):
        return self.a.flags.c_contiguous

    def detach(self):
        return self

    def contiguous(self):
        return self if self.is_contiguous() else Tensor(np.ascontiguousarray(self.a))

    def reshape(self, *shape):
        return Tensor(self.a.reshape(*shape))

    def view(self, *args):
        if len(args) == 1 and isinstance(args[0], np.dtype):
            return Tensor(self.a.view(args[0]))
        assert self.a.flags.c_contiguous, "view of a non-contiguous tensor"
        return Tensor(self.a.reshape(*args))

    def __getitem__(self, key):
        return Tensor(self.a[key])

    # work "on a stream": done at once
    def copy_(self, src, non_blocking=False):
        np.copyto(self.a, src.a.reshape(self.a.shape))
        return self

    def zero_(self):
        self.a[...] = 0
        return self

    def record_stream(self, stream):
        pass


def empty(n, dtype=uint8, device=None):
    return Tensor(np.full(n, 0xEE, dtype=dtype))   # not zero: padding must be written


def from_numpy(a):
    return Tensor(a)


class device:
    def __init__(self, kind, index=None):
        if isinstance(kind, device):
            kind, index = kind.type, kind.index
        if ":" in kind:
            kind, index = kind.split(":")[0], int(kind.split(":")[1])
        self.type, self.index = kind, index


class _Cuda:
    class Stream:
        _next = 1

        def __init__(self, device=None, priority=0):
            self.priority = priority
            self.cuda_stream = _Cuda.Stream._next
            _Cuda.Stream._next += 1

        def wait_stream(self, other):
            pass

        def wait_event(self, event):
            pass

        def synchronize(self):
            pass

    class Event:
        held = False     # a test's switch: no event completes

        def record(self, stream=None):
            pass

        def query(self):
            return not _Cuda.Event.held

    @staticmethod
    def current_device():
        return 0

    @staticmethod
    def current_stream(device=None):
        return _Cuda.Stream()

    @staticmethod
    @contextlib.contextmanager
    def stream(s):
        yield

    @staticmethod
    @contextlib.contextmanager
    def device(d):
        yield


cuda = _Cuda()

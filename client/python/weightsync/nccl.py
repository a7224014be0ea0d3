"""A minimal ctypes binding of NCCL (libnccl.so.2): what a trainer needs to
join a daemon's transfer group and broadcast bytes (rank 0), or send
them point to point (every rank of a sharded trainer, weightsync.senders.many_nccl).

No torch.distributed, no TCP store, no pickle: the 128-byte unique id
travels to the daemon inside InitWeightTransferRequest.

    uid = nccl.get_unique_id()               # 128 bytes
    comm = nccl.Communicator(world, uid, 0)  # blocks until every rank joins
    comm.broadcast(ptr, nbytes, root=0, stream=torch_stream.cuda_stream)

The library is found in this order: $NCCL_LIB (the .so file, or a folder
holding libnccl.so.2), a libnccl already loaded into this process (the one
torch loaded), the `nvidia` pip packages torch depends on
(nvidia/nccl/lib/libnccl.so.2 and similar), then the dynamic loader's
search path (LD_LIBRARY_PATH, ldconfig).
"""

import ctypes
import glob
import os
import sys
import threading

__all__ = ["NcclError", "find_library", "load", "get_unique_id", "version",
           "Communicator", "UNIQUE_ID_BYTES"]

UNIQUE_ID_BYTES = 128

# ncclResult_t
_SUCCESS = 0
_IN_PROGRESS = 7
_RESULT_NAMES = {0: "ncclSuccess", 1: "ncclUnhandledCudaError", 2: "ncclSystemError",
                 3: "ncclInternalError", 4: "ncclInvalidArgument", 5: "ncclInvalidUsage",
                 6: "ncclRemoteError", 7: "ncclInProgress"}
# ncclDataType_t
_UINT8 = 1


class NcclError(RuntimeError):
    """An NCCL call failed: `result` is the ncclResult_t, `message` NCCL's text."""

    def __init__(self, call, result, message):
        self.call = call
        self.result = result
        self.message = message
        super().__init__(f"{call} failed: {_RESULT_NAMES.get(result, result)} ({message})")


class _UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_char * UNIQUE_ID_BYTES)]


def _loaded_in_process():
    """Paths of libnccl objects already mapped into this process."""
    try:
        with open("/proc/self/maps") as f:
            found = []
            for line in f:
                path = line.split()[-1] if line.strip() else ""
                if "libnccl.so" in os.path.basename(path) and path not in found:
                    found.append(path)
            return found
    except OSError:
        return []


def _package_candidates(paths=None):
    out = []
    for base in (paths if paths is not None else sys.path):
        if not base or not os.path.isdir(os.path.join(base, "nvidia")):
            continue
        for pattern in ("nvidia/nccl/lib/libnccl.so*", "nvidia/*/lib/libnccl.so*"):
            for p in sorted(glob.glob(os.path.join(base, pattern))):
                if p not in out:
                    out.append(p)
    return out


def find_library(env=None, search_path=None, loaded=None, loader_name="libnccl.so.2"):
    """(candidates, tried): the library paths to try in order, and a
    description of every place looked at (for the error message)."""
    env = os.environ if env is None else env
    candidates, tried = [], []
    override = env.get("NCCL_LIB", "")
    if override:
        if os.path.isdir(override):
            hits = sorted(glob.glob(os.path.join(override, "libnccl.so*")))
            tried.append(f"NCCL_LIB={override} (folder: {len(hits)} libnccl.so*)")
            candidates += hits
        else:
            tried.append(f"NCCL_LIB={override}")
            candidates.append(override)
    in_process = _loaded_in_process() if loaded is None else loaded
    tried.append(f"loaded in this process ({len(in_process)})")
    candidates += [p for p in in_process if p not in candidates]
    pkg = _package_candidates(search_path)
    tried.append(f"nvidia pip packages on sys.path ({len(pkg)})")
    candidates += [p for p in pkg if p not in candidates]
    tried.append(f"the dynamic loader (LD_LIBRARY_PATH, ldconfig) for {loader_name}")
    candidates.append(loader_name)
    return candidates, tried


_lib = None
_lib_lock = threading.Lock()


def load(env=None, search_path=None, loaded=None, loader_name="libnccl.so.2"):
    """Loads libnccl once per process; raises OSError naming every place
    tried when none loads. (The arguments are for tests.)"""
    global _lib
    default = env is None and search_path is None and loaded is None
    with _lib_lock:
        if _lib is not None and default:
            return _lib
        candidates, tried = find_library(env, search_path, loaded, loader_name)
        errors = []
        for path in candidates:
            try:
                lib = ctypes.CDLL(path, mode=getattr(os, "RTLD_GLOBAL", 0))
                lib.ncclGetUniqueId  # noqa: B018 (raises AttributeError if not NCCL)
            except (OSError, AttributeError) as e:
                errors.append(f"{path}: {e}")
                continue
            _declare(lib)
            if default:
                _lib = lib
            return lib
        raise OSError(
            "weightsync.nccl: could not load the NCCL library (libnccl.so.2). Looked at: "
            + "; ".join(tried) + ". Errors: " + " | ".join(errors[-4:])
            + ". Install torch with CUDA (it brings nvidia-nccl) or set NCCL_LIB to "
            "the path of libnccl.so.2 or its folder.")


def _declare(lib):
    c_int, c_size_t, c_void_p = ctypes.c_int, ctypes.c_size_t, ctypes.c_void_p
    lib.ncclGetUniqueId.argtypes = [ctypes.POINTER(_UniqueId)]
    lib.ncclGetUniqueId.restype = c_int
    lib.ncclCommInitRank.argtypes = [ctypes.POINTER(c_void_p), c_int, _UniqueId, c_int]
    lib.ncclCommInitRank.restype = c_int
    lib.ncclBroadcast.argtypes = [c_void_p, c_void_p, c_size_t, c_int, c_int, c_void_p,
                                  c_void_p]
    lib.ncclBroadcast.restype = c_int
    for call in ("ncclSend", "ncclRecv"):
        getattr(lib, call).argtypes = [c_void_p, c_size_t, c_int, c_int, c_void_p, c_void_p]
        getattr(lib, call).restype = c_int
    lib.ncclGroupStart.argtypes = []
    lib.ncclGroupStart.restype = c_int
    lib.ncclGroupEnd.argtypes = []
    lib.ncclGroupEnd.restype = c_int
    lib.ncclCommDestroy.argtypes = [c_void_p]
    lib.ncclCommDestroy.restype = c_int
    lib.ncclCommAbort.argtypes = [c_void_p]
    lib.ncclCommAbort.restype = c_int
    lib.ncclCommGetAsyncError.argtypes = [c_void_p, ctypes.POINTER(c_int)]
    lib.ncclCommGetAsyncError.restype = c_int
    lib.ncclGetErrorString.argtypes = [c_int]
    lib.ncclGetErrorString.restype = ctypes.c_char_p
    lib.ncclGetVersion.argtypes = [ctypes.POINTER(c_int)]
    lib.ncclGetVersion.restype = c_int
    if hasattr(lib, "ncclGetLastError"):
        lib.ncclGetLastError.argtypes = [c_void_p]
        lib.ncclGetLastError.restype = ctypes.c_char_p


def _message(lib, result, comm=None):
    text = lib.ncclGetErrorString(result)
    text = text.decode(errors="replace") if text else f"ncclResult_t {result}"
    if hasattr(lib, "ncclGetLastError"):
        last = lib.ncclGetLastError(comm)
        if last:
            last = last.decode(errors="replace").strip()
            if last and last not in text:
                text += "; " + last
    return text


def _check(lib, call, result, comm=None):
    if result != _SUCCESS:
        raise NcclError(call, result, _message(lib, result, comm))


def version():
    """NCCL's version code (e.g. 22705 for 2.27.5)."""
    lib = load()
    v = ctypes.c_int(0)
    _check(lib, "ncclGetVersion", lib.ncclGetVersion(ctypes.byref(v)))
    return v.value


def get_unique_id():
    """A fresh ncclUniqueId as 128 raw bytes (what InitWeightTransfer carries)."""
    lib = load()
    uid = _UniqueId()
    _check(lib, "ncclGetUniqueId", lib.ncclGetUniqueId(ctypes.byref(uid)))
    return ctypes.string_at(ctypes.addressof(uid), UNIQUE_ID_BYTES)


class Communicator:
    """One NCCL communicator (ncclCommInitRank). The calling thread's
    current CUDA device is the communicator's device: select it first (e.g.
    `with torch.cuda.device(d):`). The constructor blocks until every rank
    has joined."""

    def __init__(self, world_size, unique_id, rank):
        if len(unique_id) != UNIQUE_ID_BYTES:
            raise ValueError(f"unique id has {len(unique_id)} bytes, not {UNIQUE_ID_BYTES}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world size {world_size}")
        self._lib = load()
        self.world_size = world_size
        self.rank = rank
        uid = _UniqueId()
        ctypes.memmove(ctypes.addressof(uid), bytes(unique_id), UNIQUE_ID_BYTES)
        comm = ctypes.c_void_p()
        _check(self._lib, "ncclCommInitRank",
               self._lib.ncclCommInitRank(ctypes.byref(comm), world_size, uid, rank))
        self._comm = comm

    @property
    def handle(self):
        return self._comm.value if self._comm is not None else None

    def _live(self, call):
        if self._comm is None:
            raise NcclError(call, 5, "the communicator was aborted or destroyed")
        return self._comm

    def broadcast(self, ptr, nbytes, root=0, stream=0):
        """ncclBroadcast of `nbytes` bytes (ncclUint8) in place at device
        address `ptr` on CUDA stream `stream` (an int cudaStream_t, e.g.
        torch.cuda.Stream().cuda_stream; 0 = the legacy default stream).
        Returns once enqueued."""
        comm = self._live("ncclBroadcast")
        _check(self._lib, "ncclBroadcast",
               self._lib.ncclBroadcast(ctypes.c_void_p(ptr), ctypes.c_void_p(ptr),
                                       ctypes.c_size_t(nbytes), _UINT8, root, comm,
                                       ctypes.c_void_p(stream)), comm)

    def send(self, ptr, nbytes, peer, stream=0):
        """ncclSend of `nbytes` bytes at device address `ptr` to rank
        `peer` on CUDA stream `stream` (point-to-point: the peer's recv
        from this rank, in the same order). Returns once enqueued."""
        comm = self._live("ncclSend")
        _check(self._lib, "ncclSend",
               self._lib.ncclSend(ctypes.c_void_p(ptr), ctypes.c_size_t(nbytes), _UINT8, peer,
                                  comm, ctypes.c_void_p(stream)), comm)

    def recv(self, ptr, nbytes, peer, stream=0):
        """ncclRecv of `nbytes` bytes from rank `peer` into `ptr`."""
        comm = self._live("ncclRecv")
        _check(self._lib, "ncclRecv",
               self._lib.ncclRecv(ctypes.c_void_p(ptr), ctypes.c_size_t(nbytes), _UINT8, peer,
                                  comm, ctypes.c_void_p(stream)), comm)

    def group_start(self):
        _check(self._lib, "ncclGroupStart", self._lib.ncclGroupStart())

    def group_end(self):
        _check(self._lib, "ncclGroupEnd", self._lib.ncclGroupEnd())

    def async_error(self):
        """None, or an NcclError describing the communicator's async error."""
        if self._comm is None:
            return None
        r = ctypes.c_int(0)
        result = self._lib.ncclCommGetAsyncError(self._comm, ctypes.byref(r))
        if result != _SUCCESS:
            return NcclError("ncclCommGetAsyncError", result, _message(self._lib, result))
        if r.value not in (_SUCCESS, _IN_PROGRESS):
            return NcclError("communicator", r.value, _message(self._lib, r.value, self._comm))
        return None

    def abort(self):
        """ncclCommAbort: ends outstanding operations (a broadcast whose peer
        is gone never returns otherwise). Safe to call twice."""
        comm, self._comm = self._comm, None
        if comm is not None:
            self._lib.ncclCommAbort(comm)

    def destroy(self):
        """ncclCommDestroy (waits for outstanding operations; prefer abort()
        after an error)."""
        comm, self._comm = self._comm, None
        if comm is not None:
            _check(self._lib, "ncclCommDestroy", self._lib.ncclCommDestroy(comm))

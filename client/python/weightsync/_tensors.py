"""Tensors as bytes: numpy arrays (and torch tensors) <-> weightsync dtypes.

`build_manifest(named_tensors)` describes a whole update at once (names,
wire dtypes, shapes, byte payloads, a fingerprint); `describe(name,
tensor)` one tensor. Both map dtypes through one cache keyed by the dtype
object, so no per-tensor dtype string work is done.
"""

import collections.abc
import operator
import sys

import numpy as np

__all__ = ["Manifest", "build_manifest", "describe", "wire_dtype", "STORAGE"]

# numpy dtype name -> weightsync.v1.DType enum name
_NUMPY = {
    "float32": "FLOAT32", "float16": "FLOAT16", "float64": "FLOAT64",
    "int64": "INT64", "int32": "INT32", "int16": "INT16", "int8": "INT8",
    "uint8": "UINT8", "bool": "BOOL",
}
_TORCH = {
    "torch.float32": "FLOAT32", "torch.bfloat16": "BFLOAT16", "torch.float16": "FLOAT16",
    "torch.float64": "FLOAT64", "torch.int64": "INT64", "torch.int32": "INT32",
    "torch.int16": "INT16", "torch.int8": "INT8", "torch.uint8": "UINT8", "torch.bool": "BOOL",
}
# weightsync dtype -> numpy dtype used to hold its bytes (bf16 as uint16)
STORAGE = {
    "FLOAT32": np.float32, "FLOAT16": np.float16, "BFLOAT16": np.uint16,
    "FLOAT64": np.float64, "INT64": np.int64, "INT32": np.int32, "INT16": np.int16,
    "INT8": np.int8, "UINT8": np.uint8, "BOOL": np.bool_,
    "FLOAT8_E4M3FN": np.uint8, "FLOAT8_E5M2": np.uint8,
}
_ELEMENT_SIZE = {"FLOAT32": 4, "BFLOAT16": 2, "FLOAT16": 2, "FLOAT64": 8, "INT64": 8,
                 "INT32": 4, "INT16": 2, "INT8": 1, "UINT8": 1, "BOOL": 1,
                 "FLOAT8_E4M3FN": 1, "FLOAT8_E5M2": 1}

_U8 = np.dtype(np.uint8)
_LITTLE = sys.byteorder == "little"

# id(dtype object) -> (dtype object, wire name or None, reason if None).
# The entry keeps the dtype object alive, so its id is never reused while
# cached. numpy's builtin dtypes (and torch's) are singletons: a model's
# tensors hit one or two entries. Bounded: other dtype objects (e.g. ones
# made by np.dtype(">f4") each time) clear it when it grows.
_DTYPES = {}
_MAX_CACHED = 256


def _classify(dt):
    """(wire name or None, reason) of a numpy or torch dtype object."""
    if isinstance(dt, np.dtype):
        wire = _NUMPY.get(dt.name) if dt.fields is None else None
        if wire is None:
            return None, f"dtype {dt} is not supported"
        if dt.itemsize > 1 and not (dt.byteorder == "=" or dt.byteorder == ("<" if _LITTLE
                                                                               else ">")):
            return None, f"dtype {dt.str} is not in native (little-endian) byte order"
        if not _LITTLE and dt.itemsize > 1:
            return None, "the wire is little-endian; this machine is not"
        return wire, None
    text = str(dt)
    if text.startswith("torch."):
        wire = _TORCH.get(text)
        return wire, None if wire else f"dtype {text} is not supported"
    return None, f"dtype {dt!r} is not supported"


def wire_dtype(dt):
    """weightsync.v1.DType enum name of a numpy dtype or torch dtype
    object, or None if it has none. Cached by the object."""
    entry = _DTYPES.get(id(dt))
    if entry is None or entry[0] is not dt:
        entry = _cache(dt)
    return entry[1]


def _cache(dt):
    wire, reason = _classify(dt)
    if len(_DTYPES) >= _MAX_CACHED:
        _DTYPES.clear()
    entry = (dt, wire, reason)
    _DTYPES[id(dt)] = entry
    return entry


def _dtype_entry(name, dt):
    entry = _DTYPES.get(id(dt))
    if entry is None or entry[0] is not dt:
        entry = _cache(dt)
    if entry[1] is None:
        raise ValueError(f"tensor '{name}': {entry[2]}")
    return entry[1]


def describe(name, tensor):
    """(dtype enum name, shape tuple, flat uint8 view of the bytes) of one
    numpy array or CPU torch tensor. A non-contiguous tensor is copied (as
    is a numpy array in foreign byte order); ValueError names the tensor
    for an unsupported dtype or a torch tensor off the CPU."""
    if isinstance(tensor, np.ndarray):
        entry = _DTYPES.get(id(tensor.dtype))
        if entry is None or entry[0] is not tensor.dtype:
            entry = _cache(tensor.dtype)
        if entry[1] is None:
            if entry[2].endswith("byte order") and _LITTLE:
                tensor = tensor.astype(tensor.dtype.newbyteorder("="))
                return describe(name, tensor)
            raise ValueError(f"tensor '{name}': {entry[2]}")
        if not tensor.flags.c_contiguous:
            tensor = np.ascontiguousarray(tensor)
        return entry[1], tensor.shape, tensor.reshape(-1).view(_U8)
    dtype = getattr(tensor, "dtype", None)
    if dtype is not None and type(dtype).__module__.startswith("torch"):
        wire = _dtype_entry(name, dtype)
        return wire, tuple(tensor.shape), _torch_host_bytes(name, tensor)
    # Lists, scalars, anything numpy can make an array of.
    return describe(name, np.ascontiguousarray(tensor))


def _torch_host_bytes(name, tensor, copy=True):
    if tensor.device.type != "cpu":
        raise ValueError(f"tensor '{name}': on {tensor.device}; the host "
                         "backend sends CPU tensors")
    import torch  # only when the caller already uses torch
    t = tensor.detach()
    if not t.is_contiguous():
        if not copy:
            raise ValueError(f"tensor '{name}': not contiguous (strides {tuple(t.stride())} "
                             f"of shape {tuple(t.shape)}); pass .contiguous()")
        t = t.contiguous()
    raw = t.view(torch.uint8) if t.element_size() == 1 else t.reshape(-1).view(torch.uint8)
    return raw.numpy().reshape(-1)


class Manifest:
    """An update's tensors, described once (see build_manifest).

    Attributes (tuples, one entry per tensor in send order):
      names     tensor names (str);
      dtypes    weightsync.v1.DType enum names ("FLOAT32", "BFLOAT16", ...);
      shapes    shapes (tuples of int);
      nbytes    payload bytes (numel * element size);
      payloads  the bytes: a flat uint8 numpy array per tensor (a view of
                the caller's memory, no copy), or with host_bytes=False the
                torch tensor as it was given;
      tensors   the tensors as given (kept alive for the views);
    and
      total_bytes  sum of nbytes (the stream adds alignment padding:
                   planner.plan_chunks);
      key          (names, dtypes, shapes): exact, hashable; equal keys
                   mean the same manifest (what plan_chunks_cached uses);
      fingerprint  hash(key), an int computed once (per process: Python
                   salts str hashes), to tell "same manifest as last step"
                   with one integer compare before comparing keys.

    `specs()` returns the manifest as planner/TensorSpec dicts
    ({"name", "dtype", "shape"}), built once and cached.
    """

    __slots__ = ("names", "dtypes", "shapes", "nbytes", "payloads", "tensors", "total_bytes",
                 "key", "fingerprint", "_dtype_objs", "_specs", "_numpy_only", "_index",
                 "_parts")

    def __len__(self):
        return len(self.names)

    def specs(self):
        if self._specs is None:
            self._specs = [{"name": n, "dtype": d, "shape": list(s)}
                           for n, d, s in zip(self.names, self.dtypes, self.shapes)]
        return self._specs

    def sent(self):
        """The manifest as weightsync.receipts.expected_receipt's `sent`
        mapping ({name: (dtype, shape, payload)}) without building a dict
        per update: a view whose name index is built once per manifest."""
        return SentView(self)

    def index(self):
        """{name: position in send order}, built once and carried over by
        build_manifest while the names stay the same."""
        if self._index is None:
            self._index = dict(zip(self.names, range(len(self.names))))
        return self._index

    def chunk_parts(self, plan):
        """[planner.chunk_parts(chunk, payloads) for each chunk of `plan`],
        kept for the next update of the same plan object and payloads
        (build_manifest carries it over while every tensor is the same
        numpy array): packing a chunk is then one join."""
        if self._parts is None or self._parts[0] is not plan:
            from weightsync.planner import chunk_parts
            self._parts = (plan, [chunk_parts(c, self.payloads) for c in plan["chunks"]])
        return self._parts[1]

    def same_as(self, other):
        """True if `other` (a Manifest or None) has the same names, dtypes
        and shapes."""
        return (other is not None and self.fingerprint == other.fingerprint
                and self.key == other.key)

    def __repr__(self):
        return (f"Manifest({len(self.names)} tensors, {self.total_bytes} bytes, "
                f"fingerprint {self.fingerprint & 0xFFFFFFFFFFFFFFFF:016x})")


class SentView(collections.abc.Mapping):
    """{name: (dtype, shape, payload)} over a Manifest (Manifest.sent()).
    `signature` (the manifest's key) and `payloads` (in send order) let
    weightsync.receipts reuse a cached walk with no per-tensor work."""

    __slots__ = ("_m",)

    def __init__(self, manifest):
        self._m = manifest

    @property
    def signature(self):
        return self._m.key

    @property
    def payloads(self):
        return self._m.payloads

    def __getitem__(self, name):
        m = self._m
        i = m.index()[name]
        return m.dtypes[i], m.shapes[i], m.payloads[i]

    def __contains__(self, name):
        return name in self._m.index()

    def __iter__(self):
        return iter(self._m.names)

    def __len__(self):
        return len(self._m.names)

    def values(self):
        m = self._m
        return list(zip(m.dtypes, m.shapes, m.payloads))


_first = operator.itemgetter(0)
_second = operator.itemgetter(1)
_NDARRAY_ONLY = frozenset((np.ndarray,))
_get_dtype = operator.attrgetter("dtype")
_get_shape = operator.attrgetter("shape")
_get_contiguous = operator.attrgetter("flags.c_contiguous")
_get_nbytes = operator.attrgetter("nbytes")
_flat = operator.methodcaller("reshape", -1)
_as_u8 = operator.methodcaller("view", _U8)


def _describe_numpy(m, names, tensors, previous):
    """build_manifest of numpy arrays only: per distinct dtype object, not
    per tensor; everything reused from `previous` when every array is the
    same object, name, dtype and shape as then. Returns (dtypes, shapes),
    None when reused (m is then complete)."""
    dtype_objs = tuple(map(_get_dtype, tensors))
    shapes = tuple(map(_get_shape, tensors))
    if (previous is not None and previous._numpy_only
            and len(previous.tensors) == len(tensors)
            and all(map(operator.is_, tensors, previous.tensors))
            and all(map(operator.is_, dtype_objs, previous._dtype_objs))
            and shapes == previous.shapes and names == previous.names):
        m.dtypes, m.shapes, m.nbytes = previous.dtypes, previous.shapes, previous.nbytes
        m.payloads, m.total_bytes = previous.payloads, previous.total_bytes
        m.key, m.fingerprint, m._dtype_objs = previous.key, previous.fingerprint, dtype_objs
        m._specs, m._index, m._parts = previous._specs, previous._index, previous._parts
        return None
    _check_names(names)
    # Per distinct dtype object, not per tensor.
    wire_by_id = {}
    for dt in set(dtype_objs):
        entry = _DTYPES.get(id(dt))
        if entry is None or entry[0] is not dt:
            entry = _cache(dt)
        wire_by_id[id(dt)] = entry
    if any(e[1] is None for e in wire_by_id.values()):
        for name, dt in zip(names, dtype_objs):
            _dtype_entry(name, dt)   # raises naming the first bad tensor
    dtypes = tuple(map(lambda e: e[1], map(wire_by_id.__getitem__, map(id, dtype_objs))))
    if not all(map(_get_contiguous, tensors)):
        for name, t in zip(names, tensors):
            if not t.flags.c_contiguous:
                raise ValueError(f"tensor '{name}': not C-contiguous (strides {t.strides} "
                                 f"of shape {t.shape}); pass np.ascontiguousarray()")
    m.payloads = tuple(map(_as_u8, map(_flat, tensors)))
    m.nbytes = tuple(map(_get_nbytes, tensors))
    m._dtype_objs = dtype_objs
    return dtypes, shapes


def _describe_any(m, names, tensors, host_bytes):
    """build_manifest of numpy arrays and torch tensors mixed, tensor by
    tensor. Returns (dtypes, shapes)."""
    _check_names(names)
    dtypes, shapes, payloads, nbytes, dtype_objs = [], [], [], [], []
    for name, t in zip(names, tensors):
        if isinstance(t, np.ndarray):
            dt = t.dtype
            wire = _dtype_entry(name, dt)
            if not t.flags.c_contiguous:
                raise ValueError(f"tensor '{name}': not C-contiguous (strides {t.strides} "
                                 f"of shape {t.shape}); pass np.ascontiguousarray()")
            shape = t.shape
            payload = t.reshape(-1).view(_U8)
            size = t.nbytes
        else:
            dt = getattr(t, "dtype", None)
            if dt is None:
                raise ValueError(f"tensor '{name}': {type(t).__name__} is not a numpy "
                                 "array or torch tensor")
            wire = _dtype_entry(name, dt)
            shape = tuple(t.shape)
            if host_bytes:
                payload = _torch_host_bytes(name, t, copy=False)
            else:
                if not t.is_contiguous():
                    raise ValueError(
                        f"tensor '{name}': not contiguous (strides {tuple(t.stride())} "
                        f"of shape {shape}); pass .contiguous()")
                payload = t
            size = t.numel() * _ELEMENT_SIZE[wire]
        dtypes.append(wire)
        shapes.append(shape)
        payloads.append(payload)
        nbytes.append(size)
        dtype_objs.append(dt)
    dtypes, shapes = tuple(dtypes), tuple(shapes)
    m.payloads, m.nbytes, m._dtype_objs = tuple(payloads), tuple(nbytes), tuple(dtype_objs)
    return dtypes, shapes


def build_manifest(named_tensors, previous=None, host_bytes=True):
    """Describes every (name, tensor) of an update in one pass.

    Args:
      named_tensors: iterable of (name, tensor) pairs in send order; tensors
        are numpy arrays or torch tensors. Not weightsync.sparse patches
        (the caller describes those itself).
      previous: the Manifest this function returned for the last update, or
        None. When every tensor is the same numpy array object as then, with
        the same name, dtype and shape, its payload views are reused (numpy
        arrays cannot move their memory) and `key`/`fingerprint` are
        carried over: the steady-state cost is a few C-level passes over
        the list.
      host_bytes: True (the host backend): every payload is a flat uint8
        numpy array; torch tensors must be on the CPU. False (GPU
        backends): torch tensors are left as they are in `payloads`
        (numpy arrays still become uint8 views).

    Returns:
      A Manifest (see its docstring).

    Raises:
      ValueError naming the tensor: an unsupported dtype (also numpy arrays
      in big-endian byte order), a tensor that is not C-contiguous (no
      hidden copies: pass np.ascontiguousarray(t) / t.contiguous()), a
      torch tensor off the CPU with host_bytes=True, or a name that is not
      a non-empty str.
    """
    pairs = named_tensors if isinstance(named_tensors, (list, tuple)) else list(named_tensors)
    m = Manifest()
    m._specs = m._index = m._parts = None
    if not pairs:
        names, tensors = (), ()
    else:
        # Two C-level passes (zip(*pairs) makes an iterator per pair).
        try:
            if set(map(len, pairs)) != {2}:
                raise TypeError
            names = tuple(map(_first, pairs))
            tensors = tuple(map(_second, pairs))
        except TypeError:
            raise ValueError("named_tensors must be (name, tensor) pairs") from None
    m.names, m.tensors = names, tensors
    numpy_only = set(map(type, tensors)) <= _NDARRAY_ONLY
    m._numpy_only = numpy_only
    if numpy_only:
        described = _describe_numpy(m, names, tensors, previous)
        if described is None:
            return m
    else:
        described = _describe_any(m, names, tensors, host_bytes)
    dtypes, shapes = described
    m.dtypes, m.shapes = dtypes, shapes
    m.total_bytes = sum(m.nbytes)
    m.key = (names, dtypes, shapes)
    m.fingerprint = hash(m.key)
    return m


def _check_names(names):
    if not all(map(str.__instancecheck__, names)) or not all(names):
        for i, n in enumerate(names):
            if not isinstance(n, str) or not n:
                raise ValueError(f"tensor {i}: name {n!r} is not a non-empty string")

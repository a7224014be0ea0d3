"""Helpers for torch CUDA tensors: dtypes, flat byte views, CUDA IPC handles
of caching-allocator blocks, GPU UUIDs, allocation tables.

The functions that don't take a torch object (parse_storage_handle,
format_gpu_uuid, allocation_table, allocation_columns, dedupe_aliases' key logic) are plain
Python so that CI, which has no GPU and no torch, can test them.
"""

import operator
import sys

CUDA_IPC_HANDLE_BYTES = 64
_SHAREABLE_CUDA_MALLOC = ord("c")
_SHAREABLE_EXPANDABLE_SEGMENT = ord("e")

# str(torch dtype) -> weightsync.v1.DType enum name
TORCH_DTYPES = {
    "torch.float32": "FLOAT32", "torch.bfloat16": "BFLOAT16", "torch.float16": "FLOAT16",
    "torch.float64": "FLOAT64", "torch.int64": "INT64", "torch.int32": "INT32",
    "torch.int16": "INT16", "torch.int8": "INT8", "torch.uint8": "UINT8", "torch.bool": "BOOL",
    "torch.float8_e4m3fn": "FLOAT8_E4M3FN", "torch.float8_e5m2": "FLOAT8_E5M2",
}


# weightsync.v1.DType enum name -> torch dtype attribute name
TORCH_BY_NAME = {v: k[len("torch."):] for k, v in TORCH_DTYPES.items()}


def elements(flat, dtype):
    """The elements of a flat uint8 tensor of weightsync dtype `dtype`."""
    import torch
    return flat.view(getattr(torch, TORCH_BY_NAME[dtype]))


def dtype_name(name, tensor):
    d = str(tensor.dtype)
    if d not in TORCH_DTYPES:
        raise ValueError(f"tensor '{name}': dtype {d} is not supported "
                         f"(supported: {', '.join(sorted(TORCH_DTYPES))})")
    return TORCH_DTYPES[d]


def dtype_names(named):
    """dtype_name of every (name, tensor), with the per-dtype work done once
    per distinct dtype rather than per tensor."""
    torch = sys.modules.get("torch")
    if torch is None or not all(torch.is_tensor(t) for _, t in named[:1]):
        return [dtype_name(n, t) for n, t in named]
    dtypes = list(map(torch.Tensor.dtype.__get__, map(operator.itemgetter(1), named)))
    known = {}
    for d in set(dtypes):
        if str(d) in TORCH_DTYPES:
            known[d] = TORCH_DTYPES[str(d)]
    if len(known) < len(set(dtypes)):
        for (n, t), d in zip(named, dtypes):
            if d not in known:
                dtype_name(n, t)   # raises, naming the tensor
    return list(map(known.__getitem__, dtypes))


def parse_storage_handle(handle):
    """The 64-byte cudaIpcMemHandle_t inside what torch's
    `untyped_storage()._share_cuda_()[1]` returns.

    torch <= 2.1 returns the raw 64-byte handle; later versions prefix a
    version byte and a type byte: b'c' for a cudaMalloc block (then the raw
    handle of the allocation's base follows) or b'e' for an expandable
    segment (cuMem* memory, which cudaIpcOpenMemHandle can't open)."""
    if handle is None:
        raise ValueError("the storage has no CUDA memory (empty tensor?)")
    handle = bytes(handle)
    if len(handle) == CUDA_IPC_HANDLE_BYTES:
        return handle
    if len(handle) >= 2 and handle[1] == _SHAREABLE_EXPANDABLE_SEGMENT:
        raise ValueError(
            "this tensor lives in an expandable segment (PYTORCH_CUDA_ALLOC_CONF="
            "expandable_segments:True), which CUDA IPC handles (cudaIpcGetMemHandle) "
            "can't share; start the process without expandable_segments for the "
            "tensors weightsync writes or reads")
    if len(handle) == CUDA_IPC_HANDLE_BYTES + 2 and handle[1] == _SHAREABLE_CUDA_MALLOC:
        return handle[2:]
    raise ValueError(f"unknown CUDA storage handle format ({len(handle)} bytes, "
                     f"starting {handle[:2].hex()}); expected 64 bytes or "
                     "version + 'c' + 64 bytes")


def format_gpu_uuid(uuid):
    """A GPU UUID as the wire carries it: "GPU-xxxxxxxx-xxxx-xxxx-xxxx-
    xxxxxxxxxxxx" (lower-case hex, like nvidia-smi and
    backends/cuda/gpu_uuid.h). Accepts 16 bytes, a list of 16 ints, torch's
    `get_device_properties(d).uuid` (whose str() lacks the "GPU-" prefix),
    or a string with or without the prefix."""
    raw = None
    if isinstance(uuid, (bytes, bytearray)):
        raw = bytes(uuid)
    elif isinstance(uuid, (list, tuple)):
        raw = bytes(int(b) & 0xFF for b in uuid)
    elif hasattr(uuid, "bytes") and not isinstance(uuid, str):
        b = uuid.bytes
        raw = bytes(b) if isinstance(b, (bytes, bytearray)) else bytes(int(x) & 0xFF for x in b)
    if raw is None:
        text = str(uuid).strip()
        if text.upper().startswith("GPU-"):
            text = text[4:]
        hexdigits = text.replace("-", "")
        try:
            raw = bytes.fromhex(hexdigits)
        except ValueError:
            raw = b""
        if len(raw) != 16:
            raise ValueError(f"not a GPU UUID: {uuid!r}")
    if len(raw) != 16:
        raise ValueError(f"a GPU UUID has 16 bytes, not {len(raw)}")
    h = raw.hex()
    return f"GPU-{h[0:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


def allocation_table(entries):
    """Groups parameters by the allocation they live in.

    entries: [(name, handle64, uuid, base_offset, nbytes)] where base_offset
    is the parameter's byte offset from the allocation's base.
    Returns (allocations, placements): allocations [{"handle", "size",
    "device_uuid"}] in first-use order, each `size` the end of the last
    byte any parameter uses (a lower bound of the real block size, which is
    all the daemon checks); placements [(name, allocation index, offset)].
    Raises ValueError naming both parameters when two overlap. The
    columnar form is allocation_columns."""
    if not entries:
        return [], []
    names, handles, uuids, offsets, nbytes = zip(*entries)
    keys = list(zip(map(bytes, handles), uuids))
    first = dict.fromkeys(keys)
    for g, key in enumerate(first):
        first[key] = g
    group = list(map(first.__getitem__, keys))
    allocations, index, off = allocation_columns(names, list(first), group, offsets, nbytes)
    return allocations, list(zip(names, index.tolist(), off.tolist()))


def allocation_columns(names, keys, group, offsets, nbytes):
    """allocation_table in columns, for 100k-parameter engines: C-level
    passes (numpy), not a Python step per parameter.

    keys: the distinct (handle64, uuid) of the allocations; group, offsets,
    nbytes: per parameter, the index into `keys` of its allocation, its
    byte offset from the allocation's base and its size (sequences or
    numpy arrays, e.g. from ipc_location_columns); names: per parameter,
    for errors. Returns (allocations, index, offsets): allocations as
    allocation_table's, in first-use order; index (int32) and offsets
    (int64) numpy arrays, per parameter, its allocation's index in
    `allocations` and its offset. ValueError naming both parameters when
    two overlap."""
    import numpy as np
    group = np.asarray(group, np.int64)
    n = group.size
    off = np.asarray(offsets, np.int64).reshape(n)
    size = np.asarray(nbytes, np.int64).reshape(n)
    if n == 0:
        return [], np.zeros(0, np.int32), off
    # Keys renumbered in first-use order (how allocation_table lists them).
    used_keys, first_use = np.unique(group, return_index=True)
    by_first = used_keys[np.argsort(first_use, kind="stable")]
    renumber = np.empty(len(keys), np.int64)
    renumber[by_first] = np.arange(by_first.size)
    alloc = renumber[group]
    ends = np.zeros(by_first.size, np.int64)
    np.maximum.at(ends, alloc, off + size)
    used = np.flatnonzero(size > 0)
    if used.size > 1:
        order = used[np.lexsort((off[used], alloc[used]))]
        a0, a1 = order[:-1], order[1:]
        bad = np.flatnonzero((alloc[a0] == alloc[a1]) & (off[a1] < off[a0] + size[a0]))
        if bad.size:
            k0, k1 = int(a0[bad[0]]), int(a1[bad[0]])
            raise ValueError(
                f"parameters '{names[k0]}' and '{names[k1]}' overlap in memory (bytes "
                f"[{off[k0]}, {off[k0] + size[k0]}) and [{off[k1]}, {off[k1] + size[k1]}) of "
                "one allocation); register each storage once "
                "(tied weights: register one name and let the trainer send it)")
    allocations = []
    for g, e in zip(by_first.tolist(), ends.tolist()):
        handle, uuid = keys[g]
        allocations.append({"handle": bytes(handle), "size": max(int(e), 1),
                            "device_uuid": uuid})
    return allocations, alloc.astype(np.int32), off


def alias_key(tensor):
    """Two tensors with the same key are the same memory viewed the same way."""
    return (tensor.device.type, tensor.device.index, tensor.data_ptr(), tuple(tensor.shape),
            tuple(tensor.stride()), str(tensor.dtype))


def _torch_data_ptrs(tensors):
    """Every tensor's data pointer by one C-level pass, or None when torch
    isn't loaded or an entry isn't a torch tensor."""
    torch = sys.modules.get("torch")
    if torch is None or not all(map(torch.is_tensor, tensors)):
        return None
    return list(map(torch.Tensor.data_ptr, tensors))


def dedupe_aliases(named_tensors):
    """Drops later names of a tensor already seen (tied embeddings:
    state_dict() lists lm_head.weight and embed_tokens.weight for one
    tensor). A sparse patch counts as the tensor it was computed from
    (TorchSparsePatch.source_key; patches without one are always kept).
    Returns (kept pairs, {dropped name: kept name})."""
    named_tensors = list(named_tensors)
    ptrs = _torch_data_ptrs(list(map(operator.itemgetter(1), named_tensors)))
    if ptrs is not None and len(set(ptrs)) == len(ptrs):
        # Aliases share a data pointer: with none shared there are none
        # (a 100k-tensor model pays one pass, not a key per tensor).
        return named_tensors, {}
    seen, kept, dropped = {}, [], {}
    for name, t in named_tensors:
        if hasattr(t, "data_ptr"):
            key = alias_key(t) if t.numel() else None
        else:
            key = getattr(t, "source_key", None)
        if key is not None and key in seen:
            dropped[name] = seen[key]
            continue
        if key is not None:
            seen[key] = name
        kept.append((name, t))
    return kept, dropped


def flat_bytes(name, tensor):
    """A 1-D uint8 view of a tensor's bytes (contiguous copy if needed)."""
    import torch
    t = tensor.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    return t.reshape(-1).view(torch.uint8)


_UUIDS = {}   # device index -> formatted uuid (asked once per device)


def gpu_uuid(device):
    import torch
    index = device.index if isinstance(device, torch.device) else device
    if index is None:
        index = torch.cuda.current_device()
    uuid = _UUIDS.get(index)
    if uuid is None:
        uuid = _UUIDS[index] = format_gpu_uuid(torch.cuda.get_device_properties(index).uuid)
    return uuid


class _DriverRanges:
    """cuMemGetAddressRange through the CUDA driver (libcuda, loaded with
    torch's context current on the calling thread): the base and size of
    the allocation holding a device pointer."""

    def __init__(self):
        import ctypes
        lib = ctypes.CDLL("libcuda.so.1")
        self._f = lib.cuMemGetAddressRange_v2
        self._f.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_size_t),
                            ctypes.c_uint64]
        self._f.restype = ctypes.c_int
        self._base, self._size = ctypes.c_uint64(), ctypes.c_size_t()
        self._ref = (ctypes.byref(self._base), ctypes.byref(self._size))

    def __call__(self, ptr):
        err = self._f(self._ref[0], self._ref[1], ptr)
        if err != 0:
            raise OSError(f"cuMemGetAddressRange({ptr:#x}) failed with CUDA error {err}")
        return self._base.value, self._size.value


_ranges = []


def ipc_locations(named):
    """ipc_location of every (name, tensor) in `named`: [(handle64, gpu
    uuid, offset from the allocation base, nbytes)]; ipc_location_columns
    is the columnar form."""
    keys, group, offsets, nbytes = ipc_location_columns(named)
    return [keys[g] + (o, b) for g, o, b in zip(group.tolist(), offsets.tolist(),
                                                nbytes.tolist())]


def _columns_of(locations):
    """ipc_location tuples as ipc_location_columns' columns."""
    import numpy as np
    first = {}
    group = np.fromiter((first.setdefault((h, u), len(first)) for h, u, _, _ in locations),
                        np.int64, len(locations))
    offsets = np.fromiter((o for _, _, o, _ in locations), np.int64, len(locations))
    nbytes = np.fromiter((b for _, _, _, b in locations), np.int64, len(locations))
    return list(first), group, offsets, nbytes


def ipc_location_columns(named):
    """ipc_location of every (name, tensor) in `named`, as columns: (keys,
    group, offsets, nbytes) where keys are the distinct (handle64, gpu
    uuid) of the allocations, and group (int64), offsets (int64, from the
    allocation base) and nbytes (int64) numpy arrays hold each tensor's
    allocation (index into keys) and bytes; allocation_columns takes them
    as they are. One CUDA IPC handle per allocation rather than per
    tensor: the tensors are grouped by the allocation (caching-allocator
    segment) holding them, found through the driver in one pass over the
    sorted data pointers, and torch shares one storage of each group. A
    100k-tensor mixture of experts registers in a fraction of a second
    this way, against ~17 us of torch's storage sharing per tensor. Falls
    back to ipc_location per tensor wherever the driver's answer and
    torch's disagree (expandable segments, an empty tensor), so what it
    returns is always what ipc_location would."""
    import numpy as np
    import torch
    T = torch.Tensor
    tensors = list(map(operator.itemgetter(1), named))
    if not (all(map(T.is_cuda.__get__, tensors)) and all(map(T.is_contiguous, tensors))):
        for name, t in named:
            ipc_location(name, t.detach())   # raises the error naming the first
    try:
        ranges = _ranges[0] if _ranges else _ranges.append(_DriverRanges()) or _ranges[0]
    except (OSError, AttributeError):
        ranges = None

    def one_by_one():
        shared = {}
        return _columns_of([ipc_location(name, t.detach(), shared) for name, t in named])

    n = len(tensors)
    ptrs = np.fromiter(map(T.data_ptr, tensors), np.uint64, n)
    nbytes = np.fromiter(map(T.nbytes.__get__, tensors), np.uint64, n)
    if ranges is None or n == 0 or not ptrs.all():
        return one_by_one()
    order = np.argsort(ptrs, kind="stable")
    sorted_ptrs = ptrs[order]
    group = np.empty(n, np.int64)
    groups = []   # (base, size, a tensor of the group)
    i = 0
    while i < n:
        with torch.cuda.device(tensors[order[i]].device):
            base, size = ranges(int(sorted_ptrs[i]))
        j = int(np.searchsorted(sorted_ptrs, np.uint64(base + size), "left"))
        group[order[i:j]] = len(groups)
        groups.append((base, size, int(order[i])))
        i = j
    keys, bases = [], np.empty(len(groups), np.uint64)
    for g, (base, size, k) in enumerate(groups):
        t = tensors[k]
        storage = t.untyped_storage()
        raw = storage._share_cuda_()
        if storage.data_ptr() - int(raw[3]) != base:
            return one_by_one()   # torch's block base is not the driver's
        keys.append((parse_storage_handle(raw[1]), gpu_uuid(t.device)))
        bases[g] = base
    offsets = ptrs - bases[group]
    sizes = np.array([size for _, size, _ in groups], np.uint64)
    if (offsets + nbytes > sizes[group]).any():
        return one_by_one()
    return keys, group, offsets.astype(np.int64), nbytes.astype(np.int64)


def ipc_location(name, tensor, cache=None):
    """(handle64, gpu uuid, offset of the tensor's first byte from the
    allocation base, nbytes) of a CUDA tensor, from torch's own storage
    sharing (`untyped_storage()._share_cuda_()`: device, handle of the
    caching-allocator segment's base, storage bytes, storage offset from
    that base, ...)."""
    if tensor.device.type != "cuda":
        raise ValueError(f"parameter '{name}' is on {tensor.device}, not a CUDA device")
    if not tensor.is_contiguous():
        raise ValueError(f"parameter '{name}' is not contiguous (shape {tuple(tensor.shape)}, "
                         f"strides {tuple(tensor.stride())}); weightsync writes parameters "
                         "as dense row-major arrays: register a contiguous tensor")
    storage = tensor.untyped_storage()
    key = (tensor.device.index, storage.data_ptr())
    shared = cache.get(key) if cache is not None else None
    if shared is None:
        # Each call wraps the storage in another IPC ref-count context: once
        # per storage is enough (views of one buffer share it).
        raw = storage._share_cuda_()
        shared = (parse_storage_handle(raw[1]), int(raw[2]), int(raw[3]))
        if cache is not None:
            cache[key] = shared
    handle, storage_bytes, storage_offset_bytes = shared
    offset = storage_offset_bytes + tensor.storage_offset() * tensor.element_size()
    nbytes = tensor.numel() * tensor.element_size()
    if tensor.storage_offset() * tensor.element_size() + nbytes > storage_bytes:
        raise ValueError(f"parameter '{name}' extends past its storage")
    return handle, gpu_uuid(tensor.device), offset, nbytes

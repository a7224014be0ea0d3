#!/usr/bin/env python3
"""Reference implementation of the weightsync chunk planner.

The chunk planner decides where every tensor of an update lives in the byte
stream that travels from a trainer to the daemon, and how that stream is cut
into chunks. The full specification is docs/chunk_planner.md; the C++
implementation is common/chunk_planner.{h,cc}. Both implementations must
agree on every case of tests/vectors/chunk_plan.json, which this module
generates:

    python3 client/python/weightsync/planner.py --write tests/vectors/chunk_plan.json
    python3 client/python/weightsync/planner.py --check tests/vectors/chunk_plan.json

The module is standard-library only and `plan_chunks` is a pure function, so
clients (e.g. the Python trainer client) may import it directly.
"""

import argparse
import collections
import json
import sys
import threading

__all__ = [
    "ALIGNMENT",
    "ELEMENT_SIZES",
    "MAX_BYTES",
    "SPEC_VERSION",
    "align_up",
    "element_size",
    "numel",
    "payload_bytes",
    "plan_chunks",
    "plan_chunks_cached",
    "pack_chunk",
    "vectors_cli",
]

SPEC_VERSION = 1

# Every tensor starts at a multiple of this many bytes of the stream.
ALIGNMENT = 256

# Any byte count above this is rejected (keeps all sums inside int64).
MAX_BYTES = 2**62
MAX_CHUNKS = 2**20  # chunks of one update (common/chunk_planner.h kMaxChunks)

# Element size in bytes, keyed by the weightsync.v1.DType enum name.
ELEMENT_SIZES = {
    "FLOAT32": 4,
    "BFLOAT16": 2,
    "FLOAT16": 2,
    "FLOAT64": 8,
    "INT64": 8,
    "INT32": 4,
    "INT16": 2,
    "INT8": 1,
    "UINT8": 1,
    "BOOL": 1,
    "FLOAT8_E4M3FN": 1,
    "FLOAT8_E5M2": 1,
}

# weightsync.v1.DType enum numbers (proto/weightsync/v1/types.proto), so that
# protobuf messages whose dtype field is an int can be passed in directly.
_DTYPE_BY_NUMBER = {
    0: "DTYPE_UNSPECIFIED",
    1: "FLOAT32",
    2: "BFLOAT16",
    3: "FLOAT16",
    4: "FLOAT64",
    5: "INT64",
    6: "INT32",
    7: "INT16",
    8: "INT8",
    9: "UINT8",
    10: "BOOL",
    11: "FLOAT8_E4M3FN",
    12: "FLOAT8_E5M2",
}

# Bytes of one sparse index (int64, little-endian).
_SPARSE_INDEX_BYTES = 8


def align_up(value, alignment=ALIGNMENT):
    """Smallest multiple of `alignment` that is >= `value` (value >= 0)."""
    return (value + alignment - 1) // alignment * alignment


def _is_int(value):
    return isinstance(value, int) and not isinstance(value, bool)


def _dtype_name(dtype):
    """Normalizes a dtype given as enum name or enum number to its name."""
    if _is_int(dtype):
        return _DTYPE_BY_NUMBER.get(dtype, str(dtype))
    return dtype


def element_size(dtype):
    """Bytes per element of `dtype` (enum name or number); None if unknown
    or DTYPE_UNSPECIFIED."""
    return ELEMENT_SIZES.get(_dtype_name(dtype))


def numel(shape):
    """Number of elements of a tensor of `shape` (empty shape: scalar, 1)."""
    n = 1
    for d in shape:
        n *= d
    return n


def payload_bytes(dtype, shape, sparse_nnz=0, sparse_index_bytes=0):
    """Bytes the tensor occupies in the stream (no validation).

    Dense (sparse_nnz == 0): numel * element_size.
    Sparse (sparse_nnz > 0): sparse_nnz little-endian indices into the
    flattened tensor (int64, or uint32 when sparse_index_bytes == 4),
    followed by sparse_nnz values of the tensor's dtype, i.e.
    sparse_nnz * (index bytes + element_size).
    """
    esize = element_size(dtype)
    if sparse_nnz == 0:
        return numel(shape) * esize
    ib = 4 if sparse_index_bytes == 4 else _SPARSE_INDEX_BYTES
    return sparse_nnz * ib + sparse_nnz * esize


def _field(tensor, snake, camel=None, default=None):
    """Reads a field from a mapping or from an object with attributes
    (e.g. a weightsync.v1.TensorSpec protobuf message)."""
    if isinstance(tensor, dict):
        if snake in tensor:
            return tensor[snake]
        if camel is not None and camel in tensor:
            return tensor[camel]
        return default
    return getattr(tensor, snake, default)


def _validate_tensor(index, tensor, seen_names):
    """Checks one tensor and returns its payload size in bytes.

    Raises ValueError; messages name the tensor (or say "name" when the name
    itself is missing).
    """
    name = _field(tensor, "name", default="")
    if not isinstance(name, str) or name == "":
        raise ValueError(f"tensor {index}: empty tensor name")
    if name in seen_names:
        raise ValueError(f"tensor '{name}': duplicate tensor name")
    seen_names.add(name)

    dtype = _field(tensor, "dtype")
    esize = element_size(dtype)
    if esize is None:
        raise ValueError(f"tensor '{name}': unknown or unspecified dtype {dtype!r}")

    shape = list(_field(tensor, "shape", default=()) or ())
    for d in shape:
        if not _is_int(d):
            raise ValueError(f"tensor '{name}': dimension {d!r} is not an integer")
        if d < 0:
            raise ValueError(f"tensor '{name}': negative dimension {d} in shape {shape}")

    n = numel(shape)
    if n * esize > MAX_BYTES:
        raise ValueError(
            f"tensor '{name}': size of shape {shape} x {esize} bytes overflows "
            f"(more than 2**62 bytes)")

    nnz = _field(tensor, "sparse_nnz", "sparseNnz", 0) or 0
    if not _is_int(nnz):
        raise ValueError(f"tensor '{name}': sparse_nnz {nnz!r} is not an integer")
    if nnz < 0 or nnz > n:
        raise ValueError(
            f"tensor '{name}': sparse_nnz {nnz} out of range [0, numel={n}]")

    ib = _field(tensor, "sparse_index_bytes", "sparseIndexBytes", 0) or 0
    if nnz > 0:
        if ib not in (0, 4, 8):
            raise ValueError(f"tensor '{name}': sparse_index_bytes {ib} is not 0, 4 or 8")
        if ib == 4 and n > 2 ** 32:
            raise ValueError(f"tensor '{name}': sparse_index_bytes 4 holds indices of at "
                             f"most 2^32 elements; it has {n}")
    quantized = _quantization(tensor)
    if quantized is not None:
        if nnz:
            raise ValueError(f"tensor '{name}': a sparse patch can't be quantised")
        return wire_payload_bytes(shape, quantized)
    payload = payload_bytes(dtype, shape, nnz, ib)
    if payload > MAX_BYTES:
        raise ValueError(f"tensor '{name}': sparse payload of {payload} bytes overflows "
                         f"(more than 2**62 bytes)")
    return payload


def _quantization(tensor):
    """The Quantization fields of a tensor quantised on the wire (a dict's
    "quantization", or a TensorSpec's set field), else None."""
    if isinstance(tensor, dict):
        return tensor.get("quantization") or None
    if hasattr(tensor, "HasField") and tensor.HasField("quantization"):
        q = tensor.quantization
        return {"scheme": "QUANT_SCHEME_PER_ROW" if q.scheme == 2 else "QUANT_SCHEME_BLOCK",
                "block_rows": q.block_rows, "block_cols": q.block_cols}
    return None


def wire_payload_bytes(shape, fields):
    """Bytes of a tensor quantised on the wire as Quantization `fields`
    say (weightsync.wire_fp8): its FP8 elements, rounded up to 4, then a
    float32 scale per block (per row: per row) of its 2-D view."""
    shape = [int(d) for d in shape]
    rows = shape[0] if shape else 1
    cols = 1
    for d in shape[1:]:
        cols *= d
    if fields.get("scheme") == "QUANT_SCHEME_PER_ROW":
        br, bc = 1, max(cols, 1)
    else:
        br, bc = fields.get("block_rows") or 128, fields.get("block_cols") or 128
    return -(-rows * cols // 4) * 4 + (-(-rows // br)) * (-(-cols // bc)) * 4


# Element size by dtype given as an enum name (str) or number (int); only
# looked up for exact str / int (not bool, not numpy integers), as
# element_size() would.
_ESIZE_BY_NAME = dict(ELEMENT_SIZES)
_ESIZE_BY_NUMBER = {n: ELEMENT_SIZES[d] for n, d in _DTYPE_BY_NUMBER.items()
                    if d in ELEMENT_SIZES}


def _fast_esize(dtype):
    t = type(dtype)
    if t is str:
        return _ESIZE_BY_NAME.get(dtype)
    if t is int:
        return _ESIZE_BY_NUMBER.get(dtype)
    return None


def _dense_numel(shape):
    """numel of a shape of exact non-negative ints, else None."""
    n = 1
    for d in shape:
        if type(d) is not int or d < 0:
            return None
        n *= d
    return n


def _validated_payloads(tensors):
    """Payload bytes of every tensor, validated as _validate_tensor does.

    One pass with the common case inline (a dict or a Manifest-like
    object of dense tensors with a str name, a known dtype and a shape of
    non-negative ints): anything else, valid (sparse) or not, goes to
    _validate_tensor, which then reports exactly what the reference
    reports, in the same order."""
    seen = set()
    add = seen.add
    payloads = []
    append = payloads.append
    names = getattr(tensors, "names", None)
    if names is not None and hasattr(tensors, "dtypes") and hasattr(tensors, "shapes"):
        # A weightsync._tensors.Manifest (dense tensors, parallel tuples).
        esizes = {}
        for i, (name, dtype, shape) in enumerate(zip(names, tensors.dtypes, tensors.shapes)):
            esize = esizes.get(dtype)
            if esize is None:
                esize = esizes[dtype] = _fast_esize(dtype)
            n = _dense_numel(shape) if esize is not None else None
            if (n is None or type(name) is not str or not name or name in seen
                    or n * esize > MAX_BYTES):
                append(_validate_tensor(i, {"name": name, "dtype": dtype, "shape": shape},
                                        seen))
                continue
            add(name)
            append(n * esize)
        return payloads
    for i, t in enumerate(tensors):
        if type(t) is dict:
            name = t.get("name", "")
            if type(name) is str and name and name not in seen:
                esize = _fast_esize(t.get("dtype"))
                if esize is not None:
                    nnz = t["sparse_nnz"] if "sparse_nnz" in t else t.get("sparseNnz", 0)
                    if not nnz and "quantization" not in t:
                        n = _dense_numel(t.get("shape", ()) or ())
                        if n is not None and n * esize <= MAX_BYTES:
                            add(name)
                            append(n * esize)
                            continue
        append(_validate_tensor(i, t, seen))
    return payloads


def _plan(payloads, chunk_bytes):
    offsets = []
    next_offset = 0
    mask = ALIGNMENT - 1
    push = offsets.append
    for p in payloads:
        push(next_offset)
        next_offset = (next_offset + p + mask) & ~mask
    total = offsets[-1] + payloads[-1] if payloads else 0
    if total > MAX_BYTES:
        raise ValueError(f"total_bytes {total} of the manifest overflows (more than 2**62 bytes)")

    chunks = []
    num_chunks = (total + chunk_bytes - 1) // chunk_bytes
    if num_chunks > MAX_CHUNKS:
        raise ValueError(f"the update packs {total} bytes into {num_chunks} chunks of "
                         f"{chunk_bytes} bytes; the limit is {MAX_CHUNKS} chunks: use larger "
                         "chunks")
    count = len(payloads)
    i = 0  # first tensor that may still intersect the current chunk
    for k in range(num_chunks):
        c_begin = k * chunk_bytes
        c_end = min(c_begin + chunk_bytes, total)
        pieces = []
        piece = pieces.append
        while i < count:
            t_begin = offsets[i]
            if t_begin >= c_end:
                break
            size = payloads[i]
            t_end = t_begin + size
            if size > 0 and t_end > c_begin:
                start = c_begin if c_begin > t_begin else t_begin
                piece({"tensor": i, "tensor_offset": start - t_begin,
                       "chunk_offset": start - c_begin,
                       "length": (c_end if c_end < t_end else t_end) - start})
            if t_end > c_end:
                break   # continues in the next chunk
            i += 1
        chunks.append({"index": k, "offset": c_begin, "size": c_end - c_begin,
                       "pieces": pieces})
    return {
        "total_bytes": total,
        "tensor_offsets": offsets,
        "payload_bytes": payloads,
        "chunks": chunks,
    }


def plan_chunks(tensors, chunk_bytes):
    """Plans the byte stream of an update and cuts it into chunks.

    Args:
      tensors: the manifest, an ordered sequence of tensors (or a
        weightsync._tensors.Manifest: its names, dtypes and shapes, all
        dense). Each is either a
        mapping with keys "name", "dtype", "shape" and optionally
        "sparse_nnz" (or "sparseNnz"; default 0), or an object with those
        attributes (such as a weightsync.v1.TensorSpec message). dtype is the
        weightsync.v1.DType enum name ("BFLOAT16") or its number (2).
      chunk_bytes: chunk size in bytes; a positive multiple of ALIGNMENT.

    Returns:
      A dict:
        "total_bytes":    length of the stream;
        "tensor_offsets": per tensor, byte offset of its payload in the stream
                          (multiples of ALIGNMENT);
        "payload_bytes":  per tensor, bytes of its payload;
        "chunks":         list of {"index", "offset", "size", "pieces"}, where
                          chunk k covers stream bytes [offset, offset + size),
                          offset = k * chunk_bytes, and "pieces" is a list of
                          {"tensor", "tensor_offset", "chunk_offset", "length"}:
                          `length` bytes of tensor `tensor`'s payload starting
                          at `tensor_offset` lie at `chunk_offset` in the chunk.
                          Pieces are in manifest order; zero-payload tensors
                          have none. Bytes of a chunk not covered by a piece
                          are padding (zeros on the wire).

    Raises:
      ValueError: invalid chunk_bytes (message contains "chunk_bytes") or an
        invalid tensor (message contains the tensor's name, or "name" if the
        name is empty). See docs/chunk_planner.md for the list.
    """
    if not _is_int(chunk_bytes) or chunk_bytes <= 0 or chunk_bytes % ALIGNMENT != 0:
        raise ValueError(
            f"chunk_bytes must be a positive multiple of {ALIGNMENT}, got {chunk_bytes!r}")
    return _plan(_validated_payloads(tensors), chunk_bytes)


_CACHE_SIZE = 8
_cache = collections.OrderedDict()
_cache_lock = threading.Lock()


def plan_chunks_cached(manifest_key, tensors, chunk_bytes):
    """plan_chunks(tensors, chunk_bytes), memoised on (manifest_key,
    chunk_bytes): a manifest that is the same as a recent one gets the
    same plan object back without validating or planning again (the last
    8 (manifest, chunk size) pairs are kept).

    manifest_key identifies the manifest exactly:
      * a weightsync._tensors.Manifest (build_manifest's result): looked up
        by its fingerprint and confirmed by comparing its key (names,
        dtypes, shapes), so two manifests share a plan only if they are
        equal; `tensors` may then be the Manifest itself or its specs();
      * or any hashable the caller guarantees changes whenever the
        manifest does (e.g. a registered source's id).

    The returned plan is shared: treat it as read-only. Errors are raised
    as by plan_chunks (and nothing is cached)."""
    if hasattr(manifest_key, "fingerprint") and hasattr(manifest_key, "key"):
        lookup, exact = (manifest_key.fingerprint, chunk_bytes, "manifest"), manifest_key.key
    else:
        lookup, exact = (manifest_key, chunk_bytes), None
    with _cache_lock:
        hit = _cache.get(lookup)
        if hit is not None and (exact is None or hit[0] is exact or hit[0] == exact):
            _cache.move_to_end(lookup)
            return hit[1]
    plan = plan_chunks(tensors, chunk_bytes)
    with _cache_lock:
        _cache[lookup] = (exact, plan)
        _cache.move_to_end(lookup)
        while len(_cache) > _CACHE_SIZE:
            _cache.popitem(last=False)
    return plan


def clear_plan_cache():
    """Forgets every plan plan_chunks_cached kept."""
    with _cache_lock:
        _cache.clear()


# ---------------------------------------------------------------------------
# Test vectors (tests/vectors/chunk_plan.json)
# ---------------------------------------------------------------------------

_ZEROS = bytes(ALIGNMENT)


def pack_chunk(chunk, payloads):
    """The bytes of one chunk of a plan_chunks plan: each piece taken from
    `payloads[piece["tensor"]]` (a flat uint8 numpy array, or anything
    bytes-like whose slices are bytes-like), padding zero. One join over
    views of the payloads: each byte is copied once."""
    return b"".join(chunk_parts(chunk, payloads))


def chunk_parts(chunk, payloads):
    """What pack_chunk joins: views of the payloads and zero padding, in
    order. Views of numpy arrays stay valid (and see new values) for as
    long as the arrays live, so a caller sending the same arrays again may
    keep this list and join it instead of walking the pieces again."""
    parts = []
    push = parts.append
    at = 0
    size = chunk["size"]
    for p in chunk["pieces"]:
        gap = p["chunk_offset"] - at
        if gap:
            push(_ZEROS[:gap] if gap <= ALIGNMENT else bytes(gap))
        data = payloads[p["tensor"]]
        begin, length = p["tensor_offset"], p["length"]
        if begin or length != len(data):
            data = data[begin:begin + length]
        push(data)
        at = p["chunk_offset"] + length
    if at < size:
        push(bytes(size - at))
    return parts


def _t(name, dtype, shape, sparse_nnz=0, sparse_index_bytes=0):
    t = {"name": name, "dtype": dtype, "shape": list(shape), "sparse_nnz": sparse_nnz}
    if sparse_index_bytes:
        t["sparse_index_bytes"] = sparse_index_bytes
    return t


def _llama_like_model():
    """A tiny Llama/Qwen-shaped model: vocab 1000, hidden 64, 2 layers,
    GQA with 4 query heads / 2 kv heads of dim 16, MLP 172."""
    vocab, hidden, inter, kv = 1000, 64, 172, 32
    ts = [_t("model.embed_tokens.weight", "BFLOAT16", [vocab, hidden])]
    for layer in range(2):
        p = f"model.layers.{layer}."
        ts += [
            _t(p + "input_layernorm.weight", "BFLOAT16", [hidden]),
            _t(p + "self_attn.q_proj.weight", "BFLOAT16", [hidden, hidden]),
            _t(p + "self_attn.k_proj.weight", "BFLOAT16", [kv, hidden]),
            _t(p + "self_attn.v_proj.weight", "BFLOAT16", [kv, hidden]),
            _t(p + "self_attn.o_proj.weight", "BFLOAT16", [hidden, hidden]),
            _t(p + "post_attention_layernorm.weight", "BFLOAT16", [hidden]),
            _t(p + "mlp.gate_proj.weight", "BFLOAT16", [inter, hidden]),
            _t(p + "mlp.up_proj.weight", "BFLOAT16", [inter, hidden]),
            _t(p + "mlp.down_proj.weight", "BFLOAT16", [hidden, inter]),
        ]
    ts += [
        _t("model.norm.weight", "BFLOAT16", [hidden]),
        _t("lm_head.weight", "BFLOAT16", [vocab, hidden]),
    ]
    return ts


def vector_cases():
    """(name, chunk_bytes, tensors) of the valid cases in the vectors file."""
    return [
        ("empty_manifest", 1024, []),
        ("one_tiny_tensor", 1024, [_t("a", "BFLOAT16", [3, 5])]),
        ("small_tensors_with_padding", 1024, [
            _t("a", "FLOAT32", [7]),
            _t("b", "BFLOAT16", [100]),
            _t("c", "UINT8", [1]),
            _t("d", "FLOAT16", [129]),
        ]),
        ("one_tensor_many_chunks", 1024, [_t("big", "FLOAT32", [1000, 3])]),
        ("tensor_exactly_one_chunk", 1024, [
            _t("exact", "FLOAT32", [16, 16]),
            _t("next", "INT8", [5]),
        ]),
        ("chunk_boundary_at_tensor_boundary", 512, [
            _t("first", "BFLOAT16", [256]),
            _t("second", "BFLOAT16", [128]),
            _t("third", "FLOAT32", [64]),
            _t("fourth", "INT64", [10]),
        ]),
        ("zero_element_tensors_between", 512, [
            _t("a", "FLOAT32", [10]),
            _t("empty0", "FLOAT32", [0, 4]),
            _t("b", "BFLOAT16", [300]),
            _t("empty1", "INT64", [3, 0]),
            _t("empty2", "BFLOAT16", [0]),
            _t("c", "UINT8", [700]),
        ]),
        ("trailing_zero_element_tensor", 512, [
            _t("a", "FLOAT32", [10]),
            _t("tail_empty", "FLOAT32", [0]),
        ]),
        ("scalars", 256, [
            _t("step", "INT64", []),
            _t("scale", "FLOAT32", []),
            _t("w", "BFLOAT16", [200]),
            _t("flag", "BOOL", []),
        ]),
        ("mixed_dtypes", 2048, [
            _t("f32", "FLOAT32", [33, 7]),
            _t("bf16", "BFLOAT16", [129]),
            _t("f16", "FLOAT16", [5, 5, 5]),
            _t("f64", "FLOAT64", [17]),
            _t("i64", "INT64", [9]),
            _t("i32", "INT32", [300]),
            _t("i16", "INT16", [3, 3]),
            _t("i8", "INT8", [1000]),
            _t("u8", "UINT8", [77]),
            _t("b", "BOOL", [31]),
            _t("e4m3", "FLOAT8_E4M3FN", [2, 300]),
            _t("e5m2", "FLOAT8_E5M2", [513]),
        ]),
        ("sparse_tensors", 1024, [
            _t("dense", "BFLOAT16", [64, 8]),
            _t("sparse_one", "BFLOAT16", [1000, 64], sparse_nnz=1),
            _t("sparse_narrow", "BFLOAT16", [1000, 64], sparse_nnz=333, sparse_index_bytes=4),
            _t("sparse_wide", "FLOAT16", [100, 7], sparse_nnz=21, sparse_index_bytes=8),
            _t("sparse_small", "FLOAT32", [128, 128], sparse_nnz=10),
            _t("sparse_big", "BFLOAT16", [512, 64], sparse_nnz=300),
            _t("sparse_full", "UINT8", [4, 4], sparse_nnz=16),
            _t("dense_tail", "FLOAT16", [100]),
        ]),
        ("chunk_with_many_tensors", 4096, [
            _t(f"bias.{i}", "FLOAT32", [i + 1]) for i in range(20)
        ]),
        ("smallest_chunk_256", 256, [
            _t("a", "BFLOAT16", [100]),
            _t("b", "FLOAT32", [150]),
            _t("c", "INT8", [256]),
            _t("d", "FLOAT16", [3]),
        ]),
        ("llama_like_small_model", 65536, _llama_like_model()),
    ]


def vector_errors():
    """(name, chunk_bytes, tensors, error_contains) of the error cases."""
    ok = [_t("w", "FLOAT32", [4, 4])]
    return [
        ("chunk_bytes_not_multiple_of_256", 1000, ok, "chunk_bytes"),
        ("chunk_bytes_zero", 0, ok, "chunk_bytes"),
        ("chunk_bytes_negative", -256, ok, "chunk_bytes"),
        ("empty_tensor_name", 1024, [_t("w", "FLOAT32", [4]), _t("", "FLOAT32", [4])], "name"),
        ("duplicate_tensor_name", 1024,
         [_t("dup.weight", "FLOAT32", [4]), _t("x", "INT8", [2]),
          _t("dup.weight", "BFLOAT16", [8])], "dup.weight"),
        ("unspecified_dtype", 1024,
         [_t("w", "FLOAT32", [4]), _t("no_dtype", "DTYPE_UNSPECIFIED", [4])], "no_dtype"),
        ("negative_dimension", 1024, [_t("neg_dim", "FLOAT32", [4, -1])], "neg_dim"),
        ("sparse_nnz_larger_than_numel", 1024,
         [_t("too_sparse", "BFLOAT16", [3, 4], sparse_nnz=13)], "too_sparse"),
        ("sparse_nnz_negative", 1024,
         [_t("neg_nnz", "BFLOAT16", [3, 4], sparse_nnz=-1)], "neg_nnz"),
        ("sparse_index_bytes_invalid", 1024,
         [_t("odd_index", "BFLOAT16", [3, 4], sparse_nnz=2, sparse_index_bytes=2)],
         "odd_index"),
        ("sparse_index_bytes_4_too_many_elements", 1024,
         [_t("big_narrow", "INT8", [2**32 + 1], sparse_nnz=1, sparse_index_bytes=4)],
         "big_narrow"),
        ("size_overflow", 1024, [_t("huge", "FLOAT32", [2**40, 2**40])], "huge"),
        ("too_many_chunks", 256, [_t("w", "UINT8", [2**28, 2])], "chunks"),
    ]


def _tensor_json(t):
    out = {"name": t["name"], "dtype": t["dtype"], "shape": list(t["shape"])}
    if t.get("sparse_nnz", 0):
        out["sparseNnz"] = t["sparse_nnz"]
    if t.get("sparse_index_bytes", 0):
        out["sparseIndexBytes"] = t["sparse_index_bytes"]
    return out


def build_vectors():
    """The whole vectors document (protobuf JSON field names)."""
    cases = []
    for name, chunk_bytes, tensors in vector_cases():
        plan = plan_chunks(tensors, chunk_bytes)
        cases.append({
            "name": name,
            "chunkBytes": chunk_bytes,
            "tensors": [_tensor_json(t) for t in tensors],
            "totalBytes": plan["total_bytes"],
            "tensorOffsets": plan["tensor_offsets"],
            "payloadBytes": plan["payload_bytes"],
            "chunks": [{
                "index": c["index"],
                "offset": c["offset"],
                "size": c["size"],
                "pieces": [{
                    "tensor": p["tensor"],
                    "tensorOffset": p["tensor_offset"],
                    "chunkOffset": p["chunk_offset"],
                    "length": p["length"],
                } for p in c["pieces"]],
            } for c in plan["chunks"]],
        })
    errors = []
    for name, chunk_bytes, tensors, contains in vector_errors():
        try:
            plan_chunks(tensors, chunk_bytes)
        except ValueError as e:
            if contains not in str(e):
                raise AssertionError(f"error case {name}: {e!r} lacks {contains!r}")
        else:
            raise AssertionError(f"error case {name} was not rejected")
        errors.append({
            "name": name,
            "chunkBytes": chunk_bytes,
            "tensors": [_tensor_json(t) for t in tensors],
            "errorContains": contains,
        })
    return {"specVersion": SPEC_VERSION, "alignment": ALIGNMENT,
            "cases": cases, "errors": errors}


def render_vectors():
    """The vectors file's exact text."""
    return json.dumps(build_vectors(), indent=1) + "\n"


def vectors_cli(argv, doc, render, script):
    """The --write / --check / print command line of a vectors generator
    (this module's and weightsync.transfer_plan's): `render()` is the
    vectors' text, `script` the path its out-of-date message names."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--write", metavar="PATH", help="write the test vectors to PATH")
    group.add_argument("--check", metavar="PATH",
                       help="exit 1 if PATH differs from freshly generated vectors")
    args = parser.parse_args(argv)
    text = render()
    if args.write:
        with open(args.write, "w", encoding="utf-8") as f:
            f.write(text)
    elif args.check:
        with open(args.check, encoding="utf-8") as f:
            if f.read() != text:
                print(f"{args.check} is out of date; regenerate with "
                      f"python3 {script} --write {args.check}", file=sys.stderr)
                return 1
    else:
        sys.stdout.write(text)
    return 0


def main(argv=None):
    return vectors_cli(argv, __doc__, render_vectors, "client/python/weightsync/planner.py")


if __name__ == "__main__":
    sys.exit(main())

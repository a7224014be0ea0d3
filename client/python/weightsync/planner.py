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
import json
import sys

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
    payload = payload_bytes(dtype, shape, nnz, ib)
    if payload > MAX_BYTES:
        raise ValueError(f"tensor '{name}': sparse payload of {payload} bytes overflows "
                         f"(more than 2**62 bytes)")
    return payload


def plan_chunks(tensors, chunk_bytes):
    """Plans the byte stream of an update and cuts it into chunks.

    Args:
      tensors: the manifest, an ordered sequence of tensors. Each is either a
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

    seen_names = set()
    payloads = [_validate_tensor(i, t, seen_names) for i, t in enumerate(tensors)]

    offsets = []
    next_offset = 0
    for p in payloads:
        offsets.append(next_offset)
        next_offset = align_up(next_offset + p)
    total = offsets[-1] + payloads[-1] if payloads else 0
    if total > MAX_BYTES:
        raise ValueError(f"total_bytes {total} of the manifest overflows (more than 2**62 bytes)")

    chunks = []
    num_chunks = (total + chunk_bytes - 1) // chunk_bytes
    if num_chunks > MAX_CHUNKS:
        raise ValueError(f"the update packs {total} bytes into {num_chunks} chunks of "
                         f"{chunk_bytes} bytes; the limit is {MAX_CHUNKS} chunks: use larger "
                         "chunks")
    first = 0  # first tensor that may still intersect the current chunk
    for k in range(num_chunks):
        c_begin = k * chunk_bytes
        c_end = min(c_begin + chunk_bytes, total)
        pieces = []
        i = first
        while i < len(payloads) and offsets[i] < c_end:
            t_begin, t_end = offsets[i], offsets[i] + payloads[i]
            if payloads[i] > 0 and t_end > c_begin:
                start, end = max(c_begin, t_begin), min(c_end, t_end)
                pieces.append({
                    "tensor": i,
                    "tensor_offset": start - t_begin,
                    "chunk_offset": start - c_begin,
                    "length": end - start,
                })
            if t_end <= c_end:
                first = i + 1  # tensor ends in this chunk; later chunks skip it
            i += 1
        chunks.append({"index": k, "offset": c_begin, "size": c_end - c_begin,
                       "pieces": pieces})

    return {
        "total_bytes": total,
        "tensor_offsets": offsets,
        "payload_bytes": payloads,
        "chunks": chunks,
    }


# ---------------------------------------------------------------------------
# Test vectors (tests/vectors/chunk_plan.json)
# ---------------------------------------------------------------------------

def pack_chunk(chunk, payloads):
    """The bytes of one chunk of a plan_chunks plan: each piece copied from
    `payloads[piece["tensor"]]` (a flat uint8 numpy array, or anything whose
    slices have .tobytes()), padding zero."""
    buf = bytearray(chunk["size"])
    for p in chunk["pieces"]:
        buf[p["chunk_offset"]:p["chunk_offset"] + p["length"]] = \
            payloads[p["tensor"]][p["tensor_offset"]:p["tensor_offset"] + p["length"]].tobytes()
    return bytes(buf)


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


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--write", metavar="PATH", help="write the test vectors to PATH")
    group.add_argument("--check", metavar="PATH",
                       help="exit 1 if PATH differs from freshly generated vectors")
    args = parser.parse_args(argv)
    text = render_vectors()
    if args.write:
        with open(args.write, "w", encoding="utf-8") as f:
            f.write(text)
    elif args.check:
        with open(args.check, encoding="utf-8") as f:
            if f.read() != text:
                print(f"{args.check} is out of date; regenerate with "
                      f"python3 client/python/weightsync/planner.py --write {args.check}", file=sys.stderr)
                return 1
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The torch-free logic of the GPU halves of the Python client, in CI (no
GPU, no torch): the NCCL library lookup and its error message, the ctypes
binding where a libnccl is installed, CUDA IPC handle parsing, GPU UUID
formatting, allocation tables, the NCCL chunk schedule (checked by
packing with numpy and comparing with the host path's packed stream), and
the GPU sparse diff and GPU receipts, whose code is written once for torch
and numpy (weightsync._xp): run here on numpy and compared bit for bit
with the host implementations (sparse.SparsePatch, receipts.expected_receipt).

    python3 client/python/tests/test_gpu_logic.py
"""

import os
import sys
import tempfile
import types
import unittest

import numpy as np

# The source tree's package, unless WEIGHTSYNC_TEST_INSTALLED=1: then the
# installed one (tests/pip_install_test.sh runs the suite that way).
if not os.environ.get("WEIGHTSYNC_TEST_INSTALLED"):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from weightsync import nccl, planner, receipts, sparse  # noqa: E402
from weightsync.receipts import gpu as receipts_gpu  # noqa: E402
from weightsync import _gpu, _xp  # noqa: E402
from weightsync._errors import WeightSyncError  # noqa: E402
from weightsync._proto import v1  # noqa: E402
from weightsync._tensors import STORAGE  # noqa: E402
from weightsync.gpu_trainer import chunk_schedule  # noqa: E402


class NcclLookupTest(unittest.TestCase):
    def test_error_names_every_place_tried(self):
        with tempfile.TemporaryDirectory() as d:
            with self.assertRaises(OSError) as cm:
                nccl.load(env={"NCCL_LIB": os.path.join(d, "nope.so")}, search_path=[d],
                          loaded=[], loader_name="libnccl-weightsync-absent.so.2")
        msg = str(cm.exception)
        self.assertIn("could not load the NCCL library", msg)
        self.assertIn("NCCL_LIB=", msg)
        self.assertIn("nvidia pip packages", msg)
        self.assertIn("libnccl-weightsync-absent.so.2", msg)
        self.assertIn("set NCCL_LIB", msg)

    def test_candidates_in_order(self):
        with tempfile.TemporaryDirectory() as d:
            lib = os.path.join(d, "nvidia", "nccl", "lib")
            os.makedirs(lib)
            open(os.path.join(lib, "libnccl.so.2"), "w").close()
            other = os.path.join(d, "nvidia", "cu13", "lib")
            os.makedirs(other)
            open(os.path.join(other, "libnccl.so.2"), "w").close()
            env_dir = os.path.join(d, "env")
            os.makedirs(env_dir)
            open(os.path.join(env_dir, "libnccl.so.2"), "w").close()
            cands, tried = nccl.find_library(env={"NCCL_LIB": env_dir}, search_path=[d],
                                             loaded=["/x/libnccl.so.2"])
        self.assertEqual(cands[0], os.path.join(env_dir, "libnccl.so.2"))
        self.assertEqual(cands[1], "/x/libnccl.so.2")
        self.assertEqual(cands[2], os.path.join(lib, "libnccl.so.2"))
        self.assertEqual(cands[3], os.path.join(other, "libnccl.so.2"))
        self.assertEqual(cands[-1], "libnccl.so.2")
        self.assertIn("folder: 1", tried[0])

    def test_not_nccl_is_skipped(self):
        # A library that loads but is not NCCL is passed over, and named.
        with self.assertRaises(OSError) as cm:
            nccl.load(env={"NCCL_LIB": "libc.so.6"}, search_path=[], loaded=[],
                      loader_name="libnccl-weightsync-absent.so.2")
        self.assertIn("libc.so.6", str(cm.exception))

    def test_binding_when_installed(self):
        try:
            nccl.load()
        except OSError as e:
            self.skipTest(f"no libnccl here: {e}")
        uid = nccl.get_unique_id()
        self.assertEqual(len(uid), 128)
        self.assertNotEqual(uid, nccl.get_unique_id())
        self.assertGreater(nccl.version(), 20000)
        with self.assertRaises(ValueError):
            nccl.Communicator(2, b"short", 0)
        with self.assertRaises(ValueError):
            nccl.Communicator(2, uid, 2)
        err = nccl.NcclError("ncclBroadcast", 4, "invalid argument")
        self.assertIn("ncclInvalidArgument", str(err))
        self.assertIn("ncclBroadcast", str(err))


class HandleAndUuidTest(unittest.TestCase):
    def test_storage_handles(self):
        raw = bytes(range(64))
        self.assertEqual(_gpu.parse_storage_handle(raw), raw)
        self.assertEqual(_gpu.parse_storage_handle(b"\x02c" + raw), raw)
        self.assertEqual(_gpu.parse_storage_handle(b"\x03c" + raw), raw)
        with self.assertRaises(ValueError) as cm:
            _gpu.parse_storage_handle(b"\x02e" + raw + b"more")
        self.assertIn("expandable_segments", str(cm.exception))
        with self.assertRaises(ValueError):
            _gpu.parse_storage_handle(b"\x02x" + raw)
        with self.assertRaises(ValueError):
            _gpu.parse_storage_handle(None)

    def test_uuid_formats_like_gpu_uuid_h(self):
        b = bytes([0x7f, 0x1c, 0x00, 0xab, 0x12, 0x34, 0x56, 0x78, 0x9a, 0xbc, 0xde, 0xf0,
                   0x01, 0x02, 0x03, 0x04])
        want = "GPU-7f1c00ab-1234-5678-9abc-def001020304"
        self.assertEqual(_gpu.format_gpu_uuid(b), want)
        self.assertEqual(_gpu.format_gpu_uuid(list(b)), want)
        self.assertEqual(_gpu.format_gpu_uuid(want), want)
        self.assertEqual(_gpu.format_gpu_uuid(want[4:].upper()), want)

        class TorchUuid:  # torch._C._CUuuid: .bytes is a list, str() has no prefix
            bytes = list(b)

            def __str__(self):
                return want[4:]
        self.assertEqual(_gpu.format_gpu_uuid(TorchUuid()), want)

        class StrOnly:
            def __str__(self):
                return want[4:]
        self.assertEqual(_gpu.format_gpu_uuid(StrOnly()), want)
        with self.assertRaises(ValueError):
            _gpu.format_gpu_uuid("GPU-1234")


class AllocationTableTest(unittest.TestCase):
    def test_groups_by_handle_and_device(self):
        h1, h2 = b"\x01" * 64, b"\x02" * 64
        allocs, places = _gpu.allocation_table([
            ("a", h1, "GPU-a", 0, 100),
            ("b", h2, "GPU-a", 512, 10),
            ("c", h1, "GPU-a", 1024, 50),
            ("d", h1, "GPU-b", 0, 8),       # same bytes, other GPU: another allocation
        ])
        self.assertEqual([a["size"] for a in allocs], [1074, 522, 8])
        self.assertEqual(places, [("a", 0, 0), ("b", 1, 512), ("c", 0, 1024), ("d", 2, 0)])

    def test_overlap_names_both(self):
        with self.assertRaises(ValueError) as cm:
            _gpu.allocation_table([("x", b"\x01" * 64, "G", 0, 100),
                                   ("y", b"\x01" * 64, "G", 96, 8)])
        self.assertIn("'x'", str(cm.exception))
        self.assertIn("'y'", str(cm.exception))


    def test_columns_equal_the_table(self):
        # allocation_columns takes ipc_location_columns' columns (keys in any
        # order) and numbers allocations by first use, as allocation_table.
        h1, h2 = b"\x01" * 64, b"\x02" * 64
        keys = [(h2, "GPU-a"), (h1, "GPU-a"), (h1, "GPU-b")]
        allocs, index, off = _gpu.allocation_columns(
            ["a", "b", "c", "d"], keys, np.array([1, 0, 1, 2]),
            np.array([0, 512, 1024, 0]), np.array([100, 10, 50, 8]))
        self.assertEqual(allocs, _gpu.allocation_table([
            ("a", h1, "GPU-a", 0, 100), ("b", h2, "GPU-a", 512, 10),
            ("c", h1, "GPU-a", 1024, 50), ("d", h1, "GPU-b", 0, 8)])[0])
        self.assertEqual(index.dtype, np.int32)
        self.assertEqual(index.tolist(), [0, 1, 0, 2])
        self.assertEqual(off.tolist(), [0, 512, 1024, 0])
        with self.assertRaises(ValueError) as cm:
            _gpu.allocation_columns(["x", "y"], keys[:1], [0, 0], [0, 96], [100, 8])
        self.assertIn("'x' and 'y' overlap", str(cm.exception))
        allocs, index, off = _gpu.allocation_columns([], [], [], [], [])
        self.assertEqual((allocs, index.size, off.size), ([], 0, 0))

    def test_location_tuples_as_columns(self):
        h1, h2 = b"\x01" * 64, b"\x02" * 64
        keys, group, off, nbytes = _gpu._columns_of([
            (h1, "GPU-a", 0, 64), (h2, "GPU-a", 8, 4), (h1, "GPU-a", 64, 16)])
        self.assertEqual(keys, [(h1, "GPU-a"), (h2, "GPU-a")])
        self.assertEqual((group.tolist(), off.tolist(), nbytes.tolist()),
                         ([0, 1, 0], [0, 8, 64], [64, 4, 16]))


class FakeTensor:
    def __init__(self, ptr, shape, dtype="torch.float32"):
        self.ptr, self.shape, self.dtype = ptr, shape, dtype
        self.device = type("D", (), {"type": "cuda", "index": 0})()

    def data_ptr(self):
        return self.ptr

    def stride(self):
        return (self.shape[1], 1) if len(self.shape) == 2 else (1,)

    def numel(self):
        return int(np.prod(self.shape))


class DedupeTest(unittest.TestCase):
    def test_tied_embeddings(self):
        emb = FakeTensor(1000, (10, 4))
        kept, dropped = _gpu.dedupe_aliases([("embed", emb), ("norm", FakeTensor(2000, (4,))),
                                             ("lm_head", emb),
                                             ("view", FakeTensor(1000, (40,)))])
        self.assertEqual([n for n, _ in kept], ["embed", "norm", "view"])
        self.assertEqual(dropped, {"lm_head": "embed"})


def _rand_bits(rng, dtype, n, specials=()):
    """n elements of weightsync dtype `dtype` with random bit patterns
    (NaNs, infinities, subnormals included), plus `specials` (bit patterns)
    at the start; as the dtype's storage array."""
    es = planner.ELEMENT_SIZES[dtype]
    u = rng.integers(0, 1 << (8 * es), n, dtype=np.uint64).astype(f"u{es}")
    u[:len(specials)] = np.array(specials, dtype=np.uint64).astype(f"u{es}")[:n]
    return u.view(STORAGE[dtype])


# Bit patterns where conversions are delicate: ties to even, NaNs with
# payloads and signs, infinities, overflow, subnormals, zeros.
F32_SPECIALS = [0x3F808000, 0x3F818000, 0x3F800001, 0x7FC00001, 0xFFA00000, 0x7F800001,
                0x7F800000, 0xFF800000, 0x477FF000, 0x477FEFFF, 0x33000000, 0x33000001,
                0x38800000, 0x387FC000, 0x00000001, 0x80000000, 0x7F7FFFFF, 0x3F801000]
F16_SPECIALS = [0x7C01, 0xFE01, 0x7FFF, 0x7C00, 0xFC00, 0x0001, 0x8000, 0x3FF, 0x7BFF]
BF16_SPECIALS = [0x7FC1, 0xFF81, 0x7F80, 0x0001, 0x8000, 0x7F7F]
SPECIALS = {"FLOAT32": F32_SPECIALS, "FLOAT16": F16_SPECIALS, "BFLOAT16": BF16_SPECIALS}
FLOATS = ("FLOAT32", "BFLOAT16", "FLOAT16")


def _f32_to_half(x):
    """common/dtype.cc FloatToHalf, transcribed: an independent reference."""
    sign = (x >> 16) & 0x8000
    x &= 0x7FFFFFFF
    if x >= 0x7F800000:
        return sign | 0x7C00 | (0x200 if x > 0x7F800000 else 0)
    if x >= 0x477FF000:
        return sign | 0x7C00
    if x < 0x38800000:
        if x < 0x33000000:
            return sign
        mant = (x & 0x7FFFFF) | 0x800000
        shift = 126 - (x >> 23)
        h, rem, half = mant >> shift, mant & ((1 << shift) - 1), 1 << (shift - 1)
        return sign | (h + (rem > half or (rem == half and h & 1)))
    h, rem = (x - 0x38000000) >> 13, x & 0x1FFF
    return sign | (h + (rem > 0x1000 or (rem == 0x1000 and h & 1)))


def _f32_to_bf16(x):
    """common/dtype.cc FloatToBf16."""
    if (x & 0x7FFFFFFF) > 0x7F800000:
        return ((x >> 16) | 0x40) & 0xFFFF
    return ((x + 0x7FFF + ((x >> 16) & 1)) >> 16) & 0xFFFF


def _half_to_f32(h):
    """common/dtype.cc HalfToFloat."""
    sign, exp, mant = (h & 0x8000) << 16, (h >> 10) & 0x1F, h & 0x3FF
    if exp == 0:
        if mant == 0:
            return sign
        exp = 127 - 15 + 1
        while not mant & 0x400:
            mant, exp = mant << 1, exp - 1
        return sign | (exp << 23) | ((mant & 0x3FF) << 13)
    if exp == 0x1F:
        return sign | 0x7F800000 | (mant << 13)
    return sign | ((exp + 127 - 15) << 23) | (mant << 13)


def _daemon_convert(bits, src, dst):
    """One element's bits converted as common/dtype.cc does (via float)."""
    if src == dst:
        return bits
    u = bits if src == "FLOAT32" else bits << 16 if src == "BFLOAT16" else _half_to_f32(bits)
    return u if dst == "FLOAT32" else _f32_to_bf16(u) if dst == "BFLOAT16" else _f32_to_half(u)


class ConversionTest(unittest.TestCase):
    def test_daemon_rules(self):
        """receipts.convert_bits gives common/dtype.cc's bits (NaN rules
        included, whatever numpy does with NaN payloads): checked against a
        transcription of dtype.cc, on the delicate values and random ones."""
        f32 = np.array([0x3F808000, 0x3F818000, 0x7FC00001, 0xFFA00000], np.uint32)
        self.assertEqual([int(x) for x in receipts.convert_bits(f32.view(np.uint8), "FLOAT32",
                                                                "BFLOAT16")],
                         [0x3F80, 0x3F82, 0x7FC0, 0xFFE0])     # ties to even; NaN quieted
        self.assertEqual([int(x) for x in receipts.convert_bits(f32.view(np.uint8), "FLOAT32",
                                                                "FLOAT16")][2:],
                         [0x7E00, 0xFE00])                    # NaN: sign + quiet bit
        rng = np.random.default_rng(4)
        for src in FLOATS:
            x = _rand_bits(rng, src, 3000, SPECIALS[src])
            bits = x.view(f"u{x.itemsize}")
            for dst in FLOATS:
                got = receipts.convert_bits(x.view(np.uint8), src, dst)
                want = [_daemon_convert(int(b), src, dst) for b in bits]
                self.assertEqual([int(g) for g in got], want, f"{src} -> {dst}")

    def test_array_conversion_equals_host(self):
        rng = np.random.default_rng(5)
        ops = _xp.NumpyOps()
        for src in FLOATS:
            x = _rand_bits(rng, src, 50000, SPECIALS[src])
            raw = x.view(np.uint8)
            for dst in FLOATS:
                want = receipts.convert_bits(raw, src, dst).astype(np.int64)
                got = receipts.convert_element_bits(ops, x, src, dst)
                self.assertEqual(got.dtype, np.int64)
                np.testing.assert_array_equal(got, want, err_msg=f"{src} -> {dst}")
        for dt, width in (("INT8", 1), ("INT64", 8), ("BOOL", 1)):
            raw = rng.integers(0, 256, 8 * width, dtype=np.uint8)
            if dt == "BOOL":
                raw = raw & 1
            np.testing.assert_array_equal(
                receipts.convert_element_bits(ops, raw.view(STORAGE[dt]), dt, dt),
                receipts.convert_bits(raw, dt, dt).astype(np.int64))
        with self.assertRaises(ValueError):
            receipts.convert_element_bits(ops, np.zeros(2, np.int32), "INT32", "FLOAT32")


def _parameter(name, dtype, shape, segments=()):
    p = v1.Parameter(name=name, dtype=getattr(v1, dtype), shape=list(shape))
    for s in segments:
        p.segments.add(**s)
    return p


def _receipt_case(rng):
    """A layout of every kind of parameter, and what a trainer sent:
    {name: (dtype, shape, storage array)}."""
    shapes = {"plain": ("FLOAT32", (37, 23)), "q": ("BFLOAT16", (8, 12)),
              "k": ("BFLOAT16", (4, 12)), "o": ("FLOAT16", (16, 40)),
              "emb": ("FLOAT32", (50, 6)), "norm": ("BFLOAT16", (12,)),
              "scale": ("FLOAT16", ()), "same": ("BFLOAT16", (5, 5)),
              "bias": ("FLOAT32", (30,)), "empty": ("FLOAT32", (0, 4))}
    sent = {n: (dt, shape, _rand_bits(rng, dt, int(np.prod(shape)), SPECIALS[dt]))
            for n, (dt, shape) in shapes.items()}
    layout = [
        _parameter("plain", "BFLOAT16", (37, 23)),                       # no segments
        _parameter("qkv", "FLOAT16", (12, 12), [                          # fused rows
            {"source": "q", "source_shape": [8, 12], "row_count": 8, "col_count": 12},
            {"source": "k", "source_shape": [4, 12], "row_count": 4, "col_count": 12,
             "dest_offset": 96}]),
        _parameter("o_shard", "FLOAT32", (16, 24), [                      # column shard,
            {"source": "o", "source_shape": [16, 40], "row_begin": 0, "row_count": 16,
             "col_begin": 20, "col_count": 20, "dest_offset": 2,       # padded rows
             "dest_row_stride": 24}]),
        _parameter("emb_shard", "BFLOAT16", (32, 6), [                    # vocab rows +
            {"source": "emb", "source_shape": [50, 6], "row_begin": 25, "row_count": 25,
             "col_count": 6}]),                                          # padding
        _parameter("norm", "FLOAT32", (12,), [                            # 1-D source
            {"source": "norm", "source_shape": [12], "row_begin": 3, "row_count": 9,
             "col_count": 1, "dest_offset": 3}]),
        _parameter("scale", "BFLOAT16", ()),                             # 0-d
        _parameter("same", "BFLOAT16", (5, 5)),                          # no conversion
        _parameter("bias", "FLOAT16", (30,)),
        _parameter("gone", "FLOAT32", (4,)),                              # not sent
        _parameter("half_sent", "FLOAT32", (20,), [
            {"source": "nope", "source_shape": [10], "row_count": 10, "col_count": 1},
            {"source": "bias", "source_shape": [30], "row_begin": 5, "row_count": 10,
             "col_count": 1, "dest_offset": 10}]),
        _parameter("empty", "FLOAT32", (0, 4)),
    ]
    return layout, sent


class ReceiptArraysTest(unittest.TestCase):
    """receipts.expected_receipt_arrays (the GPU receipt, run here on
    numpy) equals receipts.expected_receipt (the host one) bit for bit."""

    def host(self, layout, sent):
        return receipts.expected_receipt(
            layout, {n: (dt, shape, a.view(np.uint8)) for n, (dt, shape, a) in sent.items()})

    def test_mix32_in_int64_lanes(self):
        x = np.array([0, 1, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF, 0x9ABCDEF0], np.uint32)
        want = receipts.mix32(x)
        got = receipts.mix32_bits(x.astype(np.int64))
        np.testing.assert_array_equal(got, want.astype(np.int64))
        # mix32(1) = 0x85EBCA6B ^ 0x85EB; mix32(0x80000000): the first
        # xorshift carries the sign bit into the multiply.
        self.assertEqual(int(want[1]), 0x85EB4F80)
        self.assertEqual(int(want[3]), 0x6535E535)
        self.assertEqual(int(x[1]), 1)   # the input is left as it is

    def test_mix32_is_a_bijection(self):
        # What "a change of one element always changes the checksum" rests
        # on (docs/protocol.md, Receipts): mix32 is undone by the xorshift
        # again, a multiply by the inverse of MIX mod 2^32 and the first xorshift.
        x = np.random.default_rng(3).integers(0, 1 << 32, 1 << 20, dtype=np.uint64)
        x = np.concatenate([x, [0, 1, 0xFFFF, 0x10000, 0x80000000, 0xFFFFFFFF]])
        z = receipts.mix32(x.astype(np.uint32)).astype(np.uint64)
        y = z ^ (z >> np.uint64(16))
        back = (y * np.uint64(pow(receipts.MIX, -1, 1 << 32))) & np.uint64(0xFFFFFFFF)
        back ^= back >> np.uint64(16)
        np.testing.assert_array_equal(back, x)

    def test_equals_host_on_every_layout_kind(self):
        rng = np.random.default_rng(11)
        layout, sent = _receipt_case(rng)
        want = self.host(layout, sent)
        self.assertEqual(want[1], 10)   # every parameter but "gone"
        for block in (1 << 22, 64, 7, 1):
            got = receipts.expected_receipt_arrays(layout, sent, _xp.NumpyOps(), block=block)
            self.assertEqual(got, want, f"block {block}")
        # The ops follow the data: numpy arrays need no ops argument.
        self.assertEqual(receipts.expected_receipt_arrays(layout, sent), want)

    def test_one_changed_bit_changes_both(self):
        rng = np.random.default_rng(12)
        layout, sent = _receipt_case(rng)
        want = self.host(layout, sent)
        for name, element in (("o", 20 * 1 + 3), ("emb", 6 * 30 + 1), ("norm", 5)):
            dt, shape, a = sent[name]
            b = a.copy()
            b.view(f"u{b.itemsize}")[element] ^= 1 << (8 * b.itemsize - 6)  # an exponent bit
            changed = dict(sent, **{name: (dt, shape, b)})
            got = receipts.expected_receipt_arrays(layout, changed, block=16)
            self.assertNotEqual(got[0], want[0], name)
            self.assertEqual(got, self.host(layout, changed), name)
        # Padding and elements outside a shard are not covered.
        dt, shape, a = sent["emb"]
        b = a.copy()
        b.view(np.uint32)[6 * 3] ^= 1 << 30   # row 3: rank 0's rows, not emb_shard's
        got = receipts.expected_receipt_arrays(layout, dict(sent, emb=(dt, shape, b)))
        self.assertEqual(got, want)

    def test_llama_tensor_parallel_layouts(self):
        from weightsync import layouts
        config = {"vocab_size": 300, "hidden_size": 64, "intermediate_size": 96,
                  "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
                  "head_dim": 16, "model_type": "qwen3", "tie_word_embeddings": False}
        rng = np.random.default_rng(15)
        for src in FLOATS:
            sent = {n: (src, list(shape), _rand_bits(rng, src, int(np.prod(shape))))
                    for n, shape in layouts.checkpoint_shapes(config)}
            for dst in FLOATS:
                for rank in (0, 1):
                    specs, segs = layouts.llama_engine_layout(config, rank, 2, dtype=dst)
                    layout = [_parameter(n, dt, shape, segs.get(n, [])) for n, dt, shape in specs]
                    want = self.host(layout, sent)
                    self.assertEqual(want[1], len(specs))
                    self.assertEqual(receipts.expected_receipt_arrays(layout, sent, block=999),
                                     want, f"{src} -> {dst} rank {rank}")

    def test_large_sums_wrap_mod_2_64(self):
        # Enough elements that the 32-bit halves carry many times.
        rng = np.random.default_rng(13)
        a = rng.integers(0, 1 << 32, 300000, dtype=np.uint64).astype(np.uint32)
        sent = {"w": ("FLOAT32", (300000,), a.view(np.float32))}
        layout = [_parameter("w", "FLOAT32", (300000,))]
        want = self.host(layout, sent)
        for block in (1 << 22, 4096):
            self.assertEqual(receipts.expected_receipt_arrays(layout, sent, block=block), want)


class FakeStub:
    def __init__(self, layouts):
        self.layouts, self.calls = layouts, 0

    def call(self, name, request=None, **fields):
        assert name == "GetStatus" and fields.get("include_layouts")
        self.calls += 1
        r = v1.GetStatusResponse()
        for eid, layout in self.layouts.items():
            e = r.engines.add(engine_id=eid)
            e.layout.extend(layout)
        return r


class StartNcclTest(unittest.TestCase):
    """NcclSender.start (the NCCL path's Start on one daemon, which one
    GPU can't run): the plan every daemon agreed to, or INTERNAL with the
    update aborted and the communicator torn down when a daemon plans
    otherwise."""

    class Stub:
        def __init__(self, total, chunks):
            self.total, self.chunks, self.calls = total, chunks, []

        def call(self, name, request=None, **fields):
            self.calls.append(name)
            if name == "StartWeightUpdate":
                return v1.StartWeightUpdateResponse(
                    update_id=request.update_id, total_bytes=self.total,
                    num_chunks=self.chunks, chunk_bytes=request.chunk_bytes or 1024)
            return v1.FinishWeightUpdateResponse()

    class Gpu:
        def __init__(self):
            self.aborted = 0

        def plan(self, manifest, chunk_bytes):
            return planner.plan_chunks(manifest, chunk_bytes)

        def abort_comm(self):
            self.aborted += 1

    def sender(self, stub):
        from weightsync import _multi
        from weightsync.senders.base import Link
        from weightsync.senders.nccl import NcclSender
        return NcclSender(Link([stub], _multi.Group([stub], ["t"]), 30.0, 600.0), self.Gpu())

    def test_agreed_plan_and_mismatch(self):
        from weightsync.senders.base import Job
        manifest = [{"name": "a", "dtype": "FLOAT32", "shape": [300]},
                    {"name": "b", "dtype": "FLOAT32", "shape": [7]}]
        plan = planner.plan_chunks(manifest, 1024)
        request = v1.StartWeightUpdateRequest(update_id="u", chunk_bytes=1024)
        update = types.SimpleNamespace(update_id="u")
        stub = self.Stub(plan["total_bytes"], len(plan["chunks"]))
        s = self.sender(stub)
        job = Job(request, manifest=manifest, names=["a", "b"])
        started = s.start(update, job)
        self.assertEqual(job.plan["total_bytes"], plan["total_bytes"])
        self.assertEqual(len(started), 1)
        self.assertLessEqual(job.t_start, job.t_started)
        self.assertEqual(s.gpu.aborted, 0)
        bad = self.Stub(plan["total_bytes"] + 256, len(plan["chunks"]))
        s = self.sender(bad)
        with self.assertRaises(WeightSyncError) as cm:
            s.start(update, Job(request, manifest=manifest, names=["a", "b"]))
        self.assertEqual(cm.exception.code, "INTERNAL")
        self.assertIn("AbortWeightUpdate", bad.calls)
        self.assertEqual(s.gpu.aborted, 1)


class SmallRegionTableTest(unittest.TestCase):
    """receipts_gpu._split_small: which runs the small-region kernel sums
    and the table it reads (the kernel itself runs on a GPU:
    tests/gpu/check_receipts_gpu.py)."""

    def test_small_runs_grouped_and_padded(self):
        K, E = receipts_gpu.SMALL_K, receipts_gpu.SMALL_E
        # (addr, source cols, rows, cols, salt, dest, dest stride, group)
        runs = [(1000 + 64 * i, 16, 1, 16, 7 + i, 100 * i, 16, i % 2) for i in range(70)]
        runs.append((9000, 4, 3, 4, 5, 0, 4, 0))       # 3 whole rows: 12 elements, small
        runs.append((9100, 10, 3, 4, 5, 0, 4, 1))      # rows apart in the source: not small
        runs.append((9200, E + 1, 1, E + 1, 5, 0, E + 1, 0))   # too long
        runs.append((9300, 0, 1, 0, 5, 0, 0, 0))       # empty: left where it was
        rest, small = receipts_gpu._split_small(runs)
        self.assertEqual(rest, runs[71:])
        self.assertEqual(small.shape[1], 5)
        self.assertEqual(small.shape[0] % K, 0)
        # Every program's rows share one group, and each small run is there
        # once with its element count.
        groups = small[:, 4].reshape(-1, K)
        self.assertTrue((groups == groups[:, :1]).all())
        real = small[small[:, 1] > 0]
        self.assertEqual(len(real), 71)
        self.assertEqual(sorted(real[:, 0].tolist()), sorted([1000 + 64 * i for i in range(70)]
                                                             + [9000]))
        merged = real[real[:, 0] == 9000][0]
        self.assertEqual(merged[1], 12)
        self.assertEqual(merged[3], 0)
        self.assertTrue(((small[:, 1] <= E)).all())

    def test_nothing_small(self):
        runs = [(0, 1000, 1, 1000, 1, 0, 1000, 0)]
        rest, small = receipts_gpu._split_small(runs)
        self.assertEqual(rest, runs)
        self.assertIsNone(small)


class ReceiptCheckTest(unittest.TestCase):
    """Link.check_receipts, as the GPU path calls it (one result per
    daemon, the expectation from expected_receipt_arrays)."""

    def test_match_mismatch_and_replicas(self):
        from weightsync import _multi
        from weightsync.senders.base import Link
        rng = np.random.default_rng(14)
        layout, sent = _receipt_case(rng)
        checksum, _, nbytes = receipts.expected_receipt_arrays(layout, sent)
        stubs = [FakeStub({"a": layout, "b": layout}), FakeStub({"c": layout})]
        link = Link(stubs, _multi.Group(stubs, ["a", "b"]), 30.0, 600.0)
        results = []
        for engines in (("a", "b"), ("c",)):
            f = v1.FinishWeightUpdateResponse()
            for eid in engines:
                f.engines.add(engine_id=eid).receipt.CopyFrom(
                    v1.Receipt(checksum=checksum, bytes=nbytes))
            results.append(f)
        computed = []

        def expected(lay):
            computed.append(1)
            return receipts.expected_receipt_arrays(lay, sent)

        link.check_receipts(results, expected)
        self.assertEqual(len(computed), 1)   # one layout: computed once
        results[1].engines[0].receipt.checksum ^= 1 << 40
        with self.assertRaises(WeightSyncError) as cm:
            link.check_receipts(results, expected)
        self.assertEqual(cm.exception.code, "DATA_LOSS")
        self.assertIn("engine 'c'", cm.exception.message)
        # A result without receipts (VERIFY_OFF) is not checked.
        link.check_receipts([v1.FinishWeightUpdateResponse()], expected)


class GpuReceiptsPrepareTest(unittest.TestCase):
    """GpuReceipts.prepare (Trainer.init_ipc(tensors=...), the warm start):
    the kernel tables of every layout the warm start fetched are built under
    the very keys the first update's check looks up, so that check builds
    none and asks the daemon for no layout."""

    def test_prepared_tables_are_the_ones_the_check_uses(self):
        from weightsync import _multi
        from weightsync.senders.base import Link
        from weightsync.senders.gpu_receipts import GpuReceipts
        layout, sent = _receipt_case(np.random.default_rng(3))
        checksum, params, nbytes = receipts.expected_receipt_arrays(layout, sent)
        stub = FakeStub({"a": layout, "b": layout})
        link = Link([stub], _multi.Group([stub], ["a", "b"]), 30.0, 600.0)
        link.remember_layout("L-a", layout)   # what warm_receipts leaves
        link.remember_layout("L-b", layout)

        class Kernel:   # weightsync.receipts.gpu's keyed entry point
            tables, built = set(), []

            def expected_receipts_gpu(self, layouts, sent, plan_key=None):
                if plan_key not in self.tables:
                    self.tables.add(plan_key)
                    self.built.append(plan_key)
                return {0: (checksum, params, nbytes)}

        kernel = Kernel()
        gr = GpuReceipts()
        gr._fast = lambda flats, plan_key: kernel if plan_key is not None else None
        gr.prepare(link, [], [], plan_key=7)
        self.assertEqual(sorted(kernel.built), [(7, "L-a"), (7, "L-b")])
        finished = v1.FinishWeightUpdateResponse()
        for eid in ("a", "b"):
            finished.engines.add(engine_id=eid, layout_id=f"L-{eid}").receipt.CopyFrom(
                v1.Receipt(checksum=checksum, bytes=nbytes))
        gr.check(link, [finished], [], [], plan_key=7)
        self.assertEqual(len(kernel.built), 2)   # nothing built in the update
        self.assertEqual(stub.calls, 0)          # and no layout asked for
        gr.check(link, [finished], [], [], plan_key=8)   # registered again: new tables
        self.assertEqual(sorted(kernel.built)[2:], [(8, "L-a"), (8, "L-b")])
        # Without the kernel (no Triton) prepare does nothing.
        GpuReceipts().prepare(link, [], [], plan_key=None)
        self.assertEqual(len(kernel.built), 4)


class GpuReceiptsEarlyTest(unittest.TestCase):
    """GpuReceipts.early (the nccl sender, once its broadcasts are
    enqueued): the expectation of the layouts the engines had at the last
    check is computed while the transfer runs, and the check after it uses
    that, computing only a layout it has not seen (an engine registered
    again); what the check compares is what early() computed."""

    def test_the_check_uses_what_was_computed_beside_the_transfer(self):
        from weightsync import _multi
        from weightsync.senders.base import Link
        from weightsync.senders.gpu_receipts import GpuReceipts
        layout, sent = _receipt_case(np.random.default_rng(5))
        good = receipts.expected_receipt_arrays(layout, sent)
        stub = FakeStub({"a": layout})
        link = Link([stub], _multi.Group([stub], ["a"]), 30.0, 600.0)
        link.remember_layout("L-a", layout)
        link.remember_layout("L-new", layout)

        class Kernel:
            def __init__(self):
                self.calls = []

            def expected_receipts_gpu(self, layouts, sent, plan_key=None):
                self.calls.append(plan_key)
                return {0: good}

        kernel = Kernel()
        gr = GpuReceipts()
        gr._fast = lambda flats, plan_key: kernel

        def finished(layout_id, checksum=good[0]):
            f = v1.FinishWeightUpdateResponse()
            f.engines.add(engine_id="a", layout_id=layout_id).receipt.CopyFrom(
                v1.Receipt(checksum=checksum, bytes=good[2]))
            return [f]
        timings = {}
        self.assertEqual(gr.early(link, [], [0], timings=timings), {})  # no check yet
        gr.check(link, finished("L-a"), [], [0])             # the first: after the transfer
        self.assertEqual(len(kernel.calls), 1)
        early = gr.early(link, [], [0], timings=timings)     # the next: beside it
        self.assertEqual(list(early), ["L-a"])
        self.assertIn("early_receipts_s", timings)
        self.assertEqual(len(kernel.calls), 2)
        gr.check(link, finished("L-a"), [], [0], early=early)
        self.assertEqual(len(kernel.calls), 2)               # nothing computed after it
        # What is compared is early()'s value: a wrong one is a mismatch.
        with self.assertRaises(WeightSyncError) as cm:
            gr.check(link, finished("L-a"), [], [0],
                     early={"L-a": (good[0] ^ 1, good[1], good[2])})
        self.assertEqual(cm.exception.code, "DATA_LOSS")
        # An engine registered again (a layout early() did not know): computed then.
        gr.check(link, finished("L-new"), [], [0], early=early)
        self.assertEqual(len(kernel.calls), 3)
        self.assertEqual(list(gr.early(link, [], [0])), ["L-new"])
        # A layout whose expectation fails early is left to the check, which
        # raises after Finish (the update's bytes are already under way).
        kernel.expected_receipts_gpu = lambda *a, **k: (_ for _ in ()).throw(
            ValueError("no such tensor"))
        self.assertEqual(gr.early(link, [], [0]), {})


class SparseArraysTest(unittest.TestCase):
    """sparse.changed_elements and TorchSparsePatch (the GPU diff, run here
    on numpy) against the host SparsePatch and its payload."""

    def gpu_style(self, before, after, max_density=0.1, index_bytes=None):
        found = sparse.changed_elements(_xp.NumpyOps(), before, after, max_density)
        if found is None:
            return None
        return sparse.TorchSparsePatch(found[0], found[1], after.shape, index_bytes,
                                       ops=_xp.NumpyOps())

    def test_one_percent_round_trips_and_matches_host(self):
        rng = np.random.default_rng(21)
        for dtype in FLOATS:
            before = _rand_bits(rng, dtype, 300 * 70).reshape(300, 70)
            after = before.copy()
            changed = rng.choice(after.size, after.size // 100, replace=False)
            bits = after.reshape(-1).view(f"u{after.itemsize}")
            bits[changed] ^= 1 + rng.integers(0, 100, len(changed)).astype(bits.dtype)
            for ib in (None, 8):
                p = self.gpu_style(before, after, 0.05, ib)
                host = sparse.diff(before, after, 0.05, ib)
                self.assertEqual(p.nnz, len(changed))
                self.assertEqual(p.index_bytes, ib or 4)
                self.assertTrue(np.all(np.diff(p.indices) > 0))   # increasing
                np.testing.assert_array_equal(p.indices, np.sort(changed))
                np.testing.assert_array_equal(p.indices, host.indices)
                np.testing.assert_array_equal(p.payload(), host.payload())
                self.assertEqual(len(p.payload()), planner.payload_bytes(
                    dtype, [300, 70], p.nnz, p.index_bytes))
                patched = before.copy()
                patched.reshape(-1)[p.indices] = p.values
                np.testing.assert_array_equal(patched.view(f"u{after.itemsize}"),
                                              after.view(f"u{after.itemsize}"))

    def test_bitwise_density_and_unchanged(self):
        before = np.array([np.nan, 0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0], np.float32)
        after = before.copy()
        after[1] = -0.0          # -0 != +0: changed
        after.view(np.uint32)[0] = 0x7FC00001   # another NaN: changed
        p = self.gpu_style(before, after)
        self.assertIsNone(p)                 # 2 of 10 > 10%
        p = self.gpu_style(before, after, max_density=0.2)
        self.assertEqual(list(p.indices), [0, 1])
        same = self.gpu_style(before, before.copy())   # NaN == NaN bitwise
        self.assertEqual((list(same.indices), same.nnz), ([0], 1))   # one unchanged element
        host_same = sparse.diff(before, before.copy())
        np.testing.assert_array_equal(same.payload(), host_same.payload())
        self.assertIsNone(self.gpu_style(np.zeros(0, np.float32), np.zeros(0, np.float32)))
        self.assertIsNone(sparse.diff(np.zeros(0, np.float32), np.zeros(0, np.float32)))

    def test_uint32_indices_are_the_low_halves(self):
        idx = np.array([0, 5, (1 << 31) + 7, (1 << 32) - 1], np.int64)
        vals = np.arange(4, dtype=np.float16)
        p = sparse.TorchSparsePatch(idx, vals, (1 << 32,), ops=_xp.NumpyOps())
        host = sparse.SparsePatch(idx, vals, (1 << 32,))
        self.assertEqual(p.index_bytes, 4)
        np.testing.assert_array_equal(p.index_payload(), host.index_payload())
        np.testing.assert_array_equal(p.payload(), host.payload())
        wide = sparse.TorchSparsePatch(idx, vals, ((1 << 32) + 1,), ops=_xp.NumpyOps())
        self.assertEqual(wide.index_bytes, 8)
        np.testing.assert_array_equal(
            wide.index_payload(),
            sparse.SparsePatch(idx, vals, ((1 << 32) + 1,)).index_payload())
        with self.assertRaises(ValueError):
            sparse.TorchSparsePatch(idx, vals, ((1 << 32) + 1,), 4, ops=_xp.NumpyOps())

    def test_patch_aliases(self):
        a = sparse.TorchSparsePatch(np.zeros(1, np.int64), np.zeros(1, np.float32), (4,),
                                    ops=_xp.NumpyOps(), source_key=("cuda", 0, 1000))
        b = sparse.TorchSparsePatch(np.zeros(1, np.int64), np.zeros(1, np.float32), (4,),
                                    ops=_xp.NumpyOps(), source_key=("cuda", 0, 1000))
        host = sparse.SparsePatch([0], [1.0], (4,))
        kept, dropped = _gpu.dedupe_aliases([("embed", a), ("lm_head", b), ("x", host),
                                             ("y", host)])
        self.assertEqual([n for n, _ in kept], ["embed", "x", "y"])
        self.assertEqual(dropped, {"lm_head": "embed"})


class ChunkScheduleTest(unittest.TestCase):
    """Packing by the schedule (numpy standing in for torch) gives exactly
    the bytes of the packed stream the host path sends."""

    def pack(self, manifest, datas, chunk_bytes, direct_ok, ring):
        plan = planner.plan_chunks(manifest, chunk_bytes)
        ops = chunk_schedule(plan, direct_ok, ring)
        self.assertEqual([o["chunk"]["index"] for o in ops], list(range(len(plan["chunks"]))))
        buffers = [np.zeros(chunk_bytes, np.uint8) for _ in range(ring)]
        last_use = {}
        sent = []
        for k, o in enumerate(ops):
            c = o["chunk"]
            if o["direct"] is not None:
                t, off = o["direct"]
                sent.append(datas[t][off:off + c["size"]].copy())
                continue
            s = o["slot"]
            self.assertEqual(o["wait_free"], s in last_use)
            last_use[s] = k
            buf = buffers[s]
            for p in c["pieces"]:
                buf[p["chunk_offset"]:p["chunk_offset"] + p["length"]] = \
                    datas[p["tensor"]][p["tensor_offset"]:p["tensor_offset"] + p["length"]]
            # Padding is not part of any tensor: compare only covered bytes.
            mask = np.zeros(c["size"], bool)
            for p in c["pieces"]:
                mask[p["chunk_offset"]:p["chunk_offset"] + p["length"]] = True
            sent.append(np.where(mask, buf[:c["size"]], 0).astype(np.uint8))
        return plan, np.concatenate(sent) if sent else np.zeros(0, np.uint8)

    def reference(self, plan, datas):
        stream = np.zeros(plan["total_bytes"], np.uint8)
        for off, n, d in zip(plan["tensor_offsets"], plan["payload_bytes"], datas):
            stream[off:off + n] = d
        return stream

    def test_matches_packed_stream(self):
        rng = np.random.default_rng(1)
        manifest, datas = [], []
        for i, (dtype, shape) in enumerate([("BFLOAT16", (300, 7)), ("FLOAT32", (5,)),
                                             ("FLOAT32", (2048, 3)), ("BFLOAT16", ()),
                                             ("UINT8", (0,)), ("FLOAT16", (1000,))]):
            manifest.append({"name": f"t{i}", "dtype": dtype, "shape": list(shape)})
            n = planner.payload_bytes(dtype, list(shape))
            datas.append(rng.integers(0, 256, n, dtype=np.uint8))
        for chunk in (256, 1024, 4096, 1 << 20):
            for ring in (1, 2, 3):
                for direct in (True, False):
                    plan, sent = self.pack(manifest, datas, chunk, [direct] * len(datas), ring)
                    ref = self.reference(plan, datas)
                    np.testing.assert_array_equal(sent, ref, err_msg=f"{chunk} {ring} {direct}")
                    if direct and chunk == 256:
                        self.assertTrue(any(o["direct"] for o in
                                            chunk_schedule(plan, [True] * len(datas), ring)))

    def test_sparse_payloads_in_the_stream(self):
        # Patches travel packed like dense data: the planner sizes their
        # payload (indices, then values) and the schedule packs it.
        rng = np.random.default_rng(3)
        manifest, datas = [], []
        for i, dtype in enumerate(["BFLOAT16", "FLOAT32", "FLOAT16", "FLOAT32"]):
            before = _rand_bits(rng, dtype, 5000)
            after = before.copy()
            after.view(f"u{after.itemsize}")[rng.choice(5000, 50 * (i + 1), replace=False)] ^= 1
            found = sparse.changed_elements(_xp.NumpyOps(), before, after, 0.1)
            if i == 3:
                manifest.append({"name": f"t{i}", "dtype": dtype, "shape": [5000]})
                datas.append(after.view(np.uint8))
                continue
            p = sparse.TorchSparsePatch(found[0], found[1], (5000,), 8 if i == 2 else None,
                                        ops=_xp.NumpyOps())
            manifest.append({"name": f"t{i}", "dtype": dtype, "shape": [5000],
                             "sparse_nnz": p.nnz, "sparse_index_bytes": p.index_bytes})
            datas.append(p.payload())
        for chunk in (256, 4096):
            plan, sent = self.pack(manifest, datas, chunk, [True] * 4, 2)
            self.assertEqual(plan["payload_bytes"], [len(d) for d in datas])
            np.testing.assert_array_equal(sent, self.reference(plan, datas))

    def test_qwen3_8b_shapes(self):
        from weightsync import layouts
        cfg = {"vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 12288,
               "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
               "head_dim": 128, "model_type": "qwen3", "tie_word_embeddings": False}
        shapes = layouts.checkpoint_shapes(cfg)
        manifest = [{"name": n, "dtype": "BFLOAT16", "shape": list(s)} for n, s in shapes]
        self.assertEqual(len(manifest), 399)
        plan = planner.plan_chunks(manifest, 1 << 30)
        self.assertEqual(sum(plan["payload_bytes"]), 16381470720)
        ops = chunk_schedule(plan, [True] * 399, 2)
        self.assertEqual(len(ops), len(plan["chunks"]))
        # The embedding (1.24 GB) fills chunk 0 alone: broadcast in place.
        self.assertEqual(ops[0]["direct"], (0, 0))


class MovedSignatureTest(unittest.TestCase):
    """senders.ipc.moved_signature: what decides whether a registered source
    is reused. Anything a source depends on (a name, data pointer, dtype,
    shape, stride) changes it; values don't; a non-tensor gives None."""

    class FakeTensor:
        def __init__(self, ptr, dtype="bf16", shape=(4, 4), stride=(4, 1)):
            self.ptr, self.dtype, self.shape, self._stride = ptr, dtype, shape, stride
            self.values = 0

        def data_ptr(self):
            return self.ptr

        def stride(self):
            return self._stride

    def test_changes(self):
        from weightsync.senders.ipc import moved_signature as _moved_signature
        T = self.FakeTensor
        ts = [T(1000 + 64 * i) for i in range(5)]
        pairs = [(f"w{i}", t) for i, t in enumerate(ts)]
        base = _moved_signature(pairs)
        ts[2].values = 7   # values only
        self.assertEqual(_moved_signature(list(pairs)), base)
        for change in (lambda t: setattr(t, "ptr", 1), lambda t: setattr(t, "dtype", "f32"),
                       lambda t: setattr(t, "shape", (16,)),
                       lambda t: setattr(t, "_stride", (1, 4))):
            t = T(1000 + 64 * 3)
            change(t)
            moved = pairs[:3] + [("w3", t)] + pairs[4:]
            self.assertNotEqual(_moved_signature(moved), base)
        self.assertNotEqual(_moved_signature([("v0", ts[0])] + pairs[1:]), base)
        self.assertNotEqual(_moved_signature(pairs[:-1]), base)
        self.assertIsNone(_moved_signature(pairs + [("x", 3.0)]))


class SourcePairsTest(unittest.TestCase):
    """senders.ipc.SourcePairs: the check that lets an update of a registered
    source's very pairs skip all per-tensor work but one pointer read."""

    class T:
        """Compares by value the way torch does: the truth of == raises for
        more than one element, is the value's for one."""

        def __init__(self, ptr, n=16, value=0.0):
            self.ptr, self.n, self.value = ptr, n, value

        def data_ptr(self):
            return self.ptr

        def numel(self):
            return self.n

        def __eq__(self, other):
            if self.n != 1 or getattr(other, "n", 0) != 1:
                raise RuntimeError("Boolean value of Tensor with more than one value "
                                   "is ambiguous")
            return self.value == other.value

        __hash__ = object.__hash__

    def make(self):
        from weightsync.senders.ipc import SourcePairs as _SourcePairs
        T = self.T
        ts = [T(1000 + 64 * i) for i in range(4)] + [T(2000, n=1, value=3.0)]
        pairs = [(f"w{i}", t) for i, t in enumerate(ts)]
        return pairs, _SourcePairs(pairs, "src", data_ptr=T.data_ptr, numel=T.numel)

    def test_same_objects(self):
        pairs, kept = self.make()
        self.assertTrue(kept.same(pairs))
        self.assertTrue(kept.same([(n, t) for n, t in pairs]))   # new tuples
        pairs[2][1].value = 9.0   # values are not what it checks
        self.assertTrue(kept.same(pairs))

    def test_changes(self):
        T = self.T
        pairs, kept = self.make()
        pairs[1][1].ptr = 1   # moved in place (p.data = ...)
        self.assertFalse(kept.same(pairs))
        pairs, kept = self.make()
        for changed in ([("w0", T(1000))] + pairs[1:],            # another tensor, same pointer
                        pairs[:4] + [("w4", T(2000, n=1, value=3.0))],  # equal by value
                        [("v0", pairs[0][1])] + pairs[1:],          # renamed
                        pairs[:-1],                                 # one fewer
                        [list(p) for p in pairs]):                  # not tuples
            self.assertFalse(kept.same(changed))
        self.assertTrue(kept.same(pairs))


if __name__ == "__main__":
    unittest.main()

"""The torch-free logic of the GPU halves of the Python client, in CI (no
GPU, no torch): the NCCL library lookup and its error message, the ctypes
binding where a libnccl is installed, CUDA IPC handle parsing, GPU UUID
formatting, allocation tables and the NCCL chunk schedule (checked by
packing with numpy and comparing with the host path's packed stream).

    python3 client/python/tests/test_gpu_logic.py
"""

import os
import sys
import tempfile
import unittest

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from weightsync import nccl, planner  # noqa: E402
from weightsync import _gpu  # noqa: E402
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


if __name__ == "__main__":
    unittest.main()

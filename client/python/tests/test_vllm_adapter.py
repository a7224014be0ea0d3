"""weightsync.integrations.vllm on the host backend, without torch or vLLM.

The engines here are shaped like vLLM's workers (parameter names, shapes,
shards, padding, expert placement and the worker's attributes the
extension uses, all taken from vLLM's source: docs/integration.md "vLLM"),
not vLLM itself, which is not installable here. Every expected parameter is
computed in numpy from the Hugging Face tensors the way vLLM's
load_weights / weight_loader place them, independently of the layout code.

Run by Bazel (//client/python:vllm_adapter_test) with WEIGHTSYNCD pointing
at the daemon binary; by hand: WEIGHTSYNCD=bazel-bin/daemon/weightsyncd
python3 client/python/tests/test_vllm_adapter.py
"""

import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import types
import unittest

import numpy as np

# The source tree's package, unless WEIGHTSYNC_TEST_INSTALLED=1 (the
# installed one: tests/pip_install_test.sh).
if not os.environ.get("WEIGHTSYNC_TEST_INSTALLED"):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import weightsync  # noqa: E402
from weightsync import layouts, WeightSyncError  # noqa: E402
from weightsync.integrations import vllm as wv  # noqa: E402

# A tiny Qwen3-MoE: 4 query / 2 KV heads, 6 experts, layer 1 dense
# (mlp_only_layers), vocab 130 (vLLM pads to 192: 96 rows a rank at TP 2,
# rank 1 holds 34 real rows and 62 padding rows).
QWEN3_MOE = dict(model_type="qwen3_moe", vocab_size=130, hidden_size=16,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                 num_hidden_layers=3, num_experts=6, moe_intermediate_size=8,
                 intermediate_size=24, decoder_sparse_step=1, mlp_only_layers=[1],
                 tie_word_embeddings=False)
LLAMA_TIED = dict(model_type="llama", vocab_size=250, hidden_size=32, num_attention_heads=8,
                  num_key_value_heads=2, num_hidden_layers=2, intermediate_size=64,
                  tie_word_embeddings=True)


def checkpoint(config, seed):
    rng = np.random.default_rng(seed)
    return {n: rng.standard_normal(s).astype(np.float32)
            for n, s in layouts.checkpoint_shapes(config)}


def vllm_reference(ck, config, tp_rank, tp_size, ep_rank=0, ep_size=1, placement="linear"):
    """{vLLM parameter name: array} as vLLM's loaders fill a worker's
    parameters (QKVParallelLinear, MergedColumnParallelLinear,
    RowParallelLinear, VocabParallelEmbedding, FusedMoE._load_w13/_load_w2
    with determine_expert_map), written out in numpy."""
    c = dict(config)
    H, V = c["hidden_size"], c["vocab_size"]
    heads, kvh = c["num_attention_heads"], c["num_key_value_heads"]
    hd = c.get("head_dim") or H // heads
    out = {}
    padded = -(-V // 64) * 64
    per = padded // tp_size

    def vocab(name):
        w = np.zeros((per, H), np.float32)
        lo, hi = min(tp_rank * per, V), min((tp_rank + 1) * per, V)
        w[:hi - lo] = ck[name][lo:hi]
        out[name] = w

    def col(w, r, n):    # output-dim shard
        s = w.shape[0] // n
        return w[r * s:(r + 1) * s]

    def row(w, r, n):    # input-dim shard
        s = w.shape[1] // n
        return w[:, r * s:(r + 1) * s]

    vocab("model.embed_tokens.weight")
    replicas = max(1, tp_size // kvh)
    kv_parts = tp_size // replicas
    E = c.get("num_experts", 0)
    for l in range(c["num_hidden_layers"]):
        p = f"model.layers.{l}."
        a = p + "self_attn."
        out[a + "qkv_proj.weight"] = np.concatenate([
            col(ck[a + "q_proj.weight"], tp_rank, tp_size),
            col(ck[a + "k_proj.weight"], tp_rank // replicas, kv_parts),
            col(ck[a + "v_proj.weight"], tp_rank // replicas, kv_parts)])
        out[a + "o_proj.weight"] = row(ck[a + "o_proj.weight"], tp_rank, tp_size)
        if c["model_type"] in ("qwen3", "qwen3_moe"):
            out[a + "q_norm.weight"] = ck[a + "q_norm.weight"]
            out[a + "k_norm.weight"] = ck[a + "k_norm.weight"]
        for n in ("input_layernorm", "post_attention_layernorm"):
            out[p + n + ".weight"] = ck[p + n + ".weight"]
        if E and l not in c.get("mlp_only_layers", ()):
            mtp, mr = (1, 0) if ep_size > 1 else (tp_size, tp_rank)
            if ep_size == 1:
                held = list(range(E))
            elif placement == "round_robin":
                held = [e for e in range(E) if e % ep_size == ep_rank]
            else:
                base, rem = E // ep_size, E % ep_size
                start = ep_rank * base + min(ep_rank, rem)
                held = list(range(start, start + base + (ep_rank < rem)))
            I = c["moe_intermediate_size"] // mtp
            w13 = np.zeros((len(held), 2 * I, H), np.float32)
            w2 = np.zeros((len(held), H, I), np.float32)
            for j, e in enumerate(held):
                x = f"{p}mlp.experts.{e}."
                w13[j, :I] = col(ck[x + "gate_proj.weight"], mr, mtp)   # shard_id w1
                w13[j, I:] = col(ck[x + "up_proj.weight"], mr, mtp)     # shard_id w3
                w2[j] = row(ck[x + "down_proj.weight"], mr, mtp)
            out[p + "mlp.experts.w13_weight"] = w13
            out[p + "mlp.experts.w2_weight"] = w2
            out[p + "mlp.gate.weight"] = ck[p + "mlp.gate.weight"]
        else:
            out[p + "mlp.gate_up_proj.weight"] = np.concatenate([
                col(ck[p + "mlp.gate_proj.weight"], tp_rank, tp_size),
                col(ck[p + "mlp.up_proj.weight"], tp_rank, tp_size)])
            out[p + "mlp.down_proj.weight"] = row(ck[p + "mlp.down_proj.weight"], tp_rank, tp_size)
    out["model.norm.weight"] = ck["model.norm.weight"]
    if not c.get("tie_word_embeddings"):
        vocab("lm_head.weight")
    return out


def apply_segments(params, segments, ck):
    """What the daemon does with a layout (docs/protocol.md, Segments), in numpy."""
    out = {}
    for name, _, shape in params:
        flat = np.zeros(int(np.prod(shape)), np.float32)
        segs = segments.get(name)
        if not segs:
            flat[:] = ck[name].reshape(-1)
        for s in segs or ():
            src = ck[s["source"]]
            m = src.reshape(src.shape[0], -1)
            stride = s["dest_row_stride"] or s["col_count"]
            for i in range(s["row_count"]):
                o = s["dest_offset"] + i * stride
                flat[o:o + s["col_count"]] = m[s["row_begin"] + i,
                                               s["col_begin"]:s["col_begin"] + s["col_count"]]
        out[name] = flat.reshape(shape)
    return out


class LayoutTest(unittest.TestCase):
    """The layout against the reference, without a daemon, over more shapes."""

    def check(self, config, tp_size, ep_size=1, placement="linear"):
        ck = checkpoint(config, 1)
        for r in range(tp_size):
            ep_rank = r if ep_size > 1 else 0
            params, segments = wv.vllm_engine_layout(config, r, tp_size, ep_rank, ep_size,
                                                     "FLOAT32", expert_placement=placement)
            ref = vllm_reference(ck, config, r, tp_size, ep_rank, ep_size, placement)
            self.assertEqual(sorted(n for n, _, _ in params), sorted(ref))
            got = apply_segments(params, segments, ck)
            for n in ref:
                np.testing.assert_array_equal(got[n], ref[n], err_msg=f"rank {r} {n}")

    def test_qwen3_moe_tp_and_ep(self):
        self.check(QWEN3_MOE, 2, 2)
        self.check(QWEN3_MOE, 2, 2, "round_robin")
        # 6 experts over 4 ranks: 2, 2, 1, 1; KV heads replicated; vocab
        # 180 (130 would leave rank 3 only padding: refused, below).
        self.check(dict(QWEN3_MOE, vocab_size=180), 4, 4)
        self.check(QWEN3_MOE, 2)        # no EP: every expert TP-sharded

    def test_dense_kv_replication_and_tied_vocab(self):
        self.check(LLAMA_TIED, 4)       # 2 KV heads at TP 4: each replicated twice
        self.check(LLAMA_TIED, 8)
        self.check(dict(QWEN3_MOE, model_type="qwen3", num_experts=0), 2)

    def test_vocab_follows_vllm_not_per_rank_padding(self):
        # vLLM pads the whole vocabulary, then splits it: 151936 / 4 = 37984
        # rows (layouts.llama_engine_layout's per-rank padding gives 38016).
        self.assertEqual(wv.vocab_shard(151936, 3, 4), (37984, 3 * 37984, 37984))
        self.assertEqual(wv.vocab_shard(130, 1, 2), (96, 96, 34))
        with self.assertRaises(ValueError):
            wv.vocab_shard(130, 3, 4)   # 192 / 4 = 48 rows: rank 3 starts at 144

    def test_expert_placement(self):
        self.assertEqual(wv.local_experts(6, 0, 4), [0, 1])
        self.assertEqual(wv.local_experts(6, 3, 4), [5])
        self.assertEqual(wv.local_experts(6, 1, 4, "round_robin"), [1, 5])

    def test_refusals_and_check(self):
        with self.assertRaises(ValueError):
            wv.vllm_engine_layout(dict(QWEN3_MOE, model_type="mixtral"), 0, 1)
        with self.assertRaises(ValueError):
            wv.vllm_engine_layout(dict(LLAMA_TIED, attention_bias=True), 0, 1)
        with self.assertRaises(ValueError):
            layouts.llama_engine_layout(QWEN3_MOE, 0, 1)
        params, _ = wv.vllm_engine_layout(QWEN3_MOE, 0, 2, 0, 2, "FLOAT32")
        held = {n: np.zeros(s) for n, _, s in params}
        self.assertEqual(wv.check_layout(params, held), params)
        held["model.layers.0.mlp.experts.e_score_correction_bias"] = np.zeros(6)
        held["model.norm.weight"] = np.zeros(17)
        with self.assertRaises(ValueError) as ctx:
            wv.check_layout(params, held)
        self.assertIn("never updated", str(ctx.exception))
        self.assertIn("model.norm.weight: worker (17,)", str(ctx.exception))

    def test_imports_without_torch_or_vllm(self):
        code = ("import sys; sys.path.insert(0, %r); import weightsync.integrations.vllm; "
                "assert 'torch' not in sys.modules and 'vllm' not in sys.modules"
                % os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        subprocess.run([sys.executable, "-c", code], check=True)


# A stand-in for vllm.distributed.parallel_state: what the extension reads.
_RANKS = {}


def _install_fake_vllm():
    group = lambda rank, size: types.SimpleNamespace(rank_in_group=rank, world_size=size)
    ps = types.ModuleType("vllm.distributed.parallel_state")
    ps.get_tensor_model_parallel_rank = lambda: _RANKS["tp"][0]
    ps.get_tensor_model_parallel_world_size = lambda: _RANKS["tp"][1]
    ps.get_ep_group = lambda: group(*_RANKS["ep"])
    ps.get_pp_group = lambda: group(0, 1)
    dist = types.ModuleType("vllm.distributed")
    dist.parallel_state = ps
    root = types.ModuleType("vllm")
    root.distributed = dist
    saved = {k: sys.modules.get(k) for k in ("vllm", "vllm.distributed",
                                             "vllm.distributed.parallel_state")}
    sys.modules.update({"vllm": root, "vllm.distributed": dist,
                        "vllm.distributed.parallel_state": ps})
    return saved


class FakeRunner:
    """vLLM's GPUModelRunner as the extension sees it: .model, .execute_model."""

    def __init__(self, model):
        self.model = model
        self.steps = 0
        self.block = None    # an Event a step waits on

    def execute_model(self, scheduler_output, intermediate_tensors=None):
        if self.block is not None:
            self.block.wait()
        self.steps += 1
        return scheduler_output


class FakeModel:
    def __init__(self, params):
        self.params = params

    def named_parameters(self):
        return iter(list(self.params.items()))


class FakeWorker(wv.WeightsyncWorkerExtension):
    """vLLM's Worker with the extension mixed in, on the host backend: its
    parameters become shared-memory arrays (register_host) instead of CUDA
    tensors (register_torch), the only seam replaced besides the device sync."""

    def __init__(self, config, shapes, ep):
        self.model_config = types.SimpleNamespace(hf_config=config, dtype="torch.float32")
        self.parallel_config = types.SimpleNamespace(
            enable_expert_parallel=ep, expert_placement_strategy="linear", data_parallel_rank=0)
        self.device = "cpu"
        self.model_runner = FakeRunner(FakeModel(
            {n: np.zeros(s, np.float32) for n, s in shapes.items()}))
        self.drains = 0

    def _weightsync_register(self, engine, named, params, segments, version):
        arrays = engine.register_host(params, version=version, segments=segments)
        self.model_runner.model.params.update(arrays)

    def _weightsync_drain(self):
        self.drains += 1


def check_pause_relay(test, step, steps, paused):
    """An engine serving (step() called in a loop on a thread) while
    test.trainer pauses and resumes: the pause parks it at the gate (steps()
    stops growing, paused() is true), resume lets it go on."""
    stop = threading.Event()

    def serve():
        while not stop.is_set():
            step()
            time.sleep(0.001)
    t = threading.Thread(target=serve)
    t.start()
    try:
        time.sleep(0.05)
        test.trainer.pause(mode="keep")
        n = steps()
        time.sleep(0.2)
        test.assertEqual(steps(), n)      # parked at the gate
        test.assertTrue(paused())
        test.trainer.resume()
        deadline = time.time() + 5
        while steps() == n and time.time() < deadline:
            time.sleep(0.01)
        test.assertGreater(steps(), n)
    finally:
        stop.set()
        t.join()


class DaemonTest(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="wsvllm.", dir="/tmp")
        sock = os.path.join(self.dir, "d.sock")
        self.log = open(os.path.join(self.dir, "daemon.log"), "w")
        self.daemon = subprocess.Popen(
            [os.environ["WEIGHTSYNCD"], f"--socket={sock}", "--notice_timeout_ms=2000"],
            stderr=self.log)
        for _ in range(100):
            if os.path.exists(sock):
                break
            time.sleep(0.05)
        self.target = "unix:" + sock
        self.trainer = weightsync.Trainer(self.target, timeout=10)
        self.cleanup = []

    def tearDown(self):
        for fn in reversed(self.cleanup):
            fn()
        self.trainer.close()
        self.daemon.terminate()
        self.assertEqual(self.daemon.wait(timeout=10), 0)
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def wait_connected(self, ids):
        for _ in range(200):
            up = {s.engine_id for s in self.trainer.status().engines if s.connected}
            if set(ids) <= up:
                return
            time.sleep(0.02)
        self.fail(f"engines {ids} never connected")

    def test_layout_engines_receive_hf_checkpoint_as_vllm_places_it(self):
        # Four vLLM-shaped workers of one daemon: TP=2 with EP=2 (each holds
        # 3 of 6 experts), and TP=2 without EP (experts TP-sharded).
        ranks = [(0, 0, 2), (1, 1, 2), (0, 0, 1), (1, 0, 1)]
        engines = []
        for i, (tp, ep, ep_size) in enumerate(ranks):
            params, segments = wv.vllm_engine_layout(QWEN3_MOE, tp, 2, ep, ep_size, "FLOAT32")
            e = weightsync.Engine(f"w{i}", self.target, timeout=10)
            engines.append((e, e.register_host(params, segments=segments)))
            e.start()
            self.cleanup.append(e.close)
        self.wait_connected([f"w{i}" for i in range(4)])
        self.trainer.init_host()
        for version in (1, 2):
            ck = checkpoint(QWEN3_MOE, version)
            result = self.trainer.update(list(ck.items()), version=version, chunk_bytes=4096)
            self.assertEqual(result.version, version)
            for (e, w), (tp, ep, ep_size) in zip(engines, ranks):
                ref = vllm_reference(ck, QWEN3_MOE, tp, 2, ep, ep_size)
                self.assertEqual(sorted(w), sorted(ref))
                for n in ref:
                    np.testing.assert_array_equal(w[n], ref[n], err_msg=f"{e.engine_id} {n}")
                # vocab padding rows of rank 1 are never written
                if tp == 1:
                    self.assertFalse(w["lm_head.weight"][34:].any())

    def test_worker_extension_registers_relays_pause_and_reports_version(self):
        saved = _install_fake_vllm()
        os.environ["WEIGHTSYNC_TARGET"] = self.target
        self.cleanup.append(lambda: os.environ.pop("WEIGHTSYNC_TARGET", None))
        self.cleanup.append(lambda: [sys.modules.pop(k, None) if v is None else
                                     sys.modules.__setitem__(k, v) for k, v in saved.items()])
        ck0 = checkpoint(QWEN3_MOE, 0)
        workers = []
        for r in range(2):
            shapes = {n: a.shape for n, a in vllm_reference(ck0, QWEN3_MOE, r, 2, r, 2).items()}
            w = FakeWorker(QWEN3_MOE, shapes, ep=True)
            _RANKS.update(tp=(r, 2), ep=(r, 2))
            self.assertEqual(w.weightsync_start(), f"vllm.dp0.pp0.tp{r}")
            self.cleanup.append(w.weightsync_stop)
            workers.append(w)
        self.wait_connected(["vllm.dp0.pp0.tp0", "vllm.dp0.pp0.tp1"])
        self.assertEqual([w.weightsync_version() for w in workers], [0, 0])

        # vLLM's trainer-side shape: trainer_init, then trainer_send_weights.
        trainer = wv.WeightsyncTrainer.trainer_init({"target": self.target, "backend": "host",
                                                     "timeout": 10})
        self.cleanup.append(trainer.close)
        calls = []
        ck = checkpoint(QWEN3_MOE, 7)
        result = wv.WeightsyncTrainer.trainer_send_weights(
            iter(ck.items()), {"trainer": trainer, "version": 1, "chunk_bytes": 4096,
                               "pause": lambda: calls.append("pause"),
                               "resume": lambda: calls.append("resume")})
        self.assertEqual(result.version, 1)
        self.assertEqual(calls, ["pause", "resume"])
        for r, w in enumerate(workers):
            held = dict(w.model_runner.model.named_parameters())
            for n, a in vllm_reference(ck, QWEN3_MOE, r, 2, r, 2).items():
                np.testing.assert_array_equal(held[n], a, err_msg=f"rank {r} {n}")
            self.assertEqual(w.weightsync_version(), 1)
            self.assertEqual(w._weightsync_events,
                             [("pause", "PAUSE_MODE_KEEP"), ("version", 1), ("resume",)])
            self.assertGreaterEqual(w.drains, 1)
            self.assertEqual(w.weightsync_status(),
                             {"engine_id": f"vllm.dp0.pp0.tp{r}", "version": 1,
                              "paused": False, "dirty": False})

        # Pause relay: steps stop while paused, go on after resume.
        runner = workers[0].model_runner
        check_pause_relay(self, lambda: runner.execute_model("step"), lambda: runner.steps,
                          lambda: workers[0].weightsync_status()["paused"])

        # A step that does not finish: the pause is refused, not hung
        # (what a TP peer stuck in its all-reduce would see).
        gate = workers[1]._weightsync_gate
        gate.timeout = 0.3
        runner = workers[1].model_runner
        runner.block = threading.Event()
        t = threading.Thread(target=runner.execute_model, args=("step",))
        t.start()
        try:
            time.sleep(0.05)
            with self.assertRaises(WeightSyncError):
                self.trainer.pause(mode="keep")
            self.assertFalse(gate.paused)
        finally:
            runner.block.set()
            t.join()
        runner.block = None

        # Stop: the gate comes off and the daemon forgets the worker.
        workers[1].weightsync_stop()
        self.assertFalse(hasattr(runner.execute_model, "__wrapped__"))
        self.assertIsNone(workers[1].weightsync_version())
        for _ in range(100):
            if "vllm.dp0.pp0.tp1" not in {s.engine_id for s in self.trainer.status().engines}:
                break
            time.sleep(0.02)
        self.assertNotIn("vllm.dp0.pp0.tp1",
                         {s.engine_id for s in self.trainer.status().engines})


if __name__ == "__main__":
    unittest.main()

"""weightsync.integrations.sglang on the host backend, without torch or SGLang.

The engines here are shaped like SGLang's TP ranks (parameter names,
shapes, shards, padding, expert placement, and the call path of a custom
weight loader, all taken from SGLang's source: docs/integration.md
"SGLang"), not SGLang itself, which is not installable here. Where SGLang
places weights as vLLM does (dense layers, vocabulary, experts with
ep = 1 or ep = tp) the expected values come from the vLLM test's numpy
reference, imported; only SGLang's own MoE case (ep < tp: experts split
over ep, each sharded over tp / ep) is written here.

Run by Bazel (//client/python:sglang_adapter_test) with WEIGHTSYNCD pointing
at the daemon binary; by hand: WEIGHTSYNCD=bazel-bin/daemon/weightsyncd
python3 client/python/tests/test_sglang_adapter.py
"""

import os
import subprocess
import sys
import threading
import time
import types
import unittest

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
# The source tree's package, unless WEIGHTSYNC_TEST_INSTALLED=1 (the
# installed one: tests/pip_install_test.sh).
if not os.environ.get("WEIGHTSYNC_TEST_INSTALLED"):
    sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import weightsync  # noqa: E402
from weightsync import WeightSyncError  # noqa: E402
from weightsync.integrations import sglang as ws  # noqa: E402
import test_vllm_adapter as vt  # noqa: E402  (the numpy reference of the shared loaders)

QWEN3_MOE, LLAMA_TIED, checkpoint, apply_segments = (
    vt.QWEN3_MOE, vt.LLAMA_TIED, vt.checkpoint, vt.apply_segments)


def sglang_reference(ck, config, tp_rank, tp_size, ep_size=1):
    """{SGLang parameter name: array} of one TP rank. Dense parts and the
    vocabulary as vLLM (VocabParallelEmbedding, QKV/MergedColumn/RowParallel
    are the same code); the experts as SGLang's FusedMoE: moe_tp = tp / ep,
    moe_ep_rank = tp_rank // moe_tp holds experts [r * E/ep, (r+1) * E/ep),
    each sharded over moe_tp_rank = tp_rank % moe_tp."""
    out = vt.vllm_reference(ck, config, tp_rank, tp_size)
    E = config.get("num_experts", 0)
    mtp = tp_size // ep_size
    er, mr = tp_rank // mtp, tp_rank % mtp
    per = E // ep_size if E else 0
    I = config.get("moe_intermediate_size", 0) // mtp
    for l in range(config["num_hidden_layers"]):
        p = f"model.layers.{l}.mlp."
        if p + "experts.w13_weight" not in out:
            continue
        w13 = np.zeros((per, 2 * I, config["hidden_size"]), np.float32)
        w2 = np.zeros((per, config["hidden_size"], I), np.float32)
        for j, e in enumerate(range(er * per, (er + 1) * per)):
            x = f"{p}experts.{e}."
            w13[j, :I] = ck[x + "gate_proj.weight"][mr * I:(mr + 1) * I]
            w13[j, I:] = ck[x + "up_proj.weight"][mr * I:(mr + 1) * I]
            w2[j] = ck[x + "down_proj.weight"][:, mr * I:(mr + 1) * I]
        out[p + "experts.w13_weight"], out[p + "experts.w2_weight"] = w13, w2
    return out


class LayoutTest(unittest.TestCase):
    def check(self, config, tp_size, ep_size=1):
        ck = checkpoint(config, 1)
        for r in range(tp_size):
            params, segments = ws.sglang_engine_layout(config, r, tp_size, ep_size, "FLOAT32")
            ref = sglang_reference(ck, config, r, tp_size, ep_size)
            self.assertEqual(sorted(n for n, _, _ in params), sorted(ref))
            got = apply_segments(params, segments, ck)
            for n in ref:
                np.testing.assert_array_equal(got[n], ref[n], err_msg=f"rank {r} {n}")

    def test_qwen3_moe(self):
        self.check(QWEN3_MOE, 2, 2)        # whole experts, 3 a rank
        self.check(QWEN3_MOE, 2)           # every expert TP-sharded
        moe4 = dict(QWEN3_MOE, vocab_size=180)
        self.check(moe4, 4, 2)             # SGLang only: 3 experts a pair, sharded over 2
        self.check(dict(moe4, num_experts=8), 4, 4)

    def test_same_as_vllm_where_placement_agrees(self):
        from weightsync.integrations import vllm as wv
        for r in range(2):
            self.assertEqual(ws.sglang_engine_layout(QWEN3_MOE, r, 2, 2),
                             wv.vllm_engine_layout(QWEN3_MOE, r, 2, r, 2))
            self.assertEqual(ws.sglang_engine_layout(LLAMA_TIED, r, 2),
                             wv.vllm_engine_layout(LLAMA_TIED, r, 2))

    def test_dense(self):
        self.check(LLAMA_TIED, 4)
        self.check(dict(QWEN3_MOE, model_type="qwen3", num_experts=0), 2)

    def test_refusals(self):
        with self.assertRaises(ValueError):     # FusedMoE: E % ep == 0
            ws.sglang_engine_layout(dict(QWEN3_MOE, vocab_size=180), 0, 4, 4)
        with self.assertRaises(ValueError):
            ws.sglang_engine_layout(QWEN3_MOE, 0, 2, 4)
        self.assertEqual(ws.sglang_local_experts(8, 1, 4), [2, 3])

    def test_imports_without_torch_or_sglang(self):
        code = ("import sys; sys.path.insert(0, %r); import weightsync.integrations.sglang; "
                "assert 'torch' not in sys.modules and 'sglang' not in sys.modules"
                % os.path.dirname(HERE))
        subprocess.run([sys.executable, "-c", code], check=True)


class FakeModel:
    """An SGLang model as the loader sees it: named_parameters, config, load_weights."""

    def __init__(self, config, params):
        self.config, self.params, self.loaded = config, params, []

    def named_parameters(self):
        return iter(list(self.params.items()))

    def load_weights(self, named):
        self.loaded += [n for n, _ in named]


class FakeRunner:
    """SGLang's ModelRunner: .model, .forward (gated), .dp_rank, and
    update_weights_from_tensor calling the custom loader as WeightUpdater does."""

    def __init__(self, model, ranks):
        self.model, self.ranks, self.dp_rank = model, ranks, 0
        self.steps, self.block = 0, None

    def forward(self, forward_batch):
        if self.block is not None:
            self.block.wait()
        self.steps += 1
        return forward_batch

    def update_weights_from_tensor(self, named_tensors, load_format=None):
        named = [(n, t.to("cpu")) for n, t in named_tensors]
        if load_format == ws.LOADER:
            ws.load_weights(self.model, named)
        else:
            self.model.load_weights(named)
        return True, "Success"


class HostRegistration(ws._Registration):
    """The host backend: shared-memory arrays instead of CUDA tensors, and
    the ranks from the fake runner instead of sglang.srt.distributed."""

    drains = 0

    def register(self, engine, named, params, segments, version):
        self.model.params.update(engine.register_host(params, version=version,
                                                      segments=segments))

    def drain(self):
        HostRegistration.drains += 1

    def dtype(self, held):
        return "FLOAT32"

    def parallel(self):
        return dict(self.runner.ranks, pp_rank=0, pp_size=1, dp_rank=self.runner.dp_rank)


class FakeSGLang:
    """sgl.Engine as WeightsyncUpdater uses it: pause_generation,
    continue_generation, update_weights_from_tensor (to every TP rank, then
    weight_version), as Engine -> TokenizerManager -> Scheduler does."""

    def __init__(self, runners):
        self.runners, self.calls, self.weight_version = runners, [], "default"

    def pause_generation(self, mode="abort"):
        self.calls.append(("pause", mode))

    def continue_generation(self):
        self.calls.append(("continue",))

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True,
                                   weight_version=None):
        self.calls.append(("update", [n for n, _ in named_tensors], flush_cache))
        for r in self.runners:
            ok, message = r.update_weights_from_tensor(named_tensors, load_format)
        if weight_version is not None:
            self.weight_version = weight_version
        return ok, message


class DaemonTest(vt.DaemonTest):
    """vLLM test's daemon fixture (setUp/tearDown/wait_connected) only."""

    test_layout_engines_receive_hf_checkpoint_as_vllm_places_it = None
    test_worker_extension_registers_relays_pause_and_reports_version = None

    def test_loader_registers_relays_pause_and_reports_version(self):
        saved = ws.Registration
        ws.Registration = HostRegistration
        self.cleanup.append(lambda: setattr(ws, "Registration", saved))
        ck0 = checkpoint(QWEN3_MOE, 0)
        runners = []
        for r in range(2):
            shapes = sglang_reference(ck0, QWEN3_MOE, r, 2, 2)
            model = FakeModel(QWEN3_MOE, {n: np.zeros(a.shape, np.float32)
                                          for n, a in shapes.items()})
            runners.append(FakeRunner(model, {"tp_rank": r, "tp_size": 2, "ep_size": 2,
                                              "moe_ep_rank": r, "moe_tp_rank": 0}))
        sgl = FakeSGLang(runners)
        # The user's one call after launch: every rank registers.
        sgl.update_weights_from_tensor(ws.start_request(target=self.target), load_format=ws.LOADER)
        for r in runners:
            self.cleanup.append(lambda r=r: r.update_weights_from_tensor(ws.stop_request(),
                                                                         ws.LOADER))
        ids = ["sglang.dp0.pp0.tp0", "sglang.dp0.pp0.tp1"]
        self.wait_connected(ids)
        self.assertEqual([ws.weightsync_status(r.model)["version"] for r in runners], [0, 0])
        with self.assertRaises(RuntimeError):   # twice on one rank
            runners[0].update_weights_from_tensor(ws.start_request(), ws.LOADER)

        updater = ws.WeightsyncUpdater(sgl, target=self.target, backend="host", timeout=10)
        self.cleanup.append(updater.destroy_weights_update_group)
        self.assertEqual(updater.init_weights_update_group("10.0.0.1", 29500, 1, 3, "g")[0], True)
        for version in (1, 2):
            ck = checkpoint(QWEN3_MOE, 10 + version)
            names = list(ck)
            if version == 1:
                ok, msg = updater.update_weights_from_tensor(list(ck.items()), chunk_bytes=4096)
            else:   # SGLang's distributed shape: names, dtypes, shapes (+ the tensors)
                ok, msg = updater.update_weights_from_distributed(
                    names, ["float32"] * len(names), [ck[n].shape for n in names], "g",
                    weight_version="2", tensors=[ck[n] for n in names], chunk_bytes=4096)
            self.assertTrue(ok)
            self.assertEqual(updater.version, version)
            self.assertEqual(sgl.weight_version, str(version))
            for r, run in enumerate(runners):
                held = dict(run.model.named_parameters())
                for n, a in sglang_reference(ck, QWEN3_MOE, r, 2, 2).items():
                    np.testing.assert_array_equal(held[n], a, err_msg=f"v{version} rank {r} {n}")
                if r == 1:   # vocab 130 padded to 192: rank 1 holds 34 rows, 62 of padding
                    self.assertFalse(held["lm_head.weight"][34:].any())
                self.assertEqual(ws.weightsync_status(run.model),
                                 {"engine_id": ids[r], "version": version, "paused": False,
                                  "dirty": False})
        self.assertEqual(sgl.calls[1:4], [
            ("pause", "in_place"), ("update", ["weightsync.version:" '{"timeout": 10.0, "version": 1}'],
                                    False), ("continue",)])
        reg = ws._REGISTRATIONS[id(runners[0].model)]
        self.assertEqual(reg.events, [("pause", "PAUSE_MODE_KEEP"), ("version", 1), ("resume",),
                                      ("pause", "PAUSE_MODE_KEEP"), ("version", 2), ("resume",)])
        self.assertGreaterEqual(HostRegistration.drains, 2)
        # Ordinary tensors under the same load_format go to model.load_weights.
        runners[0].update_weights_from_tensor([("model.norm.weight", ws._Placeholder())], ws.LOADER)
        self.assertEqual(runners[0].model.loaded, ["model.norm.weight"])
        # A version a rank does not hold fails the call (SGLang reports it).
        with self.assertRaises((RuntimeError, WeightSyncError)):
            runners[0].update_weights_from_tensor(ws.version_request(5, timeout=0.2), ws.LOADER)

        # Pause relay: forward passes stop while paused, go on after resume.
        run = runners[0]
        vt.check_pause_relay(self, lambda: run.forward("batch"), lambda: run.steps,
                             lambda: ws.weightsync_status(run.model)["paused"])

        # A forward that does not finish: the pause is refused, not hung.
        gate = ws._REGISTRATIONS[id(runners[1].model)].gate
        gate.timeout = 0.3
        runners[1].block = threading.Event()
        t = threading.Thread(target=runners[1].forward, args=("batch",))
        t.start()
        try:
            time.sleep(0.05)
            with self.assertRaises(WeightSyncError):
                self.trainer.pause(mode="keep")
            self.assertFalse(gate.paused)
        finally:
            runners[1].block.set()
            t.join()
        runners[1].block = None

        # Stop: the gate comes off and the daemon forgets the rank.
        runners[1].update_weights_from_tensor(ws.stop_request(), ws.LOADER)
        self.assertFalse(hasattr(runners[1].forward, "__wrapped__"))
        self.assertIsNone(ws.weightsync_status(runners[1].model))
        for _ in range(100):
            if ids[1] not in {s.engine_id for s in self.trainer.status().engines}:
                break
            time.sleep(0.02)
        self.assertNotIn(ids[1], {s.engine_id for s in self.trainer.status().engines})

if __name__ == "__main__":
    unittest.main()

"""weightsync.integrations.vllm_transfer (the "weightsync" backend of vLLM's
weight-transfer API) on the host backend, without torch or vLLM.

vLLM is not installable here: tests/fake_vllm/vllm is a stand-in shaped
like the parts the backend touches (base classes, the two factories,
WeightTransferConfig, the parallel-state rank getters; see its
__init__.py), and FakeWorker / FakeLLM below do what vLLM's GPU worker and
LLM do with a weight-transfer engine (v1/worker/gpu_worker.py:
init_weight_transfer_engine, start_weight_update, update_weights,
finish_weight_update; collective_rpc fans each call out to every worker
and blocks). Two vLLM-shaped TP=2 workers of a Qwen3-MoE with EP=2
receive several versions from a trainer through the real daemon, compared
bit for bit with a numpy transcription of vLLM's weight loaders.

Run by Bazel (//client/python:vllm_transfer_test) with WEIGHTSYNCD pointing
at the daemon binary; by hand: WEIGHTSYNCD=bazel-bin/daemon/weightsyncd
python3 client/python/tests/test_vllm_transfer.py
"""

import os
import subprocess
import sys
import threading
import time
import types
import unittest
from unittest import mock

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE = os.path.dirname(HERE)
if not os.environ.get("WEIGHTSYNC_TEST_INSTALLED"):
    sys.path.insert(0, SOURCE)
sys.path.insert(0, HERE)

import daemon_fixture  # noqa: E402
import weightsync  # noqa: E402
from weightsync import WeightSyncError  # noqa: E402
from weightsync.integrations import vllm_transfer as vt  # noqa: E402
from test_vllm_adapter import QWEN3_MOE, checkpoint, vllm_reference  # noqa: E402

FAKE_VLLM = os.path.join(HERE, "fake_vllm")


def run_python(code):
    """`code` in a fresh interpreter that sees the package as this test does,
    and no vLLM."""
    prefix = "import sys; " + ("" if os.environ.get("WEIGHTSYNC_TEST_INSTALLED") else
                               f"sys.path.insert(0, {SOURCE!r}); ")
    out = subprocess.run([sys.executable, "-c", prefix + code], capture_output=True, text=True)
    if out.returncode:
        raise AssertionError(f"exit status {out.returncode}:\n{out.stderr}")
    return out


class WithoutVllmTest(unittest.TestCase):
    def test_import_needs_neither_torch_nor_vllm(self):
        run_python("import weightsync.integrations.vllm_transfer; "
                   "assert 'torch' not in sys.modules and 'vllm' not in sys.modules")

    def test_register_without_vllm_explains_itself(self):
        out = run_python(
            "import warnings; from weightsync.integrations import vllm_transfer as vt\n"
            "with warnings.catch_warnings(record=True) as w:\n"
            "    warnings.simplefilter('always')\n"
            "    assert vt.register() is None\n"
            "print(w[0].category.__name__, w[0].message)")
        self.assertIn("RuntimeWarning vLLM is not importable here", out.stdout)
        self.assertIn("'weightsync' weight-transfer backend was not registered", out.stdout)
        self.assertIn("vllm.general_plugins", out.stdout)


def _fake_vllm():
    """Imports the stand-in (vllm.FAKE is set: never the real vLLM)."""
    if FAKE_VLLM not in sys.path:
        sys.path.insert(0, FAKE_VLLM)
    import vllm
    from vllm.distributed import parallel_state
    from vllm.distributed.weight_transfer import base, factory
    from vllm.config import WeightTransferConfig
    assert vllm.FAKE, vllm.__file__
    return types.SimpleNamespace(ps=parallel_state, base=base, factory=factory,
                                 WeightTransferConfig=WeightTransferConfig)


class FakeModel:
    def __init__(self, params):
        self.params = params

    def named_parameters(self):
        return iter(list(self.params.items()))


class FakeWorker:
    """The weight-transfer part of vLLM's GPU worker (gpu_worker.py): the
    engine from WeightTransferEngineFactory after load_model, and the four
    RPCs as vLLM runs them."""

    def __init__(self, v, vllm_config, model, ranks):
        self.ranks, self.ps = ranks, v.ps
        self.weight_transfer_engine = v.factory.WeightTransferEngineFactory.create_engine(
            vllm_config.weight_transfer_config, vllm_config, "cpu", model)
        self._weight_update_active = False

    def init_weight_transfer_engine(self, init_info):
        self.ps.RANKS.update(self.ranks)   # vLLM: this worker process's groups
        e = self.weight_transfer_engine
        e.init_transfer_engine(e.parse_init_info(init_info))

    def start_weight_update(self):
        if self._weight_update_active:
            raise RuntimeError("start_weight_update called while a weight update is active")
        self.weight_transfer_engine.start_weight_update()
        self._weight_update_active = True

    def update_weights(self, update_info):
        if not self._weight_update_active:
            raise RuntimeError("start_weight_update must be called before update_weights.")
        try:
            self.weight_transfer_engine.update_weights(update_info)
        except BaseException:
            self._weight_update_active = False
            raise

    def finish_weight_update(self):
        if not self._weight_update_active:
            raise RuntimeError("finish_weight_update called without start_weight_update")
        self.weight_transfer_engine.finish_weight_update()
        self._weight_update_active = False


class FakeLLM:
    """vLLM's LLM as a VLLMWeightSyncClient: each call on every worker
    (collective_rpc), blocking until all are done, raising the first error."""

    def __init__(self, workers):
        self.workers = workers
        self.calls = []

    def _all(self, method, *args):
        self.calls.append(method)
        if method == "init_weight_transfer_engine":   # one process each in vLLM: in turn here
            for w in self.workers:
                getattr(w, method)(*args)
            return
        errors = []

        def run(w):
            try:
                getattr(w, method)(*args)
            except BaseException as e:  # noqa: BLE001
                errors.append(e)
        threads = [threading.Thread(target=run, args=(w,)) for w in self.workers]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]

    def init_weight_transfer_engine(self, init_info):
        self._all("init_weight_transfer_engine", init_info)

    def start_weight_update(self):
        self._all("start_weight_update")

    def update_weights(self, update_info):
        self._all("update_weights", update_info)

    def finish_weight_update(self, weight_version=None):
        self._all("finish_weight_update")


def _host_register(self, engine, named, params, segments, version):
    """The one seam replaced: shared-memory arrays (register_host) instead
    of CUDA tensors (register_torch), put into the model."""
    self.model.params.update(engine.register_host(params, version=version, segments=segments))


class BackendTest(unittest.TestCase):
    def setUp(self):
        self.v = _fake_vllm()
        for seam, fn in (("_weightsync_register", _host_register),
                         ("_weightsync_drain", lambda self: None)):
            patch = mock.patch.object(vt.WeightsyncWeightTransferEngine, seam, fn)
            patch.start()
            self.addCleanup(patch.stop)
        _, self.target = daemon_fixture.start(self, "--notice_timeout_ms=3000")
        os.environ["WEIGHTSYNC_TARGET"] = self.target
        self.addCleanup(os.environ.pop, "WEIGHTSYNC_TARGET", None)
        self.trainer = weightsync.Trainer(self.target, timeout=10)
        self.addCleanup(self.trainer.close)

    def workers(self):
        """Two vLLM-shaped workers, TP=2 with EP=2 (each holds 3 of 6 experts)."""
        vllm_config = types.SimpleNamespace(
            parallel_config=types.SimpleNamespace(enable_expert_parallel=True,
                                                  expert_placement_strategy="linear",
                                                  data_parallel_rank=0),
            model_config=types.SimpleNamespace(hf_config=QWEN3_MOE, dtype="torch.float32"),
            weight_transfer_config=self.v.WeightTransferConfig(backend="weightsync"))
        ck0 = checkpoint(QWEN3_MOE, 0)
        out = []
        for r in range(2):
            model = FakeModel({n: np.zeros(a.shape, np.float32)
                               for n, a in vllm_reference(ck0, QWEN3_MOE, r, 2, r, 2).items()})
            w = FakeWorker(self.v, vllm_config, model, {"tp": (r, 2), "ep": (r, 2)})
            self.addCleanup(w.weight_transfer_engine.shutdown)
            out.append(w)
        return out

    def check(self, workers, ck, version):
        for r, w in enumerate(workers):
            e = w.weight_transfer_engine
            self.assertEqual(e.weight_version, version)
            held = e.model.params
            for n, a in vllm_reference(ck, QWEN3_MOE, r, 2, r, 2).items():
                np.testing.assert_array_equal(held[n].view(np.uint32), a.view(np.uint32),
                                              err_msg=f"rank {r} {n} v{version}")

    def test_register_and_factory_lookup_by_name(self):
        got = vt.register()
        self.assertEqual(vt.register(), got)   # idempotent
        f, b = self.v.factory, self.v.base
        engine_cls = f.WeightTransferEngineFactory._registry["weightsync"]()
        trainer_cls = f.WeightTransferTrainerFactory._registry["weightsync"]()
        self.assertIs(engine_cls, got["engine"])
        self.assertIs(trainer_cls, got["trainer"])
        self.assertTrue(issubclass(engine_cls, b.WeightTransferEngine))
        self.assertTrue(issubclass(engine_cls, vt.WeightsyncWeightTransferEngine))
        self.assertTrue(issubclass(trainer_cls, b.TrainerWeightTransferEngine))
        self.assertIn("nccl", f.WeightTransferEngineFactory._registry)   # the built-ins stay
        [w, _] = self.workers()
        e = w.weight_transfer_engine
        self.assertIsInstance(e, engine_cls)
        self.assertIsInstance(e.parse_init_info({"master_address": "10.0.0.1",
                                                 "master_port": 29500, "rank_offset": 1,
                                                 "world_size": 3}), vt.WeightsyncInitInfo)
        with self.assertRaises(ValueError):
            e.parse_update_info({"no_such_field": 1})
        # Someone else's "weightsync" is not taken over.
        class Registry(f.WeightTransferEngineFactory):
            _registry = {}
        Registry.register_engine("weightsync", type("Other", (), {}))
        with self.assertRaises(ValueError) as ctx:
            vt._register_one(Registry, vt.WeightsyncWeightTransferEngine, b.WeightTransferEngine)
        self.assertIn("registered to", str(ctx.exception))

    def test_workers_receive_versions_bit_exact(self):
        vt.register()
        trainer_factory = self.v.factory.WeightTransferTrainerFactory
        workers = self.workers()
        llm = FakeLLM(workers)
        # NCCL-shaped init info: accepted, the NCCL fields ignored; every
        # worker registers with the node's daemon.
        llm.init_weight_transfer_engine({"master_address": "10.0.0.1", "master_port": 29500,
                                         "rank_offset": 1, "world_size": 3,
                                         "park_timeout": 5.0})
        ids = {s.engine_id: s.version for s in self.trainer.status().engines}
        self.assertEqual(ids, {"vllm.dp0.pp0.tp0": 0, "vllm.dp0.pp0.tp1": 0})

        # Version 1, vLLM's earlier trainer API (the seeds' examples):
        # EngineClass.trainer_init, then trainer_send_weights while the
        # inference side is in update_weights (NCCL-shaped update info).
        # The trainer starts first here: the daemon's pause waits for the
        # workers to enter update_weights.
        engine_cls = self.v.factory.WeightTransferEngineFactory._registry["weightsync"]()
        group = engine_cls.trainer_init({"target": self.target, "transport": "host",
                                         "master_address": "10.0.0.1", "master_port": 29500,
                                         "world_size": 3})
        self.addCleanup(group.close)
        ck = checkpoint(QWEN3_MOE, 11)
        results = []
        send = threading.Thread(target=lambda: results.append(engine_cls.trainer_send_weights(
            iter(ck.items()), {"group": group, "packed": True, "chunk_bytes": 4096})))
        send.start()
        time.sleep(0.2)
        llm.start_weight_update()
        llm.update_weights({"names": list(ck), "dtype_names": ["float32"] * len(ck),
                            "shapes": [list(a.shape) for a in ck.values()], "packed": True})
        llm.finish_weight_update()
        send.join()
        self.assertEqual(results[0].version, 1)
        self.check(workers, ck, 1)

        # Versions 2 and 3, vLLM's current trainer API: a trainer engine
        # from WeightTransferTrainerFactory over a WeightSource, send_weights()
        # per round (it drives start / update_weights / finish itself).
        current = {}

        class Source(self.v.base.WeightSource):
            def metadata(self):
                return [(n, "float32", a.shape) for n, a in current.items()]

            def __iter__(self):
                return iter(list(current.items()))

        info = vt.WeightsyncTrainerInitInfo(rank=0, target=self.target, transport="host",
                                            chunk_bytes=4096, receive_timeout=30.0)
        llm.calls.clear()
        sender = trainer_factory.trainer_init(info, client=llm, source=Source())
        self.addCleanup(sender.shutdown)
        self.assertEqual(llm.calls, ["init_weight_transfer_engine"])
        for version, seed in ((2, 12), (3, 13)):
            current.clear()
            current.update(checkpoint(QWEN3_MOE, seed))
            llm.calls.clear()
            self.assertEqual(sender.send_weights().version, version)
            self.assertEqual(llm.calls, ["start_weight_update", "update_weights",
                                         "finish_weight_update"])
            self.check(workers, current, version)

        # A rank other than 0 iterates its source and sends nothing.
        quiet = FakeLLM([])
        follower = trainer_factory.trainer_init(
            vt.WeightsyncTrainerInitInfo(rank=1, target=self.target), client=quiet,
            source=Source())
        self.assertIsNone(follower.send_weights())
        self.assertEqual(quiet.calls, [])

        # A trainer whose workers are not in update_weights: the pause is
        # refused (saying why), nothing is written.
        llm.init_weight_transfer_engine({"park_timeout": 0.3})
        self.trainer.init_host()
        with self.assertRaises(WeightSyncError) as ctx:
            self.trainer.update(list(checkpoint(QWEN3_MOE, 14).items()), version=4,
                                chunk_bytes=4096)
        self.assertIn("update_weights", str(ctx.exception))
        self.check(workers, current, 3)

        # update_weights with no update coming: a timeout, and the worker
        # is out of its update session (vLLM resets it on error).
        llm.start_weight_update()
        with self.assertRaises(TimeoutError):
            llm.update_weights({"timeout": 0.3})
        self.assertFalse(any(w._weight_update_active for w in workers))
        self.check(workers, current, 3)


if __name__ == "__main__":
    unittest.main()

#!/usr/bin/env python3
"""GPU proof of weightsync.integrations.sglang (issue 16), on ONE GPU.

    python3 tests/gpu/test_sglang_loader_gpu.py WEIGHTSYNCD WEIGHTSYNC_GPU_WORKER

Two SGLang-shaped tensor-parallel ranks (TP=2, both on GPU 0: bf16 CUDA
tensors in the fused and sharded shapes of sglang_engine_layout, vocab 1003
padded to 1024) register in place through the custom weight loader
(`load_weights(model, start_request(...))`, register_torch, the real
torch.cuda.synchronize drain); SGLang itself is not installable here, so
each rank's model carries what the loader uses (named_parameters, config,
load_weights) and its ranks come from a Registration subclass. A
transformers Qwen3-style model (random init, bf16) in the same process
sends three versions with a training step between them through
WeightsyncUpdater.update_weights_from_tensor (ipc, registered source,
receipts on) against a stand-in for SGLang's Engine whose
pause_generation / continue_generation / update_weights_from_tensor call
the loader on every rank as SGLang's scheduler would. Checks, PASS/FAIL
lines: every rank's parameters bit-exact against the numpy reference of
the loaders (client/python/tests/test_vllm_adapter.py: SGLang places dense
Qwen3 exactly as vLLM does), padding rows zero, the version check through
the loader passed, pause/continue called around each update.
"""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
# The same set-up as the vLLM proof: its model helpers, GPU, TP and the
# independent numpy reference of the loaders.
from test_vllm_extension_gpu import (  # noqa: E402
    C, GPU, TP, check_exact, check_padding, reference_module)


def main():
    import torch
    from weightsync.integrations import sglang as sg

    daemon_bin, worker_bin = C.binaries(sys.argv)
    check = C.Checks()
    C.deterministic()
    dev = torch.device("cuda", GPU)
    cfg = C.small_config()
    cfg.vocab_size = 1003   # padded to 1024: rank 1 holds 491 rows and 21 of padding
    cfgd = cfg.to_dict()
    cfgd["model_type"] = getattr(cfg, "model_type", "qwen3")
    ref = reference_module()
    d = C.Daemon(daemon_bin, worker_bin, gpu=GPU)
    ranks = []
    try:
        class RankModel:
            """An SGLang model as the loader sees it."""

            def __init__(self, rank):
                params, _ = sg.sglang_engine_layout(cfgd, rank, TP, dtype="BFLOAT16")
                self.params = {n: torch.zeros(tuple(s), dtype=torch.bfloat16, device=dev)
                               for n, _, s in params}
                self.config = cfgd
                self.rank = rank
                self.ordinary = 0

            def named_parameters(self):
                return iter(list(self.params.items()))

            def load_weights(self, named):
                self.ordinary += len(named)

        class Registration(sg.Registration):
            def parallel(self):
                return {"tp_rank": self.model.rank, "tp_size": TP, "ep_size": 1,
                        "moe_ep_rank": 0, "moe_tp_rank": self.model.rank, "pp_rank": 0,
                        "pp_size": 1, "dp_rank": 0}

        sg.Registration = Registration
        calls = []

        class Engine:
            """SGLang's Engine API as WeightsyncUpdater uses it: every call
            reaches the loader on each TP rank."""

            def pause_generation(self, mode):
                calls.append(("pause_generation", mode))

            def continue_generation(self):
                calls.append(("continue_generation",))

            def update_weights_from_tensor(self, named, load_format=None, flush_cache=False,
                                           weight_version=None):
                calls.append(("update_weights_from_tensor", weight_version))
                for m in ranks:
                    sg.load_weights(m, named)

        for r in range(TP):
            m = RankModel(r)
            ranks.append(m)
            sg.load_weights(m, sg.start_request(engine_id_prefix="sglang", target=d.target))
            st = sg.weightsync_status(m)
            check(st is not None and st["engine_id"] == f"sglang.dp0.pp0.tp{r}",
                  f"rank tp{r} registered {len(m.params)} parameters in place through the "
                  f"loader ({st})")
        model = C.build_model(cfg, seed=7, device=dev)
        updater = sg.WeightsyncUpdater(engine=Engine(), target=d.target, backend="ipc")
        ok, msg = updater.init_weights_update_group()
        check(ok, f"init_weights_update_group: {msg}")
        for version in (1, 2, 3):
            if version > 1:
                C.train_step(model, cfg, seed=version)
            del calls[:]
            ok, msg = updater.update_weights_from_tensor(model.named_parameters(),
                                                         weight_version=str(version))
            check(ok and updater.trainer.last_results[0].engines[0].HasField("receipt"),
                  f"v{version}: {msg}, receipts checked (the default)")
            check([c[0] for c in calls] == ["pause_generation", "update_weights_from_tensor",
                                            "continue_generation"],
                  f"v{version}: paused, version checked on every rank through the loader, "
                  f"continued ({calls})")
            check_exact(check, ref, model, cfgd, ranks, version, "SGLang")
            for m in ranks:
                check(sg.weightsync_status(m)["version"] == version,
                      f"v{version} tp{m.rank}: rank holds version {version}")
        check_padding(check, cfg, ranks[-1])
        check(all(m.ordinary == 0 for m in ranks),
              "no tensor reached model.load_weights (the daemon wrote them)")
        updater.destroy_weights_update_group()
    finally:
        for m in ranks:
            try:
                sg.load_weights(m, sg.stop_request())
            except Exception as e:   # noqa: BLE001
                print(f"stop tp{m.rank}: {e}")
        d.stop()
    return check.finish("test_sglang_loader_gpu")


if __name__ == "__main__":
    sys.exit(main())

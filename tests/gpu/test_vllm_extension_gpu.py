#!/usr/bin/env python3
"""GPU proof of weightsync.integrations.vllm (issue 16), on ONE GPU.

    python3 tests/gpu/test_vllm_extension_gpu.py WEIGHTSYNCD WEIGHTSYNC_GPU_WORKER

Two vLLM-shaped tensor-parallel workers (TP=2, both on GPU 0: vLLM's fused
qkv_proj / gate_up_proj, row-parallel o_proj / down_proj, vocab padded to a
multiple of 64 and split, bf16 CUDA tensors laid out by
vllm_engine_layout) run WeightsyncWorkerExtension.weightsync_start with its
real seams (register_torch by CUDA IPC, torch.cuda.synchronize); vLLM
itself is not installable here, so the worker object carries the
attributes the extension uses (model_runner.model / execute_model,
model_config, parallel_config, device) and its ranks. A transformers
Qwen3-style model (random init, bf16) in the same process sends its
Hugging Face-named parameters with Trainer.init_ipc() + update() (the
defaults: registered source, receipts on) through WeightsyncTrainer's
trainer_send_weights, three versions with a training step between them.
Checks, PASS/FAIL lines: every worker parameter equals, bit for bit, what
vLLM's loaders would place there (the numpy reference of
client/python/tests/test_vllm_adapter.py, written independently of the
layout code), vocab padding rows stay zero, each worker reports the
version, and the control stream relayed pause -> version -> resume.
"""

import importlib.util
import os
import sys
import types

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "examples"))
sys.path.insert(0, os.path.join(ROOT, "client", "python"))
import _common as C  # noqa: E402

GPU = 0
TP = 2


def reference_module():
    path = os.path.join(ROOT, "client", "python", "tests", "test_vllm_adapter.py")
    spec = importlib.util.spec_from_file_location("vllm_adapter_reference", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def check_exact(check, ref, model, cfgd, ranks, version, what):
    """Each rank's params (.rank, .params {name: CUDA tensor}) equal, bit for
    bit, the numpy reference of the loaders for `model`'s tensors."""
    import numpy as np
    ck = {n: p.detach().float().cpu().numpy() for n, p in model.named_parameters()}
    for r in ranks:
        want = ref.vllm_reference(ck, cfgd, r.rank, TP)
        bad = [n for n, t in r.params.items()
               if not np.array_equal(t.float().cpu().numpy(), want[n].astype(np.float32))]
        missing = sorted(set(want) ^ set(r.params))
        check(not bad and not missing,
              f"v{version} tp{r.rank}: every {what} parameter bit-exact against the loaders' "
              f"placement ({len(bad)} differ, e.g. {bad[:3]}; {len(missing)} unmatched)")


def check_padding(check, cfg, last):
    """The last rank's lm_head rows past the vocabulary stay zero."""
    pad = last.params["lm_head.weight"]
    real = cfg.vocab_size - (TP - 1) * pad.shape[0]
    check(real < pad.shape[0] and not pad[real:].any().item(),
          f"tp{TP - 1}: vocab padding rows {real}..{pad.shape[0] - 1} stay zero")


def main():
    import torch
    from weightsync.integrations import vllm as wv

    daemon_bin, worker_bin = C.binaries(sys.argv)
    check = C.Checks()
    C.deterministic()
    dev = torch.device("cuda", GPU)
    cfg = C.small_config()
    cfg.vocab_size = 1003   # vLLM pads to 1024: rank 1 holds 491 rows and 21 of padding
    cfgd = cfg.to_dict()
    cfgd["model_type"] = getattr(cfg, "model_type", "qwen3")
    ref = reference_module()
    d = C.Daemon(daemon_bin, worker_bin, gpu=GPU)
    workers = []
    try:
        class Runner:
            def __init__(self, params):
                self.model = types.SimpleNamespace(
                    named_parameters=lambda: iter(list(params.items())))

            def execute_model(self, scheduler_output, intermediate_tensors=None):
                return scheduler_output

        class Worker(wv.WeightsyncWorkerExtension):
            """vLLM's GPU worker as the extension sees it (ranks given)."""

            def __init__(self, rank):
                params, _ = wv.vllm_engine_layout(cfgd, rank, TP, dtype="BFLOAT16")
                self.params = {n: torch.zeros(tuple(s), dtype=torch.bfloat16, device=dev)
                               for n, _, s in params}
                self.model_runner = Runner(self.params)
                self.model_config = types.SimpleNamespace(hf_config=cfgd,
                                                          dtype=torch.bfloat16)
                self.parallel_config = types.SimpleNamespace(
                    enable_expert_parallel=False, data_parallel_rank=0)
                self.device = dev
                self.rank = rank

            def _weightsync_parallel(self):
                return {"tp_rank": self.rank, "tp_size": TP, "ep_rank": 0, "ep_size": 1,
                        "pp_rank": 0, "pp_size": 1, "dp_rank": 0,
                        "expert_placement": "linear"}

        for r in range(TP):
            w = Worker(r)
            eid = w.weightsync_start(engine_id=f"vllm.tp{r}", target=d.target)
            workers.append(w)
            check(eid == f"vllm.tp{r}", f"worker tp{r} registered {len(w.params)} parameters "
                  "in place (register_torch)")
        model = C.build_model(cfg, seed=7, device=dev)
        trainer = wv.WeightsyncTrainer.trainer_init({"target": d.target, "backend": "ipc"})
        for version in (1, 2, 3):
            if version > 1:
                C.train_step(model, cfg, seed=version)
            result = wv.WeightsyncTrainer.trainer_send_weights(
                model.named_parameters(), {"trainer": trainer, "version": version})
            check(all(e.HasField("receipt") for e in result.engines),
                  f"v{version}: committed with receipts checked (the default)")
            check_exact(check, ref, model, cfgd, workers, version, "vLLM")
            for w in workers:
                check(w.weightsync_version() == version,
                      f"v{version} tp{w.rank}: worker reports version {w.weightsync_version()}")
        check_padding(check, cfg, workers[-1])
        events = [e[0] for e in workers[0]._weightsync_events]
        check(events[-3:] == ["pause", "version", "resume"],
              f"the control stream relayed pause -> version -> resume ({events[-3:]})")
        trainer.close()
    finally:
        for w in workers:
            w.weightsync_stop()
        d.stop()
    return check.finish("test_vllm_extension_gpu")


if __name__ == "__main__":
    sys.exit(main())

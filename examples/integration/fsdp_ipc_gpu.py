#!/usr/bin/env python3
"""docs/integration.md on one GPU: an FSDP2 trainer feeding a TP=2,
vLLM-layout engine through weightsyncd's ipc backend.

    python3 examples/integration/fsdp_ipc_gpu.py .dev/bin   # weightsyncd + weightsync_gpu_worker

* Engine process (GPU 0): two "TP ranks" of a small Qwen3-style model in
  vLLM's layout (fused qkv / gate_up, row- and column-parallel shards,
  vLLM's vocab padding; examples/integration/vllm_layout.py), bf16 tensors
  registered in place with Engine.register_torch, and a step gate whose
  on_pause waits for the running step and synchronises the GPU.
* Trainer: two processes (torch.distributed, gloo) holding the model
  (float32) sharded with FSDP2 (fully_shard) on the CPU. Rank 0 alone
  talks to the daemon (Trainer.init_ipc on GPU 0); rank 1 stays in
  lockstep through the collectives and a barrier.
  - v1: the full state dict gathered to rank 0, offloaded to the CPU
    (get_model_state_dict(full_state_dict=True, cpu_offload=True)), sent
    as CPU tensors in one update (receipts on).
  - v2..: after a training step, gathered layer by layer (DTensor
    .full_tensor(), every rank) and sent as one partial update per layer
    inside one explicit pause.
* The engine compares its memory, bit for bit, with the gathered weights
  mapped through its segments and converted to bf16.

Prints PASS/FAIL lines; exits non-zero on failure.
"""

import contextlib
import os
import socket
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, ".."))
import _common as C  # noqa: E402  (also puts client/python on sys.path)
from segments import expected_param  # noqa: E402
from step_gate import StepGate  # noqa: E402

TP = 2


def config():
    return C.small_config(tie=False)


def cfg_dict(cfg):
    return {k: getattr(cfg, k, None) for k in (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
        "num_attention_heads", "num_key_value_heads", "head_dim", "tie_word_embeddings",
        "model_type")}


def expected_param_bf16(shape, segs, sd, name, torch):
    return expected_param(shape, segs, lambda n: sd[n].to(torch.bfloat16), name,
                          torch.zeros(int(torch.tensor(shape).prod()), dtype=torch.bfloat16))


def engine_main(conn, target, tmp):
    import torch
    import weightsync
    from vllm_layout import vllm_llama_layout, check_against
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    cfg = cfg_dict(config())
    ranks, stop = [], threading.Event()
    for rank in range(TP):
        specs, segments = vllm_llama_layout(cfg, tp_rank=rank, tp_size=TP, dtype="BFLOAT16")
        # Stand-in for the worker's loaded model: one tensor per parameter.
        model = {n: torch.zeros(s, dtype=torch.bfloat16, device=dev) for n, _, s in specs}
        check_against(specs, model.items())
        engine = weightsync.Engine(f"node0.r0.tp{rank}", target, timeout=60)
        engine.register_torch(model.items(), segments=segments)
        # The pause hook runs on the client's control thread, whose current
        # CUDA device is not the worker's: name it.
        gate = StepGate(drain=lambda: torch.cuda.synchronize(dev))
        engine.start(on_pause=gate.on_pause, on_resume=gate.on_resume,
                     on_new_version=gate.on_new_version)
        ranks.append((engine, model, segments, gate))

    def serve(model, gate):      # fake decode steps that read the weights on the GPU
        x = torch.randn(8, model["model.norm.weight"].shape[0], device=dev, dtype=torch.bfloat16)
        while not stop.is_set():
            gate.step(lambda: (x @ model["model.embed_tokens.weight"].T).sum().item())

    for _, model, _, gate in ranks:
        threading.Thread(target=serve, args=(model, gate), daemon=True).start()
    C.send(conn, {"ready": True})
    results = []
    while True:
        msg = C.recv(conn, 600, "a version to check")
        if msg.get("end"):
            break
        v = msg["version"]
        sd = torch.load(os.path.join(tmp, f"v{v}.pt"))
        bad = []
        for engine, model, segments, _ in ranks:
            if not engine.wait_for_version(v, 60):
                bad.append(f"{engine.engine_id} at v{engine.version}")
                continue
            for n, t in model.items():
                want = expected_param_bf16(tuple(t.shape), segments.get(n), sd, n, torch)
                have = t.detach().cpu()
                if segments.get(n) and n.endswith(("embed_tokens.weight", "lm_head.weight")):
                    rows = sum(s["row_count"] for s in segments[n])
                    want, have = want[:rows], have[:rows]      # padding rows: never written
                if not torch.equal(have.view(torch.int16), want.view(torch.int16)):
                    bad.append(f"{engine.engine_id}:{n}")
        results.append({"version": v, "bad": bad[:5], "nbad": len(bad)})
        C.send(conn, results[-1])
    stop.set()
    C.send(conn, {"results": results, "events": ranks[0][3].events,
                  "violations": sum(g.violations for *_, g in ranks)})


def trainer_main(conn, rank, port, target, tmp):
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.checkpoint.state_dict import (StateDictOptions,
                                                         get_model_state_dict)
    import weightsync
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,))
    cfg = config()
    model = C.build_model(cfg, seed=5, device="cpu", dtype_name="float32")
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    report = {}

    trainer = None
    if rank == 0:
        trainer = weightsync.Trainer(target, timeout=120)
        report["world_before"] = trainer.world_size()      # 0: no group yet
        trainer.init_ipc(device=0)
        report["world_after"] = trainer.world_size()       # ranks this daemon adds

    # v1: the full state dict, gathered to rank 0 and offloaded to the CPU.
    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                              cpu_offload=True))
    report["sd_keys"] = len(sd)
    if rank == 0:
        torch.save(sd, os.path.join(tmp, "v1.pt"))
        r = trainer.update(list(sd.items()), version=1)          # CPU tensors; verify=True
        report["v1"] = {"version": r.version, "engines": len(r.engines),
                        "timings": trainer.last_timings}
        C.send(conn, {"v1_sent": True})
        C.recv(conn, 600, "the go-ahead after v1 was checked")
    dist.barrier()

    # A training step, then v2.. layer by layer (a partial update each).
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * (rank + 1))
    groups = [["model.embed_tokens.weight"]]
    groups += [[f"model.layers.{i}." + n for n, _ in layer.named_parameters()]
               for i, layer in enumerate(model.model.layers)]
    groups += [["model.norm.weight", "lm_head.weight"]]
    params = dict(model.named_parameters())
    sent = {}
    ok = torch.ones(1)
    with (trainer.paused(mode="keep") if rank == 0 else contextlib.nullcontext()):
        for i, names in enumerate(groups):
            full = [(n, params[n].full_tensor()) for n in names]     # every rank
            if rank == 0:
                try:
                    trainer.update(full, version=2 + i)
                except weightsync.WeightSyncError as e:
                    report["error"] = f"{e.code}: {e.message}"
                    ok.zero_()
                sent.update((n, t.detach().clone()) for n, t in full)
            dist.all_reduce(ok, op=dist.ReduceOp.MIN)   # rank 0's failure stops everyone
            if not ok.item():
                break
    last = 2 + len(groups) - 1
    if rank == 0:
        torch.save(sent, os.path.join(tmp, f"v{last}.pt"))
        report["last"] = last
        report["parts"] = len(groups)
        report["names"] = len(params)
    dist.barrier()
    C.send(conn, report)
    C.recv(conn, 600, "the end")
    dist.destroy_process_group()


def main():
    daemon_bin, worker_bin = C.binaries(sys.argv)
    check = C.Checks()
    daemon = C.Daemon(daemon_bin, worker_bin, gpu=0)
    tmp = tempfile.mkdtemp(prefix="ws-fsdp.")
    workers = []
    try:
        engine = C.Worker(engine_main, daemon.target, tmp)
        workers.append(engine)
        engine.recv(300, "the engine's registration")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        t0 = C.Worker(trainer_main, 0, port, daemon.target, tmp)
        t1 = C.Worker(trainer_main, 1, port, daemon.target, tmp)
        workers += [t0, t1]
        t0.recv(600, "trainer rank 0's v1")
        engine.send({"version": 1})
        res = engine.recv(300, "the engine's check of v1")
        check(res["nbad"] == 0, f"v1: both TP ranks equal the gathered weights in bf16, "
              f"bit for bit (bad: {res['bad']})")
        t0.send({"go": True})
        r0 = t0.recv(600, "trainer rank 0")
        r1 = t1.recv(600, "trainer rank 1")
        check(r0["sd_keys"] == r0["names"] and r1["sd_keys"] == 0,
              f"full state dict on rank 0 only ({r0['sd_keys']} tensors; rank 1: "
              f"{r1['sd_keys']})")
        print(f"GetWorldSize before/after init_ipc: {r0['world_before']}/{r0['world_after']}")
        check(r0["v1"]["version"] == 1 and r0["v1"]["engines"] == TP,
              f"v1 from CPU tensors by IPC, receipts checked ({r0['v1']['timings']})")
        check("error" not in r0, f"per-layer partial updates v2..v{r0['last']} "
              f"({r0['parts']} parts) {r0.get('error', '')}")
        v = r0["last"]
        engine.send({"version": v})
        res = engine.recv(300, f"the engine's check of v{v}")
        check(res["nbad"] == 0, f"v{v}: both TP ranks equal the gathered weights in bf16, "
              f"bit for bit (bad: {res['bad']})")
        engine.send({"end": True})
        e = engine.recv(60, "the engine's summary")
        check(e["violations"] == 0, "no step ran while the engine was paused")
        ev = e["events"]
        check(ev.count("resume") == 2 and ev[-1] == "resume"
              and ev.count("pause PAUSE_MODE_KEEP") == 2,
              f"v1 paused once; the per-layer series paused once ({len(ev)} events)")
        for w in (t0, t1):
            w.send({"end": True})
    except Exception as ex:
        check(False, f"{type(ex).__name__}: {ex}")
    finally:
        for w in workers:
            w.proc.join(10)
            w.stop()
        daemon.stop()
    return check.finish("fsdp_ipc_gpu")


if __name__ == "__main__":
    sys.exit(main())

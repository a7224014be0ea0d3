#!/usr/bin/env python3
"""Several daemons on GPUs (issue 20), one command on a machine with N + 1
GPUs (N >= 2): NOT RUN YET (no machine with three GPUs was available).

* daemon k (k < N) owns GPU k (--gpu=k) and an engine process on GPU k
  with two engines, TP ranks 0 and 1 of pipeline stage k of a Qwen3-style
  model of N layers (stage k = layer k; the embeddings on the first, the
  norm and lm_head on the last), float32 torch tensors registered in place
  by CUDA IPC (Engine.register_torch with weightsync's TP layout);
* the trainer on GPU N: weightsync.Trainer(all daemons).init_nccl (ranks
  from GetWorldSize, its NCCL version sent), three versions by NCCL with
  receipts, each daemon copying only its stage out of the broadcasts;
  after each, every engine compares every parameter bit for bit with a
  numpy placement of what was sent;
* a tensor no daemon uses is refused before any engine pauses;
* daemon N-1 killed between prepare and commit: the others commit, the
  trainer raises ABORTED naming it, the restarted daemon's engines come
  back DIRTY; init_nccl again and the next version repairs every engine.

    python3 tests/gpu/test_multi_daemon_gpu.py WEIGHTSYNCD WEIGHTSYNC_GPU_WORKER
"""

import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "client", "python"))
sys.path.insert(0, os.path.join(HERE, ".."))

import numpy as np  # noqa: E402

import weightsync  # noqa: E402
from weightsync.integrations._common import tp_layout  # noqa: E402
from weightsync.layouts import checkpoint_shapes  # noqa: E402
from multi_daemon_test import expected  # noqa: E402,F401  (the engines' numpy placement)


def config(layers):
    return {"model_type": "qwen3", "vocab_size": 1000, "hidden_size": 256,
            "intermediate_size": 512, "num_hidden_layers": layers, "num_attention_heads": 8,
            "num_key_value_heads": 4, "head_dim": 32, "tie_word_embeddings": False}


def weights(cfg, version):
    rng = np.random.default_rng(version)
    return [(n, rng.standard_normal(s).astype(np.float32)) for n, s in checkpoint_shapes(cfg)]


def stage_layout(cfg, k, n, r):
    params, segments = tp_layout(cfg, r, 2, dtype="FLOAT32")

    def want(name):
        if name.startswith("model.layers."):
            return int(name.split(".")[2]) == k
        return k == 0 if name == "model.embed_tokens.weight" else k == n - 1
    params = [p for p in params if want(p[0])]
    return params, {p[0]: segments[p[0]] for p in params if p[0] in segments}


ENGINE = r"""
import json, sys
sys.path.insert(0, {client!r}); sys.path.insert(0, {here!r})
import numpy as np, torch, weightsync
import test_multi_daemon_gpu as t
target, k, n, gpu = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
cfg = t.config(n)
dev = torch.device("cuda", gpu)
engines, tensors = [], []
for r in range(2):
    params, segments = t.stage_layout(cfg, k, n, r)
    ts = [(name, torch.zeros(shape, dtype=torch.float32, device=dev)) for name, _, shape in params]
    e = weightsync.Engine(f"s{{k}}.tp{{r}}", target, timeout=60)
    e.register_torch(ts, segments=segments)
    e.start(on_pause=lambda mode: torch.cuda.synchronize(dev))
    engines.append(e); tensors.append((params, segments, ts))
print("ready", flush=True)
for line in sys.stdin:
    v = int(line)
    ckpt = dict(t.weights(cfg, v))
    bad = []
    for (params, segments, ts), e in zip(tensors, engines):
        for (name, _, shape), (_, x) in zip(params, ts):
            want = t.expected([(name, "FLOAT32", shape)], segments, ckpt)
            got = x.detach().reshape(-1).cpu().numpy()
            if not np.array_equal(got.view(np.uint32), want[:got.size].view(np.uint32)):
                bad.append(f"{{e.engine_id}}:{{name}}")
    print("ok" if not bad else "bad " + ",".join(bad[:5]), v, flush=True)
"""


def main():
    import torch
    daemon_bin, worker = sys.argv[1], sys.argv[2]
    gpus = torch.cuda.device_count()
    n = gpus - 1
    if n < 2:
        print(f"SKIP: {gpus} GPU(s); several daemons need at least 3 (N + 1)")
        return 0
    cfg = config(n)
    work = tempfile.mkdtemp(prefix="ws-multi-gpu.")
    os.chmod(work, 0o700)
    daemons, engines = [None] * n, []

    def start_daemon(k):
        daemons[k] = subprocess.Popen(
            [daemon_bin, f"--socket={work}/d{k}.sock", f"--gpu={k}", f"--gpu_worker={worker}",
             "--max_chunk_bytes=268435456", "--update_idle_timeout_ms=30000"],
            stderr=open(f"{work}/d{k}.log", "a"))
        for _ in range(200):
            if os.path.exists(f"{work}/d{k}.sock"):
                return
            time.sleep(0.05)
        raise RuntimeError(f"daemon {k} did not start")

    targets = [f"unix:{work}/d{k}.sock" for k in range(n)]
    ok = True
    try:
        for k in range(n):
            start_daemon(k)
        client = os.path.join(HERE, "..", "..", "client", "python")
        for k in range(n):
            p = subprocess.Popen([sys.executable, "-c", ENGINE.format(client=client, here=HERE),
                                  targets[k], str(k), str(n), str(k)],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 stderr=open(f"{work}/engine{k}.log", "a"), text=True)
            engines.append(p)
        for p in engines:
            assert p.stdout.readline().startswith("ready")

        def check(v, why):
            for p in engines:
                p.stdin.write(f"{v}\n")
                p.stdin.flush()
            for k, p in enumerate(engines):
                line = p.stdout.readline().strip()
                assert line == f"ok {v}", f"{why}: daemon {k}'s engines: {line}"

        trainer = weightsync.Trainer(targets, timeout=120)
        assert trainer.world_sizes("nccl") == [1] * n
        trainer.init_nccl(device=n)
        dev = torch.device("cuda", n)

        def send(v, **kw):
            ckpt = [(name, torch.from_numpy(a).to(dev)) for name, a in weights(cfg, v)]
            return trainer.update(ckpt, version=v, chunk_bytes=1 << 20, **kw)

        for v in (1, 2, 3):
            t0 = time.time()
            res = send(v)
            assert len(res) == n and all(r.version == v for r in res)
            check(v, f"v{v}")
            print(f"v{v}: {n} daemons, {2 * n} engines bit-exact, receipts ok "
                  f"({time.time() - t0:.2f} s)", flush=True)
        try:
            extra = [(name, torch.from_numpy(a).to(dev)) for name, a in weights(cfg, 4)]
            extra.append(("model.layers.99.nowhere", torch.ones(4, device=dev)))
            trainer.update(extra, version=4)
            raise AssertionError("a tensor no daemon uses was accepted")
        except weightsync.WeightSyncError as e:
            assert e.code == "INVALID_ARGUMENT" and "nowhere" in e.message, e
        print("a tensor no daemon uses: refused", flush=True)

        def kill_last(phase):
            if phase == "prepared":
                daemons[n - 1].kill()
                daemons[n - 1].wait()
                os.unlink(f"{work}/d{n - 1}.sock")
        trainer._on_phase = kill_last
        try:
            send(4)
            raise AssertionError("the commit did not report the dead daemon")
        except weightsync.WeightSyncError as e:
            assert e.code == "ABORTED" and f"but not on daemon {n - 1}" in e.message, e
        trainer._on_phase = None
        start_daemon(n - 1)
        for _ in range(200):   # its engines register again, DIRTY
            try:
                st = trainer.statuses()[n - 1]
                if len(st.engines) == 2:
                    break
            except weightsync.WeightSyncError:
                pass
            time.sleep(0.1)
        states = {e.engine_id: weightsync._proto.v1.enum_name("EngineState", e.state)
                  for e in trainer.statuses()[n - 1].engines}
        assert all(s == "ENGINE_DIRTY" for s in states.values()), states
        trainer.init_nccl(device=n)
        send(5)
        check(5, "repair")
        print(f"daemon {n - 1} killed between prepare and commit: the others committed v4, "
              f"its engines DIRTY; v5 repaired all", flush=True)
    except Exception as e:
        ok = False
        print(f"FAIL: {e}", flush=True)
        for f in sorted(os.listdir(work)):
            if f.endswith(".log"):
                print(f"--- {f}\n" + open(os.path.join(work, f), errors="replace").read()[-3000:])
    finally:
        for p in engines:
            p.kill()
        for d in daemons:
            if d is not None and d.poll() is None:
                d.terminate()
                d.wait(10)
        subprocess.run(["rm", "-rf", work])
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

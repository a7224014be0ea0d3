#!/usr/bin/env python3
"""Control-path cost at mixture-of-experts scale: many small tensors.

Against a real weightsyncd on the host backend (Unix socket in a temp dir,
as client/python/tests/test_host.py starts it), per tensor count and
receipts setting, a fresh daemon and one engine process:

  register_s       Engine.register_host of N FLOAT32 parameters (engine
                   process, call to return);
  first_update_s   the first Trainer.update (call to return);
  steady_update_s  median of the following updates (>= 5) of the same
                   tensors (their values change in place between updates).

Tensors are 16 float32 elements each (64 bytes), so the bytes' time is
negligible and what is measured is the control path (Python client and
daemon). `--qwen3` uses a Qwen3-235B-A22B-shaped manifest instead (real
names: 94 layers of 128 experts, 37,039 tensors); its shapes are the real
ones divided by 256 in each dimension (so it fits the host backend), except
for the first `--real-layers` layers (and embeddings) that keep their real
shapes (about 4.9 GB of float32 per layer: a large machine only).

    python3 bench/manifest_scale.py [--weightsyncd PATH] [--tensors 400,4000]
        [--receipts off,on] [--updates 6] [--qwen3 [--real-layers K]]
        [--profile] [--out bench/results/manifest_scale.json]

The daemon binary: --weightsyncd, else $WEIGHTSYNCD, else
bazel-bin/daemon/weightsyncd. Writes JSON (date, kind, commit, rows; what
an earlier file there recorded is kept: its rows under "history", its other
keys as they were) and prints a table. --profile runs cProfile over one
steady-state update per row and prints the top 15 functions by cumulative
time.
"""

import argparse
import cProfile
import datetime
import io
import json
import os
import platform
import pstats
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "client", "python"))

import numpy as np  # noqa: E402

ELEMENTS = 16

QWEN3_235B = {"layers": 94, "experts": 128, "hidden": 4096, "moe_inter": 1536,
              "heads": 64, "kv_heads": 4, "head_dim": 128, "vocab": 151936}


def qwen3_moe_shapes(real_layers=0, shrink=256):
    """[(name, shape)] of a Qwen3-235B-A22B checkpoint (Hugging Face names,
    model order). Layers >= real_layers (and embed/lm_head when
    real_layers == 0) have every dimension divided by `shrink` (at least
    1)."""
    c = QWEN3_235B

    def dims(real, *ds):
        return tuple(ds) if real else tuple(max(1, d // shrink) for d in ds)

    H, E, I = c["hidden"], c["experts"], c["moe_inter"]
    q, kv, hd = c["heads"] * c["head_dim"], c["kv_heads"] * c["head_dim"], c["head_dim"]
    big = real_layers > 0
    out = [("model.embed_tokens.weight", dims(big, c["vocab"], H))]
    for layer in range(c["layers"]):
        r = layer < real_layers
        p = f"model.layers.{layer}."
        out += [(p + "input_layernorm.weight", dims(r, H)),
                (p + "self_attn.q_proj.weight", dims(r, q, H)),
                (p + "self_attn.k_proj.weight", dims(r, kv, H)),
                (p + "self_attn.v_proj.weight", dims(r, kv, H)),
                (p + "self_attn.o_proj.weight", dims(r, H, q)),
                (p + "self_attn.q_norm.weight", dims(r, hd)),
                (p + "self_attn.k_norm.weight", dims(r, hd)),
                (p + "post_attention_layernorm.weight", dims(r, H)),
                (p + "mlp.gate.weight", dims(r, E, H))]
        for e in range(E):
            x = f"{p}mlp.experts.{e}."
            out += [(x + "gate_proj.weight", dims(r, I, H)),
                    (x + "up_proj.weight", dims(r, I, H)),
                    (x + "down_proj.weight", dims(r, H, I))]
    out += [("model.norm.weight", dims(big, H)), ("lm_head.weight", dims(big, c["vocab"], H))]
    return out


def uniform_shapes(n):
    return [(f"model.layers.{i // 1000}.experts.{i % 1000}.w", (ELEMENTS,)) for i in range(n)]


# ---------------------------------------------------------------- engine child

def engine_child(sock, spec_path, backend="host"):
    """Registers the parameters in `spec_path` (host: register_host; ipc:
    torch float32 tensors on GPU 0, register_torch), reports the time on
    stdout, serves the control stream until stdin closes."""
    import weightsync
    with open(spec_path) as f:
        shapes = [(n, tuple(s)) for n, s in json.load(f)]
    engine = weightsync.Engine("bench-engine", "unix:" + sock, timeout=120)
    if backend == "ipc":
        import torch
        params = [(n, torch.zeros(s, dtype=torch.float32, device="cuda:0")) for n, s in shapes]
        torch.cuda.synchronize()
    else:
        params = [(n, "FLOAT32", s) for n, s in shapes]
    prof = cProfile.Profile() if os.environ.get("WS_PROFILE_REGISTER") else None
    t0 = time.perf_counter()
    if prof:
        prof.enable()
    if backend == "ipc":
        engine.register_torch(params)
    else:
        engine.register_host(params)
    register_s = time.perf_counter() - t0
    if prof:
        prof.disable()
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(25)
        print(s.getvalue(), file=sys.stderr, flush=True)
    engine.start()
    print(json.dumps({"register_s": register_s}), flush=True)
    sys.stdin.read()
    engine.close()


# ---------------------------------------------------------------- trainer side

class Daemon:
    def __init__(self, binary, gpu_worker=None):
        self.dir = tempfile.mkdtemp(prefix="wsbench.", dir="/tmp")
        self.sock = os.path.join(self.dir, "d.sock")
        self.log = open(os.path.join(self.dir, "daemon.log"), "w")
        self.backend = "ipc" if gpu_worker else "host"
        gpu = [f"--gpu=0", f"--gpu_worker={gpu_worker}"] if gpu_worker else []
        self.proc = subprocess.Popen([binary, f"--socket={self.sock}", "--notice_timeout_ms=60000",
                                      "--finish_timeout_ms=600000"] + gpu +
                                     # Experiments: more daemon flags from the environment.
                                     os.environ.get("WS_DAEMON_EXTRA", "").split(),
                                     stderr=self.log)
        for _ in range(400):
            if os.path.exists(self.sock):
                break
            if self.proc.poll() is not None:
                raise RuntimeError(f"weightsyncd exited: {self.tail()}")
            time.sleep(0.025)
        self.engine = None

    def tail(self):
        self.log.flush()
        with open(os.path.join(self.dir, "daemon.log")) as f:
            return f.read()[-2000:]

    def start_engine(self, shapes):
        spec = os.path.join(self.dir, "shapes.json")
        with open(spec, "w") as f:
            json.dump([(n, list(s)) for n, s in shapes], f)
        self.engine = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--engine-child", self.sock, spec,
             self.backend],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        line = self.engine.stdout.readline()
        if not line:
            raise RuntimeError(f"engine failed; daemon log: {self.tail()}")
        return json.loads(line)["register_s"]

    def close(self):
        if self.engine is not None:
            try:
                self.engine.stdin.close()
                self.engine.wait(timeout=30)
            except Exception:
                self.engine.kill()
        self.proc.terminate()
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()
        keep = os.environ.get("WS_LOG_DIR")
        if keep:   # the daemon's log, for profiles (e.g. WS_DAEMON_EXTRA=--v=1)
            shutil.copy(os.path.join(self.dir, "daemon.log"),
                        os.path.join(keep, f"manifest-daemon-{self.proc.pid}.log"))
        shutil.rmtree(self.dir, ignore_errors=True)


def trainer_tensors(shapes, backend="host"):
    """(backing array, [(name, view)]): every tensor a contiguous float32
    view of one array (ipc: a torch tensor on GPU 0), so values change in
    place between updates."""
    sizes = [int(np.prod(s)) if len(s) else 1 for _, s in shapes]
    backing = np.random.default_rng(0).standard_normal(sum(sizes)).astype(np.float32)
    if backend == "ipc":
        import torch
        backing = torch.from_numpy(backing).to("cuda:0")
    out, at = [], 0
    for (name, shape), n in zip(shapes, sizes):
        out.append((name, backing[at:at + n].reshape(shape)))
        at += n
    return backing, out


def wait_connected(trainer, engine_id="bench-engine"):
    for _ in range(500):
        if any(s.engine_id == engine_id and s.connected for s in trainer.status().engines):
            return
        time.sleep(0.02)
    raise RuntimeError("engine never connected")


def run_row(binary, shapes, receipts, updates, profile, gpu_worker=None, host_source=False):
    import weightsync
    daemon = Daemon(binary, gpu_worker)
    try:
        register_s = daemon.start_engine(shapes)
        trainer = weightsync.Trainer("unix:" + daemon.sock, timeout=300)
        try:
            wait_connected(trainer)
            if daemon.backend == "ipc":
                trainer.init_ipc()
            else:
                trainer.init_host()
            source_register_s = None
            if host_source:
                # The trainer's tensors in its own shared memory, registered
                # once (Trainer.host_tensors); updates name the source.
                t = time.perf_counter()
                named = trainer.host_tensors([(n, "FLOAT32", s) for n, s in shapes])
                source_register_s = time.perf_counter() - t
                backing = named.buffer.view(np.float32)
            else:
                backing, named = trainer_tensors(shapes, daemon.backend)
            verify = receipts == "on"
            times = []
            version = 0
            for _ in range(updates):
                version += 1
                backing += 1.0
                t0 = time.perf_counter()
                trainer.update(named, version=version, verify=verify)
                times.append(time.perf_counter() - t0)
            last = trainer.last_results[0] if trainer.last_results else None
            timings = {"daemon": str(last.timings).replace("\n", " ") if last else None,
                       "client": trainer.last_timings}
            prof_text = None
            if profile:
                version += 1
                backing += 1.0
                prof = cProfile.Profile()
                prof.enable()
                trainer.update(named, version=version, verify=verify)
                prof.disable()
                s = io.StringIO()
                pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(15)
                prof_text = s.getvalue()
        finally:
            trainer.close()
    finally:
        daemon.close()
    extra = {}
    if host_source:
        extra = {"trainer_memory": "host_tensors",
                 "source_register_s": round(source_register_s, 5)}
    extra["last_update_timings"] = timings
    return {**extra, "tensors": len(shapes), "receipts": receipts,
            "register_s": round(register_s, 5),
            "first_update_s": round(times[0], 5),
            "steady_update_s": round(statistics.median(times[1:]), 5),
            "bytes": int(sum((int(np.prod(s)) if len(s) else 1) * 4 for _, s in shapes))}, \
        prof_text


def commit():
    try:
        return subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, check=True).stdout.strip()
    except Exception:
        return "unknown"


def keep_history(path, doc):
    """Carries over what an earlier result file at `path` recorded: its
    extra keys (e.g. "before") as they are, and its own rows, newest first,
    under "history" ({date, kind, commit, rows})."""
    try:
        with open(path) as f:
            old = json.load(f)
    except (OSError, ValueError):
        return
    history = old.pop("history", [])
    if old.get("rows"):
        history.insert(0, {k: old[k] for k in ("date", "kind", "commit", "rows") if k in old})
    for k, v in old.items():
        if k not in doc and k not in ("date", "kind", "commit", "rows", "updates_per_row",
                                      "elements_per_tensor"):
            doc[k] = v
    doc["history"] = history


def main():
    if len(sys.argv) in (4, 5) and sys.argv[1] == "--engine-child":
        return engine_child(*sys.argv[2:])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--weightsyncd", default=os.environ.get(
        "WEIGHTSYNCD", os.path.join(ROOT, "bazel-bin", "daemon", "weightsyncd")))
    ap.add_argument("--tensors", default="400,4000,40000,100000")
    ap.add_argument("--receipts", default="off,on")
    ap.add_argument("--updates", type=int, default=6, help="updates per row (>= 6)")
    ap.add_argument("--qwen3", action="store_true", help="Qwen3-235B-A22B-shaped manifest")
    ap.add_argument("--real-layers", type=int, default=0)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--gpu-worker", default=None,
                    help="weightsync_gpu_worker: run on the ipc backend on GPU 0 (torch "
                         "tensors in the trainer and the engine) instead of the host backend")
    ap.add_argument("--host-source", action="store_true",
                    help="host backend: the trainer's tensors in its own shared memory "
                         "(Trainer.host_tensors), each update one call; adds a row of one "
                         "tensor of the same elements (the bytes' own time)")
    ap.add_argument("--kind", default=f"cpu-{os.cpu_count()}core {platform.machine()} "
                    "host backend")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "manifest_scale.json"))
    args = ap.parse_args()
    if args.updates < 6:
        ap.error("--updates must be at least 6 (first + a median of >= 5)")
    binary = os.path.abspath(args.weightsyncd)
    if args.qwen3:
        cases = [("qwen3-235b-a22b", qwen3_moe_shapes(args.real_layers))]
    else:
        cases = [(None, uniform_shapes(int(n))) for n in args.tensors.split(",")]
        if args.host_source:
            # The bytes' own time: the largest count's elements in one tensor.
            n = max(int(n) for n in args.tensors.split(","))
            cases.append(("one tensor", [("w", (n * ELEMENTS,))]))
    rows = []
    print(f"{'tensors':>8} {'receipts':>8} {'register_s':>11} {'first_update_s':>15} "
          f"{'steady_update_s':>16}", flush=True)
    for label, shapes in cases:
        for receipts in args.receipts.split(","):
            row, prof = run_row(binary, shapes, receipts, args.updates, args.profile,
                                args.gpu_worker, args.host_source)
            row["backend"] = "ipc" if args.gpu_worker else "host"
            if label:
                row["manifest"] = label
                if args.qwen3:
                    row["real_layers"] = args.real_layers
            rows.append(row)
            print(f"{row['tensors']:>8} {receipts:>8} {row['register_s']:>11.4f} "
                  f"{row['first_update_s']:>15.4f} {row['steady_update_s']:>16.4f}", flush=True)
            if prof:
                print(prof, flush=True)
    doc = {"date": datetime.date.today().isoformat(), "kind": args.kind, "commit": commit(),
           "updates_per_row": args.updates, "elements_per_tensor": ELEMENTS,
           "rows": rows}
    keep_history(args.out, doc)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

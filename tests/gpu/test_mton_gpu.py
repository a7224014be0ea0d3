#!/usr/bin/env python3
"""Every trainer GPU sends, through the daemons (issue 32), on 4 GPUs:

* trainer ranks 0 and 1 (GPUs 0, 1): one process each, torch.distributed
  (gloo) as their collective, weightsync.Trainer(both daemons) on each,
  init_nccl(collective=...) on both (one NCCL group: ranks 0, 1, then the
  daemons), then Trainer.update_sharded on both with the documented
  defaults (receipts on, the daemon's chunk size);
* daemon 0 owns GPU 2, daemon 1 GPU 3 (a daemon per engine GPU: no byte
  crosses NVLink twice); engines registered in place by CUDA IPC, bf16:
  "tp2" = one TP=2 engine (rank 0 on GPU 2, rank 1 on GPU 3, vLLM's fused
  layout, weightsync.layouts.llama_engine_layout), "replicas" = two TP=1
  engines, one per GPU;
* trainer cases (bench/mton_patterns.py holdings): "rows" (FSDP row shards
  of every tensor), "layers" (layers split between the ranks), "replicas"
  (both hold everything);
* per layout, in the same run: today's single sender (rank 0 alone,
  Trainer.update over init_nccl(): one broadcast to both daemons), then
  every case with two senders; each first update is checked bit for bit
  in every engine (each engine process regenerates the version and
  compares every segment), then --reps timed updates (call to return on
  rank 0, the slower rank reported too);
* faults (replicas layout, case rows; --faults PHASE...): rank 1 dies
  (os._exit) after the Start and before its first send, after its third
  round of sends, or once all its bytes arrived but before it reports; or
  it freezes (SIGSTOP) after its third round: each time the update fails
  on rank 0 and on both daemons, no engine serves the new version (DIRTY,
  or READY at the old one), a new job (both ranks restarted) repairs
  every engine.

    python3 tests/gpu/test_mton_gpu.py --bin BIN --out DIR [--model qwen3-8b]

Prints a table last; writes DIR/mton_daemon.json and every process's log.
Every process is bounded; ranks and engines exit with os._exit.
"""

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
CLIENT = os.path.join(REPO, "client", "python")
sys.path.insert(0, CLIENT)
sys.path.insert(0, os.path.join(REPO, "bench"))

import mton_patterns as mp  # noqa: E402

MODELS = dict(mp.MODELS)
MODELS["tiny"] = {"vocab_size": 1000, "hidden_size": 256, "intermediate_size": 512,
                  "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4,
                  "head_dim": 32, "model_type": "qwen3", "tie_word_embeddings": False}
TRAINER_GPUS = (0, 1)
# (chunk bytes, receipts) of the timed updates: the documented defaults
# first (the daemon's chunk size, receipts on).
VARIANT_NAMES = {"default": (0, True), "default-noverify": (0, False),
                 "64": (64 << 20, True), "64-noverify": (64 << 20, False),
                 "256": (256 << 20, True), "256-noverify": (256 << 20, False),
                 "1024": (1 << 30, True)}
FAULTS = ("start", "mid", "finish", "frozen")
ENGINE_GPUS = (2, 3)


def shapes(cfg):
    from weightsync.layouts import checkpoint_shapes
    return [(n, list(s)) for n, s in checkpoint_shapes(cfg)]


def tensor(version, k, shape, dev):
    """Tensor k of `version`: the same bits in every process (seeded on the
    GPU)."""
    import torch
    g = torch.Generator(device=dev)
    g.manual_seed(version * 1000003 + k)
    return torch.randn(shape, generator=g, device=dev, dtype=torch.float32).to(torch.bfloat16)


def engine_layout(cfg, layout, i):
    from weightsync.layouts import llama_engine_layout
    tp_rank, tp_size = (i, 2) if layout == "tp2" else (0, 1)
    return llama_engine_layout(cfg, tp_rank=tp_rank, tp_size=tp_size)


# -- an engine process -------------------------------------------------------------

def engine_main(args):
    import torch
    import weightsync
    cfg = MODELS[args.model]
    dev = torch.device("cuda", args.gpu)
    torch.cuda.set_device(dev)
    params, segments = engine_layout(cfg, args.layout, args.index)
    ts = [(name, torch.zeros(shape, dtype=torch.bfloat16, device=dev)) for name, _, shape in params]
    engine = weightsync.Engine(args.engine_id, args.target, timeout=60)
    engine.register_torch(ts, segments=segments)
    engine.start(on_pause=lambda mode: torch.cuda.synchronize(dev))
    index = {n: k for k, (n, _) in enumerate(shapes(cfg))}
    shape_of = dict(shapes(cfg))
    print("ready", flush=True)
    for line in sys.stdin:
        v = int(line)
        bad, cache = [], {}

        def source(name):
            if name not in cache:
                cache.clear()
                t = tensor(v, index[name], shape_of[name], dev)
                cache[name] = t.reshape(t.shape[0] if t.dim() else 1, -1)
            return cache[name]
        for (name, _, shape), (_, x) in zip(params, ts):
            flat = x.reshape(-1)
            for s in segments.get(name) or [{"source": name, "row_begin": 0,
                                             "row_count": shape[0] if shape else 1,
                                             "col_begin": 0, "col_count": None,
                                             "dest_offset": 0, "dest_row_stride": 0}]:
                src = source(s["source"])
                cc = s["col_count"] if s["col_count"] is not None else src.shape[1]
                want = src[s["row_begin"]:s["row_begin"] + s["row_count"],
                           s["col_begin"]:s["col_begin"] + cc]
                got = flat.as_strided((s["row_count"], cc), (s["dest_row_stride"] or cc, 1),
                                      flat.storage_offset() + s["dest_offset"])
                if not torch.equal(got.view(torch.int16), want.view(torch.int16)):
                    bad.append(f"{name}<-{s['source']}")
        torch.cuda.synchronize(dev)
        print("ok" if not bad else "bad " + ",".join(bad[:4]), v, flush=True)
    os._exit(0)


# -- a trainer rank ------------------------------------------------------------------

def rank_main(args):
    import datetime
    import torch
    import torch.distributed as dist
    import weightsync
    from weightsync import transfer_plan
    from weightsync.senders.many import TorchCollective
    cfg = MODELS[args.model]
    dev = torch.device("cuda", TRAINER_GPUS[args.rank])
    torch.cuda.set_device(dev)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=args.rank,
                            world_size=2, timeout=datetime.timedelta(seconds=30))
    coll = TorchCollective()
    trainer = weightsync.Trainer(args.targets, timeout=60)
    all_shapes = shapes(cfg)
    manifest = [{"name": n, "dtype": "BFLOAT16", "shape": s} for n, s in all_shapes]
    local, full = [], []

    def reply(**kw):
        print(json.dumps(kw), flush=True)
    print(json.dumps({"ready": args.rank}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        try:
            if op == "init_sharded":
                t = time.perf_counter()
                trainer.init_nccl(device=dev, collective=coll)
                reply(ok=True, s=time.perf_counter() - t)
            elif op == "init_single":
                t = time.perf_counter()
                trainer.init_nccl(device=dev)
                reply(ok=True, s=time.perf_counter() - t)
            elif op == "drop":
                trainer._close_sharded()
                reply(ok=True)
            elif op == "load":
                local.clear()
                full.clear()
                holds = mp.holdings(cfg, cmd["case"]) if cmd["case"] != "full" else None
                for k, (name, shape) in enumerate(all_shapes):
                    t = tensor(cmd["version"], k, shape, dev)
                    if holds is None:
                        full.append((name, t))
                        continue
                    mine = holds[name].get(args.rank)
                    if mine is None:
                        continue
                    r0, n = mine
                    b = transfer_plan.block(name, r0, n, 0, transfer_plan.view_2d(shape)[1])
                    local.append((b, t[r0:r0 + n].contiguous()))
                torch.cuda.synchronize(dev)
                reply(ok=True, bytes=sum(t.numel() * 2 for _, t in local + full))
            elif op in ("update", "update_single"):
                if cmd.get("fault") and args.rank == 1:
                    plant_fault(trainer._sharded_nccl[1], cmd["fault"], dev)
                times, timings = [], []
                for target in cmd["versions"]:
                    t = time.perf_counter()
                    if op == "update":
                        trainer.update_sharded(manifest, local, target,
                                               chunk_bytes=cmd.get("chunk", 0),
                                               verify=cmd.get("verify", True))
                        timings.append(dict(trainer._sharded_nccl[1].last_timings))
                    else:
                        trainer.update(full, version=target, chunk_bytes=cmd.get("chunk", 0),
                                       verify=cmd.get("verify", True))
                        timings.append(dict(trainer.last_timings))
                    times.append(time.perf_counter() - t)
                reply(ok=True, times=times, timings=timings[-1:])
            elif op == "exit":
                reply(ok=True)
                sys.stdout.flush()
                os._exit(0)
        except weightsync.WeightSyncError as e:
            reply(ok=False, code=e.code, error=e.message[:600])
        except Exception as e:  # noqa: BLE001 - reported to the launcher
            reply(ok=False, code=type(e).__name__, error=str(e)[:600])
    os._exit(0)


def plant_fault(links, phase, dev):
    """Rank 1's death (or freeze) at `phase` of its next update:
    "start" after the Start is agreed, before its first send; "mid" after
    its third round of sends left the GPU; "finish" once every byte it
    sends has arrived, before it reports to the leader; "frozen" SIGSTOP
    after the third round (alive, its socket open: only the daemons' idle
    timeout can end it)."""
    import signal
    import torch
    if phase == "start":
        links._send_rounds = lambda *a, **k: os._exit(9)
    elif phase == "finish":
        push = links.push

        def push_then_die(*a, **k):
            push(*a, **k)
            torch.cuda.synchronize(dev)
            os._exit(9)
        links.push = push_then_die
    else:
        def on_round(k):
            if k >= 2:
                torch.cuda.synchronize(dev)
                if phase == "frozen":
                    os.kill(os.getpid(), signal.SIGSTOP)
                os._exit(9)
        links.on_round = on_round


# -- the launcher ------------------------------------------------------------------------

class Proc:
    def __init__(self, argv, log, env=None):
        self.log = log
        self.p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=open(log, "a"), text=True, env=env)

    def send(self, obj):
        self.p.stdin.write((obj if isinstance(obj, str) else json.dumps(obj)) + "\n")
        self.p.stdin.flush()

    def read(self, timeout=120, json_only=False):
        import select
        end = time.time() + timeout
        while time.time() < end:
            r, _, _ = select.select([self.p.stdout], [], [], 1.0)
            if r:
                line = self.p.stdout.readline()
                if not line:
                    raise RuntimeError(f"{self.log}: exited ({self.p.poll()})")
                if json_only and not line.startswith("{"):
                    continue   # a library's chatter on stdout
                return line.strip()
            if self.p.poll() is not None:
                raise RuntimeError(f"{self.log}: exited ({self.p.returncode})")
        raise RuntimeError(f"{self.log}: no answer in {timeout} s")

    def kill(self):
        if self.p.poll() is None:
            self.p.kill()
        self.p.wait()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Run:
    def __init__(self, args):
        self.args = args
        self.work = tempfile.mkdtemp(prefix="ws-mton-gpu.")
        self.logs = os.path.abspath(args.out)
        os.makedirs(self.logs, exist_ok=True)
        self.targets = [f"unix:{self.work}/d{i}.sock" for i in range(2)]
        self.daemons, self.engines, self.ranks = [], [], []
        self.rows, self.checks = [], []
        self.me = os.path.abspath(__file__)

    def start_daemons(self):
        for i, gpu in enumerate(ENGINE_GPUS):
            log = open(f"{self.logs}/d{i}.log", "a")
            self.daemons.append(subprocess.Popen(
                [f"{self.args.bin}/weightsyncd", f"--socket={self.work}/d{i}.sock",
                 f"--gpu={gpu}", f"--gpu_worker={self.args.bin}/weightsync_gpu_worker",
                 "--max_chunk_bytes=1073741824", "--update_idle_timeout_ms=20000"]
                # 1 GiB chunks (variant "1024") stage two per round and
                # link: a budget past the default 4 GiB, asked only then.
                + (["--gpu_staging_budget_bytes=17179869184"]
                   if "1024" in (self.args.variants or ()) else []),
                stderr=log, stdout=log))
        for i in range(2):
            for _ in range(400):
                if os.path.exists(f"{self.work}/d{i}.sock"):
                    break
                time.sleep(0.05)
            else:
                raise RuntimeError(f"daemon {i} did not start")

    def start_engines(self, layout):
        for p in self.engines:
            p.kill()
        self.engines = []
        for i, gpu in enumerate(ENGINE_GPUS):
            eid = f"tp2.{i}" if layout == "tp2" else f"rep{i}"
            self.engines.append(Proc(
                [sys.executable, self.me, "engine", "--model", self.args.model, "--layout", layout,
                 "--index", str(i), "--gpu", str(gpu), "--engine_id", eid,
                 "--target", self.targets[i]], f"{self.logs}/engine_{layout}{i}.log"))
        for p in self.engines:
            line = p.read(120)
            assert line == "ready", line
        time.sleep(0.5)

    def start_ranks(self):
        for p in self.ranks:
            p.kill()
        port = free_port()
        self.ranks = [Proc([sys.executable, self.me, "rank", "--model", self.args.model,
                            "--rank", str(r), "--port", str(port), "--targets", *self.targets],
                           f"{self.logs}/rank{r}.log") for r in range(2)]
        for p in self.ranks:
            json.loads(p.read(120, json_only=True))

    def both(self, cmd, timeout=120, who=(0, 1)):
        for r in who:
            self.ranks[r].send(cmd)
        return [json.loads(self.ranks[r].read(timeout, json_only=True)) for r in who]

    def check(self, data_version, why):
        for p in self.engines:
            p.send(str(data_version))
        lines = [p.read(120) for p in self.engines]
        ok = all(line == f"ok {data_version}" for line in lines)
        self.checks.append({"what": why, "ok": ok, "engines": lines})
        print(f"  check {why}: {'bit-exact' if ok else lines}", flush=True)
        if not ok:
            raise AssertionError(f"{why}: {lines}")


def median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2] if xs else None


def layout_block(run, layout, version, reps):
    """Single sender, then every case with two senders, on `layout`."""
    a = run.args
    run.start_engines(layout)
    # Today's path: rank 0 alone broadcasts to both daemons.
    r0 = run.both({"op": "drop"}, who=(1,))
    r0 = run.both({"op": "init_single"}, who=(0,))[0]
    assert r0["ok"], r0
    assert run.both({"op": "load", "case": "full", "version": version}, who=(0,))[0]["ok"]
    data = version
    first = run.both({"op": "update_single", "versions": [version]}, who=(0,))[0]
    assert first["ok"], first
    version += 1
    run.check(data, f"{layout} single sender")
    variants = [VARIANT_NAMES[v] for v in sorted(a.variants, key=list(VARIANT_NAMES).index)]
    for chunk, verify in variants:
        got = run.both({"op": "update_single", "verify": verify, "chunk": chunk,
                        "versions": list(range(version, version + reps))}, who=(0,))[0]
        assert got["ok"], got
        version += reps
        run.rows.append({"layout": layout, "case": "full", "senders": 1, "verify": verify,
                         "chunk": chunk, "median_s": median(got["times"]),
                         "times": got["times"], "timings": got["timings"]})
        print(f"  {layout} one sender chunk={chunk >> 20 or 'default'} MiB verify={verify}: "
              f"{median(got['times']) * 1e3:.2f} ms", flush=True)
    init = run.both({"op": "init_sharded"})
    assert all(x["ok"] for x in init), init
    for case in a.cases:
        data = version
        loaded = run.both({"op": "load", "case": case, "version": data})
        assert all(x["ok"] for x in loaded), loaded
        first = run.both({"op": "update", "versions": [version]})
        assert all(x["ok"] for x in first), first
        version += 1
        run.check(data, f"{layout} {case} two senders")
        for chunk, verify in variants:
            got = run.both({"op": "update", "verify": verify, "chunk": chunk,
                            "versions": list(range(version, version + reps))})
            assert all(x["ok"] for x in got), got
            version += reps
            t0, t1 = median(got[0]["times"]), median(got[1]["times"])
            run.rows.append({"layout": layout, "case": case, "senders": 2, "verify": verify,
                             "chunk": chunk, "median_s": t0, "rank1_median_s": t1,
                             "times": got[0]["times"], "timings": got[0]["timings"],
                             "bytes_per_rank": [x["bytes"] for x in loaded]})
            print(f"  {layout} {case} two senders chunk={chunk >> 20 or 'default'} MiB "
                  f"verify={verify}: rank0 {t0 * 1e3:.2f} ms, rank1 {t1 * 1e3:.2f} ms",
                  flush=True)
        run.check(data, f"{layout} {case} after the timed updates")
    return version


def faults(run, version, phases):
    """Rank 1 dies (or freezes) at each phase of an update: the update
    fails on rank 0 and on both daemons, no engine serves the new version
    (DIRTY, or READY at the old one), a new job repairs every engine."""
    import weightsync
    run.start_engines("replicas")
    assert all(x["ok"] for x in run.both({"op": "init_sharded"}))
    assert all(x["ok"] for x in run.both({"op": "load", "case": "rows", "version": version}))
    assert all(x["ok"] for x in run.both({"op": "update", "versions": [version]}))
    run.check(version, "faults: before")
    for phase in phases:
        version += 1
        # Enough rounds to die in the middle: small chunks for a small model.
        chunk = 64 << 10 if run.args.model == "tiny" else 0
        run.ranks[1].send({"op": "update", "versions": [version], "fault": phase,
                           "chunk": chunk})
        run.ranks[0].send({"op": "update", "versions": [version], "chunk": chunk})
        t = time.time()
        got = json.loads(run.ranks[0].read(120, json_only=True))
        took = time.time() - t
        assert not got["ok"], f"{phase}: the update succeeded with a dead sender: {got}"
        trainer = weightsync.Trainer(run.targets, timeout=30)
        states = []
        for st in trainer.statuses():
            for e in st.engines:
                states.append((e.engine_id,
                               weightsync._proto.v1.enum_name("EngineState", e.state), e.version))
        trainer.close()
        mixed = any(s == "ENGINE_READY" and v == version for _, s, v in states)
        print(f"  rank 1 {phase}: rank 0 got {got['code']} in {took:.1f} s; engines {states}",
              flush=True)
        assert not mixed, states
        run.start_ranks()   # SIGKILL: a frozen rank 1 too
        for attempt in range(5):   # the daemons may still be ending the aborted update
            init = run.both({"op": "init_sharded"})
            if all(x["ok"] for x in init):
                break
            print(f"  init after the fault, try {attempt + 1}: {init}", flush=True)
            time.sleep(2)
        assert all(x["ok"] for x in init), init
        version += 1
        assert all(x["ok"] for x in run.both({"op": "load", "case": "rows", "version": version}))
        assert all(x["ok"] for x in run.both({"op": "update", "versions": [version]}))
        run.check(version, f"faults: {phase}, repaired by a new job")
        run.rows.append({"fault": phase, "error": got, "seconds": took, "engines": states,
                         "repaired": True})
    return version + 1


def launcher(args):
    run = Run(args)
    ok = True
    try:
        run.start_daemons()
        run.start_ranks()
        version = 1
        for layout in args.layouts:
            version = layout_block(run, layout, version, args.reps)
        if args.faults:
            faults(run, version, args.faults)
    except Exception as e:  # noqa: BLE001 - reported, logs kept
        ok = False
        print(f"FAIL: {type(e).__name__}: {e}", flush=True)
    finally:
        for p in run.ranks + run.engines:
            try:
                p.send({"op": "exit"} if p in run.ranks else "")
            except Exception:  # noqa: BLE001
                pass
            p.kill()
        for d in run.daemons:
            d.terminate()
            try:
                d.wait(10)
            except subprocess.TimeoutExpired:
                d.kill()
    with open(os.path.join(run.logs, "mton_daemon.json"), "w") as f:
        json.dump({"model": args.model, "ok": ok, "rows": run.rows, "checks": run.checks}, f,
                  indent=1)
    print(f"\n| {args.model} | layout | case | senders | chunk MiB | receipts | rank 0 median ms |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in run.rows:
        if "median_s" in r:
            print(f"| | {r['layout']} | {r['case']} | {r['senders']} | "
                  f"{r['chunk'] >> 20 or 'default'} | {r['verify']} | "
                  f"{r['median_s'] * 1e3:.2f} |")
    print(f"=== M->N through the daemons ({args.model}): {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("role", nargs="?", default="launch", choices=("launch", "engine", "rank"))
    ap.add_argument("--bin", default=".dev/bin")
    ap.add_argument("--out", default="/tmp/ws-mton-gpu")
    ap.add_argument("--model", default="qwen3-8b", choices=sorted(MODELS))
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--cases", nargs="+", default=list(mp.CASES), choices=mp.CASES)
    ap.add_argument("--layouts", nargs="+", default=list(mp.LAYOUTS), choices=mp.LAYOUTS)
    ap.add_argument("--faults", nargs="*", choices=FAULTS,
                    help="rank 1 dies at these phases (all four when none is named)")
    ap.add_argument("--variants", nargs="+", choices=sorted(VARIANT_NAMES),
                    default=["default", "default-noverify", "256", "256-noverify"],
                    help="(chunk, receipts) of the timed updates (default: the daemons' own "
                         "chunk size: 64 MiB for one sender, 256 MiB for many)")
    ap.add_argument("--layout")
    ap.add_argument("--index", type=int)
    ap.add_argument("--gpu", type=int)
    ap.add_argument("--engine_id")
    ap.add_argument("--target")
    ap.add_argument("--rank", type=int)
    ap.add_argument("--port", type=int)
    ap.add_argument("--targets", nargs="+")
    args = ap.parse_args()
    if args.role == "engine":
        return engine_main(args)
    if args.role == "rank":
        return rank_main(args)
    args.bin = os.path.abspath(args.bin)
    if args.faults is not None and not args.faults:
        args.faults = list(FAULTS)
    return launcher(args)


if __name__ == "__main__":
    sys.exit(main())

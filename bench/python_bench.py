#!/usr/bin/env python3
"""Python-client benchmark on two GPUs, Qwen3-8B-shaped bf16 parameters
(399 tensors, 16.38 GB), in one run:

(a) weightsync through the Python client: an engine process registers 399
    torch tensors on GPU 1 by CUDA IPC (Engine.register_torch), weightsyncd
    has its NCCL rank on GPU 1, a trainer process on GPU 0 calls
    Trainer.update (NCCL); median of updates 2-6, Start to Finish (the
    broadcasts included), per chunk size;
(b) naive: torch.distributed (NCCL) between the two processes, one
    broadcast per parameter into a temporary, then copy_ into the engine's
    tensor (what RL frameworks hand-roll);
(c) raw NCCL ceiling: the same bytes as 1 GiB broadcasts between the two
    processes (weightsync.nccl, no daemon).

    python3 bench/python_bench.py WEIGHTSYNCD WEIGHTSYNC_GPU_WORKER [OUT_JSON]

Writes OUT_JSON (default bench/results/python_nccl.json): the fields of
bench/results/gpu_nccl.json plus the client's own breakdown.
"""

import datetime
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
import _common as C  # noqa: E402

QWEN3_8B = {"vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 12288,
            "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
            "head_dim": 128, "model_type": "qwen3", "tie_word_embeddings": False}
MODEL = os.environ.get("BENCH_MODEL", "qwen3-8b")
CHUNKS_MIB = [int(x) for x in os.environ.get("BENCH_CHUNKS_MIB", "1024,256").split(",")]
# BENCH_VERIFY=off,on,late: each chunk size also with receipts (the default
# of Trainer.update; rows keyed "<MiB>-on"), and with their expectation
# computed after the transfer as before 31cd3bf ("<MiB>-late":
# GpuReceipts.EARLY off).
VERIFY = os.environ.get("BENCH_VERIFY", "off").split(",")
UPDATES = 6
REPEATS = 5


def shapes():
    from weightsync import layouts
    cfg = dict(QWEN3_8B)
    if MODEL == "small":   # a quick dry run of the script
        cfg.update(vocab_size=8192, hidden_size=512, intermediate_size=1024,
                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    return layouts.checkpoint_shapes(cfg)


def tensors(device, fill):
    import torch
    out = []
    for i, (name, shape) in enumerate(shapes()):
        t = torch.empty(shape, dtype=torch.bfloat16, device=device)
        if fill:
            g = torch.Generator(device=device).manual_seed(i + 1)
            t.normal_(generator=g)
        else:
            t.zero_()
        out.append((name, t))
    torch.cuda.synchronize(device)
    return out


def sums(named):
    import torch
    return [int(t.view(torch.int16).to(torch.int64).sum()) for _, t in named]


def naive(named, rank, port, repeats):
    import torch
    import torch.distributed as dist
    dev = named[0][1].device
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    times = []
    for r in range(repeats + 1):
        dist.barrier(device_ids=[dev.index])
        torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        for _, p in named:
            if rank == 0:
                dist.broadcast(p, src=0)
            else:
                tmp = torch.empty_like(p)
                dist.broadcast(tmp, src=0)
                p.copy_(tmp)
        torch.cuda.synchronize(dev)
        if r:   # the first round warms up
            times.append(time.perf_counter() - t0)
    return times


def raw(uid, rank, nbytes, repeats, device):
    import torch
    from weightsync import nccl
    with torch.cuda.device(device):
        comm = nccl.Communicator(2, uid, rank)
        buf = torch.ones(1 << 30, dtype=torch.uint8, device=device)
        stream = torch.cuda.Stream(device)
        sizes = []
        left = nbytes
        while left > 0:
            sizes.append(min(left, 1 << 30))
            left -= sizes[-1]
        times = []
        for r in range(repeats + 1):
            comm.broadcast(buf.data_ptr(), 256, 0, stream.cuda_stream)   # line up
            stream.synchronize()
            t0 = time.perf_counter()
            for n in sizes:
                comm.broadcast(buf.data_ptr(), n, 0, stream.cuda_stream)
            stream.synchronize()
            if r:
                times.append(time.perf_counter() - t0)
    return times


def engine_main(conn, target):
    import torch
    import weightsync
    dev = torch.device("cuda", 1)
    torch.cuda.set_device(dev)
    named = tensors(dev, fill=False)
    engine = weightsync.Engine("bench-engine", target, timeout=300)
    t0 = time.perf_counter()
    engine.register_torch(named)
    reg_s = time.perf_counter() - t0
    engine.start()
    C.send(conn, {"ready": True, "register_s": reg_s})
    while True:
        msg = C.recv(conn, 1800, "a command")
        if msg["cmd"] == "sums":
            C.send(conn, {"sums": sums(named)})
        elif msg["cmd"] == "naive":
            C.send(conn, {"times": naive(named, 1, msg["port"], REPEATS)})
        elif msg["cmd"] == "raw":
            C.send(conn, {"times": raw(bytes.fromhex(msg["uid"]), 1, msg["bytes"], REPEATS,
                                       dev)})
        elif msg["cmd"] == "end":
            return


def trainer_main(conn, target):
    import torch
    import weightsync
    from weightsync import nccl
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    named = tensors(dev, fill=True)
    nbytes = sum(t.numel() * t.element_size() for _, t in named)
    C.send(conn, {"ready": True, "bytes": nbytes, "tensors": len(named)})
    while True:
        msg = C.recv(conn, 1800, "a command")
        if msg["cmd"] == "weightsync":
            trainer = weightsync.Trainer(target, timeout=300)
            trainer.init_nccl(device=0)
            runs, version = {}, 0
            from weightsync.senders.gpu_receipts import GpuReceipts
            for mib in CHUNKS_MIB:
                for mode in VERIFY:   # off: the transfer alone, as before
                    GpuReceipts.EARLY = mode != "late"
                    rows = []
                    for _ in range(UPDATES):
                        version += 1
                        r = trainer.update(named, version=version, chunk_bytes=mib << 20,
                                           verify=mode != "off")
                        rows.append(dict(trainer.last_timings, daemon_s=r.seconds))
                    runs[str(mib) + ("" if mode == "off" else "-" + mode)] = rows
            GpuReceipts.EARLY = True
            C.send(conn, {"runs": runs, "sums": sums(named)})
        elif msg["cmd"] == "naive":
            C.send(conn, {"times": naive(named, 0, msg["port"], REPEATS)})
        elif msg["cmd"] == "raw_id":
            C.send(conn, {"uid": nccl.get_unique_id().hex()})
        elif msg["cmd"] == "raw":
            C.send(conn, {"times": raw(bytes.fromhex(msg["uid"]), 0, nbytes, REPEATS, dev)})
        elif msg["cmd"] == "end":
            return


def free_port():
    import socket
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def main():
    daemon_bin, worker_bin = C.binaries(sys.argv)
    here = os.path.dirname(os.path.abspath(__file__))
    out_path = sys.argv[3] if len(sys.argv) > 3 else os.path.join(here, "results",
                                                                  "python_nccl.json")
    daemon = C.Daemon(daemon_bin, worker_bin, gpu=1, extra=[
        "--gpu_staging_buffers=4", f"--gpu_staging_budget_bytes={8 << 30}",
        f"--max_chunk_bytes={1 << 30}"])
    engine = trainer = None
    ok = True
    try:
        engine = C.Worker(engine_main, daemon.target)
        trainer = C.Worker(trainer_main, daemon.target)
        e = engine.recv(900, "the engine's registration")
        t = trainer.recv(900, "the trainer's tensors")
        nbytes = t["bytes"]
        print(f"engine registered {t['tensors']} tensors ({nbytes / 1e9:.2f} GB) in "
              f"{e['register_s']:.2f} s", flush=True)

        trainer.send({"cmd": "weightsync"})
        w = trainer.recv(1800, "the weightsync updates")
        engine.send({"cmd": "sums"})
        es = engine.recv(600, "the engine's checksums")["sums"]
        same = es == w["sums"]
        print(f"{'PASS' if same else 'FAIL'} engine tensors equal the trainer's after the "
              "updates (per-tensor int16 sums)", flush=True)
        ok &= same
        sweep = []
        for key, rows in w["runs"].items():
            tail = rows[1:]   # updates 2-6
            mib, _, mode = key.partition("-")
            row = {"chunk_MiB": int(mib), "receipts": mode or "off",
                   "weightsync_s": statistics.median(r["start_to_finish_s"] for r in tail),
                   "daemon_s": statistics.median(r["daemon_s"] for r in tail),
                   "total_s": statistics.median(r["total_s"] for r in tail),
                   "prepare_s": statistics.median(r["prepare_s"] for r in tail),
                   "enqueue_s": statistics.median(r["enqueue_s"] for r in tail),
                   "all_start_to_finish_s": [round(r["start_to_finish_s"], 5) for r in rows]}
            for k in ("early_receipts_s", "receipts_s"):
                if all(k in r for r in tail):
                    row[k] = statistics.median(r[k] for r in tail)
            row["weightsync_GBps"] = nbytes / row["weightsync_s"] / 1e9
            sweep.append(row)
            print(f"weightsync chunk {mib} MiB, receipts {row['receipts']}: "
                  f"{row['weightsync_s']:.4f} s Start->Finish "
                  f"({row['weightsync_GBps']:.1f} GB/s), daemon {row['daemon_s']:.4f} s, "
                  f"with manifest/views {row['total_s']:.4f} s", flush=True)

        port = free_port()
        trainer.send({"cmd": "naive", "port": port})
        engine.send({"cmd": "naive", "port": port})
        nt = trainer.recv(1800, "naive (trainer)")["times"]
        ne = engine.recv(1800, "naive (engine)")["times"]
        naive_s = statistics.median(max(a, b) for a, b in zip(nt, ne))
        print(f"naive per-parameter broadcast + copy_: {naive_s:.4f} s", flush=True)

        trainer.send({"cmd": "raw_id"})
        uid = trainer.recv(60, "the raw NCCL id")["uid"]
        trainer.send({"cmd": "raw", "uid": uid})
        engine.send({"cmd": "raw", "uid": uid, "bytes": nbytes})
        rt = trainer.recv(900, "raw (trainer)")["times"]
        re_ = engine.recv(900, "raw (engine)")["times"]
        raw_s = statistics.median(max(a, b) for a, b in zip(rt, re_))
        baseline = nbytes / raw_s / 1e9
        print(f"raw NCCL 1 GiB broadcasts: {raw_s:.4f} s ({baseline:.1f} GB/s)", flush=True)

        best = min((r for r in sweep if r["receipts"] == "off"), key=lambda r: r["weightsync_s"])
        commit = os.environ.get("COMMIT") or subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
            cwd=here).stdout.strip() or "unknown"
        report = {"date": datetime.date.today().isoformat(),
                  "kind": os.environ.get("KIND", "nvidia-h200-x2"), "commit": commit,
                  "model": MODEL, "bytes": nbytes, "tensors": t["tensors"],
                  "client": "python", "baseline_GBps": round(baseline, 2), "raw_1g_s": raw_s,
                  "naive_s": naive_s, "weightsync_s": best["weightsync_s"],
                  "weightsync_GBps": best["weightsync_GBps"],
                  "ratio": best["weightsync_GBps"] / baseline,
                  "weightsync_daemon_s": best["daemon_s"],
                  "weightsync_with_prepare_s": best["total_s"],
                  "best": {"chunk_MiB": best["chunk_MiB"], "staging_buffers": 4},
                  "register_s": e["register_s"], "sweep": sweep,
                  "weightsync_s_definition": "median of updates 2-6, client clock from the "
                  "StartWeightUpdate call to Finish answered and the trainer's broadcasts done"}
        # The C++ benchmark of the same manifest: from the same run when
        # CPP_RESULTS names its gpu_nccl.json, else the committed one.
        cpp_path = os.environ.get("CPP_RESULTS") or os.path.join(here, "results",
                                                                "gpu_nccl.json")
        try:
            cpp = json.load(open(cpp_path))
            entry = next((m for m in cpp.get("models", []) if m.get("model") == MODEL), cpp)
            if entry.get("model") == MODEL:
                report["cpp_weightsync_s"] = entry["weightsync_s"]
                report["cpp_commit"] = entry.get("commit", cpp.get("commit"))
                report["cpp_same_run"] = bool(os.environ.get("CPP_RESULTS"))
                report["python_vs_cpp"] = entry["weightsync_s"] / best["weightsync_s"]
        except (OSError, ValueError, KeyError, StopIteration):
            pass
        os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
        with open(out_path, "w") as f:
            json.dump(report, f, indent=2)
        print(json.dumps({k: v for k, v in report.items() if k != "sweep"}, indent=1))
        print(f"wrote {out_path}")
        for w_ in (engine, trainer):
            w_.send({"cmd": "end"})
    except Exception as ex:
        print(f"FAIL {type(ex).__name__}: {ex}", flush=True)
        ok = False
    finally:
        for w_ in (engine, trainer):
            if w_ is not None:
                w_.proc.join(10)
                w_.stop()
        daemon.stop()
    print("python_bench:", "PASS" if ok else "FAIL", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""GPU proof of the registered source (issue "Python users get the full
speed"), on ONE GPU: a transformers model (small Qwen3/Llama-style config,
random init) in a trainer process and an engine process on GPU 0, the
daemon's IPC data plane on GPU 0.

    python3 tests/gpu/test_registered_source.py WEIGHTSYNCD WEIGHTSYNC_GPU_WORKER

Checks, each a PASS/FAIL line:
  * versions 1-3 through Trainer.init_ipc(tensors=the model) + update() with the defaults
    (registered source, receipts on), a training step between them: every
    engine parameter bitwise equal to the trainer's, greedy generation equal;
  * the source is registered once, in init_ipc (the same source id for
    versions 1-3);
  * a re-allocated trainer parameter (p.data = p.data.clone(): a new data
    pointer) is registered again before the update (new source id) and the
    engine is still bit-exact;
  * an fp32 trainer into the bf16 engine: the engine holds the trainer's
    tensors rounded to bf16 (round to nearest even), receipts match;
  * a sparse patch (weightsync.sparse.diff of two versions) applies, bit-exact;
  * receipts catch a difference: an expectation computed from a tensor with
    one flipped bit raises DATA_LOSS naming the engine, and an engine byte
    corrupted after an update makes CheckEngine's receipt differ from the
    update's.
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                "examples"))
import _common as C  # noqa: E402

GPU = 0
PROMPT = [1, 17, 33, 101, 7]
TOKENS = 12


def engine_main(conn, target):
    import torch
    import weightsync
    C.deterministic()
    dev = torch.device("cuda", GPU)
    torch.cuda.set_device(dev)
    cfg = C.small_config()
    model = C.build_model(cfg, seed=1234, device=dev)   # other weights than the trainer's
    engine = weightsync.Engine("engine-0", target, timeout=60)
    engine.register_torch(model)
    engine.start()
    C.send(conn, {"ready": True})
    while True:
        cmd = C.recv(conn, 900, "a command")
        if cmd["op"] == "state":
            torch.cuda.synchronize(dev)
            C.send(conn, {"version": engine.version,
                          "digests": C.digests(model.named_parameters()),
                          "zeros": [n for n, p in model.named_parameters() if not p.any()],
                          "greedy": C.greedy(model, PROMPT, TOKENS)})
        elif cmd["op"] == "zero":
            with torch.no_grad():
                dict(model.named_parameters())[cmd["name"]].zero_()
            torch.cuda.synchronize(dev)
            C.send(conn, {"done": True})
        elif cmd["op"] == "corrupt":
            p = dict(model.named_parameters())[cmd["name"]]
            with torch.no_grad():
                p.view(-1).view(torch.int16)[0] ^= 1 << 3
            torch.cuda.synchronize(dev)
            C.send(conn, {"done": True})
        else:
            C.send(conn, {"bye": True})
            return


def trainer_main(conn, target):
    import torch
    import weightsync
    from weightsync import receipts, sparse
    C.deterministic()
    dev = torch.device("cuda", GPU)
    torch.cuda.set_device(dev)
    cfg = C.small_config()
    model = C.build_model(cfg, seed=1, device=dev)
    trainer = weightsync.Trainer(target, timeout=120)
    # Warm start: the model registered (and its receipt tables built) in init.
    trainer.init_ipc(device=GPU, tensors=model.named_parameters())
    prepared = (trainer.prepared, trainer._gpu.source and trainer._gpu.source.source_id)

    def report(tag, r, extra=None):
        out = {"tag": tag, "committed": r.version, "source": trainer._gpu.source and
               trainer._gpu.source.source_id, "timings": trainer.last_timings,
               "prepared": prepared,
               "receipts": sum(1 for e in r.engines if e.HasField("receipt")),
               "digests": C.digests(model.named_parameters()),
               "greedy": C.greedy(model, PROMPT, TOKENS)}
        out.update(extra or {})
        C.send(conn, out)
        C.recv(conn, 300, "go on")

    for version in (1, 2, 3):
        if version > 1:
            C.train_step(model, cfg, seed=version)
        r = trainer.update(model.named_parameters(), version=version)
        report(f"v{version}", r)
    # A re-allocated parameter: same values, new memory.
    name = "model.layers.0.mlp.down_proj.weight"
    p = dict(model.named_parameters())[name]
    old_ptr = p.data_ptr()
    from weightsync._gpu import ipc_location
    before_loc = ipc_location(name, p.detach())
    p.data = p.data.clone()
    C.train_step(model, cfg, seed=4)
    after_loc = ipc_location(name, p.detach())
    print(f"moved {name}: handle {before_loc[0].hex()} offset {before_loc[2]} -> "
          f"handle {after_loc[0].hex()} offset {after_loc[2]}", flush=True)
    C.send(conn, {"tag": "zero-engine", "name": name})
    C.recv(conn, 300, "engine zeroed")
    try:
        r = trainer.update(model.named_parameters(), version=4)
        err = None
    except weightsync.WeightSyncError as e:   # report, then let the digests say what
        err = [e.code, e.message]
        r = trainer.last_results[0]
    report("v4 re-allocated", r, {"moved": p.data_ptr() != old_ptr, "update_error": err})
    # fp32 trainer into the bf16 engine.
    model32 = {n: (t.detach().float() + 1e-3 * torch.randn_like(t.detach().float()))
               for n, t in model.named_parameters()}
    r = trainer.update(list(model32.items()), version=5)
    with torch.no_grad():
        for n, t in model.named_parameters():
            t.copy_(model32[n].to(torch.bfloat16))   # what the engine must hold now
    report("v5 fp32->bf16", r)
    # A sparse patch against v5.
    before = {n: t.detach().clone() for n, t in model.named_parameters()}
    with torch.no_grad():
        for i, (n, t) in enumerate(model.named_parameters()):
            flat = t.view(-1)
            flat[i % flat.numel()] += 1.0
    items = []
    for n, t in model.named_parameters():
        patch = sparse.diff(before[n], t.detach(), max_density=0.1)
        items.append((n, t.detach() if patch is None else patch))
    r = trainer.update(items, version=6, base_version=5)
    report("v6 sparse", r, {"patches": sum(1 for _, x in items
                                           if isinstance(x, sparse.SparsePatch))})
    r = trainer.update(model.named_parameters(), version=7)
    # Receipts catch a difference: an expectation from one flipped bit,
    # against the receipt of this dense update.
    named = {n: t.detach() for n, t in model.named_parameters()}
    bad = {n: ("BFLOAT16", list(t.shape), t.reshape(-1)) for n, t in named.items()}
    flipped = bad[name][2].clone()
    flipped.view(torch.int16)[0] ^= 1 << 9
    bad[name] = (bad[name][0], bad[name][1], flipped)
    try:
        trainer._link.check_receipts([r], lambda layout: receipts.expected_receipt_arrays(
            layout, bad))
        flipped_error = None
    except weightsync.WeightSyncError as e:
        flipped_error = [e.code, e.message]
    before_check = trainer.check("engine-0").receipt.checksum
    C.send(conn, {"tag": "corrupt", "flipped_error": flipped_error,
                  "update_receipt": r.engines[0].receipt.checksum,
                  "check_before": before_check})
    C.recv(conn, 300, "engine corrupted")
    after_check = trainer.check("engine-0").receipt.checksum
    C.send(conn, {"check_after": after_check})
    C.recv(conn, 60, "the end")


def main():
    daemon_bin, worker_bin = C.binaries(sys.argv)
    check = C.Checks()
    d = C.Daemon(daemon_bin, worker_bin, gpu=GPU)
    engine = trainer = None
    try:
        engine = C.Worker(engine_main, d.target)
        engine.recv(300, "the engine's registration")
        trainer = C.Worker(trainer_main, d.target)
        sources, last_digests = [], None
        for _ in range(6):
            t = trainer.recv(900, "an update")
            if t.get("tag") == "zero-engine":
                engine.send({"op": "zero", "name": t["name"]})
                engine.recv(60, "zeroed")
                trainer.send({"go": True})
                t = trainer.recv(900, "an update")
            engine.send({"op": "state"})
            e = engine.recv(300, "the engine's state")
            tag = t["tag"]
            bad, missing = C.compare_digests(e["digests"], t["digests"])
            check(t["committed"] == e["version"], f"{tag}: engine at version {t['committed']}")
            check(not bad and not missing,
                  f"{tag}: every engine parameter bitwise equal to the trainer's "
                  f"({len(bad)} differ, e.g. {bad[:3]})")
            if bad:
                print(f"  {tag}: all-zero engine parameters among those: "
                      f"{[n for n in bad if n in e['zeros']]}", flush=True)
            if bad and last_digests:
                stale = [n for n in bad if e["digests"].get(n) == last_digests.get(n)]
                print(f"  {tag}: of the {len(bad)} that differ, {len(stale)} hold the previous "
                      f"version's bytes: {stale[:3]}", flush=True)
            last_digests = t["digests"]
            check(e["greedy"] == t["greedy"], f"{tag}: greedy generation equal")
            check(t["receipts"] == 1, f"{tag}: receipts checked (the default)")
            print(f"  {tag}: timings {t['timings']}", flush=True)
            sources.append(t["source"])
            if tag == "v1":
                ok, pid = t["prepared"]
                check(ok and pid is not None and t["source"] == pid,
                      f"v1 updates from the source init_ipc(tensors=...) registered ({pid})")
            if tag == "v3":
                check(sources[0] == sources[1] == sources[2] and sources[1] is not None,
                      f"versions 1-3 reuse one registered source ({sources[1]})")
            if tag.startswith("v4"):
                check(t["update_error"] is None, f"v4: update after a re-allocation ({t['update_error']})")
                check(t["moved"] and t["source"] != sources[2],
                      f"a moved parameter is registered again ({sources[2]} -> {t['source']})")
            if tag.startswith("v6"):
                check(t["patches"] > 0, f"v6 sent {t['patches']} sparse patches")
            trainer.send({"go": True})
        t = trainer.recv(300, "the receipt checks")
        check(t["flipped_error"] is not None and t["flipped_error"][0] == "DATA_LOSS"
              and "engine-0" in t["flipped_error"][1]
              and "over 0 bytes" not in t["flipped_error"][1],
              f"an expectation from one flipped bit: DATA_LOSS naming the engine "
              f"({t['flipped_error']})")
        check(t["check_before"] == t["update_receipt"],
              "CheckEngine after the update gives the update's receipt")
        receipt = t["update_receipt"]
        engine.send({"op": "corrupt", "name": "model.layers.1.self_attn.q_proj.weight"})
        engine.recv(60, "the corruption")
        trainer.send({"go": True})
        t = trainer.recv(300, "the check after corruption")
        check(t["check_after"] != receipt,
              "one flipped engine bit: CheckEngine's receipt no longer matches the update's")
    finally:
        for w in (trainer, engine):
            if w is not None:
                try:
                    w.send({"op": "end"})
                except Exception:
                    pass
                w.stop()
        d.stop()
    return check.finish("test_registered_source")


if __name__ == "__main__":
    sys.exit(main())

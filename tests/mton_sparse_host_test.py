#!/usr/bin/env python3
"""Issue 32: sparse patches through a transfer plan on the host backend
(docs/transfer_plan.md, "Sparse patches").

    WEIGHTSYNCD=bazel-bin/daemon/weightsyncd python3 tests/mton_sparse_host_test.py

tests/mton_host_test.py's world (daemon 0: a TP=2 model instance, daemon
1: a TP=1 replica, float32 engines of a Qwen3-shaped model) and two
trainer ranks, threads of this process, each with its own Trainer, holding
FSDP row shards (Shard(0)) and keeping what they sent (basis_bytes). v1
goes dense; v2 and v3 change 0.3% of the elements (a few tensors not at
all, one wholly): every rank sends each piece that changed little as a
patch against the version before (the wire carries a few percent of the
dense bytes), the rest dense; receipts on, each engine bit for bit the
checkpoint. Then a Start that names patches against a version the
engines do not hold, a piece the plan does not have, or an nnz of 0 is
refused before anything pauses, every engine still READY at v3.
"""

import os
import sys
import threading

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "client", "python"))
sys.path.insert(0, HERE)

import numpy as np  # noqa: E402

import weightsync  # noqa: E402
from weightsync import transfer_plan  # noqa: E402
from weightsync._proto import v1  # noqa: E402
from weightsync.senders.many import ManySenders  # noqa: E402
from mton_fp8_host_test import ThreadCollective, run_ranks  # noqa: E402
from mton_host_test import World, _manifest  # noqa: E402
from multi_daemon_test import DENSE, weights  # noqa: E402

RANKS = 2


def versions():
    """{version: {name: float32 array}}: v1 the world's checkpoint, then
    0.3% of the elements changed per version (embed_tokens not at all,
    the first norm wholly)."""
    rng = np.random.default_rng(3)
    out = {1: dict(weights(DENSE, 1))}
    for v in (2, 3):
        ck = {n: a.copy() for n, a in out[v - 1].items()}
        for name, a in ck.items():
            flat = a.reshape(-1)
            if "embed_tokens" in name:
                continue
            if name.endswith("layers.0.input_layernorm.weight"):
                flat += 1
                continue
            at = rng.choice(flat.size, max(1, flat.size * 3 // 1000), replace=False)
            flat[at] = rng.standard_normal(at.size).astype(np.float32)
        out[v] = ck
    return out


def local_of(rank, ck):
    local = []
    for name, a in ck.items():
        b = transfer_plan.shard(name, a.shape, 0, rank, RANKS)
        if b is not None:
            rows = a.reshape(a.shape[0], -1)
            local.append((b, rows[b["row_begin"]:b["row_begin"] + b["row_count"]]))
    return local


def main():
    w = World()
    try:
        cks = versions()
        room = {"n": RANKS, "slots": [None] * RANKS, "barrier": threading.Barrier(RANKS, timeout=60)}
        out = [[] for _ in range(RANKS)]
        done, errors = threading.Event(), []

        def rank_main(r):
            trainer = weightsync.Trainer(w.targets, timeout=20)
            try:
                if r == 0:
                    trainer.init_host()
                senders = ManySenders(trainer._link, ThreadCollective(room, r), basis_bytes=None)
                for v in (1, 2, 3):
                    base = None if v == 1 else v - 1
                    try:
                        senders.update(_manifest(), local_of(r, cks[v]), v, chunk_bytes=8 << 10,
                                       update_id=f"s{v}", base_version=base, max_density=0.05)
                        out[r].append((v, senders.last_wire, sorted(senders.last_checked)))
                    except Exception as e:  # asserted below
                        out[r].append((v, e, None))
                if r == 0:   # while its group stands, once rank 1 is done
                    done.wait(60)
                    try:
                        refusals(w, trainer, senders.last_plan.id, cks)
                    except BaseException as e:  # raised in main
                        errors.append(e)
            finally:
                if r != 0:
                    done.set()
                trainer.close()
        run_ranks(RANKS, rank_main)
        for r in range(RANKS):
            for v, wire, checked in out[r]:
                assert isinstance(wire, dict), f"rank {r} v{v}: {wire!r}"
                if r == 0:
                    assert checked == sorted(w.layout), f"v{v}: receipts of {checked}"
        for v in (1, 2, 3):
            dense = sum(out[r][v - 1][1]["dense_bytes"] for r in range(RANKS))
            sent = sum(out[r][v - 1][1]["wire_bytes"] for r in range(RANKS))
            patched = sum(out[r][v - 1][1]["patched_pieces"] for r in range(RANKS))
            # Receipts of patched links summed from the elements that changed.
            deltas = sum(out[r][v - 1][1]["receipts_from_deltas"] for r in range(RANKS))
            if v == 1:
                assert (sent, patched, deltas) == (dense, 0, 0), (v, sent, dense, patched)
            else:
                assert patched > 0 and sent < dense * 0.2, (v, sent, dense, patched)
                assert deltas == RANKS * len(w.targets), (v, deltas)
            print(f"v{v}: {patched} pieces patched, {sent} of {dense} dense bytes on the wire "
                  f"({sent / dense:.3f})", flush=True)
        if errors:
            raise errors[0]
    except BaseException:
        w.dump_logs()
        raise
    finally:
        w.close()
    print("PASS")


def refusals(w, trainer, plan_id, cks):
    """Starts the trainer side never sends, each refused before a pause."""
    w.expect_version(3, "after v3", cks[3])
    stub = trainer._stubs[0]
    good = v1.PlanSparsePiece(sender=0, receiver=0, piece=0, nnz=1, index_bytes=4)
    cases = [("against v2", 2, [good], "FAILED_PRECONDITION", "holds sparse patches against"),
             ("no such piece", 3, [v1.PlanSparsePiece(sender=0, receiver=0, piece=10 ** 6,
                                                      nnz=1)],
              "INVALID_ARGUMENT", "names no piece of the plan"),
             ("nnz 0", 3, [v1.PlanSparsePiece(sender=1, receiver=0, piece=0, nnz=0)],
              "INVALID_ARGUMENT", "has nnz 0"),
             ("twice", 3, [good, good], "INVALID_ARGUMENT", "is named twice"),
             ("no such receiver", 3, [v1.PlanSparsePiece(sender=0, receiver=7, piece=0,
                                                         nnz=1)],
              "INVALID_ARGUMENT", "names receiver 7")]
    for why, base, entries, code, words in cases:
        try:
            stub.call("StartWeightUpdate", update_id=f"bad-{why}", target_version=9,
                      transfer_plan_id=plan_id, sparse_base_version=base,
                      plan_sparse=entries)
        except weightsync.WeightSyncError as e:
            assert e.code == code and words in e.message, f"{why}: {e.code} {e.message}"
            print(f"{why}: refused {e.code} ({e.message[:110]}...)", flush=True)
        else:
            raise AssertionError(f"{why}: the Start was accepted")
        w.expect_version(3, f"after the refused Start ({why})", cks[3])


if __name__ == "__main__":
    main()

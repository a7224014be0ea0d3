#!/usr/bin/env python3
"""Issue 32 on the host backend: M = 2 trainer processes -> N = 2 daemons
on one transfer plan (weightsync.senders.many, docs/transfer_plan.md).

    WEIGHTSYNCD=bazel-bin/daemon/weightsyncd python3 tests/mton_host_test.py

Daemon 0 holds one TP=2 model instance (two engines), daemon 1 a TP=1
replica (float32 engines of a Qwen3-shaped model). The trainer ranks hold:
(a) FSDP row shards (Shard(0)) of every tensor; (b) the layers split
between them; (c) two data-parallel replicas of everything. Each case runs
three versions in one job; every engine's memory is then compared bit for
bit with a numpy placement of the last version, every version's receipts
with the checkpoint's, each rank must have made the same plan (same
id, which the daemons' plans match too), both ranks send, the leader
checked every engine's receipt against the sum of the ranks' partial
receipts, and the receipts match the ones computed from the checkpoint.
Then faults on (a): rank 1 killed mid-stream (SIGKILL after two chunks to
daemon 0): the update fails on both daemons, no engine serves a version
its memory does not hold, and the next update (the job restarted)
repairs every engine. Bad declarations (overlapping shards, a byte no
rank holds) are refused on every rank before any engine pauses.
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
CLIENT = os.path.join(HERE, "..", "client", "python")
sys.path.insert(0, CLIENT)
sys.path.insert(0, HERE)

import numpy as np  # noqa: E402

import weightsync  # noqa: E402
from weightsync._proto import v1  # noqa: E402
from weightsync.integrations._common import tp_layout  # noqa: E402
from multi_daemon_test import DENSE, ENGINES, expected, weights  # noqa: E402

CHUNK = 8 << 10
RANKS = 2

# One trainer rank: a Trainer of both daemons, a file collective, and one
# update per version named on the command line.
RANK = r"""
import json, os, signal, sys, time
sys.path.insert(0, {client!r})
sys.path.insert(0, {here!r})
import numpy as np
import weightsync
from weightsync import transfer_plan
from weightsync.senders import many as many_senders
from mton_host_test import FileCollective, holdings
targets, coll_dir, rank, case, versions, die = (json.loads(sys.argv[1]), sys.argv[2],
    int(sys.argv[3]), sys.argv[4], json.loads(sys.argv[5]), sys.argv[6])
coll = FileCollective(coll_dir, rank, {ranks}, timeout=4.0)
trainer = weightsync.Trainer(targets, timeout=20)
if rank == 0:
    trainer.init_host()
senders = many_senders.ManySenders(trainer._link, coll)
for version in versions:
    manifest, local = holdings(case, rank, version)
    if die == "mid" and version == versions[-1]:
        seen = [0]
        def hook(daemon, index):
            if daemon == 0:
                seen[0] += 1
                if seen[0] == 3:
                    os.kill(os.getpid(), signal.SIGKILL)
        senders._on_chunk = hook
    try:
        committed = senders.update(manifest, local, version, chunk_bytes={chunk},
                                   update_id="u%d-%s" % (version, case))
        out = {{"version": version, "ok": True, "plan": senders.last_plan.id,
               "checked": sorted(senders.last_checked),
               "sent": senders.last_plan.sender_bytes[rank],
               "timings": senders.last_timings,
               "receipts": {{e.engine_id: [str(e.receipt.checksum), e.receipt.parameters]
                             for c in committed for e in c.engines}}}}
    except Exception as e:
        plan = senders.last_plan.id if senders.last_plan else None
        out = {{"version": version, "ok": False, "error": str(e)[:2000], "plan": plan}}
    print(json.dumps(out), flush=True)
trainer.close()
"""


class FileCollective:
    """Ranks that agree through files in one folder (tests; the job uses
    torch.distributed): every call is a numbered round."""

    def __init__(self, folder, rank, world_size, timeout=10.0):
        self.folder, self.rank, self.world_size = folder, rank, world_size
        self.timeout, self.round = timeout, 0
        os.makedirs(folder, exist_ok=True)

    def _write(self, name, obj):
        tmp = os.path.join(self.folder, f".{name}.tmp{self.rank}")
        with open(tmp, "w") as f:
            json.dump(obj, f)
        os.rename(tmp, os.path.join(self.folder, name))

    def _read(self, name):
        path, end = os.path.join(self.folder, name), time.time() + self.timeout
        while not os.path.exists(path):
            if time.time() > end:
                raise TimeoutError(f"rank {self.rank}: no {name} within {self.timeout} s")
            time.sleep(0.005)
        with open(path) as f:
            return json.load(f)

    def all_gather(self, obj):
        self.round += 1
        self._write(f"g{self.round}.{self.rank}", obj)
        return [self._read(f"g{self.round}.{r}") for r in range(self.world_size)]

    def broadcast(self, obj, src=0):
        self.round += 1
        if self.rank == src:
            self._write(f"b{self.round}", obj)
            return obj
        return self._read(f"b{self.round}")


def _manifest():
    return [{"name": n, "dtype": "FLOAT32", "shape": list(a.shape)}
            for n, a in weights(DENSE, 1)]


def holdings(case, rank, version):
    """(manifest, [(block, array)]) of trainer rank `rank` in `case`."""
    from weightsync import transfer_plan
    ckpt = weights(DENSE, version)
    manifest = _manifest()
    local = []
    for i, (name, a) in enumerate(ckpt):
        rows = a.reshape(a.shape[0], -1)
        if case in ("a", "kill"):
            b = transfer_plan.shard(name, a.shape, 0, rank, RANKS)
            if b is not None:
                local.append((b, rows[b["row_begin"]:b["row_begin"] + b["row_count"]]))
        elif case == "b":
            layer = int(name.split(".")[2]) if name.startswith("model.layers.") else -1
            owner = layer % RANKS if layer >= 0 else (0 if "embed" in name else 1)
            if owner == rank:
                local.append((transfer_plan.whole(name, a.shape), a))
        elif case == "c":
            local.append((transfer_plan.whole(name, a.shape), a))
        elif case == "overlap":   # rank 0 holds one row too many of the first tensor
            b = transfer_plan.shard(name, a.shape, 0, rank, RANKS)
            if i == 0 and rank == 0:
                b = dict(b, row_count=b["row_count"] + 1)
            local.append((b, rows[b["row_begin"]:b["row_begin"] + b["row_count"]]))
        elif case == "hole":      # rank 1 leaves out its shard of the last tensor
            b = transfer_plan.shard(name, a.shape, 0, rank, RANKS)
            if not (rank == 1 and i == len(ckpt) - 1):
                local.append((b, rows[b["row_begin"]:b["row_begin"] + b["row_count"]]))
    return manifest, local


class World:
    def __init__(self):
        self.work = tempfile.mkdtemp(prefix="ws-mton.", dir="/tmp")
        self.daemons, self.engines, self.shm, self.layout = [], [], {}, {}
        self.jobs = 0
        for k in range(2):
            sock = f"{self.work}/d{k}.sock"
            self.daemons.append(subprocess.Popen(
                [os.environ["WEIGHTSYNCD"], f"--socket={sock}", "--update_idle_timeout_ms=3000",
                 "--notice_timeout_ms=2000", "--finish_timeout_ms=10000"],
                stderr=open(f"{self.work}/d{k}.log", "a")))
            for _ in range(300):
                if os.path.exists(sock):
                    break
                time.sleep(0.02)
        self.targets = [f"unix:{self.work}/d{k}.sock" for k in range(2)]
        specs = [[(f"tp2.{r}",) + tuple(tp_layout(DENSE, r, 2, dtype="FLOAT32"))
                  for r in range(2)],
                 [("tp1",) + tuple(tp_layout(DENSE, 0, 1, dtype="FLOAT32"))]]
        for k, spec in enumerate(specs):
            for eid, params, segments in spec:
                self.layout[eid] = (params, segments)
            path = f"{self.work}/engines{k}.json"
            with open(path, "w") as f:
                json.dump(spec, f)
            self.engines.append(subprocess.Popen(
                [sys.executable, "-c", ENGINES.format(client=CLIENT), self.targets[k], path,
                 self.work], stdout=subprocess.PIPE, stderr=open(f"{self.work}/e{k}.log", "a"),
                text=True))
        for p in self.engines:
            line = p.stdout.readline()
            assert line.startswith("ready"), line
            self.shm.update(json.loads(line.split(" ", 1)[1]))
        self.trainer = weightsync.Trainer(self.targets, timeout=20)

    def close(self):
        self.trainer.close()
        for p in self.engines + self.daemons:
            p.terminate()
        for p in self.engines + self.daemons:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for name in self.shm.values():
            try:
                os.unlink("/dev/shm/" + name)
            except FileNotFoundError:
                pass
        shutil.rmtree(self.work, ignore_errors=True)

    def job(self, case, versions, die=""):
        """Runs one job of RANKS rank processes; returns {rank: [outcome per version]}."""
        self.jobs += 1
        coll = f"{self.work}/coll{self.jobs}"
        procs = [subprocess.Popen(
            [sys.executable, "-c", RANK.format(client=CLIENT, here=HERE, ranks=RANKS,
                                               chunk=CHUNK),
             json.dumps(self.targets), coll, str(r), case, json.dumps(versions),
             die if r == 1 else ""],
            stdout=subprocess.PIPE, stderr=open(f"{self.work}/rank{r}.log", "a"), text=True)
            for r in range(RANKS)]
        out = {}
        for r, p in enumerate(procs):
            text, _ = p.communicate(timeout=120)
            out[r] = [json.loads(line) for line in text.splitlines() if line.startswith("{")]
        return out

    def states(self):
        out = {}
        for st in self.trainer.statuses():
            for e in st.engines:
                out[e.engine_id] = (e.state, e.version)
        return out

    def memory_is(self, eid, ckpt):
        params, segments = self.layout[eid]
        got = np.fromfile("/dev/shm/" + self.shm[eid], np.float32)
        want = expected(params, segments, ckpt)
        return np.array_equal(got[:want.size].view(np.uint32), want.view(np.uint32))

    def expect_version(self, version, why, ckpt=None):
        """Every engine READY at `version`, its memory `ckpt` (default the
        world's checkpoint of that version)."""
        ckpt = dict(weights(DENSE, version)) if ckpt is None else ckpt
        st = self.states()
        for eid in self.layout:
            assert st[eid] == (v1.ENGINE_READY, version), f"{why}: {eid} is {st[eid]}"
            assert self.memory_is(eid, ckpt), f"{why}: {eid} memory is not v{version}"

    def expect_receipts(self, receipts, version, why):
        from weightsync.receipts import expected_receipt
        sent = {n: ("FLOAT32", a.shape, a.reshape(-1).view(np.uint8))
                for n, a in weights(DENSE, version)}
        layouts = self._layouts()
        for eid, (checksum, params) in receipts.items():
            want = expected_receipt(layouts[eid], sent)
            assert (int(checksum), params) == (want[0], want[1]), \
                f"{why}: {eid} receipt {checksum} != {want}"

    def _layouts(self):
        out = {}
        for stub in self.trainer._stubs:
            for e in stub.call("GetStatus", include_layouts=True).engines:
                out[e.engine_id] = e.layout
        return out

    def dump_logs(self):
        """The tail of every process's log, to stderr (a failed run)."""
        for name in sorted(os.listdir(self.work)):
            if name.endswith(".log"):
                print(f"--- {name}", file=sys.stderr)
                with open(os.path.join(self.work, name)) as f:
                    sys.stderr.write(f.read()[-3000:])

    def no_mixture(self, why):
        """No engine serves (READY) a version its memory does not hold."""
        st = self.states()
        for eid, (state, version) in st.items():
            if state == v1.ENGINE_READY and version > 0:
                assert self.memory_is(eid, dict(weights(DENSE, version))), \
                    f"{why}: {eid} READY at v{version} but its memory differs"
        return st


def main():
    w = World()
    t0 = time.time()
    try:
        base = 0
        for case in ("a", "b", "c"):
            versions = [base + 1, base + 2, base + 3]
            out = w.job(case, versions)
            for k, version in enumerate(versions):
                got = [out[r][k] for r in range(RANKS)]
                assert all(g["ok"] for g in got), f"case {case} v{version}: {got}"
                assert got[0]["plan"] == got[1]["plan"], f"case {case}: plans differ {got}"
                assert all(g["sent"] > 0 for g in got), f"case {case}: a rank sent nothing"
                # Where an update's time went, per rank (the leader also
                # times its calls to the daemons): every phase, none negative.
                phases = {"plan_start_s", "push_s", "gather_s", "finish_s"}
                for r, g in enumerate(got):
                    want = phases | ({"start_s", "prepare_s", "commit_s"} if r == 0 else set())
                    assert set(g["timings"]) == want and min(g["timings"].values()) >= 0, \
                        f"case {case}: rank {r} timed {g['timings']}"
                assert got[0]["checked"] == sorted(w.layout), \
                    f"case {case}: the leader checked the receipts of {got[0]['checked']}"
                w.expect_receipts(got[0]["receipts"], version, f"case {case} v{version}")
            w.expect_version(versions[-1], f"case {case} v{versions[-1]}")
            print(f"case {case}: 3 versions bit-exact, receipts match, plan "
                  f"{got[0]['plan']}, bytes per rank {[g['sent'] for g in got]}", flush=True)
            base += 3
        # Bad declarations: refused on every rank, nothing paused or written.
        for case, words in (("overlap", "overlaps the block"), ("hole", "held by no sender")):
            out = w.job(case, [base + 1])
            for r in range(RANKS):
                assert not out[r][0]["ok"] and words in out[r][0]["error"], out[r]
            w.expect_version(base, f"after refused {case}")
            print(f"{case}: refused on every rank ({out[0][0]['error'][:120]}...)", flush=True)
        # A sender killed mid-stream: the update fails on both daemons.
        out = w.job("kill", [base + 1, base + 2], die="mid")
        assert out[0][0]["ok"] and out[1][0]["ok"], out
        assert not out[0][1]["ok"], f"the leader did not see the failure: {out[0]}"
        assert len(out[1]) == 1, f"rank 1 was not killed: {out[1]}"
        deadline = time.time() + 10
        while time.time() < deadline:
            st = w.no_mixture("after the kill")
            if all(s in (v1.ENGINE_DIRTY, v1.ENGINE_READY) for s, _ in st.values()) and \
                    all(u.update.phase != "receiving" for u in w.trainer.statuses()):
                break
            time.sleep(0.1)
        st = w.no_mixture("after the kill")
        dirty = [e for e, (s, _) in st.items() if s == v1.ENGINE_DIRTY]
        assert all(v <= base + 1 for _, v in st.values()), st
        print(f"rank 1 killed mid-stream: update failed everywhere ({out[0][1]['error'][:160]}"
              f"...); DIRTY: {dirty}", flush=True)
        out = w.job("kill", [base + 3])
        assert out[0][0]["ok"] and out[1][0]["ok"], out
        w.expect_version(base + 3, "repair after the kill")
        print(f"next job repaired every engine at v{base + 3}; {time.time() - t0:.1f} s",
              flush=True)
    except BaseException:
        w.dump_logs()
        raise
    finally:
        w.close()
    print("PASS")


if __name__ == "__main__":
    main()

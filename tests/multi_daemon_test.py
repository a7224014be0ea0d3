#!/usr/bin/env python3
"""Issue 20's proof on the host backend: three weightsyncd processes, each
with its own engine process (two engines each), and one trainer
(weightsync.Trainer of the three sockets) updating them as one.

    WEIGHTSYNCD=bazel-bin/daemon/weightsyncd python3 tests/multi_daemon_test.py

Layouts (weightsync.integrations._common.tp_layout, float32 engines):
(a) one Qwen3-style model split by pipeline stage across the daemons
    (stage k = layer k on daemon k; embeddings on the first, norm and
    lm_head on the last), TP=2 inside each daemon;
(b) a Qwen3-MoE model whose experts are split across the daemons (two
    experts each, sharded over TP=2; attention and router on all);
(c) a data-parallel replica (TP=2) per daemon, one version sent from the
    trainer's registered shared memory (Trainer.host_tensors).
Three versions each, every engine's memory compared bit for bit with a
numpy placement of what was sent, receipts on. Each daemon of (a) is sent
only its stage's bytes. A tensor no daemon uses is refused before any
engine is paused or any byte moves. Then faults, on layout (a):
a daemon killed during prepare, an engine refusing the staged commit's
pause on one daemon, a daemon killed between prepare and commit, the
trainer killed between prepare and commit (the daemons' idle deadline ends
the prepared updates), the trainer killed after committing one daemon
(Trainer.finish_prepared commits the others). After each: no engine
serves a version its memory does not hold, no model instance serves two
versions at once (every engine of an instance READY means one version),
the dirty engines are reported DIRTY and stay paused, and the next dense
update repairs them.
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

import numpy as np  # noqa: E402

import weightsync  # noqa: E402
from weightsync._proto import v1  # noqa: E402
from weightsync.integrations._common import tp_layout  # noqa: E402
from weightsync.layouts import checkpoint_shapes  # noqa: E402

DENSE = {"model_type": "qwen3", "vocab_size": 250, "hidden_size": 32,
         "intermediate_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 8, "tie_word_embeddings": False}
MOE = dict(DENSE, model_type="qwen3_moe", num_hidden_layers=2, num_experts=6,
           moe_intermediate_size=16, decoder_sparse_step=1, mlp_only_layers=[])
DAEMONS = 3
CHUNK = 16 << 10
IDLE_MS = 1500
ENGINE_STATE = {v1.ENGINE_READY: "READY", v1.ENGINE_PAUSED: "PAUSED",
                v1.ENGINE_UPDATING: "UPDATING", v1.ENGINE_DIRTY: "DIRTY"}


def weights(config, version):
    rng = np.random.default_rng(1000 + version)
    return [(n, rng.standard_normal(s).astype(np.float32)) for n, s in checkpoint_shapes(config)]


def keep(params, segments, want):
    params = [p for p in params if want(p[0])]
    return params, {n: s for n, s in segments.items() if any(p[0] == n for p in params)}


def layout_a(k, r):
    """Stage k of 3 (layer k), TP rank r of 2."""
    def want(n):
        if n.startswith("model.layers."):
            return int(n.split(".")[2]) == k
        if n == "model.embed_tokens.weight":
            return k == 0
        return k == DAEMONS - 1   # model.norm, lm_head
    return keep(*tp_layout(DENSE, r, 2, dtype="FLOAT32"), want)


def layout_b(k, r):
    """Experts 2k, 2k+1 of 6 (each sharded over TP=2), the rest replicated."""
    return tp_layout(MOE, r, 2, experts=[2 * k, 2 * k + 1], moe_tp_rank=r, moe_tp_size=2,
                     dtype="FLOAT32")


def layout_c(k, r):
    """A whole replica per daemon, TP rank r of 2."""
    return tp_layout(DENSE, r, 2, dtype="FLOAT32")


def expected(params, segments, ckpt):
    """The engine's memory (float32, laid out as weightsync.Engine lays it
    out: 256-byte aligned in order) once `ckpt` {name: array} is installed;
    None: version 0, all zero."""
    size = 0
    offsets = []
    for _, _, shape in params:
        size = (size + 255) & ~255
        offsets.append(size)
        size += int(np.prod(shape)) * 4
    out = np.zeros(max(size, 1) // 4 + 1, np.float32)[:max(size, 1) // 4]
    if ckpt is None:
        return out
    for (name, _, shape), off in zip(params, offsets):
        flat = out[off // 4: off // 4 + int(np.prod(shape))]
        segs = segments.get(name)
        if not segs:
            flat[:] = ckpt[name].reshape(-1)
            continue
        for s in segs:
            src = ckpt[s["source"]]
            m = src.reshape(src.shape[0], -1)
            block = m[s["row_begin"]:s["row_begin"] + s["row_count"],
                      s["col_begin"]:s["col_begin"] + s["col_count"]]
            stride = s["dest_row_stride"] or s["col_count"]
            idx = (s["dest_offset"] + np.arange(s["row_count"])[:, None] * stride
                   + np.arange(s["col_count"])[None, :])
            flat[idx] = block
    return out


ENGINES = r"""
import json, os, signal, sys, time
sys.path.insert(0, {client!r})
import weightsync
target, spec_path, refuse_dir = sys.argv[1], sys.argv[2], sys.argv[3]
spec = json.load(open(spec_path))
engines, shm = [], {{}}
for eid, params, segments in spec:
    e = weightsync.Engine(eid, target, timeout=10)
    e.register_host([(n, d, tuple(s)) for n, d, s in params], segments=segments)
    def on_pause(mode, eid=eid):
        if os.path.exists(os.path.join(refuse_dir, "refuse-" + eid)):
            raise RuntimeError("engine " + eid + " refuses to pause")
    e.start(on_pause=on_pause)
    engines.append(e)
    shm[eid] = e._shm.name
print("ready", json.dumps(shm), flush=True)
def stop(*_):
    for e in engines:
        e.close()
    os._exit(0)
signal.signal(signal.SIGTERM, stop)
while True:
    time.sleep(1)
"""


class World:
    """Three daemons on Unix sockets in one temporary folder, the engine
    processes of the current layout, and a trainer of the three."""

    def __init__(self):
        self.work = tempfile.mkdtemp(prefix="ws-multi.", dir="/tmp")
        self.daemons = [None] * DAEMONS
        self.engines = []       # Popen of the engine host processes
        self.shm = {}           # engine id -> shm name
        self.layout = {}        # engine id -> (daemon, params, segments)
        self.instances = []     # lists of engine ids that serve as one
        self.sent = {0: None}   # version -> {name: array}
        self.config = None
        for k in range(DAEMONS):
            self.start_daemon(k)
        self.trainer = weightsync.Trainer(self.targets, timeout=20)

    @property
    def targets(self):
        return [f"unix:{self.work}/d{k}.sock" for k in range(DAEMONS)]

    def start_daemon(self, k):
        sock = f"{self.work}/d{k}.sock"
        log = open(f"{self.work}/d{k}.log", "a")
        self.daemons[k] = subprocess.Popen(
            [os.environ["WEIGHTSYNCD"], f"--socket={sock}", f"--update_idle_timeout_ms={IDLE_MS}",
             "--notice_timeout_ms=2000", "--finish_timeout_ms=10000"], stderr=log)
        for _ in range(200):
            if os.path.exists(sock):
                return
            time.sleep(0.02)
        raise RuntimeError(f"daemon {k} did not start")

    def kill_daemon(self, k):
        self.daemons[k].kill()
        self.daemons[k].wait()
        try:
            os.unlink(f"{self.work}/d{k}.sock")
        except FileNotFoundError:
            pass

    def start_engines(self, config, layout):
        self.stop_engines()
        self.config, self.sent = config, {0: None}
        procs = []
        for k in range(DAEMONS):
            spec = []
            for r in range(2):
                eid = f"{layout.__name__[-1]}{k}.tp{r}"
                params, segments = layout(k, r)
                spec.append((eid, params, segments))
                self.layout[eid] = (k, params, segments)
            path = f"{self.work}/engines{k}.json"
            with open(path, "w") as f:
                json.dump(spec, f)
            log = open(f"{self.work}/engines{k}.log", "a")
            procs.append(subprocess.Popen(
                [sys.executable, "-c", ENGINES.format(client=CLIENT), self.targets[k], path,
                 self.work], stdout=subprocess.PIPE, stderr=log, text=True))
        for p in procs:
            line = p.stdout.readline()
            if not line.startswith("ready"):
                raise RuntimeError(f"engine process did not start: {line!r}")
            self.shm.update(json.loads(line.split(" ", 1)[1]))
        self.engines = procs
        ids = sorted(e for e in self.layout if e[0] == layout.__name__[-1])
        if layout is layout_a:   # one model across the three daemons
            self.instances = [ids]
        else:                    # (b): one model too (experts); (c): a replica per daemon
            self.instances = ([ids] if layout is layout_b else
                              [[e for e in ids if e[1] == str(k)] for k in range(DAEMONS)])
        self.current = ids

    def stop_engines(self):
        for p in self.engines:
            p.terminate()
        for p in self.engines:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for eid, name in list(self.shm.items()):
            try:
                os.unlink("/dev/shm/" + name)
            except FileNotFoundError:
                pass
        self.engines, self.shm, self.layout = [], {}, {}

    def close(self):
        self.stop_engines()
        self.trainer.close()
        for d in self.daemons:
            if d is not None and d.poll() is None:
                d.terminate()
                try:
                    d.wait(10)
                except subprocess.TimeoutExpired:
                    d.kill()
        shutil.rmtree(self.work, ignore_errors=True)

    # --- what the daemons and the engines' memory say

    def states(self):
        """{engine id: (state name, version, connected)} over every daemon."""
        out = {}
        for st in self.trainer.statuses():
            for e in st.engines:
                out[e.engine_id] = (ENGINE_STATE.get(e.state, str(e.state)), e.version,
                                    e.connected)
        return out

    def memory_is(self, eid, version):
        _, params, segments = self.layout[eid]
        got = np.fromfile("/dev/shm/" + self.shm[eid], np.float32)
        want = expected(params, segments, self.sent[version])
        return np.array_equal(got[:want.size].view(np.uint32), want.view(np.uint32))

    def check_no_mixture(self, why):
        """No engine serves (READY) a version its memory does not hold bit
        for bit, and no instance serves with two versions. Returns states."""
        st = self.states()
        for eid in self.current:
            state, version, _ = st[eid]
            if state == "READY":
                assert self.memory_is(eid, version), f"{why}: {eid} READY at v{version} " \
                    f"but its memory differs"
        for inst in self.instances:
            if all(st[e][0] == "READY" for e in inst):
                versions = {st[e][1] for e in inst}
                assert len(versions) == 1, f"{why}: instance {inst} serves {versions}"
        return st

    def update(self, version, **kw):
        ckpt = weights(self.config, version)
        self.sent[version] = dict(ckpt)
        return self.trainer.update(ckpt, version=version, chunk_bytes=CHUNK,
                                   update_id=f"u{version}-{os.getpid()}", **kw)

    def expect_all(self, version, why):
        st = self.check_no_mixture(why)
        for eid in self.current:
            assert st[eid][:2] == ("READY", version), f"{why}: {eid} is {st[eid]}"
            assert self.memory_is(eid, version), f"{why}: {eid} memory is not v{version}"

    def wait(self, cond, what, timeout=15.0):
        end = time.time() + timeout
        while time.time() < end:
            try:
                if cond():
                    return
            except weightsync.WeightSyncError as e:
                # A restarted daemon: the channel retries after a back-off.
                if e.code != "UNAVAILABLE":
                    raise
            time.sleep(0.05)
        raise AssertionError(f"timed out waiting for {what}")

    def restart_daemon(self, k):
        """Daemon k again on its socket; waits for its engines to come back
        (weightsync.Engine registers again by itself)."""
        self.start_daemon(k)
        mine = [e for e in self.current if self.layout[e][0] == k]
        self.wait(lambda: all(e in self.states() and self.states()[e][2] for e in mine),
                  f"daemon {k}'s engines to register again")
        self.trainer.init_host()   # the new daemon has no group


def trainer_main(argv):
    """A trainer process for the trainer-killed cases: sends `version` of
    layout (a) and parks after every daemon prepared ("prepared"), or after
    committing daemon 0 only ("commit_one"), until killed."""
    targets, phase, version = argv[0].split(","), argv[1], int(argv[2])
    t = weightsync.Trainer(targets, timeout=20)
    update_id = f"killed-{version}"

    def hook(p):
        if p != "prepared":
            return
        if phase == "commit_one":
            t._stubs[0].call("CommitWeightUpdate", update_id=update_id)
        print("at", phase, flush=True)
        while True:
            time.sleep(1)
    t._on_phase = hook
    t.update(weights(DENSE, version), version=version, chunk_bytes=CHUNK, update_id=update_id)


def run_trainer_until(w, phase, version):
    p = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--trainer",
                          ",".join(w.targets), phase, str(version)],
                         stdout=subprocess.PIPE, stderr=open(f"{w.work}/trainer.log", "a"),
                         text=True)
    line = p.stdout.readline()
    assert line.startswith("at " + phase), f"trainer did not reach {phase}: {line!r}"
    w.sent[version] = dict(weights(DENSE, version))
    p.kill()
    p.wait()


def layouts_and_versions(w):
    # The packed stream of the whole model: what one daemon would get.
    full = weightsync.planner.plan_chunks(
        [{"name": n, "dtype": "FLOAT32", "shape": list(a.shape)} for n, a in weights(DENSE, 1)],
        CHUNK)["total_bytes"]
    for layout, config in ((layout_a, DENSE), (layout_b, MOE), (layout_c, DENSE)):
        t0 = time.time()
        w.start_engines(config, layout)
        for version in (1, 2, 3):
            if layout is layout_c and version == 3:
                # The trainer's registered shared memory: each daemon copies
                # its share from it.
                ckpt = weights(config, version)
                src = w.trainer.host_tensors([(n, "FLOAT32", a.shape) for n, a in ckpt])
                for n, a in ckpt:
                    src[n][...] = a
                w.sent[version] = dict(ckpt)
                res = w.trainer.update(src, version=version, chunk_bytes=CHUNK)
            else:
                res = w.update(version)
            assert len(res) == DAEMONS and all(r.version == version for r in res)
            assert all(e.HasField("receipt") for r in res for e in r.engines)
            w.expect_all(version, f"{layout.__name__} v{version}")
            if layout is layout_a:
                starts = w.trainer.last_starts
                assert all(s.stream_omits_unused and s.unused_tensors for s in starts)
                got = [s.total_bytes for s in starts]
                # The stages are disjoint: each daemon gets its share only.
                assert max(got) < full * 0.6 and sum(got) <= full, (got, full)
        print(f"{layout.__name__}: 3 versions bit-exact on {len(w.current)} engines behind "
              f"{DAEMONS} daemons, receipts ok ({time.time() - t0:.1f} s)", flush=True)


def unused_refused(w):
    before = w.states()
    ckpt = weights(DENSE, 4) + [("model.layers.7.nowhere.weight", np.ones(4, np.float32))]
    try:
        w.trainer.update(ckpt, version=4, chunk_bytes=CHUNK, update_id="unused")
        raise AssertionError("an update with a tensor no daemon uses was accepted")
    except weightsync.WeightSyncError as e:
        assert e.code == "INVALID_ARGUMENT" and "model.layers.7.nowhere.weight" in e.message, e
        message = e.message
    assert w.states() == before, "the refused update changed an engine"
    for st in w.trainer.statuses():
        assert st.update.update_id != "unused", "the refused update was opened"
    w.expect_all(3, "after the refused update")
    print("a tensor no daemon uses: refused before anything moved:", message[:90], flush=True)


def fault_daemon_killed_in_prepare(w, version):
    def hook(phase):
        if phase == "pushed":
            w.kill_daemon(2)
    w.trainer._on_phase = hook
    try:
        w.update(version)
        raise AssertionError("the update survived a dead daemon")
    except weightsync.WeightSyncError as e:
        assert "daemon 2" in e.message and "committed nowhere" in e.message, e
    finally:
        w.trainer._on_phase = None
    w.restart_daemon(2)
    st = w.check_no_mixture("daemon killed in prepare")
    assert all(st[e][:2] == ("DIRTY", version - 1) for e in w.current), st
    return "every engine DIRTY at the old version (wrote, then aborted)"


def fault_engine_refuses_in_prepare(w, version):
    open(f"{w.work}/refuse-a1.tp0", "w").close()
    try:
        w.update(version, mode="staged")
        raise AssertionError("the update survived a refused pause")
    except weightsync.WeightSyncError as e:
        assert "daemon 1" in e.message and "refuses to pause" in e.message, e
    finally:
        os.unlink(f"{w.work}/refuse-a1.tp0")
    st = w.check_no_mixture("engine refusing in prepare")
    for e in w.current:
        want = "READY" if w.layout[e][0] == 1 else "DIRTY"   # staged: daemon 1 untouched
        assert st[e][:2] == (want, version - 1), (e, st[e])
    return "daemon 1 untouched (READY, old), the others DIRTY: the instance can't serve"


def fault_daemon_killed_before_commit(w, version):
    def hook(phase):
        if phase == "prepared":
            w.kill_daemon(2)
    w.trainer._on_phase = hook
    try:
        w.update(version)
        raise AssertionError("the update did not report the dead daemon")
    except weightsync.WeightSyncError as e:
        assert e.code == "ABORTED" and "but not on daemon 2" in e.message, e
    finally:
        w.trainer._on_phase = None
    w.restart_daemon(2)
    st = w.check_no_mixture("daemon killed before commit")
    for e in w.current:
        want = ("READY", version) if w.layout[e][0] != 2 else ("DIRTY", version - 1)
        assert st[e][:2] == want, (e, st[e])
    return "daemons 0-1 READY at the new version, daemon 2's engines DIRTY, paused"


def fault_trainer_killed_before_commit(w, version):
    run_trainer_until(w, "prepared", version)
    st = w.check_no_mixture("trainer killed after prepare")
    assert all(st[e][:2] == ("UPDATING", version - 1) for e in w.current), st
    w.wait(lambda: all(w.states()[e][0] == "DIRTY" for e in w.current),
           "the idle deadline to end the prepared updates", timeout=IDLE_MS / 1000 + 10)
    st = w.check_no_mixture("prepared updates ended by the idle deadline")
    assert all(st[e][:2] == ("DIRTY", version - 1) for e in w.current), st
    return "prepared everywhere: paused until the idle deadline, then DIRTY at the old version"


def fault_trainer_killed_mid_commit(w, version):
    run_trainer_until(w, "commit_one", version)
    st = w.check_no_mixture("trainer killed after one commit")
    for e in w.current:
        want = ("READY", version) if w.layout[e][0] == 0 else ("UPDATING", version - 1)
        assert st[e][:2] == want, (e, st[e])
    done = w.trainer.finish_prepared()
    assert done == {f"killed-{version}": "committed"}, done
    w.expect_all(version, "finish_prepared")
    return "daemon 0 committed, 1-2 held paused; finish_prepared committed them"


def main():
    t0 = time.time()
    w = World()
    try:
        w.trainer.init_host()
        assert w.trainer.world_sizes("nccl") == [1] * DAEMONS
        layouts_and_versions(w)
        w.start_engines(DENSE, layout_a)
        w.update(3)
        unused_refused(w)
        version = 4
        for fault in (fault_daemon_killed_in_prepare, fault_engine_refuses_in_prepare,
                      fault_daemon_killed_before_commit, fault_trainer_killed_before_commit,
                      fault_trainer_killed_mid_commit):
            t = time.time()
            what = fault(w, version)
            if fault is not fault_trainer_killed_mid_commit:
                version += 1
                w.update(version)   # the next dense update repairs every engine
                w.expect_all(version, f"repair after {fault.__name__}")
                what += f"; v{version} repaired every engine"
            print(f"{fault.__name__}: {what} ({time.time() - t:.1f} s)", flush=True)
            version += 1
    except BaseException:
        for f in sorted(os.listdir(w.work)):
            if f.endswith(".log"):
                with open(os.path.join(w.work, f), errors="replace") as log:
                    tail = log.read()[-3000:]
                print(f"--- {f}\n{tail}", file=sys.stderr)
        raise
    finally:
        w.close()
    print(f"PASS ({time.time() - t0:.1f} s)")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--trainer":
        trainer_main(sys.argv[2:])
    else:
        main()

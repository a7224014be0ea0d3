#!/usr/bin/env python3
"""weightsyncctl against the real daemon on the host backend: two engine
processes (Python clients, numpy weights in shared memory), a trainer in
this process for the plain updates and trainer processes that push chunks
slowly for the `watch` cases.

Run by Bazel (//tests:weightsyncctl_test, through run_python.sh, which sets
WEIGHTSYNCD; the tool is tools/weightsyncctl in the runfiles tree). By hand:

    bazel build //daemon:weightsyncd //tools:weightsyncctl
    WEIGHTSYNCD=bazel-bin/daemon/weightsyncd \\
    WEIGHTSYNCCTL=bazel-bin/tools/weightsyncctl python3 tests/weightsyncctl_test.py

`watch` on a terminal is checked in a detached tmux session (tmux must be
installed; the test fails, not skips, without it). With
TEST_UNDECLARED_OUTPUTS_DIR set (Bazel does), the panes captured during
the update are written to watch_panes.txt there (docs/weightsyncctl.md
shows one).
"""

import glob
import json
import os
import re
import select
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
CLIENT = os.path.join(HERE, "..", "client", "python")
sys.path.insert(0, CLIENT)

import numpy as np  # noqa: E402

import weightsync  # noqa: E402
from weightsync._tensors import describe  # noqa: E402
from weightsync.receipts import expected_receipt  # noqa: E402

PARAMS = [("w0", (512, 1024)), ("w1", (1024,)), ("w2", (256, 512))]  # float32
CHUNK = 64 << 10   # ~41 chunks an update
SLOW_S = 0.06      # between two chunks of a slow update: ~2.5 s an update

ENGINE = r"""
import sys, time
sys.path.insert(0, {client!r})
import weightsync
e = weightsync.Engine(sys.argv[1], sys.argv[2], timeout=10)
e.register_host([(n, "FLOAT32", s) for n, s in {params!r}])
e.start()
print("ready", flush=True)
while True:
    time.sleep(1)
"""

# A trainer that sends one update chunk by chunk with a pause after each,
# so that `watch` sees it in progress. argv: target update_id version seed
# [abort_after]: with abort_after, it stops sending after that many chunks
# and aborts the update.
SLOW_TRAINER = r"""
import sys, time
sys.path.insert(0, {client!r})
import numpy as np, weightsync
from weightsync import planner
from weightsync._proto import v1
target, update_id, version, seed = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
abort_after = int(sys.argv[5]) if len(sys.argv) > 5 else None
rng = np.random.default_rng(seed)
tensors = [(n, rng.standard_normal(s).astype(np.float32)) for n, s in {params!r}]
manifest = [dict(name=n, dtype="FLOAT32", shape=list(a.shape)) for n, a in tensors]
t = weightsync.Trainer(target, timeout=30)
t.init_host()
started = t._stub.call("StartWeightUpdate", v1.StartWeightUpdateRequest(
    update_id=update_id, target_version=version, chunk_bytes={chunk},
    tensors=[v1.TensorSpec(name=m["name"], dtype=v1.FLOAT32, shape=m["shape"])
             for m in manifest]))
plan = planner.plan_chunks(manifest, started.chunk_bytes)
data = [a.view(np.uint8).reshape(-1) for _, a in tensors]
def chunks():
    for c in plan["chunks"]:
        if abort_after is not None and c["index"] == abort_after:
            # Abort while the stream is open: a stream that ends with chunks
            # missing fails the update itself (docs/protocol.md, PushChunks).
            t.abort(update_id, "stopped by weightsyncctl_test")
            return
        yield v1.PushChunksRequest(update_id=update_id, chunk_index=c["index"],
                                   data=planner.pack_chunk(c, data))
        time.sleep({slow})
t._stub.call("PushChunks", chunks(), timeout=120)
if abort_after is not None:
    print("aborted", flush=True)
else:
    print("done", t.finish(update_id).version, flush=True)
"""

# "update ID vN receiving  [####......]   48.2%  1.21/2.50 MB  3.4 MB/s  ETA 0.4s";
# rate and ETA are "--" until two samples are in.
PROGRESS = re.compile(
    r"update (\S+) v(\d+) receiving  \[([#.]{20})\]\s+(\d+\.\d)%  "
    r"(\d+\.\d\d)/(\d+\.\d\d) ([kMGTP]?B)  (\d+\.\d [kMGTP]?B|-- B)/s  "
    r"ETA (\d+(?:\.\d)?s|\d+m\d\ds|--)")


def weights(seed):
    rng = np.random.default_rng(seed)
    return [(n, rng.standard_normal(s).astype(np.float32)) for n, s in PARAMS]


def release():
    """/VERSION (in the runfiles: cwd is their root), the daemon's and this
    tool's version."""
    with open(os.path.join(os.getcwd(), "VERSION")) as f:
        return f.read().strip()


def find_ctl():
    path = os.environ.get("WEIGHTSYNCCTL") or os.path.join(os.getcwd(), "tools", "weightsyncctl")
    if not (os.path.isfile(path) and os.access(path, os.X_OK)):
        raise RuntimeError(f"weightsyncctl not found at {path}: run through Bazel "
                           "(//tests:weightsyncctl_test) or set WEIGHTSYNCCTL")
    return os.path.abspath(path)


def wait_line(proc, timeout=15.0):
    """The next line `proc` prints on stdout within `timeout`, or None."""
    end = time.time() + timeout
    while time.time() < end:
        ready, _, _ = select.select([proc.stdout], [], [], 0.1)
        if ready:
            return proc.stdout.readline()
    return None


class WeightsyncctlTest(unittest.TestCase):
    """Tests run in name order and share one daemon: versions only go up."""

    @classmethod
    def setUpClass(cls):
        cls.tmux = shutil.which("tmux")
        if cls.tmux is None:
            raise RuntimeError("tmux is not installed: weightsyncctl_test drives `watch` in a "
                               "tmux session (apt-get install tmux; add it to "
                               ".ci/install-deps.sh)")
        cls.ctl_bin = find_ctl()
        cls.work = tempfile.mkdtemp(prefix="ws-ctl.", dir="/tmp")
        cls.sock = os.path.join(cls.work, "d.sock")
        cls.target = "unix:" + cls.sock
        cls.daemon_log = open(os.path.join(cls.work, "daemon.log"), "w")
        cls.daemon = subprocess.Popen(
            [os.environ["WEIGHTSYNCD"], f"--socket={cls.sock}", f"--chunk_bytes={CHUNK}",
             f"--max_chunk_bytes={1 << 20}", "--notice_timeout_ms=3000"],
            stderr=cls.daemon_log)
        for _ in range(200):
            if os.path.exists(cls.sock):
                break
            time.sleep(0.025)
        cls.engines, cls.logs = [], [cls.daemon_log]
        src = ENGINE.format(client=CLIENT, params=PARAMS)
        for eid in ("e0", "e1"):
            cls.logs.append(open(os.path.join(cls.work, f"{eid}.log"), "w"))
            p = subprocess.Popen([sys.executable, "-c", src, eid, cls.target],
                                 stdout=subprocess.PIPE, stderr=cls.logs[-1], text=True)
            cls.engines.append(p)
            line = wait_line(p)
            if line is None or not line.startswith("ready"):
                raise RuntimeError(f"engine {eid} did not start (see {cls.work}/{eid}.log)")
        cls.trainer = weightsync.Trainer(cls.target, timeout=30)
        for _ in range(200):  # control streams open
            st = cls.trainer.status()
            if len(st.engines) == 2 and all(e.connected for e in st.engines):
                break
            time.sleep(0.02)
        cls.trainer.init_host()
        cls.layouts = {e.engine_id: e.layout
                       for e in cls.trainer._stub.call("GetStatus", include_layouts=True).engines}
        cls.w1 = weights(1)
        cls.r1 = cls.update(cls.w1, 1, "u1")
        cls.total_bytes = cls.r1.bytes

    @classmethod
    def tearDownClass(cls):
        for p in getattr(cls, "engines", []):
            p.kill()
            p.wait()
            p.stdout.close()
            # weightsync.Engine names its memory weightsync-<id>-<pid>-<random>
            for f in glob.glob(f"/dev/shm/weightsync-{p.args[3]}-{p.pid}-*"):
                try:
                    os.unlink(f)
                except OSError:
                    pass
        if hasattr(cls, "trainer"):
            cls.trainer.close()
        cls.daemon.send_signal(signal.SIGTERM)
        try:
            code = cls.daemon.wait(10)
        except subprocess.TimeoutExpired:
            cls.daemon.kill()
            code = "no exit within 10 s of SIGTERM"
        for f in cls.logs:
            f.close()
        if code != 0:
            raise RuntimeError(f"daemon exit status {code} (see {cls.work}/daemon.log)")
        shutil.rmtree(cls.work, ignore_errors=True)

    @classmethod
    def update(cls, named, version, update_id):
        """A verified full update from this process: the trainer checks
        every engine's receipt against what it sent."""
        return cls.trainer.update(named, version=version, chunk_bytes=CHUNK,
                                  update_id=update_id, verify=True)

    def ctl(self, *args, timeout=30):
        return subprocess.run([self.ctl_bin, f"--socket={self.sock}", *args],
                              capture_output=True, text=True, timeout=timeout)

    def ok(self, *args):
        p = self.ctl(*args)
        self.assertEqual(p.returncode, 0, f"weightsyncctl {' '.join(args)}: {p.stderr}")
        self.assertEqual(p.stderr, "")
        return p.stdout

    def status_json(self):
        out = self.ok("status", "--json")
        self.assertEqual(len(out.strip().splitlines()), 1, out)  # one object, one line
        return json.loads(out)

    def states(self):
        return {e["engine_id"]: e["state"] for e in self.status_json()["engines"]}

    def engine_rows(self, text):
        """{engine id: [state, version, connected, parameters, bytes..., devices]}
        from a table weightsyncctl printed."""
        rows = {}
        for line in text.splitlines():
            m = re.match(r"^(e[01])\s+(\S+)\s+(\d+)\s+(yes|no)\s+(\d+)\s+(\S+ \S+)\s+(\S+)$", line)
            if m:
                rows[m.group(1)] = list(m.groups()[1:])
        return rows

    def slow_update(self, update_id, version, seed, abort_after=None):
        args = [sys.executable, "-c",
                SLOW_TRAINER.format(client=CLIENT, params=PARAMS, chunk=CHUNK, slow=SLOW_S),
                self.target, update_id, str(version), str(seed)]
        if abort_after is not None:
            args.append(str(abort_after))
        return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def test_01_status_json(self):
        st = self.status_json()
        engines = st["engines"]
        self.assertEqual([e["engine_id"] for e in engines], ["e0", "e1"])
        nbytes = sum(int(np.prod(s)) * 4 for _, s in PARAMS)
        for e in engines:
            # proto3 JSON: field names as in the .proto, enum names, int64
            # as strings.
            self.assertEqual(e["state"], "ENGINE_READY")
            self.assertEqual(int(e["version"]), 1)
            self.assertIs(e["connected"], True)
            self.assertEqual(int(e["parameters"]), len(PARAMS))
            self.assertEqual(int(e["bytes"]), nbytes)
            self.assertEqual(e["device_uuids"], ["host"])
            self.assertEqual(e["layout"], [])  # without include_layouts
        self.assertEqual(st["backend"], "BACKEND_HOST")
        self.assertIn("build_info", st)
        self.assertEqual(st["version"], release())
        u = st["update"]
        self.assertEqual(u["update_id"], "u1")
        self.assertEqual(int(u["target_version"]), 1)
        self.assertEqual(u["phase"], "committed")
        self.assertEqual(u["mode"], "UPDATE_MODE_STREAMING")
        self.assertEqual(int(u["received_bytes"]), int(u["total_bytes"]))
        self.assertEqual(int(u["total_bytes"]), self.total_bytes)
        self.assertEqual(sorted(u["engine_ids"]), ["e0", "e1"])

    def test_02_status_text(self):
        out = self.ok("status")
        self.assertRegex(out, r"(?m)^backend: host\b")
        self.assertRegex(out, rf"(?m)^backend: host   version: {re.escape(release())}\b")
        self.assertRegex(out, r"(?m)^ENGINE\s+STATE\s+VERSION\s+CONNECTED\s+PARAMETERS\s+BYTES"
                              r"\s+DEVICES$")
        rows = self.engine_rows(out)
        self.assertEqual(sorted(rows), ["e0", "e1"], out)
        for eid, row in rows.items():
            self.assertEqual(row, ["READY", "1", "yes", "3", "2.6 MB", "host"], out)
        self.assertRegex(out, r"(?m)^last update: u1  version 1  streaming  committed$")
        total = self.total_bytes / 1e6
        self.assertIn(f"received {total:.2f}/{total:.2f} MB (100.0%)", out)
        self.assertIn("engines e0, e1", out)

    def test_02_version_flag(self):
        # The tool's own version, without a daemon; the daemon's the same.
        p = subprocess.run([self.ctl_bin, "--version"], capture_output=True,
                           text=True, timeout=30)
        self.assertEqual((p.returncode, p.stdout, p.stderr),
                         (0, f"weightsyncctl version {release()}\n", ""))
        p = subprocess.run([os.environ["WEIGHTSYNCD"], "--version"],
                           capture_output=True, text=True, timeout=30)
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertEqual(p.stdout.splitlines()[0],
                         f"weightsyncd version {release()}")

    def test_03_pause_resume(self):
        out = self.ok("pause")
        self.assertEqual({e: r[0] for e, r in self.engine_rows(out).items()},
                         {"e0": "PAUSED", "e1": "PAUSED"}, out)
        self.assertEqual(self.states(), {"e0": "ENGINE_PAUSED", "e1": "ENGINE_PAUSED"})
        self.assertEqual({e: r[0] for e, r in self.engine_rows(self.ok("status")).items()},
                         {"e0": "PAUSED", "e1": "PAUSED"})
        out = self.ok("resume")
        self.assertEqual({e: r[0] for e, r in self.engine_rows(out).items()},
                         {"e0": "READY", "e1": "READY"}, out)
        self.assertEqual(self.states(), {"e0": "ENGINE_READY", "e1": "ENGINE_READY"})
        # One engine, another mode, JSON.
        paused = json.loads(self.ok("pause", "--mode=wait", "--json", "e1"))
        self.assertEqual([(e["engine_id"], e["state"]) for e in paused["engines"]],
                         [("e1", "ENGINE_PAUSED")])
        self.assertEqual(self.states(), {"e0": "ENGINE_READY", "e1": "ENGINE_PAUSED"})
        resumed = json.loads(self.ok("resume", "--json", "e1"))
        self.assertEqual([(e["engine_id"], e["state"]) for e in resumed["engines"]],
                         [("e1", "ENGINE_READY")])
        self.assertEqual(self.states(), {"e0": "ENGINE_READY", "e1": "ENGINE_READY"})
        p = self.ctl("pause", "nosuch")
        self.assertEqual(p.returncode, 1)
        self.assertRegex(p.stderr, r"^weightsyncctl: NOT_FOUND: .*nosuch")
        self.assertEqual(self.states(), {"e0": "ENGINE_READY", "e1": "ENGINE_READY"})

    def check(self, eid):
        """(checksum, text line) of `weightsyncctl check eid`, and the same
        checksum from --json."""
        out = self.ok("check", eid)
        m = re.fullmatch(r"engine (\S+) v(\d+) (\S+) receipt 0x([0-9a-f]{16}) "
                         r"\((\d+) parameters, (\S+ \S+), read in (\d+\.\d\d) s\)\n", out)
        self.assertIsNotNone(m, out)
        self.assertEqual(m.group(1), eid)
        self.assertEqual((m.group(3), m.group(5), m.group(6)), ("READY", "3", "2.6 MB"))
        js = json.loads(self.ok("check", "--json", eid))
        self.assertEqual(js["engine_id"], eid)
        self.assertEqual(int(js["version"]), int(m.group(2)))
        self.assertEqual(js["state"], "ENGINE_READY")
        self.assertEqual(int(js["receipt"]["checksum"]), int(m.group(4), 16))
        self.assertEqual(int(js["receipt"]["parameters"]), len(PARAMS))
        self.assertEqual(int(js["receipt"]["bytes"]), sum(int(np.prod(s)) * 4 for _, s in PARAMS))
        return int(m.group(4), 16), int(m.group(2))

    def expected(self, eid, named):
        """The receipt of a full update of `named`, computed here from the
        engine's layout (weightsync.receipts)."""
        sent = {}
        for n, a in named:
            dtype, shape, raw = describe(n, a)
            sent[n] = (dtype, list(shape), raw)
        return expected_receipt(self.layouts[eid], sent)[0]

    def test_04_check(self):
        receipts = {e.engine_id: e.receipt.checksum for e in self.r1.engines}
        for eid in ("e0", "e1"):
            checksum, version = self.check(eid)
            self.assertEqual(version, 1)
            self.assertEqual(checksum, receipts[eid])  # the trainer's receipt for v1
            self.assertEqual(checksum, self.expected(eid, self.w1))
        # One element different, sent as a second full update.
        w2 = [(n, a.copy()) for n, a in self.w1]
        w2[1][1][5] += 1.0
        r2 = self.update(w2, 2, "u2")
        receipts2 = {e.engine_id: e.receipt.checksum for e in r2.engines}
        for eid in ("e0", "e1"):
            checksum, version = self.check(eid)
            self.assertEqual(version, 2)
            self.assertNotEqual(checksum, receipts[eid])
            self.assertEqual(checksum, receipts2[eid])
            self.assertEqual(checksum, self.expected(eid, w2))
        p = self.ctl("check", "nosuch")
        self.assertEqual(p.returncode, 1)
        self.assertRegex(p.stderr, r"^weightsyncctl: NOT_FOUND: .*nosuch")
        self.assertEqual(p.stdout, "")
        p = self.ctl("check", "--json", "--", "-dash")  # an id after "--", not a flag
        self.assertEqual(p.returncode, 1)
        self.assertRegex(p.stderr, r"^weightsyncctl: NOT_FOUND: .*'-dash'")

    def test_05_usage(self):
        for args in ([], ["frobnicate"], ["status", "extra"], ["watch", "e0"], ["check"],
                     ["check", "e0", "e1"], ["--bogus_flag", "status"], ["status", "--until_done"],
                     ["resume", "--mode=wait"], ["pause", "--mode=sideways"],
                     ["watch", "--interval_ms=soon"], ["watch", "--once", "--until_done"],
                     ["status", "--timeout_ms=0"], ["--target=localhost:1", "status"]):
            p = self.ctl(*args)
            self.assertEqual(p.returncode, 2, f"{args}: {p.stderr}")
            self.assertIn("usage: weightsyncctl", p.stderr, args)
            self.assertEqual(p.stdout, "", args)
        for args in (["help"], ["--help"]):
            p = self.ctl(*args)
            self.assertEqual(p.returncode, 0, args)
            self.assertIn("usage: weightsyncctl", p.stdout)

    def test_06_errors(self):
        gone = os.path.join(self.work, "nothing-here.sock")
        p = subprocess.run([self.ctl_bin, f"--socket={gone}", "status"],
                           capture_output=True, text=True, timeout=30)
        self.assertEqual(p.returncode, 1)
        self.assertRegex(p.stderr, r"^weightsyncctl: UNAVAILABLE: no daemon socket at " +
                         re.escape(gone))
        # TCP with TLS and a token, nothing listening: the token must not
        # appear anywhere.
        secret = "s3cr3t-" + os.urandom(8).hex()
        token = os.path.join(self.work, "token")
        with open(token, "w") as f:
            f.write(secret + "\n")
        ca = os.path.join(self.work, "ca.pem")
        key = os.path.join(self.work, "ca.key")
        made = subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes",
                               "-days", "1", "-subj", "/CN=weightsyncd", "-keyout", key,
                               "-out", ca], capture_output=True)
        self.assertEqual(made.returncode, 0, made.stderr)
        for cmd in ("status", "check"):
            p = subprocess.run([self.ctl_bin, "--target=127.0.0.1:1", f"--tls_ca={ca}",
                                f"--token_file={token}", "--timeout_ms=500", cmd]
                               + (["e0"] if cmd == "check" else []),
                               capture_output=True, text=True, timeout=30)
            self.assertEqual(p.returncode, 1, p.stderr)
            self.assertRegex(p.stderr, r"^weightsyncctl: UNAVAILABLE: ")
            self.assertNotIn(secret, p.stdout + p.stderr)
        p = subprocess.run([self.ctl_bin, f"--socket={self.sock}", f"--token_file={token}",
                            "status"], capture_output=True, text=True, timeout=30)
        self.assertEqual(p.returncode, 2)
        self.assertNotIn(secret, p.stdout + p.stderr)

    def test_07_watch_in_tmux(self):
        """`watch --until_done` on a terminal: the line redrawn in place."""
        server = ["tmux", "-L", f"wsctl-{os.getpid()}", "-f", "/dev/null"]
        env = {k: v for k, v in os.environ.items() if k != "TMUX"}
        env.update(TMUX_TMPDIR=self.work, PS1="$ ", TERM="xterm",
                   PATH=os.path.dirname(self.ctl_bin) + ":" + env.get("PATH", "/usr/bin:/bin"))

        def tmux(*args):
            return subprocess.run(server + list(args), env=env, capture_output=True, text=True,
                                  check=True, timeout=10).stdout

        tmux("new-session", "-d", "-s", "w", "-x", "120", "-y", "10",
             "env PS1='$ ' bash --norc --noprofile -i")
        try:
            end = time.time() + 10
            while not tmux("capture-pane", "-p", "-t", "w").startswith("$"):
                self.assertLess(time.time(), end, "no shell prompt in the tmux pane")
                time.sleep(0.05)
            # weightsyncctl by its name, from PATH: the pane reads as an
            # operator's terminal.
            tmux("send-keys", "-t", "w", f"weightsyncctl --socket={shlex.quote(self.sock)} "
                 "watch --until_done --interval_ms=100; echo EXIT=$?", "Enter")
            end = time.time() + 15
            while "no update in progress (last: u2 v2 committed)" not in tmux("capture-pane",
                                                                               "-p", "-t", "w"):
                self.assertLess(time.time(), end, tmux("capture-pane", "-p", "-t", "w"))
                time.sleep(0.05)
            trainer = self.slow_update("ws-watch-tty", 3, 3)
            panes = []
            while trainer.poll() is None:
                panes.append(tmux("capture-pane", "-p", "-t", "w"))
                time.sleep(0.1)
            out, err = trainer.communicate()
            self.assertEqual(trainer.returncode, 0, err)
            self.assertEqual(out.split(), ["done", "3"])
            end = time.time() + 15
            while not re.search(r"(?m)^EXIT=\d+$", panes[-1]):
                self.assertLess(time.time(), end, panes[-1])
                time.sleep(0.05)
                panes.append(tmux("capture-pane", "-p", "-t", "w"))
        finally:
            subprocess.run(server + ["kill-server"], env=env, capture_output=True)
        seen = []
        for pane in panes:
            for line in pane.splitlines():
                m = PROGRESS.search(line)
                if m:
                    seen.append((pane, m))
        mid = [(pane, m) for pane, m in seen
               if 0 < float(m.group(4)) < 100 and m.group(8) != "-- B"]
        self.assertTrue(mid, "no progress line between 0% and 100% with a rate:\n"
                        + "\n--\n".join(panes))
        pane, m = mid[len(mid) // 2]
        self.assertEqual(m.group(1, 2), ("ws-watch-tty", "3"))
        self.assertEqual((m.group(6), m.group(7)), (f"{self.total_bytes / 1e6:.2f}", "MB"))
        self.assertGreater(float(m.group(5)), 0)
        filled = m.group(3).count("#")
        self.assertAlmostEqual(filled / 20, float(m.group(4)) / 100, delta=0.051)
        self.assertGreater(float(m.group(8).split()[0]), 0, pane)  # a rate
        self.assertNotEqual(m.group(9), "--", pane)  # an ETA
        # The line is redrawn in place: one progress line on the screen.
        self.assertEqual(sum(1 for line in pane.splitlines() if "receiving" in line), 1, pane)
        final = panes[-1]
        self.assertRegex(final, r"(?m)^update ws-watch-tty v3 committed  2\.6 MB  \d+ chunks  "
                                r"engines e0, e1$")
        self.assertRegex(final, r"(?m)^EXIT=0$")
        self.assertNotIn("receiving", final)  # the final line replaced the progress line
        out_dir = os.environ.get("TEST_UNDECLARED_OUTPUTS_DIR")
        if out_dir:
            with open(os.path.join(out_dir, "watch_panes.txt"), "w") as f:
                f.write(f"--- a pane during the update ({m.group(4)}%):\n{pane.rstrip()}\n"
                        f"--- the pane at the end:\n{final.rstrip()}\n")
        print(f"pane during the update:\n{pane.rstrip()}\npane at the end:\n{final.rstrip()}")

    def test_08_watch_pipe(self):
        """Not a TTY: --json gives ndjson, text gives one line per change."""
        p = self.ctl("watch", "--once")
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertEqual(p.stdout, "no update in progress (last: ws-watch-tty v3 committed)\n")
        once = json.loads(self.ok("watch", "--once", "--json"))
        self.assertEqual((once["in_progress"], once["done"], once["update_id"], once["phase"]),
                         (False, False, "ws-watch-tty", "committed"))
        cmd = [self.ctl_bin, f"--socket={self.sock}", "watch", "--until_done",
               "--interval_ms=50"]
        js = subprocess.Popen(cmd + ["--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True)
        tx = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        first_js, first_tx = wait_line(js), wait_line(tx)
        self.assertEqual(json.loads(first_js)["phase"], "committed")
        self.assertEqual(first_tx, "no update in progress (last: ws-watch-tty v3 committed)\n")
        trainer = self.slow_update("ws-watch-pipe", 4, 4)
        out, err = trainer.communicate(timeout=60)
        self.assertEqual(trainer.returncode, 0, err)
        js_out, js_err = js.communicate(timeout=15)
        tx_out, tx_err = tx.communicate(timeout=15)
        self.assertEqual((js.returncode, js_err), (0, ""))
        self.assertEqual((tx.returncode, tx_err), (0, ""))

        samples = [json.loads(first_js)] + [json.loads(line) for line in js_out.splitlines()]
        for s in samples:
            self.assertEqual(set(s), {"t", "in_progress", "done", "update_id", "target_version",
                                      "mode", "phase", "bytes", "total", "chunks",
                                      "total_chunks", "rate_bytes_per_s", "eta_s", "error"})
        ours = [s for s in samples if s["update_id"] == "ws-watch-pipe"]
        self.assertTrue(ours, js_out)
        got = [s["bytes"] for s in ours]
        self.assertEqual(got, sorted(got), "bytes went down")
        self.assertTrue(all(s["total"] == self.total_bytes for s in ours))
        mid = [s for s in ours if s["in_progress"] and 0 < s["bytes"] < s["total"]
               and s["rate_bytes_per_s"] and s["eta_s"] is not None]
        self.assertTrue(mid, js_out)
        self.assertTrue(all(s["rate_bytes_per_s"] > 0 and s["eta_s"] >= 0 for s in mid))
        self.assertEqual([s["phase"] for s in ours if not s["in_progress"]], ["committed"])
        self.assertEqual((ours[-1]["phase"], ours[-1]["done"]), ("committed", True))
        self.assertEqual(ours[-1]["bytes"], self.total_bytes)
        self.assertEqual(ours[-1], samples[-1])
        times = [s["t"] for s in samples]
        self.assertEqual(times, sorted(times))

        self.assertNotIn("\r", tx_out)
        lines = tx_out.splitlines()
        self.assertTrue(all(a != b for a, b in zip(lines, lines[1:])), tx_out)  # per change
        pcts = [float(m.group(4)) for m in map(PROGRESS.fullmatch, lines) if m]
        self.assertTrue(any(0 < p < 100 for p in pcts), tx_out)
        self.assertEqual(pcts, sorted(pcts))
        self.assertRegex(lines[-1], r"^update ws-watch-pipe v4 committed  2\.6 MB  \d+ chunks  "
                                    r"engines e0, e1$")
        self.assertTrue(all(PROGRESS.fullmatch(line) for line in lines[:-1]), tx_out)

    def test_09_watch_failed_update(self):
        """An update that fails: watch --until_done exits 1, status shows
        DIRTY engines and the error; a full update repairs them."""
        cmd = [self.ctl_bin, f"--socket={self.sock}", "watch", "--until_done",
               "--interval_ms=50"]
        tx = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        js = subprocess.Popen(cmd + ["--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True)
        self.assertIsNotNone(wait_line(tx))
        self.assertIsNotNone(wait_line(js))
        trainer = self.slow_update("ws-watch-fail", 5, 5, abort_after=8)
        out, err = trainer.communicate(timeout=60)
        self.assertEqual((trainer.returncode, out.strip()), (0, "aborted"), err)
        tx_out, tx_err = tx.communicate(timeout=15)
        self.assertEqual(tx.returncode, 1, tx_out + tx_err)
        js_out, _ = js.communicate(timeout=15)
        self.assertEqual(js.returncode, 1, js_out)
        ours = [s for s in map(json.loads, js_out.splitlines())
                if s["update_id"] == "ws-watch-fail"]
        got = [s["bytes"] for s in ours]
        self.assertEqual(got, sorted(got), "bytes went down")
        self.assertGreater(got[-1], 0)  # what it had received when it failed
        self.assertEqual((ours[-1]["phase"], ours[-1]["done"], ours[-1]["in_progress"]),
                         ("failed", True, False))
        self.assertIn("stopped by weightsyncctl_test", ours[-1]["error"])
        last = tx_out.splitlines()[-1]
        self.assertRegex(last, r"^update ws-watch-fail v5 failed after (\d+\.\d\d)/\d+\.\d\d MB: "
                               r".*stopped by weightsyncctl_test")
        self.assertGreater(float(re.search(r"after (\d+\.\d\d)/", last).group(1)), 0)
        status = self.ok("status")
        self.assertEqual({e: r[0] for e, r in self.engine_rows(status).items()},
                         {"e0": "DIRTY", "e1": "DIRTY"}, status)
        self.assertRegex(status, r"(?m)^last update: ws-watch-fail  version 5  streaming  failed$")
        self.assertRegex(status, r"(?m)^  error: .*stopped by weightsyncctl_test")
        self.assertRegex(status, r"(?m)^  total 2\.63 MB, \d+ chunks; engines e0, e1$")
        out = self.ok("resume", "--allow_dirty")
        self.assertEqual({e: r[0] for e, r in self.engine_rows(out).items()},
                         {"e0": "DIRTY", "e1": "DIRTY"}, out)
        w6 = weights(6)
        r6 = self.update(w6, 6, "u6")
        self.assertEqual(self.states(), {"e0": "ENGINE_READY", "e1": "ENGINE_READY"})
        receipts = {e.engine_id: e.receipt.checksum for e in r6.engines}
        self.assertEqual(self.check("e0"), (receipts["e0"], 6))


if __name__ == "__main__":
    unittest.main(verbosity=2)

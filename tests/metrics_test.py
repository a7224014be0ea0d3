#!/usr/bin/env python3
"""The Prometheus endpoint of a live daemon (issue 7): the real weightsyncd
with --metrics_address, two engine processes and a trainer on the host
backend; scrapes /metrics over HTTP and checks what updates, a failure, a
pause and a staged update in progress must have made of it.

    WEIGHTSYNCD=bazel-bin/daemon/weightsyncd python3 tests/metrics_test.py
"""

import os
import shutil
import re
import sys
import tempfile
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "faults"))
sys.path.insert(0, os.path.join(HERE, "..", "client", "python"))

import numpy as np  # noqa: E402

import faults as F  # noqa: E402
import weightsync  # noqa: E402
from weightsync import planner  # noqa: E402
from weightsync._proto import v1  # noqa: E402

SAMPLE = re.compile(r"^([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+(\S+)$")


def scrape(port):
    """{(name, frozenset(labels)): value} of one scrape."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out = {}
    for line in text.splitlines():
        m = SAMPLE.match(line)
        if not m:
            continue
        labels = frozenset(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
        out[(m.group(1), labels)] = float(m.group(3))
    return out


def get(samples, name, **labels):
    return samples.get((name, frozenset(labels.items())))


class Check:
    def __init__(self):
        self.failures = []

    def __call__(self, what, ok, got=None):
        print(f"{'PASS' if ok else 'FAIL'} {what}" + ("" if ok else f": got {got}"), flush=True)
        if not ok:
            self.failures.append(what)


def main():
    daemon_bin = os.environ["WEIGHTSYNCD"]
    work = tempfile.mkdtemp(prefix="ws-metrics.", dir="/tmp")
    os.chmod(work, 0o750)
    sock, log = os.path.join(work, "d.sock"), os.path.join(work, "daemon.log")
    import subprocess
    daemon = subprocess.Popen([daemon_bin, f"--socket={sock}", "--metrics_address=127.0.0.1:0",
                               f"--chunk_bytes={F.CHUNK}"], stderr=open(log, "w"))
    port = None
    for _ in range(200):
        m = re.search(r"metrics on \S+ \(port (\d+)\)", open(log).read())
        if m and os.path.exists(sock):
            port = int(m.group(1))
            break
        time.sleep(0.025)
    if port is None:
        print(open(log).read())
        raise SystemExit("the daemon did not say where its metrics are")
    procs = []
    check = Check()
    try:
        target = "unix:" + sock
        for eid in ("e0", "e1"):
            procs.append(F.start_engine(eid, target, os.path.join(work, f"{eid}.log")))
        t = weightsync.Trainer(target, timeout=10)
        for _ in range(100):
            if all(e.connected for e in t.status().engines):
                break
            time.sleep(0.02)
        s = scrape(port)
        check("2 engines, READY at version 0",
              get(s, "weightsync_engines") == 2 and
              get(s, "weightsync_engine_weight_version", engine="e0") == 0 and
              get(s, "weightsync_engine_state", engine="e1", state="READY") == 1, s)

        t.init_host()
        nbytes = sum(int(np.prod(shape)) * 4 for _, shape in F.PARAMS)
        for version in (1, 2):
            t.update(F.weights(version), version=version, chunk_bytes=F.CHUNK)
        # A failed update: started, then aborted by the trainer.
        manifest = [dict(name=n, dtype="FLOAT32", shape=list(a.shape)) for n, a in F.weights(3)]
        t._stub.call("StartWeightUpdate", v1.StartWeightUpdateRequest(
            update_id="doomed", target_version=3, chunk_bytes=F.CHUNK,
            tensors=[v1.TensorSpec(name=m["name"], dtype=v1.FLOAT32, shape=m["shape"])
                     for m in manifest]))
        t._stub.call("AbortWeightUpdate", update_id="doomed", reason="test")
        # An explicit pause of at least 0.3 s.
        t.pause()
        time.sleep(0.3)
        t.resume(allow_dirty=True)

        s = scrape(port)
        committed = dict(backend="host", mode="streaming", result="committed")
        check("2 committed updates counted",
              get(s, "weightsync_updates_total", **committed) == 2, s)
        check("1 failed update, reason ABORTED",
              get(s, "weightsync_updates_total", backend="host", mode="streaming",
                  result="failed") == 1 and
              get(s, "weightsync_update_failures_total", backend="host", reason="ABORTED") == 1,
              {k: v for k, v in s.items() if "fail" in k[0] or "updates_total" in k[0]})
        check(f"bytes of the committed updates = 2 x {nbytes}",
              get(s, "weightsync_update_bytes_total", backend="host") == 2 * nbytes, s)
        check("duration, pause and GB/s histograms hold both updates",
              get(s, "weightsync_update_duration_seconds_count", backend="host",
                  mode="streaming") == 2 and
              get(s, "weightsync_update_pause_seconds_count", backend="host",
                  mode="streaming") == 2 and
              get(s, "weightsync_update_throughput_gbps_count", backend="host",
                  mode="streaming") == 2 and
              get(s, "weightsync_update_duration_seconds_sum", backend="host",
                  mode="streaming") > 0, s)
        check("engines at version 2",
              get(s, "weightsync_engine_weight_version", engine="e0") == 2 and
              get(s, "weightsync_engine_weight_version", engine="e1") == 2, s)
        paused = get(s, "weightsync_engine_paused_seconds_total", engine="e0")
        check("e0 paused for >= 0.3 s in all", paused is not None and paused >= 0.3, paused)
        check("no update in progress, no staging held",
              get(s, "weightsync_update_in_progress") == 0 and
              get(s, "weightsync_staging_bytes") == 0, s)

        # A staged update with every chunk received but not committed: its
        # chunks are the daemon's staging now.
        w = F.weights(4)
        manifest = [dict(name=n, dtype="FLOAT32", shape=list(a.shape)) for n, a in w]
        started = t._stub.call("StartWeightUpdate", v1.StartWeightUpdateRequest(
            update_id="staged", target_version=4, chunk_bytes=F.CHUNK,
            mode=v1.UPDATE_MODE_STAGED,
            tensors=[v1.TensorSpec(name=m["name"], dtype=v1.FLOAT32, shape=m["shape"])
                     for m in manifest]))
        plan = planner.plan_chunks(manifest, started.chunk_bytes)
        data = [a.view(np.uint8).reshape(-1) for _, a in w]

        def chunks():
            for c in plan["chunks"]:
                yield v1.PushChunksRequest(update_id="staged", chunk_index=c["index"],
                                           data=planner.pack_chunk(c, data))
        t._stub.call("PushChunks", chunks(), timeout=60)
        s = scrape(port)
        check(f"staged update in progress holds its {nbytes} bytes of staging",
              get(s, "weightsync_update_in_progress") == 1 and
              get(s, "weightsync_update_received_bytes") == nbytes and
              get(s, "weightsync_update_total_bytes") == nbytes and
              get(s, "weightsync_staging_bytes") == nbytes,
              {k: v for k, v in s.items() if "update_" in k[0] or "staging" in k[0]})
        r = t._stub.call("FinishWeightUpdate", update_id="staged", timeout=10)
        s = scrape(port)
        check("after the commit: staged update counted, staging released, version 4",
              r.version == 4 and
              get(s, "weightsync_updates_total", backend="host", mode="staged",
                  result="committed") == 1 and
              get(s, "weightsync_staging_bytes") == 0 and
              get(s, "weightsync_engine_weight_version", engine="e1") == 4, s)
    finally:
        code = F.stop_all(procs, daemon)
    check("daemon exits 0 after SIGTERM", code == 0, code)
    # Logs: one event line per engine and update event, with its fields.
    text = open(log).read()
    for pattern in (r"event=engine\.registered version=0 engine=e0: ",
                    r"event=group\.formed: ",
                    r"event=update\.started update=\S+ version=1 engine=e0,e1: streaming",
                    r"event=update\.committed update=\S+ version=2 engine=e0,e1: ",
                    r"event=update\.failed update=doomed version=3 engine=e0,e1: ",
                    r"event=update\.started update=staged version=4 engine=e0,e1: staged",
                    r"event=update\.committed update=staged version=4 engine=e0,e1: "):
        check(f"daemon log has /{pattern}/", re.search(pattern, text) is not None)
    print(f"metrics: {'PASS' if not check.failures else 'FAIL'}; "
          + (f"logs in {work}" if check.failures else "logs removed"))
    if not check.failures:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if check.failures else 0


if __name__ == "__main__":
    sys.exit(main())

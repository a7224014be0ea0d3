#!/usr/bin/env python3
"""What one call costs the daemon (issue 35): one client on the daemon's
Unix socket calls GetStatus, health Check and CheckEngine (of one 64 MiB
host engine) back to back; prints the daemon's CPU time per call (utime +
stime from /proc, so a busy machine inflates wall time, not this), the
client's, and the wall time. Then --checkers threads (own channels) call
CheckEngine of that engine at once, 30 calls each: the daemon's CPU per
answered check (concurrent checks of one engine share one read).

    WEIGHTSYNCD=bazel-bin/daemon/weightsyncd /usr/bin/python3 bench/call_cost.py \
        [--calls 6000] [--checkers 2]
"""

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "client",
                                "python"))
import grpc  # noqa: E402
import weightsync  # noqa: E402
from weightsync._proto import v1  # noqa: E402


def cpu_s(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=6000)
    ap.add_argument("--checkers", type=int, default=2)
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="wscallcost-")
    sock = os.path.join(tmp, "sock")
    with open(os.path.join(tmp, "log"), "w") as log:
        daemon = subprocess.Popen([os.environ["WEIGHTSYNCD"], f"--socket={sock}"], stderr=log)
    try:
        target = "unix:" + sock
        for _ in range(200):
            if os.path.exists(sock):
                break
            time.sleep(0.05)
        engine = weightsync.Engine("e0", target, timeout=30)
        engine.register_host([(f"w{i}", "FLOAT32", (4096, 1024)) for i in range(4)])
        engine.start()
        ch = grpc.insecure_channel(target)
        status = ch.unary_unary("/weightsync.v1.TrainerService/GetStatus",
                                request_serializer=v1.GetStatusRequest.SerializeToString,
                                response_deserializer=v1.GetStatusResponse.FromString)
        health = ch.unary_unary("/grpc.health.v1.Health/Check",
                                request_serializer=lambda x: x, response_deserializer=lambda r: r)
        check = ch.unary_unary("/weightsync.v1.TrainerService/CheckEngine",
                               request_serializer=v1.CheckEngineRequest.SerializeToString,
                               response_deserializer=v1.CheckEngineResponse.FromString)
        rows = [("GetStatus", lambda: status(v1.GetStatusRequest(), timeout=30), args.calls),
                ("health Check", lambda: health(b"", timeout=30), args.calls),
                ("CheckEngine 64 MiB", lambda: check(v1.CheckEngineRequest(engine_id="e0"),
                                                     timeout=30), max(1, args.calls // 100))]
        for name, call, n in rows:
            call()
            d0, c0, t0 = cpu_s(daemon.pid), time.process_time(), time.time()
            for _ in range(n):
                call()
            d1, c1, t1 = cpu_s(daemon.pid), time.process_time(), time.time()
            print(f"{name} ({n} calls): daemon {1e6 * (d1 - d0) / n:.0f} us CPU/call, "
                  f"client {1e6 * (c1 - c0) / n:.0f} us CPU/call, "
                  f"wall {1e6 * (t1 - t0) / n:.0f} us/call")
        counts = {"ok": 0, "refused": 0}
        lock = threading.Lock()

        def checker():
            with grpc.insecure_channel(target) as own:
                call = own.unary_unary(
                    "/weightsync.v1.TrainerService/CheckEngine",
                    request_serializer=v1.CheckEngineRequest.SerializeToString,
                    response_deserializer=v1.CheckEngineResponse.FromString)
                for _ in range(30):
                    try:
                        call(v1.CheckEngineRequest(engine_id="e0"), timeout=30)
                        k = "ok"
                    except grpc.RpcError:
                        k = "refused"
                    with lock:
                        counts[k] += 1

        d0, t0 = cpu_s(daemon.pid), time.time()
        threads = [threading.Thread(target=checker) for _ in range(args.checkers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        d1, t1 = cpu_s(daemon.pid), time.time()
        print(f"{args.checkers} concurrent checkers: {counts['ok']} answered, "
              f"{counts['refused']} refused; daemon {1e3 * (d1 - d0) / max(counts['ok'], 1):.1f} "
              f"ms CPU per answered check, wall {t1 - t0:.2f} s")
        engine.close()
        ch.close()
    finally:
        daemon.terminate()
        daemon.wait()
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

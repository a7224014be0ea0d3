#!/usr/bin/env python3
"""The daemon under load and abuse (issue 35), against the real weightsyncd:

* 2,000 Control streams that never send, on one Unix connection: the
  daemon's threads stay bounded, the streams past
  --max_control_streams_per_peer are refused with RESOURCE_EXHAUSTED naming
  the flag, and the threads go back when the streams close;
* the descriptor limit reached (RLIMIT_NOFILE 64) on both listeners: no
  spinning (the daemon's CPU while it is out of descriptors), health
  NOT_SERVING on an open connection, then both listeners accept again
  (a TLS + token call on TCP, a call on a new Unix connection);
* a 16 MiB header block: refused; the daemon's CPU for it is printed
  (gRPC 1.51 parses a header block before it checks its size: see
  docs/security.md);
* requests to /metrics that stop half way: scrapes are still served;
* a thousand wrong tokens: counted in /metrics, logged with the address,
  and slowed once they come fast;
* 8 CheckEngine readers hammering during updates: the median update at most
  3x the unloaded one (same run; the 1.5x target is bench/load_bench.py's;
  judged only where the daemon is not built with ASan or coverage);
* a TLS certificate that expires within a week: warned, and health's
  weightsync.tls_certificate NOT_SERVING.

    WEIGHTSYNCD=bazel-bin/daemon/weightsyncd python3 tests/limits_test.py [case ...]
"""

import asyncio
import mmap
import os
import re
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "client", "python"))

import grpc  # noqa: E402
import numpy as np  # noqa: E402

import weightsync  # noqa: E402
from weightsync._proto import v1  # noqa: E402

TOKEN = "limits-test-token"
FAILURES = []


def check(what, ok, got=None):
    print(f"{'PASS' if ok else 'FAIL'} {what}" + ("" if ok else f": got {got}"), flush=True)
    if not ok:
        FAILURES.append(what)


def cpu_seconds(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def threads(pid):
    with open(f"/proc/{pid}/status") as f:
        return int(re.search(r"^Threads:\s+(\d+)", f.read(), re.M).group(1))


class Daemon:
    """weightsyncd on a Unix socket in `work`, optionally TCP (TLS + token)
    and /metrics; `nofile`: its RLIMIT_NOFILE (soft and hard)."""

    def __init__(self, work, tcp=False, metrics=False, nofile=None, extra=(), cert_days=30):
        self.work, self.sock = work, os.path.join(work, "d.sock")
        self.log_path = os.path.join(work, "daemon.log")
        args = [os.environ["WEIGHTSYNCD"], f"--socket={self.sock}", *extra]
        if tcp:
            self.cert = os.path.join(work, "cert.pem")
            key = os.path.join(work, "key.pem")
            subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes",
                            "-days", str(cert_days), "-subj", "/CN=localhost", "-addext",
                            "subjectAltName=IP:127.0.0.1", "-keyout", key, "-out", self.cert],
                           check=True, capture_output=True)
            token = os.path.join(work, "token")
            with open(os.open(token, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
                f.write(TOKEN)
            args += ["--tcp=127.0.0.1:0", f"--tls_cert={self.cert}", f"--tls_key={key}",
                     f"--token_file={token}"]
        if metrics:
            args.append("--metrics_address=127.0.0.1:0")

        def limit():
            if nofile:
                resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

        self.p = subprocess.Popen(args, stderr=open(self.log_path, "w"), preexec_fn=limit)
        self.tcp_port = self.metrics_port = None
        end = time.time() + 15
        while time.time() < end:
            text = self.log()
            if "listening on unix:" in text:
                m = re.search(r"tcp port (\d+)", text)
                self.tcp_port = int(m.group(1)) if m else None
                m = re.search(r"\(port (\d+)\)/metrics", text)
                self.metrics_port = int(m.group(1)) if m else None
                return
            if self.p.poll() is not None:
                break
            time.sleep(0.05)
        raise RuntimeError("daemon did not start:\n" + self.log())

    def log(self):
        with open(self.log_path) as f:
            return f.read()

    def unix_channel(self):
        return grpc.insecure_channel("unix:" + self.sock)

    def tcp_channel(self):
        with open(self.cert, "rb") as f:
            creds = grpc.ssl_channel_credentials(f.read())
        return grpc.secure_channel(f"127.0.0.1:{self.tcp_port}", creds)

    def scrape(self, timeout=5):
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        return urllib.request.urlopen(url, timeout=timeout).read().decode()

    def stop(self):
        self.p.terminate()
        try:
            self.p.wait(10)
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait()


def instrumented_daemon():
    """"ASan" or "coverage" when $WEIGHTSYNCD was built so (--config=asan,
    --config=cov), else None: such a daemon's timings are not the product's."""
    with open(os.environ["WEIGHTSYNCD"], "rb") as f:
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            if m.find(b"__asan_init") >= 0:
                return "ASan"
            if m.find(b"__llvm_profile_runtime") >= 0:
                return "coverage"
    return None


def health(channel, service="", timeout=3, metadata=None):
    """grpc.health.v1 Check: 1 SERVING, 2 NOT_SERVING (no health stubs in
    Debian's python3-grpcio, so the two tiny messages are encoded here)."""
    b = service.encode()
    req = (b"\x0a" + bytes([len(b)]) + b) if b else b""
    call = channel.unary_unary("/grpc.health.v1.Health/Check",
                               request_serializer=lambda x: x,
                               response_deserializer=lambda r: r[1] if len(r) >= 2 else 0)
    return call(req, timeout=timeout, metadata=metadata)


def get_status(channel, timeout=5, metadata=None):
    call = channel.unary_unary("/weightsync.v1.TrainerService/GetStatus",
                               request_serializer=v1.GetStatusRequest.SerializeToString,
                               response_deserializer=v1.GetStatusResponse.FromString)
    return call(v1.GetStatusRequest(), timeout=timeout, metadata=metadata)


def bearer(token=TOKEN):
    return [("authorization", "Bearer " + token)]


def metric(text, name, **labels):
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    m = re.search(rf"^{name}(?:\{{{re.escape(want)}\}})?\s+(\S+)$", text, re.M)
    return float(m.group(1)) if m else None


def case_idle_streams(work):
    """2,000 Control streams that never send, on one connection: the
    per-peer cap holds 64 and refuses the rest naming its flag; then the
    same against a daemon whose --max_threads=40 leaves room for 32 streams
    of all peers: that cap refuses first (not gRPC's own thread quota),
    naming --max_threads."""
    idle_streams(work, (), 64, "--max_control_streams_per_peer=64")
    idle_streams(os.path.join(work, "threads"), ("--max_threads=40",), 32,
                 "--max_threads=40", also="Server Threadpool Exhausted")


def idle_streams(work, extra, cap, flag, also=None):
    """`also`: a refusal that may stand in for the cap's in a burst (gRPC's
    own thread quota, met when 2,000 arrive at once and the spare threads
    are all busy refusing)."""
    os.makedirs(work, mode=0o750, exist_ok=True)
    d = Daemon(work, extra=extra)
    try:
        ch = d.unix_channel()
        health(ch)
        before = threads(d.p.pid)

        async def run():
            async with grpc.aio.insecure_channel("unix:" + d.sock) as ach:
                method = ach.stream_stream("/weightsync.v1.EngineService/Control")
                calls = [method() for _ in range(2000)]
                codes, details = {}, {}
                end = time.time() + 30
                pending = list(calls)
                while time.time() < end:
                    still = []
                    for c in pending:
                        if c.done():
                            code = await c.code()
                            codes[code] = codes.get(code, 0) + 1
                            why = await c.details()
                            details[why] = details.get(why, 0) + 1
                        else:
                            still.append(c)
                    pending = still
                    if len(pending) <= cap:
                        await asyncio.sleep(0.5)  # the held ones settle
                        break
                    await asyncio.sleep(0.1)
                peak = threads(d.p.pid)
                held = len(pending)
                for c in pending:
                    c.cancel()
                return codes, details, peak, held

        t0 = time.time()
        codes, details, peak, held = asyncio.run(run())
        print(f"  2000 idle Control streams {' '.join(extra)}: {codes}, {held} held, "
              f"threads {before} -> {peak} (in {time.time() - t0:.1f} s); refusals "
              f"{ {why[:40]: n for why, n in details.items()} }")
        check(f"idle streams {flag}: the excess refused RESOURCE_EXHAUSTED",
              codes.get(grpc.StatusCode.RESOURCE_EXHAUSTED, 0) == 2000 - cap, codes)
        named = sum(n for x, n in details.items() if flag in x)
        check(f"idle streams: the refusals name {flag}" + (f" (or are {also!r})" if also else ""),
              named > 0 and all(flag in x or x == also for x in details), details)
        check(f"idle streams {flag}: {cap} held open", held == cap, held)
        check(f"idle streams {flag}: threads bounded (<= before + {cap} + 16)",
              peak <= before + cap + 16, (before, peak))
        end = time.time() + 10
        while threads(d.p.pid) > before + 8 and time.time() < end:
            time.sleep(0.2)
        check("idle streams: threads back after the streams close",
              threads(d.p.pid) <= before + 8, (before, threads(d.p.pid)))
        check("idle streams: the daemon still answers", health(ch) == 1)
    finally:
        d.stop()


def case_emfile(work):
    d = Daemon(work, tcp=True, nofile=64)
    held = []
    try:
        ch = d.unix_channel()
        check("emfile: health SERVING at start", health(ch) == 1)
        for _ in range(100):
            for family, addr in ((socket.AF_INET, ("127.0.0.1", d.tcp_port)),
                                 (socket.AF_UNIX, d.sock)):
                s = socket.socket(family, socket.SOCK_STREAM)
                s.setblocking(False)
                try:
                    s.connect(addr)
                except (BlockingIOError, OSError):
                    pass
                held.append(s)
        time.sleep(1.0)  # the daemon runs out of descriptors
        c0 = cpu_seconds(d.p.pid)
        time.sleep(2.0)
        cpu = cpu_seconds(d.p.pid) - c0
        print(f"  daemon CPU while out of descriptors: {cpu:.2f} s in 2 s")
        check("emfile: no spinning (daemon CPU < 0.3 s in 2 s)", cpu < 0.3, cpu)
        check("emfile: the log says it can't accept",
              "can't accept connections" in d.log(), d.log()[-2000:])
        check("emfile: health NOT_SERVING on an open connection", health(ch) == 2)
        for s in held:
            s.close()
        held.clear()
        end = time.time() + 10
        ok_tcp = ok_unix = False
        while time.time() < end and not (ok_tcp and ok_unix):
            try:
                if not ok_tcp:
                    get_status(d.tcp_channel(), timeout=1, metadata=bearer())
                    ok_tcp = True
                if not ok_unix:
                    get_status(d.unix_channel(), timeout=1)
                    ok_unix = True
            except grpc.RpcError:
                time.sleep(0.2)
        t = 10 - (end - time.time())
        check(f"emfile: TCP (TLS + token) accepts again ({t:.1f} s)", ok_tcp)
        check("emfile: the Unix socket accepts again", ok_unix)
        time.sleep(0.6)
        check("emfile: health SERVING again", health(ch) == 1)
    finally:
        for s in held:
            s.close()
        d.stop()


def case_big_header(work):
    d = Daemon(work, tcp=True)
    try:
        ch = d.tcp_channel()
        health(ch, metadata=bearer())  # connected: settings exchanged
        c0 = cpu_seconds(d.p.pid)
        try:
            health(ch, metadata=[("x-big", "a" * (64 << 10))], timeout=10)
            code = grpc.StatusCode.OK
        except grpc.RpcError as e:
            code = e.code()
        cpu = cpu_seconds(d.p.pid) - c0
        print(f"  64 KiB header block: {code}, daemon CPU {cpu:.3f} s")
        check("big header: 64 KiB refused RESOURCE_EXHAUSTED (over --max_metadata_bytes)",
              code == grpc.StatusCode.RESOURCE_EXHAUSTED, code)
        check("big header: not counted as a wrong token (refused before the check)",
              "refused for a missing or wrong bearer token" not in d.log())
        check("big header: 64 KiB costs under 0.1 s of daemon CPU", cpu < 0.1, cpu)
        if os.environ.get("LIMITS_TEST_16MIB"):
            c0 = cpu_seconds(d.p.pid)
            try:
                health(ch, metadata=[("x-big", "a" * (16 << 20))], timeout=120)
            except grpc.RpcError as e:
                print(f"  16 MiB header block: {e.code()}, daemon CPU "
                      f"{cpu_seconds(d.p.pid) - c0:.2f} s (gRPC 1.51's HPACK parser)")
    finally:
        d.stop()


def case_metrics_partial(work):
    d = Daemon(work, metrics=True)
    held = []
    try:
        for _ in range(6):
            s = socket.create_connection(("127.0.0.1", d.metrics_port))
            s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
            held.append(s)
        times = []
        for _ in range(3):
            t0 = time.time()
            ok = "weightsync_engines" in d.scrape(timeout=5)
            times.append(time.time() - t0)
        print(f"  scrapes with 6 half-sent requests held: {[round(t, 2) for t in times]} s")
        check("metrics: scrapes served while half requests are held",
              ok and max(times) < 3, times)
    finally:
        for s in held:
            s.close()
        d.stop()


def case_wrong_tokens(work):
    d = Daemon(work, tcp=True, metrics=True)
    try:
        ch = d.tcp_channel()
        health(ch, metadata=bearer())
        t0 = time.time()
        first = []
        for i in range(26):
            t = time.time()
            try:
                health(ch, metadata=bearer("wrong"), timeout=5)
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.UNAUTHENTICATED, e
            first.append(time.time() - t)
        fast, slow = np.median(first[:10]), np.median(first[21:])
        print(f"  wrong token: median {fast * 1e3:.1f} ms for the first 10, "
              f"{slow * 1e3:.0f} ms once they come fast")
        check("wrong tokens: slowed once they come fast (>= 200 ms each)", slow >= 0.2, slow)
        # The rest at once, concurrently: refused, counted, never more than
        # a few held waiting.
        call = ch.unary_unary("/grpc.health.v1.Health/Check",
                              request_serializer=lambda x: x, response_deserializer=lambda r: r)
        futures = [call.future(b"", metadata=bearer("wrong"), timeout=30) for _ in range(974)]
        peak = 0
        while not all(f.done() for f in futures):
            peak = max(peak, threads(d.p.pid))
            time.sleep(0.05)
        codes = {f.code() for f in futures}
        print(f"  1000 wrong tokens in {time.time() - t0:.1f} s, daemon threads peak {peak}")
        check("wrong tokens: every one UNAUTHENTICATED",
              codes == {grpc.StatusCode.UNAUTHENTICATED}, codes)
        text = d.scrape()
        check("wrong tokens: counted (weightsync_auth_failures_total 1000)",
              metric(text, "weightsync_auth_failures_total") == 1000,
              metric(text, "weightsync_auth_failures_total"))
        log = d.log()
        check("wrong tokens: logged with the address, rate-limited",
              "latest TCP connections from ipv4:127.0.0.1" in log
              and log.count("missing or wrong bearer token") <= 3, log[-1500:])
        check("wrong tokens: a right token still served", health(ch, metadata=bearer()) == 1)
    finally:
        d.stop()


def case_engine_reads(work):
    """8 readers hammering CheckEngine + GetStatus + health while a trainer
    updates (bench/load_bench.py's machinery, smaller): the median update
    at most 3x the unloaded one of the same run (before issue 35: 4.7x).
    Issue 35's target is 1.5x; a quiet 2-core VM measured 2.15-2.22x on
    2026-11-28, and readers calling only GetStatus + health slow an update
    as much (bench/RESULTS.md, "Updates under concurrent readers": the
    readers' client CPU and the daemon's per-call gRPC work take the
    trainer's CPU on 2 cores, not the engine reads), so this bound pins the
    fix, not the target. Rows unloaded, loaded, unloaded, loaded, each
    side's updates pooled, so that a change in the machine's other load
    (CI runs two tests at once) falls on both sides; a failing comparison
    is measured once more.

    In an instrumented daemon (CI's ASan pass, the coverage run) the ratio
    is printed, not judged: each of the readers' calls costs such a daemon
    several times the CPU, so the ratio measures the instrumentation (on
    one loaded 2-core VM, 2026-11-28: ASan 1.79-4.29x, coverage 2.50-3.58x,
    the plain build 1.76-2.73x); the plain build's run in CI judges it."""
    sys.path.insert(0, os.path.join(HERE, "..", "bench"))
    import load_bench
    instrumented = instrumented_daemon()
    for attempt in (1, 2):
        rows = load_bench.run(mib=16, updates=5, reader_counts=[8, 0, 8])
        steady = {0: [], 8: []}
        for r in rows:
            steady[r["readers"]] += r["seconds"][1:]  # the first pays the connection
        base, loaded = float(np.median(steady[0])), float(np.median(steady[8]))
        ratio = loaded / base
        calls = [r["reader_calls"] for r in rows if r["readers"]]
        print(f"  updates of 16 MiB: unloaded median {base:.3f} s, with 8 readers "
              f"{loaded:.3f} s ({ratio:.2f}x; readers got {calls})")
        if ratio <= 3.0 or instrumented:
            break
    if instrumented:
        print(f"  (an {instrumented} daemon: the ratio is not judged)")
    else:
        check("engine reads: 8 readers slow updates at most 3x", ratio <= 3.0, ratio)
    check("engine reads: the readers were served", all(c["ok"] > 0 for c in calls), calls)


def case_cert_expiry(work):
    """A certificate that expires within a week: warned at start, and
    health's weightsync.tls_certificate says NOT_SERVING (the listener and
    "" still serve); a 30-day one is SERVING."""
    d = Daemon(work, tcp=True, cert_days=3)
    try:
        ch = d.unix_channel()
        check("cert: warned at start", "expires at" in d.log() and "in 3.0 days" in d.log()
              or "in 2.9 days" in d.log(), d.log()[-800:])
        check("cert: weightsync.tls_certificate NOT_SERVING within 7 days",
              health(ch, "weightsync.tls_certificate") == 2)
        check("cert: weightsync.tcp and \"\" still SERVING",
              health(ch, "weightsync.tcp") == 1 and health(ch) == 1)
    finally:
        d.stop()
    # Another socket path: gRPC shares connections between channels to one
    # target, and the first daemon's is gone.
    work2 = os.path.join(work, "second")
    os.mkdir(work2, 0o750)
    d = Daemon(work2, tcp=True, cert_days=30)
    try:
        check("cert: a 30-day certificate is SERVING, no warning",
              health(d.unix_channel(), "weightsync.tls_certificate") == 1
              and "expires at" not in d.log())
    finally:
        d.stop()


CASES = {"idle_streams": case_idle_streams, "emfile": case_emfile,
         "big_header": case_big_header, "metrics_partial": case_metrics_partial,
         "wrong_tokens": case_wrong_tokens, "engine_reads": case_engine_reads,
         "cert_expiry": case_cert_expiry}


def main():
    names = sys.argv[1:] or list(CASES)
    for name in names:
        work = tempfile.mkdtemp(prefix="ws-limits-")
        os.chmod(work, 0o750)
        t0 = time.time()
        try:
            CASES[name](work)
        except Exception as e:  # noqa: BLE001
            check(f"{name}: ran", False, repr(e))
        finally:
            print(f"  ({name}: {time.time() - t0:.1f} s)", flush=True)
            shutil.rmtree(work, ignore_errors=True)
    if FAILURES:
        print(f"{len(FAILURES)} FAILED: {FAILURES}")
        return 1
    print("all passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())

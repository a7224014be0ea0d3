"""`python -m weightsync` (weightsync/_cli.py): versions and the daemon's
health, against the real weightsyncd and against stand-ins that answer
what a real daemon rarely does (NOT_SERVING, a version in build_info).

Run by Bazel (//client/python:cli_test) with WEIGHTSYNCD pointing at the
daemon binary; also by hand: WEIGHTSYNCD=bazel-bin/daemon/weightsyncd
python3 client/python/tests/test_cli.py
"""

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import unittest
from concurrent import futures

# The source tree's package, unless WEIGHTSYNC_TEST_INSTALLED=1: then the
# installed one (tests/pip_install_test.sh runs the suite that way).
if not os.environ.get("WEIGHTSYNC_TEST_INSTALLED"):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import grpc  # noqa: E402

import daemon_fixture  # noqa: E402  (next to this file)
import weightsync  # noqa: E402
from weightsync import _proto  # noqa: E402
from weightsync._proto import v1  # noqa: E402


def run_cli(*args, env=None):
    """`python -m weightsync ARGS` with this interpreter and the package
    this test imported (the source tree's or the installed one)."""
    full_env = dict(os.environ, **(env or {}))
    package_parent = os.path.dirname(os.path.dirname(os.path.abspath(weightsync.__file__)))
    full_env["PYTHONPATH"] = package_parent
    p = subprocess.run([sys.executable, "-m", "weightsync", *args], env=full_env,
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=60)
    return p.returncode, p.stdout


class CliAgainstDaemonTest(unittest.TestCase):
    def test_version(self):
        code, out = run_cli("--version")
        self.assertEqual(code, 0, out)
        self.assertEqual(out.strip(), f"weightsync {weightsync.__version__}")
        self.assertRegex(weightsync.__version__, r"^\d+\.\d+\.\d+")

    def test_healthy_daemon_reports_itself(self):
        daemon, target = daemon_fixture.start(self)
        code, out = run_cli("--target", target)
        self.assertEqual(code, 0, out)
        self.assertIn(f"weightsync {weightsync.__version__} (Python package, "
                      f"{os.path.dirname(os.path.abspath(weightsync.__file__))})", out)
        self.assertIn(f"daemon {target}: SERVING", out)
        self.assertRegex(out, r"daemon build: built with(out)? CUDA")  # either build
        self.assertIn("backend: none yet", out)
        self.assertIn("engines: none registered", out)
        self.assertRegex(out, r"daemon version: (not reported by this daemon|\d+\.\d+\.\d+)")

        # An engine and a host group: the status lines say so. A plain
        # socket path works as a target too.
        engine = weightsync.Engine("e0", target, timeout=10)
        engine.register_host([("a", "FLOAT32", (4,))])
        engine.start()
        self.addCleanup(engine.close)
        trainer = weightsync.Trainer(target, timeout=10)
        self.addCleanup(trainer.close)
        trainer.init_host()
        for _ in range(100):
            if all(s.connected for s in trainer.status().engines):
                break
            time.sleep(0.02)
        code, out = run_cli("--target", target[len("unix:"):])
        self.assertEqual(code, 0, out)
        self.assertIn("backend: host", out)
        self.assertIn("engines: 1 (1 ready), version 0", out)

    def test_default_target_is_the_daemons_default_socket(self):
        # The daemon run without --socket and the CLI run without --target
        # meet at default_target() (under $XDG_RUNTIME_DIR here).
        runtime = tempfile.mkdtemp(prefix="wspy.", dir="/tmp")
        self.addCleanup(shutil.rmtree, runtime, True)
        env = dict(os.environ, XDG_RUNTIME_DIR=runtime)
        daemon = subprocess.Popen([os.environ["WEIGHTSYNCD"]], env=env,
                                  stderr=subprocess.DEVNULL)
        self.addCleanup(daemon.wait)
        self.addCleanup(daemon.terminate)
        sock = os.path.join(runtime, "weightsync", "weightsyncd.sock")
        for _ in range(200):
            if os.path.exists(sock):
                break
            time.sleep(0.05)
        code, out = run_cli(env={"XDG_RUNTIME_DIR": runtime})
        self.assertEqual(code, 0, out)
        self.assertIn(f"daemon unix:{sock}: SERVING", out)

    def test_no_daemon(self):
        work = tempfile.mkdtemp(prefix="wspy.", dir="/tmp")
        self.addCleanup(shutil.rmtree, work, True)
        missing = os.path.join(work, "none.sock")
        code, out = run_cli("--target", "unix:" + missing)
        self.assertEqual(code, 1, out)
        self.assertIn(f"UNREACHABLE: {missing} does not exist", out)

        # A socket file nobody listens on (a daemon that died): refused
        # within the timeout.
        stale = os.path.join(work, "stale.sock")
        s = socket.socket(socket.AF_UNIX)
        s.bind(stale)
        s.close()
        t0 = time.monotonic()
        code, out = run_cli("--target", "unix:" + stale, "--timeout", "0.5")
        self.assertEqual(code, 1, out)
        self.assertIn("UNREACHABLE: no connection within 0.5 s", out)
        self.assertLess(time.monotonic() - t0, 10)

    def test_bad_arguments(self):
        code, out = run_cli("--timeout", "-1")
        self.assertEqual(code, 2, out)
        self.assertIn("--timeout must be positive", out)


class FakeDaemon:
    """A gRPC server on a Unix socket that answers grpc.health.v1 Check with
    `serving` and, when `build_info` is given, TrainerService.GetStatus."""

    def __init__(self, test, serving, build_info=None):
        work = tempfile.mkdtemp(prefix="wspy.", dir="/tmp")
        test.addCleanup(shutil.rmtree, work, True)
        self.target = "unix:" + os.path.join(work, "fake.sock")
        health_response = _proto._message_class("grpc.health.v1.HealthCheckResponse")
        health_request = _proto._message_class("grpc.health.v1.HealthCheckRequest")
        handlers = [grpc.method_handlers_generic_handler("grpc.health.v1.Health", {
            "Check": grpc.unary_unary_rpc_method_handler(
                lambda req, ctx: health_response(status=serving),
                request_deserializer=health_request.FromString,
                response_serializer=health_response.SerializeToString)})]
        if build_info is not None:
            handlers.append(grpc.method_handlers_generic_handler("weightsync.v1.TrainerService", {
                "GetStatus": grpc.unary_unary_rpc_method_handler(
                    lambda req, ctx: v1.GetStatusResponse(build_info=build_info),
                    request_deserializer=v1.GetStatusRequest.FromString,
                    response_serializer=v1.GetStatusResponse.SerializeToString)}))
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2),
                                  handlers=handlers)
        self.server.add_insecure_port(self.target)
        self.server.start()
        test.addCleanup(self.server.stop, None)


class CliAgainstStandInsTest(unittest.TestCase):
    def test_not_serving_fails(self):
        fake = FakeDaemon(self, serving=2)  # NOT_SERVING (a daemon shutting down)
        code, out = run_cli("--target", fake.target)
        self.assertEqual(code, 1, out)
        self.assertIn(f"daemon {fake.target}: NOT_SERVING", out)
        self.assertIn(f"daemon {fake.target}: not healthy", out)
        # No TrainerService here: said, not fatal in itself.
        self.assertIn("daemon status: not available: UNIMPLEMENTED", out)

    def test_daemon_version_from_build_info(self):
        fake = FakeDaemon(self, serving=1, build_info="weightsyncd 9.8.7; built without CUDA")
        code, out = run_cli("--target", fake.target)
        self.assertEqual(code, 0, out)
        self.assertIn(f"daemon version: 9.8.7 (differs from this package's "
                      f"{weightsync.__version__})", out)
        self.assertIn("daemon build: weightsyncd 9.8.7; built without CUDA", out)
        fake = FakeDaemon(self, serving=1,
                          build_info=f"weightsyncd {weightsync.__version__}; built with CUDA 12.4")
        code, out = run_cli("--target", fake.target)
        self.assertEqual(code, 0, out)
        self.assertIn(f"daemon version: {weightsync.__version__}\n", out)


if __name__ == "__main__":
    unittest.main()

"""Checks deploy/ (docs/deploy.md) without a GPU, docker or a cluster:

* the systemd unit passes `systemd-analyze verify` (with ExecStart pointed at
  the built daemon; any message about the unit fails), keeps its sandbox
  (`systemd-analyze security --offline` exposure <= 2.7) and the settings
  the daemon depends on; the sysusers file parses;
* every Kubernetes manifest parses as Kubernetes objects, and the pod and
  DaemonSet keep the invariants the daemon needs (one socket volume mounted
  at the same path by the daemon and the engines, --socket under it, the
  pid/IPC namespaces, exec probes of weightsync_health on that socket,
  resources, GPUs), with only flags the daemon knows;
* the real daemon, started with a manifest's arguments in a world-writable
  directory (as an emptyDir is), under a fake NOTIFY_SOCKET with
  WATCHDOG_USEC, sends READY=1 then WATCHDOG=1, answers weightsync_health
  (exit 0), sends STOPPING=1 on SIGTERM, and the health tool then fails;
* deploy/container/stage.sh stages the image context from the binaries:
  the Debian package (tools/build_deb.sh) the recipe installs, and the CUDA
  libraries of the GPU worker.

Run by tests:deploy_test through run_python.sh, from the runfiles root.
"""

import glob
import json
import os
import re
import shlex
import shutil
import signal
import socket
import stat
import subprocess
import tempfile
import time
import unittest
import urllib.request
import xml.etree.ElementTree as ET

import yaml

ROOT = os.getcwd()
DAEMON = os.path.join(ROOT, "daemon/weightsyncd")
HEALTH = os.path.join(ROOT, "tools/weightsync_health")
WORKER = os.path.join(ROOT, "backends/cuda/weightsync_gpu_worker")
UNIT = os.path.join(ROOT, "deploy/systemd/weightsyncd.service")
SYSUSERS = os.path.join(ROOT, "deploy/systemd/weightsync-sysusers.conf")
ENV_FILE = os.path.join(ROOT, "deploy/systemd/weightsyncd.env")
K8S = sorted(glob.glob(os.path.join(ROOT, "deploy/k8s/*.yaml")))
CONTAINERFILE = os.path.join(ROOT, "deploy/container/Containerfile")
CTL = os.path.join(ROOT, "tools/weightsyncctl")
STAGE = os.path.join(ROOT, "deploy/container/stage.sh")
# Where the Debian package (tools/build_deb.sh) installs them, on hosts and
# in the image alike.
INSTALLED_DAEMON = "/usr/sbin/weightsyncd"
INSTALLED_HEALTH = "/usr/bin/weightsync_health"


def daemon_flags():
    """Every flag weightsyncd accepts (gflags' --helpxml)."""
    out = subprocess.run([DAEMON, "--helpxml"], capture_output=True, text=True,
                         timeout=60).stdout
    names = {f.findtext("name") for f in ET.fromstring(out).iter("flag")}
    assert "socket" in names, out[:500]
    return names


def flag_value(args, name):
    for a in args:
        if a.startswith(f"--{name}="):
            return a.split("=", 1)[1]
    return None


def read_unit(path):
    """The unit as {section: [(key, value), ...]} (keys may repeat)."""
    sections, cur = {}, None
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line or line.startswith(("#", ";")):
                continue
            if line.startswith("["):
                cur = sections.setdefault(line.strip("[]"), [])
                continue
            key, _, value = line.partition("=")
            cur.append((key.strip(), value.strip()))
    return sections


def unit_values(section, key):
    return [v for k, v in section if k == key]


class SystemdUnitTest(unittest.TestCase):

    def setUp(self):
        self.assertIsNotNone(shutil.which("systemd-analyze"),
                             "systemd-analyze missing: apt-get install systemd "
                             "(.ci/install-deps.sh)")
        self.tmp = tempfile.mkdtemp(prefix="ws-unit-")
        self.addCleanup(shutil.rmtree, self.tmp, True)
        with open(UNIT) as f:
            text = f.read()
        self.assertIn(f"ExecStart={INSTALLED_DAEMON} ", text)
        # verify checks that ExecStart's binary exists: the built one.
        self.unit = os.path.join(self.tmp, "weightsyncd.service")
        with open(self.unit, "w") as f:
            f.write(text.replace(f"ExecStart={INSTALLED_DAEMON} ",
                                 f"ExecStart={os.path.realpath(DAEMON)} "))

    def run_analyze(self, *args):
        env = dict(os.environ, SYSTEMD_LOG_LEVEL="notice", SYSTEMD_PAGER="",
                   SYSTEMD_COLORS="0")
        return subprocess.run(["systemd-analyze", *args], capture_output=True,
                              text=True, env=env, timeout=120)

    def test_verify_reports_nothing(self):
        r = self.run_analyze("verify", "--man=no", self.unit)
        out = r.stdout + r.stderr
        ours = [l for l in out.splitlines()
                if "weightsyncd" in l or self.tmp in l]
        self.assertEqual(r.returncode, 0, out)
        self.assertEqual(ours, [], "systemd-analyze verify:\n" + out)

    def test_sandbox_exposure(self):
        r = self.run_analyze("security", "--offline=yes", "--threshold=27",
                             "--no-pager", self.unit)
        self.assertEqual(r.returncode, 0,
                         "exposure above 2.7 or an error:\n" + r.stdout[-3000:]
                         + r.stderr)

    def test_settings_the_daemon_needs(self):
        service = read_unit(UNIT)["Service"]
        one = lambda k: (unit_values(service, k) or [None])[-1]
        self.assertEqual(one("Type"), "notify")
        self.assertEqual(one("NotifyAccess"), "main")
        self.assertRegex(one("WatchdogSec") or "", r"^[1-9][0-9]*s?$")
        self.assertEqual(one("Restart"), "on-failure")
        self.assertEqual(one("RuntimeDirectory"), "weightsync")
        # The daemon refuses a socket directory others can enter.
        self.assertEqual(int(one("RuntimeDirectoryMode"), 8) & 0o001, 0)
        self.assertNotIn(one("User"), (None, "root", "0"))
        exec_start = shlex.split(one("ExecStart"))
        socket_path = flag_value(exec_start, "socket")
        self.assertEqual(os.path.dirname(socket_path), "/run/weightsync")
        known = daemon_flags()
        for a in exec_start[1:]:
            if a.startswith("--"):
                self.assertIn(a[2:].split("=")[0], known, a)
        # GPUs reachable: no PrivateDevices, NVIDIA devices allowed.
        self.assertNotIn(one("PrivateDevices"), ("yes", "true", "1"))
        self.assertIn(one("DevicePolicy"), ("closed", "auto"))
        self.assertTrue(any("nvidia" in v for v in
                            unit_values(service, "DeviceAllow")))
        self.assertEqual(one("LimitMEMLOCK"), "infinity")
        families = one("RestrictAddressFamilies").split()
        for fam in ("AF_UNIX", "AF_INET", "AF_INET6", "AF_NETLINK"):
            self.assertIn(fam, families)
        # The GPU worker takes VMM fds from other users' engines.
        self.assertIn("CAP_SYS_PTRACE", one("AmbientCapabilities"))
        self.assertEqual(one("ProtectSystem"), "strict")
        # The worker's private socket dir is made in /tmp (main.cc): it must
        # be writable under ProtectSystem=strict, and private is fine since
        # the worker is the daemon's child.
        self.assertEqual(one("PrivateTmp"), "yes")
        # Namespaces the engines and NCCL must share with the daemon.
        for key in ("PrivateNetwork", "PrivateIPC", "RemoveIPC"):
            self.assertNotIn(one(key), ("yes", "true", "1"), key)
        self.assertNotEqual(one("ProtectProc"), "invisible")

    def test_env_file_flags_are_known(self):
        known = daemon_flags()
        with open(ENV_FILE) as f:
            for line in f:
                if line.startswith("WEIGHTSYNCD_OPTS="):
                    for a in line.split("=", 1)[1].split():
                        self.assertIn(a[2:].split("=")[0], known, a)

    def test_sysusers_file_parses(self):
        sysusers = shutil.which("systemd-sysusers")
        self.assertIsNotNone(sysusers)
        root = os.path.join(self.tmp, "root")
        os.makedirs(os.path.join(root, "etc"))
        r = subprocess.run([sysusers, "--dry-run", f"--root={root}", SYSUSERS],
                           capture_output=True, text=True, timeout=60)
        out = r.stdout + r.stderr
        self.assertEqual(r.returncode, 0, out)
        self.assertIn("weightsync", out)
        self.assertNotIn("ignoring", out.lower(), out)


def pod_specs(doc):
    """The pod spec of a Pod, or of a workload's pod template."""
    if doc["kind"] == "Pod":
        return doc["spec"]
    return doc["spec"]["template"]["spec"]


def all_containers(spec):
    return spec.get("initContainers", []) + spec.get("containers", [])


def is_daemon(c):
    return "weightsyncd" in c.get("image", "") and "args" in c


def mount_of(container, path):
    """The volume mount of `container` that holds `path`, or None."""
    best = None
    for m in container.get("volumeMounts", []):
        mp = m["mountPath"].rstrip("/")
        if path == mp or path.startswith(mp + "/"):
            if best is None or len(mp) > len(best["mountPath"]):
                best = m
    return best


class KubernetesTest(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        cls.docs = {}
        for path in K8S:
            with open(path) as f:
                cls.docs[os.path.basename(path)] = [
                    d for d in yaml.safe_load_all(f) if d is not None]
        with open(CONTAINERFILE) as f:
            m = re.search(r"^ENTRYPOINT\s+(\[.*\])\s*$", f.read(), re.M)
        cls.entrypoint = json.loads(m.group(1))
        cls.known_flags = daemon_flags()

    def test_manifests_are_kubernetes_objects(self):
        self.assertEqual(set(self.docs), {"pod.yaml", "daemonset.yaml"})
        for name, docs in self.docs.items():
            for d in docs:
                with self.subTest(file=name, kind=d.get("kind")):
                    for key in ("apiVersion", "kind", "metadata"):
                        self.assertIn(key, d)
                    self.assertTrue(d["metadata"].get("name"))
                    if d["kind"] != "Namespace":
                        self.assertIn("spec", d)
                    if d["kind"] in ("Pod", "DaemonSet"):
                        self.assertEqual(d["apiVersion"],
                                         {"Pod": "v1",
                                          "DaemonSet": "apps/v1"}[d["kind"]])
                    if d["kind"] == "DaemonSet":
                        labels = d["spec"]["template"]["metadata"]["labels"]
                        for k, v in d["spec"]["selector"]["matchLabels"].items():
                            self.assertEqual(labels.get(k), v)

    def check_daemon_container(self, spec, where):
        """Returns (daemon container, socket path, socket volume name)."""
        daemons = [c for c in all_containers(spec) if is_daemon(c)]
        self.assertEqual(len(daemons), 1, where)
        d = daemons[0]
        args = d["args"]
        for a in args:
            self.assertIn(a[2:].split("=")[0], self.known_flags, f"{where}: {a}")
        sock = flag_value(args, "socket")
        self.assertIsNotNone(sock, where)
        mount = mount_of(d, sock)
        self.assertIsNotNone(mount, f"{where}: --socket {sock} on no volume")
        volume = {v["name"]: v for v in spec["volumes"]}[mount["name"]]
        sock_dir = os.path.dirname(sock)
        if "emptyDir" in volume:
            # An emptyDir is 0777: the daemon makes its own 0750 directory.
            self.assertNotEqual(sock_dir, mount["mountPath"].rstrip("/"), where)
        elif "hostPath" in volume:
            # kubelet makes it root's 0755: an init container fixes it.
            fixers = [c for c in spec.get("initContainers", [])
                      if mount_of(c, sock_dir) is not None
                      and "chmod 0750" in " ".join(c.get("command", []))]
            self.assertTrue(fixers or sock_dir != mount["mountPath"], where)
        else:
            self.fail(f"{where}: socket volume {volume}")
        # Probes: weightsync_health from the image's package, on this socket.
        self.assertEqual(self.entrypoint[0], INSTALLED_DAEMON)
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            p = d.get(probe)
            self.assertIsNotNone(p, f"{where}: {probe}")
            cmd = p["exec"]["command"]
            self.assertEqual(cmd[0], INSTALLED_HEALTH, where)
            self.assertIn(f"--socket={sock}", cmd, where)
            timeout_ms = int(flag_value(cmd, "timeout_ms") or 3000)
            self.assertLess(timeout_ms, p.get("timeoutSeconds", 1) * 1000,
                            f"{where}: {probe} tool deadline >= probe timeout")
        # readOnlyRootFilesystem: the worker's mkdtemp needs a writable /tmp.
        if d.get("securityContext", {}).get("readOnlyRootFilesystem"):
            self.assertIsNotNone(mount_of(d, "/tmp/x"), where)
        # The daemon requests no GPU (the engine holds them) but sees them.
        self.assertNotIn("nvidia.com/gpu", d["resources"].get("limits", {}))
        env = {e["name"]: e.get("value") for e in d.get("env", [])}
        self.assertTrue(env.get("NVIDIA_VISIBLE_DEVICES"), where)
        return d, sock, mount

    def check_resources(self, spec, where):
        for c in all_containers(spec):
            limits = c.get("resources", {}).get("limits", {})
            self.assertIn("memory", limits, f"{where}/{c['name']}")
            self.assertIn("cpu", limits, f"{where}/{c['name']}")

    def test_sidecar_pod(self):
        (pod,) = self.docs["pod.yaml"]
        spec = pod["spec"]
        self.check_resources(spec, "pod")
        d, sock, mount = self.check_daemon_container(spec, "pod")
        # A native sidecar: started (and probed) before the engine.
        if d in spec.get("initContainers", []):
            self.assertEqual(d.get("restartPolicy"), "Always")
            self.assertIn("startupProbe", d)
        # The daemon checks each engine's pid (SO_PEERCRED, VMM "pid:fd",
        # pidfd_getfd, /proc/PID/status): one pid namespace for the pod.
        self.assertIs(spec.get("shareProcessNamespace"), True)
        self.assertFalse(spec.get("hostIPC", False))
        self.assertFalse(spec.get("hostPID", False))
        engines = [c for c in spec["containers"] if not is_daemon(c)]
        self.assertTrue(engines)
        for e in engines:
            em = mount_of(e, sock)
            self.assertIsNotNone(em, f"engine {e['name']} lacks the socket")
            self.assertEqual((em["name"], em["mountPath"]),
                             (mount["name"], mount["mountPath"]))
            self.assertIn("nvidia.com/gpu", e["resources"]["limits"])
            # Same /dev/shm (host backend, NCCL) in both.
            self.assertEqual(mount_of(e, "/dev/shm/x")["name"],
                             mount_of(d, "/dev/shm/x")["name"])
        # Same uid in both (shm 0600, pidfd_getfd, the daemon's own uid).
        uid = lambda c: c.get("securityContext", {}).get(
            "runAsUser", spec.get("securityContext", {}).get("runAsUser"))
        self.assertIsNotNone(uid(d))
        for e in engines:
            self.assertEqual(uid(e), uid(d))

    def test_daemonset(self):
        docs = {d["kind"]: d for d in self.docs["daemonset.yaml"]}
        ds = docs["DaemonSet"]
        spec = pod_specs(ds)
        self.check_resources(spec, "daemonset")
        d, sock, mount = self.check_daemon_container(spec, "daemonset")
        self.assertEqual(ds["metadata"].get("namespace"),
                         docs["Namespace"]["metadata"]["name"])
        volume = {v["name"]: v for v in spec["volumes"]}[mount["name"]]
        host_dir = volume["hostPath"]["path"]
        self.assertEqual(host_dir, "/run/weightsync")
        self.assertIs(spec.get("hostPID"), True)
        self.assertIs(spec.get("hostIPC"), True)
        # The example engine pod: same host directory at the same path, the
        # host's pid and IPC namespaces, an allowed uid.
        engine = docs["Pod"]
        espec = engine["spec"]
        self.check_resources(espec, "engine pod")
        self.assertIs(espec.get("hostPID"), True)
        self.assertIs(espec.get("hostIPC"), True)
        evol = {v["name"]: v for v in espec["volumes"]}
        for e in espec["containers"]:
            em = mount_of(e, sock)
            self.assertIsNotNone(em)
            self.assertEqual(em["mountPath"], mount["mountPath"])
            self.assertEqual(evol[em["name"]]["hostPath"]["path"], host_dir)
            self.assertIn("nvidia.com/gpu", e["resources"]["limits"])
        daemon_uid = d["securityContext"]["runAsUser"]
        esc = espec.get("securityContext", {})
        self.assertTrue(esc.get("runAsUser") == daemon_uid
                        or d["securityContext"].get("runAsGroup")
                        in esc.get("supplementalGroups", []))


class LiveDaemonTest(unittest.TestCase):
    """The real daemon under a fake systemd, and the health tool."""

    def setUp(self):
        # Short: socket paths must fit in 108 bytes.
        self.tmp = tempfile.mkdtemp(prefix="ws-deploy-", dir="/tmp")
        self.addCleanup(shutil.rmtree, self.tmp, True)
        self.notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.addCleanup(self.notify.close)
        self.notify.bind(os.path.join(self.tmp, "notify"))
        self.log_path = os.path.join(self.tmp, "daemon.log")
        self.proc = None

    def tearDown(self):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def log(self):
        with open(self.log_path, errors="replace") as f:
            return f.read()[-4000:]

    def recv(self, timeout):
        self.notify.settimeout(timeout)
        try:
            return self.notify.recv(4096).decode()
        except socket.timeout:
            return None

    def health(self, sock, *extra):
        return subprocess.run([HEALTH, f"--socket={sock}", *extra],
                              capture_output=True, text=True, timeout=60)

    def test_notify_watchdog_health_and_stop(self):
        # The sidecar's arguments, in a directory anyone can enter (as an
        # emptyDir is): the daemon must make its own 0750 socket directory.
        with open(os.path.join(ROOT, "deploy/k8s/pod.yaml")) as f:
            (pod,) = yaml.safe_load_all(f)
        d = [c for c in all_containers(pod["spec"]) if is_daemon(c)][0]
        sock_in_pod = flag_value(d["args"], "socket")
        volume_root = mount_of(d, sock_in_pod)["mountPath"]
        vol = os.path.join(self.tmp, "vol")
        os.mkdir(vol)
        os.chmod(vol, 0o777)
        sock = vol + sock_in_pod[len(volume_root):]
        args = [a if not a.startswith("--socket=") else f"--socket={sock}"
                for a in d["args"]]
        # $(POD_IP), which kubelet expands from the env's fieldRef: here.
        self.assertIn("--metrics_address=$(POD_IP):9464", args)
        self.assertIn({"name": "POD_IP", "valueFrom": {"fieldRef": {
            "fieldPath": "status.podIP"}}}, d["env"])
        self.assertIn({"name": "metrics", "containerPort": 9464}, d["ports"])
        args = [a.replace("$(POD_IP):9464", "127.0.0.1:0") for a in args]
        env = dict(os.environ, NOTIFY_SOCKET=os.path.join(self.tmp, "notify"),
                   WATCHDOG_USEC="1000000")  # a ping every 0.5 s
        env.pop("WATCHDOG_PID", None)
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen([DAEMON, *args], env=env, stdout=log,
                                         stderr=subprocess.STDOUT)
        msg = self.recv(60)
        self.assertIsNotNone(msg, "no READY=1 within 60 s\n" + self.log())
        lines = msg.split("\n")
        self.assertEqual(lines[0], "READY=1", msg)
        self.assertIn(f"STATUS=serving on unix:{sock}", lines)
        # Listening by the time READY=1 arrives; its directory 0750.
        self.assertTrue(stat.S_ISSOCK(os.stat(sock).st_mode))
        self.assertEqual(stat.S_IMODE(os.stat(os.path.dirname(sock)).st_mode),
                         0o750)
        pings, deadline = 0, time.time() + 30
        while pings < 3 and time.time() < deadline:
            m = self.recv(5)
            self.assertIn(m, ("WATCHDOG=1", None), m)
            pings += m == "WATCHDOG=1"
        self.assertGreaterEqual(pings, 3, self.log())

        # The metrics endpoint the pod's annotations point Prometheus at.
        port = re.search(r"\(port (\d+)\)/metrics", self.log())
        self.assertIsNotNone(port, self.log())
        body = urllib.request.urlopen(
            f"http://127.0.0.1:{port.group(1)}/metrics", timeout=5).read().decode()
        self.assertIn("weightsync_engines 0", body)

        # The probe command of the manifest, on this socket.
        probe = d["livenessProbe"]["exec"]["command"]
        r = self.health(sock, *[a for a in probe[1:]
                                if not a.startswith("--socket=")])
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        self.assertEqual(r.stdout.strip(), "SERVING")
        # A service the daemon does not serve: not 0.
        r = self.health(sock, "--service=no.such.Service")
        self.assertNotEqual(r.returncode, 0, r.stdout)

        self.proc.send_signal(signal.SIGTERM)
        stopping, deadline = None, time.time() + 30
        while stopping is None and time.time() < deadline:
            m = self.recv(5)
            if m is not None and m.startswith("STOPPING=1"):
                stopping = m
        self.assertIsNotNone(stopping, self.log())
        self.assertEqual(self.proc.wait(timeout=60), 0, self.log())
        # Nobody there: the health tool fails, quickly.
        r = self.health(sock, "--timeout_ms=1000")
        self.assertEqual(r.returncode, 1, r.stdout + r.stderr)
        self.assertIn("UNREACHABLE", r.stdout)

    def test_health_tool_without_daemon_and_bad_flags(self):
        r = self.health(os.path.join(self.tmp, "none.sock"), "--timeout_ms=500")
        self.assertEqual(r.returncode, 1, r.stdout + r.stderr)
        r = subprocess.run([HEALTH], capture_output=True, text=True, timeout=60)
        self.assertEqual(r.returncode, 2, r.stdout + r.stderr)


class ContainerImageTest(unittest.TestCase):

    def test_stage_script(self):
        out = tempfile.mkdtemp(prefix="ws-stage-")
        self.addCleanup(shutil.rmtree, out, True)
        bins = [DAEMON, CTL, HEALTH] + ([WORKER] if os.path.exists(WORKER) else [])
        r = subprocess.run(["bash", STAGE, out, *bins], capture_output=True,
                           text=True, timeout=300)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        # The Debian package (tests:deb_test checks it whole): the binaries
        # where the unit, the entrypoint and the probes expect them, and
        # the Debian packages of their libraries among its Depends.
        (deb,) = glob.glob(os.path.join(out, "weightsync_*.deb"))
        files = subprocess.run(["dpkg-deb", "-c", deb], capture_output=True,
                               text=True, check=True).stdout
        for path in [INSTALLED_DAEMON, INSTALLED_HEALTH, "/usr/bin/weightsyncctl"] + (
                ["/usr/libexec/weightsync/weightsync_gpu_worker"]
                if os.path.exists(WORKER) else []):
            self.assertRegex(files, rf"(?m)^-rwxr-xr-x .* \.{re.escape(path)}$")
        depends = subprocess.run(["dpkg-deb", "-f", deb, "Depends"],
                                 capture_output=True, text=True,
                                 check=True).stdout
        self.assertIn("libgrpc++", depends)
        self.assertIn("libgoogle-glog", depends)
        if os.path.exists(WORKER):
            libs = os.listdir(os.path.join(out, "rootfs/usr/local/cuda/lib64"))
            self.assertTrue(any(l.startswith("libcudart.so") for l in libs))
            self.assertTrue(any(l.startswith("libnccl.so") for l in libs))
        # The recipe: Debian 12, not root, installs the package, the
        # package's daemon as entrypoint.
        with open(os.path.join(out, "Containerfile")) as f:
            recipe = f.read()
        self.assertRegex(recipe, r"(?m)^FROM debian:bookworm")
        self.assertRegex(recipe, r"(?m)^USER [1-9]")
        self.assertIn(f'ENTRYPOINT ["{INSTALLED_DAEMON}"]', recipe)
        self.assertIn("COPY weightsync_*.deb /tmp/", recipe)
        self.assertRegex(recipe, r"apt-get install .*\n? *.*/tmp/weightsync_\*\.deb")
        self.assertIn("COPY rootfs/ /", recipe)
        # The packaged daemon runs.
        root = os.path.join(out, "x")
        subprocess.run(["dpkg-deb", "-x", deb, root], check=True)
        r = subprocess.run([root + INSTALLED_DAEMON, "--version"],
                           capture_output=True, text=True, timeout=60)
        self.assertIn("weightsyncd version", r.stdout + r.stderr)


if __name__ == "__main__":
    unittest.main(verbosity=2)

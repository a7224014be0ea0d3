#!/usr/bin/env python3
"""The daemon's configuration (issue 7): --config files and the documented
defaults, against the real weightsyncd binary.

* every flag defined in daemon/main.cc is in docs/operations.md's flag
  table, with the default the binary reports (--helpxml);
* a config file sets flags, the command line wins over it
  (--dump_config shows the effective values);
* an unknown setting or a bad value stops the daemon with exit code 2 and
  names the file and line, and a live daemon really runs with a value from
  the file (its metrics port).

    WEIGHTSYNCD=bazel-bin/daemon/weightsyncd python3 tests/config_test.py
"""

import os
import shutil
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
import xml.etree.ElementTree as ET

HERE = os.path.dirname(os.path.abspath(__file__))
DAEMON = os.environ["WEIGHTSYNCD"]
failures = []


def check(what, ok, got=None):
    print(f"{'PASS' if ok else 'FAIL'} {what}" + ("" if ok else f": got {got!r}"), flush=True)
    if not ok:
        failures.append(what)


def run(*args):
    return subprocess.run([DAEMON, *args], capture_output=True, text=True, timeout=30)


def main():
    # 1. The documented defaults.
    xml = run("--helpxml").stdout
    flags = {f.findtext("name"): f.findtext("default")
             for f in ET.fromstring(xml).iter("flag")
             if f.findtext("file", "").endswith("daemon/main.cc")}
    check("--helpxml lists the daemon's flags", len(flags) > 25, len(flags))
    doc = open(os.path.join(HERE, "..", "docs", "operations.md")).read()
    rows = [line for line in doc.splitlines() if line.startswith("| `--")]
    for name, default in sorted(flags.items()):
        row = next((r for r in rows if f"`--{name}`" in r.split("|")[1]), None)
        if row is None:
            check(f"--{name} is in operations.md's flag table", False, "no row")
            continue
        shown = re.findall(r"`([^`]*)`", row.split("|")[2])
        want = '""' if default == "" else default
        check(f"--{name}: documented default {want}", want in shown, shown)

    work = tempfile.mkdtemp(prefix="ws-config.", dir="/tmp")
    os.chmod(work, 0o750)

    def conf(text):
        path = os.path.join(work, "weightsyncd.conf")
        with open(path, "w") as f:
            f.write(text)
        return path

    # 2. Values from the file; the command line wins.
    path = conf("# a comment\n\nnotice_timeout_ms = 1234\n--chunk_bytes = 1048576\n"
                'tcp = ""\nallow_uids = "1000,1001"\n')
    eff = dict(line.split(" = ", 1) for line in run(f"--config={path}", "--dump_config")
               .stdout.splitlines())
    check("the file sets notice_timeout_ms, chunk_bytes, allow_uids",
          (eff.get("notice_timeout_ms"), eff.get("chunk_bytes"), eff.get("allow_uids")) ==
          ("1234", "1048576", "1000,1001"), eff)
    check("--dump_config lists every flag", set(eff) == set(flags) - {"config", "dump_config"},
          set(flags) ^ set(eff))
    eff = dict(line.split(" = ", 1) for line in run(
        f"--config={path}", "--chunk_bytes=4096", "--dump_config").stdout.splitlines())
    check("the command line wins over the file", eff.get("chunk_bytes") == "4096" and
          eff.get("notice_timeout_ms") == "1234", eff)

    # 3. Errors name the culprit; nothing starts.
    for text, want in (("notice_timeout_ms = 5\nno_such_thing = 1\n",
                        r"weightsyncd\.conf:2: unknown setting 'no_such_thing'"),
                       ("chunk_bytes = lots\n",
                        r"'lots' is not a valid value for chunk_bytes"),
                       ("just words\n", r"weightsyncd\.conf:1: expected 'name = value'"),
                       ("config = /etc/other.conf\n",
                        r"'config' can only be given on the command line")):
        r = run(f"--config={conf(text)}", f"--socket={work}/d.sock")
        check(f"bad file -> exit 2, /{want}/", r.returncode == 2 and re.search(want, r.stderr),
              (r.returncode, r.stderr[-300:]))
    r = run(f"--config={work}/missing.conf")
    check("a missing file -> exit 2, named", r.returncode == 2 and "missing.conf" in r.stderr,
          (r.returncode, r.stderr[-200:]))

    # 4. A live daemon runs with the file's values.
    path = conf(f"socket = {work}/d.sock\nmetrics_address = 127.0.0.1:0\n")
    log = os.path.join(work, "daemon.log")
    d = subprocess.Popen([DAEMON, f"--config={path}"], stderr=open(log, "w"))
    port = None
    for _ in range(200):
        m = re.search(r"\(port (\d+)\)/metrics", open(log).read())
        if m and os.path.exists(f"{work}/d.sock"):
            port = int(m.group(1))
            break
        time.sleep(0.025)
    ok = port is not None and "weightsync_engines 0" in urllib.request.urlopen(
        f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    check("a daemon started with --config listens where the file says", ok, open(log).read()[-400:])
    d.terminate()
    check("and stops cleanly", d.wait(10) == 0)
    print(f"config: {'PASS' if not failures else 'FAIL'} ({len(failures)} failures)")
    if not failures:
        shutil.rmtree(work, ignore_errors=True)  # kept when something failed
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

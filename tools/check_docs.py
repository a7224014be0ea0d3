#!/usr/bin/python3
"""Checks that the docs name only things that exist (issue 34).

Reads README.md and docs/*.md and fails, naming file and line, when one of
them names something the code no longer has:

  flags         `--name` in code: a flag of a binary (its --helpfull), of a
                Python or shell tool of the tree (argparse, case patterns),
                or an outside tool's flag listed in tools/check_docs_allow.txt;
  protos        `StartWeightUpdate`, `GetStatusResponse.version`,
                `TrainerService/GetStatus`: a service, RPC, message, enum or
                field of proto/ (weightsync_v1.desc), or a C++/Python
                identifier of the tree; a message's field must exist;
  codes         `FAILED_PRECONDITION`, `ENGINE_DIRTY`: a gRPC status code, a
                proto enum value, or an identifier of the tree;
  Python        `weightsync.x.y`, `Trainer.update`, `engine.wait_for_version`:
                importable from client/python / an attribute of the class;
  paths         `tools/mutants.py`, `tests/gpu/RESULTS_fp8_*`, `//tests:deb_test`,
                and every relative link [..](file#anchor): the file, the
                Bazel package and target, the heading;

then runs the Python blocks marked runnable (an HTML comment
`<!-- docs-check: run ... -->` right before the block; the comment's body is
a hidden prelude that defines what the block leaves to the reader) against
a real weightsyncd on the host backend, each in a fresh process.

Usage: tools/check_docs.py [--bin DIR] [--no-run] [FILE.md ...]
  --bin   where weightsyncd and the tools are (default: bazel-bin, which
          `bazel test //...` has built in CI).
Exit 0 when every name exists and every block ran; 1 otherwise.
"""

import argparse
import glob
import importlib
import os
import re
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

GRPC_CODES = {
    "OK", "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED",
    "NOT_FOUND", "ALREADY_EXISTS", "PERMISSION_DENIED", "RESOURCE_EXHAUSTED",
    "FAILED_PRECONDITION", "ABORTED", "OUT_OF_RANGE", "UNIMPLEMENTED",
    "INTERNAL", "UNAVAILABLE", "DATA_LOSS", "UNAUTHENTICATED",
}

# Binaries whose --helpfull lists their flags (gflags).
BINARIES = [
    "daemon/weightsyncd", "tools/weightsyncctl", "tools/weightsync_health",
    "tools/weightsync_trainer", "tools/weightsync_engine",
    "tools/weightsync_gpu_trainer", "tools/weightsync_gpu_engine",
    "backends/cuda/weightsync_gpu_worker", "bench/host_bench",
    "bench/nccl_baseline", "bench/ipc_probe", "bench/gpu_kernels_bench",
    "bench/worker_rpc_probe",
]


MISSING_BINARIES = []  # not built (the GPU tools on a machine without CUDA)


class Problems:
    def __init__(self):
        self.items = []

    def add(self, where, what):
        self.items.append(f"{where}: {what}")


def tree_files():
    out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout.split("\n")
    return [f for f in out if f and os.path.exists(os.path.join(ROOT, f))]


def read(path):
    with open(os.path.join(ROOT, path), errors="replace") as f:
        return f.read()


# ---- what exists ----------------------------------------------------------

def source_words(files):
    """Every identifier-like word of the tree's code (not its Markdown)."""
    words = set()
    for f in files:
        if f.endswith((".md", ".txt", ".json", ".desc")) or "/results/" in f:
            continue
        try:
            words.update(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", read(f)))
        except (UnicodeDecodeError, IsADirectoryError):
            pass
    return words


def tool_flags(files, bindir, problems):
    """Flags the tree's programs accept."""
    flags = set()
    seen_binary = False
    for b in BINARIES:
        path = os.path.join(bindir, b)
        if not os.access(path, os.X_OK):
            MISSING_BINARIES.append(b)
            continue
        seen_binary = True
        try:
            out = subprocess.run([path, "--helpfull"], capture_output=True, text=True,
                                 timeout=20)
        except subprocess.TimeoutExpired:
            problems.add(b, "--helpfull did not return in 20 s")
            continue
        flags.update(re.findall(r"^\s+-(\w+) \(", out.stdout + out.stderr, re.M))
    if not seen_binary:
        problems.add(bindir, "no binary found: build them first (bazel build //daemon:weightsyncd "
                     "//tools:all) or pass --bin")
    for f in files:
        if f.endswith(".py"):
            flags.update(re.findall(r"""add_argument\(\s*(?:"-\w",\s*)?["']--([\w-]+)["']""",
                                    read(f)))
        elif f.endswith(".sh") or f.startswith(".ci/"):
            # case patterns: --flag) or --flag=*) or --flag|-f)
            flags.update(re.findall(r"^\s*(?:\S+\|)?--([\w-]+)(?:=\*)?(?:\|\S+)?\)", read(f),
                                    re.M))
    return flags


def proto_names():
    """{message or enum or service name: set of field/value/method names},
    and every enum value."""
    sys.path.insert(0, os.path.join(ROOT, "client/python"))
    from google.protobuf import descriptor_pb2
    fds = descriptor_pb2.FileDescriptorSet()
    with open(os.path.join(ROOT, "client/python/weightsync/weightsync_v1.desc"), "rb") as f:
        fds.ParseFromString(f.read())
    members, values = {}, set()

    def message(m):
        members[m.name] = {fl.name for fl in m.field} | {o.name for o in m.oneof_decl}
        for n in m.nested_type:
            message(n)
        for e in m.enum_type:
            enum(e)

    def enum(e):
        members[e.name] = {v.name for v in e.value}
        values.update(members[e.name])

    for fd in fds.file:
        for m in fd.message_type:
            message(m)
        for e in fd.enum_type:
            enum(e)
        for s in fd.service:
            members[s.name] = {m.name for m in s.method}
            for m in s.method:
                members.setdefault(m.name, set())
    # grpc.health.v1 (not in our descriptor set)
    members.setdefault("Health", set()).update({"Check", "Watch"})
    members.setdefault("Check", set())
    members.setdefault("Watch", set())
    values.update({"SERVING", "NOT_SERVING", "SERVICE_UNKNOWN"})
    return members, values


def load_allow():
    allow = {}
    for line in read("tools/check_docs_allow.txt").splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            kind, _, name = line.partition(" ")
            allow.setdefault(kind, set()).add(name.strip())
    return allow


# ---- what the docs say ----------------------------------------------------

def doc_parts(text):
    """Yields (line number, kind, text): kind 'span' for inline code,
    'fence:<info>' for a line of a fenced block, 'link' for a link target,
    'run' for (prelude + block + epilogue) of a runnable block: a fenced
    python block right after `<!-- docs-check: run` ... `-->` (a hidden
    prelude, possibly empty), optionally followed by `<!-- docs-check: after`
    ... `-->` (hidden code run after it). Hidden code is not checked for names."""
    lines = text.split("\n")
    i = 0
    pending = None  # (prelude, line of the marker)
    while i < len(lines):
        line = lines[i]
        m = re.match(r"\s*<!--\s*docs-check:\s*(run|after)\b(.*)$", line)
        if m:
            body, rest = [], m.group(2)
            if "-->" not in rest:
                i += 1
                while i < len(lines) and not lines[i].strip().startswith("-->"):
                    body.append(lines[i])
                    i += 1
            hidden = "\n".join(body)
            if m.group(1) == "run":
                pending = (hidden, i + 1)
            else:
                yield i + 1, "error", "docs-check: after with no runnable block before it"
            i += 1
            continue
        m = re.match(r"\s*(```+|~~~+)\s*(.*)$", line)
        if m:
            fence, info, start = m.group(1), m.group(2), i + 1
            block = []
            i += 1
            while i < len(lines) and not lines[i].strip().startswith(fence):
                block.append(lines[i])
                yield i + 1, "fence:" + info, lines[i]
                i += 1
            i += 1
            if pending is not None:
                if info.split()[:1] != ["python"]:
                    yield start, "error", "docs-check: run must precede a ```python block"
                else:
                    after = ""
                    j = i
                    while j < len(lines) and not lines[j].strip():
                        j += 1
                    a = re.match(r"\s*<!--\s*docs-check:\s*after\b(.*)$", lines[j]) \
                        if j < len(lines) else None
                    if a:
                        body = []
                        if "-->" not in a.group(1):
                            j += 1
                            while j < len(lines) and not lines[j].strip().startswith("-->"):
                                body.append(lines[j])
                                j += 1
                        after = "\n".join(body)
                        i = j + 1
                    yield start, "run", (pending[0], "\n".join(block), after)
                pending = None
            continue
        if line.strip() and pending is not None:
            yield pending[1], "error", "docs-check: run must sit right before its block"
            pending = None
        for span in re.findall(r"(?<!`)`([^`\n]+)`(?!`)", line):
            yield i + 1, "span", span
        for target in re.findall(r"\]\(([^)\s]+)\)", line):
            yield i + 1, "link", target
        i += 1


def headings(text):
    slugs, counts = set(), {}
    in_fence = False
    for line in text.split("\n"):
        if re.match(r"\s*(```|~~~)", line):
            in_fence = not in_fence
            continue
        m = None if in_fence else re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            s = m.group(1).strip().lower()
            s = re.sub(r"[^\w\- ]", "", s).replace(" ", "-")
            n = counts.get(s, 0)
            counts[s] = n + 1
            slugs.add(s if n == 0 else f"{s}-{n}")
    return slugs


# ---- the checks -----------------------------------------------------------

class Checker:
    def __init__(self, bindir, problems):
        self.p = problems
        self.files = tree_files()
        self.fileset = set(self.files)
        self.dirs = {os.path.dirname(f) for f in self.files}
        d = set()
        for x in self.dirs:
            while x:
                d.add(x)
                x = os.path.dirname(x)
        self.dirs = d
        self.top = {f.split("/")[0] for f in self.files}
        self.words = source_words(self.files)
        self.code_text = "\n".join(read(f) for f in self.files
                                   if f.endswith((".cc", ".h", ".py")))
        self.flags = tool_flags(self.files, bindir, problems)
        self.members, self.values = proto_names()
        self.allow = load_allow()
        sys.path.insert(0, os.path.join(ROOT, "client/python"))
        self.ws = importlib.import_module("weightsync")
        self.pysrc = "\n".join(read(f) for f in self.files
                               if f.startswith("client/python/weightsync/") and f.endswith(".py"))

    # flags
    def flag(self, where, name):
        if name in self.flags or name in self.allow.get("flag", ()):
            return
        if name.startswith("no") and name[2:] in self.flags:
            return  # gflags' --nofoo
        self.p.add(where, f"flag --{name}: no binary, tool or script of the tree takes it "
                   "(tools/check_docs_allow.txt lists outside tools' flags)" +
                   (f"; not built here: {', '.join(MISSING_BINARIES)}" if MISSING_BINARIES
                    else ""))

    # ALL_CAPS
    def code(self, where, name):
        if (name in GRPC_CODES or name in self.values or name in self.words
                or name in self.allow.get("name", ())):
            return
        self.p.add(where, f"{name}: not a gRPC code, a proto enum value or a name in the code")

    # CamelCase, dotted or slashed
    def proto(self, where, token):
        m = re.match(r"^(\w+)(?:([./])(.*))?$", token)
        head, sep, rest = m.group(1), m.group(2) or "", m.group(3) or ""
        if head in self.members:
            if rest:
                member = re.split(r"[.(\[]", rest)[0]
                fields = self.members[head] | self.members.get(head + "Request", set())
                if member and member not in fields and head not in ("Check", "Watch"):
                    self.p.add(where, f"{token}: {head} has no {member} (proto/)")
            return
        if head in self.words or head in self.allow.get("name", ()):
            if sep == "." and rest and head in dir(self.ws):
                self.python(where, f"weightsync.{token}")
            return
        self.p.add(where, f"{token}: {head} is no proto name and no name in the code")

    # Python
    def python(self, where, token):
        if f'"{token}"' in self.code_text:
            return  # a name the code uses as a string (health service "weightsync.unix")
        m = re.match(r"^weightsync\.((?:worker\.)?v\d+)(?:\.(.*))?$", token)
        if m:  # a proto package (proto/weightsync/v1/...), maybe with a name in it
            if not os.path.isdir(os.path.join(ROOT, "proto/weightsync",
                                              m.group(1).replace(".", "/"))) and \
                    token not in self.allow.get("name", ()):
                self.p.add(where, f"{token}: no proto package proto/weightsync/"
                           f"{m.group(1).replace('.', '/')}")
            elif m.group(2) and m.group(1) == "v1":
                self.proto(where, m.group(2))
            return
        parts = token.split(".")
        obj = self.ws
        for i, part in enumerate(parts[1:], 1):
            if hasattr(obj, part):
                obj = getattr(obj, part)
                continue
            try:
                obj = importlib.import_module(".".join(parts[:i + 1]))
                continue
            except ImportError:
                pass
            # instance attributes set in __init__ (self.version = ...)
            if isinstance(obj, type) and re.search(rf"self\.{re.escape(part)}\b", self.pysrc):
                return
            self.p.add(where, f"{token}: {'.'.join(parts[:i])} has no {part} (client/python)")
            return

    def instance(self, where, var, attr):
        cls = {"trainer": "Trainer", "engine": "Engine"}[var]
        if f'"{var}.{attr}' in self.code_text:
            return  # an event name the daemon logs (Event("engine.registered", ...))
        if hasattr(getattr(self.ws, cls), attr) or re.search(
                rf"self\.{re.escape(attr)}\b", self.pysrc):
            return
        self.p.add(where, f"{var}.{attr}: weightsync.{cls} has no {attr} (client/python)")

    # paths
    def path(self, where, token, doc_dir=None):
        t = token
        if t.startswith("//"):
            return self.label(where, t)
        t = re.sub(r":\d+(-\d+)?$", "", t).rstrip("/")
        t = t.split("#", 1)[0]
        if not t:
            return
        base = ROOT if doc_dir is None else os.path.join(ROOT, doc_dir)
        full = os.path.normpath(os.path.join(base, t))
        rel = os.path.relpath(full, ROOT)
        if any(c in t for c in "*?["):
            if not glob.glob(full) and not [f for f in self.files
                                            if glob.fnmatch.fnmatch(f, rel)]:
                self.p.add(where, f"{token}: matches no file")
            return
        if rel in self.fileset or rel in self.dirs or os.path.exists(full):
            return
        if glob.glob(glob.escape(full) + ".*"):
            return  # a stem: daemon/core/receipt for receipt.h and receipt.cc
        pkg, name = os.path.split(rel)
        build = os.path.join(ROOT, pkg, "BUILD.bazel")
        if os.path.exists(build) and re.search(rf"""name = ["']{re.escape(name)}["']""",
                                               read(os.path.relpath(build, ROOT))):
            return  # a binary of the build (bench/ipc_probe: bazel-bin/bench/ipc_probe)
        self.p.add(where, f"{token}: no such file or folder")

    def label(self, where, label):
        m = re.match(r"//([\w/.-]*)(?::([\w.+-]+))?$", label)
        if not m:
            if not re.match(r"//[\w/.-]*/\.\.\.$", label) and label != "//...":
                self.p.add(where, f"{label}: not a Bazel label")
            return
        pkg, target = m.group(1), m.group(2)
        build = next((os.path.join(pkg, b) for b in ("BUILD.bazel", "BUILD")
                      if os.path.join(pkg, b) in self.fileset), None)
        if build is None:
            self.p.add(where, f"{label}: no package {pkg or '//'}")
            return
        if target is None:
            return  # the package itself (`//client/python`'s tests)
        if not re.search(rf"""["']{re.escape(target)}["']""", read(build)) and \
                not os.path.exists(os.path.join(ROOT, pkg, target)):
            self.p.add(where, f"{label}: {build} defines no {target}")

    def link(self, where, doc, target):
        if re.match(r"[a-z]+:", target) or target.startswith("mailto:"):
            return
        path, _, anchor = target.partition("#")
        doc_dir = os.path.dirname(doc)
        dest = os.path.normpath(os.path.join(doc_dir, path)) if path else doc
        if path:
            self.path(where, path, doc_dir)
        if anchor and dest.endswith(".md") and os.path.exists(os.path.join(ROOT, dest)):
            if anchor not in headings(read(dest)):
                self.p.add(where, f"link #{anchor}: {dest} has no such heading")

    def span(self, where, doc, span):
        s = span.strip()
        for m in re.finditer(r"(?<![\w-])--([a-z][a-z0-9_-]*[a-z0-9])", s):
            self.flag(where, m.group(1))
        if " " in s and not s.startswith("//"):
            # a command or an expression: only its flags and paths are names
            for word in s.split():
                word = word.strip("\"'(),;[]{}")
                if "/" in word and word.split("/")[0] in self.top and not word.startswith("-") \
                        and re.match(r"^[\w./*?-]+(:\d+)?$", word):
                    self.path(where, word)
            return
        s = s.rstrip("(),;:")
        if re.search(r"\(.*\)$", s):
            s = s[:s.index("(")]  # update(...)
        if s.startswith("//"):
            self.path(where, s)
        elif re.match(r"^[A-Z][A-Z0-9]*(_[A-Z0-9]+)+$", s) or s in GRPC_CODES:
            self.code(where, s)
        elif s.startswith("weightsync.") and re.match(r"^[\w.]+$", s):
            self.python(where, s)
        elif re.match(r"^(trainer|engine)\.[a-z_]\w*$", s):
            var, attr = s.split(".")
            self.instance(where, var, attr)
        elif re.match(r"^[A-Z][a-z0-9]+[A-Z]\w*([./]\w+)*$", s) or \
                re.match(r"^[A-Z]\w*[./][A-Za-z_]\w*$", s):
            self.proto(where, s)
        elif "/" in s and s.split("/")[0] in self.top | {".ci"} and re.match(r"^[\w./*?-]+(:\d+)?$", s):
            self.path(where, s)
        elif s in ("LICENSE", "VERSION", "README.md", "WORKSPACE"):
            self.path(where, s)

    def fence_line(self, where, info, line):
        lang = info.split()[:1]
        if lang and lang[0] not in ("sh", "bash", "console", "shell", ""):
            return
        for m in re.finditer(r"(?<![\w-])--([a-z][a-z0-9_-]*[a-z0-9])", line.split("#")[0]):
            self.flag(where, m.group(1))
        for word in line.split("#")[0].split():
            w = word.strip("\"'(),;")
            if "/" in w and w.split("/")[0] in self.top | {".ci"} and re.match(r"^[\w./*-]+$", w) \
                    and not w.startswith("-"):
                self.path(where, w)

    def doc(self, doc):
        runs = []
        for line, kind, text in doc_parts(read(doc)):
            where = f"{doc}:{line}"
            if kind == "span":
                self.span(where, doc, text)
            elif kind == "link":
                self.link(where, doc, text)
            elif kind.startswith("fence:"):
                self.fence_line(where, kind[6:], text)
            elif kind == "run":
                runs.append((where, text))
            elif kind == "error":
                self.p.add(where, text)
        return runs


# ---- runnable blocks ------------------------------------------------------

def run_blocks(blocks, bindir, problems):
    daemon_bin = os.path.join(bindir, "daemon/weightsyncd")
    with tempfile.TemporaryDirectory(prefix="wsdocs.") as work:
        runtime = os.path.join(work, "run")
        os.makedirs(os.path.join(runtime, "weightsync"), mode=0o700)
        os.chmod(runtime, 0o700)
        sock = os.path.join(runtime, "weightsync", "weightsyncd.sock")
        log = open(os.path.join(work, "daemon.log"), "w")
        daemon = subprocess.Popen([daemon_bin, f"--socket={sock}"], stderr=log)
        try:
            for _ in range(200):
                if os.path.exists(sock) or daemon.poll() is not None:
                    break
                time.sleep(0.05)
            env = dict(os.environ, XDG_RUNTIME_DIR=runtime,
                       PYTHONPATH=os.path.join(ROOT, "client/python"))
            for where, (prelude, block, after) in blocks:
                script = (prelude + "\n# ---- the documented block ----\n" + block +
                          "\n# ---- after it ----\n" + after + "\n")
                t0 = time.time()
                try:
                    out = subprocess.run([sys.executable, "-c", script], env=env, cwd=work,
                                         capture_output=True, text=True, timeout=60)
                    rc, text = out.returncode, out.stdout + out.stderr
                except subprocess.TimeoutExpired:
                    rc, text = "timeout", "did not finish in 60 s"
                if rc != 0:
                    problems.add(where, f"runnable block failed ({rc}):\n{text.rstrip()}")
                else:
                    print(f"ran {where} in {time.time() - t0:.1f} s")
        finally:
            daemon.terminate()
            try:
                daemon.wait(timeout=15)
            except subprocess.TimeoutExpired:
                daemon.kill()
            log.close()
            if daemon.returncode not in (0, -15):
                with open(os.path.join(work, "daemon.log")) as f:
                    problems.add("weightsyncd", f"exited {daemon.returncode}:\n{f.read()}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bin", default=os.path.join(ROOT, "bazel-bin"))
    ap.add_argument("--no-run", action="store_true", help="check names only")
    ap.add_argument("docs", nargs="*")
    args = ap.parse_args()
    t0 = time.time()
    docs = [os.path.abspath(d) for d in args.docs] or [os.path.join(ROOT, "README.md")] + \
        sorted(glob.glob(os.path.join(ROOT, "docs/*.md")))
    problems = Problems()
    checker = Checker(os.path.abspath(args.bin), problems)
    blocks = []
    for d in docs:
        blocks += checker.doc(os.path.relpath(d, ROOT))
    names_s = time.time() - t0
    if blocks and not args.no_run:
        run_blocks(blocks, os.path.abspath(args.bin), problems)
    for item in problems.items:
        print(item, file=sys.stderr)
    print(f"check_docs: {len(docs)} docs, {len(blocks)} runnable blocks, "
          f"{len(problems.items)} problems; names {names_s:.1f} s, "
          f"total {time.time() - t0:.1f} s")
    return 1 if problems.items else 0


if __name__ == "__main__":
    sys.exit(main())

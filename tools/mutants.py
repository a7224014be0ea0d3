#!/usr/bin/env python3
"""Mutants generated from the code as it is: every safety check must fail a test.

Issue 33. A hand-written catalogue measures the tests that were written;
this tool enumerates every mutant of fixed operator classes over the
safety-critical sources (daemon/core, daemon/server, backends/host, common)
and runs them, one at a time:

  rel      a relational boundary moved: `<` <-> `<=`, `>` <-> `>=`
  clause   one clause of a top-level `||` / `&&` chain of an `if`/`while`
           condition (or of a `bool x = ...;` / `return ...;` chain) dropped
  cond     an `if` condition forced to `true` or to `false`
  ok       a `return <error status>` replaced by OK (functions returning
           absl::Status or grpc::Status)
  bound    `+ 1` / `- 1` added to the right side of a comparison, or an
           existing `+ 1` / `- 1` in one dropped
  loop     a `for` loop's start moved by one

The tokenizer is small and leans on what clang-format enforces here:
comments, string and character literals are blanked first, binary
comparison operators are the ones written with a space on each side
(templates are `a<b>`), and `#` lines are skipped.

A mutant's id is a hash of its file, the text of the line(s) it changes and
the change, so it survives code moving up or down (line numbers are only
printed). tools/mutants_equivalent.txt lists the ids judged equivalent (no
test can kill them) with a one-line reason each; they are left out of runs
and counted apart.

Running a mutant: the file is changed, the test targets that can see it
(`bazel query rdeps` of its library, restricted to the unit and in-process
tests of TEST_POOL, the closest first) are run one at a time until one
fails, and the file is restored whatever happens. Bazel's exit 3 (a test
failed or timed out) = killed; 0 after every target = survived; a build
error = broken (the mutant does not compile: not counted). Restoring the
file makes the next build a disk-cache hit, so a mutant costs one compile,
the links of its targets and the tests up to the first failure.

    python3 tools/mutants.py --list [--files GLOB...]      # enumerate
    python3 tools/mutants.py --sample N --seed S [--budget SECONDS]
        [--floor PCT]                                       # CI
    python3 tools/mutants.py --sweep --files daemon/core/engine_layout.cc
        [--results bench/results/mutants.json]              # full sweep
    python3 tools/mutants.py --run ID...                    # chosen ids
"""

import argparse
import fcntl
import fnmatch
import hashlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SAFETY_GLOBS = ["daemon/core/*.cc", "daemon/server/*.cc", "backends/host/*.cc",
                "common/*.cc"]
EQUIVALENT = os.path.join(ROOT, "tools", "mutants_equivalent.txt")
# Tests a mutant may run: unit tests and the in-process server tests, a few
# seconds each. The process-level suites (e2e, faults, soak, packaging)
# take minutes and run in CI's `bazel test //...` anyway.
TEST_POOL = [
    "//common:dtype_test", "//common:fp8_test", "//common:chunk_planner_test",
    "//common:transfer_plan_test", "//common:echo_test",
    "//daemon/core:engine_layout_test", "//daemon/core:quant_layout_test",
    "//daemon/core:copy_plan_test", "//daemon/core:parameter_table_test",
    "//daemon/core:source_registry_test", "//daemon/core:bus_guard_test",
    "//daemon/core:notice_hub_test", "//daemon/core:nccl_version_test",
    "//daemon/core:coordinator_device_test", "//daemon/core:link_plan_test",
    "//daemon/server:engine_owners_test", "//daemon/server:shm_reaper_test",
    "//daemon/server:shutdown_deadline_test", "//daemon/server:call_limits_test",
    "//daemon/server:token_checker_test", "//daemon/server:cert_expiry_test",
    "//daemon/server:accept_gate_test",
    "//backends/host:quant_scatter_test", "//backends/host:host_data_plane_test",
    "//backends/host:shm_memory_test",
    "//tests:refusals_test", "//tests:server_test", "//tests:commit_test",
    "//tests:hostile_test", "//tests:source_test",
    "//tests:state_machine_test", "//tests:multi_trainer_test",
    "//tests:systemd_notify_test", "//tests:liveness_test",
]
PER_MUTANT_TIMEOUT = 900  # the whole mutant, build included, seconds


# --------------------------------------------------------------- tokenizing

def blank(text):
    """`text` with comments, string/char literals and preprocessor lines
    replaced by spaces (newlines kept), so offsets stay the same."""
    out = list(text)
    i, n = 0, len(text)
    line_start = True
    while i < n:
        c = text[i]
        if line_start and c == "#":
            j = text.find("\n", i)
            j = n if j < 0 else j
            while text[j - 1] == "\\" and j < n:  # continued directive
                j = text.find("\n", j + 1)
                j = n if j < 0 else j
            for k in range(i, j):
                out[k] = " "
            i = j
            continue
        if c == "\n":
            line_start = True
            i += 1
            continue
        if not c.isspace():
            line_start = False
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            for k in range(i, j):
                out[k] = " "
            i = j
            continue
        if text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            for k in range(i, j):
                if out[k] != "\n":
                    out[k] = " "
            i = j
            continue
        if c == "R" and text.startswith('R"', i):  # raw string
            m = re.match(r'R"([^(\s]*)\(', text[i:])
            if m:
                end = text.find(")" + m.group(1) + '"', i)
                end = n if end < 0 else end + len(m.group(1)) + 2
                for k in range(i + 1, end):
                    if out[k] != "\n":
                        out[k] = " "
                i = end
                continue
        if c in "\"'":
            if c == "'" and i > 0 and text[i - 1].isalnum():  # 1'000
                i += 1
                continue
            j = i + 1
            while j < n and text[j] != c:
                j += 2 if text[j] == "\\" else 1
            for k in range(i + 1, min(j, n)):
                out[k] = " "
            i = j + 1
            continue
        i += 1
    return "".join(out)


def match_paren(code, i):
    """Index of the `)` closing the `(` at code[i]."""
    depth = 0
    for j in range(i, len(code)):
        if code[j] in "([{":
            depth += 1
        elif code[j] in ")]}":
            depth -= 1
            if depth == 0:
                return j
    return -1


def split_top(code, begin, end, op):
    """Spans [(b, e)] of `code[begin:end]` split at `op` at depth 0, or []
    when the span has no such operator."""
    spans, depth, start, j = [], 0, begin, begin
    while j < end:
        c = code[j]
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif depth == 0 and code.startswith(op, j):
            spans.append((start, j))
            start = j + len(op)
            j += len(op)
            continue
        elif depth == 0 and c in "?;" and op in ("&&", "||"):
            return []  # a ternary or a for header: not one chain
        j += 1
    if not spans:
        return []
    spans.append((start, end))
    return spans


def operand_end(code, i, end):
    """End of the operand starting at code[i] (right side of a comparison):
    up to `&&`, `||`, `?`, `:`, `,`, `;` or a closing bracket at depth 0."""
    depth = 0
    j = i
    while j < end:
        c = code[j]
        if c in "([{":
            depth += 1
        elif c in ")]}":
            if depth == 0:
                break
            depth -= 1
        elif depth == 0 and (code.startswith("&&", j) or code.startswith("||", j)
                             or c in "?:,;"):
            break
        j += 1
    while j > i and code[j - 1].isspace():
        j -= 1
    return j


# --------------------------------------------------------------- generating

class Mutant:
    __slots__ = ("file", "line", "op", "begin", "end", "before", "after",
                 "id", "context")

    def __init__(self, file, text, op, begin, end, after):
        self.file, self.op = file, op
        self.begin, self.end, self.after = begin, end, after
        self.before = text[begin:end]
        self.line = text.count("\n", 0, begin) + 1
        ls = text.rfind("\n", 0, begin) + 1
        le = text.find("\n", end)
        le = len(text) if le < 0 else le
        self.context = text[ls:le]
        key = "\0".join([file, op, " ".join(self.context.split()),
                         str(begin - ls), self.before, after])
        self.id = hashlib.sha1(key.encode()).hexdigest()[:10]

    def apply(self, text):
        return text[:self.begin] + self.after + text[self.end:]

    def describe(self):
        b = " ".join(self.before.split())
        a = " ".join(self.after.split())
        if len(b) > 70:
            b = b[:67] + "..."
        if len(a) > 70:
            a = a[:67] + "..."
        return f"{self.file}:{self.line} [{self.op}] `{b}` -> `{a}`"

    def as_json(self):
        return {"id": self.id, "file": self.file, "line": self.line,
                "op": self.op, "from": self.before, "to": self.after}


REL = re.compile(r"(?<=\s)(<=|>=|<|>)(?=\s)")
ERROR_RETURN = re.compile(
    r"\breturn\s+(absl::[A-Z][A-Za-z]*Error\s*\(|absl::Status\s*\(|Invalid\s*\("
    r"|grpc::Status\s*\(|Denied\s*\(|[A-Z][A-Za-z]*Error\s*\()")
FUNC_HEAD = re.compile(r"^(?:static\s+|inline\s+)?([A-Za-z_][\w:<>,\s*&]*?)\s+"
                       r"[\w:~]+\s*\(", re.M)


def return_type_at(code, pos):
    """Return type of the function whose body holds `pos` (a top-level
    definition starting at column 0), or ''."""
    for m in reversed(list(FUNC_HEAD.finditer(code, 0, pos))):
        if code[m.start()] in " }":
            continue
        head = m.group(1).strip()
        if head in ("else", "return", "namespace", "using"):
            continue
        return head
    return ""


def conditions(code):
    """[(kind, open paren, close paren)] of if/while conditions."""
    out = []
    for m in re.finditer(r"\b(if|while)\s*\(", code):
        o = m.end() - 1
        c = match_paren(code, o)
        if c > 0:
            out.append((m.group(1), o, c))
    return out


def generate_file(path):
    with open(os.path.join(ROOT, path)) as f:
        text = f.read()
    code = blank(text)
    ms = []

    def add(op, b, e, after):
        ms.append(Mutant(path, text, op, b, e, after))

    # rel and bound: every binary comparison, spaces on both sides.
    for m in REL.finditer(code):
        b, e = m.start(), m.end()
        # `>` closing a template with a space after (e.g. `std::pair<a, b> x`):
        # skip when an unmatched `<` precedes it on the line.
        ls = code.rfind("\n", 0, b) + 1
        before_on_line = code[ls:b]
        if m.group(1) == ">" and before_on_line.count("<") > before_on_line.count(
                " < ") + before_on_line.count(" <= ") + before_on_line.count("<<") * 2:
            continue
        # `operator<` and friends, stream `<<` (never matched: no spaces).
        flip = {"<": "<=", "<=": "<", ">": ">=", ">=": ">"}[m.group(1)]
        add("rel", b, e, flip)
        rb = e
        while rb < len(code) and code[rb] == " ":
            rb += 1
        end = code.find(";", rb)
        re_ = operand_end(code, rb, end if end > 0 else len(code))
        if re_ > rb:
            operand = text[rb:re_]
            add("bound", rb, re_, f"{operand} + 1")
            add("bound", rb, re_, f"{operand} - 1")
    # bound: existing `+ 1` / `- 1` dropped (not `x - 1` in array sizes
    # alone: any, the tests judge).
    for m in re.finditer(r"\s[+-] 1\b(?![\w.])", code):
        add("bound", m.start(), m.end(), "")
    def drop_clauses(b, e):
        """clause: each clause of the top-level `||` (else `&&`) chain in
        [b, e) dropped with its operator."""
        for op in ("||", "&&"):
            spans = split_top(code, b, e, op)
            for k, (sb, se) in enumerate(spans):
                if k + 1 < len(spans):
                    add("clause", sb, spans[k + 1][0], "")
                else:
                    add("clause", spans[k - 1][1], se, "")
            if spans:
                break

    # cond and clause over if/while conditions.
    for kind, o, c in conditions(code):
        inner_b, inner_e = o + 1, c
        if kind == "if":
            add("cond", inner_b, inner_e, "true")
            add("cond", inner_b, inner_e, "false")
        drop_clauses(inner_b, inner_e)
    # clause over `bool x = a && b;` and `return a || b;` chains.
    for m in re.finditer(r"(\bbool\s+\w+\s*=|\breturn\b)", code):
        b = m.end()
        e = code.find(";", b)
        if e < 0:
            continue
        drop_clauses(b, e)
    # ok: error returns in functions returning a plain Status.
    for m in ERROR_RETURN.finditer(code):
        paren = code.find("(", m.start(1))
        close = match_paren(code, paren)
        semi = code.find(";", close)
        if close < 0 or semi < 0 or code[close + 1:semi].strip():
            continue
        rt = return_type_at(code, m.start())
        if rt in ("absl::Status", "Status"):
            add("ok", m.start(1), close + 1, "absl::OkStatus()")
        elif rt == "grpc::Status":
            add("ok", m.start(1), close + 1, "grpc::Status::OK")
    # loop: a for loop's start moved by one.
    for m in re.finditer(r"\bfor\s*\(", code):
        o = m.end() - 1
        c = match_paren(code, o)
        semi = code.find(";", o, c)
        if semi < 0:
            continue  # range-for
        init = re.search(r"=\s*([^;]+?)\s*$", code[o + 1:semi])
        if init:
            b = o + 1 + init.start(1)
            e = o + 1 + init.end(1)
            operand = text[b:e]
            add("loop", b, e, f"{operand} + 1")
            if operand.strip() != "0":
                add("loop", b, e, f"{operand} - 1")
    # One mutant per change (two rules may make the same one). The same
    # change of an identical line elsewhere in the file (bus_guard.cc's two
    # faulted-flag loops) is a mutant of its own: its id gets the number
    # of the occurrence, so the first one's id stays what it was.
    placed, count, out = set(), {}, []
    for mu in sorted(ms, key=lambda x: (x.begin, x.op, x.after)):
        if (mu.id, mu.begin) in placed:
            continue
        placed.add((mu.id, mu.begin))
        count[mu.id] = count.get(mu.id, 0) + 1
        if count[mu.id] > 1:
            mu.id = hashlib.sha1(
                f"{mu.id}\0{count[mu.id]}".encode()).hexdigest()[:10]
        out.append(mu)
    return out


def safety_files(globs):
    files = []
    for g in globs:
        d = os.path.dirname(g)
        for name in sorted(os.listdir(os.path.join(ROOT, d))):
            rel = os.path.join(d, name)
            if fnmatch.fnmatch(rel, g) and not name.endswith("_test.cc"):
                files.append(rel)
    return files


def load_equivalent():
    """{id: reason} from tools/mutants_equivalent.txt (`id file reason`)."""
    out = {}
    if not os.path.exists(EQUIVALENT):
        return out
    with open(EQUIVALENT) as f:
        for line in f:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            parts = line.split(None, 2)
            if len(parts) < 3:
                raise SystemExit(f"{EQUIVALENT}: '{line}': expected "
                                 "'<id> <file> <reason>'")
            out[parts[0]] = parts[2]
    return out


# --------------------------------------------------------------- running

_TARGETS = {}
TARGETS_OVERRIDE = []  # --targets


def targets_for(path):
    """Test targets of TEST_POOL that depend on `path`, the nearest first
    (the test named for the file, its package's tests, then tests/)."""
    if path in _TARGETS:
        return _TARGETS[path]
    pkg, name = os.path.split(path)
    label = f"//{pkg}:{name}"
    # --keep_going: a pool target renamed or gone is left out, not fatal.
    q = subprocess.run(
        ["bazel", "query", "--noshow_progress", "--keep_going",
         f"rdeps(set({' '.join(TEST_POOL)}), {label})"],
        cwd=ROOT, capture_output=True, text=True)
    if q.returncode not in (0, 3):
        raise SystemExit(f"bazel query for {label} failed:\n{q.stderr[-2000:]}")
    found = set(q.stdout.split()) & set(TEST_POOL)
    stem = name[:-3]

    # The file's own test kills most of its mutants; then the suites that
    # drive every check through the server (a package's other unit tests
    # rarely see another file's checks).
    def rank(t):
        tpkg, tname = t[2:].split(":")
        return (0 if tname == stem + "_test" else
                1 if t == "//tests:refusals_test" else
                2 if t == "//tests:server_test" else
                3 if tpkg == pkg else 4,
                TEST_POOL.index(t))

    _TARGETS[path] = sorted(found, key=rank)
    return _TARGETS[path]


_CHILD = []  # the bazel client running now, if any


def bazel(cmd, timeout):
    """(exit code or None on timeout, stdout + stderr). The client is
    interrupted (SIGINT), not killed: a killed client leaves its command
    running in the bazel server, which then blocks the next one."""
    p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True,
                         errors="replace")
    _CHILD[:] = [p]
    try:
        out, _ = p.communicate(timeout=timeout)
        return p.returncode, out
    except subprocess.TimeoutExpired:
        interrupt()
        return None, ""
    finally:
        _CHILD[:] = []


def interrupt():
    for p in _CHILD:
        p.send_signal(signal.SIGINT)
        try:
            p.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            p.kill()


class Restore:
    """Puts `path` back to `text` on exit, also on SIGTERM/SIGINT."""

    def __init__(self, path, text):
        self.path, self.text = path, text

    def __enter__(self):
        self.old = {s: signal.getsignal(s) for s in (signal.SIGTERM,
                                                     signal.SIGINT)}

        def handler(sig, frame):
            interrupt()
            self.restore()
            raise SystemExit(128 + sig)
        for s in self.old:
            signal.signal(s, handler)
        return self

    def restore(self):
        with open(self.path, "w") as f:
            f.write(self.text)

    def __exit__(self, *exc):
        self.restore()
        for s, h in self.old.items():
            signal.signal(s, h)


def run_mutant(mu, bazel_args, verbose=False, stop_at=None):
    """('killed' | 'survived' | 'broken' | 'stale' | 'timeout', detail);
    `stop_at`: a time.time() past which it is a timeout whatever
    PER_MUTANT_TIMEOUT says."""
    path = os.path.join(ROOT, mu.file)
    with open(path) as f:
        text = f.read()
    if text[mu.begin:mu.end] != mu.before:
        return "stale", "the file changed since the mutants were generated"
    targets = TARGETS_OVERRIDE or targets_for(mu.file)
    if not targets:
        return "untested", "no test target of the pool depends on the file"
    deadline = time.time() + PER_MUTANT_TIMEOUT
    if stop_at is not None:
        deadline = min(deadline, stop_at)
    with Restore(path, text):
        with open(path, "w") as f:
            f.write(mu.apply(text))
        # The nearest targets one by one (they kill most), then the rest
        # in one command: bazel links and runs them side by side.
        for group in [[t] for t in targets[:2]] + [targets[2:]]:
            if not group:
                continue
            left = deadline - time.time()
            if left <= 0:
                return "timeout", "the mutant's time ran out"
            # Only UI flags: a build or test option that differs from the
            # last command's makes bazel discard its analysis cache (and
            # with it minutes on a loaded machine). A mutant changes the
            # test binary, so no cached result is reused; the restored file
            # gets the cached one back.
            cmd = ["bazel", "test", *group, "--noshow_progress", *bazel_args]
            rc, out = bazel(cmd, left)
            if rc is None:
                return "timeout", f"{' '.join(group)}: the mutant's time ran out"
            if rc == 3:  # a test failed, or ran past its size's timeout
                failed = re.findall(r"^(//\S+)\s+(?:FAILED|TIMEOUT)", out, re.M)
                return "killed", " ".join(failed) or " ".join(group)
            if rc != 0:
                if verbose:
                    sys.stderr.write(out[-3000:])
                return "broken", f"bazel exit {rc}"
    return "survived", f"{len(targets)} targets passed"


def collect(globs):
    out = []
    for f in safety_files(globs):
        out.extend(generate_file(f))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--files", nargs="+", default=SAFETY_GLOBS,
                    help="globs of sources (default: the safety-critical ones)")
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--list", action="store_true", help="print every mutant")
    mode.add_argument("--count", action="store_true",
                      help="mutants per file and operator class")
    mode.add_argument("--sample", type=int, metavar="N",
                      help="run N mutants drawn with --seed")
    mode.add_argument("--sweep", action="store_true",
                      help="run every mutant of --files, record --results")
    mode.add_argument("--run", nargs="+", metavar="ID", help="run these ids")
    mode.add_argument("--patch", nargs=3, action="append",
                      metavar=("FILE", "FROM", "TO"),
                      help="run a hand-made mutant (FROM once in FILE)")
    mode.add_argument("--table", metavar="RESULTS",
                      help="print the sweep recorded in RESULTS as a markdown "
                           "table, per file and in all (docs/reliability.md)")
    ap.add_argument("--only", default="",
                    help="keep the mutants whose file contains this")
    ap.add_argument("--seed", default="0")
    ap.add_argument("--budget", type=float, default=0,
                    help="stop starting mutants after this many seconds")
    ap.add_argument("--overrun", type=float, default=0,
                    help="with --budget: stop a mutant still running this many "
                         "seconds after the budget ends (a timeout, not judged), "
                         "so the whole run ends by budget + overrun")
    ap.add_argument("--floor", type=float, default=0,
                    help="fail when the kill rate (percent) is below this")
    ap.add_argument("--min_judged", type=int, default=10,
                    help="apply --floor only when at least this many mutants "
                         "were judged (killed or survived): the rate of a "
                         "handful is chance, not a measurement")
    ap.add_argument("--results", default="",
                    help="JSON file a --sweep (or --run) merges its outcome "
                         "into, per mutant")
    ap.add_argument("--targets", nargs="+", default=[],
                    help="run these test targets instead of the rdeps")
    ap.add_argument("--verbose", action="store_true")
    ap.add_argument("--bazel-args", nargs=argparse.REMAINDER, default=[])
    args = ap.parse_args()
    if args.table:
        print_table(args.table)
        return 0

    TARGETS_OVERRIDE.extend(args.targets)
    mutants = [mu for mu in collect(args.files) if args.only in mu.file]
    equivalent = load_equivalent()
    if args.list:
        for mu in mutants:
            eq = "  (equivalent: %s)" % equivalent[mu.id] if mu.id in equivalent else ""
            print(f"{mu.id}  {mu.describe()}{eq}")
        print(f"{len(mutants)} mutants", file=sys.stderr)
        return 0
    if args.count:
        per = {}
        for mu in mutants:
            per.setdefault(mu.file, {}).setdefault(mu.op, 0)
            per[mu.file][mu.op] += 1
        for f, ops in per.items():
            print(f"{sum(ops.values()):5d}  {f}  " +
                  " ".join(f"{k}={v}" for k, v in sorted(ops.items())))
        print(f"{len(mutants)} mutants in {len(per)} files")
        return 0

    live = [mu for mu in mutants if mu.id not in equivalent]
    if args.sample is not None:
        rng = random.Random(args.seed)
        chosen = rng.sample(live, min(args.sample, len(live)))
    elif args.patch:
        chosen = []
        for f, before, after in args.patch:
            with open(os.path.join(ROOT, f)) as fh:
                text = fh.read()
            if text.count(before) != 1:
                raise SystemExit(f"{f}: '{before}' is there "
                                 f"{text.count(before)} times, not once")
            b = text.index(before)
            chosen.append(Mutant(f, text, "hand", b, b + len(before), after))
    elif args.run:
        byid = {mu.id: mu for mu in mutants}
        missing = [i for i in args.run if i not in byid]
        if missing:
            raise SystemExit(f"no such mutant: {missing}")
        chosen = [byid[i] for i in args.run]
    else:
        chosen = live
    t0 = time.time()
    outcome, rows = {}, []
    for k, mu in enumerate(chosen):
        if args.budget and time.time() - t0 > args.budget:
            print(f"budget of {args.budget:.0f} s spent: {len(chosen) - k} "
                  "mutants not run", flush=True)
            break
        t = time.time()
        stop_at = t0 + args.budget + args.overrun if args.budget and args.overrun else None
        verdict, why = run_mutant(mu, args.bazel_args, args.verbose, stop_at)
        outcome[verdict] = outcome.get(verdict, 0) + 1
        rows.append((mu, verdict, why))
        mark = "SURVIVED" if verdict == "survived" else verdict
        print(f"{mark:8} {time.time() - t:5.1f}s {mu.id} {mu.describe()}"
              f"  ({why})", flush=True)
    killed = outcome.get("killed", 0)
    judged = killed + outcome.get("survived", 0)
    rate = 100.0 * killed / judged if judged else 100.0
    print(f"{len(rows)} mutants in {time.time() - t0:.0f} s: " +
          ", ".join(f"{v} {k}" for k, v in sorted(outcome.items())) +
          f"; kill rate {rate:.1f}% of {judged}", flush=True)
    for mu, verdict, why in rows:
        if verdict == "survived":
            print(f"  survivor {mu.id} {mu.describe()}")
    if args.results and (args.sweep or args.run):
        record(args.results, args.files, mutants, equivalent, rows)
    if outcome.get("stale"):
        return 1
    if judged < args.min_judged:
        if args.floor:
            print(f"floor {args.floor:.0f}% not applied: {judged} judged, "
                  f"fewer than --min_judged {args.min_judged}", flush=True)
        return 0
    return 1 if rate < args.floor else 0


def print_table(path):
    """The sweep in `path` as docs/reliability.md shows it."""
    with open(path) as f:
        data = json.load(f)
    keys = ("generated", "swept", "equivalent", "killed", "survived", "broken")
    print("| file | generated | swept | equivalent | killed | survived | "
          "broken | kill rate | at |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")

    def rate(killed, survived):
        judged = killed + survived
        return (f"**{killed:,}/{judged:,} ({100.0 * killed / judged:.1f}%)**"
                if judged else "-")

    total = dict.fromkeys(keys, 0)
    for f, v in sorted(data["files"].items()):
        print(f"| {f} | " + " | ".join(f"{v[k]:,}" for k in keys) +
              f" | {rate(v['killed'], v['survived'])} | {v['commit']} |")
        for k in keys:
            total[k] += v[k]
    print(f"| **{len(data['files'])} files** | " +
          " | ".join(f"{total[k]:,}" for k in keys) +
          f" | {rate(total['killed'], total['survived'])} | |")
    now = data.get("generated_now", {})
    if now:
        print(f"\n{now['mutants']:,} mutants are generated now over "
              f"{now['files']} files; {len(data['files'])} of them swept.")


def record(path, globs, mutants, equivalent, rows):
    """Merges this sweep into the JSON at `path`, per file, under a lock
    (sweeps in several worktrees of one checkout merge into one file)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        merge(path, mutants, equivalent, rows)


def merge(path, mutants, equivalent, rows):
    data = {}
    if os.path.exists(path):
        with open(path) as f:
            data = json.load(f)
    data.setdefault("files", {})
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                            capture_output=True, text=True).stdout.strip()
    by_file = {}
    for mu in mutants:
        by_file.setdefault(mu.file, {"mutants": []})
    ran = {mu.id: (verdict, why) for mu, verdict, why in rows}
    this_run = {mu.file for mu, _, _ in rows}
    # A mutant not run now keeps its earlier verdict (a rerun of a few ids
    # after a new test updates them alone); one whose id no longer exists
    # (its line changed) is dropped.
    for f, d in data["files"].items():
        for m in d.get("mutants", []):
            if m["id"] not in ran and m["id"] not in equivalent:
                ran[m["id"]] = (m["verdict"], m["why"])
    for mu in mutants:
        if mu.id not in ran and mu.id not in equivalent:
            continue
        entry = mu.as_json()
        if mu.id in equivalent:
            entry["verdict"], entry["why"] = "equivalent", equivalent[mu.id]
        else:
            entry["verdict"], entry["why"] = ran[mu.id]
        by_file[mu.file]["mutants"].append(entry)
    for f, d in by_file.items():
        generated = sum(1 for mu in mutants if mu.file == f)
        ms = d["mutants"]
        count = {v: sum(1 for m in ms if m["verdict"] == v)
                 for v in ("equivalent", "killed", "survived", "broken",
                           "untested", "timeout", "stale")}
        if not ms:
            continue
        judged = count["killed"] + count["survived"]
        # A file none of whose mutants ran now (a --run of another file's
        # ids) keeps the commit and date it was judged at.
        old = data["files"].get(f, {})
        fresh = f in this_run or "commit" not in old
        data["files"][f] = {
            "commit": commit if fresh else old["commit"],
            "date": time.strftime("%Y-%m-%d") if fresh else old["date"],
            "generated": generated,
            "swept": len(ms),
            **count,
            "kill_rate": round(100.0 * count["killed"] / judged, 1) if judged else None,
            "mutants": ms,
        }
    tot = {k: sum(v[k] for v in data["files"].values())
           for k in ("generated", "equivalent", "killed", "survived", "broken")}
    judged = tot["killed"] + tot["survived"]
    data["total"] = {**tot, "kill_rate": round(100.0 * tot["killed"] / judged, 1)
                     if judged else None}
    # What the sweeps have not reached yet: every safety file's count now.
    every = {}
    for mu in collect(SAFETY_GLOBS):
        every[mu.file] = every.get(mu.file, 0) + 1
    data["generated_now"] = {
        "files": len(every), "mutants": sum(every.values()),
        "swept_files": sorted(f for f in data["files"] if f in every),
        "per_file": every}
    data["note"] = ("tools/mutants.py --sweep: per file, every generated "
                    "mutant's verdict; kill_rate = killed / (killed + "
                    "survived): equivalent and broken (does not compile) "
                    "left out")
    with open(path + ".tmp", "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
    os.replace(path + ".tmp", path)


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Mutant catalogue: every safety check must fail some test when broken.

Each entry of the catalogue (tools/mutants.txt) is a one-line change to a
bounds check, refusal, version comparison or dirty/clean transition, and
the test target (optionally a gtest filter) expected to catch it. For each
entry, one at a time, this tool

  1. checks that the line still reads exactly as the catalogue says, once
     in the file (code moved: the entry fails loudly, never silently
     skipped; update the catalogue with the code);
  2. applies the change, runs `bazel test` on the target, and restores the
     file whatever happens (also on Ctrl-C);
  3. counts the mutant killed when the build succeeded and a test failed
     (bazel's exit code 3), survived when every test passed, and broken
     when it didn't build (a catalogue error: fix the entry).

Exits 0 only if every mutant was killed. Prints a line per mutant and a
summary with the time taken.

    python3 tools/mutants.py [--catalogue tools/mutants.txt] [--only SUBSTR]
        [--bazel-args ...]

Catalogue format: one mutant per block of four lines, blocks separated by
a blank line, `#` lines are comments:

    file: daemon/core/copy_plan.cc
    from: if (s.row_begin + s.row_count > rows ||
    to:   if (s.row_count > rows ||
    test: //daemon/core:copy_plan_test CopyPlanTest.ASegmentsRowRange*

`from` and `to` are exact text (leading spaces of the value are kept after
the first one following the colon); `test` is a target and optionally a
gtest filter.
"""

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse(path):
    """[(line number, {file, from, to, test})] of the catalogue."""
    entries, block, start = [], {}, None
    with open(path) as f:
        lines = f.read().split("\n")
    for n, line in enumerate(lines + [""], 1):
        if line.startswith("#"):
            continue
        if not line.strip():
            if block:
                missing = {"file", "from", "to", "test"} - set(block)
                if missing:
                    raise SystemExit(f"{path}:{start}: mutant lacks {sorted(missing)}")
                entries.append((start, block))
            block, start = {}, None
            continue
        key, sep, value = line.partition(":")
        if not sep or key not in ("file", "from", "to", "test"):
            raise SystemExit(f"{path}:{n}: expected 'file:', 'from:', 'to:' or 'test:'")
        if key in block:
            raise SystemExit(f"{path}:{n}: '{key}' given twice in one mutant")
        block[key] = value[1:] if value.startswith(" ") else value
        start = start or n
    return entries


def run_one(entry, bazel_args):
    path = os.path.join(ROOT, entry["file"])
    with open(path) as f:
        text = f.read()
    count = text.count(entry["from"])
    if count != 1:
        return "stale", f"the line is in {entry['file']} {count} times (expected once)"
    target, _, flt = entry["test"].strip().partition(" ")
    cmd = ["bazel", "test", target, "--test_output=summary", "--noshow_progress",
           *bazel_args]
    if flt.strip():
        cmd.append(f"--test_arg=--gtest_filter={flt.strip()}")
    backup = tempfile.NamedTemporaryFile(delete=False, dir="/tmp", prefix="mutant.")
    backup.close()
    shutil.copy2(path, backup.name)
    try:
        with open(path, "w") as f:
            f.write(text.replace(entry["from"], entry["to"], 1))
        rc = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL).returncode
    finally:
        shutil.copy2(backup.name, path)
        os.unlink(backup.name)
    if rc == 3:
        return "killed", ""
    if rc == 0:
        return "SURVIVED", "every test passed"
    return "broken", f"bazel exit {rc} (the mutant doesn't build, or no test ran)"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--catalogue", default=os.path.join(ROOT, "tools", "mutants.txt"))
    ap.add_argument("--only", default="", help="run the mutants whose file contains this")
    ap.add_argument("--bazel-args", nargs=argparse.REMAINDER, default=[])
    args = ap.parse_args()
    entries = [(n, e) for n, e in parse(args.catalogue) if args.only in e["file"]]
    t0 = time.time()
    outcome = {}
    for n, e in entries:
        t = time.time()
        verdict, why = run_one(e, args.bazel_args)
        outcome[verdict] = outcome.get(verdict, 0) + 1
        print(f"{verdict:8} {time.time() - t:5.1f}s  mutants.txt:{n}  {e['file']}: "
              f"{e['from'].strip()[:70]}" + (f"  ({why})" if why else ""), flush=True)
    print(f"{len(entries)} mutants in {time.time() - t0:.0f} s: " +
          ", ".join(f"{v} {k}" for k, v in sorted(outcome.items())), flush=True)
    return 0 if outcome.get("killed", 0) == len(entries) else 1


if __name__ == "__main__":
    sys.exit(main())

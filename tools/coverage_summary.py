#!/usr/bin/env python3
"""Per-folder line and branch coverage from llvm-cov's and coverage.py's JSON.

tools/coverage.sh runs this after the tests:

    python3 tools/coverage_summary.py --llvm llvm.json [--python py.json]
        [--floor PCT]

--llvm is `llvm-cov export -summary-only` output, --python is
`coverage json` output. Prints one row per folder (lines and branches,
covered/total and percent; test sources are not counted) and the branch
coverage of the safety-critical code together (daemon/core, common and
backends/host). With --floor, exits 1 when that figure is below PCT.
"""

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Most specific first: a file counts in the first folder that holds it.
FOLDERS = ["daemon/core", "daemon/server", "daemon", "common", "backends/host"]
CORE = ["daemon/core", "common", "backends/host"]


def rel(path):
    # Bazel compiles in the execroot and names sources /proc/self/cwd/...
    path = os.path.normpath(path).removeprefix("/proc/self/cwd/")
    if os.path.isabs(path):
        path = os.path.relpath(path, ROOT)
    return path


def folder_of(path):
    if path.endswith("_test.cc") or path.startswith("tests/"):
        return None
    for f in FOLDERS:
        if path.startswith(f + "/"):
            return f
    return None


def pct(c, n):
    return f"{100.0 * c / n:5.1f}%" if n else "    -"


def row(name, lc, ln, bc, bn):
    return f"{name:16} {lc:6}/{ln:<6} {pct(lc, ln)}   {bc:6}/{bn:<6} {pct(bc, bn)}"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llvm", required=True)
    ap.add_argument("--python")
    ap.add_argument("--floor", type=float)
    args = ap.parse_args()
    sums = {f: [0, 0, 0, 0] for f in FOLDERS}
    with open(args.llvm) as f:
        data = json.load(f)
    for entry in data["data"][0]["files"]:
        folder = folder_of(rel(entry["filename"]))
        if folder is None:
            continue
        s = entry["summary"]
        acc = sums[folder]
        acc[0] += s["lines"]["covered"]
        acc[1] += s["lines"]["count"]
        acc[2] += s["branches"]["covered"]
        acc[3] += s["branches"]["count"]
    print(f"{'folder':16} {'lines':>13} {'':6}   {'branches':>13}")
    for f in FOLDERS:
        print(row(f + ("/*.cc" if f == "daemon" else ""), *sums[f]))
    if args.python:
        with open(args.python) as f:
            py = json.load(f)["totals"]
        print(row("client/python", py["covered_lines"], py["num_statements"],
                  py["covered_branches"], py["num_branches"]))
    core = [sum(sums[f][i] for f in CORE) for i in range(4)]
    print(row("core+common+host", *core))
    figure = 100.0 * core[2] / core[3] if core[3] else 0.0
    if args.floor is not None:
        if figure < args.floor:
            print(f"coverage: branch coverage of {' + '.join(CORE)} is {figure:.1f}%, "
                  f"below the floor of {args.floor}% (tools/coverage.sh): a test was "
                  f"lost or untested code was added", file=sys.stderr)
            return 1
        print(f"coverage: branch coverage of {' + '.join(CORE)} {figure:.1f}% "
              f">= floor {args.floor}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())

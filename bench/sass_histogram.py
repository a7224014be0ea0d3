#!/usr/bin/env python3
"""Opcode counts of GPU functions' SASS (static: each instruction once),
to see what a kernel spends its issue slots on (integer ALU against FMA
pipe work). Runs cuobjdump (on the GPU machines).

    python3 bench/sass_histogram.py FILE [NAME_REGEX] [TOP]

FILE: an executable or .cubin; NAME_REGEX picks functions by mangled name.
"""

import collections
import re
import subprocess
import sys


def functions(path):
    out = subprocess.run(["cuobjdump", "-sass", path], capture_output=True, text=True,
                         check=True).stdout
    name, body = None, []
    for line in out.splitlines():
        m = re.match(r"\s*Function : (\S+)", line)
        if m:
            if name:
                yield name, body
            name, body = m.group(1), []
            continue
        m = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)(\.[A-Z0-9_.]*)?", line)
        if name and m:
            body.append(m.group(2))
    if name:
        yield name, body


def main():
    path = sys.argv[1]
    pattern = re.compile(sys.argv[2] if len(sys.argv) > 2 else ".")
    top = int(sys.argv[3]) if len(sys.argv) > 3 else 18
    for name, body in functions(path):
        if not pattern.search(name):
            continue
        counts = collections.Counter(body)
        print(f"{name[:110]}: {len(body)} instructions")
        print("  " + ", ".join(f"{op} {n}" for op, n in counts.most_common(top)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

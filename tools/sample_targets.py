#!/usr/bin/env python3
"""A seeded sample of test targets (CI's ASan pass, .ci/run): every target
named by --always, and of the rest a --fraction drawn with random.Random(
--seed): the commit's hash in CI, so each commit gets its own sample and a
rerun of one commit the same. Over commits every target is drawn.

    python3 tools/sample_targets.py --seed SEED --fraction 0.5 \\
        --always //tests:hostile_test ... -- TARGET...

prints the chosen targets, one a line, in the order given.
"""

import argparse
import random
import sys


def sample(targets, always, fraction, seed):
    rest = [t for t in targets if t not in always]
    k = round(len(rest) * fraction)
    drawn = set(random.Random(seed).sample(rest, k))
    return [t for t in targets if t in always or t in drawn]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", required=True)
    ap.add_argument("--fraction", type=float, required=True)
    ap.add_argument("--always", nargs="*", default=[])
    ap.add_argument("targets", nargs="*")
    args = ap.parse_args(argv)
    if not 0 <= args.fraction <= 1:
        ap.error("--fraction must be in [0, 1]")
    missing = [t for t in args.always if t not in args.targets]
    if missing:
        print(f"sample_targets: --always names targets that are not tests: {missing}",
              file=sys.stderr)
        return 2
    for t in sample(args.targets, set(args.always), args.fraction, args.seed):
        print(t)
    return 0


if __name__ == "__main__":
    sys.exit(main())

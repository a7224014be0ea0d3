#!/usr/bin/env bash
# Issue 16: the Python package installs the way a user installs it, offline
# (Debian's setuptools, wheel and pip; no package index; grpcio, protobuf and
# numpy from the system through --system-site-packages; no build isolation),
# and the Python suite passes against the installed package:
#
#   venv A: pip install ./client/python            (from the folder)
#   venv B: pip wheel ./client/python, then pip install the wheel
#
# In each, weightsync.__file__ must lie inside the venv, `python -m weightsync
# --version` and the `weightsync` console script must print /VERSION, and
# the suite (client/python/tests/test_*.py, WEIGHTSYNC_TEST_INSTALLED=1) runs
# from a tree that holds the tests and their vectors but not the package's
# source, so nothing but the installed package can be imported.
#
# Run by Bazel (//tests:pip_install_test); by hand from the repository root:
#   WEIGHTSYNCD=bazel-bin/daemon/weightsyncd bash tests/pip_install_test.sh
set -euo pipefail
if [ -n "${TEST_SRCDIR:-}" ]; then
  cd "${TEST_SRCDIR}/${TEST_WORKSPACE}"
  export WEIGHTSYNCD="$PWD/daemon/weightsyncd"
else
  cd "$(dirname "$0")/.."
  export WEIGHTSYNCD="$(realpath "${WEIGHTSYNCD:-bazel-bin/daemon/weightsyncd}")"
fi
py=/usr/bin/python3
[ -x "$py" ] || py=python3
unset PYTHONPATH PYTHONHOME PIP_INDEX_URL PIP_EXTRA_INDEX_URL
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1 PIP_NO_CACHE_DIR=1 PYTHONDONTWRITEBYTECODE=1
version=$(tr -d ' \n' < VERSION)

work=$(mktemp -d /tmp/ws-pip.XXXXXX)
trap 'rm -rf "$work"' EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }
step() { printf '%s  %s\n' "$(date +%T)" "$*"; }

# The package's source as pip sees it in a checkout, copied: an in-tree
# build writes build/ and weightsync.egg-info next to pyproject.toml.
mkdir -p "$work/src"
cp -L client/python/pyproject.toml client/python/README.md client/python/LICENSE "$work/src/"
cp -rL client/python/weightsync "$work/src/"
rm -rf "$work/src/weightsync/__pycache__"

# The tests and their vectors, without the package.
mkdir -p "$work/tree/client/python/tests" "$work/tree/tests/vectors"
cp -L client/python/tests/*.py "$work/tree/client/python/tests/"
cp -rL client/python/tests/fake_vllm "$work/tree/client/python/tests/"
cp -L tests/vectors/chunk_plan.json tests/vectors/receipts.json tests/vectors/fp8.json \
  tests/vectors/transfer_plan.json \
  "$work/tree/tests/vectors/"
tests=$(cd "$work/tree" && ls client/python/tests/test_*.py)

step "venv A: pip install ./client/python"
"$py" -m venv --system-site-packages "$work/a"
"$work/a/bin/pip" install --quiet --no-index --no-build-isolation "$work/src"

step "venv B: pip wheel, then pip install the wheel"
"$work/a/bin/pip" wheel --quiet --no-index --no-build-isolation --no-deps \
  -w "$work/dist" "$work/src"
wheel=$(ls "$work"/dist/weightsync-"$version"-*.whl) ||
  fail "no weightsync-$version wheel in $(ls "$work/dist")"
"$py" - "$wheel" <<'EOF'
import sys, zipfile
names = set(zipfile.ZipFile(sys.argv[1]).namelist())
for want in ("weightsync/__init__.py", "weightsync/__main__.py", "weightsync/_version.py",
             "weightsync/weightsync_v1.desc"):
    assert want in names, f"{want} missing from {sys.argv[1]}: {sorted(names)}"
meta = [n for n in names if n.endswith(".dist-info/METADATA")]
text = zipfile.ZipFile(sys.argv[1]).read(meta[0]).decode()
for want in ("Requires-Dist: grpcio", "Requires-Dist: protobuf", "Requires-Dist: numpy",
             "Provides-Extra: torch"):
    assert want in text, f"{want!r} missing from METADATA:\n{text}"
# vLLM loads the "weightsync" weight-transfer backend in each of its processes.
entry = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
text = zipfile.ZipFile(sys.argv[1]).read(entry[0]).decode()
want = "[vllm.general_plugins]\nweightsync = weightsync.integrations.vllm_transfer:register"
assert want in text, f"{want!r} missing from entry_points.txt:\n{text}"
# The license travels with the wheel (client/python/LICENSE is the root's).
lic = [n for n in names if n.endswith(".dist-info/LICENSE")]
assert lic, f"no LICENSE in the wheel's dist-info: {sorted(names)}"
assert b"Apache License" in zipfile.ZipFile(sys.argv[1]).read(lic[0])
EOF
"$py" -m venv --system-site-packages "$work/b"
"$work/b/bin/pip" install --quiet --no-index "$wheel"

for v in a b; do
  venv="$work/$v"
  step "venv $v: the installed package"
  (cd "$work/tree" && "$venv/bin/python" - "$venv" "$version") <<'EOF'
import os, sys
import weightsync
venv, version = sys.argv[1], sys.argv[2]
where = os.path.realpath(weightsync.__file__)
assert where.startswith(os.path.realpath(venv) + os.sep), f"weightsync from {where}, not {venv}"
assert weightsync.__version__ == version, (weightsync.__version__, version)
desc = os.path.join(os.path.dirname(where), "weightsync_v1.desc")
assert os.path.getsize(desc) > 0, desc
print(f"  weightsync {weightsync.__version__} from {where}")
EOF
  out=$(cd "$work/tree" && "$venv/bin/python" -m weightsync --version)
  [ "$out" = "weightsync $version" ] || fail "python -m weightsync --version: '$out'"
  out=$("$venv/bin/weightsync" --version)
  [ "$out" = "weightsync $version" ] || fail "weightsync --version: '$out'"
  echo "  python -m weightsync --version and the weightsync script: $out"
done

# The suite against venv B (the wheel, what most users get); the folder
# install of venv A runs the CLI's tests (its daemon checks included).
run_suite() {
  local venv=$1; shift
  for t in "$@"; do
    step "venv $(basename "$venv"): $t"
    if ! (cd "$work/tree" && WEIGHTSYNC_TEST_INSTALLED=1 "$venv/bin/python" "$t") \
        > "$work/out" 2>&1; then
      cat "$work/out"
      fail "$t against the package installed in venv $(basename "$venv")"
    fi
    grep -E "^(Ran|OK|all passed)" "$work/out" | sed 's/^/  /' || true
  done
}
run_suite "$work/b" $tests
run_suite "$work/a" client/python/tests/test_cli.py
step "all passed"

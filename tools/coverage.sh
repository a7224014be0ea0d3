#!/usr/bin/env bash
# Line and branch coverage of daemon/, common/ and backends/host (clang
# source-based coverage, llvm-cov) and of client/python (python3-coverage,
# Debian's coverage.py), from the test suite (issue 21; docs/reliability.md,
# "Coverage", has the figures). Usage: bash tools/coverage.sh
# Runs every non-GPU test once under .bazelrc's cov config (instrumented;
# the daemon binary the shell and Python tests start is instrumented too),
# then client/python/tests under coverage.py. Prints the summary per folder
# and fails (exit 1) when a test fails or the branch coverage of
# daemon/core + common + backends/host is below FLOOR: a few points under the
# figure measured when it was set (timing-dependent branches move it by
# ~0.1). Raise it when tests are added; don't lower it to make CI pass.
# Writes to ${OUT:-/tmp/wscov}: coverage.txt (the summary and the per-file
# tables), all.profdata, bazel.log, python.log. The lines and branches left:
#   llvm-cov show $(cat /tmp/wscov/llvm-cov-args) -show-branches=count \
#     daemon/core/coordinator.cc
set -uo pipefail
cd "$(dirname "$0")/.."
FLOOR=84
OUT="${OUT:-/tmp/wscov}"
# .bazelrc's cov config has every instrumented process write its profile here.
PROFILES=/tmp/wscov
rm -rf "$PROFILES" "$OUT"; mkdir -p "$PROFILES" "$OUT"
t0=$(date +%s)
BAZEL=(nice -n 19 bazel)

# --- C++ (and the instrumented daemon that the shell and Python tests start).
# Not the gpu-tagged tests, nor backends/cuda (nvcc; not in the report), nor
# pip_install_test (the Python tests again, from an installed copy: no new
# lines), nor the slow process-level suites whose branches the unit and
# server tests reach too (faults_test 145 s, soak_test, deb_test,
# deploy_test: measured 2026-11-25, the figures moved by less than the
# floor's margin; they run in bazel test //... and under ASan).
mapfile -t targets < <("${BAZEL[@]}" query 'tests(//...) except attr(tags, "gpu", //...)
    except //backends/cuda/... except //tests:gpu_worker_supervision_test
    except //tests:pip_install_test except //tests:faults_test
    except //tests:soak_test except //tests:deb_test except //tests:deploy_test' 2>/dev/null)
"${BAZEL[@]}" test --config=cov "${targets[@]}" //daemon:weightsyncd >"$OUT/bazel.log" 2>&1
rc=$?
if [ $rc != 0 ]; then
  tail -n 30 "$OUT/bazel.log"
  # What each failed test printed last (CI keeps nothing else).
  testlogs="$("${BAZEL[@]}" info --config=cov bazel-testlogs 2>/dev/null)"
  grep -oE '^//[^ ]+ +FAILED' "$OUT/bazel.log" | awk '{print $1}' | while read -r t; do
    log="$testlogs/$(echo "${t#//}" | tr ':' '/')/test.log"
    echo "=== $t: the end of $log"
    grep -E 'Failure|FAILED|Expected|Which is|Value of|Actual|error' "$log" | head -n 40
    tail -n 40 "$log"
  done
  echo "coverage: tests failed under the cov build (bazel exit $rc); $OUT/bazel.log" >&2
fi
BIN="$("${BAZEL[@]}" info --config=cov bazel-bin 2>/dev/null)"
t_cc=$(date +%s)

# --- Python: the client's tests, run as //client/python's sh_tests run them
# (tests/run_python.sh: Debian's python3, WEIGHTSYNCD the daemon binary; here
# the instrumented one, so its profile counts too), from the repository root.
pyjson=()
if /usr/bin/python3 -c 'import coverage' 2>/dev/null; then
  export WEIGHTSYNCD="$BIN/daemon/weightsyncd" LLVM_PROFILE_FILE="$PROFILES/%p-%m.profraw"
  export COVERAGE_FILE="$OUT/.coverage"
  for f in client/python/tests/test_*.py; do
    if ! /usr/bin/python3 -m coverage run -p --branch --source=client/python/weightsync \
        "$f" >>"$OUT/python.log" 2>&1; then
      echo "coverage: $f failed; $OUT/python.log" >&2
      rc=1
    fi
  done
  /usr/bin/python3 -m coverage combine -q "$OUT"/.coverage.* &&
    /usr/bin/python3 -m coverage json -q -o "$OUT/python.json" &&
    /usr/bin/python3 -m coverage report >"$OUT/python.txt" &&
    pyjson=(--python "$OUT/python.json")
else
  echo "coverage: python3-coverage not installed (.ci/install-deps.sh); Python skipped" >&2
  rc=1
fi
t_py=$(date +%s)

# --- Merge and report.
llvm-profdata merge -sparse -o "$OUT/all.profdata" "$PROFILES"/*.profraw || exit 1
objects=()
for t in $("${BAZEL[@]}" query "kind(cc_test, set(${targets[*]}))" 2>/dev/null) //daemon:weightsyncd; do
  p="$BIN/$(echo "${t#//}" | tr ':' '/')"
  # llvm-cov takes the first binary as its positional argument, the others
  # with -object (and then positional source paths, to filter the report).
  [ -x "$p" ] && { [ ${#objects[@]} = 0 ] && objects+=("$p") || objects+=(-object "$p"); }
done
# Bazel names the sources /proc/self/cwd/...: map them onto this checkout.
cov_args=(-instr-profile "$OUT/all.profdata" "${objects[@]}" -path-equivalence="/proc/self/cwd,$PWD"
  -ignore-filename-regex='(_test\.cc$|/tests/|/external/|/bazel-out/|\.pb\.(cc|h)$)')
echo "${cov_args[@]}" >"$OUT/llvm-cov-args"
llvm-cov export -summary-only "${cov_args[@]}" >"$OUT/llvm.json" 2>"$OUT/llvm-cov.log" || exit 1
{
  echo "== coverage (${#targets[@]} bazel targets; C++ $((t_cc - t0)) s," \
    "Python $((t_py - t_cc)) s)"
  python3 tools/coverage_summary.py --llvm "$OUT/llvm.json" "${pyjson[@]}" --floor "$FLOOR"
} | tee "$OUT/coverage.txt"
floor_rc=${PIPESTATUS[0]}
{
  echo; echo "== C++ per file (llvm-cov report)"
  llvm-cov report "${cov_args[@]}" -show-branch-summary daemon common backends/host
  echo; echo "== Python per file (coverage.py)"; cat "$OUT/python.txt" 2>/dev/null
} >>"$OUT/coverage.txt" 2>&1
echo "coverage: $(( $(date +%s) - t0 )) s; per-file tables in $OUT/coverage.txt"
[ $floor_rc = 0 ] || exit 1
exit $rc

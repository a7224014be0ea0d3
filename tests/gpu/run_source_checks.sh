#!/usr/bin/env bash
# One-GPU proof and benchmark of the registered source and receipts v2
# (issues "Python users get the full speed" / "Mixture-of-experts scale"),
# on nvidia-h200 or nvidia-h100-x1, one command:
#   COMMIT=<sha> bash tests/gpu/run_source_checks.sh [BIN_DIR=.dev/bin] [LOG_DIR=/tmp/ws-src]
# BIN_DIR holds weightsyncd, weightsync_gpu_worker (and ipc_alloc_size, the
# probe of ../shared/probes built here). Runs: the legacy-IPC allocation-size
# probe and the torch third-process probe (the issue's finding), the Triton
# receipt check, tests/gpu/test_registered_source.py (transformers model,
# trainer and engine on one GPU), bench/python_ipc_bench.py (->
# LOG_DIR/python_ipc.json), the C++ client's figures (weightsync_gpu_trainer
# and weightsync_gpu_engine in BIN_DIR; merged into python_ipc.json) and
# bench/manifest_scale.py on the ipc backend (-> manifest_scale_ipc.json).
# STEPS picks parts (see below): a device call runs 10 minutes at most, so
# e.g. STEPS="test bench cpp" in one call and STEPS=manifest in another.
# Every process runs under `timeout`; prints a PASS/FAIL table last; full
# logs under LOG_DIR.
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
. "$here/gpu_env.sh"
gpu_env "$repo" "${1:-.dev/bin}" "${2:-/tmp/ws-src}" || exit 2
export WS_LOG_DIR="$LOG"
results=()
record() { results+=("$(printf '%-60s %s' "$1" "$2")"); }
run() {  # name seconds command...
  local name="$1" secs="$2"; shift 2
  echo "=== $name" >&2
  timeout -k 10 "$secs" "$@" >"$LOG/$name.log" 2>&1
  local rc=$?
  tail -n "${TAIL:-12}" "$LOG/$name.log" | sed "s/^/  [$name] /"
  if [ $rc = 0 ]; then record "$name" PASS
  elif [ $rc = 124 ] || [ $rc = 137 ]; then record "$name (timed out after ${secs}s)" FAIL
  else record "$name (exit $rc)" FAIL; fi
}
{ echo "date: $(date -Is) commit: ${COMMIT:-?}"; nvidia-smi -L
  "$PY" -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'; } \
  >"$LOG/env.txt" 2>&1
cat "$LOG/env.txt"
# STEPS: which parts run (default all): probes triton test bench cpp manifest
# (SKIP_PROBES=1 drops probes, ONLY_TEST=1 keeps only test). The cpp step
# uses chunks of 8 MiB, the daemon's default that the Python client takes.
STEPS=" ${STEPS:-probes triton test bench cpp manifest} "
[ -n "${SKIP_PROBES:-}" ] && STEPS="${STEPS/ probes / }"
[ -n "${ONLY_TEST:-}" ] && STEPS=" test "
step() { case "$STEPS" in *" $1 "*) return 0;; esac; return 1; }
if [ -x "$BIN/ipc_alloc_size" ] && step probes; then
  for n in 16381470720 16382951424 4295016448 4296015872; do
    run "ipc_alloc_size_$n" 120 "$BIN/ipc_alloc_size" "$n"
  done
fi
probe="$BIN/../torch_ipc_third_process.py"
if [ -f "$probe" ] && step probes; then
  run torch_ipc_third_process 300 "$PY" "$probe"
fi
step triton && run check_receipts_gpu 300 "$PY" tests/gpu/check_receipts_gpu.py
step test && TAIL=40 run test_registered_source 600 "$PY" tests/gpu/test_registered_source.py "$WEIGHTSYNCD" "$WEIGHTSYNC_GPU_WORKER"
step bench && TAIL=20 run python_ipc_bench 900 "$PY" bench/python_ipc_bench.py "$WEIGHTSYNCD" "$WEIGHTSYNC_GPU_WORKER" "$LOG/python_ipc.json"
# The C++ client's figures (issue 15, "C++ parity"): weightsync_gpu_trainer
# on ipc by registered source (its tensors -> the engine's tensors, one
# Start{finish} call per update) into weightsync_gpu_engine's Qwen3-8B bf16
# parameters, with its own on-GPU copy of the same bytes in the same run.
cpp_ipc() {  # tag trainer-flags...
  local tag=$1; shift
  local sock="$LOG/cpp.sock"; rm -f "$sock"; chmod 750 "$LOG"
  timeout 300 "$BIN/weightsyncd" --socket="$sock" --gpu=0 --gpu_worker="$BIN/weightsync_gpu_worker" \
    --notice_timeout_ms=60000 ${WS_DAEMON_EXTRA:-} >"$LOG/cpp-daemon-$tag.log" 2>&1 &
  local d=$!
  for _ in $(seq 100); do [ -S "$sock" ] && break; sleep 0.1; done
  timeout 300 "$BIN/weightsync_gpu_engine" --target="unix:$sock" --engine_id=e --model=qwen3-8b \
    --layout=plain --dtype=bfloat16 --device=0 --verify=false >"$LOG/cpp-engine-$tag.log" 2>&1 &
  local e=$!
  for _ in $(seq 600); do grep -q registered "$LOG/cpp-engine-$tag.log" && break; sleep 0.1; done
  timeout 300 "$BIN/weightsync_gpu_trainer" --target="unix:$sock" --backend=ipc --model=qwen3-8b \
    --dtype=bfloat16 --updates=8 --same_data --chunk_mib=8 --device=0 "$@"
  local rc=$?
  kill -TERM $e $d 2>/dev/null; sleep 0.5; kill -KILL $e $d 2>/dev/null; wait $e $d 2>/dev/null
  return $rc
}
export -f cpp_ipc; export BIN LOG
if step cpp && [ -x "$BIN/weightsync_gpu_trainer" ]; then
  run cpp_ipc_receipts_off 400 bash -c 'cpp_ipc "$@"' _ off --baseline_copy
  run cpp_ipc_daemon_receipts 400 bash -c 'cpp_ipc "$@"' _ daemon_receipts --receipts --nocheck_receipts
  # The default: receipts on and checked, the expectation on the GPU.
  run cpp_ipc_receipts_default 400 bash -c 'cpp_ipc "$@"' _ default --receipts
  # The same with the receipt pass after the copy (before the fused kernel).
  WS_DAEMON_EXTRA="--ipc_fused_receipts=false ${WS_DAEMON_EXTRA:-}" \
    run cpp_ipc_daemon_receipts_unfused 400 bash -c 'cpp_ipc "$@"' _ unfused --receipts --nocheck_receipts
  "$PY" - "$LOG" <<'PY' >"$LOG/cpp_ipc.txt" 2>&1
import json, os, re, statistics, sys
log = sys.argv[1]
def medians(name):
    text = open(os.path.join(log, name + ".log")).read()
    s = [float(x) for x in re.findall(r"^update v\d+: .*?, ([0-9.]+) s,", text, re.M)]
    copy = re.search(r"baseline on-GPU copy: .*?, ([0-9.]+) s,", text)
    return (statistics.median(s[1:]) if len(s) > 1 else None), (float(copy.group(1)) if copy else None)
off, copy_s = medians("cpp_ipc_receipts_off")
daemon, _ = medians("cpp_ipc_daemon_receipts")
def with_expectation(name):
    # Each update's time plus its expectation's (the user's default).
    text = open(os.path.join(log, name + ".log")).read()
    upd = {int(v): float(x) for v, x in re.findall(r"^update v(\d+): .*?, ([0-9.]+) s,", text, re.M)}
    exp = {int(v): float(x) for v, x in re.findall(
        r"^update v(\d+): receipts ok .*?expectation on the gpu ([0-9.]+) s", text, re.M)}
    both = [upd[v] + exp[v] for v in sorted(upd) if v in exp][1:]
    return (statistics.median(both) if both else None,
            statistics.median(sorted(exp.values())[1:]) if len(exp) > 1 else None)
default, expect = (None, None)
if os.path.exists(os.path.join(log, "cpp_ipc_receipts_default.log")):
    default, expect = with_expectation("cpp_ipc_receipts_default")
unfused = None
if os.path.exists(os.path.join(log, "cpp_ipc_daemon_receipts_unfused.log")):
    unfused, _ = medians("cpp_ipc_daemon_receipts_unfused")
out = {"cpp_copy_s": copy_s, "cpp_update_s_receipts_off": off,
       "cpp_update_s_daemon_receipts": daemon,
       "cpp_update_s_daemon_receipts_unfused": unfused,
       "cpp_update_s_default": default, "cpp_expected_receipts_s": expect,
       "cpp_ratio_default": copy_s / default if copy_s and default else None,
       "cpp_ratio_receipts_off": copy_s / off if copy_s and off else None}
print(json.dumps(out))
path = os.path.join(log, "python_ipc.json")
if os.path.exists(path):
    res = json.load(open(path))
    res.update(out)
    json.dump(res, open(path, "w"), indent=1)
PY
  cat "$LOG/cpp_ipc.txt"
fi
# Control cost at mixture-of-experts scale on the ipc backend (issue 22).
step manifest && TAIL=12 run manifest_scale_ipc "${MANIFEST_TIMEOUT:-900}" "$PY" bench/manifest_scale.py \
  --weightsyncd "$WEIGHTSYNCD" --gpu-worker "$WEIGHTSYNC_GPU_WORKER" \
  --tensors "${MANIFEST_TENSORS:-400,4000,40000,100000}" \
  --kind "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), ipc backend" \
  --out "$LOG/manifest_scale_ipc.json"
echo
echo "=== registered source checks ($LOG)"
for r in "${results[@]}"; do echo "$r"; done
for r in "${results[@]}"; do case "$r" in *FAIL) exit 1;; esac; done
exit 0

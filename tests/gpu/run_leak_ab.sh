#!/usr/bin/env bash
# Issue 36: where does the NCCL worker's resident memory creep come from?
# The leak check's NCCL mode (tests/gpu/run_leak_checks.sh, 2 GPUs) once per
# environment, same machine, same binaries:
#   base    as shipped
#   arena2  MALLOC_ARENA_MAX=2 (glibc keeps one arena per thread by default,
#           up to 8 x cores; NCCL starts new threads for every communicator)
#   noras   NCCL_RAS_ENABLE=0 (NCCL's RAS thread keeps peer state)
#   bash tests/gpu/run_leak_ab.sh BIN OUTDIR [ROUNDS=12] [VARIANTS="base arena2 noras"]
# Prints each variant's judge line and its worker's RSS after each dropped
# communicator; logs under OUTDIR/<variant>.
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
bin="$1"; out="$(mkdir -p "$2" && cd "$2" && pwd)"; rounds="${3:-12}"
for v in ${4:-base arena2 noras}; do
  case "$v" in
    base) env=() ;;
    arena2) env=(MALLOC_ARENA_MAX=2) ;;
    noras) env=(NCCL_RAS_ENABLE=0) ;;
    *) echo "unknown variant $v"; exit 2 ;;
  esac
  mkdir -p "$out/$v"
  env "${env[@]}" timeout -k 10 "${T_VARIANT:-170}" bash "$here/run_leak_checks.sh" "$bin" \
    "$out/$v" "$rounds" >"$out/$v/run.txt" 2>&1
  echo "== $v (${env[*]:-as shipped}): rc $?"
  grep -E "^(PASS|FAIL) GPU leak" "$out/$v/run.txt"
  grep -h "nccl.comm_released" "$out/$v"/*.log 2>/dev/null | sed 's/.*RSS/RSS/' | tr '\n' ';' | cut -c1-900
  echo
done

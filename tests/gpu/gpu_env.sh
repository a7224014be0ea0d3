# The GPU scripts' shared prologue (sourced, not run): the packed binaries
# and a log folder from the script's arguments, and the environment every
# GPU run needs (../shared/DEVICE.md).
#   gpu_env REPO BIN_DIR LOG_DIR
# sets BIN (absolute), LOG (absolute, created), PY, WEIGHTSYNCD and
# WEIGHTSYNC_GPU_WORKER, NCCL's library and the packed libraries on
# LD_LIBRARY_PATH, the client package on PYTHONPATH, NCCL_NVLS_ENABLE=0 and
# unbuffered Python output; then changes into REPO.
gpu_env() {
  local repo="$1"
  BIN="$(cd "$2" 2>/dev/null && pwd)" || { echo "gpu_env: no folder $2" >&2; return 1; }
  mkdir -p "$3"
  LOG="$(cd "$3" && pwd)"
  export NCCL_NVLS_ENABLE=0
  local nccl
  nccl=$(python3 -c 'import nvidia, os; print(os.path.join(nvidia.__path__[0], "nccl", "lib"))' 2>/dev/null)
  export LD_LIBRARY_PATH="$BIN/../lib:${nccl:+$nccl:}/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  export PYTHONPATH="$repo/client/python${PYTHONPATH:+:$PYTHONPATH}"
  export WEIGHTSYNCD="$BIN/weightsyncd" WEIGHTSYNC_GPU_WORKER="$BIN/weightsync_gpu_worker"
  export PYTHONUNBUFFERED=1
  PY="${PYTHON:-python3}"
  cd "$repo" || return 1
}

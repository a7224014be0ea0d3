# Sourced by the GPU scripts: stop_all stops every process in the array
# `pids` and empties it. TERM first: each pid is usually a `timeout`, which
# passes TERM on to its child (the daemon then stops its GPU worker); a
# KILL of the `timeout` would leave the child running with its GPU memory
# (bench/run_sparse_breakdown.sh left ~33 GB a run that way). KILL after
# 10 s for what is still there.
stop_all() {
  for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null; done
  for _ in $(seq 100); do
    local alive=0
    for p in "${pids[@]}"; do kill -0 "$p" 2>/dev/null && alive=1; done
    [ $alive = 0 ] && break
    sleep 0.1
  done
  for p in "${pids[@]}"; do kill -KILL "$p" 2>/dev/null; done
  pids=(); true
}

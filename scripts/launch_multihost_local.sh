#!/usr/bin/env bash
# Start N cooperating jax.distributed processes on this machine (process 0 is the
# coordinator and the scheduler), each with its own share of the devices, and wait for
# all of them. Ctrl-C / SIGTERM stops every process, process 0 first (below); the script
# ends once every process has, with the first non-zero exit code among them.
#
#   scripts/launch_multihost_local.sh [-n N] [-d DEVICES_PER_PROCESS] [-p PORT] -- CMD [ARGS...]
#
# Each process runs CMD with JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID
# set (read by jaxserve.distributed.resolve). On the CPU, each process gets
# DEVICES_PER_PROCESS emulated devices; with GPUs, process i sees GPUs
# [i*D, (i+1)*D) through CUDA_VISIBLE_DEVICES. Output goes to LOG_DIR/process_<i>.log
# (default ./multihost_logs), process 0's is also shown.
#
# Example (2 processes x 4 CPU devices, the multi-process MoE benchmark):
#   scripts/launch_multihost_local.sh -n 2 -d 4 -- \
#       python scripts/bench_ep.py --worker --steps 200 --out /tmp/coordination
set -euo pipefail

num=2
per=4
port=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    -n) num="$2"; shift 2 ;;
    -d) per="$2"; shift 2 ;;
    -p) port="$2"; shift 2 ;;
    --) shift; break ;;
    *) echo "usage: $0 [-n N] [-d DEVICES_PER_PROCESS] [-p PORT] -- CMD [ARGS...]" >&2; exit 2 ;;
  esac
done
[[ $# -gt 0 ]] || { echo "$0: no command given after --" >&2; exit 2; }

if [[ -z "$port" ]]; then
  # A free port; the step channel also uses the next two, a failed leader the third
  # (jaxserve.distributed.start_status).
  port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
fi
log_dir="${LOG_DIR:-multihost_logs}"
mkdir -p "$log_dir"
gpus=$(command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | wc -l || echo 0)

pids=()
# Ctrl-C / SIGTERM: SIGTERM to process 0 only. A `jaxserve serve` leader then stops its
# engine, which sends STOP to the followers: they end cleanly at the same step. A follower
# stopped at the same time as the leader would leave the run under it (mid-step or during
# its background compilation) and skip jax.distributed's shutdown barrier, where the
# leader's engine would then wait until killed. The followers still running once process
# 0 is gone get SIGTERM then; a second Ctrl-C / SIGTERM (or one after process 0 ended)
# goes to every process at once.
signals=0
forward() {
  signals=$((signals + 1))
  local targets=("${pids[0]}")
  [[ "$signals" -eq 1 ]] && kill -0 "${pids[0]}" 2>/dev/null || targets=("${pids[@]}")
  for pid in "${targets[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
}
trap forward INT TERM

# Sets `code` to process $1's exit status. A trapped signal ends `wait` early (status
# 128+N) while the process runs on (it is shutting down): then wait again, so that the
# status is the process's own and this script never ends before its processes.
wait_for() {
  local before
  while :; do
    before=$signals
    code=0
    wait "$1" || code=$?
    [[ "$signals" -ne "$before" && "$code" -gt 128 ]] || return 0
  done
}

for ((i = 0; i < num; i++)); do
  env_vars=(
    "JAX_COORDINATOR_ADDRESS=127.0.0.1:${port}"
    "JAX_NUM_PROCESSES=${num}"
    "JAX_PROCESS_ID=${i}"
  )
  if [[ "$gpus" -gt 0 ]]; then
    env_vars+=("CUDA_VISIBLE_DEVICES=$(seq -s, $((i * per)) $((i * per + per - 1)))")
  else
    env_vars+=("JAX_PLATFORMS=cpu" "XLA_FLAGS=--xla_force_host_platform_device_count=${per}")
  fi
  env "${env_vars[@]}" "$@" >"${log_dir}/process_${i}.log" 2>&1 &
  pids+=("$!")
done

# Every process exits by itself when another one dies (jaxserve.distributed), so waiting
# for all of them ends; name the ones that failed. Process 0 is waited for first.
status=0
tail -n +1 -f "${log_dir}/process_0.log" --pid="${pids[0]}" &
for i in "${!pids[@]}"; do
  if [[ "$i" -eq 1 && "$signals" -gt 0 ]]; then
    # Stopping, and process 0 is gone: the followers it stopped end within moments;
    # those still running after FOLLOWER_GRACE_S get SIGTERM.
    for ((t = 0; t < ${FOLLOWER_GRACE_S:-5} * 10; t++)); do
      alive=0
      for pid in "${pids[@]:1}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
      [[ "$alive" -eq 1 ]] || break
      sleep 0.1
    done
    for pid in "${pids[@]:1}"; do kill -TERM "$pid" 2>/dev/null || true; done
  fi
  wait_for "${pids[$i]}"
  if [[ "$code" -ne 0 ]]; then
    echo "$0: process ${i} exited with code ${code} (log: ${log_dir}/process_${i}.log)" >&2
    [[ "$status" -ne 0 ]] || status=$code
  fi
done
exit "$status"

#!/usr/bin/env bash
# A frontend on host A and headless engine replicas on host B (jaxserve engine), joined
# over TCP (jaxserve/router/remote.py, jaxserve/router/headless.py).
#
# On two hosts (A reachable from B at A_ADDR, a private network: the replica port has no
# authentication):
#   host A:  scripts/serve_two_hosts.sh frontend A_ADDR:PORT --allow-remote [serve flags...]
#   host B:  scripts/serve_two_hosts.sh engines  A_ADDR:PORT [-n N] [engine flags...]
# On one machine, local processes standing in for both hosts (loopback, no --allow-remote):
#   scripts/serve_two_hosts.sh local [-n N] [flags for both...]
#
# "frontend" runs `jaxserve serve --replica-listen A_ADDR:PORT` and its own --replicas
# (default 1) local replicas; an A_ADDR other than loopback needs --allow-remote.
# "engines" runs N (default 1) `jaxserve engine --frontend A_ADDR:PORT`, each on its own
# devices: GPUs [i*D, (i+1)*D) through CUDA_VISIBLE_DEVICES with -d D (default: all
# GPUs for N = 1), or on the CPU their own emulated devices. Give both the same model
# and engine flags (model, --dtype, --block-size, --max-model-len): a replica whose
# model identity differs is refused, with a line naming the field.
# Logs: LOG_DIR (default ./two_hosts_logs)/{frontend,engine_<i>}.log. Ctrl-C stops all.
set -euo pipefail

usage() {
  echo "usage: $0 frontend HOST:PORT [serve flags] | engines HOST:PORT [-n N] [-d D] [engine flags] | local [-n N] [flags]" >&2
  exit 2
}
[[ $# -ge 1 ]] || usage
role="$1"; shift
jaxserve="${JAXSERVE:-$(dirname "$0")/../.venv/bin/jaxserve}"
log_dir="${LOG_DIR:-two_hosts_logs}"
mkdir -p "$log_dir"
pids=()
cleanup() { for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done; wait; }
trap cleanup INT TERM EXIT

run_frontend() {  # ADDR [flags]
  local addr="$1"; shift
  "$jaxserve" serve --replica-listen "$addr" "$@" 2>&1 | tee "$log_dir/frontend.log" &
  pids+=($!)
}

run_engines() {  # ADDR N D [flags]
  local addr="$1" n="$2" d="$3"; shift 3
  for ((i = 0; i < n; i++)); do
    local env_vars=()
    [[ -n "$d" ]] && env_vars+=("CUDA_VISIBLE_DEVICES=$(seq -s, $((i * d)) $((i * d + d - 1)))")
    env "${env_vars[@]}" "$jaxserve" engine --frontend "$addr" "$@" >"$log_dir/engine_$i.log" 2>&1 &
    pids+=($!)
    echo "engine $i: pid $!, log $log_dir/engine_$i.log"
  done
}

parse_nd() {  # sets n, d, rest
  n=1; d=""; rest=()
  while [[ $# -gt 0 ]]; do
    case "$1" in
      -n) n="$2"; shift 2 ;;
      -d) d="$2"; shift 2 ;;
      *) rest+=("$1"); shift ;;
    esac
  done
}

case "$role" in
  frontend)
    [[ $# -ge 1 ]] || usage
    run_frontend "$@" ;;
  engines)
    [[ $# -ge 1 ]] || usage
    addr="$1"; shift
    parse_nd "$@"
    run_engines "$addr" "$n" "$d" "${rest[@]}" ;;
  local)
    parse_nd "$@"
    port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    run_frontend "127.0.0.1:$port" "${rest[@]}"
    run_engines "127.0.0.1:$port" "$n" "$d" "${rest[@]}" ;;
  *) usage ;;
esac
wait -n "${pids[@]}"  # the first to end (an error, or Ctrl-C) stops the others

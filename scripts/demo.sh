#!/usr/bin/env bash
# Set up jaxserve on a fresh machine, serve the bundled demo MoE model, and stream a completion.
#   bash scripts/demo.sh ["prompt"]
set -euo pipefail
cd "$(dirname "$0")/.."
port="${JAXSERVE_PORT:-50051}"
# A setting, checked before the venv is set up: "abc" is not a port, not a busy one.
if ! [[ "$port" =~ ^[0-9]{1,5}$ ]] || (( 10#$port < 1 || 10#$port > 65535 )); then
  echo "error: JAXSERVE_PORT=$port is not a port number (give one in 1-65535)" >&2
  exit 2
fi
port=$((10#$port))
bash scripts/setup_venv.sh
venv="${JAXSERVE_VENV:-.venv}"
prompt="${1:-def open(}"

# Refuse a busy port up front, so the completion below can only come from our server.
if ! "$venv/bin/python" -c "import socket,sys; s=socket.socket(); s.bind(('127.0.0.1', int(sys.argv[1])))" "$port" 2>/dev/null; then
  echo "error: port $port is in use; choose another with JAXSERVE_PORT=..." >&2
  exit 1
fi

"$venv/bin/jaxserve" serve --port "$port" &
server=$!
trap 'kill -TERM $server 2>/dev/null || true; wait $server 2>/dev/null || true' EXIT

# Wait for the gRPC health service to report SERVING (start-up compiles the step functions).
# Gives up as soon as our server process exits (e.g. the port is taken).
"$venv/bin/python" - "$port" "$server" <<'PY'
import os, sys, time, grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
stub = health_pb2_grpc.HealthStub(grpc.insecure_channel(f"127.0.0.1:{sys.argv[1]}"))
deadline = time.time() + 600
while time.time() < deadline:
    if not os.path.exists(f"/proc/{sys.argv[2]}") or " Z " in open(f"/proc/{sys.argv[2]}/stat").read():
        sys.exit("jaxserve serve exited before it was ready (see its log above)")
    try:
        if stub.Check(health_pb2.HealthCheckRequest(), timeout=2).status == health_pb2.HealthCheckResponse.SERVING:
            sys.exit(0)
    except grpc.RpcError:
        pass
    time.sleep(0.5)
sys.exit("server did not become ready within 600 s")
PY

# The prompt, then its completion on the same line, apart from the server's log above.
printf '\n>>> %s' "$prompt"
"$venv/bin/jaxserve" generate --server "127.0.0.1:$port" --max-tokens 48 --temperature 0 "$prompt"

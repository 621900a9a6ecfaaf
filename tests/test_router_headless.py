"""A headless engine replica over TCP (`jaxserve engine --frontend HOST:PORT`) beside a
local one (`jaxserve serve --replicas 1 --replica-listen 127.0.0.1:PORT`), on the demo
model (CPU), round-robin routing: each prompt is served by both replicas with the same
greedy text; the remote replica shows in GetServerInfo and the per-replica metrics; a
peer with another model or protocol version is refused with a line naming the field; a
listen address beyond loopback is refused without --allow-remote; a killed remote
engine is out of rotation at once, its stream ends UNAVAILABLE naming it.

One frontend and one headless replica serve the module (engine start-up is the
expensive part); the kill test runs last.
"""

from __future__ import annotations

import datetime
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import grpc
import pytest
import zmq
from router_helpers import replica_infos, wait_replicas
from server_harness import DEMO_ENGINE, REPO_DIR, ServerProcess, child_pids, free_port, serve_flags

from jaxserve.config import DEMO_MODEL_DIR
from jaxserve.frontend.client import JaxserveClient
from jaxserve.frontend.proto import jaxserve_pb2 as pb
from jaxserve.ipc import PROTOCOL_VERSION, ReplicaHello, ReplicaRefused, decode, encode

pytestmark = pytest.mark.slow

ENGINE_FLAGS = serve_flags(DEMO_ENGINE)  # the session's compiled executables
LISTEN_PORT = free_port()
METRICS_PORT = free_port()
START_TIMEOUT_S = 900
PROMPTS = ["def fibonacci(n):", "import os\nimport "]
MAX_TOKENS = 12


def _jaxserve(*args: str) -> list[str]:
    return [sys.executable, "-m", "jaxserve.cli", *args]


def _headless(*extra: str, drain: bool = False) -> subprocess.Popen:
    """`jaxserve engine` joining the module's frontend. drain: its stderr is read into
    `proc.lines` by a thread (a long-lived one: its engine logs must never fill the pipe)."""
    cmd = _jaxserve(
        "engine", "--model", str(DEMO_MODEL_DIR), "--frontend", f"127.0.0.1:{LISTEN_PORT}",
        *ENGINE_FLAGS, *extra,
    )  # fmt: skip
    proc = subprocess.Popen(
        cmd, cwd=REPO_DIR, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    if drain:
        proc.lines = []
        threading.Thread(target=lambda: proc.lines.extend(proc.stderr), daemon=True).start()
    return proc


@pytest.fixture(scope="module")
def server():
    flags = (
        "--replicas", "1", "--router-policy", "round-robin",
        "--replica-listen", f"127.0.0.1:{LISTEN_PORT}", "--metrics-port", str(METRICS_PORT),
        *ENGINE_FLAGS,
    )  # fmt: skip
    srv = ServerProcess(DEMO_MODEL_DIR, extra_args=flags, start_timeout_s=START_TIMEOUT_S)
    remote = _headless(drain=True)
    try:
        yield srv.wait_ready(), remote
    finally:
        for proc in (remote, srv.proc):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        remote.wait(30)
        srv.kill() if srv.proc.poll() is None else None


@pytest.fixture(scope="module")
def client(server):
    with JaxserveClient(server[0].target) as c:
        wait_replicas(
            c, lambda rs: len(rs) == 2 and all(r.state == "serving" for r in rs),
            timeout=START_TIMEOUT_S,
        )  # fmt: skip
        yield c


def _decisions(client) -> list[int]:
    return [r.router_decisions for r in replica_infos(client)]


def _served_by(client, prompt: str) -> tuple[str, int]:
    """Complete `prompt` greedily; returns (text, the replica that served it)."""
    before = _decisions(client)
    out = client.complete(prompt, max_tokens=MAX_TOKENS, temperature=0, timeout=300)
    after = _decisions(client)
    changed = [k for k, (a, b) in enumerate(zip(before, after, strict=True)) if a != b]
    assert len(changed) == 1, (before, after)
    return out[0].text, changed[0]


def test_remote_replica_serves_the_same_greedy_text(server, client):
    infos = replica_infos(client)
    assert infos[1].address.startswith("remote "), infos[1]
    assert infos[0].address.startswith("ipc://"), infos[0]
    # The server's KV numbers are the replicas' sum; each replica's is logged at its ready.
    info = client._stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10)
    assert all(r.kv_blocks_total > 0 for r in infos)
    assert info.kv_blocks_total == sum(r.kv_blocks_total for r in infos)
    srv, _ = server
    for k in (0, 1):
        assert any(
            f"replica {k} ready" in x and f": {infos[k].kv_blocks_total} usable KV blocks" in x
            for x in srv.lines
        ), srv.log()
    for prompt in PROMPTS:
        # Round-robin: two requests in a row go to the two replicas.
        (text_a, rep_a), (text_b, rep_b) = _served_by(client, prompt), _served_by(client, prompt)
        assert {rep_a, rep_b} == {0, 1}
        assert text_a, prompt
        assert text_a == text_b, (prompt, rep_a, text_a, rep_b, text_b)
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{METRICS_PORT}/metrics").read().decode()
    up = re.search(r'jaxserve_replica_up\{[^}]*replica="1"[^}]*\} (\S+)', metrics)
    assert up is not None and float(up.group(1)) == 1.0


def test_other_model_is_refused_naming_the_field(server, client):
    srv, _ = server
    peer = _headless("--block-size", "32")
    _, err = peer.communicate(timeout=120)
    assert peer.returncode == 2, err
    line = "block_size: the frontend serves 16, the replica 32"
    assert f"refused this replica: {line}" in err, err
    assert any("refused the remote replica" in x and line in x for x in srv.lines), srv.log()
    assert len(replica_infos(client)) == 2  # nothing joined


def test_other_protocol_version_is_refused(server, client):
    srv, _ = server
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(f"tcp://127.0.0.1:{LISTEN_PORT}")
        sock.send(encode(ReplicaHello(PROTOCOL_VERSION + 1, {}, "a future replica")))
        assert sock.poll(30_000), "no answer to the handshake"
        answer = decode(sock.recv())
    finally:
        sock.close()
        ctx.term()
    assert isinstance(answer, ReplicaRefused)
    line = f"protocol_version: the frontend speaks {PROTOCOL_VERSION}, the replica "
    assert answer.reason == line + str(PROTOCOL_VERSION + 1)
    # The server logs the refusal before it answers, but the harness reads that line
    # from the server's stderr in a thread of its own, which may not have yet.
    deadline = time.monotonic() + 10
    while not any("a future replica" in x and line in x for x in srv.lines):
        assert time.monotonic() < deadline, srv.log()
        time.sleep(0.05)


def test_listen_beyond_loopback_needs_allow_remote():
    cmd = _jaxserve("serve", "--replica-listen", f"0.0.0.0:{free_port()}", "--port", "0")
    done = subprocess.run(cmd, cwd=REPO_DIR, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "replica-listen: 0.0.0.0 is not a loopback address" in done.stderr
    assert "--allow-remote" in done.stderr
    assert "Traceback" not in done.stderr


def test_killed_remote_engine_leaves_rotation(server, client):
    """Last: the remote replica stays dead."""
    srv, remote = server
    engine = next(
        pid for pid in child_pids(remote.pid)
        if "jaxserve.engine.process" in open(f"/proc/{pid}/cmdline").read()
    )  # fmt: skip
    # A long stream on the remote replica (round-robin: the next request of two).
    results: dict = {}

    def stream(key):
        try:
            results[key] = client.complete(
                "class ", max_tokens=400, ignore_eos=True, temperature=0, timeout=300
            )
        except grpc.RpcError as e:
            results[key] = e

    threads = [threading.Thread(target=stream, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    wait_replicas(client, lambda rs: all(r.num_running == 1 for r in rs), timeout=120)
    killed, killed_at = time.monotonic(), time.time()
    os.kill(engine, signal.SIGKILL)
    took = wait_replicas(client, lambda rs: rs[1].state == "dead", timeout=10)
    assert took < 5.0, took  # as seen through GetServerInfo polls on a loaded machine
    # The frontend's own time to take it out: its log line's stamp (this machine's clock).
    left = next(x for x in srv.lines if re.search(r"replica 1 \(remote .*\) left: ", x))
    stamp = datetime.datetime.strptime(left[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
    # Within a second on an idle machine (asserted on mock engines, which leave the CPU
    # to the frontend: test_router_headless_faults); here two demo engines decode.
    assert stamp - killed_at < 5.0, left
    for t in threads:
        t.join(300)
    dead = [r for r in results.values() if isinstance(r, grpc.RpcError)]
    assert len(dead) == 1, results
    assert dead[0].code() == grpc.StatusCode.UNAVAILABLE
    assert "remote replica" in dead[0].details() and "replica 1" in dead[0].details()
    assert replica_infos(client)[1].reason.startswith("replica 1: the remote replica")
    assert remote.wait(30) == 1  # the headless process names the dead engine and exits
    assert time.monotonic() - killed < 30
    text, rep = _served_by(client, PROMPTS[0])  # new requests go to the live replica
    assert rep == 0 and text

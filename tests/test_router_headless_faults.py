"""Faults of headless replicas over TCP, on mock engines (seconds each): a stopped
(SIGSTOP) remote engine is stalled after the stall timeout and serves again after
SIGCONT; a killed remote engine is out of rotation within a second, its stream ending
UNAVAILABLE naming it; a remote engine that fails to start is out with its cause, named
on both sides; a stopped `jaxserve engine` (SIGTERM) leaves, and the next one to join takes its
slot with empty entries; a frontend that goes away ends its headless replicas; a
frontend without local replicas serves the ones that join and runs on when they die.

One frontend (one local replica) serves the module; the fifth test stops it; the last
runs a frontend of its own without local replicas (--replicas 0).
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
from mock_engine import write_mock_model_dir
from router_helpers import replica_infos, wait_replicas
from server_harness import REPO_DIR, TESTS_DIR, ServerProcess, child_pids, free_port

from jaxserve.frontend.client import JaxserveClient

pytestmark = pytest.mark.slow  # ~20 s: five scenarios, each with its processes

STALL_TIMEOUT_S = 1.0
LISTEN_PORT = free_port()
ENV = {"JAXSERVE_MOCK_STEP_DELAY_S": "0.01"}
MOCK = ("--engine-class", "mock_engine:MockEngineCore")


@pytest.fixture(scope="module")
def mock_model_dir(tmp_path_factory):
    return write_mock_model_dir(tmp_path_factory.mktemp("mock_model"))


@pytest.fixture(scope="module")
def server(mock_model_dir):
    flags = (
        *MOCK, "--replicas", "1", "--router-policy", "round-robin",
        "--replica-listen", f"127.0.0.1:{LISTEN_PORT}", "--stall-timeout-s", str(STALL_TIMEOUT_S),
    )  # fmt: skip
    srv = ServerProcess(mock_model_dir, extra_args=flags, env=ENV).wait_ready()
    yield srv
    srv.kill() if srv.proc.poll() is None else None


@pytest.fixture(scope="module")
def client(server):
    with JaxserveClient(server.target) as c:
        yield c


class Headless:
    """`jaxserve engine` joining the module's frontend, its stderr read into `lines`."""

    def __init__(self, model_dir: Path, *extra: str, port: int = LISTEN_PORT) -> None:
        cmd = [
            sys.executable, "-m", "jaxserve.cli", "engine", "--model", str(model_dir),
            "--frontend", f"127.0.0.1:{port}", *extra,
        ]  # fmt: skip
        env = {**os.environ, **ENV, "PYTHONPATH": str(TESTS_DIR)}
        self.proc = subprocess.Popen(
            cmd, cwd=REPO_DIR, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        self.lines: list[str] = []
        threading.Thread(target=lambda: self.lines.extend(self.proc.stderr), daemon=True).start()

    def engine_pid(self) -> int:
        for pid in child_pids(self.proc.pid):
            if "jaxserve.engine.process" in Path(f"/proc/{pid}/cmdline").read_text():
                return pid
        raise AssertionError("no engine process")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)


@pytest.fixture()
def remote(server, mock_model_dir, client):
    h = Headless(mock_model_dir, *MOCK)
    wait_replicas(client, lambda rs: len(rs) == 2 and rs[1].state == "serving", timeout=60)
    yield h
    h.stop()
    if server.proc.poll() is None:
        wait_replicas(client, lambda rs: rs[1].state == "dead", timeout=10)


def _decisions(client) -> list[int]:
    return [r.router_decisions for r in replica_infos(client)]


def test_a_stopped_remote_replica_stalls_and_comes_back(client, remote):
    pid = remote.engine_pid()
    os.kill(pid, signal.SIGSTOP)
    try:
        took = wait_replicas(client, lambda rs: rs[1].state == "stalled", timeout=10)
        assert took < STALL_TIMEOUT_S + 2.0
        assert "replica 1" in replica_infos(client)[1].reason
        before = _decisions(client)[1]
        for i in range(4):  # new requests go to the local replica
            assert client.complete(f"while stopped {i}", max_tokens=4, timeout=30)
        assert _decisions(client)[1] == before
    finally:
        os.kill(pid, signal.SIGCONT)
    wait_replicas(client, lambda rs: rs[1].state == "serving", timeout=10)
    for i in range(2):  # round-robin: one of the two goes to the remote replica again
        assert client.complete(f"after {i}", max_tokens=4, timeout=30)
    assert _decisions(client)[1] == before + 1


def test_sigterm_leaves_and_the_next_replica_takes_the_slot(mock_model_dir, client, remote):
    remote.proc.send_signal(signal.SIGTERM)
    assert remote.proc.wait(30) == 0
    wait_replicas(client, lambda rs: rs[1].state == "dead", timeout=10)
    assert replica_infos(client)[1].reason.endswith(": stopped (SIGTERM)")
    again = Headless(mock_model_dir, *MOCK)
    try:
        wait_replicas(client, lambda rs: rs[1].state == "serving", timeout=60)
        infos = replica_infos(client)
        assert len(infos) == 2  # the dead remote slot was reused
        assert infos[1].address == f"remote {socket.gethostname()} pid {again.proc.pid}"
        assert infos[1].router_decisions == 0 and infos[1].router_index_blocks == 0
    finally:
        again.stop()
    wait_replicas(client, lambda rs: rs[1].state == "dead", timeout=10)


def test_a_remote_engine_that_fails_to_start_is_out_with_its_cause(server, mock_model_dir, client):
    bad = Headless(mock_model_dir, "--engine-class", "mock_engine:NoSuchEngine")
    assert bad.proc.wait(60) == 1
    err = "".join(bad.lines)
    assert "NoSuchEngine" in err and "this replica leaves the frontend" in err, err
    wait_replicas(client, lambda rs: "NoSuchEngine" in rs[1].reason, timeout=10)
    info = replica_infos(client)[1]
    assert info.state == "dead" and info.reason.startswith("replica 1: the remote replica ")
    assert client.complete("still served", max_tokens=4, timeout=30)


def test_a_killed_remote_engine_is_out_within_a_second(client, remote):
    results: dict = {}

    def stream(key):
        try:
            results[key] = client.complete(f"long {key}", max_tokens=400, ignore_eos=True)
        except grpc.RpcError as e:
            results[key] = e

    threads = [threading.Thread(target=stream, args=(k,)) for k in range(2)]
    for t in threads:  # round-robin: one on each replica
        t.start()
    wait_replicas(client, lambda rs: [r.router_requests for r in rs] == [1, 1], timeout=10)
    os.kill(remote.engine_pid(), signal.SIGKILL)
    took = wait_replicas(client, lambda rs: rs[1].state == "dead", timeout=5, poll_s=0.01)
    assert took < 1.0, took
    for t in threads:
        t.join(60)
    failed = [r for r in results.values() if isinstance(r, grpc.RpcError)]
    assert len(failed) == 1, results
    assert failed[0].code() == grpc.StatusCode.UNAVAILABLE
    assert "replica 1: the remote replica" in failed[0].details()
    assert "died (signal SIGKILL)" in failed[0].details()
    finished = [r for r in results.values() if not isinstance(r, grpc.RpcError)]
    assert [r[0].completion_tokens for r in finished] == [400]  # the local one's went on
    assert remote.proc.wait(30) == 1


def test_a_frontend_that_goes_away_ends_its_headless_replicas(server, client, remote):
    """Last: stops the module's frontend."""
    server.proc.send_signal(signal.SIGTERM)
    assert remote.proc.wait(30) == 1
    assert any("the frontend at 127.0.0.1" in x and "went away" in x for x in remote.lines)
    assert server.proc.wait(30) == 0


def test_a_frontend_without_local_replicas_serves_the_ones_that_join(mock_model_dir):
    """--replicas 0: health follows the remote replicas; serve runs on when they die."""
    port = free_port()
    cmd = [
        sys.executable, "-m", "jaxserve.cli", "serve", "--model", str(mock_model_dir),
        "--host", "127.0.0.1", "--port", "0", *MOCK, "--replicas", "0",
        "--replica-listen", f"127.0.0.1:{port}",
    ]  # fmt: skip
    # The listening line as it comes: this frontend is never ready (no replica yet).
    env = {**os.environ, **ENV, "PYTHONPATH": str(TESTS_DIR), "JAXSERVE_START_LOG_HOLD_S": "0"}
    frontend = subprocess.Popen(
        cmd, cwd=REPO_DIR, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(frontend.stderr), daemon=True).start()
    try:
        deadline = time.monotonic() + 60
        while not (m := re.search(r"gRPC listening on (127\.0\.0\.1:\d+)", "".join(lines))):
            assert time.monotonic() < deadline and frontend.poll() is None, "".join(lines)
            time.sleep(0.05)
        with JaxserveClient(m.group(1)) as client:
            with pytest.raises(grpc.RpcError) as e:
                client.complete("nobody yet", max_tokens=4, timeout=10)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
            for attempt in range(2):  # a replica joins, dies; the next one joins the slot
                h = Headless(mock_model_dir, *MOCK, port=port)
                try:
                    wait_replicas(client, lambda rs: rs and rs[0].state == "serving", timeout=60)
                    assert client.complete(f"served {attempt}", max_tokens=4, timeout=30)
                    os.kill(h.engine_pid(), signal.SIGKILL)
                    assert h.proc.wait(30) == 1
                finally:
                    h.stop()
                with pytest.raises(grpc.RpcError) as e:
                    for _ in range(100):  # until the frontend has taken it out
                        client.complete("after", max_tokens=4, timeout=10)
                        time.sleep(0.05)
                assert e.value.code() == grpc.StatusCode.UNAVAILABLE
                assert "replica 0" in e.value.details()
                assert frontend.poll() is None  # serve runs on, waiting for replicas
    finally:
        frontend.kill()
        frontend.wait(30)

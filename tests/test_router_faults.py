"""Faults with several replicas (mock engines, so each scenario takes seconds): a killed
replica leaves rotation within a second and its streams end UNAVAILABLE naming it while
the others' streams finish; a stopped (SIGSTOP) replica is treated the same after the
stall timeout and serves again after SIGCONT.

One server serves the module; the kill test runs last (a killed replica stays dead).
"""

from __future__ import annotations

import os
import re
import signal
import socket
import threading
import urllib.request

import grpc
import pytest
from mock_engine import write_mock_model_dir
from router_helpers import replica_infos, replica_pid, wait_replicas
from server_harness import ServerProcess

from jaxserve.frontend.client import JaxserveClient

STEP_DELAY_S = 0.02
STALL_TIMEOUT_S = 1.0
LONG_TOKENS = 200  # ~4 s of steps: long enough to be running when a replica goes


@pytest.fixture(scope="module")
def mock_model_dir(tmp_path_factory):
    return write_mock_model_dir(tmp_path_factory.mktemp("mock_model"))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


METRICS_PORT = _free_port()


@pytest.fixture(scope="module")
def server(mock_model_dir):
    flags = (
        "--metrics-port", str(METRICS_PORT),
        "--engine-class", "mock_engine:MockEngineCore", "--replicas", "3",
        "--stall-timeout-s", str(STALL_TIMEOUT_S), "--router-policy", "kv",
    )  # fmt: skip
    env = {"JAXSERVE_MOCK_STEP_DELAY_S": str(STEP_DELAY_S)}
    srv = ServerProcess(mock_model_dir, extra_args=flags, env=env).wait_ready()
    yield srv
    srv.kill() if srv.proc.poll() is None else None


@pytest.fixture(scope="module")
def client(server):
    with JaxserveClient(server.target) as c:
        wait_replicas(c, lambda rs: all(r.state == "serving" for r in rs), timeout=60)
        yield c


def _stream(client, prompt: str, results: dict, key) -> None:
    try:
        done = client.complete(prompt, max_tokens=LONG_TOKENS, ignore_eos=True, timeout=60)
        results[key] = done[0]
    except grpc.RpcError as e:
        results[key] = e


def _start_one_per_replica(client, live: list[int], tag: str) -> tuple[dict, list]:
    """One long stream on each live replica (cache misses spread by load: one each)."""
    results: dict = {}
    threads = []
    for i in range(len(live)):
        t = threading.Thread(target=_stream, args=(client, f"{tag} prompt {i}", results, i))
        t.start()
        threads.append(t)
    wait_replicas(
        client, lambda rs: [r.router_requests for r in rs if r.replica in live] == [1] * len(live),
        timeout=10, poll_s=0.01,
    )  # fmt: skip
    return results, threads


def test_a_stopped_replica_is_out_of_rotation_after_the_stall_timeout(server, client):
    results, threads = _start_one_per_replica(client, [0, 1, 2], "stall")
    pid = replica_pid(server, 2, "jaxserve.engine.process")
    os.kill(pid, signal.SIGSTOP)
    try:
        took = wait_replicas(client, lambda rs: rs[2].state == "stalled", timeout=10)
        assert took < STALL_TIMEOUT_S + 1.0
        for t in threads:
            t.join(30)
        failed = [r for r in results.values() if isinstance(r, grpc.RpcError)]
        assert len(failed) == 1, results
        assert failed[0].code() == grpc.StatusCode.UNAVAILABLE
        assert "replica 2" in failed[0].details()
        finished = [r for r in results.values() if not isinstance(r, grpc.RpcError)]
        assert [r.completion_tokens for r in finished] == [LONG_TOKENS] * 2
        before = replica_infos(client)[2].router_decisions
        for i in range(6):  # new requests go to the others
            assert client.complete(f"while stopped {i}", max_tokens=4, timeout=30)
        assert replica_infos(client)[2].router_decisions == before
    finally:
        os.kill(pid, signal.SIGCONT)
    wait_replicas(client, lambda rs: rs[2].state == "serving", timeout=10)


def test_a_killed_replica_ends_its_streams_naming_it_and_others_go_on(server, client):
    results, threads = _start_one_per_replica(client, [0, 1, 2], "kill")
    os.kill(replica_pid(server, 1, "jaxserve.engine.process"), signal.SIGKILL)
    took = wait_replicas(client, lambda rs: rs[1].state == "dead", timeout=5, poll_s=0.01)
    assert took < 1.0
    for t in threads:
        t.join(30)
    failed = [r for r in results.values() if isinstance(r, grpc.RpcError)]
    assert len(failed) == 1, results
    assert failed[0].code() == grpc.StatusCode.UNAVAILABLE
    assert "replica 1" in failed[0].details() and "SIGKILL" in failed[0].details()
    finished = [r for r in results.values() if not isinstance(r, grpc.RpcError)]
    assert [r.completion_tokens for r in finished] == [LONG_TOKENS] * 2
    dead_decisions = replica_infos(client)[1].router_decisions
    for i in range(8):
        assert client.complete(f"after the kill {i}", max_tokens=4, timeout=30)
    infos = replica_infos(client)
    assert infos[1].router_decisions == dead_decisions and "SIGKILL" in infos[1].reason
    assert infos[0].router_decisions > 0 and infos[2].router_decisions > 0
    assert server.proc.poll() is None  # serve keeps running while a replica lives
    assert client.is_serving()
    # One death, one ERROR line naming it (the frontend's stream ending logged a second;
    # the stall test before this one logged its own, about replica 2).
    log = server.log().splitlines()
    errors = [line for line in log if " ERROR " in line and "replica 2" not in line]
    assert len(errors) == 1 and "replica 1" in errors[0] and "SIGKILL" in errors[0], errors


def _metric(text: str, name: str, replica: int) -> float:
    m = re.search(rf'^{name}{{[^}}]*replica="{replica}"[^}}]*}} (\S+)$', text, re.M)
    assert m, f"{name} replica {replica} not exported"
    return float(m.group(1))


def test_metrics_show_each_replica_and_every_decision(server, client):
    """After the kill above: replica 1 is down in the metrics, the others up, and the
    decision counters add up to the requests routed (GetServerInfo's counts)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{METRICS_PORT}/metrics", timeout=10) as r:
        text = r.read().decode()
    assert [_metric(text, "jaxserve_replica_up", k) for k in range(3)] == [1.0, 0.0, 1.0]
    infos = replica_infos(client)
    for k in range(3):
        decisions = _metric(text, "jaxserve_router_decisions_total", k)
        assert decisions == infos[k].router_decisions
    assert _metric(text, "jaxserve_replica_index_blocks", 1) == 0.0
    # The Python client's ServerInfo carries the replicas; a dead one holds nothing.
    replicas = client.server_info().replicas
    assert [r["state"] for r in replicas] == ["serving", "dead", "serving"]
    assert replicas[1]["num_running"] == 0 and replicas[1]["kv_blocks_total"] == 0

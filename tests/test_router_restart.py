"""--restart-dead-replicas (mock engines): a killed replica's processes start again and
it rejoins the rotation; the others serve throughout."""

from __future__ import annotations

import os
import signal
import threading

import pytest
from mock_engine import write_mock_model_dir
from router_helpers import replica_infos, replica_pid, wait_replicas
from server_harness import ServerProcess

from jaxserve.frontend.client import JaxserveClient


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = write_mock_model_dir(tmp_path_factory.mktemp("mock_model"))
    flags = (
        "--engine-class", "mock_engine:MockEngineCore", "--replicas", "2",
        "--restart-dead-replicas",
    )  # fmt: skip
    env = {"JAXSERVE_MOCK_STEP_DELAY_S": "0.02"}
    srv = ServerProcess(model, extra_args=flags, env=env).wait_ready()
    yield srv
    srv.kill() if srv.proc.poll() is None else None


def test_a_killed_replica_restarts_and_rejoins(server):
    with JaxserveClient(server.target) as client:
        wait_replicas(client, lambda rs: all(r.state == "serving" for r in rs), timeout=60)
        old = replica_pid(server, 0, "jaxserve.engine.process")
        os.kill(old, signal.SIGKILL)
        wait_replicas(client, lambda rs: rs[0].state == "dead", timeout=5, poll_s=0.01)
        for i in range(3):  # served by replica 1 meanwhile
            assert client.complete(f"meanwhile {i}", max_tokens=3, timeout=30)
        wait_replicas(client, lambda rs: rs[0].state == "serving", timeout=60)
        assert replica_pid(server, 0, "jaxserve.engine.process") != old
        before = [r.router_decisions for r in replica_infos(client)]
        # Four concurrent misses of one length spread by load: two on each replica.
        threads = [
            threading.Thread(
                target=client.complete, args=(f"after {i:02d}",),
                kwargs=dict(max_tokens=60, ignore_eos=True, timeout=30),
            )
            for i in range(4)
        ]  # fmt: skip
        for n, t in enumerate(threads, 1):
            t.start()  # one at a time, each booked before the next arrives
            wait_replicas(client, lambda rs, n=n: _routed(rs, before) == n, timeout=10)
        for t in threads:
            t.join(30)
        after = [r.router_decisions for r in replica_infos(client)]
        assert [a - b for a, b in zip(after, before, strict=True)] == [2, 2]
        assert server.proc.poll() is None


def _routed(infos, before: list[int]) -> int:
    return sum(r.router_decisions for r in infos) - sum(before)

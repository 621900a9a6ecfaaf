"""EPLB in a multi-process run: process 0 plans, every process applies each new placement
between the same two steps. Two processes x 4 emulated CPU devices (jax.distributed on
loopback) against the engine on one device; and a follower that gets a placement it
cannot apply stops with a clear error.

Oracles: the one-device engine's greedy tokens (a re-placement must not change them)
and the leader's own placement tables (every process must end with the same ones).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from server_harness import cpu_xla_flags, free_port_range

TESTS = Path(__file__).resolve().parent
WORKER = TESTS / "multihost_eplb_worker.py"


@pytest.fixture(scope="module")
def model_dir(mesh_model_dir):
    # The session's mesh model (tests/conftest.py): the one-device reference engine is
    # the session's `mesh_engine(1, 1)` (`multihost_engine_worker.engine_config`).
    return mesh_model_dir


@pytest.mark.slow
def test_two_process_eplb_applies_every_placement_everywhere(model_dir, mesh_engine, tmp_path):
    from engine_helpers import run_engine
    from multihost_engine_worker import requests

    port, out = free_port_range(), tmp_path / "eplb.json"
    env = dict(os.environ)
    env.update(
        JAX_PLATFORMS="cpu",
        XLA_FLAGS=cpu_xla_flags(4),
        JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
        JAX_NUM_PROCESSES="2",
        PYTHONPATH=os.pathsep.join([str(TESTS.parent), str(TESTS), env.get("PYTHONPATH", "")]),
    )
    cmd = [sys.executable, str(WORKER), str(model_dir), "2", "4", str(out)]
    procs = [
        subprocess.Popen(
            cmd,
            env={**env, "JAX_PROCESS_ID": str(i)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    try:
        logs = [p.communicate(timeout=900)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, log in zip(procs, logs, strict=True):
        assert p.returncode == 0, log[-4000:]
    leader, follower = (json.loads(Path(f"{out}.{i}").read_text()) for i in range(2))
    assert leader["rebalances"] >= 1
    assert follower["rebalances"] == leader["rebalances"]
    assert follower["physical_to_logical"] == leader["physical_to_logical"]
    # The placement did change (the redundant slots start as replicas of experts 0..7).
    p2l = np.asarray(leader["physical_to_logical"])
    start = np.arange(p2l.shape[1]) % 16
    assert (p2l != start).any()
    want = {rid: r.tokens for rid, r in run_engine(mesh_engine(1, 1), requests()).items()}
    assert leader["tokens"] == want


class _NoRunner:
    def run_buffers(self, shape, arrays):  # pragma: no cover -- no step is sent
        raise AssertionError("no step expected")


def test_a_placement_without_eplb_stops_the_follower_with_a_clear_error():
    from jaxserve.distributed.executor import follow
    from jaxserve.distributed.step_channel import StepPublisher, StepSubscriber
    from jaxserve.distributed.step_message import PLACEMENT

    port = free_port_range() + 1
    errors: list[BaseException] = []

    def run_follower() -> None:
        sub = StepSubscriber("127.0.0.1", port, 1, timeout_s=30)
        try:
            follow(_NoRunner(), sub, timeout_s=30)
        except RuntimeError as e:
            errors.append(e)
        finally:
            sub.close()

    thread = threading.Thread(target=run_follower)
    thread.start()
    leader = StepPublisher("127.0.0.1", port, 1, timeout_s=30)
    leader.publish([np.zeros((2, 8), np.int32)], meta={"steps": 0}, kind=PLACEMENT)
    thread.join(timeout=30)
    leader.close()
    assert errors and "no EPLB controller" in str(errors[0])
    assert "--enable-eplb" in str(errors[0])


def test_a_placement_at_another_step_stops_the_follower():
    from jaxserve.distributed.executor import follow
    from jaxserve.distributed.step_channel import StepPublisher, StepSubscriber
    from jaxserve.distributed.step_message import PLACEMENT

    port = free_port_range() + 1
    errors: list[BaseException] = []
    applied: list[np.ndarray] = []

    def run_follower() -> None:
        sub = StepSubscriber("127.0.0.1", port, 1, timeout_s=30)
        try:
            follow(_NoRunner(), sub, timeout_s=30, on_placement=applied.append)
        except RuntimeError as e:
            errors.append(e)
        finally:
            sub.close()

    thread = threading.Thread(target=run_follower)
    thread.start()
    leader = StepPublisher("127.0.0.1", port, 1, timeout_s=30)
    table = np.arange(16, dtype=np.int32).reshape(2, 8)
    leader.publish([table], meta={"steps": 0}, kind=PLACEMENT)  # applied
    leader.publish([table], meta={"steps": 5}, kind=PLACEMENT)  # 5 steps the follower lacks
    thread.join(timeout=30)
    leader.close()
    assert len(applied) == 1 and np.array_equal(applied[0], table)
    assert errors and "after 5 leader steps arrived after 0 steps here" in str(errors[0])

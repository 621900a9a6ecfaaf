"""The step channel of a multi-process run and its distributed settings, without JAX
processes: process 0 publishes each step to its followers (`distributed.step_channel`),
every step arrives in order, a dead peer is named at once, a clean stop reports no loss;
and the settings built from flags and environment (`distributed.from_arguments`).
The runs of several JAX processes are in test_multihost.py.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from server_harness import free_port_range

from jaxserve import distributed
from jaxserve.distributed import start_status
from jaxserve.distributed.step_channel import StepPublisher, StepSubscriber
from jaxserve.distributed.step_message import STOP

ROOT = Path(__file__).resolve().parent.parent


# ----- the step channel and the distributed settings (no JAX processes) -------------------


def test_step_channel_delivers_every_step_in_order():
    port = free_port_range()
    received = []

    def follow():
        sub = StepSubscriber("127.0.0.1", port, process_id=1, timeout_s=30)
        while (msg := sub.receive(timeout_s=30)).kind != STOP:
            received.append(msg)
        sub.close()

    thread = threading.Thread(target=follow)
    thread.start()
    pub = StepPublisher("127.0.0.1", port, num_followers=1, timeout_s=30)
    sent = []
    rng = np.random.default_rng(0)
    for i in range(50):
        arrays = [
            rng.integers(0, 100, size=(i + 1,), dtype=np.uint8),  # odd sizes: padding
            rng.integers(0, 100, size=(i + 1,), dtype=np.int32),
            rng.random((2, 3)),
            np.zeros((0, 3), np.float32),
            np.array(i, np.int64),
        ]
        sent.append(arrays)
        pub.publish(arrays, meta={"bucket": i})
    pub.close()
    thread.join(timeout=30)
    assert [m.step for m in received] == list(range(50))
    for msg, arrays in zip(received, sent, strict=True):
        assert msg.meta == {"bucket": msg.step}
        for got, want in zip(msg.arrays, arrays, strict=True):
            assert got.dtype == want.dtype and got.shape == want.shape
            assert got.ctypes.data % 16 == 0  # each array aligned, as if allocated alone
            np.testing.assert_array_equal(got, want)
    assert pub.stats.steps == 51  # 50 steps and the stop


def test_distributed_settings_from_flags_and_environment():
    resolve = distributed.resolve
    assert resolve(env={}) is None
    flags = resolve("10.0.0.1:1234", 4, 2, env={"JAX_PROCESS_ID": "3"})
    assert flags == distributed.DistributedConfig("10.0.0.1:1234", 4, 2)
    env = {"JAX_COORDINATOR_ADDRESS": "h:99", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "1"}
    cfg = resolve(env=env)
    assert (cfg.coordinator_host, cfg.coordinator_port, cfg.is_leader) == ("h", 99, False)
    slurm = {"SLURM_NTASKS": "8", "SLURM_PROCID": "5", "SLURM_STEP_NODELIST": "gpu[003-010]"}
    assert resolve(env=slurm) == distributed.DistributedConfig("gpu003:61234", 8, 5)
    k8s = {
        "JOB_COMPLETION_INDEX": "0",
        "JAX_NUM_PROCESSES": "3",
        "JAX_COORDINATOR_ADDRESS": "j-0.s:7",
    }
    assert resolve(env=k8s).is_leader
    with pytest.raises(ValueError, match="no coordinator address"):
        resolve(num_processes=2, process_id=0, env={})
    with pytest.raises(ValueError, match="process id 2 is not in"):
        resolve("h:1", 2, 2, env={})
    with pytest.raises(ValueError, match="JAX_NUM_PROCESSES='two' is not an integer"):
        resolve(env={"JAX_NUM_PROCESSES": "two"})
    # A port outside [1, 65532] (the run takes the coordinator's port and the 3 above it)
    # is named at once; JAX took it and aborted after its 5-minute join wait.
    for bad in ("localhost:0", "localhost:65536", "localhost:99999", "h:65533"):
        with pytest.raises(ValueError, match=r"port \d+ is not in \[1, 65532\] \(--coordinator"):
            resolve(bad, 2, 1, env={})
        with pytest.raises(ValueError, match="JAX_COORDINATOR_ADDRESS"):
            resolve(env={**env, "JAX_COORDINATOR_ADDRESS": bad})
    assert resolve("h:65532", 2, 1, env={}).coordinator_port == 65532
    assert distributed.settings.HIGHEST_PORT_OFFSET == start_status.START_STATUS_PORT_OFFSET
    assert distributed.first_slurm_host("node7,node8") == "node7"
    assert resolve(env=env).heartbeat_timeout_s == distributed.DEFAULT_HEARTBEAT_TIMEOUT_S
    assert resolve(env={**env, "JAXSERVE_HEARTBEAT_TIMEOUT_S": "7"}).heartbeat_timeout_s == 7
    flag_wins = resolve(env={**env, "JAXSERVE_HEARTBEAT_TIMEOUT_S": "7"}, heartbeat_timeout_s=9)
    assert flag_wins.heartbeat_timeout_s == 9
    with pytest.raises(ValueError, match="heartbeat timeout must be >= 1 s"):
        resolve(env={**env, "JAXSERVE_HEARTBEAT_TIMEOUT_S": "0"})


def test_distributed_config_round_trips_through_its_flags():
    """`to_arguments` (what serve passes to its engine process) parses back to the same
    place in the run, whatever the environment says."""
    config = distributed.DistributedConfig("10.1.2.3:4567", 3, 2, heartbeat_timeout_s=12)
    parser = argparse.ArgumentParser()
    distributed.add_arguments(parser)
    args = parser.parse_args(config.to_arguments())
    env = {"JAX_PROCESS_ID": "0", "JAXSERVE_HEARTBEAT_TIMEOUT_S": "99"}
    assert distributed.from_arguments(args, env) == config


# ----- a process that dies: the step channel's membership connections ---------------------

# A step-channel end in a child process, to be SIGKILLed. argv: port, role. The role
# "follower_exits" reacts to a lost leader as `jaxserve serve`'s followers do.
_CHANNEL_END = """
import logging, sys, time
from jaxserve.distributed import DistributedConfig
from jaxserve.distributed.processes import exit_on_lost_peer
from jaxserve.distributed import start_status
from jaxserve.distributed.step_channel import StepPublisher, StepSubscriber
logging.basicConfig(level="INFO")
port, role = int(sys.argv[1]), sys.argv[2]
if role == "leader":
    end = StepPublisher("127.0.0.1", port, num_followers=1, timeout_s=30)
elif role == "follower":
    end = StepSubscriber("127.0.0.1", port, process_id=1, timeout_s=30)
else:
    dist = DistributedConfig(f"127.0.0.1:{port - 1}", 2, 1)
    end = StepSubscriber("127.0.0.1", port, 1, 30, on_leader_lost=exit_on_lost_peer(dist))
print("joined", flush=True)
time.sleep(120)
"""


def _channel_end_process(port: int, role: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", _CHANNEL_END, str(port), role],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )


def _wait_event(event: threading.Event, timeout_s: float) -> float:
    """Seconds until `event` was set (fails after timeout_s)."""
    start = time.monotonic()
    assert event.wait(timeout_s), f"not reported within {timeout_s} s"
    return time.monotonic() - start


def test_step_channel_names_a_dead_follower_at_once():
    port = free_port_range()
    child = _channel_end_process(port, "follower")
    lost, reported = [], threading.Event()

    def on_lost(process_id: int) -> None:
        lost.append(process_id)
        reported.set()

    try:
        pub = StepPublisher("127.0.0.1", port, 1, timeout_s=30, on_follower_lost=on_lost)
        assert child.stdout.readline() == "joined\n"
        pub.publish([np.arange(3)])
        assert not reported.wait(0.2)  # a live, quiet follower is not lost
        child.send_signal(signal.SIGKILL)
        assert _wait_event(reported, 5.0) < 2.0
        assert lost == pub.lost_followers == [1]
        pub.close()  # still closes cleanly without that follower
    finally:
        child.kill()
        child.communicate()


def test_step_channel_names_a_dead_leader_at_once():
    port = free_port_range()
    child = _channel_end_process(port, "leader")
    lost, reported = [], threading.Event()

    def on_lost(process_id: int) -> None:
        lost.append(process_id)
        reported.set()

    try:
        sub = StepSubscriber("127.0.0.1", port, 1, timeout_s=30, on_leader_lost=on_lost)
        assert child.stdout.readline() == "joined\n"
        assert not reported.wait(0.2)
        child.send_signal(signal.SIGKILL)
        assert _wait_event(reported, 5.0) < 2.0
        assert lost == [0] and sub.leader_lost
        with pytest.raises(ConnectionError, match="the leader"):
            sub.receive(timeout_s=5)  # a step's read ends too, it does not wait for ever
        sub.close()
    finally:
        child.kill()
        child.communicate()


def test_a_follower_exits_with_code_3_naming_the_dead_leader():
    """The follower's reaction in `jaxserve serve` (`exit_on_lost_peer`): when the
    leader's process dies, it exits at once with EXIT_PEER_LOST and says why."""
    from jaxserve.distributed.processes import EXIT_PEER_LOST

    port = free_port_range()
    leader = _channel_end_process(port, "leader")
    follower = _channel_end_process(port, "follower_exits")
    try:
        assert leader.stdout.readline() == "joined\n"
        assert follower.stdout.readline() == "joined\n"
        leader.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        _, log = follower.communicate(timeout=10)
        assert time.monotonic() - killed < 2.0
        assert follower.returncode == EXIT_PEER_LOST, log
        assert "process 0 (the leader) of the 2-process run is gone" in log
        assert f"process 1 exits (code {EXIT_PEER_LOST})" in log
    finally:
        for p in (leader, follower):
            p.kill()
            p.communicate()


def test_step_channel_clean_stop_reports_no_loss():
    port = free_port_range()
    lost: list[int] = []
    subs = []

    def follow() -> None:
        sub = StepSubscriber("127.0.0.1", port, 1, timeout_s=30, on_leader_lost=lost.append)
        subs.append(sub)
        while sub.receive(timeout_s=30).kind != STOP:
            pass
        time.sleep(0.2)  # the leader has closed its end by now: still no loss
        sub.close()

    thread = threading.Thread(target=follow)
    thread.start()
    pub = StepPublisher("127.0.0.1", port, 1, timeout_s=30, on_follower_lost=lost.append)
    pub.publish([np.zeros(2)])
    pub.close()
    thread.join(30)
    assert lost == [] and pub.lost_followers == [] and not subs[0].leader_lost


def test_step_channel_rejects_a_duplicate_process_id():
    port = free_port_range()
    joined: list[StepSubscriber] = []

    def follower() -> None:
        # The leader refuses the second join; this end may or may not have joined first.
        with contextlib.suppress(Exception):
            joined.append(StepSubscriber("127.0.0.1", port, 1, timeout_s=10))

    threads = [threading.Thread(target=follower) for _ in range(2)]
    for t in threads:
        t.start()
    with pytest.raises(ValueError, match="joined as process 1, expected each of 1..2 once"):
        StepPublisher("127.0.0.1", port, num_followers=2, timeout_s=10)
    for t in threads:
        t.join(15)
    for sub in joined:
        sub.close()

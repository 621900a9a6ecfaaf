"""Several processes (jax.distributed on loopback) against one process with all devices.

2 processes x 4 emulated CPU devices run the sharded model, process 0 scheduling and
the other following it over the step channel; their greedy tokens must equal the same
mesh in this process (1 process x 8 devices) and the single-device model. Then the same
with `jaxserve serve` itself, and what a dead process does to the run: the step
channel names it at once and the survivors exit.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
from server_harness import (
    ServerProcess,
    alive,
    child_pids,
    cpu_xla_flags,
    ep_test_threshold,
    free_port_range,
)

from jaxserve import distributed
from jaxserve.config import DEMO_MODEL_DIR
from jaxserve.distributed import start_status
from jaxserve.distributed.step_channel import StepPublisher, StepSubscriber
from jaxserve.distributed.step_message import STOP

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
WORKER = TESTS / "multihost_worker.py"
ENGINE_WORKER = TESTS / "multihost_engine_worker.py"


@pytest.fixture(scope="module")
def model_dir(mesh_model_dir):
    # The session's mesh model (tests/conftest.py, as test_sharding's: heads divisible by
    # 8, 16 experts), so the in-process reference engines are the session's `mesh_engine`.
    return mesh_model_dir


def _run_processes(
    model_dir: Path, dp: int, tp: int, num_processes: int, out: Path, worker: Path = WORKER
) -> dict:
    port = free_port_range()
    env = dict(os.environ)
    env.update(
        JAX_PLATFORMS="cpu",
        XLA_FLAGS=cpu_xla_flags(8 // num_processes),
        JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
        JAX_NUM_PROCESSES=str(num_processes),
        PYTHONPATH=os.pathsep.join([str(ROOT), str(TESTS), env.get("PYTHONPATH", "")]),
    )
    procs = [
        subprocess.Popen(
            [sys.executable, str(worker), str(model_dir), str(dp), str(tp), str(out)],
            env={**env, "JAX_PROCESS_ID": str(i)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(num_processes)
    ]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=240)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, log in zip(procs, logs, strict=True):
        assert p.returncode == 0, log[-4000:]
    return json.loads(out.read_text())


def test_two_processes_match_one_process(model_dir, tmp_path):
    from multihost_worker import MAX_LEN, NUM_NEW, PROMPTS
    from sharding_utils import GreedyDriver

    from jaxserve.models.loader import load_model
    from jaxserve.sharding.load import load_sharded_model
    from jaxserve.sharding.mesh import build_mesh

    result = _run_processes(model_dir, 2, 4, num_processes=2, out=tmp_path / "out.json")

    mesh = build_mesh(2, 4)  # this process: 1 x 8 devices
    model, _ = load_sharded_model(model_dir, mesh)
    one_process, _ = GreedyDriver(model, mesh, len(PROMPTS), MAX_LEN).generate(PROMPTS, NUM_NEW)
    single, _ = load_model(model_dir)
    one_device, _ = GreedyDriver(single, None, len(PROMPTS), MAX_LEN).generate(PROMPTS, NUM_NEW)
    assert result["tokens"] == one_process == one_device
    assert result["channel_us"] > 0


def test_two_process_engine_matches_one_process(model_dir, mesh_engine, tmp_path):
    """The engine itself (scheduler, DP attention, async steps, multi-step decode) led by
    process 0 and followed by process 1 gives the tokens of the same mesh in one process
    and of one device (the session's engines, `multihost_engine_worker.engine_config`)."""
    from engine_helpers import run_engine
    from multihost_engine_worker import requests

    out = tmp_path / "engine.json"
    result = _run_processes(model_dir, 2, 4, 2, out, worker=ENGINE_WORKER)

    def tokens(dp, tp):
        return {rid: r.tokens for rid, r in run_engine(mesh_engine(dp, tp), requests()).items()}

    assert result["tokens"] == tokens(2, 4) == tokens(1, 1)
    assert result["counters"]["num_compilations"] == 0
    assert result["counters"]["coordination_time_s"] > 0


# ----- the step channel and the distributed settings (no JAX processes) -------------------


def test_step_channel_delivers_every_step_in_order():
    port = free_port_range()
    import threading

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


# ----- `jaxserve serve` over two processes ------------------------------------------------

# Small engine: few step buckets, so both processes compile in seconds. The demo model
# has 2 KV heads and 8 experts: dp=4,tp=2 spans the 2 x 4 devices.
SERVE_MESH = "dp=4,tp=2"
SERVE_ENGINE = {
    "max_num_seqs": 4,
    "max_num_batched_tokens": 16,
    "max_model_len": 64,
    "num_blocks": 32,
}
SERVE_PROMPTS = ["def ", "import ", "class ", "for i in range("]
SERVE_MAX_TOKENS = 12
RPC_TIMEOUT_S = 120
# A dead follower must end the serve run within this (measured: 0.2 s to the engine's
# exit, then the frontend's 2 s grace; without the membership watch it was 63 s).
DEAD_PROCESS_BOUND_S = 10.0


@pytest.fixture(scope="module")
def two_process_serve(tmp_path_factory):
    """`jaxserve serve` as process 0 (frontend, detokenizer, leading engine) and process 1
    (follower), each with 4 CPU devices; yields (server, follower, follower_log_path) and
    the offline results of SERVE_PROMPTS on one device, computed while they start."""
    from jaxserve import LLM, SamplingParams

    port = free_port_range()
    env = {
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": cpu_xla_flags(4),
        "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}",
        "JAX_NUM_PROCESSES": "2",
    }
    flags = ["--mesh", SERVE_MESH]
    threshold = ep_test_threshold(4, SERVE_ENGINE["max_num_batched_tokens"])
    flags += ["--ep-replicated-max-tokens", str(threshold)]
    for name, value in SERVE_ENGINE.items():
        flags += [f"--{name.replace('_', '-')}", str(value)]
    log_path = tmp_path_factory.mktemp("follower") / "process_1.log"
    follower = subprocess.Popen(
        [sys.executable, "-m", "jaxserve.cli", "serve", "--model", str(DEMO_MODEL_DIR), *flags],
        env={**os.environ, **env, "JAX_PROCESS_ID": "1"},
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=log_path.open("w"),
    )
    server = None
    try:
        server = ServerProcess(
            DEMO_MODEL_DIR,
            extra_args=tuple(flags),
            env={**env, "JAX_PROCESS_ID": "0"},
            start_timeout_s=300,
        )
        llm = LLM(model=DEMO_MODEL_DIR, **SERVE_ENGINE)
        greedy = SamplingParams(temperature=0.0, max_tokens=SERVE_MAX_TOKENS)
        offline = llm.generate(SERVE_PROMPTS, greedy)
        server.wait_ready()
        yield server, follower, log_path, offline
    finally:
        if server is not None:
            server.kill()
        follower.kill()
        follower.wait()


def test_two_process_serve_streams_equal_offline_generate(two_process_serve):
    from jaxserve.frontend.client import JaxserveClient

    server, follower, _, offline = two_process_serve
    results: dict[int, list] = {}

    def run(client: JaxserveClient, i: int) -> None:
        deltas = client.generate(
            SERVE_PROMPTS[i],
            max_tokens=SERVE_MAX_TOKENS,
            temperature=0.0,
            return_token_ids=True,
            timeout=RPC_TIMEOUT_S,
        )
        results[i] = list(deltas)

    with JaxserveClient(server.target) as client:
        threads = [threading.Thread(target=run, args=(client, i)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(RPC_TIMEOUT_S)
    assert sorted(results) == list(range(len(SERVE_PROMPTS)))
    for i, deltas in results.items():
        want = offline[i]
        assert [t for d in deltas for t in d.token_ids] == list(want.token_ids), SERVE_PROMPTS[i]
        assert "".join(d.text for d in deltas) == want.text
        assert deltas[-1].finish_reason == want.finish_reason
    assert follower.poll() is None  # the follower serves on


def test_two_process_serve_ends_when_the_follower_dies(two_process_serve):
    """SIGKILL the follower mid-stream: the open stream ends with UNAVAILABLE, the leading
    engine exits with code 3 naming process 1, the server exits non-zero, all within
    DEAD_PROCESS_BOUND_S, and no process of the run is left."""
    from jaxserve.distributed.processes import EXIT_PEER_LOST
    from jaxserve.frontend.client import JaxserveClient

    server, follower, _, _ = two_process_serve
    engine_pid = server.child("jaxserve.engine.process")
    pids = [server.proc.pid, *server.children, *child_pids(engine_pid)]
    first_token, ended = threading.Event(), threading.Event()
    error: list[grpc.RpcError] = []

    def stream(client: JaxserveClient) -> None:
        try:
            for _ in client.generate(
                "class ", max_tokens=50, temperature=0.0, ignore_eos=True, timeout=RPC_TIMEOUT_S
            ):
                first_token.set()
                time.sleep(0.05)  # a slow reader: the stream is still open at the kill
        except grpc.RpcError as e:
            error.append(e)
        ended.set()

    with JaxserveClient(server.target) as client:
        thread = threading.Thread(target=stream, args=(client,), daemon=True)
        thread.start()
        assert first_token.wait(RPC_TIMEOUT_S)
        follower.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        assert ended.wait(DEAD_PROCESS_BOUND_S), "the stream did not end"
        server.proc.wait(DEAD_PROCESS_BOUND_S)
        elapsed = time.monotonic() - killed
    assert error and error[0].code() == grpc.StatusCode.UNAVAILABLE, error
    assert elapsed < DEAD_PROCESS_BOUND_S
    assert server.proc.returncode != 0
    log = server.log()
    assert f"engine process (pid {engine_pid}) died (exit code {EXIT_PEER_LOST})" in log, log
    assert "process 1 (a follower) of the 2-process run is gone" in log
    deadline = time.monotonic() + 5
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [p for p in pids if alive(p)]

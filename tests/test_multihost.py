"""Several processes (jax.distributed on loopback) against one process with all devices.

2 processes x 4 emulated CPU devices run the sharded model, process 0 scheduling and
the other following it over the step channel; their greedy tokens must equal the same
mesh in this process (1 process x 8 devices) and the single-device model. Then the same
with `jaxserve serve` itself, and a follower that dies ends the served run. The step
channel alone (no JAX processes) is tested in test_step_channel.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
from server_harness import (
    ServerProcess,
    alive,
    child_pids,
    cpu_xla_flags,
    ep_test_threshold,
    free_port_range,
)

from jaxserve.config import DEMO_MODEL_DIR

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
    # It serves no clients: its lines are tagged as the follower it is.
    _, _, log_path, _ = two_process_serve
    log = log_path.read_text()
    assert "INFO [follower 1] " in log and "[frontend]" not in log, log


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
    died = f"engine process (pid {engine_pid}) died (exit code {EXIT_PEER_LOST}: another"
    assert died in log and died in error[0].details(), log
    # One line for the follower's loss in the leader's engine (the step channel's own
    # line and its callback's were two), one for the engine's exit in the frontend.
    lost = [line for line in log.splitlines() if " ERROR " in line and "(a follower)" in line]
    assert len(lost) == 1 and "process 1 (a follower) of the 2-process run is gone" in lost[0]
    deadline = time.monotonic() + 5
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [p for p in pids if alive(p)]

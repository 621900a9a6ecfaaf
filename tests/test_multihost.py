"""Several processes (jax.distributed on loopback) against one process with all devices.

2 processes x 4 emulated CPU devices run the sharded model, process 0 scheduling and
the other following it over the step channel; their greedy tokens must equal the same
mesh in this process (1 process x 8 devices) and the single-device model.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from model_utils import write_hf_checkpoint
from sharding_utils import mesh_qwen3_moe_config

from jaxserve import distributed
from jaxserve.step_channel import STOP, StepPublisher, StepSubscriber

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
WORKER = TESTS / "multihost_worker.py"
ENGINE_WORKER = TESTS / "multihost_engine_worker.py"


def _free_port() -> int:
    """A port with the next one free too (the step channel uses port + 1 and + 2)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        try:
            for offset in (1, 2):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port + offset))
            return port
        except OSError:
            continue
    raise RuntimeError("no free port range")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # The same model as test_sharding's (heads divisible by 8, 16 experts).
    path = tmp_path_factory.mktemp("multihost_qwen3_moe")
    write_hf_checkpoint(mesh_qwen3_moe_config(32), path, seed=0)
    return path


def _run_processes(
    model_dir: Path, dp: int, tp: int, num_processes: int, out: Path, worker: Path = WORKER
) -> dict:
    port = _free_port()
    env = dict(os.environ)
    env.update(
        JAX_PLATFORMS="cpu",
        XLA_FLAGS=f"--xla_force_host_platform_device_count={8 // num_processes}",
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


def test_two_process_engine_matches_one_process(model_dir, tmp_path):
    """The engine itself (scheduler, DP attention, async steps, multi-step decode) led by
    process 0 and followed by process 1 gives the tokens of the same mesh in one process
    and of one device."""
    from engine_helpers import run_engine
    from multihost_engine_worker import engine_config, requests

    from jaxserve.engine.core import EngineCore

    out = tmp_path / "engine.json"
    result = _run_processes(model_dir, 2, 4, 2, out, worker=ENGINE_WORKER)

    def tokens(dp, tp):
        engine = EngineCore(engine_config(str(model_dir), dp, tp))
        return {rid: r.tokens for rid, r in run_engine(engine, requests()).items()}

    assert result["tokens"] == tokens(2, 4) == tokens(1, 1)
    assert result["counters"]["num_compilations"] == 0
    assert result["counters"]["coordination_time_s"] > 0


# ----- the step channel and the distributed settings (no JAX processes) -------------------


def test_step_channel_delivers_every_step_in_order():
    port = _free_port()
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
        arrays = [rng.integers(0, 100, size=(i + 1,), dtype=np.int32), rng.random((2, 3))]
        sent.append(arrays)
        pub.publish(arrays, meta={"bucket": i})
    pub.close()
    thread.join(timeout=30)
    assert [m.step for m in received] == list(range(50))
    for msg, arrays in zip(received, sent, strict=True):
        assert msg.meta == {"bucket": msg.step}
        for got, want in zip(msg.arrays, arrays, strict=True):
            assert got.dtype == want.dtype
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
    assert distributed.first_slurm_host("node7,node8") == "node7"

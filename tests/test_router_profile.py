"""`jaxserve profile` with several replicas captures every serving replica (it used to
capture only the first): each replica's engine writes its host timeline and manifest
into its own folder, and the combined manifest names them all. Mock engines (no JAX
trace, the host timeline only), so the server starts in seconds."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from mock_engine import write_mock_model_dir
from scenario_load import Background, burst
from server_harness import REPO_DIR, ServerProcess

REPLICAS = 2
SECONDS = 1.0


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = write_mock_model_dir(tmp_path_factory.mktemp("mock_model"))
    flags = ("--engine-class", "mock_engine:MockEngineCore", "--replicas", str(REPLICAS),
             "--router-policy", "round-robin")  # fmt: skip
    env = {"JAXSERVE_MOCK_STEP_DELAY_S": "0.01"}
    srv = ServerProcess(model, extra_args=flags, env=env).wait_ready()
    yield srv
    srv.kill() if srv.proc.poll() is None else None


def test_profile_captures_every_replica(server, tmp_path):
    out = tmp_path / "prof"
    # Round-robin over both replicas, streaming all along: each has steps to record.
    load = Background(lambda: burst(server.target, ["a b c"] * 4, 64))
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "jaxserve.cli", "profile", "--server", server.target,
             "--seconds", str(SECONDS), "--out", str(out)],
            cwd=REPO_DIR, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
    finally:
        load.stop()
    assert proc.returncode == 0, proc.stderr
    manifest = json.loads((out / "profile.json").read_text())
    assert sorted(manifest["replicas"]) == [str(k) for k in range(REPLICAS)]
    assert manifest["error"] is None
    steps = 0
    for k, each in manifest["replicas"].items():
        assert each is not None and each["error"] is None, k
        timeline = Path(each["host_timeline"])
        assert timeline.parent == (out / f"replica-{k}").resolve()
        events = json.loads(timeline.read_text())["traceEvents"]
        assert each["steps"] > 0 and sum(e["name"] == "step" for e in events) == each["steps"]
        assert str(timeline) in manifest["files"]
        steps += each["steps"]
    assert manifest["steps"] == steps
    assert manifest["host_timeline"] in proc.stdout

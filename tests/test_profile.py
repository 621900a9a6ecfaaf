"""`jaxserve profile` against a running server (issue 11 part 4): the engine records a
JAX profiler trace and its loop's host timeline for the asked window without a restart,
and the command says where they are.

The server runs the demo model; requests stream while the capture runs, so the timeline
must hold the loop's phases and the steps of those requests, and the XLA trace the
device work. Checked on the files themselves: the Chrome trace parses and its spans lie
inside the window; the xplane protobuf exists and is not empty.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from scenario_load import Background, burst
from server_harness import DEMO_ENGINE, REPO_DIR, ServerProcess, serve_flags

from jaxserve.config import DEMO_MODEL_DIR

pytestmark = pytest.mark.slow

# The capture window. Stopping a JAX trace with load running takes about 3x the window
# (its events are collected and written: 14-17 s for 3 s here); the window checks below
# keep their absolute slack (1 s plus a step) at any length.
SECONDS = 1.5


@pytest.fixture(scope="module")
def server():
    # The demo-model tests' engine settings: in the suite it starts on the executables
    # that `demo_llm` and the other demo servers compiled (the session's cache).
    flags = serve_flags(DEMO_ENGINE)
    srv = ServerProcess(DEMO_MODEL_DIR, extra_args=flags, start_timeout_s=900).wait_ready()
    yield srv
    srv.kill()


def _profile(server, out, seconds=SECONDS):
    return subprocess.run(
        [sys.executable, "-m", "jaxserve.cli", "profile", "--server", server.target,
         "--seconds", str(seconds), "--out", str(out)],
        cwd=REPO_DIR, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def test_profile_captures_trace_and_timeline_of_a_running_engine(server, tmp_path):
    out = tmp_path / "prof"
    load = Background(lambda: burst(server.target, ["def "] * 4, 48))  # streams all along
    try:
        proc = _profile(server, out)
    finally:
        load.stop()
    assert proc.returncode == 0, proc.stderr
    print(proc.stdout)  # the command's output (pytest -s)
    manifest = json.loads((out / "profile.json").read_text())
    assert manifest["error"] is None and manifest["steps"] > 0
    # The printed lines name every file and where to open it.
    assert manifest["host_timeline"] in proc.stdout and "ui.perfetto.dev" in proc.stdout
    assert manifest["xplane"] and all(Path(p).stat().st_size > 0 for p in manifest["xplane"])
    events = json.loads((out / "host_timeline.json").read_text())["traceEvents"]
    names = {e["name"] for e in events}
    assert {"step", "schedule", "pack", "dispatch", "wait for device", "outputs"} <= names
    assert sum(e["name"] == "step" for e in events) == manifest["steps"]
    # The spans cover the window, and none starts after it ended plus the step that was
    # running then and a loop turn (a poll, at most a heartbeat interval).
    longest_step = max(e["dur"] for e in events if e["name"] == "step")
    assert min(e["ts"] for e in events) >= 0
    assert max(e["ts"] + e["dur"] for e in events) >= 0.9 * SECONDS * 1e6
    assert max(e["ts"] for e in events) <= (SECONDS + 1.0) * 1e6 + longest_step
    # The server kept serving: the same engine process answers afterwards.
    assert burst(server.target, ["def "], 4)[0] > 0


def test_profile_bad_arguments_are_usage_errors(server, tmp_path):
    proc = _profile(server, tmp_path / "x", seconds=0)
    assert proc.returncode == 2 and "seconds" in proc.stderr
    proc = _profile(server, tmp_path / "x", seconds=10_000)
    assert proc.returncode == 2 and "seconds" in proc.stderr
    # A folder the server cannot write: it said "profile: INVALID_ARGUMENT: out_dir: ..."
    # (the request's field, not the flag) with exit 1; now a usage error naming --out.
    proc = _profile(server, "/proc/x")
    assert proc.returncode == 2, proc
    assert proc.stderr.splitlines() == [
        "jaxserve profile: error: --out: cannot write /proc/x (No such file or directory)"
    ]
    # A file there: it said "cannot write F (File exists)".
    (tmp_path / "a_file").write_text("")
    proc = _profile(server, tmp_path / "a_file")
    assert proc.returncode == 2, proc
    assert proc.stderr.splitlines() == [
        f"jaxserve profile: error: --out: {tmp_path / 'a_file'} is a file, not a folder"
    ]

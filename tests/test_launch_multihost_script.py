"""scripts/launch_multihost_local.sh's stop (Ctrl-C / SIGTERM), with stand-in processes
(bash loops, no JAX) that trap SIGTERM and exit later with a chosen code: the script
signals process 0 first, the followers once it is gone, waits for every process to
really exit and reports their own codes. A few seconds."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "launch_multihost_local.sh"

# Each stand-in writes "up", and on SIGTERM "term <time>", sleeps its process's delay,
# writes "exit <time>" and exits with its process's code ($1: delays, $2: codes, by
# process id). `sleep` runs in the background so that the trap runs at once.
STAND_IN = r"""
i=$JAX_PROCESS_ID; delays=($1); codes=($2)
now() { date +%s.%N; }
on_term() { echo "term $(now)"; sleep "${delays[$i]}"; echo "exit $(now)"; exit "${codes[$i]}"; }
trap on_term TERM
echo up
while :; do sleep 0.05 & wait $!; done
"""


def _launch(tmp_path, delays, codes, **env):
    logs = tmp_path / "logs"
    proc = subprocess.Popen(
        ["bash", str(SCRIPT), "-n", str(len(codes)), "-d", "1", "-p", "1", "--",
         "bash", "-c", STAND_IN, "stand-in", " ".join(map(str, delays)),
         " ".join(map(str, codes))],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "LOG_DIR": str(logs), **env},
    )  # fmt: skip
    deadline = time.monotonic() + 10
    while not all(
        (logs / f"process_{i}.log").exists() and "up" in (logs / f"process_{i}.log").read_text()
        for i in range(len(codes))
    ):
        assert time.monotonic() < deadline and proc.poll() is None, "stand-ins did not start"
        time.sleep(0.02)
    return proc, logs


def _times(logs, i):
    """{"term": t, "exit": t} of stand-in `i` (seconds since the epoch)."""
    lines = (logs / f"process_{i}.log").read_text().split()
    return {k: float(v) for k, v in zip(lines[1::2], lines[2::2], strict=True)}


def test_sigterm_waits_for_every_process_and_reports_their_own_codes(tmp_path):
    # Process 0 takes 1.5 s to stop and exits 7; the follower exits 5 at once when told.
    proc, logs = _launch(tmp_path, delays=(1.5, 0), codes=(7, 5), FOLLOWER_GRACE_S="0")
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        _, err = proc.communicate(timeout=20)
    finally:
        proc.kill()
    took = time.monotonic() - sent
    assert took >= 1.4, f"the script ended {took:.2f} s after SIGTERM, before process 0"
    assert proc.returncode == 7  # process 0's own code, not 143
    assert "process 0 exited with code 7" in err and "process 1 exited with code 5" in err
    leader, follower = _times(logs, 0), _times(logs, 1)
    # Process 0 first; the follower only once process 0 is gone.
    assert follower["term"] >= leader["exit"]


def test_a_second_sigterm_reaches_every_process_at_once(tmp_path):
    # The first SIGTERM reaches process 0 only; a second one every process at once.
    proc, logs = _launch(tmp_path, delays=(3, 0), codes=(0, 0))
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    assert proc.poll() is None and "term" not in (logs / "process_1.log").read_text()
    proc.send_signal(signal.SIGTERM)
    try:
        _, err = proc.communicate(timeout=20)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    leader, follower = _times(logs, 0), _times(logs, 1)
    assert follower["term"] < leader["exit"]  # the second signal did not wait for process 0

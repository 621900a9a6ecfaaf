"""`serve --replicas N` supervision (`router.launch.watch_replica_children`): when one
child of a replica dies (its detokenizer sidecar SIGKILLed), the replica's other child
(its engine) is stopped and reaped, never left running or as a zombie beside the
replicas that serve on. Real processes (small Python programs standing in for the
engine and the sidecar), no JAX."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import pytest

from jaxserve.launcher import _Child
from jaxserve.router import launch

# A stand-in child: prints "ready" once its SIGTERM disposition is set, then sleeps.
_CHILD = "import signal, sys, time\n{setup}\nprint('ready', flush=True)\ntime.sleep(120)\n"


def _child(name: str, replica: int, ignore_term: bool = False) -> _Child:
    setup = "signal.signal(signal.SIGTERM, signal.SIG_IGN)" if ignore_term else ""
    proc = subprocess.Popen(
        [sys.executable, "-c", _CHILD.format(setup=setup)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "ready"
    return _Child(name, proc, replica=replica)


def _gone(pid: int) -> bool:
    """The pid is neither running nor a zombie: its parent reaped it."""
    return not os.path.exists(f"/proc/{pid}")


class _Replicas:
    dead_reason = None

    def __init__(self) -> None:
        self.died: list[tuple[int, str]] = []

    def replica_died(self, k: int, reason: str) -> None:
        self.died.append((k, reason))


async def _watch_until(children, replicas, done, timeout: float) -> bool:
    task = asyncio.create_task(launch.watch_replica_children(children, replicas, False))
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline and not done():
            await asyncio.sleep(0.05)
        return done()
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


@pytest.mark.parametrize("ignore_term", [False, True], ids=["stops", "ignores-sigterm"])
def test_a_dead_sidecar_takes_its_engine_down_and_reaped(monkeypatch, ignore_term):
    monkeypatch.setattr(launch, "CHILD_TERM_TIMEOUT_S", 0.5, raising=False)
    engine = _child("replica 0 engine", 0, ignore_term)
    sidecar = _child("replica 0 detokenizer", 0)
    others = [_child("replica 1 engine", 1), _child("replica 1 detokenizer", 1)]
    children = [engine, sidecar, *others]
    replicas = _Replicas()
    try:
        sidecar.process.send_signal(signal.SIGKILL)
        pid = engine.process.pid
        assert asyncio.run(_watch_until(children, replicas, lambda: _gone(pid), timeout=10)), (
            "the engine of the replica whose sidecar died was left "
            + ("running" if engine.process.poll() is None else "a zombie")
        )
        want = -signal.SIGKILL if ignore_term else -signal.SIGTERM
        assert engine.process.returncode == want
        assert [k for k, _ in replicas.died] == [0]
        assert "replica 0 detokenizer" in replicas.died[0][1]
        assert "SIGKILL" in replicas.died[0][1]
        assert all(c.process.poll() is None for c in others)  # replica 1 serves on
    finally:
        for c in children:
            if c.process.poll() is None:
                c.process.kill()
            c.process.wait()

"""What an idle `jaxserve serve` frontend waits on: it blocks until something happens
instead of waking on a short timer (an idle server used CPU for nothing). The child
watcher blocks on the children's pidfds (`lifetime.wait_any_exit`), the stall watcher
sleeps until a stall could first be declared (`liveness.watch_liveness`), and the HTTP
server's Date header is refreshed once a second, at the second (`http.server._ticks`)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time

import pytest

from jaxserve.frontend import liveness
from jaxserve.lifetime import wait_any_exit

_SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)"]


def _sleepers(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen(_SLEEPER) for _ in range(n)]


@pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="no pidfd on this platform")
def test_the_child_watcher_blocks_on_pidfds_and_names_the_child_that_exited(monkeypatch):
    """Two children; the second is killed after 0.3 s: wait_any_exit returns index 1 (and
    reaps it), having set no timer while it waited (asyncio.sleep would fail)."""

    async def no_timer(*_args, **_kwargs):
        raise AssertionError("wait_any_exit polled instead of blocking on the pidfds")

    monkeypatch.setattr("jaxserve.lifetime.asyncio.sleep", no_timer)
    procs = _sleepers(2)
    try:

        async def main() -> int:
            asyncio.get_running_loop().call_later(0.3, procs[1].kill)
            return await wait_any_exit(procs, poll_interval_s=0.1)

        start = time.monotonic()
        assert asyncio.run(main()) == 1
        assert time.monotonic() - start < 5
        assert procs[1].returncode == -9 and procs[0].poll() is None
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def test_without_pidfds_the_child_watcher_polls(monkeypatch):
    """Where os.pidfd_open is missing (not Linux), the first child to exit is still found,
    by polling."""
    monkeypatch.delattr(os, "pidfd_open", raising=False)
    procs = _sleepers(2)
    try:

        async def main() -> int:
            asyncio.get_running_loop().call_later(0.3, procs[0].kill)
            return await wait_any_exit(procs, poll_interval_s=0.05)

        assert asyncio.run(main()) == 0
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


class _Engine:
    """What watch_liveness reads and calls on the engine client."""

    def __init__(self, heard: float) -> None:
        self.last_heartbeat = {"engine": heard, "detokenizer": heard}
        self.dead_reason = None
        self.stalled_reason = None

    def mark_stalled(self, reason) -> None:
        self.stalled_reason = reason


def test_the_stall_watcher_sleeps_until_a_stall_could_be_declared(monkeypatch):
    """Heartbeats stop at once; stall timeout 0.6 s, check interval 0.05 s. The watcher
    declares the stall at ~0.6 s, having checked once or twice, not every 0.05 s (12
    times); then, stalled, it checks every 0.05 s and serves again once a heartbeat
    comes."""
    checks = []
    real = liveness.stalled_process

    def counted(*args):
        checks.append(time.monotonic())
        return real(*args)

    monkeypatch.setattr(liveness, "stalled_process", counted)
    engine = _Engine(time.monotonic())
    serving = []

    async def set_serving(value: bool) -> None:
        serving.append((value, time.monotonic()))

    async def main() -> None:
        start = time.monotonic()
        task = asyncio.create_task(liveness.watch_liveness(engine, set_serving, 0.6, 0.05))
        while not serving:
            await asyncio.sleep(0.01)
        assert serving[0][0] is False and 0.6 <= serving[0][1] - start < 1.5
        assert len(checks) <= 2, len(checks)
        engine.last_heartbeat["engine"] = engine.last_heartbeat["detokenizer"] = time.monotonic()
        await asyncio.sleep(0.3)
        assert [value for value, _ in serving] == [False, True]
        task.cancel()

    asyncio.run(main())


def test_the_http_ticker_refreshes_at_each_whole_second():
    """`_ticks` calls on_tick(0) at once, then at each whole second of the wall clock."""
    from jaxserve.frontend.http.server import _ticks

    class Server:
        ticks: list[tuple[int, float]] = []

        async def on_tick(self, counter: int) -> bool:
            self.ticks.append((counter, time.time()))
            return False

    server = Server()

    async def main() -> None:
        task = asyncio.create_task(_ticks(server))
        await asyncio.sleep(1.2)
        task.cancel()

    asyncio.run(main())
    assert [c for c, _ in server.ticks] == [0] * len(server.ticks)
    assert 2 <= len(server.ticks) <= 3, server.ticks
    for _, at in server.ticks[1:]:
        assert at % 1.0 < 0.1, at  # just after a whole second

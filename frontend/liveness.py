"""Stall detection: the engine and the sidecar prove they live by heartbeats.

The engine loop sends an `ipc.Heartbeat` every `engine.control.HEARTBEAT_INTERVAL_S`,
idle or busy (between steps); the sidecar forwards it with its outputs and sends its
own. `watch_liveness` checks both when the older of their last heartbeats turns as old as
the stall timeout (while stalled: every `CHECK_INTERVAL_S`): when one has been silent for
longer than the stall timeout (--stall-timeout-s), the server is stalled (health
NOT_SERVING; new requests UNAVAILABLE naming the silent process; open streams end with
UNAVAILABLE, their aborts queued for the engine: `AsyncEngineClient.mark_stalled`).
When heartbeats come again, it serves again. A silent sidecar is named first: the
engine's heartbeats pass through it, so its silence hides the engine's.

A process that died is not a stall: the launcher's child watcher reports it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from jaxserve.frontend.engine_client import AsyncEngineClient

DEFAULT_STALL_TIMEOUT_S = 30.0  # a healthy engine step takes far less (no compiles
# after warm-up); the first heartbeat after a stop proves the process is back
CHECK_INTERVAL_S = 0.25
_PROCESSES = ("detokenizer", "engine")  # the silent sidecar is named first (docstring)


def stalled_process(
    last_heartbeat: dict[str, float], since: float, now: float, timeout_s: float
) -> str | None:
    """Why the server is stalled, or None. last_heartbeat: process -> monotonic time of
    its last heartbeat; since: when watching began (the baseline of a process not heard
    from yet)."""
    for process in _PROCESSES:
        silent = now - max(last_heartbeat.get(process, since), since)
        if silent > timeout_s:
            return (
                f"the {process} process is stalled (no heartbeat for {silent:.1f} s, "
                f"timeout {timeout_s:g} s)"
            )
    return None


async def watch_liveness(
    engine: AsyncEngineClient,
    set_serving: Callable[[bool], Awaitable[None]],
    timeout_s: float,
    check_interval_s: float = CHECK_INTERVAL_S,
) -> None:
    """Run until cancelled: mark the engine client stalled or not, and health with it.
    Call once the engine is ready."""
    since = time.monotonic()
    while True:
        # Serving: no stall can be declared before the oldest heartbeat is timeout_s old,
        # so sleep till then (an idle server wakes for nothing in between). Stalled: check
        # every check_interval_s, for the first heartbeat back.
        wait_s = check_interval_s
        if engine.stalled_reason is None:
            oldest = min(max(engine.last_heartbeat.get(p, since), since) for p in _PROCESSES)
            wait_s = max(check_interval_s, oldest + timeout_s - time.monotonic())
        await asyncio.sleep(wait_s)
        if engine.dead_reason is not None:
            return  # a dead child: the launcher reports it
        reason = stalled_process(engine.last_heartbeat, since, time.monotonic(), timeout_s)
        if reason != engine.stalled_reason:
            engine.mark_stalled(reason)
            await set_serving(reason is None)

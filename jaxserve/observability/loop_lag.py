"""Frontend event-loop lag: how late the asyncio loop runs a timer.

A task sleeps `interval_s` again and again and observes, each time, how much later than
asked it woke up. A loop blocked by Python work (tokenizing a huge prompt, a slow
handler) delays every ready client write by as much; this is the application layer's
number (`jaxserve_frontend_event_loop_lag_seconds`). The same technique as Node's
`monitorEventLoopDelay` and aiomonitor. No JAX here.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

DEFAULT_INTERVAL_S = 0.05


async def watch_loop_lag(observe: Callable[[float], None], interval_s: float = DEFAULT_INTERVAL_S):
    """Run until cancelled: call `observe(lag_s)` after each sleep of `interval_s` s."""
    while True:
        start = time.perf_counter()
        await asyncio.sleep(interval_s)
        observe(max(time.perf_counter() - start - interval_s, 0.0))

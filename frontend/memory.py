"""Returning freed memory to the OS after bursts of large requests.

glibc's malloc keeps freed memory in its arenas (one per thread that allocated: gRPC's
and the tokenizer pool's threads each get one), so a burst of 30 MB requests leaves the
frontend's RSS at its peak long after they end (issue 12 measured 2.5 GiB kept).
Measured (48 requests of 7M token ids each, in-process): 4.9 GB after the burst; a
full `gc.collect()` brings it to 2.2 GB (refused calls leave reference cycles through
their exceptions' tracebacks, which hold the request messages until the cyclic
collector's oldest generation runs), and `malloc_trim(0)` then to 186 MB.
`trim()` does both; the admission controller calls it (off the event loop, at most every
`MIN_TRIM_INTERVAL_S`) when the bytes of open requests fall back to zero after at least
`TRIM_AFTER_BYTES` were held. malloc_trim is skipped without glibc.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import functools
import gc
import threading
import time

TRIM_AFTER_BYTES = 16 * 2**20  # a burst smaller than this is not worth a trim
MIN_TRIM_INTERVAL_S = 1.0
TRIM_DELAY_S = 0.2
_lock = threading.Lock()


@functools.cache
def _malloc_trim():
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        fn = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):  # not glibc (musl, macOS)
        return None
    fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    return fn


def trim() -> None:
    """Collect reference cycles, then give free heap memory back to the OS (blocking:
    tens of milliseconds; run it off the event loop)."""
    with _lock:
        gc.collect()
        fn = _malloc_trim()
        if fn is not None:
            fn(0)


class Trimmer:
    """Schedules `trim` on the running event loop's executor: `request()` runs one
    `TRIM_DELAY_S` later (so the calls ending now have dropped their references), and
    never more often than every MIN_TRIM_INTERVAL_S; requests meanwhile share it."""

    def __init__(self) -> None:
        self._scheduled = False
        self._last = float("-inf")
        self._tasks: set = set()
        self.num_trims = 0

    def request(self) -> None:
        if self._scheduled:
            return
        self._scheduled = True
        loop = asyncio.get_running_loop()
        delay = max(TRIM_DELAY_S, self._last + MIN_TRIM_INTERVAL_S - time.monotonic())
        loop.call_later(delay, self._run, loop)

    def _run(self, loop: asyncio.AbstractEventLoop) -> None:
        self._scheduled = False
        self._last = time.monotonic()
        self.num_trims += 1
        task = loop.run_in_executor(None, trim)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

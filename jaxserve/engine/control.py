"""The engine loop's control bookkeeping: aborts, deadlines and the heartbeat schedule.

Plain Python, no JAX, no sockets: `jaxserve.engine.process.EngineLoop` calls it.

- Aborts come on their own socket (the control path), drained before the request queue,
  so an abort is never stuck behind requests. An abort can still overtake its request
  (two sockets do not keep order between them): every aborted id is remembered
  (`MAX_TOMBSTONES`, oldest forgotten first), and a request that arrives after its
  abort is not run. Engine request ids are unique for the life of the frontend
  (`frontend.engine_client.engine_request_id`), so no later request is refused by it.
- Deadlines: a request may carry `deadline` (seconds since the epoch, the client's gRPC
  deadline); `expired(now)` returns the running requests whose deadline has passed, for
  the loop to abort before its next step.
- Heartbeat: `heartbeat_due(now)` says when the loop must send one (every
  `heartbeat_interval_s`, idle or not), so the frontend can tell a stalled engine.

Two clocks: deadlines are wall-clock times (`time.time()`: they come from the client's
host), the heartbeat schedule is monotonic (`time.monotonic()`: a wall-clock step must
not stop or flood the heartbeats). `poll_timeout_ms` takes both.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Iterable

# Aborted engine ids remembered in case their request arrives after the abort.
MAX_TOMBSTONES = 65536
# How often the engine loop sends a heartbeat (seconds), idle or not.
HEARTBEAT_INTERVAL_S = 0.5


class EngineControl:
    """See the module docstring. Counters: `num_expired` (requests aborted for their
    deadline), `num_dropped_late` (requests that arrived after their abort)."""

    def __init__(self, heartbeat_interval_s: float = HEARTBEAT_INTERVAL_S) -> None:
        self.heartbeat_interval_s = heartbeat_interval_s
        self._tombstones: OrderedDict[str, None] = OrderedDict()
        self._deadlines: dict[str, float] = {}  # running request id -> deadline
        self._heap: list[tuple[float, str]] = []
        self._last_heartbeat = float("-inf")
        self.num_expired = 0
        self.num_dropped_late = 0

    def aborted(self, request_ids: Iterable[str]) -> None:
        """Record aborts (before passing them to the core)."""
        for rid in request_ids:
            self._tombstones[rid] = None
            self._tombstones.move_to_end(rid)
            self._deadlines.pop(rid, None)
        while len(self._tombstones) > MAX_TOMBSTONES:
            self._tombstones.popitem(last=False)

    def admit(self, request_id: str, deadline: float | None) -> bool:
        """False if the request was aborted before it arrived (do not run it)."""
        if request_id in self._tombstones:
            del self._tombstones[request_id]
            self.num_dropped_late += 1
            return False
        if deadline is not None:
            self._deadlines[request_id] = deadline
            heapq.heappush(self._heap, (deadline, request_id))
            if len(self._heap) > 2 * len(self._deadlines) + 1024:  # drop finished entries
                self._heap = [(d, r) for d, r in self._heap if self._deadlines.get(r) == d]
                heapq.heapify(self._heap)
        return True

    def finished(self, request_ids: Iterable[str]) -> None:
        """Requests that ended (their final output was produced)."""
        for rid in request_ids:
            self._deadlines.pop(rid, None)

    def expired(self, now: float) -> list[str]:
        """The running requests whose deadline is <= now (each returned once)."""
        out = []
        while self._heap and self._heap[0][0] <= now:
            deadline, rid = heapq.heappop(self._heap)
            if self._deadlines.get(rid) == deadline:
                del self._deadlines[rid]
                out.append(rid)
        self.num_expired += len(out)
        return out

    def heartbeat_due(self, now: float) -> bool:
        """True (and the clock restarts) when a heartbeat is due. now: `time.monotonic()`."""
        if now - self._last_heartbeat >= self.heartbeat_interval_s:
            self._last_heartbeat = now
            return True
        return False

    def poll_timeout_ms(self, wall_now: float, monotonic_now: float) -> int:
        """How long an idle loop may block (ms, 1 to 3,600,000): until the next heartbeat
        (`monotonic_now`: `time.monotonic()`) or deadline (`wall_now`: `time.time()`)."""
        wait = self._last_heartbeat + self.heartbeat_interval_s - monotonic_now
        if self._heap:
            wait = min(wait, self._heap[0][0] - wall_now)
        return max(1, int(min(max(wait, 0.0), 3600.0) * 1000))

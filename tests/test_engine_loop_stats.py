"""EngineLoop's rate-limited stats: a step whose stats are not due builds none (the core's
`request_counts` says nothing changed), while a change of the request counts still goes
out at the step it happens."""

from __future__ import annotations

import threading
import time

import numpy as np
import zmq
from engine_loop_sockets import loop_sockets

from jaxserve.engine.process import EngineLoop
from jaxserve.ipc import (
    EngineOutputs,
    EngineRequest,
    EngineStats,
    Shutdown,
    TokenOutput,
    decode,
    encode,
)

STEPS = 40


class _CountedCore:
    """One request of STEPS steps, one token each; `running` drops to 0 after step 30
    (as if preempted into the queue); counts the stats it builds."""

    def __init__(self) -> None:
        self.steps = 0
        self.left = 0
        self.stats_built = 0

    def add_request(self, req) -> None:
        self.left = STEPS

    def abort_requests(self, ids) -> None:
        pass

    def has_work(self) -> bool:
        return self.left > 0

    def _counts(self) -> tuple[int, int]:
        if self.left == 0:
            return 0, 0
        return (1, 0) if self.steps < 30 else (0, 1)

    def request_counts(self) -> tuple[int, int]:
        return self._counts()

    def step(self):
        self.steps += 1
        self.left -= 1
        return [TokenOutput("r", [self.steps], "length" if self.left == 0 else None)]

    def stats(self) -> EngineStats:
        self.stats_built += 1
        running, waiting = self._counts()
        return EngineStats(num_running=running, num_waiting=waiting)


def test_stats_not_due_are_not_built_and_count_changes_go_out_at_once():
    core = _CountedCore()
    with loop_sockets("loop-stats") as (to_loop, loop_in, loop_out, from_loop):
        # An interval no step of this test outlasts: every send after the first is a
        # change of the counts.
        loop = EngineLoop(core, loop_in, loop_out, stats_interval_s=60.0)
        thread = threading.Thread(target=loop.run)
        thread.start()
        to_loop.send(encode(EngineRequest("r", np.asarray([1], np.int32), {})))
        tokens: list[int] = []
        sent: list[tuple[int, int, int]] = []  # (tokens out before it, running, waiting)
        while not tokens or tokens[-1] != STEPS:
            assert from_loop.poll(10_000), "the loop stopped publishing"
            msg = decode(from_loop.recv())
            if isinstance(msg, EngineStats):
                sent.append((len(tokens), msg.num_running, msg.num_waiting))
            elif isinstance(msg, EngineOutputs):
                tokens += [t for o in msg.outputs for t in o.new_token_ids]
        to_loop.send(encode(Shutdown("test")))
        thread.join(10)
        while from_loop.poll(100):
            msg = decode(from_loop.recv(zmq.NOBLOCK))
            if isinstance(msg, EngineStats):
                sent.append((len(tokens), msg.num_running, msg.num_waiting))
    assert tokens == list(range(1, STEPS + 1))
    # The counts as they changed: idle at start, running from the first step, waiting
    # after step 30, idle at the end.
    changes = [(n, r, w) for i, (n, r, w) in enumerate(sent) if i == 0 or sent[i - 1][1:] != (r, w)]
    assert [c[1:] for c in changes] == [(0, 0), (1, 0), (0, 1), (0, 0)]
    assert changes[2][0] == 30  # sent with step 30's outputs, after which they changed
    # Built: the start, the first step's, the change at step 30, the idle ones at the end
    # (and the add's); not one per step.
    assert core.stats_built <= 8, core.stats_built


def test_an_idle_loop_blocks_between_heartbeats():
    """Idle for 1 s, the loop wakes for its heartbeats (every 0.5 s), not every
    millisecond: it builds its stats a few times, not hundreds."""
    core = _CountedCore()
    with loop_sockets("loop-idle") as (to_loop, loop_in, loop_out, from_loop):
        loop = EngineLoop(core, loop_in, loop_out)
        thread = threading.Thread(target=loop.run)
        thread.start()
        time.sleep(1.0)
        to_loop.send(encode(Shutdown("test")))
        thread.join(10)
    assert core.stats_built <= 10, core.stats_built


def test_an_idle_loop_sends_its_clocks():
    """Idle, nothing in the stats changes but the loop's clocks: they still go out (every
    IDLE_CLOCKS_S), so the wait counter advances while the engine waits. They stayed at
    the last step's values, and a `jaxserve diagnose` window that ran past the end of a
    load took the engine for saturated (engine_busy 0.92 over a 5 s window with 2.3 s of
    load)."""
    from jaxserve.engine.process import IDLE_CLOCKS_S

    core = _CountedCore()
    idle_s = 2 * IDLE_CLOCKS_S + 1.0
    with loop_sockets("loop-clocks") as (to_loop, loop_in, loop_out, from_loop):
        loop = EngineLoop(core, loop_in, loop_out)
        thread = threading.Thread(target=loop.run)
        start = time.perf_counter()
        thread.start()
        time.sleep(idle_s)
        stats = []
        while from_loop.poll(0):
            msg = decode(from_loop.recv())
            if isinstance(msg, EngineStats):
                stats.append(msg.counters)
        elapsed = time.perf_counter() - start
        to_loop.send(encode(Shutdown("test")))
        thread.join(10)
    assert stats[0].loop_wait_s == 0.0  # the ready handshake, before any wait
    # Sent after at least IDLE_CLOCKS_S of waiting, and never more than the time passed.
    assert IDLE_CLOCKS_S <= stats[-1].loop_wait_s <= elapsed
    assert stats[-1].loop_work_s < stats[-1].loop_wait_s  # idle: mostly waiting

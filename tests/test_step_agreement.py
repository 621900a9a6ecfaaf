"""The step agreement latency the followers report to the leader over the step channel
(three ends in one process, on loopback), and the bytes the leader counts as published;
then the same latency on its way from the leader's engine to what `jaxserve diagnose`
reads (the session's tiny engine leading a follower thread).

Oracles: each follower's own transit samples (the report must be their median over
the last REPORT_EVERY steps), the sizes of the arrays published, and the leader's
channel's own `agreement_s` at each later stage.
"""

from __future__ import annotations

import threading
import time

import numpy as np
from conftest import swap_scheduler
from engine_helpers import greedy, run_engine
from prometheus_client import generate_latest
from server_harness import free_port_range

from jaxserve.distributed.membership import REPORT_EVERY
from jaxserve.distributed.step_channel import StepPublisher, StepSubscriber
from jaxserve.distributed.step_message import STOP


def test_followers_report_their_median_transit_and_bytes_are_counted():
    port = free_port_range()
    followers: dict[int, StepSubscriber] = {}

    def follow(pid: int) -> None:
        sub = StepSubscriber("127.0.0.1", port, pid, timeout_s=30)
        followers[pid] = sub
        while sub.receive(timeout_s=30).kind != STOP:
            pass

    threads = [threading.Thread(target=follow, args=(pid,)) for pid in (1, 2)]
    for t in threads:
        t.start()
    leader = StepPublisher("127.0.0.1", port, 2, timeout_s=30)
    steps = 2 * REPORT_EVERY + 5  # two reports each, then 5 steps not yet reported
    arrays = [np.arange(1000, dtype=np.int32), np.ones((4, 8), np.float32)]
    for _ in range(steps):
        leader.publish(arrays, meta={"shape": [4, 8]})
        time.sleep(0.0005)
    deadline = time.monotonic() + 10
    while len(leader.follower_transit_s) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    # Both followers' second report has arrived once all steps were received.
    while time.monotonic() < deadline and not all(
        f.stats.steps == steps for f in followers.values()
    ):
        time.sleep(0.01)
    time.sleep(0.2)
    want = {}
    for pid, sub in followers.items():
        window = sorted(sub.stats.samples_s[REPORT_EVERY : 2 * REPORT_EVERY])
        want[pid] = round(1e6 * window[len(window) // 2]) / 1e6
    assert leader.follower_transit_s == want
    assert leader.agreement_s == max(want.values()) > 0
    payload = steps * sum(a.nbytes for a in arrays)
    # Arrays as raw buffers plus one small msgpack header per step.
    assert payload < leader.bytes_sent < payload + 200 * steps
    leader.close()
    for t in threads:
        t.join(timeout=10)
    for sub in followers.values():
        sub.close()


def test_the_leaders_step_agreement_reaches_diagnose(tiny_engine):
    """The path `jaxserve diagnose --server` reads on a multi-process leader: the
    followers' reports -> `LeaderExecutor` -> `EngineCore.counters()` -> the engine's
    stats -> the frontend's metrics -> the scraped window. The session engine leads one
    follower (a thread that receives the steps, as a follower's channel does) for one
    request of more than REPORT_EVERY single-token steps."""
    from jaxserve.distributed.executor import LeaderExecutor
    from jaxserve.observability.diagnose import Window, diagnose_window, parse_exposition
    from jaxserve.observability.metrics import Metrics

    port = free_port_range()
    follower = threading.Thread(
        target=lambda: _receive_until_stop(StepSubscriber("127.0.0.1", port, 1, timeout_s=30))
    )
    follower.start()
    engine, one_process = tiny_engine, tiny_engine.executor
    leader = LeaderExecutor(engine.runner, StepPublisher("127.0.0.1", port, 1, timeout_s=30))
    metrics = Metrics(model="tiny")
    metrics.update_from_engine(engine.stats())
    first = parse_exposition(generate_latest(metrics.registry).decode())
    engine.executor = leader
    try:
        with swap_scheduler(engine, num_decode_steps=1):
            request = ("agree", [1, 2, 3], greedy(REPORT_EVERY + 60, ignore_eos=True))
            run_engine(engine, [request])
            # The report of step REPORT_EVERY crosses on the membership connection; the
            # executor copies it at its next dispatch.
            deadline = time.monotonic() + 10
            while leader.step_agreement_s == 0 and time.monotonic() < deadline:
                run_engine(engine, [("more", [4, 5], greedy(2, ignore_eos=True))])
        stats = engine.stats()
    finally:
        engine.executor = one_process
        leader.close()
        follower.join(timeout=10)
    agreement = leader.step_agreement_s
    assert agreement > 0
    assert stats.counters.step_agreement_s == agreement
    metrics.update_from_engine(stats)
    last = parse_exposition(generate_latest(metrics.registry).decode())
    assert last["jaxserve_engine_step_agreement_seconds"] == agreement
    window = Window(first, last, {k: max(first.get(k, v), v) for k, v in last.items()}, 5.0)
    assert diagnose_window(window, "test").summary["step_agreement_s"] == agreement


def _receive_until_stop(sub: StepSubscriber) -> None:
    while sub.receive(timeout_s=30).kind != STOP:
        pass
    sub.close()

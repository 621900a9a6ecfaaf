"""The step agreement latency the followers report to the leader over the step channel
(three ends in one process, on loopback), and the bytes the leader counts as published.

Oracles: each follower's own transit samples (the report must be their median over
the last REPORT_EVERY steps) and the sizes of the arrays published.
"""

from __future__ import annotations

import threading
import time

import numpy as np
from server_harness import free_port_range

from jaxserve.distributed.step_channel import (
    REPORT_EVERY,
    STOP,
    StepPublisher,
    StepSubscriber,
)


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

"""`jaxserve bench`'s request driver (jaxserve.benchmark.client) against a fake backend:
the arrival process, the concurrency cap, warm-ups and chained turns."""

from __future__ import annotations

import asyncio
import math
import time

import numpy as np
import pytest

from jaxserve.benchmark import client, datasets
from jaxserve.benchmark.backends import RequestResult, Sampling


def test_arrival_gaps_are_gamma_with_mean_one_over_rate():
    gaps = client.arrival_gaps(40_000, rate=8.0, burstiness=1.0, seed=0)
    assert gaps[0] == 0
    assert gaps[1:].mean() == pytest.approx(1 / 8, rel=0.03)
    assert gaps[1:].std() == pytest.approx(1 / 8, rel=0.03)  # exponential: std == mean
    bursty = client.arrival_gaps(40_000, rate=8.0, burstiness=0.25, seed=0)[1:]
    assert bursty.mean() == pytest.approx(1 / 8, rel=0.05)
    assert bursty.std() == pytest.approx(1 / 8 / math.sqrt(0.25), rel=0.05)  # mean/sqrt(k)
    assert not client.arrival_gaps(5, math.inf, 1.0, 0).any()
    with pytest.raises(ValueError, match="request_rate"):
        client.arrival_gaps(5, 0.0, 1.0, 0)


class FakeBackend:
    """Answers after `delay` seconds with output "<n>"; records prompts and the peak of
    requests in flight."""

    def __init__(self, delay: float = 0.02) -> None:
        self.delay, self.prompts, self.in_flight, self.peak = delay, [], 0, 0

    async def send(self, prompt, max_tokens, sp):
        self.prompts.append(prompt)
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        out = RequestResult(start=time.perf_counter(), chunk_tokens=[1])
        await asyncio.sleep(self.delay)
        self.in_flight -= 1
        out.chunk_times, out.ttft, out.latency = [self.delay], self.delay, self.delay
        out.success, out.output_len, out.text = True, 1, f"<{len(self.prompts)}>"
        return out


def _single(n):
    return [datasets.Session([datasets.BenchRequest(f"p{i}", 1, 1)]) for i in range(n)]


def test_driver_caps_concurrency_and_sends_warmups_first():
    fake = FakeBackend()
    run = asyncio.run(
        client.run(fake, _single(12), sampling=Sampling(), max_concurrency=3, num_warmups=2)
    )
    assert fake.prompts[:2] == ["p0", "p1"]  # warm-ups: the first sessions' first turns
    assert len(fake.prompts) == 14 and len(run.outputs) == 12
    assert fake.peak == 3
    # 12 requests, 3 at a time, 0.02 s each: at least 4 rounds.
    assert run.duration >= 4 * 0.02


def test_driver_rate_spreads_the_sends():
    fake = FakeBackend(delay=0.001)
    rate = 50.0
    run = asyncio.run(client.run(fake, _single(6), sampling=Sampling(), request_rate=rate))
    sent = np.array([o.start - run.t0 for o in run.outputs])
    # Each send waits for its arrival time (gaps from the same seed), in dataset order.
    assert np.all(sent >= np.cumsum(client.arrival_gaps(6, rate, 1.0, 0)) - 1e-6), sent
    assert np.all(np.diff(sent) >= 0)
    # Rate inf: every request is sent before the first one ends.
    fake = FakeBackend(delay=0.5)
    asyncio.run(client.run(fake, _single(6), sampling=Sampling()))
    assert fake.peak == 6


def test_driver_chains_turns_with_history():
    fake = FakeBackend(delay=0.001)
    turns = [datasets.BenchRequest(t, 1, 1) for t in ("first", "second", "third")]
    asyncio.run(client.run(fake, [datasets.Session(turns, chained=True)], sampling=Sampling()))
    sep = client.TURN_SEPARATOR
    assert fake.prompts == [
        "first",
        "first<1>" + sep + "second",
        "first<1>" + sep + "second<2>" + sep + "third",
    ]

"""The request driver of `jaxserve bench`: when each request is sent, and how many at once.

Sessions (`datasets.Session`) start in dataset order. With a finite request rate the gaps
between session starts are drawn from a gamma distribution of shape `burstiness` and mean
1/rate (burstiness 1: a Poisson process, exponential gaps), as vLLM's benchmark_serving
does; rate inf starts every session at once. `max_concurrency` caps the requests in
flight (a semaphore taken per request), so rate inf with a cap is a closed loop of that
many clients. The turns of a chained session go one after another, each prompt the
history so far plus the turn's own message.

Warm-up requests (the first sessions' first turns, sent together, not timed) run before
the clock starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from jaxserve.benchmark.backends import RequestResult, Sampling
from jaxserve.benchmark.datasets import BenchRequest, Session

# A chained turn's prompt: the history, then this between it and the new message.
TURN_SEPARATOR = "\n\n"


@dataclass(slots=True)
class BenchRun:
    """The outcome of `run`: one RequestResult per request (sessions' turns in order,
    sessions in dataset order), the seconds from the first send to the last finish, and
    the perf_counter() the clock started at (RequestResult.start - t0 is a request's
    send time into the run)."""

    outputs: list[RequestResult]
    duration: float
    t0: float


def arrival_gaps(n: int, rate: float, burstiness: float, seed: int) -> np.ndarray:
    """n seconds to wait before each session: 0 for the first, then gamma draws of shape
    `burstiness` and scale 1/(rate*burstiness) (mean 1/rate); all 0 for rate inf.

    Raises ValueError naming request_rate (<= 0) or burstiness (<= 0)."""
    if not rate > 0:
        raise ValueError(f"request_rate: must be > 0 (inf: all at once), got {rate}")
    if not burstiness > 0:
        raise ValueError(f"burstiness: must be > 0, got {burstiness}")
    if math.isinf(rate) or n == 0:
        return np.zeros(n)
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(burstiness, 1.0 / (rate * burstiness), size=n)
    gaps[0] = 0.0
    return gaps


def _prompt(history: str, turn: BenchRequest) -> str | list[int]:
    return history + TURN_SEPARATOR + turn.prompt if history else turn.prompt


async def _warm_up(backend, sessions: list[Session], n: int, sp: Sampling) -> None:
    firsts = [s.turns[0] for s in sessions[:n]] if sessions else []
    firsts += [firsts[-1]] * (n - len(firsts)) if firsts else []
    results = await asyncio.gather(*(backend.send(t.prompt, t.output_len, sp) for t in firsts))
    if failed := [r.error for r in results if not r.success]:
        raise RuntimeError(f"warm-up request failed: {failed[0]}")


async def run(
    backend,
    sessions: list[Session],
    *,
    sampling: Sampling,
    request_rate: float = math.inf,
    burstiness: float = 1.0,
    max_concurrency: int | None = None,
    num_warmups: int = 0,
    seed: int = 0,
    on_done: Callable[[RequestResult], None] | None = None,
) -> BenchRun:
    """Send every turn of `sessions` through `backend` (an entered GrpcBackend or
    HttpBackend); `on_done` is called as each request finishes (the progress bar).

    Raises ValueError naming a bad request_rate, burstiness or max_concurrency, and
    RuntimeError if a warm-up request fails (the server is not serving)."""
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"max_concurrency: must be >= 1, got {max_concurrency}")
    gaps = arrival_gaps(len(sessions), request_rate, burstiness, seed)
    if num_warmups:
        await _warm_up(backend, sessions, num_warmups, sampling)
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    results: list[list[RequestResult]] = [[] for _ in sessions]

    async def one(k: int, session: Session) -> None:
        history = ""
        for turn in session.turns:
            prompt = _prompt(history, turn) if session.chained else turn.prompt
            async with limit if limit else contextlib.nullcontext():
                out = await backend.send(prompt, turn.output_len, sampling)
            results[k].append(out)
            if on_done:
                on_done(out)
            if session.chained:
                if not out.success:
                    break  # the history is lost; the later turns are not sent
                history = prompt + out.text

    send_at = np.cumsum(gaps)  # from t0: sleeping to these does not add up drift
    t0 = time.perf_counter()
    tasks = []
    for k, session in enumerate(sessions):
        if (wait := t0 + send_at[k] - time.perf_counter()) > 0:
            await asyncio.sleep(wait)
        tasks.append(asyncio.create_task(one(k, session)))
    await asyncio.gather(*tasks)
    duration = time.perf_counter() - t0
    return BenchRun([o for rs in results for o in rs], duration, t0)

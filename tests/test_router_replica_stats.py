"""`router.replica_stats.aggregate_stats`: several replicas' EngineStats read as one
engine's, checked field by field against sums and maxima computed here."""

from __future__ import annotations

import dataclasses
import random

from jaxserve.ipc import EngineStats
from jaxserve.observability.stats import EngineCounters
from jaxserve.router.replica_stats import aggregate_stats


def _stats(rng: random.Random, async_scheduling: bool) -> EngineStats:
    counters = EngineCounters()
    for f in dataclasses.fields(EngineCounters):
        if isinstance(getattr(counters, f.name), int | float):
            setattr(counters, f.name, type(getattr(counters, f.name))(rng.randint(0, 50)))
    return EngineStats(
        model="m", max_model_len=512, block_size=16, vocab_size=100,
        num_blocks_total=rng.randint(10, 99), num_blocks_free=rng.randint(0, 9),
        num_running=rng.randint(0, 9), num_waiting=rng.randint(0, 9), ready=True,
        counters=counters, async_scheduling=async_scheduling,
    )  # fmt: skip


def test_gauges_sum_over_live_counters_over_every_replica_seen():
    rng = random.Random(0)
    live = [_stats(rng, False) for _ in range(3)]
    dead = _stats(rng, False)
    out = aggregate_stats(live, [*live, dead])
    for name in ("num_blocks_total", "num_blocks_free", "num_running", "num_waiting"):
        assert getattr(out, name) == sum(getattr(s, name) for s in live), name
    seen = [*live, dead]
    for f in dataclasses.fields(EngineCounters):
        values = [getattr(s.counters, f.name) for s in seen]
        if not isinstance(values[0], int | float):
            continue
        if f.name == "warmup_pending_shapes":  # a gauge: live replicas only
            want = sum(getattr(s.counters, f.name) for s in live)
        elif f.name.startswith(("last_", "peak_")):
            want = max(values)
        else:
            want = sum(values)
        assert getattr(out.counters, f.name) == want, f.name
    assert out.ready and (out.model, out.max_model_len, out.block_size) == ("m", 512, 16)


def test_the_resolved_async_scheduling_is_the_replicas_own():
    """serve's config block reads it: with replicas it said "auto" instead of off/on."""
    rng = random.Random(1)
    for value in (False, True):
        replicas = [_stats(rng, value) for _ in range(2)]
        assert aggregate_stats(replicas, replicas).async_scheduling is value
    assert aggregate_stats([], []).async_scheduling is None and not aggregate_stats([], []).ready


def test_a_dead_replica_keeps_its_counters_in_its_line():
    """GetServerInfo's line of a dead replica: no requests or blocks, but the prefix-cache
    counters it had (the server's totals keep them too)."""
    from types import SimpleNamespace

    from jaxserve.router.replica_stats import replica_info

    rng = random.Random(1)
    last = _stats(rng, False)
    client = SimpleNamespace(ready=False, dead_reason="exit 1", stalled_reason=None)
    rep = SimpleNamespace(index=0, state="dead", client=client, last_stats=last,
                          decisions=7, address="a")  # fmt: skip
    zero = SimpleNamespace(num_requests=lambda i: 0, load=lambda i: 0.0)
    router = SimpleNamespace(load=zero, index=SimpleNamespace(num_blocks=lambda i: 0))
    (line,) = replica_info([rep], router)
    assert (line["num_running"], line["kv_blocks_total"]) == (0, 0)
    assert line["prefix_cache_queries"] == last.counters.prefix_cache_queries > 0
    assert line["prefix_cache_hits"] == last.counters.prefix_cache_hits

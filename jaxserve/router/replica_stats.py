"""The engine stats of several replicas as one server's, and each replica's line of
GetServerInfo and the metrics.

`aggregate_stats` sums the replicas' `EngineStats` so that the server-wide gauges and
counters (`observability.metrics.Metrics.update_from_engine`) read as one engine's:
gauges (running, waiting, KV blocks) over the live replicas; cumulative counters over
every replica ever seen, dead ones included at their last value, so that a replica's
death never makes a counter go down (the engine histograms too, bucket by bucket); the
`last_*` step values and the `peak_*` device peaks are the maximum. Model limits and the
resolved async scheduling come from the first replica (they agree: every replica runs
one config, and `ReplicaSet` refuses a replica whose model or block size differs).
`refusal` says why a replica cannot join them; `replica_info` and `update_gauges` give
each replica's line (GetServerInfo, metrics).
"""

from __future__ import annotations

import dataclasses

from jaxserve.ipc import EngineStats
from jaxserve.observability.stats import EngineCounters, EngineHistograms


def aggregate_stats(live: list[EngineStats], all_seen: list[EngineStats]) -> EngineStats:
    """One `EngineStats` for the whole server.

    Args:
        live: the last stats of the replicas that serve now (their gauges are summed).
        all_seen: the last stats of every replica ever ready, live or not (counters).

    Returns:
        ready=True when any replica is live; limits of the first in all_seen.
    """
    first = all_seen[0] if all_seen else EngineStats()
    counters = EngineCounters()
    for f in dataclasses.fields(EngineCounters):
        values = [getattr(s.counters, f.name) for s in all_seen]
        if not values:
            continue
        keep_max = f.name.startswith(("last_", "peak_"))  # a step's value, a device's peak
        setattr(counters, f.name, max(values) if keep_max else sum(values))
    # A gauge of the replicas serving now (a dead one's last value would stay forever).
    counters.warmup_pending_shapes = sum(s.counters.warmup_pending_shapes for s in live)
    histograms = EngineHistograms()
    for stats in all_seen:
        h = stats.histograms
        if h.queue_time_counts:
            mine = histograms.queue_time_counts or [0] * len(h.queue_time_counts)
            histograms.queue_time_counts = [
                a + b for a, b in zip(mine, h.queue_time_counts, strict=True)
            ]
        histograms.queue_time_sum_s += h.queue_time_sum_s
    return EngineStats(
        model=first.model,
        max_model_len=first.max_model_len,
        block_size=first.block_size,
        num_blocks_total=sum(s.num_blocks_total for s in live),
        num_blocks_free=sum(s.num_blocks_free for s in live),
        vocab_size=first.vocab_size,
        kv_bytes_per_token=first.kv_bytes_per_token,
        kv_layout=first.kv_layout,
        async_scheduling=first.async_scheduling,  # every replica runs one config
        num_running=sum(s.num_running for s in live),
        num_waiting=sum(s.num_waiting for s in live),
        ready=bool(live),
        counters=counters,
        histograms=histograms,
    )


def refusal(stats: EngineStats, first: EngineStats, block_size: int) -> str | None:
    """Why a replica whose stats are `stats` cannot serve beside the others: once ready,
    its model or max_model_len differs from the first replica's (`first`) or its block
    size from the router's (`block_size`). None when it can."""
    if stats.ready and (
        stats.block_size != block_size
        or stats.model != first.model
        or stats.max_model_len != first.max_model_len
    ):
        return (
            f"refused: model {stats.model!r} / block_size {stats.block_size} / "
            f"max_model_len {stats.max_model_len} differ from model {first.model!r} / "
            f"block_size {block_size} / max_model_len {first.max_model_len}"
        )
    return None


def update_gauges(metrics, replicas, router) -> None:
    """Set each replica's gauges (`router.metrics.RouterMetrics.replica`)."""
    for rep in replicas:
        s = _live_stats(rep)
        metrics.replica(
            rep.index,
            up=float(rep.client.ready),
            running=s.num_running,
            waiting=s.num_waiting,
            kv_blocks_free=s.num_blocks_free,
            load_blocks=router.load.load(rep.index),
            index_blocks=router.index.num_blocks(rep.index),
            engine_cpu_seconds=s.counters.process_cpu_s,
            detokenizer_cpu_seconds=s.counters.detokenizer_cpu_s,
        )


def replica_info(replicas, router) -> list[dict]:
    """Per replica (`replicas.Replica`), the fields of GetServerInfo's `ReplicaInfo`."""
    out = []
    for rep in replicas:
        s = _live_stats(rep)
        # Counters since the replica's (last) start stay after it died: the server's
        # totals keep them too (`aggregate_stats`' all_seen).
        counters = (rep.last_stats or s).counters
        out.append(
            dict(
                replica=rep.index,
                state=rep.state,
                reason=rep.client.dead_reason or rep.client.stalled_reason or "",
                kv_blocks_total=s.num_blocks_total,
                kv_blocks_free=s.num_blocks_free,
                num_running=s.num_running,
                num_waiting=s.num_waiting,
                router_requests=router.load.num_requests(rep.index),
                router_load_blocks=router.load.load(rep.index),
                router_index_blocks=router.index.num_blocks(rep.index),
                router_decisions=rep.decisions,
                address=rep.address,
                prefix_cache_queries=counters.prefix_cache_queries,
                prefix_cache_hits=counters.prefix_cache_hits,
            )
        )
    return out


def _live_stats(rep) -> EngineStats:
    """A replica's last stats; empty for a dead one (it holds no requests or blocks)."""
    if rep.state == "dead" or rep.last_stats is None:
        return EngineStats()
    return rep.last_stats

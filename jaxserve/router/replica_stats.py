"""The engine stats of several replicas as one server's, and each replica's line of
GetServerInfo and the metrics.

`aggregate_stats` sums the replicas' `EngineStats` so that the server-wide gauges and
counters (`observability.metrics.Metrics.update_from_engine`) read as one engine's:
gauges (running, waiting, KV blocks) over the live replicas; cumulative counters over
every replica ever seen, dead ones included at their last value, so that a replica's
death never makes a counter go down; the `last_*` step timings are the maximum (the
slowest replica's last step). Model limits come from the first replica (they agree:
`ReplicaSet` refuses a replica whose model or block size differs).
"""

from __future__ import annotations

import dataclasses

from jaxserve.ipc import EngineStats
from jaxserve.observability.stats import EngineCounters


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
        setattr(counters, f.name, max(values) if f.name.startswith("last_") else sum(values))
    return EngineStats(
        model=first.model,
        max_model_len=first.max_model_len,
        block_size=first.block_size,
        num_blocks_total=sum(s.num_blocks_total for s in live),
        num_blocks_free=sum(s.num_blocks_free for s in live),
        vocab_size=first.vocab_size,
        num_running=sum(s.num_running for s in live),
        num_waiting=sum(s.num_waiting for s in live),
        ready=bool(live),
        counters=counters,
    )

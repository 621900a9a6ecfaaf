"""Prometheus metrics of the router and of each replica, on the server's registry.

Every decision is counted (`jaxserve_router_decisions_total{policy, replica}`) with the
prompt blocks it asked for and the blocks the index expected cached on the chosen
replica (`jaxserve_router_prompt_blocks_total`, `jaxserve_router_matched_blocks_total`;
their ratio is the router's expected hit rate). Per replica, as gauges: whether it serves
(`jaxserve_replica_up`: 1 serving, 0 starting/stalled/dead), its running and waiting
requests and free KV blocks (its own stats), the router's view of its load (blocks) and
of its cache (blocks in the prefix index), its engine's and sidecar's CPU seconds since
they started (`jaxserve_replica_{engine,detokenizer}_cpu_seconds`, cumulative values of
one process life, so gauges), and the index resyncs asked of it
(`jaxserve_router_resyncs_total`). No JAX.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge


class RouterMetrics:
    """The router's and the replicas' metrics.

    Args:
        registry: the server's registry (`observability.metrics.Metrics.registry`).
        model: the model label.
    """

    def __init__(self, registry: CollectorRegistry, model: str = "") -> None:
        r, self._model = registry, model
        self.decisions = Counter(
            "jaxserve_router_decisions", "Routing decisions by policy and chosen replica",
            ["model", "policy", "replica"], registry=r,
        )  # fmt: skip
        self.prompt_blocks = Counter(
            "jaxserve_router_prompt_blocks", "Full prompt blocks of routed requests",
            ["model"], registry=r,
        ).labels(model)  # fmt: skip
        self.matched_blocks = Counter(
            "jaxserve_router_matched_blocks",
            "Prompt blocks the prefix index expected cached on the chosen replica",
            ["model"], registry=r,
        ).labels(model)  # fmt: skip
        self.resyncs = Counter(
            "jaxserve_router_resyncs", "KV index snapshots asked of a replica (gaps, starts)",
            ["model", "replica"], registry=r,
        )  # fmt: skip
        gauges = {
            "up": "1 while the replica serves (0: starting, stalled or dead)",
            "running": "Requests running on the replica",
            "waiting": "Requests waiting on the replica",
            "kv_blocks_free": "Free KV blocks of the replica",
            "load_blocks": "The router's active load of the replica (KV blocks)",
            "index_blocks": "Blocks of the replica in the router's prefix index",
            "engine_cpu_seconds": "CPU seconds of the replica's engine process (0 dead)",
            "detokenizer_cpu_seconds": "CPU seconds of the replica's detokenizer sidecar",
        }
        self._gauges = {
            key: Gauge(f"jaxserve_replica_{key}", doc, ["model", "replica"], registry=r)
            for key, doc in gauges.items()
        }

    def decision(self, policy: str, replica: int, num_blocks: int, matched: int) -> None:
        self.decisions.labels(self._model, policy, str(replica)).inc()
        self.prompt_blocks.inc(num_blocks)
        self.matched_blocks.inc(matched)

    def resync(self, replica: int) -> None:
        self.resyncs.labels(self._model, str(replica)).inc()

    def replica(self, replica: int, **values: float) -> None:
        """Set the replica's gauges (keys of the gauges table: up, running, ...)."""
        for key, value in values.items():
            self._gauges[key].labels(self._model, str(replica)).set(value)

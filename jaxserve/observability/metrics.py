"""The metric registry: every Prometheus metric jaxserve exports, defined in one place.

The frontend process owns the registry and the HTTP endpoint. It observes what it sees
itself (TTFT, inter-token latency, TPOT, end-to-end latency, tokens, finish reasons) and
copies the engine's gauges and counters from the `EngineStats` messages that the engine
sends through the detokenizer (`EngineStats.counters`, an
`observability.stats.EngineCounters`: see `ENGINE_COUNTERS` and `ENGINE_GAUGES`).

The engine sends its counters as cumulative values since its start; they are exported as
Prometheus counters (`..._total`, as vLLM's `vllm:num_preemptions_total` and
`vllm:prefix_cache_queries_total`), so that `rate()` and `increase()` work: each stats
message increments a counter by the change since the previous message. A value below the
previous one means the engine restarted and counts from 0 again: the whole new value is
the increment (Prometheus' own counter-reset rule, applied at the source).
Counters and histograms export no `_created` series: `disable_created_metrics`, the
process-wide switch of prometheus_client, is called by `jaxserve serve` (the launcher),
which owns its process, as vLLM's server does; it is not called here, so that importing
this module leaves other registries of an embedding program alone.

Expert-parallel load balance (MoE models only, from `EngineStats.expert_*`): per MoE
layer the balancedness of the EP ranks' loads over the engine's EPLB window,
`jaxserve_expert_balancedness{layer="3"}` (mean / max, vLLM's EPLB metric; 1.0 is
balanced), its mean over layers `jaxserve_expert_balancedness_mean`, and
`jaxserve_expert_routed_tokens_total`; with EPLB on, the re-placements applied
`jaxserve_eplb_rebalances_total` and their time `jaxserve_eplb_rebalance_seconds_total`
(engine counters, 0 while EPLB is off). They are registered on the first stats of an MoE
model, so a dense model's exposition has none of them.
No JAX here.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

# Latency buckets in seconds: sub-millisecond ITL on a GPU up to minute-long CPU requests.
_LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
)  # fmt: skip

# Cumulative `EngineCounters` fields: field -> (counter name, help).
# prometheus_client appends `_total` to a counter's name in the exposition.
ENGINE_COUNTERS = {
    "num_steps": ("jaxserve_engine_steps", "Engine steps"),
    "num_preemptions": (
        "jaxserve_num_preemptions", "Requests preempted (KV blocks freed, recomputed later)"
    ),
    "prefix_cache_queries": (
        "jaxserve_prefix_cache_queries", "Prompt tokens looked up in the prefix cache"
    ),
    "prefix_cache_hits": ("jaxserve_prefix_cache_hits", "Prompt tokens found in the prefix cache"),
    "prefill_tokens": ("jaxserve_engine_prefill_tokens", "Prefill tokens computed"),
    "decode_tokens": ("jaxserve_engine_decode_tokens", "Decode tokens computed"),
    "host_time_s": (
        "jaxserve_engine_host_time_seconds",
        "Engine host time (schedule, prepare inputs, outputs), s",
    ),
    "device_time_s": ("jaxserve_engine_device_time_seconds", "Engine device time, s"),
    "coordination_time_s": (
        "jaxserve_engine_coordination_time_seconds",
        "Multi-process step coordination (publishing steps), s",
    ),
    "num_compilations": (
        "jaxserve_engine_compilations", "XLA compilations after warm-up (should stay 0)"
    ),
    "eplb_rebalances": (
        "jaxserve_eplb_rebalances", "EPLB expert re-placements applied (weights moved)"
    ),
    "eplb_rebalance_s": (
        "jaxserve_eplb_rebalance_seconds", "Time spent moving expert weights for EPLB, s"
    ),
    "coordination_bytes": (
        "jaxserve_engine_coordination_bytes",
        "Bytes the multi-process leader published to the followers (step inputs)",
    ),
    "requests_expired": (
        "jaxserve_engine_requests_expired",
        "Requests the engine aborted because their client's deadline had passed",
    ),
}  # fmt: skip

# `EngineCounters` fields that are values of the last step, exported as gauges (name, help).
# Names end in the unit, `_seconds` (Prometheus' naming convention).
ENGINE_GAUGES = {
    "last_host_s": ("jaxserve_engine_last_host_seconds", "Host time of the last engine step, s"),
    "last_device_s": (
        "jaxserve_engine_last_device_seconds", "Device time of the last engine step, s"
    ),
    "last_coordination_s": (
        "jaxserve_engine_last_coordination_seconds",
        "Multi-process step coordination time of the last step, s",
    ),
    "step_agreement_s": (
        "jaxserve_engine_step_agreement_seconds",
        "Multi-process: slowest follower's median time from the leader's publish to "
        "having the step, s",
    ),
}  # fmt: skip


# Expert-load metric names (see the module docstring).
EXPERT_BALANCEDNESS = "jaxserve_expert_balancedness"
EXPERT_BALANCEDNESS_MEAN = "jaxserve_expert_balancedness_mean"
EXPERT_ROUTED_TOKENS = "jaxserve_expert_routed_tokens"


class Metrics:
    """Prometheus metrics of one jaxserve server (one registry, so tests can make many)."""

    def __init__(self, model: str = "") -> None:
        self.registry = CollectorRegistry()
        labels = {"model": model}
        r = self.registry

        def hist(name, doc):
            return Histogram(
                name, doc, labelnames=["model"], buckets=_LATENCY_BUCKETS, registry=r
            ).labels(**labels)

        self.ttft = hist("jaxserve_time_to_first_token_seconds", "Time to first token (TTFT)")
        self.itl = hist("jaxserve_inter_token_latency_seconds", "Inter-token latency (ITL)")
        self.tpot = hist(
            "jaxserve_time_per_output_token_seconds", "Time per output token (TPOT) per request"
        )
        self.e2e = hist("jaxserve_e2e_request_latency_seconds", "End-to-end request latency")
        self.prompt_tokens = Counter(
            "jaxserve_prompt_tokens", "Prompt tokens processed", ["model"], registry=r
        ).labels(**labels)
        self.generation_tokens = Counter(
            "jaxserve_generation_tokens", "Output tokens generated", ["model"], registry=r
        ).labels(**labels)
        self._finished = Counter(
            "jaxserve_request_success", "Finished requests by finish reason",
            ["model", "finish_reason"], registry=r,
        )  # fmt: skip
        self._model = model
        self._rejected = Counter(
            "jaxserve_requests_rejected", "Requests refused by admission control, by limit",
            ["model", "limit"], registry=r,
        )  # fmt: skip
        self._abandoned = Counter(
            "jaxserve_requests_abandoned",
            "Requests whose client left before the end (reason: cancelled or deadline); "
            "the engine aborts them",
            ["model", "reason"], registry=r,
        )  # fmt: skip
        self.running = Gauge(
            "jaxserve_num_requests_running", "Requests running", ["model"], registry=r
        ).labels(**labels)
        self.waiting = Gauge(
            "jaxserve_num_requests_waiting", "Requests waiting", ["model"], registry=r
        ).labels(**labels)
        self.kv_blocks_free = Gauge(
            "jaxserve_kv_blocks_free", "Free KV cache blocks", ["model"], registry=r
        ).labels(**labels)
        self.kv_blocks_total = Gauge(
            "jaxserve_kv_blocks_total", "Usable KV cache blocks (the null block excluded)",
            ["model"], registry=r,
        ).labels(**labels)  # fmt: skip
        self.engine_counters = {
            key: Counter(name, doc, ["model"], registry=r).labels(**labels)
            for key, (name, doc) in ENGINE_COUNTERS.items()
        }
        self.engine_gauges = {
            key: Gauge(name, doc, ["model"], registry=r).labels(**labels)
            for key, (name, doc) in ENGINE_GAUGES.items()
        }
        # The last cumulative value seen of each engine counter (the base of the next delta).
        self._last_engine_counts: dict[str, float] = {}
        self.prefix_cache_hit_rate = Gauge(
            "jaxserve_prefix_cache_hit_rate", "Prefix cache hits / queries over prompt tokens",
            ["model"], registry=r,
        ).labels(**labels)  # fmt: skip
        # Expert-load metrics: registered by the first stats of an MoE model.
        self._expert_metrics: tuple[Gauge, Gauge, Counter] | None = None

    def request_rejected(self, limit: str) -> None:
        self._rejected.labels(model=self._model, limit=limit).inc()

    def request_abandoned(self, reason: str) -> None:
        self._abandoned.labels(model=self._model, reason=reason).inc()

    def request_finished(self, finish_reason: str) -> None:
        self._finished.labels(model=self._model, finish_reason=finish_reason).inc()

    def update_from_engine(self, stats) -> None:
        """Apply one `ipc.EngineStats`: set the gauges, advance the counters by the change
        of their cumulative values since the previous message (see the module docstring
        for a value that went down)."""
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_blocks_free.set(stats.num_blocks_free)
        self.kv_blocks_total.set(stats.num_blocks_total)
        counters = stats.counters
        for key, counter in self.engine_counters.items():
            self._advance_engine_counter(key, float(getattr(counters, key)), counter)
        for key, gauge in self.engine_gauges.items():
            gauge.set(float(getattr(counters, key)))
        if queries := counters.prefix_cache_queries:
            self.prefix_cache_hit_rate.set(counters.prefix_cache_hits / queries)
        if stats.expert_layers:
            self._update_expert_load(stats)

    def _update_expert_load(self, stats) -> None:
        """Per-layer and mean balancedness gauges, routed-token counter (MoE only)."""
        if self._expert_metrics is None:
            r = self.registry
            self._expert_metrics = (
                Gauge(
                    EXPERT_BALANCEDNESS,
                    "Expert load balancedness of an MoE layer: mean / max of the EP ranks' "
                    "routed tokens over the EPLB window (1 = balanced)",
                    ["model", "layer"], registry=r,
                ),
                Gauge(
                    EXPERT_BALANCEDNESS_MEAN,
                    "Expert load balancedness averaged over the MoE layers",
                    ["model"], registry=r,
                ),
                Counter(
                    EXPERT_ROUTED_TOKENS,
                    "Token copies routed to experts (tokens x top-k, summed over MoE layers)",
                    ["model"], registry=r,
                ),
            )  # fmt: skip
        per_layer, mean, routed = self._expert_metrics
        values = stats.expert_balancedness
        for layer, value in zip(stats.expert_layers, values, strict=True):
            per_layer.labels(model=self._model, layer=str(layer)).set(float(value))
        if values:
            mean.labels(model=self._model).set(sum(values) / len(values))
        self._advance_engine_counter(
            EXPERT_ROUTED_TOKENS,
            float(stats.expert_routed_tokens),
            routed.labels(model=self._model),
        )

    def _advance_engine_counter(self, key: str, total: float, counter) -> None:
        """Advance `counter` by the change of the engine's cumulative value `key`."""
        last = self._last_engine_counts.get(key, 0.0)
        # Below the last value: the engine restarted, and `total` counts from its start.
        delta = total - last if total >= last else total
        self._last_engine_counts[key] = total
        if delta > 0:
            counter.inc(delta)

    def serve(self, port: int, addr: str = "127.0.0.1", **tls) -> None:
        """Expose /metrics over HTTP on addr:port (a daemon thread); over HTTPS with
        `tls` (certfile, keyfile, client_cafile, client_auth_required: the arguments of
        prometheus_client.start_http_server; `frontend.auth.TlsFiles.metrics_kwargs`).

        Raises RuntimeError("metrics-port: cannot bind ADDR:PORT (...)") if the address
        cannot be bound (the port is busy, the address is not local).
        """
        try:
            start_http_server(port, addr=addr, registry=self.registry, **tls)
        except OSError as e:
            raise RuntimeError(f"metrics-port: cannot bind {addr}:{port} ({e})") from e

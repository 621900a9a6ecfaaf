"""The metric registry: every Prometheus metric jaxserve exports, defined in one place.

The frontend process owns the registry and the HTTP endpoint. It observes what it sees
itself (TTFT, inter-token latency, TPOT, end-to-end latency, tokens, finish reasons) and
copies the engine's gauges and counters from the `EngineStats` messages that the engine
sends through the detokenizer (`EngineStats.extra`, see `ENGINE_STAT_KEYS`).
No JAX here.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

# Latency buckets in seconds: sub-millisecond ITL on a GPU up to minute-long CPU requests.
_LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
)  # fmt: skip

# EngineStats.extra keys (EngineCore.counters()) exported 1:1 as gauges (name -> help).
# Monotonic engine counters travel as values, so they are gauges here (set, not inc).
ENGINE_STAT_KEYS = {
    "num_steps": "Engine steps since start",
    "num_preemptions": "Requests preempted (freed and recomputed) since start",
    "prefix_cache_queries": "Prompt tokens looked up in the prefix cache since start",
    "prefix_cache_hits": "Prompt tokens found in the prefix cache since start",
    "prefill_tokens": "Prefill tokens computed since start",
    "decode_tokens": "Decode tokens computed since start",
    "host_time_s": "Engine host time (schedule, prepare inputs, outputs) since start, s",
    "device_time_s": "Engine device time since start, s",
    "last_host_s": "Host time of the last engine step, s",
    "last_device_s": "Device time of the last engine step, s",
    "num_compilations": "XLA compilations after warm-up (should stay 0)",
    "coordination_time_s": "Multi-process step coordination (publishing steps) since start, s",
    "last_coordination_s": "Multi-process step coordination time of the last step, s",
}


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
        self.running = Gauge(
            "jaxserve_num_requests_running", "Requests running", ["model"], registry=r
        ).labels(**labels)
        self.waiting = Gauge(
            "jaxserve_num_requests_waiting", "Requests waiting", ["model"], registry=r
        ).labels(**labels)
        self.kv_blocks_free = Gauge(
            "jaxserve_kv_blocks_free", "Free KV cache blocks", ["model"], registry=r
        ).labels(**labels)
        self.engine = {
            key: Gauge(f"jaxserve_engine_{key}", doc, ["model"], registry=r).labels(**labels)
            for key, doc in ENGINE_STAT_KEYS.items()
        }
        self.prefix_cache_hit_rate = Gauge(
            "jaxserve_prefix_cache_hit_rate", "Prefix cache hits / queries over prompt tokens",
            ["model"], registry=r,
        ).labels(**labels)  # fmt: skip

    def request_finished(self, finish_reason: str) -> None:
        self._finished.labels(model=self._model, finish_reason=finish_reason).inc()

    def update_from_engine(self, stats) -> None:
        """Copy an `ipc.EngineStats` into the gauges (unknown extra keys are ignored)."""
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_blocks_free.set(stats.num_blocks_free)
        extra = stats.extra or {}
        for key, value in extra.items():
            if key in self.engine and value is not None:
                self.engine[key].set(float(value))
        if queries := extra.get("prefix_cache_queries"):
            self.prefix_cache_hit_rate.set(extra["prefix_cache_hits"] / queries)

    def serve(self, port: int, addr: str = "127.0.0.1") -> None:
        """Expose /metrics over HTTP on addr:port (a daemon thread)."""
        start_http_server(port, addr=addr, registry=self.registry)

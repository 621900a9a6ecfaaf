"""The metric registry: the Prometheus metrics jaxserve exports, on one registry.

The frontend process owns the registry and the HTTP endpoint. It observes what it sees
itself (TTFT, inter-token latency, TPOT, end-to-end latency, tokens, finish reasons) and
copies the engine's gauges, counters and histograms from the `EngineStats` messages that
the engine sends through the detokenizer (which field is which metric:
engine_metrics.py).

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

Layer metrics (issue 11), one per layer of the diagnosis tree (`observability.diagnose`):
- scheduling: `jaxserve_request_queue_time_seconds` (arrival to first schedule), a
  histogram kept in the engine (`ENGINE_HISTOGRAMS`, exported by a collector from the
  engine's cumulative bucket counts, `EngineStats.histograms`); prefill / decode tokens
  per step: the steps with each (`jaxserve_engine_{prefill,decode}_steps_total`, so
  rate(prefill_tokens) / rate(prefill_steps) is the mean) and the last step's
  (`jaxserve_engine_last_step_{prefill,decode}_tokens`); the engine loop's time blocked
  on its sockets versus working (`jaxserve_engine_loop_{wait,work}_seconds_total`);
- hardware / kernel: per step, bytes read and FLOPs estimated from its shapes over its
  time (`observability.step_cost`): `jaxserve_engine_mbu` / `jaxserve_engine_mfu` (the
  last step), `jaxserve_engine_model_{bytes,flops}_total` and
  `jaxserve_engine_step_seconds_total` (rate(bytes) / rate(seconds) / peak is the MBU of a
  window), and the peak they are measured against (`jaxserve_device_peak_*`,
  `observability.peaks`);
- memory: `jaxserve_kv_blocks_used` and its high-water mark `jaxserve_kv_blocks_used_max`;
- application: `jaxserve_detokenizer_lag_seconds` (engine sends a step's outputs -> their
  text reaches the frontend: the sidecar and both IPC hops) and
  `jaxserve_frontend_event_loop_lag_seconds` (`observability.loop_lag`: how late the
  frontend's event loop runs a timer, i.e. how long a ready client write waits);
- application, CPU (issue 17, `observability.process_cpu`):
  `jaxserve_process_cpu_seconds_total{process=...}`, the CPU seconds (user + system, all
  threads) of each serving process: "frontend" (this process, read at each scrape),
  "engine" and "detokenizer" (their own clocks, sent on the engine's stats; with several
  replicas, the sum over them, and each replica's as
  `jaxserve_replica_{engine,detokenizer}_cpu_seconds`, `router.metrics`), and
  `jaxserve_host_usable_cores`, the cores this process may run on
  (`os.sched_getaffinity`): rate(cpu) / cores is a process's share of the host; and
  `jaxserve_host_busy_cpu_seconds_total`, those cores' busy time, every process of the
  host included (Linux): what is not the serving processes' is another's (a client);
- router: the replica router's decision metrics register on this registry too (see
  `Metrics.registry`; none until replicas exist).
No JAX here.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from jaxserve.frontend.server_address import join_host_port
from jaxserve.observability.engine_metrics import (
    ENGINE_COUNTERS,
    ENGINE_GAUGES,
    EngineHistogramCollector,
)
from jaxserve.observability.process_cpu import ProcessCpu, host_busy_seconds, usable_cores
from jaxserve.observability.stats import LATENCY_BUCKETS_S, cumulative_increment

_LATENCY_BUCKETS = LATENCY_BUCKETS_S
# Event-loop lag: a healthy loop runs a timer within a millisecond.
_LOOP_LAG_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)

# Expert-load metric names (see the module docstring).
EXPERT_BALANCEDNESS = "jaxserve_expert_balancedness"
EXPERT_BALANCEDNESS_MEAN = "jaxserve_expert_balancedness_mean"
EXPERT_ROUTED_TOKENS = "jaxserve_expert_routed_tokens"
# The `limit` label values of jaxserve_requests_rejected_total: the admission limits
# (`frontend.admission.AdmissionError.limit`) and the HTTP connection cap.
REJECTED_LIMITS = ("requests", "queued_prompt_tokens", "bytes", "http_connections")


def observe_repeated(histogram, value: float, n: int) -> None:
    """Observe `value` n times into a prometheus_client Histogram (a labelled child):
    the same bucket counts and count as n `observe(value)` calls, and a sum larger by
    value * n (equal to n additions up to float rounding).

    Why: the frontend observes one inter-token latency per output token, all tokens of
    one stream message with the same gap; `observe` takes two locks and scans the bucket
    bounds in Python per call, and prometheus_client has no observe(value, n). Here it is
    one bisect (C) and two locked increments per message. Uses the Histogram child's
    `_upper_bounds`, `_buckets` and `_sum`, as `observe` itself does (prometheus_client
    0.x; tests/test_metrics.py checks the result against `observe` called n times).
    """
    if n <= 0:
        return
    if value != value:  # NaN: `observe` adds it to the sum and to no bucket
        histogram._sum.inc(value)
        return
    bucket = bisect.bisect_left(histogram._upper_bounds, value)  # first bound >= value
    histogram._sum.inc(value * n)
    histogram._buckets[bucket].inc(n)


class Metrics:
    """Prometheus metrics of one jaxserve server (one registry, so tests can make many)."""

    def __init__(
        self,
        model: str = "",
        cpu_clock: Callable[[], float] = time.process_time,
        host_clock: Callable[[], float | None] = host_busy_seconds,
    ) -> None:
        """cpu_clock: this process's CPU seconds (`jaxserve_process_cpu_seconds_total`
        of the frontend); host_clock: the host's busy CPU seconds
        (`jaxserve_host_busy_cpu_seconds_total`, None: unknown); a test passes its own."""
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
        self._finished_by_reason: dict[str, Counter] = {}  # finish_reason -> its child
        self._rejected = Counter(
            "jaxserve_requests_rejected",
            "Requests refused by admission control before the engine (gRPC "
            "RESOURCE_EXHAUSTED, HTTP 429; HTTP 503 server_busy at the connection cap), by "
            "limit: requests, queued_prompt_tokens, bytes or http_connections; a bad "
            "request (INVALID_ARGUMENT, HTTP 400) is not counted",
            ["model", "limit"], registry=r,
        )  # fmt: skip
        self._abandoned = Counter(
            "jaxserve_requests_abandoned",
            "Samples (n per request, as jaxserve_request_success counts them) whose client "
            "left before their end (reason: cancelled, deadline, refused, or slow_client: "
            "past --max-stream-buffer-bytes of output unread); the engine "
            "aborts them, and each is a finish_reason=\"abort\" of jaxserve_request_success",
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
        self.kv_blocks_used = Gauge(
            "jaxserve_kv_blocks_used", "KV cache blocks held by requests (total - free)",
            ["model"], registry=r,
        ).labels(**labels)  # fmt: skip
        self.detokenizer_lag = hist(
            "jaxserve_detokenizer_lag_seconds",
            "Engine sends a step's outputs -> their text reaches the frontend (sidecar + IPC)",
        )
        self.event_loop_lag = Histogram(
            "jaxserve_frontend_event_loop_lag_seconds",
            "How late the frontend's event loop runs a timer (observability.loop_lag)",
            labelnames=["model"], buckets=_LOOP_LAG_BUCKETS, registry=r,
        ).labels(**labels)  # fmt: skip
        self._engine_histograms = EngineHistogramCollector(model)
        r.register(self._engine_histograms)
        self._process_cpu = ProcessCpu(model, cpu_clock, host_clock)
        r.register(self._process_cpu)
        Gauge(
            "jaxserve_host_usable_cores", "CPU cores the frontend process may run on "
            "(os.sched_getaffinity): the host's cores the serving processes share",
            ["model"], registry=r,
        ).labels(**labels).set(usable_cores())  # fmt: skip
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
        # Expert-load metrics: registered by the first stats of an MoE model, as the
        # labelled children (per-layer gauge by layer, mean gauge, routed-token counter):
        # `labels()` builds and validates a label tuple under a lock on each call, every
        # stats message for every MoE layer otherwise.
        self._expert_metrics: tuple[Gauge, Gauge, Counter] | None = None
        self._expert_layer_gauges: dict[int, Gauge] = {}

    def request_rejected(self, limit: str) -> None:
        """One request (one API call) refused by admission control. limit: one of
        `REJECTED_LIMITS` (`AdmissionError.limit`, or "http_connections" for the HTTP
        connection cap, `frontend.http.server`). Raises ValueError for another value (the
        label set stays bounded)."""
        if limit not in REJECTED_LIMITS:
            raise ValueError(f"limit: {limit!r} is not one of {REJECTED_LIMITS}")
        self._rejected.labels(model=self._model, limit=limit).inc()

    def request_abandoned(self, reason: str, samples: int = 1) -> None:
        """`samples` unfinished samples of one request, left for `reason`."""
        self._abandoned.labels(model=self._model, reason=reason).inc(samples)

    def request_finished(self, finish_reason: str) -> None:
        # The labelled child per reason, kept: `labels()` takes a lock and builds the
        # label tuple on every call, once per finished request otherwise.
        child = self._finished_by_reason.get(finish_reason)
        if child is None:
            child = self._finished.labels(model=self._model, finish_reason=finish_reason)
            self._finished_by_reason[finish_reason] = child
        child.inc()

    def update_from_engine(self, stats) -> None:
        """Apply one `ipc.EngineStats`: set the gauges, advance the counters by the change
        of their cumulative values since the previous message (see the module docstring
        for a value that went down)."""
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_blocks_free.set(stats.num_blocks_free)
        self.kv_blocks_total.set(stats.num_blocks_total)
        self.kv_blocks_used.set(stats.num_blocks_total - stats.num_blocks_free)
        counters = stats.counters
        self._engine_histograms.update(stats.histograms)
        self._process_cpu.update(counters)
        for key, counter in self.engine_counters.items():
            self._advance_engine_counter(key, float(getattr(counters, key)), counter)
        for key, gauge in self.engine_gauges.items():
            gauge.set(float(getattr(counters, key)))
        if queries := counters.prefix_cache_queries:
            self.prefix_cache_hit_rate.set(counters.prefix_cache_hits / queries)
        if stats.expert_layers:
            self._update_expert_load(stats)

    def outputs_received(self, msg) -> None:
        """An `ipc.TextOutputs` reached the frontend: observe its detokenizer lag (an
        `AsyncEngineClient` outputs listener)."""
        if msg.engine_time:
            self.detokenizer_lag.observe(max(time.time() - msg.engine_time, 0.0))

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
            self._expert_metrics = (
                per_layer, mean.labels(model=self._model), routed.labels(model=self._model)
            )  # fmt: skip
        per_layer, mean, routed = self._expert_metrics
        gauges = self._expert_layer_gauges
        values = stats.expert_balancedness
        for layer, value in zip(stats.expert_layers, values, strict=True):
            gauge = gauges.get(layer)
            if gauge is None:
                gauge = gauges[layer] = per_layer.labels(model=self._model, layer=str(layer))
            gauge.set(float(value))
        if values:
            mean.set(sum(values) / len(values))
        self._advance_engine_counter(
            EXPERT_ROUTED_TOKENS, float(stats.expert_routed_tokens), routed
        )

    def _advance_engine_counter(self, key: str, total: float, counter) -> None:
        """Advance `counter` by the change of the engine's cumulative value `key`."""
        delta = cumulative_increment(total, self._last_engine_counts.get(key, 0.0))
        self._last_engine_counts[key] = total
        if delta > 0:
            counter.inc(delta)

    def serve(self, port: int, addr: str = "127.0.0.1", **tls) -> int:
        """Expose /metrics over HTTP on addr:port (a daemon thread); over HTTPS with
        `tls` (certfile, keyfile, client_cafile, client_auth_required: the arguments of
        prometheus_client.start_http_server; `frontend.auth.TlsFiles.metrics_kwargs`).
        Returns the port bound (port 0 picks a free one).

        Raises RuntimeError("metrics-port: cannot bind ADDR:PORT (...)") if the address
        cannot be bound (the port is busy, the address is not local).
        """
        try:
            server, _ = start_http_server(port, addr=addr, registry=self.registry, **tls)
        except OSError as e:
            raise RuntimeError(
                f"metrics-port: cannot bind {join_host_port(addr, port)} ({e})"
            ) from e
        return server.server_port

"""What the serving frontend logs about the running server: the effective configuration
once the engine is ready, then a periodic stats line, as vLLM's LoggingStatLogger does:

    Avg prompt throughput: 412.3 tokens/s, Avg generation throughput: 95.0 tokens/s,
    Running: 8 reqs, Waiting: 2 reqs, KV cache usage: 63.5%, Prefix cache hit rate: 41.0%,
    Preemptions: 0

Both are built from what the frontend already has: the configs it started the engine
with and the `ipc.EngineStats` messages the engine sends (`StatsLogger.update` is an
`AsyncEngineClient` stats listener; its `counters` are `observability.stats.EngineCounters`).
Throughputs are the change of the engine's
cumulative token counters over the interval: prompt tokens are the prefill tokens the
engine computed (prefix-cache hits excluded), generation tokens the decode tokens it
computed. The hit rate is over the prompt tokens looked up in the interval (the rate
since start when none were). A line is logged only when the interval saw work (or after
one that did, so that the last line shows the server idle again). Preemptions in an
interval also log a WARNING saying what to raise. No JAX here.
"""

from __future__ import annotations

import asyncio
import logging
import time

from jaxserve.config import EngineConfig, EplbConfig, ServerConfig
from jaxserve.frontend.server_address import join_host_port

logger = logging.getLogger("jaxserve.stats")

# vLLM's default interval (VLLM_LOG_STATS_INTERVAL).
DEFAULT_INTERVAL_S = 10.0

_COUNTERS = ("prefill_tokens", "decode_tokens", "prefix_cache_queries", "prefix_cache_hits")


class StatsLogger:
    """Turns the engine's stats into one line per interval.

    `update(stats)` records the latest `EngineStats`; `line(now)` returns the line for
    the interval since the previous call (None when there is nothing to say) and starts
    the next interval; `run(interval_s)` logs it every interval_s seconds.
    """

    def __init__(self, clock=time.monotonic) -> None:
        self._clock = clock
        self._stats = None
        self._last_counts: dict[str, float] = {}
        self._last_preemptions = 0.0
        self._last_time = clock()
        self._was_active = False

    def update(self, stats) -> None:
        self._stats = stats
        if not self._last_counts:  # the ready handshake: the base of the first interval
            self._last_counts = _counts(stats)
            self._last_preemptions = float(stats.counters.num_preemptions)

    def line(self, now: float | None = None) -> str | None:
        """The stats line of the interval ending `now` (seconds of `clock`), or None."""
        now = self._clock() if now is None else now
        stats = self._stats
        if stats is None:
            return None
        elapsed = max(now - self._last_time, 1e-9)
        counts = _counts(stats)
        delta = {k: counts[k] - self._last_counts.get(k, 0.0) for k in _COUNTERS}
        preemptions = float(stats.counters.num_preemptions)
        new_preemptions = int(preemptions - self._last_preemptions)
        self._last_counts, self._last_preemptions, self._last_time = counts, preemptions, now

        active = bool(
            delta["prefill_tokens"] or delta["decode_tokens"] or stats.num_running
            or stats.num_waiting
        )  # fmt: skip
        if not active and not self._was_active:
            return None
        self._was_active = active
        if new_preemptions > 0:
            logger.warning(
                "%d request(s) preempted in the last %.0f s: the KV cache was full, so their "
                "blocks were freed and they will be recomputed; give the KV cache more blocks "
                "(--num-blocks, --gpu-memory-utilization, a larger -tp) or admit fewer at once "
                "(--max-num-seqs, --max-num-batched-tokens)",
                new_preemptions, elapsed,
            )  # fmt: skip
        total = stats.num_blocks_total
        usage = 100.0 * (total - stats.num_blocks_free) / total if total else 0.0
        if delta["prefix_cache_queries"] > 0:
            hit_rate = 100.0 * delta["prefix_cache_hits"] / delta["prefix_cache_queries"]
        elif counts["prefix_cache_queries"] > 0:
            hit_rate = 100.0 * counts["prefix_cache_hits"] / counts["prefix_cache_queries"]
        else:
            hit_rate = 0.0
        return (
            f"Avg prompt throughput: {delta['prefill_tokens'] / elapsed:.1f} tokens/s, "
            f"Avg generation throughput: {delta['decode_tokens'] / elapsed:.1f} tokens/s, "
            f"Running: {stats.num_running} reqs, Waiting: {stats.num_waiting} reqs, "
            f"KV cache usage: {usage:.1f}%, Prefix cache hit rate: {hit_rate:.1f}%, "
            f"Preemptions: {max(new_preemptions, 0)}"
        )

    async def run(self, interval_s: float) -> None:
        """Log `line()` every interval_s seconds until cancelled."""
        self._last_time = self._clock()
        while True:
            await asyncio.sleep(interval_s)
            text = self.line()
            if text is not None:
                logger.info("%s", text)


def _counts(stats) -> dict[str, float]:
    return {k: float(getattr(stats.counters, k)) for k in _COUNTERS}


def config_block(
    engine: EngineConfig,
    server: ServerConfig,
    stats,
    grpc_port: int,
    replicas: str = "",
    tls: bool = False,
    http_port: int | None = None,
) -> str:
    """The effective configuration, one `key: value` per line, logged once at ready.

    stats: the engine's ready `EngineStats` (what it settled on: max_model_len, usable KV
    blocks); grpc_port: the port bound (the configured one may be 0). replicas: with the
    request router, a description of the replicas (then the KV numbers are the serving
    ones' sum so far, each replica's logged as it becomes ready); "" for one engine.
    tls: whether --tls-cert is on (the metrics and HTTP API ports then speak HTTPS only).
    http_port: the HTTP (OpenAI) API's bound port; None: no --http-port.
    """
    sc, cc, mesh, eplb = engine.scheduler, engine.cache, engine.mesh, engine.eplb
    scheme = "https" if tls else "http"
    metrics = (
        f"{scheme}://{join_host_port(server.host, server.metrics_port)}/metrics"
        if server.metrics_port is not None
        else "off (--metrics-port)"
    )
    rows = [
        ("model", f"{stats.model} ({engine.model})"),
        ("dtype", engine.dtype),
        (
            "mesh",
            f"dp={mesh.dp}, tp={mesh.tp} ({mesh.size} device(s); experts over all of them)",
        ),
        ("max_model_len", f"{stats.max_model_len} tokens"),
        (
            "KV cache",
            f"{stats.num_blocks_total} usable blocks x {stats.block_size} tokens = "
            f"{stats.num_blocks_total * stats.block_size} tokens"
            + (f" ({stats.num_blocks_total // mesh.dp} per dp rank)" if mesh.dp > 1 else "")
            + (" over the replicas serving now (GetServerInfo sums them)" if replicas else ""),
        ),
        *([("replicas", replicas)] if replicas else []),
        ("prefix caching", "on" if cc.enable_prefix_caching else "off"),
        (
            "scheduler",
            f"max_num_seqs={sc.max_num_seqs}, max_num_batched_tokens="
            f"{sc.max_num_batched_tokens}, chunked prefill "
            f"{'on' if sc.enable_chunked_prefill else 'off'}, async scheduling "
            f"{_async_scheduling(sc.async_scheduling, stats.async_scheduling)}, decode "
            f"steps per call {sc.num_decode_steps}, stream interval {sc.stream_interval} "
            "token(s)",
        ),
        ("EPLB", _eplb(eplb, mesh.size)),
        ("gRPC", join_host_port(server.host, grpc_port)),
        *(
            [("HTTP API", f"{scheme}://{join_host_port(server.host, http_port)}/v1")]
            if http_port is not None
            else []
        ),
        ("metrics", metrics),
        ("compilation cache", engine.compilation_cache_dir or "off"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k.ljust(width)}  {v}" for k, v in rows)


def _eplb(configured: EplbConfig, mesh_size: int) -> str:
    """The config block's EPLB: what the engine runs (`EplbConfig.for_mesh`, as
    `engine.builder.check_eplb`), and why it is off when it was asked for."""
    eplb = configured.for_mesh(mesh_size)
    redundant = f"{eplb.num_redundant_experts} redundant experts"
    if eplb.enabled:
        return (
            f"on (window {eplb.window_size} steps, every {eplb.step_interval} steps, {redundant})"
        )
    if eplb is not configured:
        return f"off (needs an expert-parallel mesh, dp*tp > 1; {redundant})"
    return f"off ({redundant})"


def _async_scheduling(configured: bool | None, resolved: bool | None) -> str:
    """The config block's async scheduling: what the engine resolved (its stats), and
    whether that was the backend's default (`config.resolve_async_scheduling`)."""
    value = configured if resolved is None else resolved
    if value is None:
        return "auto (on for an accelerator, off for the CPU)"
    return ("on" if value else "off") + (" (the backend's default)" if configured is None else "")

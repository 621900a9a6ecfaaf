"""The metrics copied from the engine's `EngineStats` messages
(`observability.stats.EngineCounters` and `EngineHistograms`): which field is exported
under which name and help, as a counter (`ENGINE_COUNTERS`, cumulative fields), a gauge
(`ENGINE_GAUGES`, the last step's values) or a histogram (`ENGINE_HISTOGRAMS`, exported
from the engine's cumulative bucket counts by `EngineHistogramCollector`). The registry
that holds them is `metrics.Metrics`. No JAX here.
"""

from __future__ import annotations

from prometheus_client.core import HistogramMetricFamily

from jaxserve.observability.stats import LATENCY_BUCKETS_S

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
    "loop_wait_s": (
        "jaxserve_engine_loop_wait_seconds", "Engine loop time blocked on its sockets (idle), s"
    ),
    "loop_work_s": (
        "jaxserve_engine_loop_work_seconds",
        "Engine loop time working (sockets drained, steps, outputs sent), s",
    ),
    "step_time_s": (
        "jaxserve_engine_step_seconds",
        "Dispatch-to-results time of the engine steps (an upper bound of device time), s",
    ),
    "model_bytes": (
        "jaxserve_engine_model_bytes", "Bytes the steps read (weights + KV), from their shapes"
    ),
    "model_flops": ("jaxserve_engine_model_flops", "FLOPs of the steps, from their shapes"),
    "prefill_steps": ("jaxserve_engine_prefill_steps", "Engine steps with prefill tokens"),
    "decode_steps": ("jaxserve_engine_decode_steps", "Engine steps with decode tokens"),
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
    "kv_blocks_used_max": (
        "jaxserve_kv_blocks_used_max", "High-water mark of KV blocks held by requests"
    ),
    "last_mbu": (
        "jaxserve_engine_mbu", "Model bandwidth utilisation of the last step (bytes/s / peak)"
    ),
    "last_mfu": ("jaxserve_engine_mfu", "Model FLOP utilisation of the last step (FLOP/s / peak)"),
    "peak_bandwidth": (
        "jaxserve_device_peak_bandwidth_bytes_per_second",
        "Memory bandwidth peak of the engine's devices, bytes per second (CPU: measured)",
    ),
    "peak_flops": (
        "jaxserve_device_peak_flops_per_second",
        "FLOP per second peak of the engine's devices at the compute dtype (CPU: measured)",
    ),
    "last_prefill_tokens": (
        "jaxserve_engine_last_step_prefill_tokens", "Prefill tokens of the last engine step"
    ),
    "last_decode_tokens": (
        "jaxserve_engine_last_step_decode_tokens", "Decode tokens of the last engine step"
    ),
    "warmup_pending_shapes": (
        "jaxserve_engine_warmup_pending_shapes",
        "Step shapes still compiling in the background after start-up (0: all compiled)",
    ),
}  # fmt: skip

# Histograms the engine keeps (`observability.stats.EngineHistograms`): name -> (counts
# field, sum field, bucket bounds, help).
ENGINE_HISTOGRAMS = {
    "jaxserve_request_queue_time_seconds": (
        "queue_time_counts", "queue_time_sum_s", LATENCY_BUCKETS_S,
        "Queue time: request arrival to its first scheduling in the engine, s",
    ),
}  # fmt: skip


class EngineHistogramCollector:
    """A prometheus_client collector of `ENGINE_HISTOGRAMS` from the engine's last
    cumulative counts; counts that go down (an engine restart) are added to a base."""

    def __init__(self, model: str) -> None:
        self._model = model
        self._last: dict[str, tuple[list[int], float]] = {}
        self._base: dict[str, tuple[list[int], float]] = {}

    def update(self, histograms) -> None:
        for name, (counts_key, sum_key, bounds, _) in ENGINE_HISTOGRAMS.items():
            counts = list(getattr(histograms, counts_key)) or [0] * (len(bounds) + 1)
            total = float(getattr(histograms, sum_key))
            last = self._last.get(name)
            if last is not None and sum(counts) < sum(last[0]):  # restarted: keep the old
                base = self._base.get(name, ([0] * len(counts), 0.0))
                self._base[name] = (
                    [a + b for a, b in zip(base[0], last[0], strict=True)],
                    base[1] + last[1],
                )
            self._last[name] = (counts, total)

    def collect(self):
        for name, (_, _, bounds, doc) in ENGINE_HISTOGRAMS.items():
            counts, total = self._last.get(name, ([0] * (len(bounds) + 1), 0.0))
            base = self._base.get(name)
            if base is not None:
                counts = [a + b for a, b in zip(counts, base[0], strict=True)]
                total += base[1]
            family = HistogramMetricFamily(name, doc, labels=["model"])
            cumulative, buckets = 0, []
            for le, n in zip([*map(str, bounds), "+Inf"], counts, strict=True):
                cumulative += n
                buckets.append((le, cumulative))
            family.add_metric([self._model], buckets, total)
            yield family

"""Typed stats records: what a process counts, as dataclasses that cross process
boundaries (msgpack, `jaxserve.ipc`) field by field.

`EngineCounters` is the engine core's: cumulative counters since its start (exported as
Prometheus counters, `engine_metrics.ENGINE_COUNTERS`), the last step's timings and
utilisation (gauges, `engine_metrics.ENGINE_GAUGES`). Every field has a metric: a new
field needs one there. `EngineHistograms` holds the histograms kept in the engine
(`engine_metrics.ENGINE_HISTOGRAMS`: per-bucket counts and a sum, cumulative, so that a
stats message the engine skips loses nothing); `Histogram` is the engine-side
accumulator of one.
No JAX here.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

# Latency buckets in seconds: sub-millisecond ITL on a GPU up to minute-long CPU requests.
LATENCY_BUCKETS_S = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
)  # fmt: skip


def cumulative_increment(total: float, last: float) -> float:
    """The increment of a process's cumulative counter from `last` to `total`: below
    `last`, the process restarted and `total` counts from its start, all of it new."""
    return total - last if total >= last else total


class Histogram:
    """A cumulative histogram over fixed upper bounds (Prometheus' `le` buckets).

    `counts[i]` is the number of observations in (bounds[i-1], bounds[i]] (not cumulative;
    the last entry counts those above bounds[-1]); `sum` is their total. O(log buckets)
    per observation.
    """

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value


@dataclass(slots=True)
class EngineCounters:
    """One engine core's counters (monotonic since its start) and last-step timings.

    num_steps: `EngineCore.step` calls.
    num_preemptions: requests preempted (KV blocks freed, recomputed later).
    prefix_cache_queries / prefix_cache_hits: prompt tokens looked up in / found in the
        prefix cache.
    prefill_tokens / decode_tokens: tokens computed in prefill chunks / decode rows.
    host_time_s: seconds the engine thread worked (scheduling, packing inputs,
        dispatching, turning tokens into outputs).
    device_time_s: seconds it waited for the device (without async scheduling, the
        device time of the steps; with it, the device time host work did not hide).
    coordination_time_s: seconds agreeing on steps with other processes (multi-process
        leader: publishing each step; 0 in one process).
    num_compilations: XLA compilations since start-up finished (0 when healthy).
    eplb_rebalances / eplb_rebalance_s: EPLB expert re-placements applied, and seconds
        spent moving weights for them (0 with EPLB off).
    last_host_s / last_device_s / last_coordination_s: the same times of the last step.
    step_agreement_s: multi-process leader: the slowest follower's median time from the
        leader's publish to its having the step's inputs (0 in one process).
    coordination_bytes: bytes the leader published to the followers (0 in one process).
    requests_expired: requests aborted because their client's deadline passed (set by
        the engine loop, `jaxserve.engine.control`, not the core).

    Layer metrics (issue 11; `observability.step_cost`, `observability.peaks`):
    loop_wait_s / loop_work_s: seconds the engine loop blocked on its sockets (idle, in
        poll) / spent on everything else (draining sockets, steps, sending outputs); set
        by the engine loop (`jaxserve.engine.process`), not the core.
    kv_blocks_used_max: high-water mark of KV blocks held by requests (all dp ranks).
    step_time_s: seconds from dispatching each step to its results on the host, summed:
        the device time of the steps, an upper bound (it also holds the host work the
        device waited behind), so the MBU/MFU below are lower bounds.
    model_bytes / model_flops: bytes the steps read (weights + KV cache) and FLOPs they
        did, estimated from their shapes (`step_cost.StepCostModel`), summed.
    last_mbu / last_mfu: the last step's model bandwidth / FLOP utilisation in [0, 1]:
        its bytes (FLOPs) over its step time over the peak.
    peak_bandwidth / peak_flops: that peak in bytes/s and FLOP/s (all devices of the
        mesh; on the CPU a ceiling measured at start-up), 0 when unknown (MBU/MFU stay 0).
    prefill_steps / decode_steps: steps that computed any prefill / decode tokens (so
        prefill_tokens / prefill_steps is the mean prefill tokens per such step).
    last_prefill_tokens / last_decode_tokens: those tokens of the last step dispatched.
    warmup_pending_shapes: step shapes still compiling in the background after start-up
        (`engine.warmup.WarmUp`; the step budget is held to the compiled ones until 0).

    CPU of the serving processes (issue 17; `process_cpu.PROCESS_CPU`, the CPU branches
    of `observability.diagnose`):
    process_cpu_s: CPU seconds (user + system, all threads) of the engine process since
        its start; set by the engine loop, not the core (multi-process: the leader's).
    detokenizer_cpu_s: the same of the detokenizer sidecar that forwarded these stats;
        set by the sidecar on the way (0 until it has).
    """

    num_steps: int = 0
    num_preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    host_time_s: float = 0.0
    device_time_s: float = 0.0
    coordination_time_s: float = 0.0
    num_compilations: int = 0
    eplb_rebalances: int = 0
    eplb_rebalance_s: float = 0.0
    last_host_s: float = 0.0
    last_device_s: float = 0.0
    last_coordination_s: float = 0.0
    requests_expired: int = 0
    step_agreement_s: float = 0.0
    coordination_bytes: int = 0
    loop_wait_s: float = 0.0
    loop_work_s: float = 0.0
    kv_blocks_used_max: int = 0
    step_time_s: float = 0.0
    model_bytes: float = 0.0
    model_flops: float = 0.0
    last_mbu: float = 0.0
    last_mfu: float = 0.0
    peak_bandwidth: float = 0.0
    peak_flops: float = 0.0
    prefill_steps: int = 0
    decode_steps: int = 0
    last_prefill_tokens: int = 0
    last_decode_tokens: int = 0
    warmup_pending_shapes: int = 0
    process_cpu_s: float = 0.0
    detokenizer_cpu_s: float = 0.0


@dataclass(slots=True)
class EngineHistograms:
    """Histograms the engine keeps (`EngineStats.histograms`), cumulative since its start,
    exported by `engine_metrics.ENGINE_HISTOGRAMS`.

    queue_time_counts / queue_time_sum_s: per-bucket counts (`Histogram.counts`, over
        `LATENCY_BUCKETS_S`) and total of the seconds from a request's arrival to its
        first scheduling; empty before the engine filled them.
    """

    queue_time_counts: list[int] = field(default_factory=list)
    queue_time_sum_s: float = 0.0

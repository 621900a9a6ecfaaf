"""Typed stats records: what a process counts, as dataclasses that cross process
boundaries (msgpack, `jaxserve.ipc`) field by field.

`EngineCounters` is the engine core's: cumulative counters since its start (exported as
Prometheus counters, `metrics.ENGINE_COUNTERS`) and the last step's timings (gauges,
`metrics.ENGINE_GAUGES`). Every field has a metric: a new field needs one there.
No JAX here.
"""

from __future__ import annotations

from dataclasses import dataclass


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

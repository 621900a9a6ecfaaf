"""What an `EngineCore` reports to the metrics layer: its `EngineStats` (facts, gauges,
the queue-time histogram, expert load) and `EngineCounters` (monotonic counters and
last-step timings), read from the core's scheduler, executor, runner and meters.

Reads only: nothing here changes the engine. `EngineCore.stats()` and
`EngineCore.counters()` are these functions; the metric each field becomes is
`observability.engine_metrics`'s.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from jaxserve.ipc import EngineStats
from jaxserve.observability.stats import EngineCounters, EngineHistograms

if TYPE_CHECKING:
    from jaxserve.engine.core import EngineCore
    from jaxserve.engine.model_runner import ModelRunner
    from jaxserve.observability.step_cost import StepMeter


def engine_stats(core: EngineCore) -> EngineStats:
    """Engine facts and gauges. Free blocks include cached blocks no request holds."""
    s, bms = core.scheduler, core.block_managers
    return EngineStats(
        model=core.config.served_model_name or Path(core.config.model).name,
        max_model_len=core.max_model_len,
        block_size=s.bm.block_size,
        num_blocks_total=sum(bm.num_usable_blocks for bm in bms),
        num_blocks_free=sum(bm.num_free_blocks for bm in bms),
        vocab_size=core.model_config.vocab_size,
        kv_bytes_per_token=core.runner.kv_bytes_per_token,
        kv_layout=core.runner.kv_layout.label,
        async_scheduling=core.async_scheduling,
        num_running=s.num_running,
        num_waiting=s.num_waiting,
        ready=True,
        counters=engine_counters(core),
        histograms=EngineHistograms(list(core.queue_time.counts), core.queue_time.sum),
        **expert_load_stats(core.runner),
    )


def expert_load_stats(runner: ModelRunner) -> dict:
    """The `EngineStats` expert-load fields: per MoE layer (decoder-layer index) the
    balancedness over the EP ranks in the recorder's window, and the routed tokens
    since start-up; {} for a model without MoE layers."""
    recorder = runner.expert_load
    if recorder is None:
        return {}
    return {
        "expert_layers": list(runner.moe_layers),
        "expert_balancedness": recorder.balancedness().tolist(),
        "expert_routed_tokens": recorder.total_routed_tokens(),
    }


def engine_counters(core: EngineCore) -> EngineCounters:
    """Monotonic counters and last-step timings, for the metrics layer."""
    s, ex, eplb = core.scheduler, core.executor, core.eplb
    return EngineCounters(
        num_steps=core.num_steps,
        num_preemptions=s.num_preemptions,
        prefix_cache_queries=s.num_prefix_queries,
        prefix_cache_hits=s.num_prefix_hits,
        prefill_tokens=s.num_prefill_tokens_computed,
        decode_tokens=s.num_decode_tokens_computed,
        host_time_s=core.host_time_s,
        device_time_s=core.device_time_s,
        coordination_time_s=ex.coordination_time_s,
        num_compilations=core.num_compilations,
        eplb_rebalances=0 if eplb is None else eplb.num_rebalances,
        eplb_rebalance_s=0.0 if eplb is None else eplb.rebalance_time_s,
        last_host_s=core.last_host_s,
        last_device_s=core.last_device_s,
        last_coordination_s=ex.last_coordination_s,
        step_agreement_s=ex.step_agreement_s,
        coordination_bytes=ex.coordination_bytes,
        warmup_pending_shapes=core.warmup.pending_shapes(),
        **layer_counters(core.step_meter, core.kv_blocks_used_max),
    )


def layer_counters(m: StepMeter, kv_blocks_used_max: int) -> dict:
    """The `EngineCounters` fields of the layer metrics (per-step tokens and cost,
    MBU / MFU, the KV high-water mark); see `observability.stats`."""
    return dict(
        kv_blocks_used_max=kv_blocks_used_max,
        step_time_s=m.step_time_s,
        model_bytes=m.model_bytes,
        model_flops=m.model_flops,
        last_mbu=m.last_mbu,
        last_mfu=m.last_mfu,
        peak_bandwidth=m.peak_bytes_per_s,
        peak_flops=m.peak_flops_per_s,
        prefill_steps=m.prefill_steps,
        decode_steps=m.decode_steps,
        last_prefill_tokens=m.last_prefill_tokens,
        last_decode_tokens=m.last_decode_tokens,
    )

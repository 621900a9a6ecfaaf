"""`jaxserve diagnose`'s tree over windows of a real metric registry: the step agreement
branch (issue 16 item 4), alone and ranked against the other branches.

A multi-process server whose step agreement is slow needs hosts apart (on one machine
the shared-memory ring keeps it at a few hundred us), so unlike the scenarios of
tests/test_diagnose_scenarios.py these windows are built from the engine's own records:
`EngineStats` / `EngineCounters` messages fed to `observability.metrics.Metrics` (what
the frontend does with the engine's stats), read back from its text exposition as
`diagnose` scrapes it. Oracles: the numbers put into the counters, and the thresholds
of `observability.diagnose`.
"""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest

from jaxserve.ipc import EngineStats
from jaxserve.observability.diagnose import (
    AGREEMENT_SHARE,
    Window,
    diagnose_window,
    parse_exposition,
)
from jaxserve.observability.metrics import Metrics
from jaxserve.observability.stats import LATENCY_BUCKETS_S, EngineCounters, EngineHistograms

AGREEMENT = "step agreement (CPU path between hosts)"
WINDOW_S = 10.0
STEPS = 1000
# The leader's loop over the window: 9.5 s working, so 9.5 ms of wall time per step.
STEP_WALL_S = 0.0095


def _leader(agreement_s: float, wait_s: float, publish_s: float = 0.2, **extra) -> EngineCounters:
    """Counters of a leader at the end of the window (it starts from zero)."""
    return EngineCounters(
        num_steps=STEPS, decode_steps=STEPS, decode_tokens=8 * STEPS,
        loop_work_s=STEP_WALL_S * STEPS, loop_wait_s=wait_s,
        host_time_s=1.0, device_time_s=8.0, step_time_s=9.0,
        coordination_time_s=publish_s, coordination_bytes=68_000 * STEPS,
        step_agreement_s=agreement_s, **extra,
    )  # fmt: skip


def _window(end: EngineCounters, frontend=None, **stats) -> Window:
    """The window between an engine at rest and `end`, as `diagnose.sample` sees it.
    `frontend(metrics)` observes the frontend's own histograms in the window."""
    metrics = Metrics(model="m")
    base = dict(num_blocks_total=64, num_blocks_free=60)
    metrics.update_from_engine(EngineStats(model="m", **base))
    first = parse_exposition(generate_latest(metrics.registry).decode())
    metrics.update_from_engine(EngineStats(model="m", counters=end, **{**base, **stats}))
    if frontend is not None:
        frontend(metrics)
    last = parse_exposition(generate_latest(metrics.registry).decode())
    peak = {k: max(first.get(k, v), v) for k, v in last.items()}
    return Window(first, last, peak, WINDOW_S)


def test_slow_step_agreement_is_the_suspect_not_the_device():
    """A saturated leader whose steps wait on the device with a low MBU reads as
    hardware / kernel on its own; with the followers 4 ms late on 9.5 ms steps the
    step agreement is named first, with its numbers, and the hardware comes after."""
    end = _leader(
        agreement_s=0.004, wait_s=0.5, model_bytes=1e6, model_flops=1e6,
        peak_bandwidth=1e12, peak_flops=1e15,
    )  # fmt: skip
    result = diagnose_window(_window(end), "test")
    assert [f.layer for f in result.findings] == [AGREEMENT, "hardware / kernel"]
    assert result.layer == AGREEMENT
    numbers = result.findings[0].numbers
    assert numbers["step_agreement_s"] == pytest.approx(0.004)
    assert numbers["step_wall_s"] == pytest.approx(STEP_WALL_S)
    assert numbers["agreement_share_of_step"] == pytest.approx(0.004 / STEP_WALL_S)
    assert numbers["publish_s_per_step"] == pytest.approx(0.2 / STEPS)
    assert numbers["step_message_bytes"] == pytest.approx(68_000)
    assert "JAXSERVE_STEP_TRANSPORT" in result.findings[0].next
    assert result.summary["step_agreement_s"] == pytest.approx(0.004)
    text = result.render()
    assert f"suspect: {AGREEMENT}" in text and "step_agreement_s 0.004" in text


@pytest.mark.parametrize(
    "agreement_s",
    [0.0, 0.0003, 0.99 * AGREEMENT_SHARE * STEP_WALL_S],
    ids=["one-process", "300us", "just-under-the-share"],
)
def test_fast_step_agreement_names_no_layer(agreement_s):
    """The same steps with a fast channel (0 in one process; the measured few hundred
    us; just under AGREEMENT_SHARE of the step) and a loop that keeps up: healthy."""
    result = diagnose_window(_window(_leader(agreement_s, wait_s=5.0)), "test")
    assert result.findings == [], result.render()
    # Several processes: the summary still shows it.
    assert result.summary.get("step_agreement_s", 0.0) == pytest.approx(agreement_s)
    assert ("step_agreement_s" in result.summary) == (agreement_s > 0)


def test_step_agreement_at_the_share_is_named():
    end = _leader(agreement_s=AGREEMENT_SHARE * STEP_WALL_S, wait_s=5.0)
    result = diagnose_window(_window(end), "test")
    assert [f.layer for f in result.findings] == [AGREEMENT]


def test_step_agreement_ranks_after_parallelism_and_before_queue_and_hardware():
    """Every branch that holds is a finding, in the tree's order: memory, application,
    parallelism, step agreement, queue, hardware."""
    queue_counts = [0] * (len(LATENCY_BUCKETS_S) + 1)
    queue_counts[LATENCY_BUCKETS_S.index(1.0)] = 10  # 10 requests queued ~0.8 s each
    end = _leader(
        agreement_s=0.004, wait_s=0.5, num_preemptions=3, model_bytes=1e6,
        model_flops=1e6, peak_bandwidth=1e12, peak_flops=1e15,
    )  # fmt: skip

    def frontend(metrics: Metrics) -> None:
        for _ in range(10):
            metrics.ttft.observe(1.0)
            metrics.tpot.observe(0.05)
            metrics.detokenizer_lag.observe(0.05)

    window = _window(
        end, frontend, num_waiting=6,
        histograms=EngineHistograms(queue_counts, 8.0),
        expert_layers=[0, 1], expert_balancedness=[0.5, 0.6], expert_routed_tokens=4000,
    )  # fmt: skip
    result = diagnose_window(window, "test")
    assert [f.layer for f in result.findings] == [
        "memory (KV cache)",
        "application (frontend / detokenizer)",
        "parallelism (expert load)",
        AGREEMENT,
        "scheduling (queue)",
        "hardware / kernel",
    ], result.render()


def test_kv_starvation_ranks_before_shapes_still_compiling():
    """Preemptions while shapes still compile in the background: memory is the suspect,
    start-up second (the pool's size is fixed at start; compiling does not fill it)."""
    end = _leader(agreement_s=0.0, wait_s=5.0, num_preemptions=26, warmup_pending_shapes=9)
    result = diagnose_window(_window(end), "test")
    layers = [f.layer for f in result.findings]
    assert layers[:2] == ["memory (KV cache)", "start-up (background compilation)"], layers
    assert result.findings[0].numbers["preemptions"] == 26
    assert result.findings[1].numbers["warmup_pending_shapes"] == 9

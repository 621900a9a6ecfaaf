"""`jaxserve.observability.metrics.Metrics` fed `EngineStats` messages: cumulative engine
counters are Prometheus counters (`_total`) that equal the engine's values, across an
engine restart;
last-step values and request counts stay gauges.

Values are read back through prometheus_client (the registry and the text exposition),
and the expected ones are worked out from the messages sent, not from Metrics.
"""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from jaxserve.ipc import EngineStats
from jaxserve.observability.engine_metrics import ENGINE_COUNTERS, ENGINE_GAUGES
from jaxserve.observability.metrics import Metrics
from jaxserve.observability.stats import EngineCounters

MODEL = "tiny"
LABELS = {"model": MODEL}


def _stats(
    running: int = 0, waiting: int = 0, free: int = 10, total: int = 16, **extra
) -> EngineStats:
    return EngineStats(
        model=MODEL,
        num_running=running,
        num_waiting=waiting,
        num_blocks_free=free,
        num_blocks_total=total,
        counters=EngineCounters(**extra),
    )


def _value(metrics: Metrics, name: str) -> float | None:
    return metrics.registry.get_sample_value(name, LABELS)


def _families(metrics: Metrics) -> dict[str, str]:
    """Metric family name -> type, from the text exposition a Prometheus server scrapes."""
    text = generate_latest(metrics.registry).decode()
    return {f.name: f.type for f in text_string_to_metric_families(text)}


def test_engine_counters_equal_the_last_cumulative_value():
    metrics = Metrics(model=MODEL)
    # Cumulative values of one engine over four steps (two equal messages: no change).
    sequence = [
        dict(num_preemptions=0, prefix_cache_queries=32, prefix_cache_hits=0, host_time_s=0.25),
        dict(num_preemptions=2, prefix_cache_queries=64, prefix_cache_hits=16, host_time_s=0.5),
        dict(num_preemptions=2, prefix_cache_queries=64, prefix_cache_hits=16, host_time_s=0.5),
        dict(num_preemptions=5, prefix_cache_queries=160, prefix_cache_hits=48, host_time_s=1.75),
    ]
    for extra in sequence:
        metrics.update_from_engine(_stats(**extra))
        assert _value(metrics, "jaxserve_num_preemptions_total") == extra["num_preemptions"]
        assert (
            _value(metrics, "jaxserve_prefix_cache_queries_total")
            == (extra["prefix_cache_queries"])
        )
        assert _value(metrics, "jaxserve_prefix_cache_hits_total") == extra["prefix_cache_hits"]
        assert _value(metrics, "jaxserve_engine_host_time_seconds_total") == pytest.approx(
            extra["host_time_s"]
        )
    last = sequence[-1]
    assert _value(metrics, "jaxserve_prefix_cache_hit_rate") == pytest.approx(
        last["prefix_cache_hits"] / last["prefix_cache_queries"]
    )


def test_engine_restart_counts_the_new_value_as_the_increment():
    metrics = Metrics(model=MODEL)
    metrics.update_from_engine(_stats(num_preemptions=7, num_steps=100))
    # A new engine counts from 0: its first value 3 is 3 more preemptions, not -4.
    metrics.update_from_engine(_stats(num_preemptions=3, num_steps=40))
    assert _value(metrics, "jaxserve_num_preemptions_total") == 7 + 3
    assert _value(metrics, "jaxserve_engine_steps_total") == 100 + 40
    metrics.update_from_engine(_stats(num_preemptions=4, num_steps=41))
    assert _value(metrics, "jaxserve_num_preemptions_total") == 7 + 4
    assert _value(metrics, "jaxserve_engine_steps_total") == 100 + 41


def test_gauges_follow_the_last_message():
    metrics = Metrics(model=MODEL)
    metrics.update_from_engine(_stats(running=3, waiting=2, free=5, total=12, last_host_s=0.5))
    metrics.update_from_engine(
        _stats(running=1, waiting=0, free=9, total=15, last_host_s=0.125, last_device_s=0.25)
    )
    assert _value(metrics, "jaxserve_num_requests_running") == 1
    assert _value(metrics, "jaxserve_num_requests_waiting") == 0
    assert _value(metrics, "jaxserve_kv_blocks_free") == 9
    assert _value(metrics, "jaxserve_kv_blocks_total") == 15
    assert _value(metrics, "jaxserve_engine_last_host_seconds") == 0.125
    assert _value(metrics, "jaxserve_engine_last_device_seconds") == 0.25


def test_exposition_names_and_types():
    metrics = Metrics(model=MODEL)
    metrics.update_from_engine(_stats(num_preemptions=1, prefix_cache_queries=8))
    families = _families(metrics)
    text = generate_latest(metrics.registry).decode()
    # vLLM's names for the same counters, with the jaxserve prefix.
    for name in (
        "jaxserve_num_preemptions",
        "jaxserve_prefix_cache_queries",
        "jaxserve_prefix_cache_hits",
    ):
        assert families[name] == "counter", name
        assert f'{name}_total{{model="{MODEL}"}}' in text
    for key, (name, _) in ENGINE_COUNTERS.items():
        assert families[name] == "counter", key
    for key, (name, _) in ENGINE_GAUGES.items():
        assert families[name] == "gauge", key
    for name in (
        "jaxserve_num_requests_running",
        "jaxserve_num_requests_waiting",
        "jaxserve_kv_blocks_free",
        "jaxserve_kv_blocks_total",
        "jaxserve_prefix_cache_hit_rate",
    ):
        assert families[name] == "gauge", name
    # No key is both.
    assert not set(ENGINE_COUNTERS) & set(ENGINE_GAUGES)


def test_time_metrics_are_named_in_seconds():
    """Prometheus' naming convention: a metric of a duration ends in its unit, `_seconds`
    (a counter's exposition adds `_total` after it). The engine's keys in seconds end
    in `_s`."""
    for key, (name, _) in {**ENGINE_COUNTERS, **ENGINE_GAUGES}.items():
        if key.endswith("_s"):
            assert name.endswith("_seconds"), (key, name)
    families = _families(Metrics(model=MODEL))
    for name, kind in families.items():
        if kind == "histogram":  # every histogram here is a latency
            assert name.endswith("_seconds"), name


def test_every_engine_counter_key_is_exported():
    """The fields of EngineCore.counters()'s record (`EngineCounters`, no engine built):
    each is a counter or a gauge here, or a process's CPU (`PROCESS_CPU`), so no engine
    value is silently dropped."""
    import dataclasses

    from jaxserve.observability.process_cpu import PROCESS_CPU

    keys = {f.name for f in dataclasses.fields(EngineCounters)}
    assert keys == set(ENGINE_COUNTERS) | set(ENGINE_GAUGES) | set(PROCESS_CPU)


def _moe_stats(layers: list[int], balancedness: list[float], routed: int) -> EngineStats:
    stats = _stats()
    stats.expert_layers, stats.expert_balancedness = layers, balancedness
    stats.expert_routed_tokens = routed
    return stats


def test_expert_balancedness_per_layer_mean_and_routed_tokens():
    """Per-layer gauges labelled by decoder layer, their mean over layers, and the routed
    tokens as a counter (across an engine restart), in the text exposition."""
    metrics = Metrics(model=MODEL)
    metrics.update_from_engine(_moe_stats([0, 2, 3], [1.0, 0.5, 0.75], routed=120))
    metrics.update_from_engine(_moe_stats([0, 2, 3], [0.25, 0.5, 0.6], routed=300))
    text = generate_latest(metrics.registry).decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert families["jaxserve_expert_balancedness"].type == "gauge"
    per_layer = {
        s.labels["layer"]: s.value for s in families["jaxserve_expert_balancedness"].samples
    }
    assert per_layer == {"0": 0.25, "2": 0.5, "3": 0.6}
    assert all(s.labels["model"] == MODEL for s in families["jaxserve_expert_balancedness"].samples)
    assert _value(metrics, "jaxserve_expert_balancedness_mean") == pytest.approx(
        (0.25 + 0.5 + 0.6) / 3
    )
    assert families["jaxserve_expert_routed_tokens"].type == "counter"
    assert _value(metrics, "jaxserve_expert_routed_tokens_total") == 300
    metrics.update_from_engine(_moe_stats([0, 2, 3], [1.0, 1.0, 1.0], routed=50))  # restart
    assert _value(metrics, "jaxserve_expert_routed_tokens_total") == 300 + 50


def test_dense_model_exports_no_expert_metrics():
    metrics = Metrics(model=MODEL)
    metrics.update_from_engine(_stats(num_steps=3))
    text = generate_latest(metrics.registry).decode()
    assert "jaxserve_expert" not in text


def _histogram_samples(hist) -> dict[str, float]:
    """A Histogram child's exported samples, {"_bucket{le=...}" | "_count" | "_sum": v}
    (not `_created`, a time)."""
    out = {}
    for sample in hist._child_samples():
        if sample.name == "_created":
            continue
        le = sample.labels.get("le")
        out[f"{sample.name}{{le={le}}}" if le else sample.name] = sample.value
    return out


@pytest.mark.parametrize(
    "observations",
    [
        [(0.003, 1)],
        [(0.003, 16), (0.0001, 4), (0.001, 3)],  # 0.001: on a bound (le is inclusive)
        [(0.02, 5), (7.5, 2), (500.0, 3), (-0.5, 2), (0.0, 1)],  # past the last bound
        [(0.05, 0), (float("nan"), 3), (0.2, 64)],
    ],
)
def test_observe_repeated_exports_what_observe_n_times_does(observations):
    """observe_repeated(h, v, n) leaves every bucket and the count as n `observe(v)`
    calls of prometheus_client do, and the sum equal up to float rounding."""
    from prometheus_client import CollectorRegistry, Histogram

    from jaxserve.observability.metrics import observe_repeated
    from jaxserve.observability.stats import LATENCY_BUCKETS_S

    def child():
        return Histogram(
            "h_seconds", "test", ["model"], buckets=LATENCY_BUCKETS_S,
            registry=CollectorRegistry(),
        ).labels(model=MODEL)  # fmt: skip

    one_by_one, batched = child(), child()
    for value, n in observations:
        for _ in range(n):
            one_by_one.observe(value)
        observe_repeated(batched, value, n)
    want, got = _histogram_samples(one_by_one), _histogram_samples(batched)
    assert set(got) == set(want)
    for key, value in want.items():
        if key == "_sum":
            assert got[key] == pytest.approx(value, rel=1e-12, nan_ok=True)
        else:
            assert got[key] == value, key


def test_requests_rejected_counts_by_limit_and_keeps_its_labels_bounded():
    metrics = Metrics(model=MODEL)
    metrics.request_rejected("requests")
    metrics.request_rejected("requests")
    metrics.request_rejected("http_connections")
    name = "jaxserve_requests_rejected_total"
    get = metrics.registry.get_sample_value
    assert get(name, {"model": MODEL, "limit": "requests"}) == 2
    assert get(name, {"model": MODEL, "limit": "http_connections"}) == 1
    assert get(name, {"model": MODEL, "limit": "bytes"}) is None
    with pytest.raises(ValueError, match="limit: 'max_tokens'"):
        metrics.request_rejected("max_tokens")


def test_request_timing_counts_one_itl_per_token_after_the_first(monkeypatch):
    """Deliveries of 3, 2 and 1 tokens (the first merged, as a slow reader gets them): the
    ITL histogram counts 5 = tokens - 1 gaps whatever the first delivery held (the two
    delivered with the first came 0 s after it), so the mean ITL equals the TPOT."""
    from jaxserve.ipc import TextOutput
    from jaxserve.observability import request_timing

    clock = iter([1.0, 1.5, 2.5])
    monkeypatch.setattr(request_timing.time, "perf_counter", lambda: next(clock))
    metrics = Metrics(model=MODEL)
    timing = request_timing.RequestTiming(metrics, start=0.5)
    timing.observe([TextOutput("r", "ab", [1, 2]), TextOutput("r", "c", [3])])
    timing.observe([TextOutput("r", "de", [4, 5])])
    timing.observe([TextOutput("r", "f", [6], "length", None, 4, 6)])
    itl = "jaxserve_inter_token_latency_seconds"
    assert _value(metrics, f"{itl}_count") == 5
    assert _value(metrics, f"{itl}_sum") == pytest.approx(0.5 + 1.0)
    assert _value(metrics, "jaxserve_time_to_first_token_seconds_sum") == pytest.approx(0.5)
    tpot = _value(metrics, "jaxserve_time_per_output_token_seconds_sum")
    assert tpot == pytest.approx((2.5 - 1.0) / 5) == _value(metrics, f"{itl}_sum") / 5

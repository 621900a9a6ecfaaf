"""Layer metrics (issue 11 part 2): step cost (bytes, FLOPs, MBU / MFU), queue time,
per-step tokens, the KV high-water mark, detokenizer and event-loop lag.

Independent references: the checkpoint's own tensors (the safetensors header) for the
weight bytes and the FLOPs of one token, the engine's allocated KV cache arrays for the
KV bytes per token, a wall clock around a sleep for queue time and loop lag, and the
block arithmetic of one request for the high-water mark.
"""

from __future__ import annotations

import asyncio
import json
import math
import struct
import time

import jax
import numpy as np
import pytest
from conftest import TINY_BLOCK_SIZE, swap_scheduler

from jaxserve.ipc import EngineRequest, TextOutputs
from jaxserve.observability.loop_lag import watch_loop_lag
from jaxserve.observability.metrics import Metrics
from jaxserve.observability.peaks import Peak, device_peak, mesh_peak
from jaxserve.observability.step_cost import StepCostModel, StepMeter, multi_pass_cost

_BYTES = {"F32": 4, "BF16": 2, "F16": 2}


def _tensors(model_dir) -> dict[str, tuple[list[int], int]]:
    """name -> (shape, bytes per element), read from the safetensors header."""
    raw = (model_dir / "model.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    header.pop("__metadata__", None)
    return {k: (v["shape"], _BYTES[v["dtype"]]) for k, v in header.items()}


def _model(model_dir) -> StepCostModel:
    from jaxserve.models.config import ModelConfig

    cfg = ModelConfig.from_hf(json.loads((model_dir / "config.json").read_text()))
    return StepCostModel(cfg, "float32")


def test_weight_bytes_equal_the_checkpoint(tiny_moe_dir):
    tensors = _tensors(tiny_moe_dir)
    on_disk = sum(math.prod(shape) * size for shape, size in tensors.values())
    assert _model(tiny_moe_dir).total_weight_bytes == on_disk


def test_flops_of_one_token_are_twice_its_active_weights(tiny_moe_dir):
    """One token at position 0: 2 FLOPs per weight it meets (attention projections, the
    gate, top-k experts, the LM head) plus attention's two products over one key."""
    tensors = _tensors(tiny_moe_dir)
    cfg = json.loads((tiny_moe_dir / "config.json").read_text())
    k, layers = cfg["num_experts_per_tok"], cfg["num_hidden_layers"]

    def size(name):
        return math.prod(tensors[name][0])

    active = size("lm_head.weight")
    for i in range(layers):
        p = f"model.layers.{i}."
        active += sum(size(f"{p}self_attn.{x}_proj.weight") for x in "qkvo")
        active += size(f"{p}mlp.gate.weight")
        active += k * sum(size(f"{p}mlp.experts.0.{x}_proj.weight") for x in ("gate", "up", "down"))
    attention = 4 * cfg["num_attention_heads"] * cfg["head_dim"] * layers
    assert _model(tiny_moe_dir).cost([(0, 1)]).flops == 2 * active + attention


def test_kv_bytes_per_token_equal_the_allocated_cache(tiny_engine):
    runner = tiny_engine.runner
    cache_bytes = sum(x.nbytes for x in jax.tree.leaves(runner.kv_cache))
    slots = tiny_engine.block_manager.num_blocks * TINY_BLOCK_SIZE
    model = StepCostModel(tiny_engine.model_config, tiny_engine.config.dtype)
    assert model.kv_bytes_per_token == cache_bytes / slots


def test_step_meter_utilisation_is_cost_over_time_over_peak(tiny_moe_dir):
    model = _model(tiny_moe_dir)
    clock = iter([10.0, 10.5])
    peak = Peak(1e9, {"float32": 1e12})
    meter = StepMeter(model, peak, "float32", clock=lambda: next(clock))

    class _Sched:  # one prefill row of 12 tokens
        num_steps = 1
        requests = [type("R", (), dict(start=0, num_tokens=12, samples=True,
                                       seq=type("S", (), dict(num_prompt_tokens=12))))]  # fmt: skip

    handle = object()
    meter.dispatched(handle, _Sched)
    meter.fetched(handle)
    cost = model.cost([(0, 12)])
    assert meter.step_time_s == pytest.approx(0.5)
    assert meter.last_mbu == pytest.approx(cost.bytes / 0.5 / 1e9)
    assert meter.last_mfu == pytest.approx(cost.flops / 0.5 / 1e12)
    assert (meter.prefill_steps, meter.decode_steps, meter.last_prefill_tokens) == (1, 0, 12)


@pytest.mark.parametrize("measured", [True, False])
def test_a_measured_peak_is_raised_by_a_faster_step(tiny_moe_dir, measured):
    """A measured (CPU) ceiling below a step's achieved rate is raised to it, so MFU
    stays <= 1; a data-sheet peak is kept (MFU > 1 then shows a wrong cost model)."""
    model = _model(tiny_moe_dir)
    cost = model.cost([(0, 12)])
    low = Peak(cost.bytes / 4.0, {"float32": cost.flops / 4.0}, measured=measured)  # 0.5 s
    clock = iter([10.0, 10.5, 20.0, 22.0])
    meter = StepMeter(model, low, "float32", clock=lambda: next(clock))

    class _Sched:  # one prefill row of 12 tokens
        num_steps = 1
        requests = [type("R", (), dict(start=0, num_tokens=12, samples=True,
                                       seq=type("S", (), dict(num_prompt_tokens=12))))]  # fmt: skip

    for _ in range(2):  # 0.5 s, then 2 s for the same work
        handle = object()
        meter.dispatched(handle, _Sched)
        meter.fetched(handle)
    if measured:
        assert meter.peak_flops_per_s == pytest.approx(cost.flops / 0.5)
        assert meter.peak_bytes_per_s == pytest.approx(cost.bytes / 0.5)
        assert meter.last_mfu == pytest.approx(0.25) and meter.last_mbu == pytest.approx(0.25)
    else:
        assert meter.peak_flops_per_s == cost.flops / 4.0
        assert meter.last_mfu == pytest.approx(2.0)


def test_peak_table():
    h200 = device_peak("NVIDIA H200")
    assert h200.bytes_per_s == 4.8e12 and h200.flops("bfloat16") == 989e12
    assert device_peak("NVIDIA H100 PCIe").bytes_per_s == 2.0e12
    assert device_peak("Some Future Chip") is None
    assert mesh_peak("NVIDIA H200", 8, "gpu").bytes_per_s == 8 * 4.8e12
    cpu = mesh_peak("cpu", 8, "cpu")  # measured once, not multiplied by emulated devices
    assert cpu is mesh_peak("cpu", 1, "cpu") and cpu.bytes_per_s > 0 and cpu.flops("float32") > 0
    assert cpu.measured and not h200.measured


def _value(metrics: Metrics, name: str) -> float:
    return metrics.registry.get_sample_value(name, {"model": metrics._model}) or 0.0


def test_engine_layer_metrics_of_one_request(tiny_engine):
    """One request, synchronous single-step decoding: queue time covers the sleep before
    its first step; its prefill is one step of its prompt, its decode N - 1 steps of one
    token; the bytes and FLOPs are those of exactly those passes; the KV high-water mark
    is its blocks."""
    prompt, n = list(range(3, 23)), 9  # 20 prompt tokens
    metrics = Metrics(model="tiny")
    with swap_scheduler(tiny_engine, async_scheduling=False, num_decode_steps=1):
        tiny_engine.kv_blocks_used_max = 0
        metrics.update_from_engine(tiny_engine.stats())
        # The engine's histograms are cumulative and the session engine served other tests.
        q_count0 = _value(metrics, "jaxserve_request_queue_time_seconds_count")
        q_sum0 = _value(metrics, "jaxserve_request_queue_time_seconds_sum")
        before = tiny_engine.counters()
        tiny_engine.add_request(
            EngineRequest("q", np.asarray(prompt, np.int32),
                          dict(temperature=0.0, max_tokens=n, ignore_eos=True)),
        )  # fmt: skip
        time.sleep(0.3)
        while tiny_engine.has_work():
            tiny_engine.step()
            metrics.update_from_engine(tiny_engine.stats())
        after = tiny_engine.counters()
    assert _value(metrics, "jaxserve_request_queue_time_seconds_count") - q_count0 == 1
    assert 0.3 <= _value(metrics, "jaxserve_request_queue_time_seconds_sum") - q_sum0 < 30
    assert after.prefill_steps - before.prefill_steps == 1
    assert after.decode_steps - before.decode_steps == n - 1
    assert after.last_decode_tokens == 1 and after.last_prefill_tokens == 0
    model = tiny_engine.step_meter.model
    p = len(prompt)
    passes = [model.cost([(0, p)])] + [model.cost([(p + i, 1)]) for i in range(n - 1)]
    assert after.model_bytes - before.model_bytes == pytest.approx(sum(c.bytes for c in passes))
    assert after.model_flops - before.model_flops == pytest.approx(sum(c.flops for c in passes))
    # Measured after each step: the most is after step n - 1 (the last one frees them),
    # which holds the K/V of the prompt and n - 2 tokens fed back.
    assert after.kv_blocks_used_max == math.ceil((p + n - 2) / TINY_BLOCK_SIZE)
    assert after.peak_bandwidth > 0 and 0 < after.last_mbu <= 1 and 0 < after.last_mfu <= 1
    assert _value(metrics, "jaxserve_engine_mbu") == after.last_mbu
    assert _value(metrics, "jaxserve_kv_blocks_used_max") == after.kv_blocks_used_max


def test_engine_histograms_survive_an_engine_restart():
    from jaxserve.ipc import EngineStats
    from jaxserve.observability.stats import EngineHistograms

    metrics = Metrics(model="m")
    for counts, total in (
        ([1, 0] + [0] * 17, 0.001),
        ([1, 2] + [0] * 17, 0.01),
        ([0, 1] + [0] * 17, 0.002),
    ):
        metrics.update_from_engine(EngineStats(histograms=EngineHistograms(counts, total)))
    # 3 observations before the restart, 1 after it.
    assert _value(metrics, "jaxserve_request_queue_time_seconds_count") == 4
    assert _value(metrics, "jaxserve_request_queue_time_seconds_sum") == pytest.approx(0.012)


def test_detokenizer_lag_is_engine_send_to_frontend_receive():
    metrics = Metrics(model="m")
    metrics.outputs_received(TextOutputs([], engine_time=time.time() - 0.25))
    metrics.outputs_received(TextOutputs([], engine_time=0.0))  # unknown: not observed
    assert _value(metrics, "jaxserve_detokenizer_lag_seconds_count") == 1
    assert 0.25 <= _value(metrics, "jaxserve_detokenizer_lag_seconds_sum") < 5


def test_event_loop_lag_sees_a_blocked_loop():
    lags: list[float] = []

    async def main():
        task = asyncio.create_task(watch_loop_lag(lags.append, interval_s=0.01))
        await asyncio.sleep(0.05)
        time.sleep(0.2)  # blocks the loop
        await asyncio.sleep(0.05)
        task.cancel()

    asyncio.run(main())
    assert max(lags) >= 0.15
    assert min(lags) < 0.1


class _SleepyCore:
    """EngineCore's loop interface: each request is 5 steps of 20 ms of work."""

    def __init__(self) -> None:
        self.steps_left = 0

    def add_request(self, req) -> None:
        self.steps_left += 5

    def abort_requests(self, ids) -> None:
        pass

    def has_work(self) -> bool:
        return self.steps_left > 0

    def step(self):
        time.sleep(0.02)
        self.steps_left -= 1
        return []

    def stats(self):
        from jaxserve.ipc import EngineStats

        return EngineStats(num_running=min(self.steps_left, 1))


def test_engine_loop_counts_socket_wait_and_work():
    """Idle 0.4 s (blocked in poll), then one request of 5 x 20 ms steps: the stats after
    the steps say the loop waited about the idle time and worked at least the steps."""
    import threading

    from engine_loop_sockets import loop_sockets

    from jaxserve.engine.process import EngineLoop
    from jaxserve.ipc import EngineStats, Shutdown, decode, encode

    with loop_sockets("metrics") as (to_loop, loop_in, loop_out, from_loop):
        loop = EngineLoop(_SleepyCore(), loop_in, loop_out)
        thread = threading.Thread(target=loop.run)
        start = time.perf_counter()
        thread.start()
        time.sleep(0.4)
        to_loop.send(encode(EngineRequest("r", np.asarray([1], np.int32), {})))
        time.sleep(0.3)
        to_loop.send(encode(Shutdown("test")))
        thread.join(10)
        elapsed = time.perf_counter() - start
        stats = [m for m in map(decode, iter_frames(from_loop)) if isinstance(m, EngineStats)]
    last = stats[-1].counters
    assert 0.35 <= last.loop_wait_s <= elapsed
    assert last.loop_work_s >= 5 * 0.02
    assert last.loop_wait_s + last.loop_work_s <= elapsed


def iter_frames(sock):
    import zmq

    while True:
        try:
            yield sock.recv(zmq.NOBLOCK)
        except zmq.Again:
            return


def test_multi_pass_cost_is_the_sum_of_its_passes(tiny_moe_dir):
    """`multi_pass_cost` (closed form from two passes) equals the sum of `cost` over
    every pass, each decode pass one position later, at 1, 2, 3 and 16 passes."""
    model = _model(tiny_moe_dir)
    rows = [(0, 7), (30, 1), (5, 1), (100, 1)]
    for passes in (1, 2, 3, 16):
        got = multi_pass_cost(model, rows, passes)
        parts = [model.cost(rows)] + [
            model.cost([(s + q + p - 1, 1) for s, q in rows]) for p in range(1, passes)
        ]
        for field in ("weight_bytes", "kv_bytes", "flops"):
            expected = sum(getattr(c, field) for c in parts)
            assert getattr(got, field) == pytest.approx(expected, rel=1e-12)


def test_engine_peak_is_measured_before_any_step_compiles(tiny_engine_config, monkeypatch):
    """build_engine takes the mesh's peak before the warm-up starts compiling: on the CPU
    the peak is measured, and beside the compile threads it came out up to 10x low."""
    from jaxserve.engine import builder

    calls: list[str] = []

    class _Stop(Exception):
        pass

    def peak(mesh):
        calls.append("peak")
        return None

    def start(self):
        calls.append("warm-up")
        raise _Stop  # nothing to compile: the order is all this test needs

    monkeypatch.setattr(builder, "engine_peak", peak)
    monkeypatch.setattr(builder.WarmUp, "start", start)
    with pytest.raises(_Stop):
        builder.build_engine(tiny_engine_config)
    assert calls == ["peak", "warm-up"]

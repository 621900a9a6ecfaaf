"""Start-up compilation in tiers (jaxserve/engine/warmup.py): the first tier is the
smallest bucket's two steps; with background compilation the engine serves at once,
under the budget of what is compiled, and no step ever waits on a compilation."""

from __future__ import annotations

import dataclasses
import random
import threading

import pytest
from conftest import TINY_NUM_BLOCKS
from engine_helpers import assert_idle, greedy, random_prompts, run_engine

from jaxserve.engine.warmup import WarmUp, warmup_tiers


def test_tiers_cover_every_shape_once_smallest_first(tiny_engine):
    runner = tiny_engine.runner
    tiers = warmup_tiers(runner)
    flat = [s for _, shapes in tiers for s in shapes]
    assert sorted(flat) == sorted(runner.buckets()) and len(flat) == len(set(flat))
    t0, first = tiers[0]
    assert t0 == runner.token_buckets[0]
    assert {(s.num_tokens, s.num_steps) for s in first} == {(t0, 1)} and len(first) == 2
    # A tier of T only holds shapes that steps of <= T tokens use.
    for t, shapes in tiers:
        assert all(s.num_tokens <= t for s in shapes)
    assert [t for t, _ in tiers] == sorted(t for t, _ in tiers)


@pytest.fixture
def gated_background(monkeypatch):
    """Background compilation that starts only when the test sets the event."""
    gate = threading.Event()
    original = WarmUp._compile_rest

    def gated(self):
        assert gate.wait(600)
        original(self)

    monkeypatch.setattr(WarmUp, "_compile_rest", gated)
    return gate


def test_background_compile_serves_under_the_compiled_budget(
    tiny_engine, tiny_engine_config, gated_background
):
    from jaxserve.engine.core import EngineCore

    # One KV block more than the session's engine: every step executable differs from
    # the ones it wrote to the session's persistent compilation cache, so this engine's
    # background thread compiles instead of deserializing them. Two full-suite runs
    # (never this file alone) segfaulted inside jax's cache read
    # (compilation_cache.get_executable_and_time) in exactly that thread, here; the
    # cause is not found (see the closing note of session 5).
    cache = dataclasses.replace(tiny_engine_config.cache, num_blocks=TINY_NUM_BLOCKS + 1)
    config = dataclasses.replace(tiny_engine_config, background_compile=True, cache=cache)
    engine = EngineCore(config)
    warmup, runner = engine.warmup, engine.runner
    t0 = runner.token_buckets[0]
    assert not warmup.done.is_set()
    compiled = [s for s in runner.buckets() if runner.compiler.is_compiled(s)]
    assert sorted(compiled) == sorted(warmup_tiers(runner)[0][1])
    assert warmup.budget() == (t0, min(t0, config.scheduler.max_num_seqs), 1)

    rng = random.Random(5)
    vocab = engine.model_config.vocab_size
    prompts = random_prompts(rng, 6, 20, 50, vocab)  # longer than the first bucket
    reqs = [(f"g{i}", p, greedy(12)) for i, p in enumerate(prompts)]
    reqs.append(("pen", prompts[0], greedy(8, repetition_penalty=1.3)))
    reqs.append(("lp", prompts[1], greedy(4, prompt_logprobs=2, logprobs=2)))
    steps = []
    before = engine.num_compilations
    got = run_engine(engine, reqs, on_step=lambda _: steps.append(engine.scheduler.max_num_seqs))
    assert engine.scheduler.max_num_batched_tokens == t0 and set(steps) == {min(t0, 8)}
    assert runner.compiler.num_compile_waits == 0 and engine.num_compilations == before
    # The same greedy tokens as the fully compiled engine.
    want = run_engine(tiny_engine, reqs)
    for rid, _, _ in reqs:
        assert got[rid].error is None and got[rid].tokens == want[rid].tokens, rid
    assert_idle(engine)

    gated_background.set()
    assert warmup.wait(600) and warmup.error is None
    assert all(runner.compiler.is_compiled(s) for s in runner.buckets())
    sc = config.scheduler
    assert (engine.scheduler.max_num_batched_tokens, engine.scheduler.max_num_seqs) == (
        sc.max_num_batched_tokens,
        sc.max_num_seqs,
    )
    assert engine.scheduler.num_decode_steps == sc.num_decode_steps
    # The idle engine loop runs each background-compiled shape once, one per call.
    ran, before_s = 0, warmup.first_run_s
    while engine.idle_work():
        ran += 1
    background = len(runner.buckets()) - len(warmup_tiers(runner)[0][1])
    assert ran == background - 1 and warmup.first_run_s > before_s
    assert not engine.idle_work()
    again = run_engine(engine, reqs[:3])
    for rid, _, _ in reqs[:3]:
        assert again[rid].tokens == want[rid].tokens, rid
    assert runner.compiler.num_compile_waits == 0 and engine.num_compilations == before
    assert_idle(engine)


def test_moe_calibration_stops_at_the_first_count_the_replicated_path_loses(monkeypatch):
    """Start-up time on a mesh: the counts above the crossover cannot raise the threshold,
    so one process does not time them; the threshold is the one of every count."""
    from jaxserve.sharding import ep_calibration, moe_ep

    timings = {8: (5.0, 1.0), 16: (5.0, 2.0), 32: (5.0, 6.0), 64: (5.0, 4.0), 128: (5.0, 9.0)}
    timed = []

    def fake(mesh, num_tokens, *args, **kwargs):
        timed.append(num_tokens)
        a2a, rep = timings[num_tokens]
        return {moe_ep.ALL_TO_ALL: a2a, moe_ep.REPLICATED: rep}

    monkeypatch.setattr(ep_calibration, "time_moe_paths", fake)

    class Mesh:
        shape = {"dp": 2, "tp": 1}

    got = ep_calibration.measure_replicated_max_tokens(Mesh(), sorted(timings), 8, 8, 4, 2)
    assert got == ep_calibration.replicated_threshold(timings) == 16
    assert timed == [8, 16, 32]


def test_first_runs_on_padding_leave_every_kv_block_of_a_request_as_it_was(tiny_engine):
    """`ModelRunner.run_once` (what `WarmUp.start` runs on the shapes it compiles) runs
    every shape on all-padding inputs: it may touch the null block (block 0), never a
    block a request can hold. Checked on a cache filled with random values, restored after."""
    import jax
    import numpy as np

    runner = tiny_engine.runner
    assert tiny_engine.warmup.first_run_s > 0  # the offline engine ran its shapes at start
    saved = runner.kv_cache
    rng = np.random.default_rng(0)
    filled = [
        tuple(jax.device_put(rng.standard_normal(a.shape, np.float32), a.sharding) for a in kv)
        for kv in saved
    ]
    expected = [tuple(np.asarray(a)[1:] for a in kv) for kv in filled]
    runner.kv_cache = filled
    try:
        assert runner.run_once(runner.buckets()) > 0
        for layer, kv in enumerate(runner.kv_cache):
            for a, want in zip(kv, expected[layer], strict=True):
                np.testing.assert_array_equal(np.asarray(a)[1:], want)
    finally:
        runner.kv_cache = saved
    assert_idle(tiny_engine)

"""Engine depth on the tiny random Qwen3-MoE: prompt log-probs, n samples sharing the
prompt's KV blocks, async scheduling and multi-step decode, each against an independent
reference (HF transformers' logits, the block count of separate prompts, the engine with
the feature off).

One compiled engine serves every test (tests/conftest.py); tests leave it idle.
"""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest
from conftest import TINY_BLOCK_SIZE, TINY_MAX_MODEL_LEN, swap_scheduler
from engine_helpers import assert_idle, greedy, random_prompts, run_engine
from model_utils import hf_logits

from jaxserve.ipc import EngineRequest

pytestmark = pytest.mark.slow


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def assert_prompt_logprobs(entries: list, prompt: list[int], k: int, hf_model) -> None:
    """entries (the engine's prompt_logprobs) against a log-softmax of HF's logits: the
    log-prob of each next prompt token, and the k largest log-probs with their ids."""
    expected = log_softmax(hf_logits(hf_model, prompt))  # row j predicts prompt[j + 1]
    assert len(entries) == len(prompt) and entries[0] is None
    for j in range(1, len(prompt)):
        logprob, top = entries[j]
        assert logprob == pytest.approx(expected[j - 1, prompt[j]], abs=1e-4), j
        assert len(top) == k
        np.testing.assert_allclose(
            [lp for _, lp in top], np.sort(expected[j - 1])[::-1][:k], atol=1e-4
        )
        for token_id, lp in top:  # each id carries its own log-prob (robust to near ties)
            assert lp == pytest.approx(expected[j - 1, token_id], abs=1e-4)


# ----- prompt log-probs ---------------------------------------------------------------------


def test_prompt_logprobs_equal_log_softmax_of_model_logits(tiny_engine, hf_model):
    rng = random.Random(20)
    vocab = tiny_engine.model_config.vocab_size
    long_prompt = [rng.randrange(vocab) for _ in range(150)]  # 3 chunks of the 64-token budget
    short, plain, penalized = random_prompts(rng, 3, 5, 30, vocab)
    # The long prompt's blocks are in the prefix cache: a request that wants prompt
    # log-probs must compute them anyway.
    ref = run_engine(tiny_engine, [("warm", long_prompt, greedy(3))])["warm"].tokens
    before = tiny_engine.num_compilations
    r = run_engine(
        tiny_engine,
        [
            ("long", long_prompt, greedy(3, prompt_logprobs=5)),
            ("short", short, dict(temperature=1.0, seed=3, max_tokens=4, prompt_logprobs=0)),
            ("plain", plain, greedy(5)),
            ("penalized", penalized, greedy(5, repetition_penalty=1.3, prompt_logprobs=2)),
        ],
    )
    assert tiny_engine.num_compilations == before
    assert r["long"].tokens == ref  # asking for prompt log-probs changes no output
    for rid, prompt, k in (
        ("long", long_prompt, 5),
        ("short", short, 0),
        ("penalized", penalized, 2),
    ):
        carrying = [o for o in r[rid].outputs if o.prompt_logprobs is not None]
        assert len(carrying) == 1 and carrying[0].new_token_ids, rid
        assert carrying[0] is next(o for o in r[rid].outputs if o.new_token_ids)
        assert_prompt_logprobs(carrying[0].prompt_logprobs, prompt, k, hf_model)
    assert all(o.prompt_logprobs is None for o in r["plain"].outputs)
    assert_idle(tiny_engine)


def test_llm_returns_prompt_logprobs(tiny_engine, tiny_moe_dir, hf_model):
    from jaxserve import SamplingParams
    from jaxserve.llm import LLM

    llm = LLM.from_engine(tiny_engine, tokenizer=tiny_moe_dir)
    prompt = [7, 1, 99, 4, 12, 3]
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=3, n=2)
    out = llm.generate([prompt, [5, 6]], [params, SamplingParams(max_tokens=2)])
    assert_prompt_logprobs(out[0].prompt_logprobs, prompt, 3, hf_model)
    assert out[1].prompt_logprobs is None


# ----- n samples share the prompt's blocks --------------------------------------------------


class BlockSpy:
    """An EngineCore stand-in for `LLM` that records, after every step, the block tables
    of the running sequences (as tuples) and the ref count of every block."""

    def __init__(self, engine):
        self._engine = engine
        self.snapshots: list[tuple[list[tuple[int, ...]], list[int]]] = []

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def step(self):
        outs = self._engine.step()
        sched = self._engine.scheduler
        tables = [tuple(s.block_table) for s in sched.running]
        self.snapshots.append((tables, list(sched.bm.ref_counts)))
        return outs


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_n_samples_share_the_prompt_blocks(tiny_engine, tiny_moe_dir, prefix_caching):
    from jaxserve import SamplingParams
    from jaxserve.llm import LLM

    n, bs, max_tokens = 4, TINY_BLOCK_SIZE, 8
    prompt_len = 5 * bs + 3  # 5 full blocks, then a partial one
    full = (prompt_len - 1) // bs  # prompt blocks a sample can share (one token stays to compute)
    per_sample = -(-(prompt_len + max_tokens - 1) // bs)  # blocks one sample holds at the end
    rng = random.Random(21)
    vocab = tiny_engine.model_config.vocab_size
    prompts = random_prompts(rng, n, prompt_len, prompt_len, vocab)
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=max_tokens, ignore_eos=True)

    def run(prompt_list, sampling):
        with swap_scheduler(tiny_engine, enable_prefix_caching=prefix_caching):
            spy = BlockSpy(tiny_engine)
            llm = LLM.from_engine(spy, tokenizer=tiny_moe_dir)
            outs = llm.generate(prompt_list, sampling)
        return outs, spy.snapshots

    shared_outs, shared = run([prompts[0]], dataclasses.replace(params, n=n))
    separate_outs, separate = run(prompts, params)

    def blocks_in_use(tables):
        return len({b for t in tables for b in t})

    all_running = [(t, refs) for t, refs in shared if len(t) == n]
    assert all_running, "the n samples never ran together"
    for tables, refs in all_running:
        assert len({t[:full] for t in tables}) == 1  # one copy of the prompt's full blocks
        assert all(refs[b] == n for b in tables[0][:full])
        assert blocks_in_use(tables) == sum(map(len, tables)) - (n - 1) * full
    for tables, _ in separate:
        assert blocks_in_use(tables) == sum(map(len, tables))  # nothing shared
    peak_shared = max(blocks_in_use(t) for t, _ in shared)
    peak_separate = max(blocks_in_use(t) for t, _ in separate)
    # n samples hold the prompt's full blocks once, and one tail each.
    assert peak_shared == full + n * (per_sample - full)
    assert peak_separate > peak_shared
    assert [len(o.token_ids) for o in shared_outs[0].outputs] == [max_tokens] * n
    assert all(len(o.token_ids) == max_tokens for o in separate_outs)
    assert_idle(tiny_engine)


def test_request_cache_group_shares_the_prompt_blocks(tiny_engine):
    """EngineRequest.cache_group (set by the gRPC frontend for the n samples of one
    request) shares the prompt's blocks with prefix caching off, as `LLM`'s n does."""
    n, bs = 3, TINY_BLOCK_SIZE
    vocab = tiny_engine.model_config.vocab_size
    prompt = np.asarray(random_prompts(random.Random(8), 1, 3 * bs + 1, 3 * bs + 1, vocab)[0])

    def max_ref_count(group):
        peak = 0

        def watch(_outs):
            nonlocal peak
            peak = max(peak, max(tiny_engine.scheduler.bm.ref_counts))

        with swap_scheduler(tiny_engine, enable_prefix_caching=False):
            for i in range(n):
                sampling = dict(temperature=1.0, seed=i, max_tokens=4)
                tiny_engine.add_request(
                    EngineRequest(f"g{i}", prompt.astype(np.int32), sampling, cache_group=group)
                )
            run_engine(tiny_engine, [], on_step=watch)
        assert_idle(tiny_engine)
        return peak

    assert max_ref_count("g") == n  # the prompt's full blocks are held once, by all n
    assert max_ref_count(None) == 1  # without a group nothing is shared


# ----- async scheduling and multi-step decode -----------------------------------------------

# (async_scheduling, num_decode_steps)
MODES = [(False, 1), (True, 1), (False, 4), (True, 4)]


def record_decisions(scheduler) -> list:
    """Make `scheduler.schedule` record every decision it returns."""
    decisions = []
    schedule = scheduler.schedule

    def recording():
        decisions.append(schedule())
        return decisions[-1]

    scheduler.schedule = recording
    return decisions


def test_async_and_multi_step_give_the_same_outputs(tiny_engine):
    """Greedy and seeded requests, penalties, log-probs, stop tokens, EOS and length
    limits give the same tokens, finish reasons and log-probs with async scheduling and
    multi-step decode on and off; stops inside a multi-step chunk end the request there."""
    rng = random.Random(22)
    vocab = tiny_engine.model_config.vocab_size
    shared = [rng.randrange(vocab) for _ in range(2 * TINY_BLOCK_SIZE)]
    prompts = [shared + p for p in random_prompts(rng, 6, 1, 20, vocab)]
    prompts += random_prompts(rng, 6, 1, 40, vocab)
    samplings = [
        greedy(rng.randint(1, 30)) if i % 3 == 0 else
        dict(temperature=rng.choice([0.7, 1.0]), seed=100 + i, max_tokens=rng.randint(1, 30))
        for i in range(len(prompts))
    ]  # fmt: skip
    samplings[1]["logprobs"] = 3
    samplings[2]["repetition_penalty"] = 1.2  # single-step only: mixes into multi-step runs
    samplings[4]["top_k"] = 5
    requests = [(f"r{i}", p, s) for i, (p, s) in enumerate(zip(prompts, samplings, strict=True))]
    with swap_scheduler(tiny_engine, async_scheduling=False, num_decode_steps=1):
        ref = run_engine(tiny_engine, requests)
    # Stop on a token each request produces (some inside a 4-step chunk), and declare an
    # EOS that two requests produce.
    for (rid, _, sampling), i in zip(requests, range(len(requests)), strict=True):
        tokens = ref[rid].tokens
        if i % 2 and len(tokens) > 3:
            sampling["stop_token_ids"] = [tokens[rng.randrange(1, len(tokens))]]
    eos = ref["r0"].tokens[-1]

    before = tiny_engine.num_compilations
    runs = {}
    for overlap, steps in MODES:
        with swap_scheduler(tiny_engine, async_scheduling=overlap, num_decode_steps=steps) as s:
            s.eos_token_ids = frozenset({eos})
            used = record_decisions(s)
            r = run_engine(tiny_engine, requests)
        # Multi-step decode did run (with each row bucket's compiled step count: more for
        # few rows on the CPU), or did not with 1.
        multi = {out.num_steps for out in used if out.num_steps > 1}
        compiled = {sh.num_steps for sh in tiny_engine.runner.buckets() if sh.num_steps > 1}
        assert (bool(multi), multi <= compiled) == (steps > 1, True), (multi, compiled)
        runs[overlap, steps] = r
        for rid, _, sampling in requests:
            tokens, expected = r[rid].tokens, ref[rid].tokens
            stops = [t for t in expected if t in sampling.get("stop_token_ids", ()) or t == eos]
            cut = expected.index(stops[0]) + 1 if stops else len(expected)
            assert tokens == expected[:cut], (rid, overlap, steps)
            assert r[rid].finish_reason == ("stop" if stops else "length")
    base = runs[False, 1]
    for mode, r in runs.items():
        logprobs = [e for o in r["r1"].outputs for e in o.logprobs or ()]
        base_logprobs = [e for o in base["r1"].outputs for e in o.logprobs or ()]
        assert len(logprobs) == len(r["r1"].tokens) == len(base_logprobs), mode
        for (lp, top), (base_lp, base_top) in zip(logprobs, base_logprobs, strict=True):
            assert lp == pytest.approx(base_lp, abs=1e-5)
            assert [i for i, _ in top] == [i for i, _ in base_top]
    assert tiny_engine.num_compilations == before
    assert_idle(tiny_engine)


# ----- max_model_len against the KV cache ---------------------------------------------------

# A pool of 12 usable blocks of 8 tokens: 96 tokens, below the tiny model's 256 positions.
SMALL_POOL_BLOCKS = 13


def small_pool_config(tiny_engine_config, max_model_len: int | None):
    """The tiny model on a 13-block pool, with the fewest compiled shapes (one token
    bucket, synchronous single-step decode)."""
    from jaxserve.config import CacheConfig, SchedulerConfig

    return dataclasses.replace(
        tiny_engine_config,
        cache=CacheConfig(block_size=TINY_BLOCK_SIZE, num_blocks=SMALL_POOL_BLOCKS),
        scheduler=SchedulerConfig(
            max_num_seqs=2,
            max_num_batched_tokens=16,
            max_model_len=max_model_len,
            async_scheduling=False,
            num_decode_steps=1,
        ),
    )


def test_explicit_max_model_len_above_the_kv_cache_is_an_error(tiny_engine_config):
    from jaxserve.engine.core import EngineCore

    capacity = (SMALL_POOL_BLOCKS - 1) * TINY_BLOCK_SIZE
    with pytest.raises(ValueError, match=rf"^max_model_len: .*\b{capacity} tokens"):
        EngineCore(small_pool_config(tiny_engine_config, max_model_len=capacity + 1))


def test_default_max_model_len_is_capped_to_the_kv_cache(tiny_engine_config, caplog):
    from jaxserve.engine.core import EngineCore

    capacity = (SMALL_POOL_BLOCKS - 1) * TINY_BLOCK_SIZE
    default = TINY_MAX_MODEL_LEN  # the tiny model's max_position_embeddings
    assert capacity < default
    with caplog.at_level("WARNING", logger="jaxserve.engine.core"):
        engine = EngineCore(small_pool_config(tiny_engine_config, max_model_len=None))
    assert any("max_model_len" in r.getMessage() for r in caplog.records)
    assert engine.max_model_len == capacity
    assert engine.stats().max_model_len == capacity  # what GetServerInfo / validation see
    assert engine.scheduler.max_model_len == capacity
    rng = random.Random(30)
    vocab = engine.model_config.vocab_size
    too_long, fits = random_prompts(rng, 1, capacity, capacity, vocab)[0], [1] * (capacity - 4)
    r = run_engine(
        engine, [("too-long", too_long, greedy(4)), ("fits", fits, greedy(50, ignore_eos=True))]
    )
    # A prompt that fills max_model_len ends at once with an error naming the limit.
    assert r["too-long"].finish_reason == "error" and not r["too-long"].tokens
    assert f"max_model_len={capacity}" in r["too-long"].error
    # A request that reaches the capped limit runs to it: the KV cache holds all of it.
    assert r["fits"].finish_reason == "length"
    assert len(r["fits"].tokens) == 4
    assert_idle(engine)

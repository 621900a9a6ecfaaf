"""Engine depth on the tiny random Qwen3-MoE: prompt log-probs, n samples sharing the
prompt's KV blocks, async scheduling and multi-step decode, each against an independent
reference (HF transformers' logits, the block count of separate prompts, the engine with
the feature off).

One compiled engine serves every test (tests/conftest.py); tests leave it idle.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
from engine_helpers import assert_idle, greedy, random_prompts, run_engine
from model_utils import hf_logits

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
    assert tiny_engine.num_compilations == before == 0
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

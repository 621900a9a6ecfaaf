"""Model families against HF transformers (PyTorch, CPU, float32) on the same checkpoint.

For each family config: logits of a prompt through the paged cache and through the
cache-less path match HF; a 16-token greedy continuation (prefill + 15 decode steps,
block_size 4, shuffled block table) equals HF `generate(do_sample=False)`; two prompts
batched in one flat step give the same logits as each alone.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.model_utils import (
    StepRequest,
    build_step,
    hf_generate_greedy,
    hf_logits,
    load_family,
    paged_greedy,
    shuffled_blocks,
    tiny_mixtral_config,
    tiny_qwen3_moe_config,
)

BLOCK_SIZE = 4
NUM_BLOCKS = 32
MAX_BLOCKS = 8  # 32 tokens per request
ATOL = 1e-4

CONFIGS = {
    # Layer 0 dense via mlp_only_layers; renormalized top-k.
    "qwen3_moe_mlp_only": lambda: tiny_qwen3_moe_config(mlp_only_layers=[0], norm_topk_prob=True),
    # Every other layer dense via decoder_sparse_step; raw top-k weights; tied embeddings.
    "qwen3_moe_sparse_step_tied": lambda: tiny_qwen3_moe_config(
        num_hidden_layers=4, decoder_sparse_step=2, norm_topk_prob=False, tie_word_embeddings=True
    ),
    "mixtral": lambda: tiny_mixtral_config(),
    # A window shorter than prompt + continuation, so it changes the answer.
    "mixtral_sliding_window": lambda: tiny_mixtral_config(sliding_window=5),
}

PROMPT = [17, 200, 3, 45, 99, 120, 7]


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def family(request, tmp_path_factory):
    """(HF torch model, our stepper) for one config, sharing one saved checkpoint."""
    return load_family(CONFIGS[request.param](), tmp_path_factory.mktemp(request.param))


def _shuffled_blocks(seed: int, count: int) -> list[int]:
    return shuffled_blocks(seed, count, NUM_BLOCKS)


def _prefill(stepper, prompt, blocks, kv_cache, num_tokens=None):
    tokens, positions, metadata = build_step(
        [StepRequest(prompt, 0, blocks)], BLOCK_SIZE, MAX_BLOCKS, num_tokens=num_tokens, num_reqs=2
    )
    logits, kv_cache = stepper.paged(tokens, positions, kv_cache, metadata)
    return np.asarray(logits)[: len(prompt)], kv_cache


def test_paged_prefill_logits_match_hf(family):
    hf_model, stepper = family
    # Padded to 8 tokens / 2 request rows: padding must not disturb real tokens.
    logits, _ = _prefill(
        stepper, PROMPT, _shuffled_blocks(0, 2), stepper.new_cache(NUM_BLOCKS, BLOCK_SIZE), 8
    )
    np.testing.assert_allclose(logits, hf_logits(hf_model, PROMPT), atol=ATOL, rtol=0)


def test_cacheless_logits_match_hf(family):
    hf_model, stepper = family
    np.testing.assert_allclose(
        stepper.cacheless(PROMPT), hf_logits(hf_model, PROMPT), atol=ATOL, rtol=0
    )


def test_greedy_decode_matches_hf_generate(family):
    hf_model, stepper = family
    generated = paged_greedy(
        stepper, PROMPT, 16, block_size=BLOCK_SIZE, max_blocks=MAX_BLOCKS, num_blocks=NUM_BLOCKS
    )
    assert generated == hf_generate_greedy(hf_model, PROMPT, 16)


def test_batched_prompts_match_each_alone(family):
    hf_model, stepper = family
    short, long = PROMPT[:5], [5, 6, 7, 8, 9, 10, 11, 12, 13]
    blocks = _shuffled_blocks(2, 5)  # disjoint: both requests share one cache
    blocks_a, blocks_b = blocks[:2], blocks[2:]
    tokens, positions, metadata = build_step(
        [StepRequest(short, 0, blocks_a), StepRequest(long, 0, blocks_b)],
        BLOCK_SIZE,
        MAX_BLOCKS,
        num_tokens=16,
        num_reqs=3,
    )
    kv_cache = stepper.new_cache(NUM_BLOCKS, BLOCK_SIZE)
    batched, _ = stepper.paged(tokens, positions, kv_cache, metadata)
    batched = np.asarray(batched)

    alone_short, _ = _prefill(
        stepper, short, blocks_a, stepper.new_cache(NUM_BLOCKS, BLOCK_SIZE), 16
    )
    alone_long, _ = _prefill(stepper, long, blocks_b, stepper.new_cache(NUM_BLOCKS, BLOCK_SIZE), 16)
    np.testing.assert_allclose(batched[:5], alone_short, atol=1e-5, rtol=0)
    np.testing.assert_allclose(batched[5:14], alone_long, atol=1e-5, rtol=0)
    np.testing.assert_allclose(batched[5:14], hf_logits(hf_model, long), atol=ATOL, rtol=0)

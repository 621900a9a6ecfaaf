"""A DeepSeek-V3 (MLA, latent paged KV cache) through the EngineCore against HF
transformers' greedy `generate`: batched requests with chunked prefill, preemption in a
pool too small for them, the prefix cache, and the KV pool sized from the latent layout.
"""

from __future__ import annotations

import random

import pytest
from conftest import swap_scheduler
from engine_helpers import assert_idle, greedy, hf_greedy, random_prompts, run_engine

from tests.deepseek_utils import write_deepseek_folder

pytestmark = pytest.mark.slow

BLOCK_SIZE = 4
NUM_BLOCKS = 96


@pytest.fixture(scope="module")
def ds_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_deepseek_v3")
    return path, write_deepseek_folder(path, max_position_embeddings=128)


@pytest.fixture(scope="module")
def ds_engine(ds_dir):
    from jaxserve.config import CacheConfig, EngineConfig, SchedulerConfig
    from jaxserve.engine.core import EngineCore

    config = EngineConfig(
        model=str(ds_dir[0]),
        cache=CacheConfig(block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS),
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16, num_decode_steps=1),
    )
    return EngineCore(config)


def test_greedy_with_chunked_prefill_matches_hf(ds_engine, ds_dir):
    hf_model = ds_dir[1]
    rng = random.Random(0)
    vocab = ds_engine.model_config.vocab_size
    # Prompts up to 40 tokens against a 16-token step budget: prefilled in chunks.
    prompts = [[rng.randrange(vocab) for _ in range(n)] for n in (3, 17, 40)]
    out = run_engine(ds_engine, [(f"r{i}", p, greedy(16)) for i, p in enumerate(prompts)])
    for i, p in enumerate(prompts):
        assert out[f"r{i}"].tokens == hf_greedy(hf_model, p, 16), f"prompt {i}"
    assert_idle(ds_engine)


def test_preemption_matches_hf(ds_engine, ds_dir):
    hf_model = ds_dir[1]
    rng = random.Random(1)
    prompts = random_prompts(rng, 4, 10, 20, ds_engine.model_config.vocab_size)
    requests = [(f"p{i}", p, greedy(16)) for i, p in enumerate(prompts)]
    # 16 usable blocks = 64 tokens for 4 requests of up to 36: some must be preempted.
    with swap_scheduler(ds_engine, num_blocks=17) as sched:
        out = run_engine(ds_engine, requests)
        assert sched.num_preemptions > 0
        assert sched.bm.num_free_blocks == sched.bm.num_usable_blocks
    for rid, p, _ in requests:
        assert out[rid].tokens == hf_greedy(hf_model, p, 16), rid


def test_prefix_cache_hits_on_latent_blocks(ds_engine, ds_dir):
    hf_model = ds_dir[1]
    rng = random.Random(2)
    vocab = ds_engine.model_config.vocab_size
    prefix = [rng.randrange(vocab) for _ in range(3 * BLOCK_SIZE)]
    first, second = prefix + [1, 2, 3], prefix + [9, 8, 7, 6]
    with swap_scheduler(ds_engine, enable_prefix_caching=True) as sched:
        run_engine(ds_engine, [("first", first, greedy(4))])
        before = sched.num_prefill_tokens_computed
        cached = run_engine(ds_engine, [("second", second, greedy(16))])["second"]
        assert sched.num_prefill_tokens_computed - before == len(second) - 3 * BLOCK_SIZE
    assert cached.tokens == hf_greedy(hf_model, second, 16)


def test_kv_cache_is_the_latent_layout(ds_engine):
    c = ds_engine.model_config
    k, v = ds_engine.runner.kv_cache[0]
    assert k.shape == (NUM_BLOCKS, BLOCK_SIZE, 1, c.mla.kv_lora_rank)
    assert v.shape == (NUM_BLOCKS, BLOCK_SIZE, 1, c.mla.qk_rope_head_dim)
    assert len(ds_engine.runner.kv_cache) == c.num_hidden_layers

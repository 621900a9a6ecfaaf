"""DeepSeek-V3 / V2 against HF transformers (PyTorch, CPU, float32) on small random configs.

Configs cover q LoRA on and off, several group settings of both gates (V3 sigmoid with a
random e_score_correction_bias, V2 greedy and group-limited greedy), dense-first layers
and YaRN rope scaling (interleaved and half-split RoPE). For each: logits over every
prompt position through the latent paged cache (absorbed MLA) and cache-less (expanded
MLA) within 1e-4 of HF; 16 greedy tokens with a shuffled block table and the prompt
prefilled in two chunks equal HF `generate`; two prompts in one flat step each equal HF.
"""

from __future__ import annotations

import numpy as np
import pytest

from jaxserve.engine.kv_sizing import kv_block_bytes
from jaxserve.models.base import KVLayout
from jaxserve.models.config import ModelConfig
from jaxserve.models.loader import load_model
from tests.deepseek_utils import (
    YARN,
    DeepseekStepper,
    tiny_deepseek_v2_config,
    tiny_deepseek_v3_config,
    write_deepseek_checkpoint,
)
from tests.model_utils import StepRequest, build_step, hf_logits

BLOCK_SIZE = 4
NUM_BLOCKS = 32
MAX_BLOCKS = 8
ATOL = 1e-4
PROMPT = [17, 200, 3, 45, 99, 120, 7, 64, 33]
# Every paged step is padded to 16 tokens and 3 request rows (one compiled shape; the
# padding must not disturb the real tokens).
STEP = (16, 3)

CONFIGS = {
    # q LoRA, 4 groups / top-2 groups, layer 0 dense, renormalized, YaRN (interleaved).
    "v3_qlora_groups_yarn": lambda: tiny_deepseek_v3_config(rope_parameters=YARN),
    # No q LoRA, 2 groups / top-1, YaRN on half-split RoPE, raw weights, no dense layer.
    "v3_yarn_halves": lambda: tiny_deepseek_v3_config(
        q_lora_rank=None,
        n_group=2,
        topk_group=1,
        first_k_dense_replace=0,
        norm_topk_prob=False,
        rope_parameters=YARN,
        rope_interleave=False,
    ),
    # V2 softmax greedy gate, no q LoRA, every layer MoE, plain RoPE.
    "v2_greedy": lambda: tiny_deepseek_v2_config(),
    # V2 group-limited greedy, q LoRA, YaRN, layer 0 dense.
    "v2_group_yarn": lambda: tiny_deepseek_v2_config(
        topk_method="group_limited_greedy",
        n_group=4,
        topk_group=2,
        q_lora_rank=16,
        first_k_dense_replace=1,
        rope_parameters=YARN,
    ),
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def family(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf_model = write_deepseek_checkpoint(CONFIGS[request.param](), path, seed=0)
    model, config = load_model(path)
    assert config.architecture == type(hf_model).__name__
    return hf_model, DeepseekStepper(model)


def _shuffled_blocks(seed: int, count: int) -> list[int]:
    perm = np.random.default_rng(seed).permutation(np.arange(1, NUM_BLOCKS))
    return [int(b) for b in perm[:count]]


def test_paged_prefill_logits_match_hf(family):
    hf_model, stepper = family
    tokens, positions, metadata = build_step(
        [StepRequest(PROMPT, 0, _shuffled_blocks(0, 3))], BLOCK_SIZE, MAX_BLOCKS, *STEP
    )
    logits, _ = stepper.paged(
        tokens, positions, stepper.new_cache(NUM_BLOCKS, BLOCK_SIZE), metadata
    )
    np.testing.assert_allclose(
        np.asarray(logits)[: len(PROMPT)], hf_logits(hf_model, PROMPT), atol=ATOL, rtol=0
    )


def test_cacheless_logits_match_hf(family):
    hf_model, stepper = family
    np.testing.assert_allclose(
        stepper.cacheless(PROMPT), hf_logits(hf_model, PROMPT), atol=ATOL, rtol=0
    )


def test_greedy_chunked_prefill_then_decode_matches_hf_generate(family):
    import torch

    hf_model, stepper = family
    new_tokens = 16
    blocks = _shuffled_blocks(1, -(-(len(PROMPT) + new_tokens) // BLOCK_SIZE))
    kv_cache = stepper.new_cache(NUM_BLOCKS, BLOCK_SIZE)
    # The prompt in two chunks (5 + 4 tokens): the second reads the first from the cache.
    split = 5
    for start, chunk in ((0, PROMPT[:split]), (split, PROMPT[split:])):
        tokens, positions, metadata = build_step(
            [StepRequest(chunk, start, blocks)], BLOCK_SIZE, MAX_BLOCKS, *STEP
        )
        logits, kv_cache = stepper.paged(tokens, positions, kv_cache, metadata)
    generated = [int(np.argmax(np.asarray(logits)[len(PROMPT) - split - 1]))]
    for _ in range(new_tokens - 1):
        pos = len(PROMPT) + len(generated) - 1
        tokens, positions, metadata = build_step(
            [StepRequest([generated[-1]], pos, blocks)], BLOCK_SIZE, MAX_BLOCKS, *STEP
        )
        step_logits, kv_cache = stepper.paged(tokens, positions, kv_cache, metadata)
        generated.append(int(np.argmax(np.asarray(step_logits)[0])))
    with torch.no_grad():
        expected = hf_model.generate(
            torch.tensor([PROMPT]), max_new_tokens=new_tokens, do_sample=False, pad_token_id=0
        )[0, len(PROMPT) :].tolist()
    assert generated == expected


def test_two_prompts_in_one_step_match_hf(family):
    hf_model, stepper = family
    short, long = PROMPT[:5], [5, 6, 7, 8, 9, 10, 11, 12, 13]
    blocks = _shuffled_blocks(2, 5)
    blocks_a, blocks_b = blocks[:2], blocks[2:]
    tokens, positions, metadata = build_step(
        [StepRequest(short, 0, blocks_a), StepRequest(long, 0, blocks_b)],
        BLOCK_SIZE,
        MAX_BLOCKS,
        16,
        3,
    )
    batched, _ = stepper.paged(
        tokens, positions, stepper.new_cache(NUM_BLOCKS, BLOCK_SIZE), metadata
    )
    batched = np.asarray(batched)
    np.testing.assert_allclose(batched[:5], hf_logits(hf_model, short), atol=ATOL, rtol=0)
    np.testing.assert_allclose(batched[5:14], hf_logits(hf_model, long), atol=ATOL, rtol=0)


def test_config_parses_the_deepseek_fields():
    hf = tiny_deepseek_v3_config(rope_parameters=YARN, moe_layer_freq=1).to_dict()
    hf["architectures"] = ["DeepseekV3ForCausalLM"]
    c = ModelConfig.from_hf(hf)
    assert c.mla.q_lora_rank == 32 and c.mla.kv_lora_rank == 24 and c.mla.latent_dim == 32
    assert c.mla.rope_scaling.factor == 4.0 and c.mla.rope_scaling.mscale_all_dim == 1.0
    assert c.grouped_gate.n_group == 4 and c.grouped_gate.topk_group == 2
    assert [c.is_moe_layer(i) for i in range(3)] == [False, True, True]
    # DeepSeek's moe_layer_freq: every second layer from first_k_dense_replace on.
    c2 = ModelConfig.from_hf({**hf, "num_hidden_layers": 5, "moe_layer_freq": 2})
    assert [c2.is_moe_layer(i) for i in range(5)] == [False, False, True, False, True]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("n_group", 3),  # 8 experts not divisible by 3 groups
        ("topk_group", 5),  # more groups kept than exist
        ("qk_rope_head_dim", 7),  # RoPE needs pairs
        ("rope_parameters", {"rope_type": "longrope", "rope_theta": 1e4}),
        ("kv_lora_rank", 0),
    ],
)
def test_bad_deepseek_config_names_the_field(field, value):
    hf = tiny_deepseek_v3_config().to_dict()
    hf["architectures"] = ["DeepseekV3ForCausalLM"]
    hf[field] = value
    key = "rope_scaling" if field == "rope_parameters" else field
    with pytest.raises(ValueError, match=key):
        ModelConfig.from_hf(hf)


def test_latent_block_bytes_from_the_layout():
    hf = tiny_deepseek_v3_config().to_dict()
    hf["architectures"] = ["DeepseekV3ForCausalLM"]
    c = ModelConfig.from_hf(hf)
    latent = KVLayout(1, 24, 1, 8, shard_heads=False)
    # 3 layers * (kv_lora_rank 24 + rope 8) values * 4 bytes * 16 tokens; the same model
    # with per-head K (4 heads of nope 16 + rope 8) and V (4 heads of 12) would need more.
    assert kv_block_bytes(c, 16, np.float32, latent) == 3 * 32 * 4 * 16
    per_head = KVLayout(4, 24, 4, 12)
    assert kv_block_bytes(c, 16, np.float32, per_head) == 3 * 4 * (24 + 12) * 4 * 16

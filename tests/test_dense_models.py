"""Dense families (Qwen3, Qwen2, Llama) against HF transformers (PyTorch, CPU, float32).

For each: logits of a prompt through the paged cache (padded step, shuffled block
table) and cache-less match HF; a greedy continuation through prefill + decode steps
equals HF `generate(do_sample=False)`. Then: the registry and the JAX-free list of
supported architectures agree, an unsupported architecture is named with the supported
ones whatever its config lacks, the unsupported options of these families are refused by
name, and a dense checkpoint serves through the offline engine like HF generates.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from jaxserve.models.config import SUPPORTED_ARCHITECTURES, ModelConfig
from jaxserve.models.registry import supported_architectures
from tests.model_utils import (
    StepRequest,
    build_step,
    hf_generate_greedy,
    hf_logits,
    load_family,
    paged_greedy,
    shuffled_blocks,
    write_hf_checkpoint,
)

BLOCK_SIZE = 4
NUM_BLOCKS = 32
MAX_BLOCKS = 8
ATOL = 1e-4
PROMPT = [17, 200, 3, 45, 99, 120, 7]

_TINY = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    initializer_range=0.2,  # far from ties, as the MoE families' tests
    bos_token_id=None,
    eos_token_id=None,
)


# Llama 3.1's rope scaling, its real factors with a short original context so that every
# band (kept, interpolated, divided by `factor`) holds some of head_dim 16's frequencies.
LLAMA31_ROPE = dict(
    rope_scaling={
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
)


def tiny_dense_config(family: str, **overrides):
    """A small random-init HF config of a dense family (float32)."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    cls = {"qwen3": Qwen3Config, "qwen2": Qwen2Config, "llama": LlamaConfig}[family]
    base = dict(_TINY, **({"head_dim": 16} if family != "qwen2" else {}))
    base.update(overrides)
    return cls(**base)


CONFIGS = {
    "qwen3": lambda: tiny_dense_config("qwen3"),
    "qwen3_tied": lambda: tiny_dense_config("qwen3", tie_word_embeddings=True),
    "qwen2": lambda: tiny_dense_config("qwen2", rope_theta=1_000_000.0),
    "llama": lambda: tiny_dense_config("llama", rope_theta=500_000.0),
    "llama_head_dim": lambda: tiny_dense_config("llama", head_dim=8),
    "llama31_rope": lambda: tiny_dense_config("llama", rope_theta=10_000.0, **LLAMA31_ROPE),
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def family(request, tmp_path_factory):
    hf_model, stepper = load_family(
        CONFIGS[request.param](), tmp_path_factory.mktemp(request.param)
    )
    assert stepper.config.num_experts == 0 and stepper.model.moe_layers() == ()
    return hf_model, stepper


def test_paged_and_cacheless_logits_match_hf(family):
    hf_model, stepper = family
    tokens, positions, metadata = build_step(
        [StepRequest(PROMPT, 0, shuffled_blocks(0, 2, NUM_BLOCKS))],
        BLOCK_SIZE,
        MAX_BLOCKS,
        num_tokens=8,
        num_reqs=2,
    )
    logits, _ = stepper.paged(
        tokens, positions, stepper.new_cache(NUM_BLOCKS, BLOCK_SIZE), metadata
    )
    want = hf_logits(hf_model, PROMPT)
    np.testing.assert_allclose(np.asarray(logits)[: len(PROMPT)], want, atol=ATOL, rtol=0)
    np.testing.assert_allclose(stepper.cacheless(PROMPT), want, atol=ATOL, rtol=0)


def test_greedy_decode_matches_hf_generate(family):
    hf_model, stepper = family
    generated = paged_greedy(
        stepper, PROMPT, 12, block_size=BLOCK_SIZE, max_blocks=MAX_BLOCKS, num_blocks=NUM_BLOCKS
    )
    assert generated == hf_generate_greedy(hf_model, PROMPT, 12)


# ----- configs ----------------------------------------------------------------------------


def test_registry_and_supported_list_agree():
    assert tuple(supported_architectures()) == SUPPORTED_ARCHITECTURES
    for name in ("Qwen3ForCausalLM", "Qwen2ForCausalLM", "LlamaForCausalLM"):
        assert name in SUPPORTED_ARCHITECTURES


@pytest.mark.parametrize(
    "hf",
    [
        {"architectures": ["GPT2LMHeadModel"]},  # none of the fields these families need
        # An MoE family not implemented (DeepSeek-V3 was the example before issue 15 added it).
        {"architectures": ["Qwen2MoeForCausalLM"], "hidden_size": 64, "num_experts": 8},
    ],
)
def test_unsupported_architecture_lists_the_supported_ones(hf):
    with pytest.raises(ValueError) as info:
        ModelConfig.from_hf(hf)
    message = str(info.value)
    assert f"architecture {hf['architectures'][0]!r} is not supported" in message
    assert all(name in message for name in SUPPORTED_ARCHITECTURES)


@pytest.mark.parametrize(
    "family, field, value",
    [
        ("llama", "attention_bias", True),
        ("llama", "mlp_bias", True),
        ("llama", "rope_scaling", {"rope_type": "llama3", "factor": 8.0}),
        ("qwen2", "use_sliding_window", True),
    ],
)
def test_unsupported_options_are_named(family, field, value):
    hf = tiny_dense_config(family).to_dict()
    hf["architectures"] = [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[family]]
    hf[field] = value
    if field == "rope_scaling":  # the transformers 4.x spelling, alone
        hf.pop("rope_parameters", None)
    with pytest.raises(ValueError, match=field):
        ModelConfig.from_hf(json.loads(json.dumps(hf)))


def test_dense_config_needs_no_expert_fields():
    hf = tiny_dense_config("qwen2").to_dict()
    hf["architectures"] = ["Qwen2ForCausalLM"]
    config = ModelConfig.from_hf(hf)
    assert (config.num_experts, config.num_experts_per_tok) == (0, 0)
    assert config.attention_qkv_bias and not any(map(config.is_moe_layer, range(2)))


# ----- serving ----------------------------------------------------------------------------


def test_dense_checkpoint_serves_like_hf_generate(tmp_path):
    """The offline engine (scheduler, paged cache, multi-step decode) on a Qwen2
    checkpoint: greedy output equals HF generate for two prompts batched together."""
    from mock_engine import train_test_tokenizer

    from jaxserve import LLM, SamplingParams

    tok = train_test_tokenizer()
    tok.save(str(tmp_path / "tokenizer.json"))
    config = tiny_dense_config("qwen2", vocab_size=tok.get_vocab_size())
    hf_model = write_hf_checkpoint(config, tmp_path, seed=1)
    llm = LLM(
        model=str(tmp_path), max_num_seqs=2, max_num_batched_tokens=16, num_blocks=16,
        block_size=8, max_model_len=64, compilation_cache_dir=None,
    )  # fmt: skip
    prompts = [PROMPT, [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.token_ids == hf_generate_greedy(hf_model, prompt, 10)


def test_llama31_rope_scaling_is_parsed_and_matters(tmp_path):
    """The llama31_rope parity above can fail: its scaling changes HF's logits, and every
    band of the scaling holds a frequency of the test's head_dim."""
    import math

    import torch

    from jaxserve.models.layers import llama3_inv_freq

    scaled = tiny_dense_config("llama", rope_theta=10_000.0, **LLAMA31_ROPE)
    plain = tiny_dense_config("llama", rope_theta=10_000.0)
    hf = json.loads(scaled.to_json_string())
    config = ModelConfig.from_hf({**hf, "architectures": ["LlamaForCausalLM"]})
    assert config.rope_scaling is not None and config.rope_scaling.factor == 8.0
    inv = llama3_inv_freq(16, 10_000.0, config.rope_scaling)
    base = 1.0 / 10_000.0 ** (np.arange(0, 16, 2) / 16)
    wavelen = 2 * math.pi / base
    assert (wavelen < 16).any() and (wavelen > 64).any() and ((wavelen > 16) & (wavelen < 64)).any()
    np.testing.assert_allclose(inv[wavelen < 16], base[wavelen < 16], rtol=1e-6)
    np.testing.assert_allclose(inv[wavelen > 64], base[wavelen > 64] / 8, rtol=1e-6)
    a = write_hf_checkpoint(scaled, tmp_path / "scaled", seed=0)
    b = write_hf_checkpoint(plain, tmp_path / "plain", seed=0)
    prompt = list(range(1, 40))
    with torch.no_grad():
        assert np.abs(hf_logits(a, prompt) - hf_logits(b, prompt)).max() > 100 * ATOL

"""Test helpers for DeepSeek-V2/V3: tiny random HF configs (float32, std 0.2 weights so
routing and logits are far from ties) and a paged-cache allocator in the model's layout."""

from __future__ import annotations


def tiny_deepseek_v3_config(**overrides):
    """A small random-init HF DeepSeek-V3 config: q LoRA on, 8 experts in 4 groups (top-2
    groups), top-2, one shared expert, layer 0 dense, YaRN off."""
    from transformers import DeepseekV3Config

    base = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=32,
        kv_lora_rank=24,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=12,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=4,
        topk_group=2,
        n_shared_experts=1,
        first_k_dense_replace=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        max_position_embeddings=256,
        initializer_range=0.2,
        bos_token_id=None,
        eos_token_id=None,
    )
    base.update(overrides)
    return DeepseekV3Config(**base)


def tiny_deepseek_v2_config(**overrides):
    """A small random-init HF DeepSeek-V2 config: q LoRA off, softmax greedy gate, two
    shared experts, every layer MoE."""
    from transformers import DeepseekV2Config

    base = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=None,
        kv_lora_rank=24,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=2,
        first_k_dense_replace=0,
        routed_scaling_factor=1.0,
        topk_method="greedy",
        max_position_embeddings=256,
        initializer_range=0.2,
        bos_token_id=None,
        eos_token_id=None,
    )
    base.update(overrides)
    return DeepseekV2Config(**base)


YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 64,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 0.707,
    "mscale_all_dim": 1.0,
}


def new_cache(model, num_blocks: int, block_size: int):
    """A zero paged cache in the model's own layout (`model.kv_layout()`)."""
    return model.kv_layout().allocate(model.config.num_hidden_layers, num_blocks, block_size)


def write_deepseek_checkpoint(hf_config, path, seed: int = 0):
    """Like `model_utils.write_hf_checkpoint`, but V3's e_score_correction_bias (zeros at
    init) is drawn at random first, so a test sees whether the gate uses it. Returns the
    eval-mode torch model."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.normal_(0.0, 0.1)
    model.save_pretrained(path)
    return model


class DeepseekStepper:
    """`model_utils.ModelStepper` with the cache in the model's own layout."""

    def __init__(self, model):
        from tests.model_utils import ModelStepper

        self._inner = ModelStepper(model)
        self.layout = model.kv_layout()
        self.config = model.config
        self.paged = self._inner.paged
        self.cacheless = self._inner.cacheless

    def new_cache(self, num_blocks: int, block_size: int):
        return self.layout.allocate(self.config.num_hidden_layers, num_blocks, block_size)


def write_deepseek_folder(path, **overrides):
    """A random DeepSeek-V3 HF folder with the test tokenizer (config.json,
    model.safetensors, tokenizer.json), no EOS id. Returns the torch model, generation
    set to run to max_new_tokens."""
    from mock_engine import train_test_tokenizer

    tok = train_test_tokenizer()
    tok.save(str(path / "tokenizer.json"))
    config = tiny_deepseek_v3_config(
        vocab_size=tok.get_vocab_size(), **{"rope_parameters": YARN, **overrides}
    )
    model = write_deepseek_checkpoint(config, path, seed=0)
    model.generation_config.eos_token_id = None
    return model

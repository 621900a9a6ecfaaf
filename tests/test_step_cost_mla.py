"""The step cost model (observability/step_cost.py) on DeepSeek-V2/V3 shapes: Multi-head
Latent Attention's projections and latent cache, shared experts, V3's gate bias, dense
first layers. References: the checkpoint's own tensors (as transformers writes them) for
weight bytes and the FLOPs of one token, and the model's KV layout's allocation for the
cache bytes per token."""

from __future__ import annotations

import math

import jax
import pytest
from deepseek_utils import (
    tiny_deepseek_v2_config,
    tiny_deepseek_v3_config,
    write_deepseek_checkpoint,
)
from safetensors import safe_open

from jaxserve.models.config import ModelConfig
from jaxserve.models.mla import mla_kv_layout
from jaxserve.observability.step_cost import StepCostModel

CONFIGS = {"v3": tiny_deepseek_v3_config, "v2": tiny_deepseek_v2_config}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def checkpoint(request, tmp_path_factory):
    """(ModelConfig, {tensor name: element count}) of a random checkpoint."""
    path = tmp_path_factory.mktemp(f"deepseek_{request.param}")
    hf_config = CONFIGS[request.param]()
    write_deepseek_checkpoint(hf_config, path)
    sizes = {}
    with safe_open(str(path / "model.safetensors"), "np") as f:
        for name in f.keys():
            sizes[name] = math.prod(f.get_slice(name).get_shape())
    cfg = ModelConfig.from_hf(hf_config.to_dict())
    return cfg, sizes


def test_weight_bytes_equal_the_checkpoint(checkpoint):
    cfg, sizes = checkpoint
    assert StepCostModel(cfg, "float32").total_weight_bytes == 4 * sum(sizes.values())


def test_flops_of_one_token_are_twice_its_active_weights(checkpoint):
    """One token at position 0 meets every attention projection, the dense MLP or the
    gate + top-k routed + shared experts, and the LM head; its one (query, key) pair
    costs the absorbed products: scores over latent + RoPE key, output over the latent."""
    cfg, sizes = checkpoint
    k, m = cfg.num_experts_per_tok, cfg.mla

    def total(prefix: str, skip: str = "layernorm") -> int:
        return sum(v for n, v in sizes.items() if n.startswith(prefix) and skip not in n)

    active = sizes["lm_head.weight"]
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        active += total(p + "self_attn.")
        if cfg.is_moe_layer(i):
            active += total(p + "mlp.gate.") + total(p + "mlp.shared_experts.")
            active += k * total(p + "mlp.experts.0.")
        else:
            active += total(p + "mlp.")
    attention = 2 * cfg.num_attention_heads * (2 * m.kv_lora_rank + m.qk_rope_head_dim)
    want = 2 * active + attention * cfg.num_hidden_layers
    assert StepCostModel(cfg, "float32").cost([(0, 1)]).flops == want


def test_kv_bytes_per_token_are_the_latent_of_the_allocated_cache(checkpoint):
    cfg, _ = checkpoint
    num_blocks, block_size = 3, 4
    cache = mla_kv_layout(cfg.mla).allocate(cfg.num_hidden_layers, num_blocks, block_size)
    nbytes = sum(x.nbytes for x in jax.tree.leaves(cache))
    model = StepCostModel(cfg, "float32")
    assert model.kv_bytes_per_token == nbytes / (num_blocks * block_size)
    # 2 decode rows at contexts 5 and 9: read 5 + 9 positions plus write 2, per layer.
    assert model.cost([(4, 1), (8, 1)]).kv_bytes == model.kv_bytes_per_token * (5 + 9 + 2)

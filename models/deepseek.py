"""DeepSeek-V3 and DeepSeek-V2 (DeepSeek-AI 2024; HF `DeepseekV3ForCausalLM`, also what
DeepSeek-R1 and Kimi-K2 checkpoints declare, and `DeepseekV2ForCausalLM`).

Pre-norm decoder whose attention is Multi-head Latent Attention (`mla.py`, with the
latent paged KV cache) and whose MLP is dense for the first `first_k_dense_replace`
layers (and off-`moe_layer_freq` ones), else `DeepseekMoeBlock` (`deepseek_moe.py`:
grouped gate, shared experts, `MoeBlock`'s routed experts). The forward, the expert
counts and the LM head are `DecoderOnlyLM`'s; this file builds the layers, declares the
latent `kv_layout` and the HF weight names.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from jaxserve.models.base import KVLayout
from jaxserve.models.config import ModelConfig
from jaxserve.models.decoder import (
    DecoderLayer,
    DecoderOnlyLM,
    dense_mlp_specs,
    final_specs,
    layer_norm_specs,
    moe_block_specs,
)
from jaxserve.models.deepseek_moe import DeepseekMoeBlock
from jaxserve.models.layers import MLP, Parallelism, RMSNorm
from jaxserve.models.mla import MlaAttention, mla_kv_layout
from jaxserve.models.weight_map import WeightSpec, copy, linear, one


class DeepseekDecoderLayer(DecoderLayer):
    """x + mla(norm(x)), then h + mlp(norm(h)); `DecoderLayer.__call__`."""

    def __init__(
        self,
        config: ModelConfig,
        layer: int,
        dtype: jnp.dtype,
        rngs: nnx.Rngs,
        parallel: Parallelism | None = None,
    ):
        c = config
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, "embed", dtype, rngs)
        self.self_attn = MlaAttention(c, dtype, rngs, parallel)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, "embed", dtype, rngs)
        if c.is_moe_layer(layer):
            self.mlp = DeepseekMoeBlock(c, dtype, rngs, parallel)
        else:
            self.mlp = MLP(c.hidden_size, c.intermediate_size, dtype, rngs)


class DeepseekForCausalLM(DecoderOnlyLM):
    """`DeepseekV3ForCausalLM(config, dtype, rngs=nnx.Rngs(0), parallel=None)`; the
    contract and weights of `DecoderOnlyLM`, MLA layers, the latent KV layout."""

    def __init__(
        self,
        config: ModelConfig,
        dtype: jnp.dtype = jnp.float32,
        *,
        rngs: nnx.Rngs,
        parallel: Parallelism | None = None,
    ):
        if config.mla is None or config.grouped_gate is None:
            raise ValueError(f"{config.architecture}: not a DeepSeek (MLA) config")
        super().__init__(config, dtype, rngs=rngs, parallel=parallel)

    def make_layer(self, config, layer, dtype, rngs, parallel) -> nnx.Module:
        """An MLA decoder layer (dense or DeepSeek MoE by `is_moe_layer`)."""
        return DeepseekDecoderLayer(config, layer, dtype, rngs, parallel)

    def kv_layout(self) -> KVLayout:
        """The latent cache: kv_lora_rank + qk_rope_head_dim values per token and layer."""
        return mla_kv_layout(self.config.mla)

    def hf_weight_specs(self) -> list[WeightSpec]:
        c, m = self.config, self.config.mla
        h, n = c.hidden_size, c.num_attention_heads
        dq, dkv = m.qk_head_dim, m.qk_nope_head_dim + m.v_head_dim
        specs = [one(("embed_tokens",), copy("model.embed_tokens.weight", (c.vocab_size, h)))]
        for i in range(c.num_hidden_layers):
            hf, ours = f"model.layers.{i}", ("layers", i)
            attn, hf_attn = (*ours, "self_attn"), f"{hf}.self_attn"
            specs += layer_norm_specs(hf, ours, h)
            specs += [
                one(
                    (*attn, "kv_a_proj_with_mqa"),
                    linear(
                        f"{hf_attn}.kv_a_proj_with_mqa.weight", m.latent_dim, h, (h, m.latent_dim)
                    ),
                ),
                one(
                    (*attn, "kv_a_layernorm", "weight"),
                    copy(f"{hf_attn}.kv_a_layernorm.weight", (m.kv_lora_rank,)),
                ),
                one(
                    (*attn, "kv_b_proj"),
                    linear(
                        f"{hf_attn}.kv_b_proj.weight",
                        n * dkv,
                        m.kv_lora_rank,
                        (m.kv_lora_rank, n, dkv),
                    ),
                ),
                one(
                    (*attn, "o_proj"),
                    linear(f"{hf_attn}.o_proj.weight", h, n * m.v_head_dim, (n, m.v_head_dim, h)),
                ),
            ]
            if m.q_lora_rank is None:
                specs.append(
                    one(
                        (*attn, "q_proj"), linear(f"{hf_attn}.q_proj.weight", n * dq, h, (h, n, dq))
                    )
                )
            else:
                r = m.q_lora_rank
                specs += [
                    one((*attn, "q_a_proj"), linear(f"{hf_attn}.q_a_proj.weight", r, h, (h, r))),
                    one(
                        (*attn, "q_a_layernorm", "weight"),
                        copy(f"{hf_attn}.q_a_layernorm.weight", (r,)),
                    ),
                    one(
                        (*attn, "q_b_proj"),
                        linear(f"{hf_attn}.q_b_proj.weight", n * dq, r, (r, n, dq)),
                    ),
                ]
            if c.is_moe_layer(i):
                specs += self.moe_weight_specs(i)
            else:
                specs += dense_mlp_specs(hf, ours, h, c.intermediate_size)
        return specs + final_specs(c, tied=self.lm_head is None)

    def moe_weight_specs(self, layer: int) -> list[WeightSpec]:
        c, g = self.config, self.config.grouped_gate
        hf, ours = f"model.layers.{layer}.mlp", ("layers", layer, "mlp")
        specs = moe_block_specs(
            c,
            layer,
            gate_names=(f"{hf}.gate.weight",),
            experts_prefix=f"{hf}.experts",
            expert_names=("gate_proj", "up_proj", "down_proj"),
            fused_prefix=f"{hf}.experts",
        )
        if g.correction_bias:
            specs.append(
                one(
                    (*ours, "e_score_correction_bias"),
                    copy(f"{hf}.gate.e_score_correction_bias", (c.num_experts,)),
                )
            )
        if g.n_shared_experts:
            inter = c.moe_intermediate_size * g.n_shared_experts
            specs += _shared_specs(hf, ours, c.hidden_size, inter)
        return specs


def _shared_specs(hf_mlp: str, ours: tuple, hidden: int, inter: int) -> list[WeightSpec]:
    mlp, hf_se = (*ours, "shared_experts"), f"{hf_mlp}.shared_experts"
    return [
        one((*mlp, name), linear(f"{hf_se}.{name}.weight", o, i, (i, o)))
        for name, o, i in (
            ("gate_proj", inter, hidden),
            ("up_proj", inter, hidden),
            ("down_proj", hidden, inter),
        )
    ]


class DeepseekV3ForCausalLM(DeepseekForCausalLM):
    """DeepSeek-V3 / R1 / Kimi-K2: sigmoid grouped gate with e_score_correction_bias."""


class DeepseekV2ForCausalLM(DeepseekForCausalLM):
    """DeepSeek-V2: softmax gate, greedy or group-limited greedy."""

"""Qwen3-MoE (Qwen team 2025; HF `Qwen3MoeForCausalLM`).

Llama-style decoder with per-head q/k RMSNorm, a softmax top-k gate (renormalized only
if `norm_topk_prob`), and dense SwiGLU layers where `decoder_sparse_step` /
`mlp_only_layers` say so. The forward is `DecoderOnlyLM`'s; this file holds what is
Qwen3-specific: q/k norm and the HF weight names of the MoE block.
"""

from __future__ import annotations

from jaxserve.models.decoder import DecoderOnlyLM, moe_block_specs
from jaxserve.models.weight_map import WeightSpec


class Qwen3MoeForCausalLM(DecoderOnlyLM):
    """`Qwen3MoeForCausalLM(config, dtype, rngs=nnx.Rngs(0))`; see `DecoderOnlyLM`."""

    QK_NORM = True

    def moe_weight_specs(self, layer: int) -> list[WeightSpec]:
        hf = f"model.layers.{layer}.mlp"
        return moe_block_specs(
            self.config,
            layer,
            gate_names=(f"{hf}.gate.weight",),
            experts_prefix=f"{hf}.experts",
            expert_names=("gate_proj", "up_proj", "down_proj"),
            fused_prefix=f"{hf}.experts",
        )

"""Mixtral (Jiang et al. 2024, "Mixtral of Experts"; HF `MixtralForCausalLM`).

Llama-style decoder, every layer a sparse MoE block whose top-k weights are always
renormalized; optional sliding-window attention. The forward is `DecoderOnlyLM`'s; this
file holds the HF weight names of the MoE block (`block_sparse_moe.experts.{e}.w1/w3/w2`
on the Hub, `mlp.experts.gate_up_proj/down_proj` in transformers 5.x memory).
"""

from __future__ import annotations

from jaxserve.models.decoder import DecoderOnlyLM, moe_block_specs
from jaxserve.models.weight_map import WeightSpec


class MixtralForCausalLM(DecoderOnlyLM):
    """`MixtralForCausalLM(config, dtype, rngs=nnx.Rngs(0))`; see `DecoderOnlyLM`."""

    QK_NORM = False

    def moe_weight_specs(self, layer: int) -> list[WeightSpec]:
        hf = f"model.layers.{layer}"
        return moe_block_specs(
            self.config,
            layer,
            gate_names=(f"{hf}.block_sparse_moe.gate.weight", f"{hf}.mlp.gate.weight"),
            # w1 = gate, w3 = up, w2 = down (Mistral's naming).
            experts_prefix=f"{hf}.block_sparse_moe.experts",
            expert_names=("w1", "w3", "w2"),
            fused_prefix=f"{hf}.mlp.experts",
        )

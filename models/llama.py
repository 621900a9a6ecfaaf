"""Llama (Touvron et al. 2023; HF `LlamaForCausalLM`), and the checkpoints that use its
architecture name (Mistral-style dense models without sliding windows among them).

Pre-norm decoder: GQA attention with RoPE, a dense SwiGLU MLP, no biases. The forward and
the weight names are `DecoderOnlyLM`'s. Not implemented, refused by `ModelConfig` with a
message naming the field: RoPE scaling (`rope_scaling` of Llama 3.1+ "llama3"),
`attention_bias` and `mlp_bias`.
"""

from __future__ import annotations

from jaxserve.models.decoder import DecoderOnlyLM


class LlamaForCausalLM(DecoderOnlyLM):
    """`LlamaForCausalLM(config, dtype, rngs=nnx.Rngs(0))`; see `DecoderOnlyLM`."""

    QK_NORM = False

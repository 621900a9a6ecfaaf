"""Llama (Touvron et al. 2023; HF `LlamaForCausalLM`), and the checkpoints that use its
architecture name (Mistral-style dense models without sliding windows among them).

Pre-norm decoder: GQA attention with RoPE, a dense SwiGLU MLP, no biases. The forward and
the weight names are `DecoderOnlyLM`'s. Llama 3.1+'s RoPE scaling (`rope_scaling` /
`rope_parameters` with rope_type "llama3") is applied (`models.layers.llama3_inv_freq`).
Not implemented, refused by `ModelConfig` with a message naming the field: other RoPE
scalings (linear, dynamic, yarn), `attention_bias` and `mlp_bias`.
"""

from __future__ import annotations

from jaxserve.models.decoder import DecoderOnlyLM


class LlamaForCausalLM(DecoderOnlyLM):
    """`LlamaForCausalLM(config, dtype, rngs=nnx.Rngs(0))`; see `DecoderOnlyLM`."""

    QK_NORM = False

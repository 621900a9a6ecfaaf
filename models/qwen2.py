"""Qwen2 / Qwen2.5, dense (Qwen team 2024; HF `Qwen2ForCausalLM`).

Llama-style decoder whose q/k/v projections carry a bias (always, no config flag:
`ModelConfig.attention_qkv_bias`), without q/k norm, with a dense SwiGLU MLP. The
forward and the weight names (`*.q_proj.bias` included) are `DecoderOnlyLM`'s. Qwen2's
optional sliding-window layers (`use_sliding_window`) are refused by `ModelConfig`.
"""

from __future__ import annotations

from jaxserve.models.decoder import DecoderOnlyLM


class Qwen2ForCausalLM(DecoderOnlyLM):
    """`Qwen2ForCausalLM(config, dtype, rngs=nnx.Rngs(0))`; see `DecoderOnlyLM`."""

    QK_NORM = False

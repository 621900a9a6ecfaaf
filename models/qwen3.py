"""Qwen3, dense (Qwen team 2025; HF `Qwen3ForCausalLM`).

Llama-style decoder with per-head q/k RMSNorm before RoPE and a dense SwiGLU MLP in
every layer: `Qwen3MoeForCausalLM` without experts. The forward and the weight names are
`DecoderOnlyLM`'s; this file holds the one Qwen3 option, q/k norm.
"""

from __future__ import annotations

from jaxserve.models.decoder import DecoderOnlyLM


class Qwen3ForCausalLM(DecoderOnlyLM):
    """`Qwen3ForCausalLM(config, dtype, rngs=nnx.Rngs(0))`; see `DecoderOnlyLM`."""

    QK_NORM = True

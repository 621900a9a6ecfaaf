"""Pure-jnp reference for Multi-head Latent Attention over the latent paged KV cache.

The absorbed form of MLA (DeepSeek-AI 2024, "DeepSeek-V2", sec. 2.1.2; vLLM's MLA
backend): the key up-projection W_UK is folded into the query before this call
(q_latent = q_nope @ W_UK^T per head) and the value up-projection W_UV is applied to
the output after it, so attention runs directly on the cached latent:

    score[t, h, s] = (q_latent[t, h] . c_kv[s] + q_rope[t, h] . k_rope[s]) * scale
    out[t, h]      = sum_s softmax(score)[t, h, s] * c_kv[s]           (latent space)

It is multi-query attention with one shared "head" whose key is [c_kv, k_rope] and whose
value is c_kv. Like `paged_attention_ref` it gathers every token's context through its
block table (O(T * max_blocks * block_size * kv_lora_rank) memory): the oracle and the
CPU path, not a serving kernel. The cache layout is `models.base.KVLayout` (MLA).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxserve.kernels.paged_attention_ref import masked_softmax
from jaxserve.models.base import PAD_SLOT, AttentionMetadata


def mla_paged_attention_ref(
    q_latent: jax.Array,
    q_rope: jax.Array,
    latent_cache: jax.Array,
    rope_cache: jax.Array,
    positions: jax.Array,
    metadata: AttentionMetadata,
    scale: float,
) -> jax.Array:
    """Causal absorbed MLA of a flat token batch over the latent paged cache.

    Token t (request r = metadata.token_req[t]) attends to positions 0..positions[t] of
    request r, read through block_tables[r]; this step's latents must already be written.

    Args:
        q_latent: [T, H, kv_lora_rank], the position-free query times W_UK.
        q_rope: [T, H, qk_rope_head_dim], the RoPE part of the query (RoPE applied).
        latent_cache: [num_blocks, block_size, 1, kv_lora_rank], normalized c_kv.
        rope_cache: [num_blocks, block_size, 1, qk_rope_head_dim], RoPE'd shared key.
        positions: [T] int32; metadata: as in `models.base.AttentionMetadata`.
        scale: softmax scale (qk_head_dim^-0.5, times the YaRN mscale^2 where used).

    Returns:
        [T, H, kv_lora_rank] in q_latent.dtype (apply W_UV, then o_proj). Padded tokens
        get zeros. Scores, softmax and the weighted sum are float32.
    """
    num_tokens = q_latent.shape[0]
    _, block_size, _, rank = latent_cache.shape
    rope_dim = rope_cache.shape[-1]
    req = metadata.token_req
    block_ids = metadata.block_tables[req]  # [T, B]
    context = block_ids.shape[1] * block_size
    latents = latent_cache[block_ids].reshape(num_tokens, context, rank).astype(jnp.float32)
    ropes = rope_cache[block_ids].reshape(num_tokens, context, rope_dim).astype(jnp.float32)

    key_pos = jnp.arange(context, dtype=jnp.int32)[None, :]
    mask = (key_pos <= positions[:, None]) & (key_pos < metadata.seq_lens[req][:, None])
    mask &= (metadata.slot_mapping != PAD_SLOT)[:, None]

    scores = jnp.einsum("thl,tsl->ths", q_latent.astype(jnp.float32), latents)
    scores += jnp.einsum("thr,tsr->ths", q_rope.astype(jnp.float32), ropes)
    probs = masked_softmax(scores * scale, mask[:, None, :])
    out = jnp.einsum("ths,tsl->thl", probs, latents)
    return out.astype(q_latent.dtype)

"""Pure-jnp reference for attention over the paged KV cache (the oracle for the kernels).

It gathers every request's keys through its block table, so memory is
O(T * max_blocks * block_size): fine for tests, not for serving. Off the GPU the engine
runs `paged_attention_blockwise` instead (same contract; cost follows the real context),
and this stays its oracle (`JAXSERVE_CPU_ATTENTION=reference` still runs it, for A/B).
The cache layout and metadata are defined in `jaxserve.models.base`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxserve.models.base import PAD_SLOT, AttentionMetadata


def paged_attention_ref(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    positions: jax.Array,
    metadata: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
) -> jax.Array:
    """Causal GQA attention of a flat token batch over the paged KV cache.

    Token t (request r = metadata.token_req[t]) attends to the keys at positions
    0..positions[t] of request r, read through block_tables[r]. The K/V of this step's
    tokens must already be written to the cache.

    Args:
        q: [T, num_heads, head_dim] queries (RoPE applied).
        k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim].
        positions: [T] int32, position of each token in its request.
        metadata: block tables, seq_lens, token_req and slot_mapping (padding marker).
        scale: softmax scale, usually head_dim ** -0.5.
        sliding_window: if set, token t sees only keys with positions[t] - key_pos < window
            (HF Mistral/Mixtral convention).

    Returns:
        [T, num_heads, head_dim] in q.dtype. Padded tokens (slot PAD_SLOT, or a request row
        with seq_len 0) get zeros, never NaN. Scores and softmax are float32.
    """
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads

    req = metadata.token_req
    block_ids = metadata.block_tables[req]  # [T, B]
    context = block_ids.shape[1] * block_size
    keys = k_cache[block_ids].reshape(num_tokens, context, num_kv_heads, head_dim)
    values = v_cache[block_ids].reshape(num_tokens, context, num_kv_heads, head_dim)

    key_pos = jnp.arange(context, dtype=jnp.int32)[None, :]  # [1, L]
    query_pos = positions[:, None]
    mask = (key_pos <= query_pos) & (key_pos < metadata.seq_lens[req][:, None])
    mask &= (metadata.slot_mapping != PAD_SLOT)[:, None]
    if sliding_window is not None:
        mask &= query_pos - key_pos < sliding_window

    qg = q.reshape(num_tokens, num_kv_heads, group, head_dim).astype(jnp.float32)
    scores = jnp.einsum("tkgd,tlkd->tkgl", qg, keys.astype(jnp.float32)) * scale
    probs = masked_softmax(scores, mask[:, None, None, :])
    out = jnp.einsum("tkgl,tlkd->tkgd", probs, values.astype(jnp.float32))
    return out.reshape(num_tokens, num_heads, head_dim).astype(q.dtype)


def masked_softmax(scores: jax.Array, mask: jax.Array) -> jax.Array:
    """Softmax over the last axis restricted to `mask`; rows with no valid entry give zeros.

    scores: float32, any shape; mask: bool, broadcastable to scores.
    """
    masked = jnp.where(mask, scores, -jnp.inf)
    row_max = jnp.max(masked, axis=-1, keepdims=True)
    # A fully masked row has max -inf; shift by 0 instead so exp() stays finite.
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    weights = jnp.where(mask, jnp.exp(masked - row_max), 0.0)
    total = jnp.sum(weights, axis=-1, keepdims=True)
    return weights / jnp.where(total > 0, total, 1.0)

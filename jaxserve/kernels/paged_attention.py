"""Paged attention on Hopper in Pallas Mosaic GPU, for decode and mixed prefill/decode.

Owns `paged_attention`, with the signature and contract of
`paged_attention_ref.paged_attention_ref`: a flat batch of T query tokens, each attending
causally to its request's keys read through the block table. The engine reaches it
through `dispatch.py`. This module validates, lays the queries out, plans the work list
and picks the launch:

- `paged_attention_ragged.ragged_attention` for any batch: 64-row query tiles of one
  request and one KV head, and a decode path without row padding for one-token tiles;
- `paged_attention_decode.decode_attention` when the caller states the batch is
  decode-only (`max_query_len=1`) and there are too few (request, KV head) pairs to fill
  the GPU: the keys are then split over several SMs (flash-decoding).

The design notes are in those modules, in `paged_attention_flash.py` (the FlashAttention
stage loop both kernels run) and in `paged_attention_common.py` (work list, pipeline).
"""

from __future__ import annotations

import jax
import jax.experimental.pallas as pl
import jax.numpy as jnp

from jaxserve.kernels import tile_table
from jaxserve.kernels.paged_attention_common import (
    ROW_TILING,
    AttentionSpec,
    KernelInputs,
    QueryLayout,
    plan_work_items,
)
from jaxserve.kernels.paged_attention_decode import decode_attention
from jaxserve.kernels.paged_attention_ragged import TILE_ROWS, ragged_attention
from jaxserve.kernels.tile_table import AttentionConfig, attention_config
from jaxserve.models.base import AttentionMetadata

MAX_KV_SPLITS = 16


def unsupported_reason(q_shape, kv_shape, dtype) -> str | None:
    """Why the kernel cannot attend q [T, H, D] over caches [N, block_size, KVH, D] in
    `dtype`; None if it can (wgmma wants 16-bit operands and 64-wide head dims, TMA
    8-row boxes)."""
    (_, num_heads, head_dim), (_, block_size, num_kv_heads, _) = q_shape, kv_shape
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"dtype {jnp.dtype(dtype).name} (the kernel takes bfloat16 or float16)"
    if head_dim % 64:
        return f"head_dim={head_dim} is not a multiple of 64"
    if block_size % ROW_TILING:
        return f"block_size={block_size} is not a multiple of 8"
    if num_heads % num_kv_heads or pl.cdiv(num_heads // num_kv_heads, 8) * 8 > TILE_ROWS:
        return f"{num_heads} query heads over {num_kv_heads} KV heads"
    return None


def _validate(q, k_cache, v_cache, positions, metadata, config: AttentionConfig):
    if q.ndim != 3:
        raise ValueError(f"q: expected [T, H, D], got shape {q.shape}")
    if k_cache.ndim != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"k_cache, v_cache: expected equal [num_blocks, block_size, KVH, D], got "
            f"{k_cache.shape} and {v_cache.shape}"
        )
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, kv_dim = k_cache.shape
    if kv_dim != head_dim:
        raise ValueError(f"k_cache: head_dim {kv_dim} differs from q's {head_dim}")
    if num_heads % num_kv_heads:
        raise ValueError(f"q: {num_heads} heads is not a multiple of {num_kv_heads} KV heads")
    if head_dim % 64:
        raise ValueError(f"q: head_dim={head_dim} must be a multiple of 64")
    if q.dtype != k_cache.dtype or q.dtype != v_cache.dtype:
        raise ValueError(f"q, k_cache, v_cache: dtypes differ ({q.dtype}, {k_cache.dtype})")
    if jnp.dtype(q.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        raise ValueError(f"q: dtype must be bfloat16 or float16, got {q.dtype}")
    if block_size % ROW_TILING:
        raise ValueError(f"k_cache: block_size={block_size} must be a multiple of 8")
    if config.block_kv % block_size and block_size % config.block_kv:
        raise ValueError(
            f"block_kv={config.block_kv} must be a multiple or a divisor of block_size={block_size}"
        )
    if positions.shape != (num_tokens,):
        raise ValueError(f"positions: expected [T={num_tokens}], got {positions.shape}")
    if metadata.slot_mapping.shape != (num_tokens,):
        raise ValueError(
            f"metadata.slot_mapping: expected [T={num_tokens}], got {metadata.slot_mapping.shape}"
        )
    if metadata.query_start_loc.shape != (metadata.block_tables.shape[0] + 1,):
        raise ValueError(
            "metadata.query_start_loc: expected [R + 1] with R = block_tables rows, got "
            f"{metadata.query_start_loc.shape}"
        )


def _query_layout(q: jax.Array, num_kv_heads: int) -> tuple[QueryLayout, jax.Array]:
    """The [rows, D] view of q the kernels read, and where each (token, KV head) is."""
    num_tokens, num_heads, head_dim = q.shape
    group = num_heads // num_kv_heads
    if group % ROW_TILING == 0:
        # The g heads of a KV head are already 8-row aligned in q: use it in place.
        return QueryLayout(group, num_heads, group), q.reshape(num_tokens * num_heads, head_dim)
    # Repack [T, H, D] -> [KVH, T, gp, D], gp = g rounded up to the 8-row tiling.
    padded = pl.cdiv(group, ROW_TILING) * ROW_TILING
    rows = q.reshape(num_tokens, num_kv_heads, group, head_dim).transpose(1, 0, 2, 3)
    rows = jnp.pad(rows, ((0, 0), (0, 0), (0, padded - group), (0, 0)))
    layout = QueryLayout(padded, padded, num_tokens * padded)
    return layout, rows.reshape(num_kv_heads * num_tokens * padded, head_dim)


def _unpack(rows: jax.Array, layout: QueryLayout, q_shape: tuple[int, int, int], num_kv_heads):
    """Inverse of `_query_layout` for the output rows."""
    num_tokens, num_heads, head_dim = q_shape
    group = num_heads // num_kv_heads
    if layout.head_stride == group:
        return rows.reshape(q_shape)
    rows = rows.reshape(num_kv_heads, num_tokens, layout.rows_per_token, head_dim)[:, :, :group]
    return rows.transpose(1, 0, 2, 3).reshape(q_shape)


def num_kv_splits(num_requests: int, num_kv_heads: int, max_stages: int, num_sms: int) -> int:
    """KV splits for a decode-only launch: enough (request, KV head, split) units to give
    every SM one, at most MAX_KV_SPLITS and at most one per key stage."""
    pairs = max(num_requests * num_kv_heads, 1)
    return max(1, min(num_sms // pairs, MAX_KV_SPLITS, max_stages))


def paged_attention(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    positions: jax.Array,
    metadata: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    *,
    max_query_len: int | None = None,
    config: AttentionConfig | None = None,
    num_sms: int | None = None,
) -> jax.Array:
    """Causal GQA attention of a flat token batch over the paged KV cache (Mosaic GPU).

    Token t of request r (query_start_loc[r] <= t < query_start_loc[r + 1]) attends to
    keys 0..positions[t] (and < seq_lens[r]) of request r, read through block_tables[r].
    The K/V of this step's tokens must already be in the cache. As the engine schedules
    them, query_start_loc[0] = 0 and the tokens of one request have consecutive
    positions.

    Args:
      q: [T, H, D] bf16 (or f16) queries, RoPE applied; D a multiple of 64.
      k_cache, v_cache: [num_blocks, block_size, KVH, D], q's dtype; block_size a
        multiple of 8; block 0 is the null block.
      positions: [T] int32 position of each token in its request.
      metadata: `models.base.AttentionMetadata` (block_tables, seq_lens,
        query_start_loc; slot_mapping is not read: tokens past query_start_loc[R] are the
        padding).
      scale: softmax scale, usually D ** -0.5.
      sliding_window: if set, token t sees keys with positions[t] - key_pos < window.
      max_query_len: static promise that no request has more query tokens than this;
        1 (a decode-only step) allows the split-KV decode launch. Results are undefined
        if the promise is broken.
      config: tiling; `tile_table.attention_config` if None.
      num_sms: persistent CTAs; the device's SM count if None.

    Returns:
      [T, H, D] in q.dtype; tokens in no request are 0.

    Raises:
      ValueError: shapes, dtypes or tiling disagree (the message names the argument).
    """
    if q.ndim != 3 or k_cache.ndim != 4:
        raise ValueError(
            f"q [T, H, D] and k_cache [num_blocks, block_size, KVH, D] expected, got "
            f"q {q.shape}, k_cache {k_cache.shape}"
        )
    num_tokens, _, head_dim = q.shape
    if config is None:
        config = attention_config(head_dim, k_cache.shape[1], itemsize=q.dtype.itemsize)
    _validate(q, k_cache, v_cache, positions, metadata, config)
    num_kv_heads = k_cache.shape[2]
    layout, q_rows = _query_layout(q, num_kv_heads)
    if layout.rows_per_token > TILE_ROWS:
        raise ValueError(f"q: {layout.rows_per_token} query rows per KV head exceed {TILE_ROWS}")
    num_sms = num_sms or tile_table.num_sms()
    block_tables = metadata.block_tables.astype(jnp.int32)
    spec = AttentionSpec(config, layout, float(scale), sliding_window)

    max_stages = pl.cdiv(block_tables.shape[1] * k_cache.shape[1], config.block_kv)
    splits = num_kv_splits(block_tables.shape[0], num_kv_heads, max_stages, num_sms)
    if max_query_len == 1 and splits > 1:
        meta, counts = plan_work_items(
            metadata, positions, num_tokens, 1, sliding_window, config.block_kv
        )
        inputs = KernelInputs(meta, counts, block_tables, q_rows, k_cache, v_cache)
        out = decode_attention(inputs, spec, num_splits=splits, num_sms=num_sms)
        out = _unpack(out, layout, q.shape, num_kv_heads)
        covered = jnp.arange(num_tokens) < counts[1]
        return jnp.where(covered[:, None, None], out, jnp.zeros((), out.dtype))

    meta, counts = plan_work_items(
        metadata, positions, num_tokens, TILE_ROWS // layout.rows_per_token, sliding_window,
        config.block_kv,
    )  # fmt: skip
    inputs = KernelInputs(meta, counts, block_tables, q_rows, k_cache, v_cache)
    out = ragged_attention(inputs, spec, num_tokens=num_tokens, num_sms=num_sms)
    return _unpack(out, layout, q.shape, num_kv_heads)

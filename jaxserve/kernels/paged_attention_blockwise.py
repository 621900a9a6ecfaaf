"""Blockwise paged attention in pure jnp: what runs off the GPU (the CPU backend).

Same signature and result as `paged_attention_ref.paged_attention_ref` (the test oracle),
but it never gathers a token's whole block table. The step's tokens are cut into
*query chunks*: up to `query_chunk` consecutive tokens of one request (a decode row is a
chunk of one). Each chunk attends to the KV blocks its own context needs, from the
first block inside its sliding window to the block of its last query position. The
(chunk, KV block) pairs of the whole step are laid out in one flat list, and a
`lax.while_loop` walks it `pairs_per_iter` pairs at a time with the online softmax of
FlashAttention (Dao et al. 2022; the split-KV "flash-decoding" combine, Dao et al.
2023): each iteration gathers its pairs' blocks once, scores them against their chunk's
queries and folds them into per-chunk running (max, sum, output) accumulators with
segment reductions.

Cost: the trip count is ceil(pairs / pairs_per_iter), a traced value, so the work
follows the step's real context (sum over chunks of their blocks), never
max_model_len, and one compiled shape serves every context length. Memory is
O(chunks * query_chunk * heads * head_dim) for the accumulators plus one iteration's
gathered blocks: each key is read once per query chunk, not once per query token.

`paged_attention_blockwise` picks the chunk size per step with a `lax.cond` on a flag
computed on the device: chunks of one token when every request has one query token (a
decode step: no query padding), `PREFILL_QUERY_CHUNK` otherwise (mixed and prefill
steps). Both branches live in the one executable, so no shape is added.

Contract (models/base.py AttentionMetadata): the real tokens of a request are
contiguous in the flat batch (query_start_loc defines them so) and padded tokens carry
PAD_SLOT. This module must not import the engine.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from jaxserve.models.base import PAD_SLOT, AttentionMetadata

# Tokens per query chunk of a step that has a request with more than one query token.
PREFILL_QUERY_CHUNK = 16
# Fewest query tokens' worth of (chunk, block) pairs per loop iteration: a loop
# iteration has a fixed cost (~tens of microseconds on the CPU), so a small batch with a
# long context takes several blocks of one chunk per iteration.
MIN_QUERIES_PER_ITER = 64


def paged_attention_blockwise(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    positions: jax.Array,
    metadata: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    *,
    query_chunk: int | None = None,
) -> jax.Array:
    """Causal GQA attention of a flat token batch over the paged KV cache, blockwise.

    Token t (request r = metadata.token_req[t]) attends to the keys at positions
    0..positions[t] (and < seq_lens[r]) of request r, read through block_tables[r]. The
    K/V of this step's tokens must already be written to the cache.

    Args:
        q: [T, num_heads, head_dim] queries (RoPE applied), any float dtype.
        k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim].
        positions: [T] int32, position of each token in its request.
        metadata: block tables [R, B], seq_lens [R], token_req [T], slot_mapping [T]
            (PAD_SLOT marks padded tokens). A request's real tokens must be contiguous.
        scale: softmax scale, usually head_dim ** -0.5.
        sliding_window: if set, token t sees only keys with positions[t] - key_pos < window
            (HF Mistral/Mixtral convention).
        query_chunk: static tokens per query chunk; None picks per step (1 for a
            decode-only step, PREFILL_QUERY_CHUNK otherwise).

    Returns:
        [T, num_heads, head_dim] in q.dtype, equal to `paged_attention_ref` within
        float32 rounding. Padded tokens (slot PAD_SLOT, or a row with seq_len 0) get
        zeros, never NaN. Scores, softmax and accumulation are float32.

    Raises:
        ValueError: num_heads is not a multiple of num_kv_heads, or query_chunk < 1.
    """
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    if num_heads % num_kv_heads:
        heads = f"{num_heads} {'head is' if num_heads == 1 else 'heads are'}"
        raise ValueError(f"q: {heads} not a multiple of {num_kv_heads} KV heads")
    args = (q, k_cache, v_cache, positions, metadata)
    attend = functools.partial(_attend, scale=scale, sliding_window=sliding_window)
    if query_chunk is not None:
        if query_chunk < 1:
            raise ValueError(f"query_chunk: must be >= 1, got {query_chunk}")
        return attend(*args, query_chunk=query_chunk)
    if q.shape[0] == 1:
        return attend(*args, query_chunk=1)
    _, offset = _token_runs(metadata)
    decode_only = jnp.all(offset == 0)
    return jax.lax.cond(
        decode_only,
        functools.partial(attend, query_chunk=1),
        functools.partial(attend, query_chunk=PREFILL_QUERY_CHUNK),
        *args,
    )


def _token_runs(metadata: AttentionMetadata) -> tuple[jax.Array, jax.Array]:
    """(valid [T] bool, offset [T] int32): whether token t is real, and its index among
    the contiguous real tokens of its request (0 for padded tokens)."""
    req = metadata.token_req
    num_tokens = req.shape[0]
    valid = metadata.slot_mapping != PAD_SLOT
    same = (req[1:] == req[:-1]) & valid[1:] & valid[:-1]
    continues = jnp.concatenate([jnp.zeros(1, bool), same])
    index = jnp.arange(num_tokens, dtype=jnp.int32)
    run_start = jax.lax.cummax(jnp.where(continues, 0, index))
    return valid, index - run_start


def _attend(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    positions: jax.Array,
    metadata: AttentionMetadata,
    *,
    scale: float,
    sliding_window: int | None,
    query_chunk: int,
) -> jax.Array:
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    num_rows, max_blocks = metadata.block_tables.shape
    qc = query_chunk

    # ----- query chunks: W of them at most (each request's run cut every qc tokens).
    num_chunks = min(num_tokens, num_rows + math.ceil(num_tokens / qc))
    valid, offset = _token_runs(metadata)
    starts = valid & (offset % qc == 0)
    chunk_of = jnp.where(valid, jnp.cumsum(starts) - 1, num_chunks)  # [T]; W: none
    slot_of = offset % qc
    tok = jnp.arange(num_tokens, dtype=jnp.int32)
    first_tok = (
        jnp.zeros(num_chunks, jnp.int32)
        .at[jnp.where(starts, chunk_of, num_chunks)]
        .set(tok, mode="drop")
    )
    chunk_len = jax.ops.segment_sum(valid.astype(jnp.int32), chunk_of, num_chunks)
    chunk_req = metadata.token_req[first_tok]
    chunk_seq_len = jnp.where(chunk_len > 0, metadata.seq_lens[chunk_req], 0)
    slots = jnp.arange(qc, dtype=jnp.int32)
    chunk_tok = jnp.minimum(first_tok[:, None] + slots, num_tokens - 1)  # [W, qc]
    chunk_qvalid = slots[None, :] < chunk_len[:, None]
    chunk_qpos = jnp.where(chunk_qvalid, positions[chunk_tok], -1)
    q_chunks = (
        q[chunk_tok].reshape(num_chunks, qc, num_kv_heads, group, head_dim).astype(jnp.float32)
    )

    # ----- the KV blocks each chunk reads: [lo, hi).
    last_pos = jnp.max(chunk_qpos, axis=1)
    kv_end = jnp.minimum(chunk_seq_len, last_pos + 1)
    hi = jnp.minimum((kv_end + block_size - 1) // block_size, max_blocks)
    lo = jnp.zeros_like(hi)
    if sliding_window is not None:
        first_pos = jnp.min(jnp.where(chunk_qvalid, chunk_qpos, jnp.iinfo(jnp.int32).max), axis=1)
        lo = jnp.maximum(first_pos - sliding_window + 1, 0) // block_size
    num_pairs = jnp.where(chunk_len > 0, jnp.maximum(hi - lo, 0), 0)
    pair_end = jnp.cumsum(num_pairs)  # [W]
    pair_start = pair_end - num_pairs
    total_pairs = pair_end[-1]
    per_iter = max(num_chunks, -(-MIN_QUERIES_PER_ITER // qc))
    num_iters = (total_pairs + per_iter - 1) // per_iter

    acc_shape = (num_chunks, num_kv_heads, group, qc)
    # Under shard_map the loop's outputs vary over the mesh axes its inputs vary over; the
    # initial accumulators must be marked the same, or while_loop rejects the carry.
    vary = _varying_like(q_chunks, k_cache, v_cache, metadata.block_tables)
    init = (
        jnp.zeros((), jnp.int32),
        vary(jnp.full(acc_shape, -jnp.inf, jnp.float32)),  # running max
        vary(jnp.zeros(acc_shape, jnp.float32)),  # running sum of exp
        vary(jnp.zeros((*acc_shape, head_dim), jnp.float32)),  # running output
    )
    key_offsets = jnp.arange(block_size, dtype=jnp.int32)

    def body(carry):
        it, run_max, run_sum, run_out = carry
        pair = it * per_iter + jnp.arange(per_iter, dtype=jnp.int32)
        live = pair < total_pairs
        chunk = jnp.searchsorted(pair_end, pair, side="right", method="compare_all")
        chunk = jnp.minimum(chunk, num_chunks - 1).astype(jnp.int32)
        segment = jnp.where(live, chunk, num_chunks)  # dead pairs drop out of the sums
        block_index = jnp.clip(lo[chunk] + pair - pair_start[chunk], 0, max_blocks - 1)
        block = metadata.block_tables[chunk_req[chunk], block_index]
        keys = k_cache[block].astype(jnp.float32)  # [P, bs, KVH, D]
        values = v_cache[block].astype(jnp.float32)
        scores = jnp.einsum("pqkgd,pbkd->pkgqb", q_chunks[chunk], keys) * scale

        key_pos = block_index[:, None] * block_size + key_offsets  # [P, bs]
        query_pos = chunk_qpos[chunk][:, :, None]  # [P, qc, 1]
        mask = (key_pos[:, None, :] <= query_pos) & (
            key_pos[:, None, :] < chunk_seq_len[chunk][:, None, None]
        )
        mask &= (live[:, None] & chunk_qvalid[chunk])[:, :, None]
        if sliding_window is not None:
            mask &= query_pos - key_pos[:, None, :] < sliding_window
        scores = jnp.where(mask[:, None, None], scores, -jnp.inf)

        pair_max = jnp.max(scores, axis=-1)  # [P, KVH, G, qc]
        new_max = jnp.maximum(run_max, jax.ops.segment_max(pair_max, segment, num_chunks))
        # A chunk slot with no key yet keeps max -inf; shift by 0 so exp() stays finite.
        shift = jnp.where(jnp.isfinite(new_max), new_max, 0.0)
        rescale = jnp.exp(run_max - shift)  # 0 where run_max is -inf
        weights = jnp.exp(scores - shift[chunk][..., None])  # masked: exp(-inf) = 0
        pair_out = jnp.einsum("pkgqb,pbkd->pkgqd", weights, values)
        run_sum = run_sum * rescale + jax.ops.segment_sum(
            jnp.sum(weights, axis=-1), segment, num_chunks
        )
        run_out = run_out * rescale[..., None] + jax.ops.segment_sum(pair_out, segment, num_chunks)
        return it + 1, new_max, run_sum, run_out

    _, _, run_sum, run_out = jax.lax.while_loop(lambda c: c[0] < num_iters, body, init)
    chunk_out = run_out / jnp.where(run_sum > 0, run_sum, 1.0)[..., None]  # [W, KVH, G, qc, D]

    # ----- back to the flat token order; padded tokens get zeros.
    gathered = chunk_out[jnp.minimum(chunk_of, num_chunks - 1), :, :, slot_of]  # [T, KVH, G, D]
    out = jnp.where((valid & (chunk_of < num_chunks))[:, None, None, None], gathered, 0.0)
    return out.reshape(num_tokens, num_heads, head_dim).astype(q.dtype)


def _varying_like(*refs: jax.Array):
    """A function that marks an array as varying over every manual mesh axis (inside
    `shard_map`) that any of `refs` varies over; the identity outside `shard_map`."""
    axes = frozenset().union(*(jax.typeof(r).manual_axis_type.varying for r in refs))
    if not axes:
        return lambda x: x
    return lambda x: jax.lax.pcast(x, tuple(sorted(axes)), to="varying")

"""Paged attention on Hopper in Pallas Mosaic GPU, for decode and mixed prefill/decode.

Owns `paged_attention`, with the signature and contract of
`paged_attention_ref.paged_attention_ref`: a flat batch of T query tokens, each
attending causally to its request's keys read through the block table. The engine
reaches it through `dispatch.py`.

Design (FlashAttention-2's online softmax, Dao 2023; the query packing of
FlashAttention-3's PackGQA, Shah et al. 2024; the wgmma/TMA structure of JAX's
`ops/gpu/attention_mgpu.py`):

- Query packing. The g = H / KVH query heads that share a KV head are stacked as rows:
  q is rearranged to [KVH, T * gp, D] (gp = g rounded up to 8, the TMA row tiling), so a
  64-row wgmma tile holds 64 / gp consecutive tokens of one request for one KV head.
  A decode token fills gp rows; a prefill chunk fills whole tiles. One kernel serves
  decode and prefill; the tile list (`_work_items`) is built by a few tiny XLA ops.
- Work item = (tile of one request's query tokens, KV head). CTAs are persistent and
  walk the items; each runs two warpgroups: a TMA warpgroup that streams the query tile
  and the key/value blocks of the item through a ring of `num_stages` buffers, and a
  compute warpgroup (S = Q K^T by wgmma, masked online softmax in float32, O += P V by
  wgmma). The ring runs across item boundaries, so the loads of the next item overlap
  the end of the current one (no per-item pipeline bubble).
- A stage is `block_kv` keys: block_kv / block_size TMA boxes of one KV block each, at
  block ids read from the block table. Boxes past the keys an item needs read the null
  block 0 instead (the cache contract keeps it allocated), so they cost L2, not HBM.
- Masking inside a stage: key position < the row's query position + 1, < seq_len, and
  inside the sliding window if any. Masked scores get a large finite negative value,
  so rows whose first stage is fully masked (sliding window) recover exactly.
- Rows are stored with a ladder of power-of-two TMA boxes (as in `grouped_matmul`), so
  a tile never overwrites another request's rows. Tokens no item covers (padding) are
  zeroed when the output is unpacked.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from jaxserve.kernels import tile_table
from jaxserve.kernels.tile_table import AttentionConfig, attention_config
from jaxserve.models.base import AttentionMetadata

TILE_ROWS = 64  # query rows of one work item: one warpgroup MMA
_ROW_TILING = 8  # TMA into swizzled SMEM moves whole 8-row tiles
_MASK_VALUE = -1e30  # finite, so exp2(mask - max) is 0 and never NaN
_LOG2E = math.log2(math.e)
# Item metadata fields (rows of the [fields, items] array).
_REQ, _FIRST_TOK, _NUM_TOKS, _POS_FIRST, _NUM_KEYS, _SEQ_LEN, _FIRST_STAGE = range(7)
_NUM_FIELDS = 7


@dataclass(frozen=True, slots=True)
class _QueryLayout:
    """Where the query rows of (token t, KV head h) live in the 2-D [rows, D] view.

    Rows of (t, h) are [t * token_stride + h * head_stride, + rows_per_token). With g
    query heads per KV head: if g is a multiple of 8, q itself ([T * H, D]) is used
    (token_stride H, head_stride g); otherwise q is repacked to [KVH, T, gp, D] with
    gp = g rounded up to 8 (token_stride gp, head_stride T * gp).
    """

    rows_per_token: int
    token_stride: int
    head_stride: int

    @property
    def tokens_per_tile(self) -> int:
        return TILE_ROWS // self.rows_per_token


def _work_items(
    metadata: AttentionMetadata,
    positions: jax.Array,
    num_tokens: int,
    tokens_per_tile: int,
    sliding_window: int | None,
    block_kv: int,
) -> tuple[jax.Array, jax.Array]:
    """Tiles of query tokens, one request each, and what each tile needs.

    Tile j of request r covers its tokens [qs + j * tpt, min(qs + (j + 1) * tpt, qe)),
    tpt = tokens_per_tile. Tokens of one request in a step have consecutive positions
    (the engine's contract), so the tile's query positions are positions[first] + 0, 1..

    Returns:
      meta: [7, max_items] int32, fields (req, first_tok, num_toks, pos_first, num_keys,
        seq_len, first_stage): the item's tokens are [first_tok, first_tok + num_toks),
        it needs keys [first_stage * block_kv, num_keys) of a context of seq_len keys.
        Entries past num_items have num_toks = 0.
      counts: [2] int32, (num_items, covered = tokens in some request).
    """
    qsl = jnp.clip(metadata.query_start_loc.astype(jnp.int32), 0, num_tokens)
    num_reqs = qsl.shape[0] - 1
    starts, ends = qsl[:-1], qsl[1:]
    q_lens = jnp.maximum(ends - starts, 0)
    tiles = (q_lens + tokens_per_tile - 1) // tokens_per_tile
    tile_ends = jnp.cumsum(tiles)
    max_items = pl.cdiv(num_tokens, tokens_per_tile) + num_reqs
    i = jnp.arange(max_items, dtype=jnp.int32)
    req = jnp.minimum(jnp.searchsorted(tile_ends, i, side="right"), num_reqs - 1)
    req = req.astype(jnp.int32)
    first_tok = starts[req] + (i - (tile_ends[req] - tiles[req])) * tokens_per_tile
    num_toks = jnp.clip(ends[req] - first_tok, 0, tokens_per_tile)
    num_toks = jnp.where(i < tile_ends[-1], num_toks, 0)
    first_tok = jnp.clip(first_tok, 0, num_tokens - 1)
    last_tok = jnp.clip(first_tok + num_toks - 1, 0, num_tokens - 1)
    pos_first = positions[first_tok].astype(jnp.int32)
    seq_len = metadata.seq_lens.astype(jnp.int32)[req]
    num_keys = jnp.minimum(positions[last_tok].astype(jnp.int32) + 1, seq_len)
    num_keys = jnp.maximum(num_keys, 1)
    if sliding_window is None:
        first_stage = jnp.zeros_like(num_keys)
    else:
        first_stage = jnp.maximum(pos_first - sliding_window + 1, 0) // block_kv
    meta = jnp.stack([req, first_tok, num_toks, pos_first, num_keys, seq_len, first_stage])
    counts = jnp.stack([tile_ends[-1], qsl[-1]])
    return meta.astype(jnp.int32), counts.astype(jnp.int32)


def _attention_kernel(
    meta_gmem,
    counts_gmem,
    block_tables_gmem,
    q_gmem,
    k_gmem,
    v_gmem,
    out_gmem,
    *,
    config: AttentionConfig,
    layout: _QueryLayout,
    num_tokens: int,
    scale: float,
    sliding_window: int | None,
):
    """Kernel body: warpgroup 1 streams Q, K, V by TMA; warpgroup 0 computes."""
    head_dim = q_gmem.shape[1]
    _, block_size, num_kv_heads, _ = k_gmem.shape
    max_blocks = block_tables_gmem.shape[1]
    block_kv, num_stages = config.block_kv, config.num_stages
    rows_per_token, tokens_per_tile = layout.rows_per_token, layout.tokens_per_tile
    box_rows = min(block_kv, block_size)
    boxes = block_kv // box_rows
    dtype = q_gmem.dtype
    itemsize = jnp.dtype(dtype).itemsize

    def swizzled(minor: int):
        swizzle = plgpu.find_swizzle(minor * itemsize * 8)
        return (
            plgpu.TilingTransform((_ROW_TILING, swizzle // itemsize)),
            plgpu.SwizzleTransform(swizzle),
        )

    num_items = counts_gmem[0]
    grid = (num_items * num_kv_heads,)

    def item_fields(lin):
        item = lax.div(lin, num_kv_heads)
        head = lax.rem(lin, num_kv_heads)
        return head, [meta_gmem[f, item] for f in range(_NUM_FIELDS)]

    def stage_range(fields):
        last = lax.div(fields[_NUM_KEYS] + block_kv - 1, block_kv)
        return fields[_FIRST_STAGE], last

    def query_rows(token, head):
        """The rows of (token, head) in q_gmem / out_gmem."""
        row = token * layout.token_stride + head * layout.head_stride
        return pl.ds(pl.multiple_of(row, _ROW_TILING), rows_per_token)

    def tile_rows(i: int):
        return pl.ds(i * rows_per_token, rows_per_token)

    def memory_warpgroup(q_smem, k_smem, v_smem, q_ready, q_free, k_ready, v_ready, kv_free):
        def load_stage(stage, step, req, head, num_keys):
            slot = lax.rem(step, num_stages)

            @pl.when(step >= num_stages)
            def _():
                plgpu.barrier_wait(kv_free.at[slot])

            for j in range(boxes):
                key = stage * block_kv + j * box_rows
                block_idx = jnp.minimum(lax.div(key, block_size), max_blocks - 1)
                # Boxes past the keys the item needs read the null block (an L2 hit).
                block = jnp.where(key < num_keys, block_tables_gmem[req, block_idx], 0)
                offset = pl.multiple_of(lax.rem(key, block_size), _ROW_TILING)
                src = (block, pl.ds(offset, box_rows), head)
                dst = (slot, pl.ds(j * box_rows, box_rows))
                plgpu.copy_gmem_to_smem(k_gmem.at[src], k_smem.at[dst], k_ready.at[slot])
                plgpu.copy_gmem_to_smem(v_gmem.at[src], v_smem.at[dst], v_ready.at[slot])
            return step + 1

        @plgpu.nd_loop(grid, collective_axes="sm", init_carry=(jnp.int32(0), jnp.int32(0)))
        def _items(loop_info, carry):
            step, items = carry
            (lin,) = loop_info.index
            head, fields = item_fields(lin)
            q_slot = lax.rem(items, 2)

            @pl.when(items >= 2)
            def _():
                plgpu.barrier_wait(q_free.at[q_slot])

            # A fixed number of boxes per tile (the barrier counts arrivals): rows of
            # tokens past the item repeat its last token and are never stored.
            last_tok = fields[_FIRST_TOK] + fields[_NUM_TOKS] - 1
            for i in range(tokens_per_tile):
                token = jnp.minimum(fields[_FIRST_TOK] + i, last_tok)
                plgpu.copy_gmem_to_smem(
                    q_gmem.at[query_rows(token, head)],
                    q_smem.at[q_slot, tile_rows(i)],
                    q_ready.at[q_slot],
                )
            first, last = stage_range(fields)
            body = functools.partial(
                load_stage, req=fields[_REQ], head=head, num_keys=fields[_NUM_KEYS]
            )
            return lax.fori_loop(first, last, body, step), items + 1

        # Observe the releases not waited for yet, so that every barrier ends quiescent.
        step, items = _items

        @pl.loop(jnp.maximum(step - num_stages, 0), step)
        def _drain_kv(s):
            plgpu.barrier_wait(kv_free.at[lax.rem(s, num_stages)])

        @pl.loop(jnp.maximum(items - 2, 0), items)
        def _drain_q(i):
            plgpu.barrier_wait(q_free.at[lax.rem(i, 2)])

    def compute_warpgroup(
        q_smem, k_smem, v_smem, p_smem, q_ready, q_free, k_ready, v_ready, kv_free
    ):
        shape = (TILE_ROWS, block_kv)

        def stage_body(stage, carry, *, q_ref, pos_first, seq_len):
            step, acc, m_i, l_i = carry
            slot = lax.rem(step, num_stages)
            plgpu.barrier_wait(k_ready.at[slot])

            def compute_qk(acc_ref):
                plgpu.wgmma(acc_ref, q_ref, k_smem.at[slot].transpose((1, 0)))
                return acc_ref[...]

            qk = pl.run_scoped(compute_qk, plgpu.ACC(shape, jnp.float32))
            row = plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=plgpu.Layout.WGMMA)
            col = plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=plgpu.Layout.WGMMA)
            q_pos = pos_first + lax.div(row, rows_per_token)
            k_pos = stage * block_kv + col
            mask = (k_pos <= q_pos) & (k_pos < seq_len)
            if sliding_window is not None:
                mask = mask & (q_pos - k_pos < sliding_window)
            # Scores in log2 units: exp2 is the native instruction.
            s = jnp.where(mask, qk * (scale * _LOG2E), _MASK_VALUE)
            m_ij = jnp.maximum(m_i, s.max(axis=1))
            alpha = jnp.exp2(m_i - m_ij)
            p = jnp.exp2(s - lax.broadcast_in_dim(m_ij, shape, [0]))
            l_i = l_i * alpha + p.sum(axis=1)
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
            # P goes through SMEM (the interpreter needs both wgmma operands there); the
            # previous stage's P @ V is complete (its accumulator was read).
            p_smem[...] = p.astype(dtype)
            plgpu.commit_smem()
            plgpu.barrier_wait(v_ready.at[slot])

            def compute_pv(acc_ref):
                plgpu.wgmma(acc_ref, p_smem, v_smem.at[slot])
                return acc_ref[...]

            acc = acc + pl.run_scoped(compute_pv, plgpu.ACC((TILE_ROWS, head_dim), jnp.float32))
            plgpu.barrier_arrive(kv_free.at[slot])
            return step + 1, acc, m_ij, l_i

        @plgpu.nd_loop(grid, collective_axes="sm", init_carry=(jnp.int32(0), jnp.int32(0)))
        def _items(loop_info, carry):
            step, items = carry
            (lin,) = loop_info.index
            head, fields = item_fields(lin)
            q_slot = lax.rem(items, 2)
            plgpu.barrier_wait(q_ready.at[q_slot])
            row_layout = plgpu.Layout.WGMMA.reduce(1)
            m_i = plgpu.layout_cast(jnp.full((TILE_ROWS,), -jnp.inf, jnp.float32), row_layout)
            l_i = plgpu.layout_cast(jnp.full((TILE_ROWS,), 0.0, jnp.float32), row_layout)
            acc = plgpu.layout_cast(
                jnp.full((TILE_ROWS, head_dim), 0.0, jnp.float32), plgpu.Layout.WGMMA
            )
            first, last = stage_range(fields)
            body = functools.partial(
                stage_body,
                q_ref=q_smem.at[q_slot],
                pos_first=fields[_POS_FIRST],
                seq_len=fields[_SEQ_LEN],
            )
            step, acc, m_i, l_i = lax.fori_loop(first, last, body, (step, acc, m_i, l_i))
            # Rows of tokens outside the item may hold l = 0; they are never stored.
            acc = acc / lax.broadcast_in_dim(l_i, acc.shape, [0])
            # The item's query tile is done with: stage the output in it (saves SMEM),
            # and hand it back to the TMA warpgroup once the stores have read it.
            staging = q_smem.at[q_slot]
            staging[...] = acc.astype(dtype)
            plgpu.commit_smem()
            for i in range(tokens_per_tile):
                token = fields[_FIRST_TOK] + i

                @pl.when(i < fields[_NUM_TOKS])
                def _store(token=token, i=i):
                    plgpu.copy_smem_to_gmem(
                        staging.at[tile_rows(i)], out_gmem.at[query_rows(token, head)]
                    )

            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            plgpu.barrier_arrive(q_free.at[q_slot])
            return step, items + 1

        # Tokens in no request (the batch's padding) get zeros, stored from a query
        # buffer: every query load has been waited for and every tile stored by now.
        covered = counts_gmem[1]
        zeros = q_smem.at[0]
        zeros[...] = plgpu.layout_cast(jnp.zeros((TILE_ROWS, head_dim), dtype), plgpu.Layout.WGMMA)
        plgpu.commit_smem()

        @plgpu.nd_loop(((num_tokens - covered) * num_kv_heads,), collective_axes="sm")
        def _zero_tail(loop_info):
            (lin,) = loop_info.index
            token = covered + lax.div(lin, num_kv_heads)
            head = lax.rem(lin, num_kv_heads)
            plgpu.copy_smem_to_gmem(zeros.at[tile_rows(0)], out_gmem.at[query_rows(token, head)])

        plgpu.wait_smem_to_gmem(0)

    def scoped(q_smem, k_smem, v_smem, p_smem, *barriers):
        q_ready, q_free, k_ready, v_ready, kv_free = barriers
        wg = lax.axis_index("wg")
        pl.when(wg == 1)(
            lambda: memory_warpgroup(
                q_smem, k_smem, v_smem, q_ready, q_free, k_ready, v_ready, kv_free
            )
        )
        pl.when(wg == 0)(
            lambda: compute_warpgroup(
                q_smem,
                k_smem,
                v_smem,
                p_smem,
                q_ready,
                q_free,
                k_ready,
                v_ready,
                kv_free,
            )
        )

    kv_ring = plgpu.SMEM((num_stages, block_kv, head_dim), dtype, transforms=swizzled(head_dim))
    pl.run_scoped(
        scoped,
        plgpu.SMEM((2, TILE_ROWS, head_dim), dtype, transforms=swizzled(head_dim)),
        kv_ring,
        kv_ring,
        plgpu.SMEM((TILE_ROWS, block_kv), dtype, transforms=swizzled(block_kv)),
        plgpu.Barrier(num_arrivals=tokens_per_tile, num_barriers=2),
        plgpu.Barrier(num_barriers=2),
        plgpu.Barrier(num_arrivals=boxes, num_barriers=num_stages),
        plgpu.Barrier(num_arrivals=boxes, num_barriers=num_stages),
        plgpu.Barrier(num_barriers=num_stages),
        collective_axes="wg",
    )


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
    if block_size % _ROW_TILING:
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


def paged_attention(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    positions: jax.Array,
    metadata: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    *,
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
      config: tiling; `tile_table.attention_config` if None.
      num_sms: persistent CTAs; the device's SM count if None.

    Returns:
      [T, H, D] in q.dtype; tokens in no request are 0.

    Raises:
      ValueError: shapes, dtypes or tiling disagree (the message names the argument).
    """
    num_tokens, num_heads, head_dim = q.shape if q.ndim == 3 else (0, 0, 0)
    if config is None and k_cache.ndim == 4:
        config = attention_config(head_dim, k_cache.shape[1], itemsize=q.dtype.itemsize)
    _validate(q, k_cache, v_cache, positions, metadata, config)
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    if group % _ROW_TILING == 0:
        # The g heads of a KV head are already 8-row aligned in q: use it in place.
        layout = _QueryLayout(group, num_heads, group)
        q_rows = q.reshape(num_tokens * num_heads, head_dim)
    else:
        # Repack [T, H, D] -> [KVH, T, gp, D], gp = g rounded up to the 8-row tiling.
        padded = pl.cdiv(group, _ROW_TILING) * _ROW_TILING
        layout = _QueryLayout(padded, padded, num_tokens * padded)
        q_rows = q.reshape(num_tokens, num_kv_heads, group, head_dim).transpose(1, 0, 2, 3)
        q_rows = jnp.pad(q_rows, ((0, 0), (0, 0), (0, padded - group), (0, 0)))
        q_rows = q_rows.reshape(num_kv_heads * num_tokens * padded, head_dim)
    if layout.rows_per_token > TILE_ROWS:
        raise ValueError(f"q: {group} query heads per KV head exceed the {TILE_ROWS}-row tile")

    meta, counts = _work_items(
        metadata, positions, num_tokens, layout.tokens_per_tile, sliding_window, config.block_kv
    )
    kernel = plgpu.kernel(
        functools.partial(
            _attention_kernel,
            config=config,
            layout=layout,
            num_tokens=num_tokens,
            scale=float(scale),
            sliding_window=sliding_window,
        ),
        out_type=jax.ShapeDtypeStruct(q_rows.shape, q.dtype),
        grid=(num_sms or tile_table.num_sms(),),
        grid_names=("sm",),
        num_threads=2,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
    )
    out = kernel(meta, counts, metadata.block_tables.astype(jnp.int32), q_rows, k_cache, v_cache)
    if layout.head_stride == group:
        return out.reshape(num_tokens, num_heads, head_dim)
    out = out.reshape(num_kv_heads, num_tokens, layout.rows_per_token, head_dim)[:, :, :group]
    return out.transpose(1, 0, 2, 3).reshape(num_tokens, num_heads, head_dim)

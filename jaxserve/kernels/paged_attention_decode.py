"""Decode paged attention: one query token per work unit.

A decode token brings only g query heads per KV head (8 for Qwen3-30B-A3B), far fewer
than the 64 rows of a wgmma. So the products run transposed, with the keys as the MMA's
rows ("swap AB"): S^T = K Q^T ([block_kv, gp]) and O^T += V^T P^T ([D, gp]), and the
online softmax (FlashAttention-2, Dao 2023) reduces over axis 0. Nothing is padded to 64
rows: the softmax works on block_kv x gp scores, not 64 x block_kv.

`decode_unit` is that computation for one unit; the ragged kernel runs it for every
single-token tile. `decode_attention` is a launch for batches known to be decode-only,
which may also split the keys of one (request, KV head) into ranges that run on
different SMs (flash-decoding, Dao et al. 2023): each writes its normalised partial
output (bf16) and log2-sum-exp (float32), and `combine_splits` merges them (a small XLA op).
"""

from __future__ import annotations

import functools

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from jaxserve.kernels.paged_attention_common import (
    FIRST_TOK,
    LOG2E,
    MASK_VALUE,
    POS_FIRST,
    SEQ_LEN,
    QueryLayout,
    Ring,
    WorkUnits,
    ring_barriers,
    stream_qkv,
    swizzled,
)
from jaxserve.kernels.tile_table import AttentionConfig


def decode_unit(
    ring: Ring,
    config: AttentionConfig,
    step: jax.Array,
    q_slot: jax.Array,
    fields: list,
    stages: tuple[jax.Array, jax.Array],
    *,
    rows: int,
    scale: float,
    sliding_window: int | None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Consume one unit's key stages from the ring for the token of `fields`.

    The token's gp = `rows` query rows are rows [0, gp) of query slot `q_slot`.

    Returns:
      (next ring step, out^T [D, gp] float32 normalised, log2-sum-exp [gp] float32);
      an empty stage range gives out 0 and lse -inf.
    """
    block_kv, num_stages = config.block_kv, config.num_stages
    head_dim = ring.k_smem.shape[-1]
    dtype = ring.k_smem.dtype
    scores_shape, out_shape = (block_kv, rows), (head_dim, rows)
    q_ref = ring.q_smem.at[q_slot, pl.ds(0, rows)]
    p_ref = ring.p_smem.at[pl.ds(0, rows)]
    pos, seq_len = fields[POS_FIRST], fields[SEQ_LEN]

    def stage_body(stage, carry):
        step, acc, m_i, l_i = carry
        slot = lax.rem(step, num_stages)
        plgpu.barrier_wait(ring.k_ready.at[slot])

        def compute_qk(acc_ref):
            plgpu.wgmma(acc_ref, ring.k_smem.at[slot], q_ref.transpose((1, 0)))
            return acc_ref[...]

        qk = pl.run_scoped(compute_qk, plgpu.ACC(scores_shape, jnp.float32))
        key = plgpu.broadcasted_iota(jnp.int32, scores_shape, 0, layout=plgpu.Layout.WGMMA)
        k_pos = stage * block_kv + key
        mask = (k_pos <= pos) & (k_pos < seq_len)
        if sliding_window is not None:
            mask = mask & (pos - k_pos < sliding_window)
        s = jnp.where(mask, qk * (scale * LOG2E), MASK_VALUE)
        m_ij = jnp.maximum(m_i, s.max(axis=0))
        alpha = jnp.exp2(m_i - m_ij)
        p = jnp.exp2(s - lax.broadcast_in_dim(m_ij, scores_shape, [1]))
        l_i = l_i * alpha + p.sum(axis=0)
        acc = acc * lax.broadcast_in_dim(alpha, out_shape, [1])
        # P^T is stored as P ([gp, block_kv], keys contiguous): the K-major operand the
        # wgmma wants. The previous stage's P V is complete (its result was read).
        p_ref.transpose((1, 0))[...] = p.astype(dtype)
        plgpu.commit_smem()
        plgpu.barrier_wait(ring.v_ready.at[slot])

        def compute_pv(acc_ref):
            plgpu.wgmma(acc_ref, ring.v_smem.at[slot].transpose((1, 0)), p_ref.transpose((1, 0)))
            return acc_ref[...]

        acc = acc + pl.run_scoped(compute_pv, plgpu.ACC(out_shape, jnp.float32))
        plgpu.barrier_arrive(ring.kv_free.at[slot])
        return step + 1, acc, m_ij, l_i

    column = plgpu.Layout.WGMMA.reduce(0)
    m_i = plgpu.layout_cast(jnp.full((rows,), -jnp.inf, jnp.float32), column)
    l_i = plgpu.layout_cast(jnp.full((rows,), 0.0, jnp.float32), column)
    acc = plgpu.layout_cast(jnp.full(out_shape, 0.0, jnp.float32), plgpu.Layout.WGMMA)
    step, acc, m_i, l_i = lax.fori_loop(*stages, stage_body, (step, acc, m_i, l_i))
    l_safe = jnp.where(l_i > 0.0, l_i, 1.0)
    out = acc / lax.broadcast_in_dim(l_safe, out_shape, [1])
    return step, out, m_i + jnp.log2(l_i)


def _split_kernel(
    meta_gmem,
    counts_gmem,
    block_tables_gmem,
    q_gmem,
    k_gmem,
    v_gmem,
    out_gmem,
    lse_gmem,
    *,
    config: AttentionConfig,
    layout: QueryLayout,
    num_splits: int,
    scale: float,
    sliding_window: int | None,
):
    """Decode-only launch with KV splits: partial outputs [splits, rows, D] (q's dtype) and
    their log2-sum-exp [splits, rows] float32. Rows of tokens in no request are left unwritten
    (the combine step masks them)."""
    head_dim = q_gmem.shape[1]
    block_size, num_kv_heads = k_gmem.shape[1], k_gmem.shape[2]
    rows = layout.rows_per_token
    dtype = q_gmem.dtype
    units = WorkUnits(meta_gmem, counts_gmem[0], num_kv_heads, num_splits, config.block_kv)

    def compute(ring: Ring, o_smem, lse_smem):
        @plgpu.nd_loop(units.grid, collective_axes="sm", init_carry=(jnp.int32(0), jnp.int32(0)))
        def _units(loop_info, carry):
            step, count = carry
            fields, split, head = units.unpack(loop_info.index[0])
            q_slot = lax.rem(count, 2)
            plgpu.barrier_wait(ring.q_ready.at[q_slot])
            step, out, lse = decode_unit(
                ring, config, step, q_slot, fields, units.stages(fields, split),
                rows=rows, scale=scale, sliding_window=sliding_window,
            )  # fmt: skip
            plgpu.barrier_arrive(ring.q_free.at[q_slot])
            target = layout.rows(fields[FIRST_TOK], head)
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            o_smem.transpose((1, 0))[...] = out.astype(dtype)
            lse_smem[...] = lse
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem, out_gmem.at[split, target])
            plgpu.copy_smem_to_gmem(lse_smem, lse_gmem.at[split, target])
            return step, count + 1

        plgpu.wait_smem_to_gmem(0)

    def scoped(q_smem, k_smem, v_smem, p_smem, o_smem, lse_smem, *barriers):
        ring = Ring(q_smem, k_smem, v_smem, p_smem, *barriers)
        wg = lax.axis_index("wg")
        pl.when(wg == 1)(
            lambda: stream_qkv(
                units, config, layout, 1, block_tables_gmem, q_gmem, k_gmem, v_gmem, ring
            )
        )
        pl.when(wg == 0)(lambda: compute(ring, o_smem, lse_smem))

    kv_ring = plgpu.SMEM(
        (config.num_stages, config.block_kv, head_dim), dtype,
        transforms=swizzled(head_dim, dtype),
    )  # fmt: skip
    pl.run_scoped(
        scoped,
        plgpu.SMEM((2, rows, head_dim), dtype, transforms=swizzled(head_dim, dtype)),
        kv_ring,
        kv_ring,
        plgpu.SMEM((rows, config.block_kv), dtype, transforms=swizzled(config.block_kv, dtype)),
        # Partial outputs are stored in q's dtype: a transposed store into float32 SMEM
        # does not lower, and the merge in float32 adds under one bf16 rounding.
        plgpu.SMEM((rows, head_dim), dtype, transforms=swizzled(head_dim, dtype)),
        plgpu.SMEM((rows,), jnp.float32),
        *ring_barriers(config, block_size, 1),
        collective_axes="wg",
    )


def decode_attention(
    q_rows: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    block_tables: jax.Array,
    meta: jax.Array,
    counts: jax.Array,
    *,
    config: AttentionConfig,
    layout: QueryLayout,
    num_splits: int,
    scale: float,
    sliding_window: int | None,
    num_sms: int,
) -> jax.Array:
    """Decode-only launch with `num_splits` KV splits; returns rows like q_rows (float32
    merged, cast to q's dtype). Rows of tokens in no request are undefined: mask them.

    meta, counts: `plan_work_items(..., tokens_per_tile=1)`; every item must hold one
    token.
    """
    num_rows, head_dim = q_rows.shape
    kernel = plgpu.kernel(
        functools.partial(
            _split_kernel,
            config=config,
            layout=layout,
            num_splits=num_splits,
            scale=scale,
            sliding_window=sliding_window,
        ),
        out_type=(
            jax.ShapeDtypeStruct((num_splits, num_rows, head_dim), q_rows.dtype),
            jax.ShapeDtypeStruct((num_splits, num_rows), jnp.float32),
        ),
        grid=(num_sms,),
        grid_names=("sm",),
        num_threads=2,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
    )
    partial_out, lse = kernel(meta, counts, block_tables, q_rows, k_cache, v_cache)
    return combine_splits(partial_out, lse).astype(q_rows.dtype)


def combine_splits(partial_out: jax.Array, lse: jax.Array) -> jax.Array:
    """Merge per-split normalised outputs [S, rows, D] by their log2-sum-exp [S, rows]:
    out = sum_s 2^(lse_s - max) out_s / sum_s 2^(lse_s - max), in float32."""
    top = jnp.max(lse, axis=0, keepdims=True)
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    weights = jnp.exp2(lse - top)
    total = jnp.sum(weights, axis=0)
    merged = jnp.sum(weights[..., None] * partial_out.astype(jnp.float32), axis=0)
    return merged / jnp.where(total > 0, total, 1.0)[..., None]

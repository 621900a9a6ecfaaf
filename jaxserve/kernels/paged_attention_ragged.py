"""The ragged paged attention kernel: any mix of prefill chunks and decode tokens.

A work item is a 64-row query tile of one request and one KV head: 64 / gp consecutive
tokens of the request, each contributing its gp = 8-aligned query-head rows (the query
packing of FlashAttention-3's PackGQA, Shah et al. 2024). Per key stage `tile_unit` runs
S = Q K^T (wgmma), the causal / sequence-length / sliding-window mask, the online
softmax in float32 (FlashAttention-2, Dao 2023) and O += P V (wgmma), after the
structure of JAX's `ops/gpu/attention_mgpu.py`. A tile that holds a single token (every
decode token, and the last token of some prefill chunks) runs the decode path instead
(`paged_attention_decode.decode_unit`), which does not pad the token's rows to 64. The
branch is per unit, on the device, so one launch serves any batch. The TMA warpgroup and
the work list are shared (`paged_attention_common.py`).
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
    NUM_TOKS,
    POS_FIRST,
    SEQ_LEN,
    QueryLayout,
    Ring,
    WorkUnits,
    ring_barriers,
    stream_qkv,
    swizzled,
)
from jaxserve.kernels.paged_attention_decode import decode_unit
from jaxserve.kernels.tile_table import AttentionConfig

TILE_ROWS = 64  # query rows of one work item: one warpgroup MMA


def tile_unit(
    ring: Ring,
    config: AttentionConfig,
    step: jax.Array,
    q_slot: jax.Array,
    fields: list,
    stages: tuple[jax.Array, jax.Array],
    *,
    rows_per_token: int,
    scale: float,
    sliding_window: int | None,
) -> tuple[jax.Array, jax.Array]:
    """Consume one unit's key stages from the ring for the 64-row query tile in slot
    `q_slot`; row i belongs to the tile's token i // rows_per_token.

    Returns (next ring step, out [64, D] float32 normalised; rows with no key are
    undefined and must not be stored).
    """
    block_kv, num_stages = config.block_kv, config.num_stages
    head_dim = ring.k_smem.shape[-1]
    dtype = ring.k_smem.dtype
    shape = (TILE_ROWS, block_kv)
    q_ref = ring.q_smem.at[q_slot]
    pos_first, seq_len = fields[POS_FIRST], fields[SEQ_LEN]

    def stage_body(stage, carry):
        step, acc, m_i, l_i = carry
        slot = lax.rem(step, num_stages)
        plgpu.barrier_wait(ring.k_ready.at[slot])

        def compute_qk(acc_ref):
            plgpu.wgmma(acc_ref, q_ref, ring.k_smem.at[slot].transpose((1, 0)))
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
        s = jnp.where(mask, qk * (scale * LOG2E), MASK_VALUE)
        m_ij = jnp.maximum(m_i, s.max(axis=1))
        alpha = jnp.exp2(m_i - m_ij)
        p = jnp.exp2(s - lax.broadcast_in_dim(m_ij, shape, [0]))
        l_i = l_i * alpha + p.sum(axis=1)
        acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
        # P goes through SMEM (the interpreter needs both wgmma operands there); the
        # previous stage's P @ V is complete (its accumulator was read).
        ring.p_smem[...] = p.astype(dtype)
        plgpu.commit_smem()
        plgpu.barrier_wait(ring.v_ready.at[slot])

        def compute_pv(acc_ref):
            plgpu.wgmma(acc_ref, ring.p_smem, ring.v_smem.at[slot])
            return acc_ref[...]

        acc = acc + pl.run_scoped(compute_pv, plgpu.ACC((TILE_ROWS, head_dim), jnp.float32))
        plgpu.barrier_arrive(ring.kv_free.at[slot])
        return step + 1, acc, m_ij, l_i

    row_layout = plgpu.Layout.WGMMA.reduce(1)
    m_i = plgpu.layout_cast(jnp.full((TILE_ROWS,), -jnp.inf, jnp.float32), row_layout)
    l_i = plgpu.layout_cast(jnp.full((TILE_ROWS,), 0.0, jnp.float32), row_layout)
    acc = plgpu.layout_cast(jnp.full((TILE_ROWS, head_dim), 0.0, jnp.float32), plgpu.Layout.WGMMA)
    step, acc, m_i, l_i = lax.fori_loop(*stages, stage_body, (step, acc, m_i, l_i))
    return step, acc / lax.broadcast_in_dim(l_i, acc.shape, [0])


def _kernel(
    meta_gmem,
    counts_gmem,
    block_tables_gmem,
    q_gmem,
    k_gmem,
    v_gmem,
    out_gmem,
    *,
    config: AttentionConfig,
    layout: QueryLayout,
    num_tokens: int,
    scale: float,
    sliding_window: int | None,
):
    """Kernel body: warpgroup 1 streams Q, K, V by TMA; warpgroup 0 computes each unit
    with `decode_unit` if its tile holds one token, else with `tile_unit`."""
    head_dim = q_gmem.shape[1]
    block_size, num_kv_heads = k_gmem.shape[1], k_gmem.shape[2]
    rows_per_token = layout.rows_per_token
    tokens_per_tile = TILE_ROWS // rows_per_token
    dtype = q_gmem.dtype
    units = WorkUnits(meta_gmem, counts_gmem[0], num_kv_heads, 1, config.block_kv)
    options = dict(scale=scale, sliding_window=sliding_window)

    def token_rows(i: int) -> pl.Slice:
        return pl.ds(i * rows_per_token, rows_per_token)

    def compute(ring: Ring):
        @plgpu.nd_loop(units.grid, collective_axes="sm", init_carry=(jnp.int32(0), jnp.int32(0)))
        def _units(loop_info, carry):
            step, count = carry
            fields, split, head = units.unpack(loop_info.index[0])
            q_slot = lax.rem(count, 2)
            stages = units.stages(fields, split)
            # The unit's query tile is done with once computed: the output is staged in
            # it (saves SMEM) and handed back to the TMA warpgroup after the stores.
            staging = ring.q_smem.at[q_slot]
            plgpu.barrier_wait(ring.q_ready.at[q_slot])

            def single_token():
                next_step, out, _ = decode_unit(
                    ring, config, step, q_slot, fields, stages, rows=rows_per_token, **options
                )
                staging.at[token_rows(0)].transpose((1, 0))[...] = out.astype(dtype)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(
                    staging.at[token_rows(0)], out_gmem.at[layout.rows(fields[FIRST_TOK], head)]
                )
                return next_step

            def tile():
                next_step, out = tile_unit(
                    ring, config, step, q_slot, fields, stages,
                    rows_per_token=rows_per_token, **options,
                )  # fmt: skip
                staging[...] = out.astype(dtype)
                plgpu.commit_smem()
                for i in range(tokens_per_tile):
                    token = fields[FIRST_TOK] + i

                    @pl.when(i < fields[NUM_TOKS])
                    def _store(token=token, i=i):
                        plgpu.copy_smem_to_gmem(
                            staging.at[token_rows(i)], out_gmem.at[layout.rows(token, head)]
                        )

                return next_step

            step = lax.cond(fields[NUM_TOKS] == 1, single_token, tile)
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            plgpu.barrier_arrive(ring.q_free.at[q_slot])
            return step, count + 1

        # Tokens in no request (the batch's padding) get zeros, stored from a query
        # buffer: every query load has been waited for and every tile stored by now.
        covered = counts_gmem[1]
        zeros = ring.q_smem.at[0]
        zeros[...] = plgpu.layout_cast(jnp.zeros((TILE_ROWS, head_dim), dtype), plgpu.Layout.WGMMA)
        plgpu.commit_smem()

        @plgpu.nd_loop(((num_tokens - covered) * num_kv_heads,), collective_axes="sm")
        def _zero_tail(loop_info):
            (lin,) = loop_info.index
            token = covered + lax.div(lin, num_kv_heads)
            head = lax.rem(lin, num_kv_heads)
            plgpu.copy_smem_to_gmem(zeros.at[token_rows(0)], out_gmem.at[layout.rows(token, head)])

        plgpu.wait_smem_to_gmem(0)

    def scoped(q_smem, k_smem, v_smem, p_smem, *barriers):
        ring = Ring(q_smem, k_smem, v_smem, p_smem, *barriers)
        wg = lax.axis_index("wg")
        pl.when(wg == 1)(
            lambda: stream_qkv(
                units,
                config,
                layout,
                tokens_per_tile,
                block_tables_gmem,
                q_gmem,
                k_gmem,
                v_gmem,
                ring,
            )  # fmt: skip
        )
        pl.when(wg == 0)(lambda: compute(ring))

    kv_ring = plgpu.SMEM(
        (config.num_stages, config.block_kv, head_dim), dtype,
        transforms=swizzled(head_dim, dtype),
    )  # fmt: skip
    pl.run_scoped(
        scoped,
        plgpu.SMEM((2, TILE_ROWS, head_dim), dtype, transforms=swizzled(head_dim, dtype)),
        kv_ring,
        kv_ring,
        plgpu.SMEM(
            (TILE_ROWS, config.block_kv), dtype, transforms=swizzled(config.block_kv, dtype)
        ),
        *ring_barriers(config, block_size, tokens_per_tile),
        collective_axes="wg",
    )


def ragged_attention(
    q_rows: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    block_tables: jax.Array,
    meta: jax.Array,
    counts: jax.Array,
    *,
    config: AttentionConfig,
    layout: QueryLayout,
    num_tokens: int,
    scale: float,
    sliding_window: int | None,
    num_sms: int,
) -> jax.Array:
    """Launch the ragged kernel on the packed query rows; returns rows like q_rows.

    meta, counts: `plan_work_items(..., tokens_per_tile=64 // layout.rows_per_token)`.
    """
    kernel = plgpu.kernel(
        functools.partial(
            _kernel,
            config=config,
            layout=layout,
            num_tokens=num_tokens,
            scale=scale,
            sliding_window=sliding_window,
        ),
        out_type=jax.ShapeDtypeStruct(q_rows.shape, q_rows.dtype),
        grid=(num_sms,),
        grid_names=("sm",),
        num_threads=2,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
    )
    return kernel(meta, counts, block_tables, q_rows, k_cache, v_cache)

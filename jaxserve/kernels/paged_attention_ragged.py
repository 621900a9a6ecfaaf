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
    NUM_TOKS,
    AttentionSpec,
    KernelInputs,
    Ring,
    WorkUnits,
    consume_units,
    launch,
    run_pipelined,
)
from jaxserve.kernels.paged_attention_decode import decode_unit
from jaxserve.kernels.paged_attention_flash import attend_stages

TILE_ROWS = 64  # query rows of one work item: one warpgroup MMA


def tile_unit(
    ring: Ring,
    spec: AttentionSpec,
    step: jax.Array,
    q_slot: jax.Array,
    fields: list,
    stages: tuple[jax.Array, jax.Array],
) -> tuple[jax.Array, jax.Array]:
    """Consume one unit's key stages from the ring for the 64-row query tile in slot
    `q_slot`, query-major (`paged_attention_flash.attend_stages`); row i belongs to the
    tile's token i // rows_per_token.

    Returns (next ring step, out [64, D] float32 normalised; rows with no key are
    undefined and must not be stored).
    """
    q_ref, p_ref = ring.q_smem.at[q_slot], ring.p_smem
    step, acc, _, l_i = attend_stages(
        ring, spec, step, stages, fields, q_ref=q_ref, p_ref=p_ref, keys_major=False
    )
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
    spec: AttentionSpec,
    num_tokens: int,
):
    """Kernel body: warpgroup 1 streams Q, K, V by TMA; warpgroup 0 computes each unit
    with `decode_unit` if its tile holds one token, else with `tile_unit`."""
    head_dim, dtype = q_gmem.shape[1], q_gmem.dtype
    layout, rows_per_token = spec.layout, spec.layout.rows_per_token
    tokens_per_tile = TILE_ROWS // rows_per_token
    num_kv_heads = k_gmem.shape[2]
    units = WorkUnits(meta_gmem, counts_gmem[0], num_kv_heads, 1, spec.config.block_kv)

    def token_rows(i: int) -> pl.Slice:
        return pl.ds(i * rows_per_token, rows_per_token)

    def compute(ring: Ring):
        def unit(step, q_slot, fields, split, head):
            stages = units.stages(fields, split)
            # The unit's query tile is done with once computed: the output is staged in
            # it (saves SMEM) and handed back to the TMA warpgroup after the stores.
            staging = ring.q_smem.at[q_slot]

            def single_token():
                next_step, out, _ = decode_unit(ring, spec, step, q_slot, fields, stages)
                staging.at[token_rows(0)].transpose((1, 0))[...] = out.astype(dtype)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(
                    staging.at[token_rows(0)], out_gmem.at[layout.rows(fields[FIRST_TOK], head)]
                )
                return next_step

            def tile():
                next_step, out = tile_unit(ring, spec, step, q_slot, fields, stages)
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
            return step

        consume_units(units, ring, unit)

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

    run_pipelined(
        units, spec, tokens_per_tile, TILE_ROWS, block_tables_gmem, q_gmem, k_gmem, v_gmem,
        compute,
    )  # fmt: skip


def ragged_attention(
    inputs: KernelInputs, spec: AttentionSpec, *, num_tokens: int, num_sms: int
) -> jax.Array:
    """Launch the ragged kernel over `num_sms` persistent CTAs; returns rows like
    inputs.q_rows (rows of tokens >= counts[1], the padding, are 0).

    inputs.meta, inputs.counts: `plan_work_items(..., tokens_per_tile=64 //
    rows_per_token)`.
    """
    body = functools.partial(_kernel, spec=spec, num_tokens=num_tokens)
    out_type = jax.ShapeDtypeStruct(inputs.q_rows.shape, inputs.q_rows.dtype)
    return launch(body, out_type, num_sms, inputs)

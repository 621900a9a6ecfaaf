"""Decode paged attention: one query token per work unit.

A decode token brings only g query heads per KV head (8 for Qwen3-30B-A3B), far fewer
than the 64 rows of a wgmma. So the products run transposed, with the keys as the MMA's
rows ("swap AB"): S^T = K Q^T ([block_kv, gp]) and O^T += V^T P^T ([D, gp]), and the
online softmax (FlashAttention-2, Dao 2023) reduces over axis 0
(`paged_attention_flash.attend_stages`, key-major). Nothing is padded to 64 rows: the
softmax works on block_kv x gp scores, not 64 x block_kv.

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
    AttentionSpec,
    KernelInputs,
    Ring,
    WorkUnits,
    consume_units,
    launch,
    run_pipelined,
    swizzled,
)
from jaxserve.kernels.paged_attention_flash import attend_stages


def decode_unit(
    ring: Ring,
    spec: AttentionSpec,
    step: jax.Array,
    q_slot: jax.Array,
    fields: list,
    stages: tuple[jax.Array, jax.Array],
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Consume one unit's key stages from the ring for the token of `fields`, key-major
    (`paged_attention_flash.attend_stages`).

    The token's gp = rows_per_token query rows are rows [0, gp) of query slot `q_slot`.

    Returns:
      (next ring step, out^T [D, gp] float32 normalised, log2-sum-exp [gp] float32);
      an empty stage range gives out 0 and lse -inf.
    """
    rows = spec.layout.rows_per_token
    q_ref, p_ref = ring.q_smem.at[q_slot, pl.ds(0, rows)], ring.p_smem.at[pl.ds(0, rows)]
    step, acc, m_i, l_i = attend_stages(
        ring, spec, step, stages, fields, q_ref=q_ref, p_ref=p_ref, keys_major=True
    )
    l_safe = jnp.where(l_i > 0.0, l_i, 1.0)
    out = acc / lax.broadcast_in_dim(l_safe, acc.shape, [1])
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
    spec: AttentionSpec,
    num_splits: int,
):
    """Decode-only launch with KV splits: partial outputs [splits, rows, D] (q's dtype) and
    their log2-sum-exp [splits, rows] float32. Rows of tokens in no request are left unwritten
    (the combine step masks them)."""
    head_dim, dtype = q_gmem.shape[1], q_gmem.dtype
    layout, rows = spec.layout, spec.layout.rows_per_token
    num_kv_heads = k_gmem.shape[2]
    units = WorkUnits(meta_gmem, counts_gmem[0], num_kv_heads, num_splits, spec.config.block_kv)

    def compute(ring: Ring, o_smem, lse_smem):
        def unit(step, q_slot, fields, split, head):
            stages = units.stages(fields, split)
            step, out, lse = decode_unit(ring, spec, step, q_slot, fields, stages)
            plgpu.barrier_arrive(ring.q_free.at[q_slot])
            target = layout.rows(fields[FIRST_TOK], head)
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            o_smem.transpose((1, 0))[...] = out.astype(dtype)
            lse_smem[...] = lse
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem, out_gmem.at[split, target])
            plgpu.copy_smem_to_gmem(lse_smem, lse_gmem.at[split, target])
            return step

        consume_units(units, ring, unit)
        plgpu.wait_smem_to_gmem(0)

    run_pipelined(
        units, spec, 1, rows, block_tables_gmem, q_gmem, k_gmem, v_gmem, compute,
        # Partial outputs are stored in q's dtype: a transposed store into float32 SMEM
        # does not lower, and the merge in float32 adds under one bf16 rounding.
        plgpu.SMEM((rows, head_dim), dtype, transforms=swizzled(head_dim, dtype)),
        plgpu.SMEM((rows,), jnp.float32),
    )  # fmt: skip


def decode_attention(
    inputs: KernelInputs, spec: AttentionSpec, *, num_splits: int, num_sms: int
) -> jax.Array:
    """Decode-only launch with `num_splits` KV splits over `num_sms` persistent CTAs;
    returns rows like inputs.q_rows (float32 merged, cast to q's dtype). Rows of tokens
    in no request are undefined: mask them.

    inputs.meta, inputs.counts: `plan_work_items(..., tokens_per_tile=1)` (every item
    holds one token).
    """
    num_rows, head_dim = inputs.q_rows.shape
    dtype = inputs.q_rows.dtype
    out_type = (
        jax.ShapeDtypeStruct((num_splits, num_rows, head_dim), dtype),
        jax.ShapeDtypeStruct((num_splits, num_rows), jnp.float32),
    )
    body = functools.partial(_split_kernel, spec=spec, num_splits=num_splits)
    partial_out, lse = launch(body, out_type, num_sms, inputs)
    return combine_splits(partial_out, lse).astype(dtype)


def combine_splits(partial_out: jax.Array, lse: jax.Array) -> jax.Array:
    """Merge per-split normalised outputs [S, rows, D] by their log2-sum-exp [S, rows]:
    out = sum_s 2^(lse_s - max) out_s / sum_s 2^(lse_s - max), in float32."""
    top = jnp.max(lse, axis=0, keepdims=True)
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    weights = jnp.exp2(lse - top)
    total = jnp.sum(weights, axis=0)
    merged = jnp.sum(weights[..., None] * partial_out.astype(jnp.float32), axis=0)
    return merged / jnp.where(total > 0, total, 1.0)[..., None]

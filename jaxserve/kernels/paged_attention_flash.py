"""The FlashAttention inner loop of the paged attention kernels: one work unit's key
stages, consumed from the ring that `paged_attention_common.stream_qkv` fills.

Per stage of block_kv keys: S = Q K^T (wgmma), the causal / sequence-length /
sliding-window mask, the online softmax in float32 (FlashAttention-2, Dao 2023), and
O += P V (wgmma). Scores are kept in log2 units (exp2 is the native instruction).

The loop runs in one of two operand orientations:

- query-major (`keys_major=False`, the ragged kernel's 64-row tiles): S is
  [rows, block_kv] and O is [rows, D], as in JAX's `ops/gpu/attention_mgpu.py`;
- key-major (`keys_major=True`, "swap AB", the decode path): a decode token brings only
  gp = 8..16 query rows, far fewer than the 64 rows of a wgmma, so the keys are the
  MMA's rows: S^T = K Q^T ([block_kv, rows]) and O^T += V^T P^T ([D, rows]), and the
  softmax reduces over axis 0. Nothing is padded to 64 rows.
"""

from __future__ import annotations

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from jaxserve.kernels.paged_attention_common import (
    LOG2E,
    MASK_VALUE,
    POS_FIRST,
    SEQ_LEN,
    AttentionSpec,
    Ring,
)


def online_softmax_step(
    s: jax.Array, m_i: jax.Array, l_i: jax.Array, acc: jax.Array, *, key_axis: int
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Fold one stage of scores into the running softmax (FlashAttention-2, Dao 2023).

    Args:
      s: [2-D] float32 masked scores in log2 units; axis `key_axis` runs over keys, the
        other over query rows.
      m_i, l_i: [rows] float32 running max and running sum of 2^(s - m_i).
      acc: [2-D] float32 unnormalised output; its query axis is s's query axis.
      key_axis: 0 or 1.

    Returns:
      (p = 2^(s - m_new) like s, m_new, l_new, acc rescaled to m_new); the caller adds
      P V to the rescaled acc.
    """
    query_axis = 1 - key_axis
    m_new = jnp.maximum(m_i, s.max(axis=key_axis))
    alpha = jnp.exp2(m_i - m_new)
    p = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [query_axis]))
    l_new = l_i * alpha + p.sum(axis=key_axis)
    acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [query_axis])
    return p, m_new, l_new, acc


def attend_stages(
    ring: Ring,
    spec: AttentionSpec,
    step: jax.Array,
    stages: tuple[jax.Array, jax.Array],
    fields: list,
    *,
    q_ref,
    p_ref,
    keys_major: bool,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Consume key stages [stages[0], stages[1]) of one unit from the ring.

    Waits for each stage's K and V (k_ready, v_ready) and releases its ring slot
    (kv_free) once P V is complete.

    Args:
      ring: the CTA's shared buffers; stage i lies in ring slot step % num_stages.
      spec: block_kv, ring depth, rows per token, scale and sliding window.
      step: ring step of the first stage (int32 scalar; counts across units).
      stages: [first, last) key stages; keys of stage i are [i * block_kv, + block_kv).
      fields: the unit's item fields (`WorkUnits.unpack`): its first query position
        and its request's context length (keys >= seq_len are masked).
      q_ref: [rows, D] query rows in SMEM; row r belongs to the tile's token
        r // rows_per_token, at position pos_first + r // rows_per_token.
      p_ref: [rows, block_kv] SMEM staging of P (the second MMA's operand).
      keys_major: run key-major (S^T, O^T), see the module docstring.

    Returns:
      (next ring step, acc, m_i, l_i): acc float32 unnormalised, [D, rows] if
      keys_major else [rows, D]; m_i, l_i [rows] float32 (max and sum of 2^(s - m_i) in
      log2 units). A row with no unmasked key has l_i = 0 (or, with an empty stage range,
      m_i = -inf); the caller normalises.
    """
    config, rows_per_token = spec.config, spec.layout.rows_per_token
    scale, sliding_window = spec.scale, spec.sliding_window
    pos_first, seq_len = fields[POS_FIRST], fields[SEQ_LEN]
    block_kv, num_stages = config.block_kv, config.num_stages
    rows, head_dim = q_ref.shape
    dtype = ring.k_smem.dtype
    key_axis = 0 if keys_major else 1
    scores_shape = (block_kv, rows) if keys_major else (rows, block_kv)
    out_shape = (head_dim, rows) if keys_major else (rows, head_dim)
    # P is stored [rows, block_kv] (keys contiguous) in both orientations: the K-major
    # operand the second wgmma wants.
    p_view = p_ref.transpose((1, 0)) if keys_major else p_ref

    def qk_operands(slot):
        k = ring.k_smem.at[slot]
        return (k, q_ref.transpose((1, 0))) if keys_major else (q_ref, k.transpose((1, 0)))

    def pv_operands(slot):
        v = ring.v_smem.at[slot]
        return (v.transpose((1, 0)), p_view) if keys_major else (p_ref, v)

    def mma(shape, operands):
        def body(acc_ref):
            plgpu.wgmma(acc_ref, *operands)
            return acc_ref[...]

        return pl.run_scoped(body, plgpu.ACC(shape, jnp.float32))

    def iota(axis):
        return plgpu.broadcasted_iota(jnp.int32, scores_shape, axis, layout=plgpu.Layout.WGMMA)

    def stage_body(stage, carry):
        step, acc, m_i, l_i = carry
        slot = lax.rem(step, num_stages)
        plgpu.barrier_wait(ring.k_ready.at[slot])
        qk = mma(scores_shape, qk_operands(slot))
        k_pos = stage * block_kv + iota(key_axis)
        if rows == rows_per_token:  # one token: every row has the same position
            q_pos = pos_first
        else:
            q_pos = pos_first + lax.div(iota(1 - key_axis), rows_per_token)
        mask = (k_pos <= q_pos) & (k_pos < seq_len)
        if sliding_window is not None:
            mask = mask & (q_pos - k_pos < sliding_window)
        s = jnp.where(mask, qk * (scale * LOG2E), MASK_VALUE)
        p, m_i, l_i, acc = online_softmax_step(s, m_i, l_i, acc, key_axis=key_axis)
        # P goes through SMEM (the interpreter needs both wgmma operands there); the
        # previous stage's P V is complete (its accumulator was read).
        p_view[...] = p.astype(dtype)
        plgpu.commit_smem()
        plgpu.barrier_wait(ring.v_ready.at[slot])
        acc = acc + mma(out_shape, pv_operands(slot))
        plgpu.barrier_arrive(ring.kv_free.at[slot])
        return step + 1, acc, m_i, l_i

    row_layout = plgpu.Layout.WGMMA.reduce(key_axis)
    m_i = plgpu.layout_cast(jnp.full((rows,), -jnp.inf, jnp.float32), row_layout)
    l_i = plgpu.layout_cast(jnp.full((rows,), 0.0, jnp.float32), row_layout)
    acc = plgpu.layout_cast(jnp.full(out_shape, 0.0, jnp.float32), plgpu.Layout.WGMMA)
    return lax.fori_loop(*stages, stage_body, (step, acc, m_i, l_i))

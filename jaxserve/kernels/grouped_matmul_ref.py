"""Pure-jnp references of the MoE grouped matmul kernels (`grouped_matmul.py`).

These are the CPU path of the engine and the oracle of the kernel tests, so they favour
plain, exact code: each row is multiplied by its own expert's matrix (a gather of the
weights in row batches), never by every expert, and `lax.ragged_dot` is not used (on
the CPU it is lowered to a dense product over all groups).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

# Rows per batch of the weight gather: bounds the [rows, K, N] gathered weights.
_ROW_BATCH_ELEMENTS = 1 << 24


def row_group_ids(group_sizes: jax.Array, m: int) -> tuple[jax.Array, jax.Array]:
    """Group of each of m rows sorted by group, and whether the row belongs to any group.

    Args:
      group_sizes: [G] integer rows per group; negative counts as 0.
      m: number of rows.

    Returns:
      (group [m] int32 in [0, G), valid [m] bool); rows past sum(group_sizes) have
      valid False (and group clamped to G - 1).
    """
    ends = jnp.cumsum(jnp.maximum(group_sizes.astype(jnp.int32), 0))
    rows = jnp.arange(m, dtype=jnp.int32)
    group = jnp.searchsorted(ends, rows, side="right").astype(jnp.int32)
    return jnp.minimum(group, group_sizes.shape[0] - 1), rows < ends[-1]


def grouped_matmul_ref(
    x: jax.Array,
    w: jax.Array,
    group_sizes: jax.Array,
    *,
    preferred_element_type=None,
) -> jax.Array:
    """out[r] = x[r] @ w[g(r)] over rows sorted by group (`lax.ragged_dot` semantics).

    Args:
      x: [M, K], rows sorted by group.
      w: [G, K, N], same dtype as x.
      group_sizes: [G] int32 rows per group; rows past their sum give 0.
      preferred_element_type: output dtype (float32 accumulation); x.dtype if None.

    Returns:
      [M, N] of preferred_element_type.

    Raises:
      ValueError: if the shapes disagree.
    """
    if x.ndim != 2 or w.ndim != 3 or w.shape[1] != x.shape[1]:
        raise ValueError(f"x [M, K] and w [G, K, N] disagree: x {x.shape}, w {w.shape}")
    if group_sizes.shape != (w.shape[0],):
        raise ValueError(f"group_sizes: expected [G={w.shape[0]}], got {group_sizes.shape}")
    m, k = x.shape
    n = w.shape[2]
    out_dtype = preferred_element_type or x.dtype
    group, valid = row_group_ids(group_sizes, m)

    def row(args):
        x_row, g = args
        return jnp.dot(x_row, w[g], preferred_element_type=jnp.float32)

    batch = max(1, min(m, _ROW_BATCH_ELEMENTS // max(k * n, 1)))
    out = lax.map(row, (x, group), batch_size=batch) if m else jnp.zeros((0, n), jnp.float32)
    return jnp.where(valid[:, None], out, 0.0).astype(out_dtype)


def silu_mul(gate: jax.Array, up: jax.Array) -> jax.Array:
    """SiLU(gate) * up in float32 (the SwiGLU activation, Shazeer 2020)."""
    gate = gate.astype(jnp.float32)
    return gate * jax.nn.sigmoid(gate) * up.astype(jnp.float32)


def grouped_matmul_gate_up_ref(
    x: jax.Array, w_gate: jax.Array, w_up: jax.Array, group_sizes: jax.Array
) -> jax.Array:
    """SiLU(x @ w_gate[g]) * (x @ w_up[g]) per group; [M, H] -> [M, I] in x.dtype.

    The epilogue runs on the float32 accumulators, as in the fused kernel.
    """
    gate = grouped_matmul_ref(x, w_gate, group_sizes, preferred_element_type=jnp.float32)
    up = grouped_matmul_ref(x, w_up, group_sizes, preferred_element_type=jnp.float32)
    return silu_mul(gate, up).astype(x.dtype)


def moe_ffn_ref(
    x_sorted: jax.Array,
    group_sizes: jax.Array,
    w_gate: jax.Array,
    w_up: jax.Array,
    w_down: jax.Array,
) -> jax.Array:
    """The SwiGLU expert MLP of every row, rows sorted by expert (HF Qwen3MoeMLP).

    Args:
      x_sorted: [M, H] activations, rows sorted by expert.
      group_sizes: [E] int32 rows per expert; rows past their sum give 0.
      w_gate, w_up: [E, H, I].
      w_down: [E, I, H].

    Returns:
      [M, H] in x_sorted.dtype: down(SiLU(gate(x)) * up(x)) with the expert's weights;
      the [M, I] intermediate is rounded to x_sorted.dtype, as the kernels store it.
    """
    hidden = grouped_matmul_gate_up_ref(x_sorted, w_gate, w_up, group_sizes)
    return grouped_matmul_ref(hidden, w_down, group_sizes)

"""Sparse SwiGLU experts off the NVIDIA GPU: only the routed (token copy, expert) rows.

The CPU (and any non-kernel) path of the MoE experts, for the single-device model
(`moe_experts.moe_experts_local`) and for the local expert FFN of expert parallelism
(`jaxserve.sharding.moe_ep.local_expert_ffn`). The Pallas grouped matmul stays the NVIDIA
path (`jaxserve.kernels.dispatch`); `moe_experts.moe_experts_dense` (every token through
every expert, E/k times the work) stays as the test oracle.

Algorithm (the block-sparse layout of MegaBlocks, Gale et al. 2022, with one expert per
block instead of a block-sparse matmul):
    1. the N = T*k token copies are sorted by expert (stable argsort);
    2. each expert's rows are padded to a multiple of the block size B, so that every
       block of B rows belongs to one expert; the number of blocks has the static bound
       nb = (N + m*(B - 1)) // B with m = min(E, N) (`padded_rows`), whatever the routing;
    3. each block runs SwiGLU with its expert's weights, gathered per block; blocks are
       processed in chunks (`lax.map`) so that the gathered weights stay under
       `GATHER_ELEMENTS` (a cache-sized chunk beats one large gather);
    4. the rows are un-sorted back to their token copies.
B = 1 is the decode fast path: no sort, each copy gathers its own expert's weights.
Shapes are static (no host sync), and `lax.ragged_dot`, dense on the CPU, is not used.

With block_size None, `sparse_expert_ffn` picks the layout from the routed rows N:
on the CPU with float32 weights, below `cpu_moe.MAX_MEAN_GROUP` rows per expert, the
C++ kernel (`jaxserve.kernels.cpu_moe`: weights read in place, which no XLA layout here
manages on the CPU); otherwise the block layout below `LOOP_MIN_ROWS`, the expert
loop (`moe_loop`: each expert's weights sliced once, its rows in chunks of B) from
there, and from
`moe_capacity.CAPACITY_MIN_MEAN_GROUP` rows per expert the capacity layout
(`moe_capacity`: every expert's first C rows in one batched matmul, the overflow through
the expert loop, or the loop alone when the routing is too skewed for any capacity to
keep the work within MAX_PADDING).

The block size is chosen from the static row count (`block_size_for`): the largest power
of two up to `MAX_BLOCK_SIZE` whose worst-case padding keeps the work within
`MAX_PADDING` (1.3x) of the routed rows; small batches (N <= E, decode) get B = 1.
`MAX_BLOCK_SIZE` comes from `scripts/bench_moe.py` (see that script's table).

Numerics: the same rounding points as the grouped-matmul kernels and their reference
(`grouped_matmul_ref.moe_ffn_ref`): float32 products and activation, the [rows, I]
intermediate stored in x.dtype, each expert output rounded to x.dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jaxserve.models import moe_capacity
from jaxserve.models.moe_loop import expert_loop_ffn, loop_levels_for, swiglu_rows

# Most work the static padding may add over the routed rows (worst case, any routing).
MAX_PADDING = 1.3
# Largest block size (rows per expert block); measured by scripts/bench_moe.py.
MAX_BLOCK_SIZE = 64
# Elements of gathered expert weights (3 matrices per block) per chunk of blocks: 2 MiB of
# float32, a cache-sized temporary whatever the batch. Measured (`bench_moe.py --gather`):
# 2^24 (one big gather) ran 2-10x slower on the Qwen3-MoE-like layer at 8-512 tokens.
GATHER_ELEMENTS = 1 << 19
# Routed rows (tokens x top-k) from which the default path is the expert loop.
LOOP_MIN_ROWS = 16


def check_expert_shapes(fn: str, x, ids, w_gate, w_up, w_down) -> None:
    """Raise ValueError (naming `fn` and the arrays) unless x [T, H], ids [T, k], w_gate
    and w_up [E, H, I], w_down [E, I, H] agree. The weights may be any objects with a
    `shape` (arrays, `moe_slices.ExpertSlices`)."""
    if x.ndim != 2 or ids.ndim != 2 or ids.shape[0] != x.shape[0]:
        raise ValueError(f"{fn}: x [T, H] and ids [T, k] disagree: {x.shape}, {ids.shape}")
    num_experts, hidden, inter = w_gate.shape
    if (
        hidden != x.shape[1]
        or w_up.shape != w_gate.shape
        or w_down.shape != (num_experts, inter, hidden)
    ):
        raise ValueError(
            f"{fn}: weights disagree with x [T, {x.shape[1]}]: w_gate "
            f"{w_gate.shape}, w_up {w_up.shape}, w_down {w_down.shape}"
        )


def padded_rows(num_rows: int, num_experts: int, block_size: int) -> int:
    """Rows the sparse experts compute for `num_rows` routed rows: the static number of
    blocks times `block_size`, the worst case over every routing.

    Each expert's g_e rows fill ceil(g_e / B) blocks, and sum_e ceil(g_e / B) <=
    (N + m*(B - 1)) / B with m = min(E, N) experts holding rows.

    Raises ValueError if a count is negative or block_size < 1.
    """
    if num_rows < 0 or num_experts < 1 or block_size < 1:
        raise ValueError(
            f"padded_rows: need num_rows >= 0, num_experts >= 1, block_size >= 1, got "
            f"{num_rows}, {num_experts}, {block_size}"
        )
    m = min(num_experts, num_rows)
    return (num_rows + m * (block_size - 1)) // block_size * block_size


def block_size_for(num_rows: int, num_experts: int, max_block: int = MAX_BLOCK_SIZE) -> int:
    """The block size for `num_rows` routed rows over `num_experts` experts: the largest
    power of two <= max_block with padded_rows <= MAX_PADDING * num_rows (1 if none)."""
    block = 1
    while (
        block * 2 <= max_block
        and padded_rows(num_rows, num_experts, block * 2) <= MAX_PADDING * num_rows
    ):
        block *= 2
    return block


def sparse_moe_flops(
    num_tokens: int,
    top_k: int,
    num_experts: int,
    block_size: int,
    hidden: int,
    inter: int,
) -> int:
    """Matmul FLOPs (2 per multiply-add) of `sparse_expert_ffn` on [num_tokens, top_k]
    copies: gate and up [rows, H] @ [H, I], down [rows, I] @ [I, H] over the padded rows.
    The routed work is the same with num_tokens * top_k rows."""
    return padded_rows(num_tokens * top_k, num_experts, block_size) * 6 * hidden * inter


def _blocks(
    x_blocks: jax.Array,
    block_expert: jax.Array,
    w_gate: jax.Array,
    w_up: jax.Array,
    w_down: jax.Array,
) -> jax.Array:
    """SwiGLU of nb blocks [nb, B, H], block b with expert block_expert[b], in chunks of
    blocks whose gathered weights fit GATHER_ELEMENTS. Returns [nb, B, H]."""
    num_blocks = x_blocks.shape[0]
    hidden, inter = w_gate.shape[1:]
    chunk = max(1, min(num_blocks, GATHER_ELEMENTS // (3 * hidden * inter)))

    if chunk >= num_blocks:
        e = block_expert
        return swiglu_rows(x_blocks, w_gate[e], w_up[e], w_down[e], x_blocks.dtype)

    def one_block(args: tuple[jax.Array, jax.Array]) -> jax.Array:
        xs, e = args  # [B, H], scalar: vectorized by lax.map into one gather per chunk
        return swiglu_rows(xs[None], w_gate[e][None], w_up[e][None], w_down[e][None],
                           xs.dtype)[0]  # fmt: skip

    # lax.map with batch_size: a scan over chunks of blocks, each chunk vectorized.
    return lax.map(one_block, (x_blocks, block_expert), batch_size=chunk)


def sparse_expert_ffn(
    x: jax.Array,
    ids: jax.Array,
    w_gate: jax.Array,
    w_up: jax.Array,
    w_down: jax.Array,
    *,
    block_size: int | None = None,
) -> jax.Array:
    """SwiGLU (Shazeer 2020) of each token copy with its own expert, computing only the
    routed rows (see the module docstring).

    Args:
        x: [T, H] activations.
        ids: [T, k] int32 expert of each of a token's k copies, in [0, E]; E marks an
            empty copy (output 0, no work beyond the static padding).
        w_gate, w_up: [E, H, I]; w_down: [E, I, H].
        block_size: rows per expert block; None: the layout of the module docstring
            (the CPU kernel, the block layout with `block_size_for(T * k, E)`, the
            expert loop with chunks of that size, or the capacity layout).

    Returns:
        [T, k, H] in x.dtype: expert_{ids[t, j]}(x[t]), 0 for empty copies.

    Raises:
        ValueError: if the shapes disagree or block_size < 1.
    """
    from jaxserve.kernels import cpu_moe  # noqa: PLC0415 -- kernels import models

    check_expert_shapes("sparse_expert_ffn", x, ids, w_gate, w_up, w_down)
    num_experts, hidden, _ = w_gate.shape
    num_tokens, top_k = ids.shape
    n = num_tokens * top_k
    if block_size is None and cpu_moe.applies(x, n, num_experts, (w_gate, w_up, w_down)):
        return cpu_moe.moe_rows_ffn(x, ids, w_gate, w_up, w_down)
    # Weights the engine holds panel-major (`cpu_moe.ExpertPanels`) where the kernel does
    # not run (a prefill past MAX_MEAN_GROUP_TILED rows an expert, the kernel switched
    # off at trace time): the XLA paths below take them unpacked, a copy in the step.
    w_gate, w_up, w_down = (cpu_moe.logical(w) for w in (w_gate, w_up, w_down))
    if block_size is None:
        if n >= LOOP_MIN_ROWS:
            chunk = block_size_for(n, num_experts)
            levels = loop_levels_for(n, num_experts, chunk)
            if moe_capacity.uses_capacity(n, num_experts):
                return moe_capacity.capacity_expert_ffn(
                    x, ids, w_gate, w_up, w_down, chunk=chunk, levels=levels,
                    max_padding=MAX_PADDING,
                )  # fmt: skip
            return expert_loop_ffn(x, ids, w_gate, w_up, w_down, chunk=chunk, levels=levels)
        block_size = block_size_for(n, num_experts)
    if block_size < 1:
        raise ValueError(f"sparse_expert_ffn: block_size must be >= 1, got {block_size}")
    if n == 0:
        return jnp.zeros((num_tokens, top_k, hidden), x.dtype)
    flat = ids.reshape(n).astype(jnp.int32)
    valid = flat < num_experts

    if block_size == 1:  # decode: one block per copy, in copy order, no sort
        rows = jnp.repeat(x, top_k, axis=0)[:, None]  # [n, 1, H]
        out = _blocks(rows, jnp.minimum(flat, num_experts - 1), w_gate, w_up, w_down)[:, 0]
        out = jnp.where(valid[:, None], out, 0)
        return out.reshape(num_tokens, top_k, hidden)

    b = block_size
    padded = padded_rows(n, num_experts, b)
    num_blocks = padded // b
    sizes = jnp.zeros(num_experts, jnp.int32).at[flat].add(1, mode="drop")
    blocks_per_expert = (sizes + b - 1) // b
    block_end = jnp.cumsum(blocks_per_expert)  # [E] first block past expert e
    block_start = block_end - blocks_per_expert
    row_start = jnp.cumsum(sizes) - sizes  # [E] first sorted row of expert e

    order = jnp.argsort(flat, stable=True)  # sorted row r is copy order[r]
    sorted_ids = flat[order]
    e = jnp.minimum(sorted_ids, num_experts - 1)
    rank = jnp.arange(n, dtype=jnp.int32) - row_start[e]
    dest = jnp.where(sorted_ids < num_experts, block_start[e] * b + rank, padded)
    # Padded row -> source token (num_tokens: a zero row); empty copies are dropped.
    source = jnp.full(padded, num_tokens, jnp.int32).at[dest].set(order // top_k, mode="drop")
    x_pad = jnp.concatenate([x, jnp.zeros((1, hidden), x.dtype)])
    x_blocks = x_pad[source].reshape(num_blocks, b, hidden)
    # Unused blocks (past block_end[-1]) get the last expert: their rows are zero rows.
    block_expert = jnp.searchsorted(block_end, jnp.arange(num_blocks), side="right")
    block_expert = jnp.minimum(block_expert, num_experts - 1).astype(jnp.int32)

    y = _blocks(x_blocks, block_expert, w_gate, w_up, w_down).reshape(padded, hidden)
    copy_dest = jnp.zeros(n, jnp.int32).at[order].set(dest)
    out = y.at[copy_dest].get(mode="fill", fill_value=0)  # padded (empty) -> 0
    return out.reshape(num_tokens, top_k, hidden)


def moe_experts_sparse(
    x: jax.Array,
    topk_weights: jax.Array,
    topk_ids: jax.Array,
    w_gate: jax.Array,
    w_up: jax.Array,
    w_down: jax.Array,
    *,
    block_size: int | None = None,
) -> jax.Array:
    """The MoE experts of a token batch, sparse: sum_j topk_weights[t, j] *
    expert_{topk_ids[t, j]}(x[t]); the contract of `moe_experts.moe_experts_dense`.

    x: [T, H]; topk_weights: [T, k]; topk_ids: [T, k] int32 in [0, E);
    w_gate, w_up: [E, H, I]; w_down: [E, I, H]. Returns [T, H] in x.dtype (the weighted
    sum in float32, rounded once). block_size: see `sparse_expert_ffn`.
    """
    y = sparse_expert_ffn(x, topk_ids, w_gate, w_up, w_down, block_size=block_size)
    return combine_copies(topk_weights, y, x.dtype)


def combine_copies(topk_weights: jax.Array, y: jax.Array, dtype) -> jax.Array:
    """sum_j topk_weights[t, j] * y[t, j]: [T, k], [T, k, H] -> [T, H] in dtype (the sum
    in float32, rounded once)."""
    combined = jnp.einsum("tk,tkh->th", topk_weights.astype(jnp.float32), y.astype(jnp.float32))
    return combined.astype(dtype)

"""The expert loop of the sparse experts: token copies sorted by expert, one expert at a
time, its weights sliced once and its rows run in chunks.

`moe_sparse.sparse_expert_ffn` runs this from `moe_sparse.LOOP_MIN_ROWS` routed rows up
(below `moe_capacity`'s batch sizes, and as its fallback on a skewed routing), and
`moe_slices` runs the same loop body over per-expert weight arrays. A `lax.fori_loop`
runs over the experts that hold rows; each expert's rows run in chunks of up to three
sizes, the smallest the block size B of `moe_sparse.block_size_for` (so the same
worst-case padding; `loop_levels_for` picks the sizes), instead of the block layout's
gathered copy of an expert's weights per block. Measured with one chunk size
(`scripts/bench_moe.py --loop 4,16`, Qwen3-MoE-like layer, load 9-10): 65.0 -> 28.3 ms at
128 tokens, 17.0 -> 13.0 at 32, 7.0 -> 3.7 at 8, and a tie at 1 token (0.54 vs 0.59 ms),
where the block path stays.

Numerics: as `moe_sparse` (`swiglu_rows`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

# Chunk sizes of the expert loop: chunk, 4 x chunk, 16 x chunk (`loop_chunk_sizes`); the
# default path keeps those up to the mean group (`loop_levels_for`).
LOOP_LEVELS = 3


def swiglu_rows(
    x: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array, dtype
) -> jax.Array:
    """Row batches with their own weights: x [n, B, H], w_* [n, H, I] / [n, I, H] ->
    [n, B, H] in dtype (float32 products, intermediate rounded to dtype)."""
    f32 = jnp.float32
    x32 = x.astype(f32)
    gate = jnp.einsum("nbh,nhi->nbi", x32, w_gate.astype(f32))
    up = jnp.einsum("nbh,nhi->nbi", x32, w_up.astype(f32))
    hidden = (jax.nn.silu(gate) * up).astype(dtype).astype(f32)
    return jnp.einsum("nbi,nih->nbh", hidden, w_down.astype(f32)).astype(dtype)


def loop_chunk_sizes(chunk: int, levels: int = LOOP_LEVELS) -> tuple[int, ...]:
    """The chunk sizes of the expert loop, largest first: chunk * 4^(levels-1), ..., chunk.

    Raises ValueError if chunk or levels < 1."""
    if chunk < 1 or levels < 1:
        raise ValueError(f"loop_chunk_sizes: need chunk >= 1, levels >= 1, got {chunk}, {levels}")
    return tuple(chunk * 4**i for i in reversed(range(levels)))


def loop_levels_for(num_rows: int, num_experts: int, chunk: int) -> int:
    """The default path's number of chunk sizes (at most LOOP_LEVELS): the sizes up to the
    mean group, max(chunk, ceil(num_rows / num_experts)). A larger size would rarely hold
    a whole chunk, and each size costs every expert one more loop, which at decode sizes
    (a row or two per expert) costs more than it saves: there it is the one-size loop."""
    top = max(chunk, -(-num_rows // num_experts))
    return sum(1 for size in loop_chunk_sizes(chunk) if size <= top)


def expert_loop_ffn(
    x: jax.Array,
    ids: jax.Array,
    w_gate: jax.Array,
    w_up: jax.Array,
    w_down: jax.Array,
    *,
    chunk: int,
    levels: int = LOOP_LEVELS,
) -> jax.Array:
    """`sparse_expert_ffn` as a loop over the experts that hold rows, each expert's
    weights read in place once, its rows in chunks (see the module docstring).

    The block layout gathers a copy of an expert's three matrices for every block (at
    batch 128 of a 32-expert top-4 layer: ~5 copies of every expert per layer); here a
    `lax.fori_loop` runs over the distinct experts routed to (a traced count) and, inside,
    over that expert's g_e sorted rows in chunks of the sizes `loop_chunk_sizes(chunk,
    levels)`, largest first: as many whole chunks of the largest size as fit, then of the
    next, and the rest in chunks of `chunk` (traced counts). Each chunk is one
    [size, H] x [H, I] SwiGLU with the expert's weights: large chunks make few, wide
    matmuls (a matmul of a few rows re-reads the expert's weights for little work), the
    smallest bounds the padding. Only the last chunk of an expert may run past its rows
    into the next expert's: those rows are overwritten when the next expert (later in the
    loop) writes its own, and the last one's run into spare rows. Work: sum_e
    ceil(g_e / chunk) * chunk rows, at most `padded_rows(N, E, chunk)` (the block layout's
    static count) and usually less; nothing is done for experts without rows.

    Args / Returns: as `sparse_expert_ffn` (ids in [0, E], E: an empty copy, output 0).
    chunk: the smallest chunk, >= 1; levels: how many chunk sizes, >= 1 (1: every chunk
    has `chunk` rows).
    """
    rows = SortedRows.of(x, ids, w_gate.shape[0], chunk)
    weights = (w_gate, w_up, w_down)
    return rows.unsort(expert_loop_rows(rows, weights, rows.chunk_sizes(chunk, levels), x.dtype))


def expert_loop_rows(
    rows: SortedRows, weights: Sequence[jax.Array], sizes_desc: Sequence[int], dtype
) -> jax.Array:
    """The expert loop on sorted rows: for j < rows.num_used, expert e = rows.used[j]'s
    rows.sizes[e] rows from rows.starts[e] through its SwiGLU (weights (w_gate, w_up,
    w_down), sliced once per expert), in chunks of `sizes_desc` (`run_expert_rows`).
    Returns [N + chunk, H] in dtype, sorted order; rows no expert covers are 0."""

    def one_expert(j, y):
        e = rows.used[j]
        w = [lax.dynamic_index_in_dim(a, e, keepdims=False) for a in weights]

        def swiglu(r: jax.Array) -> jax.Array:
            return swiglu_rows(r[None], w[0][None], w[1][None], w[2][None], dtype)[0]

        return run_expert_rows(y, rows.x_sorted, swiglu, rows.starts[e], rows.sizes[e], sizes_desc)

    y0 = jnp.zeros(rows.x_sorted.shape, dtype)
    return lax.fori_loop(0, rows.num_used, one_expert, y0)


class SortedRows(NamedTuple):
    """The N = T*k token copies sorted by expert (the expert loops' shared layout).

    order: [N] sorted row r is copy order[r]; sorted_ids: [N] their experts (E: empty);
    sizes / starts: [E] rows of expert e and its first sorted row; used: [E] the experts
    holding rows first (ascending), then the empty ones; num_used: their count;
    x_sorted: [N + chunk, H] the rows, then `chunk` zero rows for the last chunk's overrun.
    """

    order: jax.Array
    sorted_ids: jax.Array
    sizes: jax.Array
    starts: jax.Array
    used: jax.Array
    num_used: jax.Array
    x_sorted: jax.Array
    top_k: int

    @classmethod
    def of(cls, x: jax.Array, ids: jax.Array, num_experts: int, chunk: int) -> SortedRows:
        top_k = ids.shape[1]
        flat = ids.reshape(-1).astype(jnp.int32)
        order = jnp.argsort(flat, stable=True)
        sizes = jnp.zeros(num_experts, jnp.int32).at[flat].add(1, mode="drop")
        x_sorted = jnp.concatenate([x[order // top_k], jnp.zeros((chunk, x.shape[1]), x.dtype)])
        rows = cls(order, flat[order], sizes, sizes, sizes, sizes, x_sorted, top_k)
        return rows.regrouped(sizes, jnp.cumsum(sizes) - sizes)

    def regrouped(self, sizes: jax.Array, starts: jax.Array) -> SortedRows:
        """The same rows with other groups for the loop: expert e's `sizes[e]` rows from
        `starts[e]` ([E] int32 each); `used` and `num_used` follow from the sizes."""
        return self._replace(
            sizes=sizes,
            starts=starts,
            used=jnp.argsort(sizes == 0, stable=True).astype(jnp.int32),
            num_used=jnp.sum(sizes > 0),
        )

    def chunk_sizes(self, chunk: int, levels: int) -> list[int]:
        """`loop_chunk_sizes` less those above N (never a whole chunk; could not be
        sliced), the smallest always kept."""
        n = self.order.shape[0]
        return [s for s in loop_chunk_sizes(chunk, levels) if s <= n or s == chunk]

    def unsort(self, y: jax.Array) -> jax.Array:
        """y [N + chunk, H] in sorted order -> [T, k, H] in copy order, 0 for empty copies."""
        n = self.order.shape[0]
        num_experts = self.sizes.shape[0]
        y = jnp.where((self.sorted_ids < num_experts)[:, None], y[:n], 0)
        out = jnp.zeros_like(y).at[self.order].set(y)
        return out.reshape(n // self.top_k, self.top_k, y.shape[1])


def run_expert_rows(
    y: jax.Array,
    x_sorted: jax.Array,
    swiglu: Callable[[jax.Array], jax.Array],
    start: jax.Array,
    left: jax.Array,
    sizes_desc: Sequence[int],
) -> jax.Array:
    """One expert's `left` sorted rows from `start`, in chunks of `sizes_desc` (largest
    first, the last the smallest, which also takes the remainder), through `swiglu`
    (that expert's FFN: [size, H] -> [size, H]), written into y [N + chunk, H]."""
    smallest = sizes_desc[-1]
    for size in sizes_desc:

        def one_chunk(c, y, size=size, start=start):
            first = start + c * size
            out = swiglu(lax.dynamic_slice_in_dim(x_sorted, first, size))
            return lax.dynamic_update_slice_in_dim(y, out, first, 0)

        # Whole chunks of this size; the smallest size also takes the remainder.
        count = left // size if size != smallest else (left + size - 1) // size
        y = lax.fori_loop(0, count, one_chunk, y)
        start, left = start + count * size, left - count * size
    return y

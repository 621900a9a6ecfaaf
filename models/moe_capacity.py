"""The expert-capacity layout of the sparse experts, for large token batches.

`moe_loop.expert_loop_ffn` runs one expert at a time, and XLA's CPU backend copies
each expert's weights (a `dynamic-slice` of the stacked [E, H, I] arrays) before its
matmuls: at 128 tokens of a 32-expert top-4 layer that is every expert's 1.5 MB copied
once per layer, for a matmul of ~16 rows. Here every expert's first C rows run as ONE
batched matmul over the stacked weights, read in place ([E, C, H] x [E, H, I], the
capacity layout of GShard, Lepikhin et al. 2020, and Switch Transformer, Fedus et al.
2021), and only the rows past an expert's capacity (the overflow) go through the expert
loop, in chunks of `OVERFLOW_CHUNK`. No row is dropped, unlike GShard's capacity.

The capacity is chosen per step, on the device, from the routing: among
`capacities_for(N, E)` (the mean group N/E times `CAPACITY_FACTORS`), the largest whose
executed rows (E*C plus the overflow rounded up to whole chunks, `executed_rows`) stay
within `moe_sparse.MAX_PADDING` of the routed rows N; if none does (a skewed routing),
the plain expert loop runs. So the work stays within 1.3x of the routed work whatever
the routing, and a balanced routing gets the batched matmul. Each capacity is one
branch of a `lax.switch`: static shapes, no host sync.

Measured, one MoE layer's experts (`scripts/bench_moe.py --capacity --tokens
32,64,128,512`, 7 interleaved repeats, medians; 2-core VM, load 1.4-1.7), the capacity
layout against the expert loop it replaced there, ms: Qwen3-MoE-like layer (hidden 512,
32 experts, top-4) 5.6 vs 8.6, 8.0 vs 12.1, 8.7 vs 11.3, 17.5 vs 26.0; the demo model's
(hidden 128, 8 experts, top-2) 0.28 vs 0.27, 0.29 vs 0.34, 0.50 vs 0.59, 1.44 vs 1.78.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jaxserve.models.moe_loop import SortedRows, expert_loop_rows, swiglu_rows

# Capacities tried, as multiples of the mean group N / E (rounded down): the largest whose
# executed rows fit moe_sparse.MAX_PADDING wins.
CAPACITY_FACTORS = (1.0, 1.125, 1.25)
# Routed rows per expert (N / E) from which the default path may use the capacity layout:
# below it most experts hold a row or none, and E * C can not fit moe_sparse.MAX_PADDING.
CAPACITY_MIN_MEAN_GROUP = 4
# Rows per chunk of the overflow loop. 1, 2 and 4 measured within the noise of each other
# at 32-512 tokens (`bench_moe.py --capacity --overflow-chunks 1,4`); 2 avoids 1-row
# matmuls (a multiply-reduce on XLA's CPU backend) and pads less than 4, so that a
# capacity fits MAX_PADDING more often at 32 tokens.
OVERFLOW_CHUNK = 2


def uses_capacity(num_rows: int, num_experts: int) -> bool:
    """Whether the default sparse path runs the capacity layout for `num_rows` routed rows
    (N >= CAPACITY_MIN_MEAN_GROUP * E)."""
    return num_rows >= CAPACITY_MIN_MEAN_GROUP * num_experts


def capacities_for(num_rows: int, num_experts: int) -> tuple[int, ...]:
    """The candidate capacities (rows per expert in the batched matmul), ascending and
    distinct: floor(f * N / E) for f in CAPACITY_FACTORS, at least 1."""
    return tuple(sorted({max(1, int(f * num_rows / num_experts)) for f in CAPACITY_FACTORS}))


def executed_rows(sizes: jax.Array, capacity: int, chunk: int) -> jax.Array:
    """Rows the capacity layout computes for expert group sizes `sizes` [E] int32: E * C
    batched rows plus each expert's overflow max(g_e - C, 0) rounded up to whole chunks."""
    over = jnp.maximum(sizes - capacity, 0)
    return sizes.shape[0] * capacity + jnp.sum((over + chunk - 1) // chunk * chunk)


def capacity_expert_ffn(
    x: jax.Array,
    ids: jax.Array,
    w_gate: jax.Array,
    w_up: jax.Array,
    w_down: jax.Array,
    *,
    chunk: int,
    levels: int,
    max_padding: float,
) -> jax.Array:
    """`moe_sparse.sparse_expert_ffn` in the capacity layout (see the module docstring):
    the capacity chosen per step from the routing, or the expert loop (`chunk`, `levels`:
    as `moe_loop.expert_loop_ffn`) when no capacity keeps the work within max_padding
    (the work bound, `moe_sparse.MAX_PADDING`).

    Args / Returns: as `sparse_expert_ffn` (x [T, H]; ids [T, k] in [0, E], E: an empty
    copy; w_gate, w_up [E, H, I]; w_down [E, I, H]) -> [T, k, H] in x.dtype.
    """
    rows = SortedRows.of(x, ids, w_gate.shape[0], max(chunk, OVERFLOW_CHUNK))
    capacities = capacities_for(ids.size, w_gate.shape[0])
    weights = (w_gate, w_up, w_down)

    def loop() -> jax.Array:
        return expert_loop_rows(rows, weights, rows.chunk_sizes(chunk, levels), x.dtype)

    def batched(capacity: int) -> jax.Array:
        return capacity_rows(rows, weights, capacity, x.dtype)

    branches = [loop] + [lambda c=c: batched(c) for c in capacities]
    return rows.unsort(lax.switch(capacity_branch(rows.sizes, capacities, max_padding), branches))


def capacity_branch(sizes: jax.Array, capacities: tuple[int, ...], max_padding: float) -> jax.Array:
    """Which layout runs for expert group sizes `sizes` [E] int32 (N = their sum): i + 1
    for the largest capacities[i] whose `executed_rows` <= max_padding * N, else 0 (the
    expert loop). Returns an int32 scalar."""
    n = jnp.sum(sizes)
    # OVERFLOW_CHUNK read here, when traced, as `capacity_rows` reads it.
    rows = [executed_rows(sizes, c, OVERFLOW_CHUNK) for c in capacities]
    fits = jnp.stack([r <= max_padding * n for r in rows])
    return jnp.max(jnp.where(fits, jnp.arange(1, len(capacities) + 1), 0)).astype(jnp.int32)


def capacity_rows(rows: SortedRows, weights, capacity: int, dtype) -> jax.Array:
    """The sorted rows' outputs [N + chunk, H] in dtype: each expert's first `capacity`
    rows in one batched SwiGLU over weights (w_gate, w_up, w_down), stacked, the rest
    (the overflow) through the expert loop over the experts that overflow; rows.x_sorted
    needs at least OVERFLOW_CHUNK spare rows (`SortedRows.of`'s chunk)."""
    num_experts = weights[0].shape[0]
    n = rows.order.shape[0]
    slot = jnp.arange(capacity)
    # [E, C] sorted row of each expert's slot; n (a zero row of x_sorted) where empty.
    source = jnp.where(slot[None, :] < rows.sizes[:, None], rows.starts[:, None] + slot[None, :], n)
    y_batched = swiglu_rows(rows.x_sorted[source], *weights, dtype)  # [E, C, H]

    # The overflow: rows from starts[e] + C, through the expert loop (its starts moved).
    over = jnp.maximum(rows.sizes - capacity, 0)
    overflow = rows.regrouped(over, rows.starts + capacity)
    y = expert_loop_rows(overflow, weights, [OVERFLOW_CHUNK], dtype)

    # Rows within capacity take the batched output; an overflow chunk that ran past its
    # expert's rows into such a row is overwritten here.
    expert = jnp.minimum(rows.sorted_ids, num_experts - 1)
    rank = jnp.arange(n) - rows.starts[expert]
    flat = y_batched.reshape(num_experts * capacity, -1)
    batched = flat[expert * capacity + jnp.minimum(rank, capacity - 1)]
    return y.at[:n].set(jnp.where((rank < capacity)[:, None], batched, y[:n]))

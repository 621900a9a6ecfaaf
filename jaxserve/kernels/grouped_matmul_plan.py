"""The tile list of the grouped matmul kernel (`grouped_matmul.py`), built by a few tiny
XLA ops before the launch, so that the kernel reads its tiles instead of searching the
group boundaries (the group-metadata idea of megablox,
`jax.experimental.pallas.ops.tpu.megablox`).
"""

from __future__ import annotations

import jax
import jax.experimental.pallas as pl
import jax.numpy as jnp


def group_metadata(
    group_sizes: jax.Array, m: int, padded_m: int, tile_m: int
) -> tuple[jax.Array, jax.Array]:
    """Tile list of a grouped matmul over m rows sorted by group.

    Tile j of group g covers the group's rows in [a, a + tile_m), a = 8 * floor(start_g
    / 8) + j * tile_m: TMA into swizzled shared memory needs the first row loaded to be
    a multiple of the 8-row tiling, so a group's first tile may carry up to 7 rows of
    the previous group (computed, never stored).

    Args:
      group_sizes: [G] int32, rows of each group; the groups tile rows [0, sum) in order.
        Negative sizes count as 0; a running sum past m is clipped to m.
      m: rows of x (static).
      padded_m: rows of the x the kernel reads: a multiple of 8, >= max(m, tile_m).
      tile_m: rows per tile (static).

    Returns:
      meta: [4, max_tiles] int32 rows (group, load_row, offset, rows): tile i computes
        x[load_row : load_row + tile_m] @ w[group] and stores its rows
        [offset, offset + rows) as output rows load_row + offset + [0, rows).
        load_row is a multiple of 8. Entries at or past num_tiles have rows = 0.
      counts: [2] int32, (num_tiles, rows covered by groups = min(sum(group_sizes), m)).
    """
    num_groups = group_sizes.shape[0]
    sizes = jnp.maximum(group_sizes.astype(jnp.int32), 0)
    ends = jnp.minimum(jnp.cumsum(sizes), m)
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
    aligned_starts = starts // 8 * 8
    tiles = jnp.where(ends > starts, (ends - aligned_starts + tile_m - 1) // tile_m, 0)
    tile_ends = jnp.cumsum(tiles)
    # Each group adds at most one tile beyond its share of ceil(m / tile_m), plus one
    # for the <= 7 rows its first tile starts early.
    max_tiles = pl.cdiv(m, tile_m) + 2 * num_groups
    i = jnp.arange(max_tiles, dtype=jnp.int32)
    group = jnp.searchsorted(tile_ends, i, side="right").astype(jnp.int32)
    group = jnp.minimum(group, num_groups - 1)
    tile_start = aligned_starts[group] + (i - (tile_ends[group] - tiles[group])) * tile_m
    first_row = jnp.maximum(tile_start, starts[group])
    rows = jnp.minimum(tile_start + tile_m, ends[group]) - first_row
    rows = jnp.where(i < tile_ends[-1], jnp.clip(rows, 0, tile_m), 0)
    load_row = jnp.minimum(tile_start, padded_m - tile_m)
    offset = jnp.where(rows > 0, first_row - load_row, 0)
    meta = jnp.stack([group, load_row, offset, rows])
    counts = jnp.stack([tile_ends[-1], ends[-1]]).astype(jnp.int32)
    return meta, counts

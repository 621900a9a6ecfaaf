"""The ragged expert-parallel dispatch: `lax.ragged_all_to_all` moves exactly the routed rows.

Where the backend implements `ragged_all_to_all` (an NVIDIA GPU; the CPU does not), the
all_to_all path of `moe_ep` with a capacity factor sends each peer only the rows routed
to it, not a padded buffer:

1. the per-peer row counts of the sorted assignments are exchanged (`all_to_all` of
   [ep] int32), and from them each sender learns where its rows land in each receiver's
   buffer (receivers lay their rows out by source, in device order);
2. `ragged_all_to_all` the rows and their local expert ids into a receive buffer of
   ep * C_main rows (the memory of the capacity path's main round);
3. the local experts run on the received rows (`moe_ep.local_expert_ffn`);
4. `ragged_all_to_all` the results back into the senders' sorted order.

If any device would receive more than the buffer holds (a `pmax`, so every device
agrees), the step takes the capacity path instead (main + overflow rounds), so no token
is dropped. The CPU never takes this path (`ragged_supported`); `JAXSERVE_EP_RAGGED=off`
turns it off on a GPU, `=on` forces it (then the backend must implement it).
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
from jax import lax

from jaxserve.sharding.rules import EP

RAGGED_ENV = "JAXSERVE_EP_RAGGED"


def ragged_supported() -> bool:
    """Whether the dispatch uses `ragged_all_to_all`: `JAXSERVE_EP_RAGGED` = on / off /
    auto (default: on an NVIDIA GPU only).

    Raises:
        ValueError: JAXSERVE_EP_RAGGED is set to something else.
    """
    mode = os.environ.get(RAGGED_ENV, "auto").lower()
    if mode not in ("auto", "on", "off"):
        raise ValueError(f"{RAGGED_ENV} must be auto, on or off, got {mode!r}")
    if mode != "auto":
        return mode == "on"
    from jaxserve.kernels import dispatch  # noqa: PLC0415 -- kernels import models; keep lazy

    return dispatch.has_nvidia_gpu()


def exclusive_cumsum(sizes: jax.Array) -> jax.Array:
    """[n] int32 -> [n] int32 offsets of consecutive slices of these sizes."""
    return jnp.cumsum(sizes) - sizes


def ragged_dispatch(
    rows, local_ids, send_offsets, send_sizes, recv_sizes, recv_rows, empty_id, ffn
):
    """Steps 2-4 of the module docstring on one device, inside shard_map over EP.

    rows: [N, H] this device's (token, choice) rows sorted by destination device;
    local_ids: [N] int32 their local expert on the destination; send_offsets,
    send_sizes: [ep] int32, the slice of `rows` for each device; recv_sizes: [ep] int32,
    rows each device sends here (`all_to_all` of the peers' send_sizes); recv_rows: the
    static receive buffer (>= sum(recv_sizes) on every device: the caller checks);
    empty_id: the local id of an empty row (L); ffn(rows [M, H], local ids [M]) ->
    [M, H], 0 for empty rows.

    Returns [N, H]: each routed row's expert output in the order of `rows`; rows past
    the last slice are 0.
    """
    recv_offsets = exclusive_cumsum(recv_sizes)
    # Where my slice for device j starts in j's buffer: j's recv_offsets[me].
    out_offsets = lax.all_to_all(recv_offsets, EP, 0, 0, tiled=True)
    # Where device i's results go back to: i's send_offsets[me].
    src_offsets = lax.all_to_all(send_offsets, EP, 0, 0, tiled=True)
    recv = lax.ragged_all_to_all(
        rows,
        jnp.zeros((recv_rows, rows.shape[1]), rows.dtype),
        send_offsets,
        send_sizes,
        out_offsets,
        recv_sizes,
        axis_name=EP,
    )
    recv_ids = lax.ragged_all_to_all(
        local_ids,
        jnp.full((recv_rows,), empty_id, jnp.int32),
        send_offsets,
        send_sizes,
        out_offsets,
        recv_sizes,
        axis_name=EP,
    )
    out = ffn(recv, recv_ids)
    return lax.ragged_all_to_all(
        out,
        jnp.zeros_like(rows),
        recv_offsets,
        recv_sizes,
        src_offsets,
        send_sizes,
        axis_name=EP,
    )

"""Expert-parallel MoE experts inside `shard_map`: dispatch, grouped matmul, combine.

Experts live in physical slots spread over all ep = dp * tp devices (`placement.py`).
Routing (top-k) happens before this module, identically to the single-device model; this
module takes each token's top-k (weights, logical expert ids) and returns the weighted
sum of its experts' outputs. Two paths, the same result:

all_to_all path (any batch; DeepSpeed-MoE / GShard-style dispatch and combine):
    1. each device takes 1/tp of its dp rank's tokens;
    2. every (token, choice) gets a physical slot (`choose_slots`), hence a device;
    3. assignments are sorted by slot and scattered into a send buffer [ep, C, H];
    4. `all_to_all` the rows (and their local expert ids) to the devices holding them;
    5. grouped matmul over the local experts (`local_expert_ffn`);
    6. `all_to_all` the results back;
    7. with a capacity factor (`dispatch_capacity`): C is about the mean rows per peer,
       and the rows past it go through steps 3-6 again in overflow rounds of a smaller
       static size, as many as the busiest (device, peer) pair of the step needs (a
       `pmax` of the excess, so every device loops the same count); without one, C is
       the worst case, tokens_per_device * min(k, slots_per_device) (a token's k
       experts are distinct), in one round. Either way no token is ever dropped, even
       if every token picks the experts of one device;
    8. un-sort, weighted sum over the k choices; `all_gather` over tp restores the dp
       rank's tokens.

replicated-token path (small batches): every device gathers all tokens, runs its local
experts on the (token, choice) pairs that chose them (sparse off the GPU: `moe_sparse`),
and a `psum` over tp plus a `psum_scatter` over dp sums the partial outputs. It moves
the whole batch instead of the routed rows, but skips the capacity padding and both
all_to_alls, which wins when the batch is small.

The array layout is the DP-attention flat batch: the T tokens are the concatenation of
the dp ranks' T/dp tokens, so T must be divisible by dp.

Avoided on purpose: `lax.ragged_dot` (dense over all groups on the CPU). On an NVIDIA
GPU the local expert FFN goes through `jaxserve.kernels.dispatch.moe_ffn` (the Pallas
grouped matmul), and with a capacity factor the rows travel by `lax.ragged_all_to_all`
(`moe_ragged`: exactly the routed rows; unimplemented on the CPU), the capacity rounds
being its fallback when a device would receive more than its buffer.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxserve.models.moe_sparse import sparse_expert_ffn
from jaxserve.sharding import moe_ragged
from jaxserve.sharding.dispatch_capacity import (
    dispatch_bytes_per_device,
    dispatch_capacity,
    worst_case_rows,
)
from jaxserve.sharding.placement import ExpertPlacement, choose_slots
from jaxserve.sharding.rules import DP, EP, TP

ALL_TO_ALL = "all_to_all"
REPLICATED = "replicated"


def capacity(tokens_per_device: int, top_k: int, slots_per_device: int) -> int:
    """Rows one device may send to one other device in one MoE step: the worst case, so
    no token is dropped (every token choosing experts of one device)."""
    return worst_case_rows(tokens_per_device, top_k, slots_per_device)


def all_to_all_bytes_per_device(
    num_tokens: int,
    hidden: int,
    top_k: int,
    mesh: Mesh,
    num_slots: int,
    itemsize: int,
    capacity_factor: float | None = None,
    overflow_rounds: int = 0,
) -> int:
    """Bytes one device sends to the other devices in one MoE layer step of the
    all_to_all path: dispatched rows with their int32 expert ids, then the results back,
    capacity padding included (the buffers are static; the chunk a device keeps for
    itself is not sent).

    num_tokens: the whole flat batch (all dp ranks). capacity_factor: as passed to
    `expert_parallel_moe` (None: the worst-case buffers). overflow_rounds: the overflow
    rounds of this step (`DispatchCapacity.overflow_rounds`; 0: none).
    Same accounting as `dispatch_capacity.dispatch_bytes_per_device`, which it calls.
    """
    cap = dispatch_capacity(
        per_device_tokens(num_tokens, mesh),
        top_k,
        mesh.size,
        num_slots // mesh.size,
        capacity_factor,
    )
    return dispatch_bytes_per_device(cap, hidden, itemsize, overflow_rounds)


def per_device_tokens(num_tokens: int, mesh: Mesh) -> int:
    """Tokens one device dispatches in the all_to_all path: its 1/tp of its dp rank's."""
    return -(-(num_tokens // mesh.shape[DP]) // mesh.shape[TP])


def replicated_bytes_per_device(
    num_tokens: int, hidden: int, top_k: int, mesh: Mesh, itemsize: int
) -> int:
    """Bytes one device sends in one MoE layer step of the replicated-token path, with
    ring collectives: all_gather over dp of the tokens (activations, combine weights,
    int32 ids), all-reduce over tp and reduce-scatter over dp of the outputs."""
    dp, tp = mesh.shape[DP], mesh.shape[TP]
    per_rank = num_tokens // dp
    gather = (dp - 1) * per_rank * (hidden * itemsize + top_k * (itemsize + 4))
    all_reduce = 2 * (tp - 1) * num_tokens * hidden * itemsize // tp
    scatter = (dp - 1) * per_rank * hidden * itemsize
    return gather + all_reduce + scatter


def local_expert_ffn(
    rows: jax.Array,
    local_ids: jax.Array,
    w_gate: jax.Array,
    w_up: jax.Array,
    w_down: jax.Array,
) -> jax.Array:
    """SwiGLU (Shazeer 2020) of each row with its own local expert: the grouped matmul
    of the expert-parallel MoE. The function boundary where the Pallas kernel plugs in.

    Args:
        rows: [M, H] activations, any order.
        local_ids: [M] int32 local expert of each row in [0, L]; L marks an empty row.
        w_gate, w_up: [L, H, I]; w_down: [L, I, H] (this device's slots).

    Returns:
        [M, H] in rows.dtype; empty rows give 0.

    On the kernel backends (`jaxserve.kernels.dispatch`, NVIDIA GPU) rows are sorted by
    expert and fed to the grouped matmul kernel; on the reference backend (the CPU) the
    sparse blocked path of the single-device model (`moe_sparse.sparse_expert_ffn`, only
    the non-empty rows), or, with `JAXSERVE_MOE_EXPERTS=dense`, every row through every
    local expert with its own expert's output selected. No `ragged_dot` either way.
    """
    from jaxserve.kernels import dispatch  # noqa: PLC0415 -- kernels import models; keep lazy

    num_local = w_gate.shape[0]
    if _sparse_reference():
        return sparse_expert_ffn(rows, local_ids[:, None], w_gate, w_up, w_down)[:, 0]
    if dispatch.get_backend() == dispatch.REFERENCE:
        out = _dense_local_ffn(rows, w_gate, w_up, w_down)  # [M, L, H]
        picked = jnp.take_along_axis(out, jnp.minimum(local_ids, num_local - 1)[:, None, None], 1)
        return jnp.where((local_ids < num_local)[:, None], picked[:, 0], 0).astype(rows.dtype)
    order = jnp.argsort(local_ids, stable=True)
    group_sizes = jnp.bincount(local_ids, length=num_local).astype(jnp.int32)
    out_sorted = dispatch.moe_ffn(rows[order], group_sizes, w_gate, w_up, w_down)
    return jnp.zeros_like(out_sorted).at[order].set(out_sorted)


def _dense_local_ffn(x: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array):
    """Every row through every local expert: [M, H] -> [M, L, H] in x.dtype.

    Same rounding points as the grouped-matmul kernels: float32 products and activation,
    the [M, L, I] intermediate stored in x.dtype. (Operands are upcast explicitly: the
    CPU backend has no bfloat16 x bfloat16 -> float32 dot.)
    """
    f32 = jnp.float32
    x32 = x.astype(f32)
    gate = jnp.einsum("mh,lhi->mli", x32, w_gate.astype(f32))
    up = jnp.einsum("mh,lhi->mli", x32, w_up.astype(f32))
    hidden = (jax.nn.silu(gate) * up).astype(x.dtype).astype(f32)
    return jnp.einsum("mli,lih->mlh", hidden, w_down.astype(f32)).astype(x.dtype)


def _sparse_reference() -> bool:
    """Whether the local expert FFN runs the sparse blocked path (the reference backend,
    not forced dense; see `jaxserve.kernels.dispatch.moe_reference_experts`)."""
    from jaxserve.kernels import dispatch  # noqa: PLC0415 -- kernels import models; keep lazy

    return dispatch.sparse_reference_experts()


def _token_chunk(a: jax.Array, chunk: int, index: jax.Array) -> jax.Array:
    """Rows [index * chunk, (index + 1) * chunk) of `a`, zero-padded past its end."""
    pad = chunk * lax.axis_size(TP) - a.shape[0]
    padded = jnp.pad(a, [(0, pad)] + [(0, 0)] * (a.ndim - 1))
    return lax.dynamic_slice_in_dim(padded, index * chunk, chunk)


def _exchange(send, send_ids, w_gate, w_up, w_down):
    """One dispatch round: all_to_all the rows [ep, C, H] and their local expert ids
    [ep, C] to their devices, run the local experts, all_to_all the results back."""
    ep, cap, hidden = send.shape
    recv = lax.all_to_all(send, EP, 0, 0, tiled=True)
    recv_ids = lax.all_to_all(send_ids, EP, 0, 0, tiled=True)
    out = local_expert_ffn(
        recv.reshape(ep * cap, hidden), recv_ids.reshape(-1), w_gate, w_up, w_down
    )
    return lax.all_to_all(out.reshape(ep, cap, hidden), EP, 0, 0, tiled=True)


def _round(rows, local_ids, dest, rank, start, size, weights):
    """Rows of rank [start, start + size) per destination through one dispatch round;
    returns [N, H] results in the rows' order (0 for rows outside the round)."""
    ep = lax.axis_size(EP)
    num_local = weights[0].shape[0]
    inside = (rank >= start) & (rank < start + size)
    # Rows outside the round go to an index past the buffer: dropped by the scatter.
    at = jnp.where(inside, rank - start, size)
    send = jnp.zeros((ep, size, rows.shape[1]), rows.dtype).at[dest, at].set(rows, mode="drop")
    send_ids = jnp.full((ep, size), num_local, jnp.int32).at[dest, at].set(local_ids, mode="drop")
    back = _exchange(send, send_ids, *weights)
    return back.at[dest, at].get(mode="fill", fill_value=0)


def overflow_rounds(excess: jax.Array, overflow: int) -> jax.Array:
    """ceil(excess / overflow) for excess > 0, else 0 (int32): the traced twin of
    `DispatchCapacity.overflow_rounds`."""
    return (jnp.maximum(excess, 0) + overflow - 1) // overflow


def _all_to_all_body(
    x, topk_weights, topk_ids, w_gate, w_up, w_down, placement, *, capacity_factor
):
    """Per-device body of the all_to_all path (see the module docstring).

    x: [T_dp, H] this dp rank's tokens (replicated over tp); topk_*: [T_dp, k];
    w_*: this device's L slots. Returns [T_dp, H].
    """
    t_dp, hidden = x.shape
    top_k = topk_ids.shape[1]
    ep, tp = lax.axis_size(EP), lax.axis_size(TP)
    num_local = w_gate.shape[0]
    n = -(-t_dp // tp)  # tokens handled by this device
    cap = dispatch_capacity(n, top_k, ep, num_local, capacity_factor)
    tp_index, dp_index = lax.axis_index(TP), lax.axis_index(DP)

    xs = _token_chunk(x, n, tp_index)
    weights = _token_chunk(topk_weights, n, tp_index)
    ids = _token_chunk(topk_ids, n, tp_index)
    local_token = tp_index * n + jnp.arange(n, dtype=jnp.int32)
    real = local_token < t_dp  # tp padding rows are not dispatched
    slots = choose_slots(ids, dp_index * t_dp + local_token, placement)  # [n, k]
    # Padding goes to a sentinel slot past the end: sorted last, dropped by the scatter.
    slots = jnp.where(real[:, None], slots, ep * num_local).reshape(-1)

    order = jnp.argsort(slots, stable=True)
    slot_sorted = slots[order]
    dest = slot_sorted // num_local  # ep for padding: outside every buffer
    first_of_dest = jnp.searchsorted(dest, jnp.arange(ep + 1, dtype=dest.dtype), side="left")
    rank = jnp.arange(n * top_k) - first_of_dest[dest]
    rows, local_ids = xs[order // top_k], slot_sorted % num_local
    experts = (w_gate, w_up, w_down)

    per_dest = jnp.diff(first_of_dest)  # [ep] rows to each device

    def capacity_rounds(*_):
        y_sorted = _round(rows, local_ids, dest, rank, 0, cap.main, experts)
        if not cap.overflow:
            return y_sorted
        # Rounds for the largest per-peer excess over the main round on any device:
        # the same count on every device, so the collectives in the loop meet.
        rounds = overflow_rounds(lax.pmax(jnp.max(per_dest) - cap.main, EP), cap.overflow)

        def overflow_round(i, y):
            start = cap.main + i * cap.overflow
            return y + _round(rows, local_ids, dest, rank, start, cap.overflow, experts)

        return lax.fori_loop(0, rounds, overflow_round, y_sorted)

    if capacity_factor is not None and moe_ragged.ragged_supported():
        # Exactly the routed rows (GPU), unless some device would receive more than
        # ep * main rows: then every device takes the capacity rounds.
        recv_sizes = lax.all_to_all(per_dest, EP, 0, 0, tiled=True)
        recv_rows = ep * cap.main
        fits = lax.pmax(jnp.sum(recv_sizes), EP) <= recv_rows

        def ragged(*_):
            ffn = functools.partial(local_expert_ffn, w_gate=w_gate, w_up=w_up, w_down=w_down)
            send_offsets = first_of_dest[:ep]
            return moe_ragged.ragged_dispatch(
                rows, local_ids, send_offsets, per_dest, recv_sizes, recv_rows, num_local, ffn
            )

        y_sorted = lax.cond(fits, ragged, capacity_rounds)
    else:
        y_sorted = capacity_rounds()
    y = jnp.zeros_like(y_sorted).at[order].set(y_sorted).reshape(n, top_k, hidden)
    # Weighted sum in float32, rounded once (the k expert outputs are already rounded).
    combined = jnp.einsum("nk,nkh->nh", weights.astype(jnp.float32), y.astype(jnp.float32))
    combined = combined.astype(x.dtype)
    return lax.all_gather(combined, TP, axis=0, tiled=True)[:t_dp]


def _replicated_body(x, topk_weights, topk_ids, w_gate, w_up, w_down, placement):
    """Per-device body of the replicated-token path (see the module docstring)."""
    t_dp = x.shape[0]
    num_local = w_gate.shape[0]
    xs = lax.all_gather(x, DP, axis=0, tiled=True)  # [T, H]: every token on every device
    weights = lax.all_gather(topk_weights, DP, axis=0, tiled=True)
    ids = lax.all_gather(topk_ids, DP, axis=0, tiled=True)
    num_tokens = xs.shape[0]
    token = jnp.arange(num_tokens, dtype=jnp.int32)
    local = choose_slots(ids, token, placement) - lax.axis_index(EP) * num_local
    mine = (local >= 0) & (local < num_local)
    if _sparse_reference():  # only the (token, choice) pairs of this device's experts
        y = sparse_expert_ffn(xs, jnp.where(mine, local, num_local), w_gate, w_up, w_down)
        partial = jnp.einsum("tk,tkh->th", weights.astype(jnp.float32), y.astype(jnp.float32))
        summed = lax.psum(partial.astype(x.dtype), TP)
        return lax.psum_scatter(summed, DP, scatter_dimension=0, tiled=True)[:t_dp]
    combine = jnp.zeros((num_tokens, num_local + 1), weights.dtype)
    combine = combine.at[token[:, None], jnp.where(mine, local, num_local)].add(weights)
    partial = jnp.einsum(
        "tlh,tl->th", _dense_local_ffn(xs, w_gate, w_up, w_down), combine[:, :num_local]
    )
    summed = lax.psum(partial, TP)
    return lax.psum_scatter(summed, DP, scatter_dimension=0, tiled=True)[:t_dp]


def expert_parallel_moe(
    x: jax.Array,
    topk_weights: jax.Array,
    topk_ids: jax.Array,
    w_gate: jax.Array,
    w_up: jax.Array,
    w_down: jax.Array,
    placement: ExpertPlacement,
    *,
    mesh: Mesh,
    path: str = ALL_TO_ALL,
    capacity_factor: float | None = None,
) -> jax.Array:
    """The experts of an MoE layer over a (dp, tp) mesh, experts on all dp * tp devices.

    Args:
        x: [T, H] routed activations, the dp ranks' tokens concatenated (T % dp == 0).
        topk_weights: [T, k] combine weights (x.dtype); topk_ids: [T, k] int32 logical
            expert ids, as returned by `jaxserve.models.moe.route`.
        w_gate, w_up: [S, H, I]; w_down: [S, I, H]: the weights of the S physical slots
            (slot s holds expert placement.physical_to_logical[s]); sharded over ep.
        placement: the tables (traced: a new placement needs no recompile).
        mesh: the (dp, tp) mesh (`mesh.build_mesh`).
        path: ALL_TO_ALL or REPLICATED (same result; see the module docstring).
        capacity_factor: all_to_all path only: the main round's rows per peer over the
            mean (`dispatch_capacity`), with a drop-free overflow round; None = one
            round of worst-case buffers. The result does not depend on it.

    Returns:
        [T, H] in x.dtype: sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(x[t]).

    Raises:
        ValueError: T not divisible by dp, S not divisible by dp * tp, unknown path, or
            capacity_factor <= 0.
    """
    bodies = {
        ALL_TO_ALL: functools.partial(_all_to_all_body, capacity_factor=capacity_factor),
        REPLICATED: _replicated_body,
    }
    if path not in bodies:
        raise ValueError(f"expert_parallel_moe: path must be one of {sorted(bodies)}, got {path!r}")
    if capacity_factor is not None and not capacity_factor > 0:
        raise ValueError(
            f"expert_parallel_moe: capacity_factor must be > 0 or None, got {capacity_factor}"
        )
    dp = mesh.shape[DP]
    if x.shape[0] % dp:
        n = x.shape[0]
        raise ValueError(
            f"expert_parallel_moe: {n} {'token is' if n == 1 else 'tokens are'} not "
            f"divisible by dp={dp} "
            "(the flat batch is dp ranks' equal-size batches concatenated)"
        )
    if w_gate.shape[0] % mesh.size:
        n = w_gate.shape[0]
        raise ValueError(
            f"expert_parallel_moe: {n} {'expert slot is' if n == 1 else 'expert slots are'} "
            "not divisible by "
            f"ep = dp*tp = {mesh.size}"
        )
    tokens, experts, tables = P(DP), P(EP), P()
    sharded = jax.shard_map(
        bodies[path],
        mesh=mesh,
        in_specs=(tokens, tokens, tokens, experts, experts, experts, tables),
        out_specs=tokens,
        # The outputs are equal over tp by construction (all_gather / psum over tp), which
        # the replication checker cannot see through the all_to_alls.
        check_vma=False,
    )
    return sharded(x, topk_weights, topk_ids, w_gate, w_up, w_down, placement)

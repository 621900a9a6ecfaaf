"""EPLB placement planner: from measured expert load to the logical expert of every slot.

Pure NumPy, run on the host between steps. It owns the *plan* only: which logical expert
each physical slot should hold so the device loads are balanced, and a reordering of
that plan that keeps experts where they already are (fewer weight bytes to move). It
does not record load (eplb/recorder.py), move weights, or touch device arrays; the
tables the MoE step reads come from `sharding.placement.placement_from_slots`.

The algorithm is DeepSeek's Expert Parallelism Load Balancer (github.com/deepseek-ai/EPLB,
eplb.py; vendored by vLLM as vllm/distributed/eplb/rebalance_algo.py):

1. (hierarchical only) pack expert groups onto nodes, balancing node load;
2. give the redundant slots, one at a time, to the expert whose per-replica load
   (load / replicas) is the highest (`replicate_experts`);
3. pack the replicas onto devices, heaviest first, each onto the lightest device that
   still has a free slot (`balanced_packing`), so every device gets exactly S / ep slots.

`refine=False` is that algorithm as published, one layer at a time. The default adds,
vectorised over all layers (and nodes) at once (eplb/planner_refine.py): no device
holds two copies of one expert and no expert has more copies than devices (of its node),
whenever S / ep <= E (of a node) makes that possible; pairwise swap sweeps and a
2-exchange local search after the packing; and, given the placement in use and a
`tolerance`, a re-plan that changes few slots (`replan_rows`). Given the placement in
use, a layer also keeps it where the plan is not better (by `min_improvement`).
`minimize_movement` reorders a plan so that the fewest slots change expert.

Slot layout (sharding/placement.py): device d holds slots [d * S/ep, (d + 1) * S/ep); a
token of expert e picks one of its replicas evenly, so a slot's expected load is
load[e] / replica_counts[e].
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike

from jaxserve.eplb import planner_refine, planner_replan
from jaxserve.eplb.planner_deepseek import (
    balanced_packing,
    plan_layer,
    refine_packing,
    replicate_experts,
)
from jaxserve.eplb.planner_movement import minimize_movement

# The re-plan tolerance the engine uses (EplbController): a layer's re-plan keeps its
# current slots where that costs at most 0.5% of a fresh plan's balancedness.
REPLAN_TOLERANCE = 0.005

__all__ = [
    "REPLAN_TOLERANCE",
    "PlacementPlan",
    "balanced_packing",
    "device_load",
    "minimize_movement",
    "plan_placement",
    "refine_packing",
    "replicate_experts",
]


@dataclass(frozen=True)
class PlacementPlan:
    """The planned placement of every MoE layer.

    physical_to_logical: [L, S] int32, the logical expert each slot should hold.
    replica_counts: [L, E] int32 >= 1, slots per expert (bincount of the row above).
    device_load: [L, ep] float64, the expected load of each device under the plan (same
        unit as the input load, e.g. tokens per window).
    """

    physical_to_logical: np.ndarray
    replica_counts: np.ndarray
    device_load: np.ndarray


def plan_placement(
    expert_load: ArrayLike,
    num_slots: int,
    ep: int,
    *,
    num_nodes: int = 1,
    num_groups: int | None = None,
    refine: bool = True,
    current: ArrayLike | None = None,
    min_improvement: float = 0.0,
    tolerance: float | None = None,
) -> PlacementPlan:
    """Plan the slots of every layer from its expert load (DeepSeek EPLB + our additions).

    Args:
        expert_load: [L, E] float or int >= 0, tokens routed to each logical expert of
            each layer over a window (any consistent unit).
        num_slots: S, physical expert slots per layer; S >= E and S % ep == 0.
        ep: number of expert-parallel devices.
        num_nodes: 1 for the global policy (experts replicated and packed over all
            devices at once, DeepSeek's decode policy). > 1 for the hierarchical policy
            (DeepSeek's prefill policy): expert groups are packed onto nodes first, so
            the experts of a group, and all their replicas, stay on one node's devices
            (devices [n * ep/num_nodes, (n + 1) * ep/num_nodes) form node n).
        num_groups: expert groups of group-limited routing (DeepSeek-V3: contiguous
            blocks of E / num_groups experts); required when num_nodes > 1, and must be
            a multiple of num_nodes.
        refine: True (default): the project's planner. Whenever S / ep <= E / num_nodes
            no device holds an expert twice and no expert has more than ep / num_nodes
            copies; the packing starts as DeepSeek's (so wherever DeepSeek's plan has
            no duplicate, the max device load is at most DeepSeek's) and is improved by
            swaps and slot reassignments (`planner_refine`). With more slots
            per device than experts (of a node) duplicates cannot be avoided; the plan
            is then DeepSeek's greedy improved by `refine_packing`. False gives
            DeepSeek's plan exactly, duplicates included.
        current: [L, S] ints, the placement in use. A layer whose plan does not lower
            the max device load below the current placement's (under expert_load) keeps
            the current placement, so a replan never makes a layer worse (the greedy
            alone can, rarely: e.g. 2 of 3,000 random S == E cases against the
            identity placement at ep=2, E=14).
        min_improvement: with current, a layer takes its new plan only if that lowers
            the max device load by more than this fraction (e.g. 0.05): load windows are
            noisy, and a fresh plan of a similar load can move most slots for a small
            gain. In [0, 1).
        tolerance: with current (and refine, when duplicates can be avoided): instead
            of a fresh plan, a layer gets its current placement changed by as few slots
            as the local search needs (`planner_replan.replan_rows`) to reach a
            balancedness within this fraction of the fresh plan's (e.g. 0.005), unchanged
            slots in place; a layer where that fails (its load shifted too much) gets
            the fresh plan, reordered by `minimize_movement`. In [0, 1). None (default):
            every layer gets the fresh plan.

    Returns:
        The plan; deterministic (the same input gives the same plan).

    Raises:
        ValueError: a bad shape or value, naming the argument.
    """
    load = _check_load(expert_load)
    num_layers, num_experts = load.shape
    if not 0.0 <= min_improvement < 1.0:
        raise ValueError(f"min_improvement: must be in [0, 1), got {min_improvement}")
    if tolerance is not None and not 0.0 <= tolerance < 1.0:
        raise ValueError(f"tolerance: must be in [0, 1), got {tolerance}")
    _check_sizes(num_experts, num_slots, ep, num_nodes, num_groups)
    cur = None if current is None else _check_current(current, num_layers, num_slots, num_experts)
    groups = num_groups or 1
    no_duplicates = refine and num_slots // ep <= num_experts // num_nodes
    if no_duplicates:
        node_experts = _node_experts(load, num_nodes, groups)
        p2l = _plan_rows(load, node_experts, num_slots, ep)
    else:
        p2l = np.stack([plan_layer(row, num_slots, ep, num_nodes, groups, refine) for row in load])
    if cur is not None:
        if tolerance is not None and no_duplicates:
            p2l = _replan(load, cur, p2l, ep, num_nodes, groups, tolerance)
        cur_peak = device_load(load, cur, ep).max(-1)
        worse = device_load(load, p2l, ep).max(-1) >= cur_peak * (1.0 - min_improvement)
        p2l[worse] = cur[worse]
    p2l = p2l.astype(np.int32)
    rows = p2l.astype(np.int64) + np.arange(num_layers)[:, None] * num_experts
    counts = np.bincount(rows.ravel(), minlength=num_layers * num_experts)
    return PlacementPlan(
        physical_to_logical=p2l,
        replica_counts=counts.reshape(num_layers, num_experts).astype(np.int32),
        device_load=device_load(load, p2l, ep),
    )


def device_load(expert_load: ArrayLike, physical_to_logical: ArrayLike, ep: int) -> np.ndarray:
    """Expected load of each device: the sum of its slots' load[e] / replica_counts[e].

    expert_load: [..., E] >= 0; physical_to_logical: [..., S] ints in [0, E) with every
    expert present, S % ep == 0 (leading dims equal). Returns [..., ep] float64.
    """
    load = np.asarray(expert_load, np.float64)
    p2l = np.asarray(physical_to_logical, np.int64)
    num_experts = load.shape[-1]
    # Per-row bincount via an offset per row: counts[..., e] = slots holding e.
    rows = p2l.reshape(-1, p2l.shape[-1])
    offsets = np.arange(rows.shape[0])[:, None] * num_experts
    counts = np.bincount((rows + offsets).ravel(), minlength=rows.shape[0] * num_experts)
    counts = counts.reshape(p2l.shape[:-1] + (num_experts,))
    slot_load = np.take_along_axis(load / np.maximum(counts, 1), p2l, axis=-1)
    return slot_load.reshape(p2l.shape[:-1] + (ep, -1)).sum(-1)


def _node_experts(load: np.ndarray, num_nodes: int, num_groups: int) -> np.ndarray:
    """[L, N, E / N] int64: the experts of each node of each layer, in increasing id:
    groups packed onto nodes (DeepSeek's `balanced_packing` of the group loads, all
    layers at once)."""
    num_layers, num_experts = load.shape
    if num_nodes == 1:
        return np.broadcast_to(np.arange(num_experts), (num_layers, 1, num_experts))
    group_size = num_experts // num_groups
    group_load = load.reshape(num_layers, num_groups, group_size).sum(-1)
    capacity = num_groups // num_nodes
    index = np.arange(num_layers)
    node_of_group = np.empty((num_layers, num_groups), np.int64)
    node_load = np.zeros((num_layers, num_nodes))
    node_size = np.zeros((num_layers, num_nodes), np.int64)
    for group in np.argsort(-group_load, axis=1, kind="stable").T:
        node = np.argmin(np.where(node_size < capacity, node_load, np.inf), axis=1)
        node_of_group[index, group] = node
        node_load[index, node] += group_load[index, group]
        node_size[index, node] += 1
    return _experts_of_nodes(node_of_group, num_nodes, group_size)


def _experts_of_nodes(node_of_group: np.ndarray, num_nodes: int, group_size: int) -> np.ndarray:
    """[L, N, E / N] experts of each node, increasing, from [L, G] node of each group."""
    num_layers, num_groups = node_of_group.shape
    groups = np.argsort(node_of_group, axis=1, kind="stable")  # by node, then by id
    experts = groups[..., None] * group_size + np.arange(group_size)
    return experts.reshape(num_layers, num_nodes, -1)


def _plan_rows(load: np.ndarray, node_experts: np.ndarray, num_slots: int, ep: int) -> np.ndarray:
    """[L, S] fresh no-duplicate plan: one `planner_refine.plan_rows` row per (layer,
    node), node n's slots holding its experts."""
    num_layers, num_nodes, per_node = node_experts.shape
    rows = node_experts.reshape(num_layers * num_nodes, per_node)
    row_load = np.take_along_axis(np.repeat(load, num_nodes, axis=0), rows, 1)
    local = planner_refine.plan_rows(row_load, num_slots // num_nodes, ep // num_nodes)
    experts = np.take_along_axis(rows, local.reshape(rows.shape[0], -1), 1)
    return experts.reshape(num_layers, num_slots)


def _replan(
    load: np.ndarray,
    current: np.ndarray,
    fresh: np.ndarray,
    ep: int,
    num_nodes: int,
    num_groups: int,
    tolerance: float,
) -> np.ndarray:
    """[L, S]: each layer's current placement changed by few slots to within tolerance
    of the fresh plan's balancedness (`planner_replan.replan_rows`, with the current
    placement's groups per node), or the fresh plan reordered by `minimize_movement`
    where that fails or the current placement does not keep groups on nodes."""
    num_layers, num_slots = current.shape
    num_experts = load.shape[1]
    target = device_load(load, fresh, ep).max(-1) / (1.0 - tolerance)
    node_experts, valid = _current_nodes(current, num_experts, num_nodes, num_groups)
    out = fresh.copy()
    layers = np.flatnonzero(valid)
    if layers.size:
        experts = node_experts[layers]
        per_node = experts.shape[2]
        rows = experts.reshape(-1, per_node)
        row_load = np.take_along_axis(np.repeat(load[layers], num_nodes, axis=0), rows, 1)
        # Local id of every expert within its node's list.
        local_of = np.empty((layers.size, num_experts), np.int64)
        np.put_along_axis(
            local_of,
            experts.reshape(layers.size, -1),
            np.tile(np.arange(per_node), num_nodes)[None],
            1,
        )
        cur_local = np.take_along_axis(local_of, current[layers], 1)
        devices = ep // num_nodes
        cur_rows = cur_local.reshape(-1, devices, num_slots // ep)
        row_target = np.repeat(target[layers], num_nodes)
        slots, ok = planner_replan.replan_rows(row_load, cur_rows, row_target)
        # A (layer, node) the local search could not bring to the target: a fresh plan of
        # that node's experts, reordered to keep what it can of the current slots.
        for row in np.flatnonzero(~ok):
            plan = planner_refine.plan_rows(
                row_load[row : row + 1], num_slots // num_nodes, devices
            )
            slots[row] = minimize_movement(cur_rows[row].ravel(), plan.ravel(), devices)[0].reshape(
                devices, -1
            )
        peak = device_load(row_load, slots.reshape(rows.shape[0], -1), devices).max(-1)
        ok = (peak <= row_target * (1 + 1e-12)).reshape(layers.size, num_nodes).all(1)
        planned = np.take_along_axis(rows, slots.reshape(rows.shape[0], -1), 1)
        out[layers[ok]] = planned.reshape(layers.size, num_slots)[ok]
        valid[layers[~ok]] = False
    for layer in np.flatnonzero(~valid):
        out[layer] = minimize_movement(current[layer], fresh[layer], ep, num_nodes=num_nodes)[0]
    return out


def _current_nodes(
    current: np.ndarray, num_experts: int, num_nodes: int, num_groups: int
) -> tuple[np.ndarray, np.ndarray]:
    """([L, N, E / N] experts of each node in the current placement, [L] bool: the
    layer's current placement keeps each group on one node, num_groups / num_nodes
    groups per node)."""
    num_layers, num_slots = current.shape
    if num_nodes == 1:
        experts = np.broadcast_to(np.arange(num_experts), (num_layers, 1, num_experts))
        return experts, np.ones(num_layers, bool)
    group_size = num_experts // num_groups
    node_of_slot = np.arange(num_slots) // (num_slots // num_nodes)
    index = np.broadcast_to(np.arange(num_layers)[:, None], current.shape)
    lowest = np.full((num_layers, num_groups), num_nodes)
    highest = np.full((num_layers, num_groups), -1)
    group = current // group_size
    np.minimum.at(lowest, (index, group), np.broadcast_to(node_of_slot, current.shape))
    np.maximum.at(highest, (index, group), np.broadcast_to(node_of_slot, current.shape))
    node_of_group = np.minimum(lowest, num_nodes - 1)
    per_node = np.stack([(node_of_group == n).sum(1) for n in range(num_nodes)], 1)
    valid = (lowest == highest).all(1) & (per_node == num_groups // num_nodes).all(1)
    return _experts_of_nodes(node_of_group, num_nodes, group_size), valid


def _check_load(expert_load: ArrayLike) -> np.ndarray:
    load = np.asarray(expert_load)
    if load.ndim != 2 or load.shape[1] == 0:
        raise ValueError(f"expert_load: expected [num_layers, E], got shape {load.shape}")
    if not (np.issubdtype(load.dtype, np.integer) or np.issubdtype(load.dtype, np.floating)):
        raise ValueError(f"expert_load: expected int or float, got dtype {load.dtype}")
    load = load.astype(np.float64)
    if not np.isfinite(load).all() or (load < 0).any():
        raise ValueError("expert_load: entries must be finite and >= 0")
    return load


def _check_current(
    current: ArrayLike, num_layers: int, num_slots: int, num_experts: int
) -> np.ndarray:
    cur = np.asarray(current)
    if cur.shape != (num_layers, num_slots) or not np.issubdtype(cur.dtype, np.integer):
        raise ValueError(
            f"current: expected int [{num_layers}, {num_slots}], got {cur.dtype} {cur.shape}"
        )
    cur = cur.astype(np.int64)
    if (cur < 0).any() or (cur >= num_experts).any():
        raise ValueError(f"current: entries must be in [0, {num_experts})")
    for layer, row in enumerate(cur):
        if (np.bincount(row, minlength=num_experts) == 0).any():
            raise ValueError(f"current: layer {layer} leaves an expert without a slot")
    return cur


def _check_sizes(
    num_experts: int, num_slots: int, ep: int, num_nodes: int, num_groups: int | None
) -> None:
    if ep < 1:
        raise ValueError(f"ep: must be >= 1, got {ep}")
    if num_slots < num_experts or num_slots % ep:
        raise ValueError(
            f"num_slots: {num_slots} must be >= E={num_experts} and a multiple of ep={ep}"
        )
    if num_nodes < 1 or ep % num_nodes:
        raise ValueError(f"num_nodes: {num_nodes} must be >= 1 and divide ep={ep}")
    if num_nodes == 1:
        if num_groups is not None and (num_groups < 1 or num_experts % num_groups):
            raise ValueError(f"num_groups: {num_groups} must divide E={num_experts}")
        return
    if num_groups is None or num_groups < 1 or num_experts % num_groups or num_groups % num_nodes:
        raise ValueError(
            f"num_groups: the hierarchical policy (num_nodes={num_nodes}) needs num_groups "
            f"dividing E={num_experts} and a multiple of num_nodes, got {num_groups}"
        )

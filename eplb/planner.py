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
from scipy.optimize import linear_sum_assignment

from jaxserve.eplb import planner_refine


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
            copies; the packing is improved by swaps (`planner_refine`). With more slots
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
            as the local search needs (`planner_refine.replan_rows`) to reach a
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
        p2l = np.stack([_plan_layer(row, num_slots, ep, num_nodes, groups, refine) for row in load])
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


def replicate_experts(expert_load: np.ndarray, num_slots: int) -> np.ndarray:
    """Replica count of each expert that minimises the largest per-replica load.

    Every expert gets one slot; each of the S - E redundant slots goes to the expert
    with the highest load / replicas at that moment (DeepSeek EPLB `replicate_experts`;
    this greedy is optimal for max(load / replicas)). Ties go to the expert with fewer
    replicas, then the lower index, so zero load spreads replicas round-robin.

    expert_load: [E] float64 >= 0. num_slots: S >= E.
    Returns [E] int64 replica counts >= 1 summing to S.
    """
    counts = np.ones(expert_load.shape[0], np.int64)
    for _ in range(num_slots - expert_load.shape[0]):
        per_replica = expert_load / counts
        tied = np.flatnonzero(per_replica == per_replica.max())
        counts[tied[np.argmin(counts[tied])]] += 1
    return counts


def balanced_packing(weight: np.ndarray, num_packs: int) -> np.ndarray:
    """Pack n items into num_packs packs of exactly n / num_packs items each.

    Greedy longest-processing-time with a cardinality limit (DeepSeek EPLB
    `balanced_packing`): items in decreasing weight, each into the lightest pack that
    still has room (ties: lower pack index; equal weights: lower item index).

    weight: [n] float64 >= 0, n % num_packs == 0.
    Returns [n] int64, the pack of each item.
    """
    capacity = weight.shape[0] // num_packs
    pack_of = np.empty(weight.shape[0], np.int64)
    pack_weight = np.zeros(num_packs)
    pack_size = np.zeros(num_packs, np.int64)
    for item in np.argsort(-weight, kind="stable"):
        pack = int(np.argmin(np.where(pack_size < capacity, pack_weight, np.inf)))
        pack_of[item] = pack
        pack_weight[pack] += weight[item]
        pack_size[pack] += 1
    return pack_of


def refine_packing(weight: np.ndarray, pack_of: np.ndarray, num_packs: int) -> np.ndarray:
    """Improve a packing by swapping items between the heaviest pack and another.

    Each round takes the heaviest pack h and, over every item i in h and every item j
    in another pack o, the swap that most lowers max(load[h], load[o]); it stops when
    no swap lowers it. Pack sizes never change. The sorted vector of pack loads falls
    lexicographically each round, so it ends; the round count is also capped. This is a
    standard 2-exchange local search after LPT (the greedy alone can lose to a plain
    round-robin placement on small instances, e.g. loads [8, 10, 12, 13, 4, 14] on 2
    packs: greedy 32, expert order 31); it is not part of DeepSeek's EPLB.

    weight: [n] float64 >= 0; pack_of: [n] ints in [0, num_packs).
    Returns [n] int64, the improved pack of each item (a new array).
    """
    pack_of = np.asarray(pack_of, np.int64).copy()
    pack_load = np.bincount(pack_of, weights=weight, minlength=num_packs)
    for _ in range(4 * weight.shape[0]):
        heavy = int(np.argmax(pack_load))
        inside = np.flatnonzero(pack_of == heavy)
        outside = np.flatnonzero(pack_of != heavy)
        if outside.size == 0:
            break
        # shift[i, j]: load that leaves the heavy pack when item i and item j swap.
        shift = weight[inside][:, None] - weight[outside][None, :]
        other = pack_load[pack_of[outside]][None, :]
        new_peak = np.maximum(pack_load[heavy] - shift, other + shift)
        best = np.unravel_index(np.argmin(new_peak), new_peak.shape)
        # A relative margin, so float rounding cannot make a swap look like a gain.
        if not new_peak[best] < pack_load[heavy] * (1 - 1e-12):
            break
        i, j = inside[best[0]], outside[best[1]]
        pack_load[heavy] -= shift[best]
        pack_load[pack_of[j]] += shift[best]
        pack_of[i], pack_of[j] = pack_of[j], heavy
    return pack_of


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


def minimize_movement(
    current: ArrayLike,
    planned: ArrayLike,
    ep: int,
    *,
    num_nodes: int = 1,
    relabel_devices: bool = True,
) -> tuple[np.ndarray, int]:
    """Reorder a plan of one layer so that the fewest slots change expert.

    The loads a plan balances depend only on which experts share a device, not on the
    slot order inside a device nor on which device of a node gets which set. So:
    with relabel_devices, each planned device's expert set is first assigned to the
    current device (of the same node) it overlaps most (maximum-weight matching,
    Hungarian algorithm); then, inside each device, a slot keeps its current expert
    whenever the planned set still contains it, and the remaining planned experts fill
    the remaining slots in increasing id. Both steps are optimal, so the result moves
    the fewest slots of any plan with the same device sets (up to that relabeling).
    Replanning the same load with a deterministic plan therefore moves nothing.

    Args:
        current: [S] ints, the expert each slot holds now.
        planned: [S] ints, the plan (e.g. a row of PlacementPlan.physical_to_logical).
        ep: number of devices; S % ep == 0.
        num_nodes: relabeling stays within a node (hierarchical plans keep a group's
            experts on its node); ep % num_nodes == 0.
        relabel_devices: False keeps every planned device set on its planned device.

    Returns:
        (physical_to_logical [S] int32, number of slots whose expert changed).

    Raises:
        ValueError: shapes differ, S % ep != 0, or ep % num_nodes != 0.
    """
    cur = np.asarray(current, np.int64)
    plan = np.asarray(planned, np.int64)
    if cur.ndim != 1 or cur.shape != plan.shape:
        raise ValueError(
            f"current/planned: expected equal [S] shapes, got {cur.shape} and {plan.shape}"
        )
    if ep < 1 or cur.shape[0] % ep:
        raise ValueError(f"ep: {ep} must be >= 1 and divide S={cur.shape[0]}")
    if num_nodes < 1 or ep % num_nodes:
        raise ValueError(f"num_nodes: {num_nodes} must be >= 1 and divide ep={ep}")
    cur_dev = cur.reshape(ep, -1)
    plan_dev = plan.reshape(ep, -1)
    if relabel_devices:
        plan_dev = plan_dev[_match_devices(cur_dev, plan_dev, num_nodes)]
    out = np.stack([_keep_in_place(c, p) for c, p in zip(cur_dev, plan_dev, strict=True)])
    out = out.reshape(-1)
    return out.astype(np.int32), int((out != cur).sum())


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
    of the fresh plan's balancedness (`planner_refine.replan_rows`, with the current
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
        slots, ok = planner_refine.replan_rows(row_load, cur_rows, row_target)
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


def _plan_layer(
    load: np.ndarray, num_slots: int, ep: int, num_nodes: int, num_groups: int, refine: bool
) -> np.ndarray:
    """[S] logical expert of each slot for one layer (DeepSeek's hierarchical policy;
    the global policy is the case num_nodes = num_groups = 1)."""
    num_experts = load.shape[0]
    group_size = num_experts // num_groups
    node_of_group = balanced_packing(load.reshape(num_groups, group_size).sum(1), num_nodes)
    slots_per_node = num_slots // num_nodes
    devices_per_node = ep // num_nodes
    slots_per_device = num_slots // ep
    p2l = np.empty(num_slots, np.int64)
    for node in range(num_nodes):
        groups = np.flatnonzero(node_of_group == node)
        experts = (groups[:, None] * group_size + np.arange(group_size)).ravel()
        counts = replicate_experts(load[experts], slots_per_node)
        replica_expert = np.repeat(experts, counts)
        replica_load = np.repeat(load[experts] / counts, counts)
        device_of = balanced_packing(replica_load, devices_per_node)
        if refine:
            device_of = refine_packing(replica_load, device_of, devices_per_node)
        for local in range(devices_per_node):
            start = (node * devices_per_node + local) * slots_per_device
            # Sorted by id: the order inside a device does not change its load.
            p2l[start : start + slots_per_device] = np.sort(replica_expert[device_of == local])
    return p2l


def _match_devices(cur_dev: np.ndarray, plan_dev: np.ndarray, num_nodes: int) -> np.ndarray:
    """[ep] planned device to put on each current device, maximising kept slots, within
    each node. cur_dev, plan_dev: [ep, S/ep]."""
    num_experts = int(max(cur_dev.max(), plan_dev.max())) + 1
    cur_counts = np.stack([np.bincount(d, minlength=num_experts) for d in cur_dev])
    plan_counts = np.stack([np.bincount(d, minlength=num_experts) for d in plan_dev])
    per_node = cur_dev.shape[0] // num_nodes
    order = np.arange(cur_dev.shape[0])
    for node in range(num_nodes):
        block = slice(node * per_node, (node + 1) * per_node)
        # overlap[d, p]: slots device d keeps if it receives planned set p.
        overlap = np.minimum(cur_counts[block, None, :], plan_counts[None, block, :]).sum(-1)
        rows, cols = linear_sum_assignment(overlap, maximize=True)
        order[block][rows] = cols + node * per_node
    return order


def _keep_in_place(current: np.ndarray, planned: np.ndarray) -> np.ndarray:
    """Slots of one device holding the multiset `planned`, keeping `current` entries
    wherever the multiset allows (the maximum number kept). Both [S/ep]."""
    remaining: dict[int, int] = {}
    for expert in planned.tolist():
        remaining[expert] = remaining.get(expert, 0) + 1
    out = np.full_like(current, -1)
    for slot, expert in enumerate(current.tolist()):
        if remaining.get(expert, 0) > 0:
            out[slot] = expert
            remaining[expert] -= 1
    leftovers = sorted(e for e, n in remaining.items() for _ in range(n))
    out[out == -1] = leftovers
    return out


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

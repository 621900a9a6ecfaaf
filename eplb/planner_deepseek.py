"""DeepSeek's Expert Parallelism Load Balancer as published, one layer at a time.

github.com/deepseek-ai/EPLB, eplb.py (vendored by vLLM as
vllm/distributed/eplb/rebalance_algo.py): `replicate_experts`, `balanced_packing`, and
their composition per layer, `plan_layer` (DeepSeek's hierarchical policy; the global
policy is its case num_nodes = num_groups = 1). `eplb.planner.plan_placement` runs it
with refine=False (the baseline the project's planner is measured against), and, with
`refine_packing` after the packing, where more slots per device than experts make
duplicates unavoidable. Pure NumPy.
"""

from __future__ import annotations

import numpy as np


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


def plan_layer(
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

"""Reordering a plan so that the fewest slots change expert (`minimize_movement`).

A plan's device loads depend only on which experts share a device, so the slot order
inside a device and which device of a node gets which set are free: this module uses
that freedom to keep experts where they already are. Pure NumPy (and SciPy's Hungarian
algorithm).
"""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike
from scipy.optimize import linear_sum_assignment


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

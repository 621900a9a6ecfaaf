"""The low-churn re-plan: the placement in use changed by few slots until its balance is
within a tolerance of a fresh plan's (`replan_rows`), on a batch of rows as in
eplb/planner_refine.py (whose local search it uses). Pure NumPy.
"""

from __future__ import annotations

import numpy as np

from jaxserve.eplb.planner_refine import EPS, refine_swaps, repeat_rows, replica_counts


def anchored_pack(
    current: np.ndarray, weight: np.ndarray, counts: np.ndarray, load: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """The current placement changed to the new replica counts by few slots.

    A slot keeps its expert unless it is a second copy on its device or its expert has
    more copies than counts allows (the copies on the most loaded devices, under the new
    load and the current counts, go first). Each missing copy, heaviest first, goes into
    a freed slot of the least loaded device (kept slots at the new weights) that does not
    hold that expert yet; that can run out (every device with a free slot holds it), and
    the row is then reported as failed (its plan still holds every copy, possibly twice
    on one device).

    current: [B, d, k] int64 experts (every expert at least once per row).
    weight: [B, n] new load of one copy (load / counts); counts: [B, n] new copies;
    load: [B, n] the new expert load.
    Returns ([B, d, k] int64 slots, [B] bool failed).
    """
    rows, num_devices, per_device = current.shape
    num_experts = counts.shape[1]
    flat = current.reshape(rows, -1)
    index = np.arange(rows)[:, None]
    # Second or later copy of an expert within one device.
    same = current[:, :, :, None] == current[:, :, None, :]
    duplicate = np.tril(same, -1).any(-1).reshape(rows, -1)
    old_counts = np.zeros((rows, num_experts), np.int64)
    np.add.at(old_counts, (np.broadcast_to(index, flat.shape), flat), 1)
    old_weight = np.take_along_axis(load / old_counts, flat, 1)
    device_load = np.repeat(old_weight.reshape(current.shape).sum(-1), per_device, axis=1)
    # Rank of each slot among the non-duplicate slots of its expert, lightest device first.
    row_id = np.broadcast_to(index, flat.shape).ravel()
    order = np.lexsort((device_load.ravel(), duplicate.ravel(), flat.ravel(), row_id))
    group = row_id[order] * num_experts + flat.ravel()[order]
    start = np.r_[True, group[1:] != group[:-1]]
    first = np.maximum.accumulate(np.where(start, np.arange(order.size), 0))
    rank = np.empty(order.size, np.int64)
    rank[order] = np.arange(order.size) - first
    keep = ~duplicate & (rank.reshape(flat.shape) < np.take_along_axis(counts, flat, 1))
    slots = np.where(keep, flat, -1).reshape(current.shape)
    kept = np.zeros((rows, num_experts), np.int64)
    np.add.at(kept, (np.broadcast_to(index, flat.shape)[keep], flat[keep]), 1)
    missing = counts - kept
    failed = np.zeros(rows, bool)
    if not missing.any():
        return slots, failed
    # The missing copies of each row, heaviest first, padded with -1.
    order = np.argsort(-weight, axis=1, kind="stable")
    width = int(missing.sum(1).max())
    todo = repeat_rows(order, np.take_along_axis(missing, order, 1), width)
    slot_weight = np.take_along_axis(weight, np.maximum(slots, 0).reshape(rows, -1), 1)
    dev_load = np.where(slots >= 0, slot_weight.reshape(slots.shape), 0.0).sum(-1)
    for t in range(width):
        live = np.flatnonzero(todo[:, t] >= 0)
        expert = todo[live, t]
        free = slots[live] < 0  # [A, d, k]
        holds = (slots[live] == expert[:, None, None]).any(-1)
        room = free.any(-1)
        ok = room & ~holds
        stuck = ~ok.any(1)
        failed[live[stuck]] = True
        usable = np.where(stuck[:, None], room, ok)
        device = np.argmin(np.where(usable, dev_load[live], np.inf), axis=1)
        a = np.arange(live.size)
        slot = np.argmax(free[a, device], axis=1)
        slots[live, device, slot] = expert
        dev_load[live, device] += weight[live, expert]
    return slots, failed


def replan_rows(
    load: np.ndarray, current: np.ndarray, target: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Every row's current placement changed by few slots until its max device load is at
    most target.

    First with the current copy counts (a row whose placement has no duplicate on a
    device and at most d copies of an expert): `refine_swaps` from the current slots,
    stopping as soon as the target is met (a noisy window of an unchanged load needs a
    few swaps; a fresh count vector would change the load of every copy of the experts
    whose count moved). Rows that miss it start again from `anchored_pack` to the new
    load's `replica_counts`, then `refine_swaps` with the target.

    load: [B, n] float64 >= 0; current: [B, d, k] int64 experts, every expert at least
    once per row; target: [B] float64.
    Returns ([B, d, k] int64 slots, unchanged slots in their current positions; [B]
    bool: the row met its target with no duplicate on a device).
    """
    rows, num_devices, per_device = current.shape
    num_experts = load.shape[1]
    flat = current.reshape(rows, -1)
    old_counts = np.zeros((rows, num_experts), np.int64)
    np.add.at(old_counts, (np.broadcast_to(np.arange(rows)[:, None], flat.shape), flat), 1)
    sorted_slots = np.sort(current, axis=-1)
    valid = ~(sorted_slots[..., 1:] == sorted_slots[..., :-1]).any((1, 2))
    valid &= old_counts.max(1) <= num_devices
    slots = current.copy()
    met = np.zeros(rows, bool)
    first = np.flatnonzero(valid)
    if first.size:
        counts = old_counts[first]
        slots[first] = refine_swaps(slots[first], load[first], counts, target=target[first])
        met[first] = _peak(slots[first], load[first] / counts) <= target[first] * (1 + EPS)
    again = np.flatnonzero(~met)
    if again.size == 0:
        return slots, met
    counts = replica_counts(load[again], num_devices * per_device, num_devices)
    weight = load[again] / counts
    fresh, failed = anchored_pack(current[again], weight, counts, load[again])
    ok = np.flatnonzero(~failed)
    sub = counts[ok]
    fresh[ok] = refine_swaps(fresh[ok], load[again][ok], sub, target=target[again][ok])
    counts[ok] = sub
    slots[again] = fresh
    met[again] = ~failed & (_peak(fresh, load[again] / counts) <= target[again] * (1 + EPS))
    return slots, met


def _peak(slots: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """[B] max device load of [B, d, k] slots under [B, n] copy loads."""
    copy_load = np.take_along_axis(weight, slots.reshape(slots.shape[0], -1), 1)
    return copy_load.reshape(slots.shape).sum(-1).max(1)

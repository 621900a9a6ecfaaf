"""The planner's own placement search: no expert twice on a device, at most d copies of
an expert, vectorised over every (layer, node) at once.

`eplb/planner.py` owns the public API; eplb/planner_deepseek.py DeepSeek's EPLB as
published; this module what the project adds to it (eplb/planner_replan.py the low-churn
re-plan on top of it). Every function works on a batch of B independent packing
problems of the same shape (a row is a layer in the global policy, a (layer, node) pair
in the hierarchical one): n experts of known load go into s slots on d devices of
k = s / d slots each, with k <= n (else some device must hold an expert twice). Pure
NumPy; the Python loops run over slots, copies or local-search rounds, never over rows.

The steps of a fresh plan (`plan_rows`; DeepSeek EPLB's structure,
github.com/deepseek-ai/EPLB, with the constraints):

1. `replica_counts`: DeepSeek's greedy (each redundant slot to the expert of highest
   load / copies, DeepSeek's ties), except that no expert gets more than d copies.
2. `pack_greedy`: DeepSeek's `balanced_packing` (replicas in decreasing load, each onto
   the least loaded device with a free slot: LPT with a cardinality limit, Graham 1969)
   never onto a device already holding that expert. Where DeepSeek's own plan has no
   duplicate this is DeepSeek's plan, so what follows can only improve on it.
   (`pack_rounds`, d replicas at a time, is the fallback for a row that runs out of
   devices without the expert.)
3. `sweep_pairs`: pairwise balancing sweeps (the i-th most loaded device swaps one slot
   with a rotating partner among the least loaded), d / 2 swaps per sweep.
4. `refine_swaps`: a 2-exchange local search on the most loaded device (the swap with one
   of the least loaded devices that most lowers the larger of the two loads), and where
   no swap helps, handing one of its slots to another expert (copy counts change),
   until neither lowers the max device load or a target is met.

Steps 3 and 4 never raise a row's max device load and never create a duplicate.
Slots of row b are device-major: slot j of device i is index i * k + j.
"""

from __future__ import annotations

import numpy as np

_INT_MAX = np.iinfo(np.int64).max
# Devices a swap partner of the most loaded device is looked for among (the least loaded
# ones, where a swap lowers the pair's max the most): 4x fewer candidates at d = 64.
_PARTNERS = 16
# Pairwise sweeps of a fresh plan before the heaviest-device search (see sweep_pairs).
_SWEEPS = 8
# Rounds of count-changing moves after the swaps are stuck (see refine_swaps).
_REASSIGN_PHASES = 4
# Penalty on a device that already holds the expert being packed (pack_greedy).
_HELD = 1e300
# Relative margin under which a swap does not count as a gain (float rounding).
EPS = 1e-12


def replica_counts(load: np.ndarray, num_slots: int, cap: int) -> np.ndarray:
    """Copies of each expert that minimise the largest load / copies, at most `cap` each.

    DeepSeek EPLB's `replicate_experts` greedy (each of the s - n redundant slots goes to
    the expert with the highest load / copies at that moment; optimal for that max), with
    its ties (fewer copies, then lower index: zero load spreads copies round-robin), and
    the experts at `cap` copies skipped. Only the s - n heaviest experts (lower index
    first among equal loads) can receive a copy: one of them always has load / 1 at
    least as high as any other expert's, and wins its ties. So the loop runs on those,
    updating one entry per row per slot; where no count reaches cap it is DeepSeek's.

    load: [B, n] float64 >= 0; num_slots: s with n <= s <= n * cap.
    Returns [B, n] int64 in [1, cap], each row summing to s.
    """
    rows, num_experts = load.shape
    counts = np.ones((rows, num_experts), np.int64)
    extra = num_slots - num_experts
    if extra == 0:
        return counts
    heaviest = np.argsort(-load, axis=1, kind="stable")[:, : min(num_experts, extra)]
    candidates = np.sort(heaviest, axis=1)  # by index, for the ties
    cand_load = np.take_along_axis(load, candidates, 1)
    cand_counts = np.ones(candidates.shape, np.int64)
    ratio = cand_load.copy() if cap > 1 else np.full(cand_load.shape, -np.inf)
    index = np.arange(rows)
    for _ in range(extra):
        tied = ratio == ratio.max(1, keepdims=True)
        pick = np.argmin(np.where(tied, cand_counts, _INT_MAX), axis=1)
        copies = cand_counts[index, pick] + 1
        cand_counts[index, pick] = copies
        ratio[index, pick] = np.where(copies >= cap, -np.inf, cand_load[index, pick] / copies)
    np.put_along_axis(counts, candidates, cand_counts, 1)
    return counts


def pack_rounds(weight: np.ndarray, counts: np.ndarray, num_devices: int) -> np.ndarray:
    """Pack every row's replicas onto devices, k per device, no expert twice on a device.

    weight: [B, n] float64, the load of one copy of each expert (load / counts).
    counts: [B, n] ints in [1, d], rows summing to s = d * k with k <= n.
    Returns [B, d, k] int64, the expert of each slot (each device's experts in the order
    they were placed).
    """
    rows = weight.shape[0]
    num_slots = int(counts[0].sum())
    per_device = num_slots // num_devices
    index = np.arange(rows)[:, None]
    # Replicas in decreasing weight, an expert's copies consecutive (stable: by id).
    order = np.argsort(-weight, axis=1, kind="stable")
    item = repeat_rows(order, np.take_along_axis(counts, order, 1), num_slots)
    item_weight = np.take_along_axis(weight, item, 1)
    slots = np.empty((rows, num_devices, per_device), np.int64)
    slots[:, :, 0] = item[:, :num_devices]
    load = item_weight[:, :num_devices].copy()
    for r in range(1, per_device):
        block = slice(r * num_devices, (r + 1) * num_devices)
        # Only the round's first expert can have copies in the rounds before.
        held = (slots[:, :, :r] == item[:, block][:, :1, None]).any(-1)
        device = np.argsort(np.where(held, np.inf, load), axis=1, kind="stable")
        slots[index, device, r] = item[:, block]
        load[index, device] += item_weight[:, block]
    return slots


def pack_greedy(weight: np.ndarray, counts: np.ndarray, num_devices: int) -> np.ndarray:
    """DeepSeek EPLB's `balanced_packing` on every row at once, never onto a device that
    holds the expert already: replicas in decreasing weight (an expert's copies
    consecutive, equal weights by id), each onto the least loaded device (ties: lower
    index) with a free slot and without that expert. Where DeepSeek's own packing puts no
    expert twice on a device it makes the same choices, so the plan starts from
    DeepSeek's. A row can run out of such devices (its free slots all on devices holding
    the expert); it then gets `pack_rounds`' packing, which never does.

    weight, counts, returns: as `pack_rounds` (each device's experts in placing order).
    """
    rows = weight.shape[0]
    num_slots = int(counts[0].sum())
    per_device = num_slots // num_devices
    order = np.argsort(-weight, axis=1, kind="stable")
    item = repeat_rows(order, np.take_along_axis(counts, order, 1), num_slots)
    item_weight = np.take_along_axis(weight, item, 1)
    # A device that holds the current expert gets this much on top of its key: still
    # below a full device's inf, so a row out of choices puts a duplicate (found below)
    # rather than overfill a device.
    same_next = np.zeros((rows, num_slots))
    same_next[:, :-1] = np.where(item[:, 1:] == item[:, :-1], _HELD, 0.0)
    keep_next = same_next > 0
    slots = np.zeros((rows * num_devices, per_device), np.int64)
    load = np.zeros(rows * num_devices)
    size = np.zeros(rows * num_devices, np.int64)
    key = np.zeros((rows, num_devices))  # device load, inf when full
    held = np.zeros((rows, num_devices))  # _HELD on the devices of the current expert
    base = np.arange(rows) * num_devices
    start = 0
    if num_devices <= num_slots and (item_weight[:, :num_devices] > 0).all():
        # Round one needs no loop: with positive weights the i-th replica meets i loaded
        # devices and takes the first empty one, device i.
        slots[:, 0] = item[:, :num_devices].ravel()
        load[:] = item_weight[:, :num_devices].ravel()
        size[:] = 1
        key[:] = load.reshape(rows, -1) if per_device > 1 else np.inf
        prev = item[:, num_devices - 1]
        same = item[:, num_devices] == prev if num_devices < num_slots else prev < 0
        run = item[:, :num_devices] == prev[:, None]  # the devices of that expert
        held[:] = np.where(same[:, None] & run, _HELD, 0.0)
        start = num_devices
    key_flat, held_flat = key.ravel(), held.ravel()
    for t in range(start, num_slots):
        flat = base + (key + held).argmin(1)
        filled = size[flat]
        slots[flat, filled] = item[:, t]
        filled += 1
        size[flat] = filled
        new = load[flat] + item_weight[:, t]
        load[flat] = new
        key_flat[flat] = np.where(filled < per_device, new, np.inf)
        held *= keep_next[:, t : t + 1]
        held_flat[flat] = same_next[:, t]
    slots = slots.reshape(rows, num_devices, per_device)
    sorted_slots = np.sort(slots, axis=-1)
    stuck = (sorted_slots[..., 1:] == sorted_slots[..., :-1]).any((1, 2))
    if stuck.any():
        slots[stuck] = pack_rounds(weight[stuck], counts[stuck], num_devices)
    return slots


def sweep_pairs(slots: np.ndarray, weight: np.ndarray, sweeps: int) -> np.ndarray:
    """Pairwise balancing rounds on every row at once (in place, and returned).

    Each sweep sorts a row's devices by load and pairs the i-th most loaded with the
    ((i + sweep) mod d/2)-th least loaded (i < d / 2); every pair takes, at once, the
    swap of one slot each that most lowers the larger of its two loads (no expert twice
    on a device), if any. Pairs are disjoint, so a sweep makes up to d / 2 swaps, and the
    rotation gives each loaded device new partners: it flattens the whole load profile
    (not only its maximum) in a few vectorised steps; `refine_swaps` finishes.

    slots: [B, d, k] int64 experts (no duplicates in a device); weight: [B, n].
    """
    rows, num_devices, per_device = slots.shape
    half = num_devices // 2
    if half == 0 or rows == 0:
        return slots
    state = _SwapState(slots, weight)
    base = (np.arange(rows) * num_devices)[:, None]
    for sweep in range(sweeps):
        by_load = np.argsort(state.load.reshape(rows, -1), axis=1, kind="stable")
        heavy = by_load[:, : -half - 1 : -1] + base  # [B, P] flat device ids
        light = np.roll(by_load[:, :half], -(sweep % half), axis=1) + base
        peak, shift = state.swap_peaks(heavy, light)  # [B, P, k, k]
        peak = peak.reshape(rows, half, -1)
        best = peak.argmin(-1)
        gain = np.take_along_axis(peak, best[..., None], -1)[..., 0] < state.load[heavy] * (1 - EPS)
        # No early exit when no pair gains: the next rotation pairs other devices (and
        # a row's result must not depend on the other rows of the batch).
        i, j = np.divmod(best[gain], per_device)
        state.swap(
            heavy[gain],
            i,
            light[gain],
            j,
            shift[gain].reshape(-1, per_device**2)[np.arange(i.size), best[gain]],
        )
    return slots


def refine_swaps(
    slots: np.ndarray,
    load: np.ndarray,
    counts: np.ndarray,
    *,
    target: np.ndarray | None = None,
    max_rounds: int | None = None,
) -> np.ndarray:
    """Local search on every row at once (slots and counts in place; slots returned).

    Each round, in every row still improving, takes the most loaded device h and, over
    every slot of h and every slot of the `_PARTNERS` least loaded devices, the swap
    that most lowers max(load[h], load[o]) without putting an expert twice on a device
    (a 2-exchange, as after LPT). Where no swap helps it tries to hand one slot of h to
    another expert (`_SwapState.reassign`: the copy counts change, so every copy of both
    experts changes load), if that lowers the max device load. A row stops when neither
    helps, or its max load is at most target[b]. Each accepted move lowers the sorted
    device loads lexicographically, so it ends; `max_rounds` (default 4 * s) caps it.

    slots: [B, d, k] int64 experts (no duplicates in a device); load: [B, n] expert
    load; counts: [B, n] int64 copies (the bincount of slots), at most d each; target:
    [B] float64 or None.
    """
    rows, num_devices, per_device = slots.shape
    if num_devices == 1 or rows == 0:
        return slots
    state = _SwapState(slots, load / counts)
    device_load = state.load.reshape(rows, -1)
    partners = min(num_devices - 1, _PARTNERS)
    active = np.arange(rows)
    for _ in range(_REASSIGN_PHASES + 1):
        # Swaps until every row is stuck (or meets its target), then one reassignment
        # for all the stuck rows at once; the rows it moved swap again.
        stuck = []
        rounds = max_rounds if max_rounds is not None else 4 * slots[0].size
        while active.size and rounds > 0:
            rounds -= 1
            if target is not None:
                active = active[device_load[active].max(1) > target[active]]
                if active.size == 0:
                    break
            row_load = device_load[active]
            base = (active * num_devices)[:, None]
            heavy = row_load.argmax(1)[:, None] + base  # [A, 1]
            light = np.argpartition(row_load, partners - 1, axis=1)[:, :partners] + base
            peak, shift = state.swap_peaks(np.broadcast_to(heavy, light.shape), light)
            peak = np.where((light == heavy)[..., None, None], np.inf, peak)  # equal loads
            peak = peak.transpose(0, 2, 1, 3).reshape(active.size, -1)  # [A, k * P * k]
            best = peak.argmin(1)
            gain = peak[np.arange(active.size), best] < state.load[heavy[:, 0]] * (1 - EPS)
            i, p, j = np.unravel_index(best[gain], (per_device, partners, per_device))
            moved = shift[gain][np.arange(i.size), p, i, j]
            state.swap(heavy[gain, 0], i, light[gain][np.arange(i.size), p], j, moved)
            stuck.append(active[~gain])
            active = active[gain]
        if not stuck:
            break
        stuck = np.sort(np.concatenate(stuck))
        if stuck.size == 0:
            break
        heavy = device_load[stuck].argmax(1)
        active = stuck[state.reassign(stuck, heavy, load, counts)]
    return slots


def _member(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """x[..., i] in y[..., :], for each i ([..., a] bool; leading dims broadcast). A loop
    over y's few columns: 6x faster than `(x[..., None] == y[..., None, :]).any(-1)`."""
    out = x == y[..., :1]
    for j in range(1, y.shape[-1]):
        out = out | (x == y[..., j : j + 1])
    return out


def repeat_rows(order: np.ndarray, reps: np.ndarray, width: int) -> np.ndarray:
    """[B, width] int64: row b lists order[b, j] reps[b, j] times, j ascending, padded
    with -1 (rows sum to at most width). One searchsorted over all rows: row b's
    cumulative counts are offset by b * width, which keeps the flat array sorted."""
    rows, num = order.shape
    index = np.arange(rows)[:, None]
    ends = np.cumsum(reps, axis=1)
    pos = index * width + np.arange(width)
    rank = np.searchsorted((ends + index * width).ravel(), pos.ravel(), side="right")
    rank = rank.reshape(rows, width) - index * num
    out = np.take_along_axis(order, np.minimum(rank, num - 1), 1)
    return np.where(rank < num, out, -1)


def plan_rows(load: np.ndarray, num_slots: int, num_devices: int) -> np.ndarray:
    """A fresh plan of every row: `replica_counts` (cap d), `pack_rounds`, `sweep_pairs`,
    `refine_swaps`.

    load: [B, n] float64 >= 0; s = num_slots with s % d == 0 and s / d <= n.
    Returns [B, d, k] int64 experts, each device's experts in increasing id.
    """
    counts = replica_counts(load, num_slots, num_devices)
    weight = load / counts
    slots = sweep_pairs(pack_greedy(weight, counts, num_devices), weight, _SWEEPS)
    return np.sort(refine_swaps(slots, load, counts), axis=-1)


class _SwapState:
    """Views of a [B, d, k] packing by flat device id (b * d + device): the slots, each
    slot's copy load, and each device's load; moves update all three in place."""

    def __init__(self, slots: np.ndarray, weight: np.ndarray):
        rows, num_devices, per_device = slots.shape
        self.shape = slots.shape
        self.slots = slots.reshape(rows * num_devices, per_device)
        copy_load = np.take_along_axis(weight, slots.reshape(rows, -1), 1)
        self.copy_load = copy_load.reshape(rows * num_devices, per_device)
        self.load = self.copy_load.sum(-1)

    def swap_peaks(self, heavy: np.ndarray, light: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """For device pairs heavy[...] / light[...] (flat ids, same shape [..]): the larger
        of the two loads after swapping slot i of heavy with slot j of light ([.., k, k];
        inf where that puts an expert twice on a device), and the load it moves."""
        e_h, e_l = self.slots[heavy], self.slots[light]
        shift = self.copy_load[heavy][..., :, None] - self.copy_load[light][..., None, :]
        peak = np.maximum(
            self.load[heavy][..., None, None] - shift, self.load[light][..., None, None] + shift
        )
        bad = _member(e_h, e_l)[..., :, None] | _member(e_l, e_h)[..., None, :]
        peak[bad] = np.inf
        return peak, shift

    def swap(
        self, heavy: np.ndarray, i: np.ndarray, light: np.ndarray, j: np.ndarray, moved: np.ndarray
    ) -> None:
        """Swap slot i of device heavy with slot j of device light (flat ids, 1-D)."""
        self.slots[heavy, i], self.slots[light, j] = self.slots[light, j], self.slots[heavy, i]
        cl = self.copy_load
        cl[heavy, i], cl[light, j] = cl[light, j], cl[heavy, i]
        self.load[heavy] -= moved
        self.load[light] += moved

    def reassign(
        self, rows: np.ndarray, heavy: np.ndarray, load: np.ndarray, counts: np.ndarray
    ) -> np.ndarray:
        """In each of `rows` (1-D, distinct), give one slot of its device `heavy` (its most
        loaded) to another expert where that lowers the row's max device load: slot i of
        expert a (>= 2 copies) becomes a copy of the expert b, not on that device and
        with fewer than d copies, whose new copy is lightest (load[b] / (c_b + 1)).
        Every copy of a then carries load[a] / (c_a - 1) and every copy of b load[b] /
        (c_b + 1); the move is taken if h's new load and every other device's load with
        a's heavier copies (b's lighter ones ignored: they only help) are below h's
        load. Updates counts and the state; returns [len(rows)] bool, moved.
        """
        _, num_devices, _ = self.shape
        r = np.arange(rows.size)
        slots = self.slots.reshape(self.shape)[rows]  # [R, d, k]
        dev_load = self.load.reshape(self.shape[:2])[rows]  # [R, d]
        row_load, row_counts = load[rows], counts[rows]
        e_h = slots[r, heavy]  # [R, k]
        c_a = np.take_along_axis(row_counts, e_h, 1)
        l_a = np.take_along_axis(row_load, e_h, 1)
        fill = np.where(row_counts < num_devices, row_load / (row_counts + 1), np.inf)
        fill[r[:, None], e_h] = np.inf  # not onto h twice
        b = fill.argmin(1)  # [R]
        holds_a = _member(e_h[:, :, None, None], slots[:, None])[..., 0]  # [R, k, d]
        holds_a[r, :, heavy] = False
        inc_a = l_a / np.maximum(c_a - 1, 1) - l_a / c_a  # [R, k]
        others = np.where(
            (np.arange(num_devices) == heavy[:, None])[:, None, :],
            -np.inf,
            dev_load[:, None, :] + inc_a[..., None] * holds_a,
        ).max(-1)
        h_load = dev_load[r, heavy]
        new_h = h_load[:, None] - l_a / c_a + fill[r, b][:, None]
        peak = np.where(c_a > 1, np.maximum(others, new_h), np.inf)
        i = peak.argmin(1)
        moved = peak[r, i] < h_load * (1 - EPS)
        m = np.flatnonzero(moved)
        if m.size:
            row, i, a, b = rows[m], i[m], e_h[m, i[m]], b[m]
            counts[row, a] -= 1
            counts[row, b] += 1
            self.slots[row * num_devices + heavy[m], i] = b
            devices = (row * num_devices)[:, None] + np.arange(num_devices)  # [M, d]
            weight = load[row] / counts[row]
            self.copy_load[devices] = np.take_along_axis(
                weight, self.slots[devices].reshape(m.size, -1), 1
            ).reshape(m.size, num_devices, -1)
            self.load[devices] = self.copy_load[devices].sum(-1)
        return moved

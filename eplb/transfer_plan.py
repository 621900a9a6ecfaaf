"""EPLB re-placement plan on the host: which current slot every new slot copies from, and
the int32 index tables the compiled move (`eplb/executor.py`) runs on.

1. `source_slots` picks for every new slot s a current slot holding expert new_p2l[s]:
   s itself when it already holds it, else a slot on s's device, else a slot on another
   device (the one that has sent this device the fewest slots so far, to keep the
   per-link transfer count, and so the buffers, small).
2. `transfer_tables` turns the sources into int32 index tables: a local gather per
   device, and for each ring shift r = 1 .. ep-1 which of its slots device d sends to
   device (d + r) % ep and where the receiver puts them, and how many transfers each
   round needs.

Pure NumPy: tested against brute force without devices (tests/test_eplb_executor.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class TransferTables:
    """Host int32 index tables of one re-placement (`transfer_tables`).

    local_source: [ep, L, S/ep], device d's new local slot j takes its own current local
        slot local_source[d, l, j] (slots filled by a transfer are overwritten after).
    send_slots: [ep, L, ep - 1, C], in ring round r (shift r + 1) device d sends its
        current local slots send_slots[d, l, r, :] to device (d + r + 1) % ep; unused
        entries are 0 (sent, then dropped by the receiver).
    recv_slots: [ep, L, ep - 1, C], device d writes row k received in round r into its
        new local slot recv_slots[d, l, r, k]; S/ep marks an unused row (dropped).
    round_slots: [ep, L, ep - 1], the slots round r of layer l sends: the most any
        device sends in it (the same on every device, so all run as many transfers).
    """

    local_source: np.ndarray
    send_slots: np.ndarray
    recv_slots: np.ndarray
    round_slots: np.ndarray


def source_slots(current_p2l: np.ndarray, new_p2l: np.ndarray, ep: int) -> np.ndarray:
    """The current slot each new slot copies its weights from (one layer, host).

    New slot s keeps its own weights when current_p2l[s] == new_p2l[s]; otherwise it
    takes a current slot holding new_p2l[s] on its own device (lowest index) if there is
    one, else one on another device: the device that has so far sent s's device the
    fewest slots (ties: lowest slot index), which keeps the per-link count, and so the
    capacity `PlacementExecutor` needs, small.

    Args:
        current_p2l: [S] ints, the logical expert each slot holds now.
        new_p2l: [S] ints, the logical expert each slot should hold.
        ep: number of expert-parallel devices; S % ep == 0 (slots of device d:
            [d * S/ep, (d + 1) * S/ep)).

    Returns:
        [S] int32, source slot of every new slot; current_p2l[src[s]] == new_p2l[s].

    Raises:
        ValueError: shapes differ or are not 1-D (names the argument), ep does not
            divide S, or an expert of new_p2l is held by no current slot.
    """
    cur, new = _check_pair(current_p2l, new_p2l)
    num_slots = cur.shape[0]
    if ep < 1 or num_slots % ep:
        raise ValueError(f"ep: {ep} must be >= 1 and divide S={num_slots}")
    per_device = num_slots // ep
    holders: dict[int, list[int]] = {}
    for slot, expert in enumerate(cur.tolist()):
        holders.setdefault(expert, []).append(slot)
    missing = sorted(set(new.tolist()) - holders.keys())
    if missing:
        raise ValueError(
            f"new_p2l: experts {missing[:10]} are held by no slot of current_p2l "
            "(weights can only be copied from a slot that holds them)"
        )
    src = np.arange(num_slots, dtype=np.int32)
    sent = np.zeros((ep, ep), np.int64)  # sent[from, to]: remote copies so far
    for slot in np.flatnonzero(cur != new).tolist():
        device = slot // per_device
        candidates = holders[int(new[slot])]
        local = [c for c in candidates if c // per_device == device]
        if local:
            src[slot] = local[0]
            continue
        best = min(candidates, key=lambda c: (sent[c // per_device, device], c))
        sent[best // per_device, device] += 1
        src[slot] = best
    return src


def transfer_tables(sources: np.ndarray, ep: int, capacity: int) -> TransferTables:
    """The index tables of the compiled move, from every layer's source slots.

    Args:
        sources: [L, S] ints, `source_slots` of each layer.
        ep: number of devices; S % ep == 0.
        capacity: C, most slots one device may send another in one re-placement.

    Raises:
        ValueError: a device needs more than `capacity` slots from one other device
            (names the layer and devices).
    """
    src = np.asarray(sources, np.int64)
    num_layers, num_slots = src.shape
    per_device = num_slots // ep
    rounds = ep - 1
    local = np.tile(np.arange(per_device, dtype=np.int32), (ep, num_layers, 1))
    send = np.zeros((ep, num_layers, rounds, capacity), np.int32)
    recv = np.full((ep, num_layers, rounds, capacity), per_device, np.int32)
    round_slots = np.zeros((ep, num_layers, rounds), np.int32)
    for layer in range(num_layers):
        used = np.zeros((ep, rounds), np.int64)  # rows used per (receiver, round)
        for slot, source in enumerate(src[layer].tolist()):
            dst_dev, j = divmod(slot, per_device)
            src_dev, i = divmod(source, per_device)
            if src_dev == dst_dev:
                local[dst_dev, layer, j] = i
                continue
            r = (dst_dev - src_dev) % ep - 1
            k = used[dst_dev, r]
            if k >= capacity:
                raise ValueError(
                    f"new_p2l: layer {layer}: device {dst_dev} needs more than "
                    f"max_transfer_slots={capacity} slots from device {src_dev}"
                )
            send[src_dev, layer, r, k] = i
            recv[dst_dev, layer, r, k] = j
            used[dst_dev, r] += 1
        round_slots[:, layer] = used.max(axis=0)
    return TransferTables(local, send, recv, round_slots)


def _check_pair(current_p2l, new_p2l) -> tuple[np.ndarray, np.ndarray]:
    cur, new = np.asarray(current_p2l), np.asarray(new_p2l)
    for name, table in (("current_p2l", cur), ("new_p2l", new)):
        if table.ndim != 1 or not np.issubdtype(table.dtype, np.integer):
            raise ValueError(f"{name}: expected int [S], got {table.dtype} {table.shape}")
    if cur.shape != new.shape:
        raise ValueError(f"new_p2l: expected the shape of current_p2l {cur.shape}, got {new.shape}")
    return cur.astype(np.int64), new.astype(np.int64)


__all__ = ["TransferTables", "source_slots", "transfer_tables"]

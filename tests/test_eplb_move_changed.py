"""The EPLB move sends only the slots that change: per ring round as many one-slot
transfers as its busiest device needs, none for a round (or a placement) that moves
nothing. On 8 emulated CPU devices.

Oracles: the weights each slot should hold (`logical[new_p2l]`, indexed on the host);
the bytes on the wire counted by brute force from `source_slots`; the collective-permute
buffers of the compiled move (one slot each).
"""

from __future__ import annotations

import re

import jax
import numpy as np
import pytest

from jaxserve.eplb.executor import PlacementExecutor
from jaxserve.eplb.transfer_plan import source_slots
from jaxserve.sharding.mesh import build_mesh
from jaxserve.sharding.rules import named_sharding

NUM_EXPERTS, NUM_SLOTS, HIDDEN, INTER, NUM_LAYERS, EP = 16, 24, 16, 8, 2, 8
PER_DEVICE = NUM_SLOTS // EP


@pytest.fixture(scope="module")
def setup():
    mesh = build_mesh(EP, 1)
    rng = np.random.default_rng(0)
    logical = [
        (rng.standard_normal((NUM_EXPERTS, HIDDEN, INTER)).astype(np.float32),)
        for _ in range(NUM_LAYERS)
    ]
    cur = np.stack([np.arange(NUM_SLOTS) % NUM_EXPERTS] * NUM_LAYERS)
    sharding = named_sharding(mesh, ("experts", None, None))
    structs = [
        (jax.ShapeDtypeStruct((NUM_SLOTS, HIDDEN, INTER), np.float32, sharding=sharding),)
        for _ in range(NUM_LAYERS)
    ]
    executor = PlacementExecutor(mesh, structs, NUM_EXPERTS, NUM_SLOTS - NUM_EXPERTS + 1)
    return mesh, logical, cur, sharding, executor


def _weights(logical, p2l, sharding):
    return [
        (jax.device_put(layer[0][row], sharding),) for layer, row in zip(logical, p2l, strict=True)
    ]


def _wire_bytes_brute_force(cur, new) -> int:
    """Per (layer, ring round): the most slots any device receives in it, times ep
    devices sending that many slots, times the slot's bytes."""
    slot_bytes = HIDDEN * INTER * 4
    total = 0
    for c, n in zip(cur, new, strict=True):
        src = source_slots(c, n, EP)
        per_round = np.zeros((EP - 1, EP), int)  # [round, receiver]
        for slot, source in enumerate(src):
            dst_dev, src_dev = slot // PER_DEVICE, source // PER_DEVICE
            if dst_dev != src_dev:
                per_round[(dst_dev - src_dev) % EP - 1, dst_dev] += 1
        total += EP * per_round.max(axis=1).sum() * slot_bytes
    return total


def _apply(setup, new):
    mesh, logical, cur, sharding, executor = setup
    weights, _, stats = executor.apply(_weights(logical, cur, sharding), cur, new)
    for layer, row, w in zip(logical, new, weights, strict=True):
        np.testing.assert_array_equal(np.asarray(w[0]), layer[0][row])
    return stats


def test_unchanged_placement_sends_nothing(setup):
    stats = _apply(setup, setup[2].copy())
    assert stats.bytes_on_wire == 0 and stats.slots_moved_remote == 0


def test_one_remote_slot_sends_one_round_of_one_slot(setup):
    cur = setup[2]
    new = cur.copy()
    # Slot 0 (device 0) takes expert 5, held by slots 5 and 21 on devices 1 and 7: one
    # transfer; expert 0 keeps slot 16.
    new[0, 0] = 5
    stats = _apply(setup, new)
    assert stats.slots_moved_remote == 1
    assert stats.bytes_on_wire == EP * HIDDEN * INTER * 4 == _wire_bytes_brute_force(cur, new)


@pytest.mark.parametrize("seed", [1, 2])
def test_random_moves_send_the_busiest_device_count_per_round(setup, seed):
    rng = np.random.default_rng(seed)
    cur = setup[2]
    new = np.stack([rng.permutation(np.arange(NUM_SLOTS) % NUM_EXPERTS) for _ in range(NUM_LAYERS)])
    stats = _apply(setup, new)
    assert stats.bytes_on_wire == _wire_bytes_brute_force(cur, new) > 0
    # Never more than the padded rounds of the capacity (the move before this change).
    padded = NUM_LAYERS * EP * (EP - 1) * PER_DEVICE * HIDDEN * INTER * 4
    assert stats.bytes_on_wire < padded


def test_each_transfer_moves_one_slot(setup):
    executor = setup[4]
    hlo = executor._compiled.as_text()
    shapes = re.findall(r"= (f32\[[\d,]*\])\{[^}]*\} collective-permute\(", hlo)
    assert shapes and set(shapes) == {f"f32[{HIDDEN},{INTER}]"}

"""Tests of the planner's own additions (eplb/planner_refine.py through plan_placement): no
expert twice on a device, at most ep (node) copies, the capped replica counts against
brute force, DeepSeek's packing reproduced where it already meets the constraints, and
the low-churn re-plan (`tolerance`) on unchanged and shifted load.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from jaxserve.eplb import planner_refine
from jaxserve.eplb.planner import (
    balanced_packing,
    device_load,
    plan_placement,
    replicate_experts,
)
from jaxserve.eplb.recorder import balancedness


def _zipf(rng: np.random.Generator, layers: int, experts: int, s: float) -> np.ndarray:
    weight = 1.0 / np.arange(1, experts + 1) ** s
    return np.stack([rng.permutation(weight / weight.sum()) for _ in range(layers)])


def _window(rng: np.random.Generator, popularity: np.ndarray, routings: int) -> np.ndarray:
    return np.stack([rng.multinomial(routings, p) for p in popularity]).astype(np.float64)


def _check_constraints(p2l: np.ndarray, num_experts: int, ep: int, num_nodes: int) -> None:
    """No device holds an expert twice; every expert has 1..ep/num_nodes copies."""
    for row in p2l:
        for device in row.reshape(ep, -1):
            assert len(set(device.tolist())) == device.size, device
        counts = np.bincount(row, minlength=num_experts)
        assert counts.min() >= 1 and counts.max() <= ep // num_nodes, counts


@pytest.mark.parametrize("hierarchical", [False, True])
def test_no_duplicates_and_bounded_copies_on_random_loads(hierarchical: bool) -> None:
    rng = np.random.default_rng(20)
    checked = 0
    for _ in range(60):
        num_nodes = int(rng.choice([2, 4])) if hierarchical else 1
        ep = num_nodes * int(rng.integers(1, 5))
        num_groups = num_nodes * int(rng.integers(1, 3)) if hierarchical else None
        num_experts = (num_groups or 1) * int(rng.integers(1, 17))
        per_device = int(rng.integers(1, num_experts // num_nodes + 1))
        num_slots = ep * per_device
        if num_slots < num_experts:
            continue
        kind = rng.integers(3)
        shape = (int(rng.integers(1, 5)), num_experts)
        if kind == 0:  # one expert with nearly all the load
            load = rng.integers(0, 3, shape).astype(float)
            load[:, rng.integers(num_experts)] = 10_000
        elif kind == 1:
            load = _window(rng, _zipf(rng, shape[0], num_experts, 1.2), 5000)
        else:
            load = rng.exponential(1.0, shape)
        plan = plan_placement(load, num_slots, ep, num_nodes=num_nodes, num_groups=num_groups)
        _check_constraints(plan.physical_to_logical, num_experts, ep, num_nodes)
        checked += 1
    assert checked > 30


def test_no_duplicates_on_the_eplb_workload() -> None:
    # The goal shapes: 256 experts, 64 devices in 8 nodes, 320 slots.
    rng = np.random.default_rng(21)
    load = _window(rng, _zipf(rng, 4, 256, 1.0), 100_000)
    for kwargs in ({}, {"num_nodes": 8, "num_groups": 8}):
        plan = plan_placement(load, 320, 64, **kwargs)
        _check_constraints(plan.physical_to_logical, 256, 64, kwargs.get("num_nodes", 1))
        # DeepSeek's plan of the same load does break both (so the check can fail).
        deepseek = plan_placement(load, 320, 64, refine=False, **kwargs).physical_to_logical
        with pytest.raises(AssertionError):
            _check_constraints(deepseek, 256, 64, kwargs.get("num_nodes", 1))


def test_more_slots_per_device_than_experts_still_plans() -> None:
    # Duplicates cannot be avoided (3 slots per device, 2 experts): the plan is
    # DeepSeek's greedy counts (5 / 5 copies beats 1 / 1 at every redundant slot) with
    # every expert on a slot.
    plan = plan_placement(np.array([[5.0, 1.0]]), 6, 2)
    np.testing.assert_array_equal(plan.replica_counts[0], [5, 1])
    np.testing.assert_array_equal(
        plan.replica_counts[0], replicate_experts(np.array([5.0, 1.0]), 6)
    )


def test_capped_replica_counts_minimise_max_load_per_copy() -> None:
    rng = np.random.default_rng(22)
    for _ in range(300):
        n, cap = int(rng.integers(1, 6)), int(rng.integers(1, 5))
        num_slots = int(rng.integers(n, n * cap + 1))
        if rng.integers(2):
            load = rng.integers(0, 5, (1, n)).astype(float)
        else:
            load = rng.exponential(1.0, (1, n))
        counts = planner_refine.replica_counts(load, num_slots, cap)[0]
        assert counts.sum() == num_slots and counts.min() >= 1 and counts.max() <= cap
        best = min(
            (load[0] / np.array(c)).max()
            for c in itertools.product(range(1, cap + 1), repeat=n)
            if sum(c) == num_slots
        )
        assert (load[0] / counts).max() <= best * (1 + 1e-12)
        if counts.max() < cap:  # the cap did not bind: DeepSeek's greedy, ties and all
            np.testing.assert_array_equal(counts, replicate_experts(load[0], num_slots))


def test_packing_is_deepseeks_where_deepseek_has_no_duplicates() -> None:
    rng = np.random.default_rng(23)
    compared = 0
    for _ in range(400):
        devices, n = int(rng.integers(1, 6)), int(rng.integers(2, 12))
        per_device = int(rng.integers(1, n + 1))
        num_slots = devices * per_device
        if num_slots < n:
            continue
        load = rng.exponential(1.0, n)
        counts = replicate_experts(load, num_slots)
        if counts.max() > devices:
            continue
        experts = np.repeat(np.arange(n), counts)
        pack = balanced_packing(np.repeat(load / counts, counts), devices)
        deepseek = [sorted(experts[pack == d].tolist()) for d in range(devices)]
        if any(len(set(d)) < len(d) for d in deepseek):
            continue
        ours = planner_refine.pack_greedy((load / counts)[None], counts[None], devices)[0]
        assert [sorted(d) for d in ours.tolist()] == deepseek
        compared += 1
    assert compared > 50


@pytest.mark.parametrize("kwargs", [{}, {"num_nodes": 4, "num_groups": 8}])
@pytest.mark.parametrize("zipf", [0.6, 1.0])
def test_replan_of_unchanged_load_moves_few_slots(kwargs: dict, zipf: float) -> None:
    rng = np.random.default_rng(24)
    layers, experts, slots, ep = 6, 64, 80, 16
    popularity = _zipf(rng, layers, experts, zipf)
    in_use = plan_placement(_window(rng, popularity, 200_000), slots, ep, **kwargs)
    window = _window(rng, popularity, 200_000)  # same popularity: sampling noise only
    fresh = plan_placement(window, slots, ep, **kwargs)
    replan = plan_placement(
        window, slots, ep, current=in_use.physical_to_logical, tolerance=0.005, **kwargs
    )
    moved = (replan.physical_to_logical != in_use.physical_to_logical).mean(1)
    assert (moved <= 0.2).all(), moved
    fresh_moved = (fresh.physical_to_logical != in_use.physical_to_logical).mean(1)
    assert fresh_moved.mean() > 0.2, "a fresh plan would move more (so the check can fail)"
    ratio = balancedness(replan.device_load) / balancedness(fresh.device_load)
    assert (ratio >= 1 - 0.005 - 1e-12).all(), ratio
    np.testing.assert_allclose(
        replan.device_load, device_load(window, replan.physical_to_logical, ep)
    )
    _check_constraints(replan.physical_to_logical, experts, ep, kwargs.get("num_nodes", 1))


@pytest.mark.parametrize("kwargs", [{}, {"num_nodes": 4, "num_groups": 8}])
def test_replan_of_shifted_load_reaches_the_fresh_balance(kwargs: dict) -> None:
    rng = np.random.default_rng(25)
    layers, experts, slots, ep = 6, 64, 80, 16
    in_use = plan_placement(
        _window(rng, _zipf(rng, layers, experts, 1.0), 200_000), slots, ep, **kwargs
    )
    shifted = _window(rng, _zipf(rng, layers, experts, 1.0), 200_000)  # new hot experts
    fresh = plan_placement(shifted, slots, ep, **kwargs)
    kept = balancedness(device_load(shifted, in_use.physical_to_logical, ep))
    replan = plan_placement(
        shifted, slots, ep, current=in_use.physical_to_logical, tolerance=0.005, **kwargs
    )
    ratio = balancedness(replan.device_load) / balancedness(fresh.device_load)
    assert (ratio >= 1 - 0.005 - 1e-12).all(), ratio
    assert (kept < balancedness(fresh.device_load) * 0.95).all(), "the load did shift"
    moved = (replan.physical_to_logical != in_use.physical_to_logical).mean(1)
    assert (moved > 0.05).all(), moved
    _check_constraints(replan.physical_to_logical, experts, ep, kwargs.get("num_nodes", 1))


def test_replan_repairs_a_placement_with_duplicates() -> None:
    rng = np.random.default_rng(26)
    load = _window(rng, _zipf(rng, 4, 64, 1.0), 100_000)
    deepseek = plan_placement(load, 80, 16, refine=False).physical_to_logical
    with pytest.raises(AssertionError):
        _check_constraints(deepseek, 64, 16, 1)
    replan = plan_placement(load, 80, 16, current=deepseek, tolerance=0.005)
    _check_constraints(replan.physical_to_logical, 64, 16, 1)


def test_replan_with_zero_tolerance_of_the_planned_load_moves_nothing() -> None:
    rng = np.random.default_rng(27)
    load = _window(rng, _zipf(rng, 4, 64, 0.8), 100_000)
    plan = plan_placement(load, 80, 16).physical_to_logical
    replan = plan_placement(load, 80, 16, current=plan, tolerance=0.0).physical_to_logical
    np.testing.assert_array_equal(replan, plan)


def test_tolerance_bad_input_names_the_field() -> None:
    with pytest.raises(ValueError, match="tolerance"):
        plan_placement(np.ones((1, 8)), 8, 2, current=np.arange(8)[None], tolerance=1.0)

"""Tests of the EPLB placement planner (eplb/planner.py), against independent references:
a brute-force optimum over every replica-count vector and every slot-to-device
assignment on tiny instances, a brute-force minimum of max(load / replicas), a plain
re-statement of DeepSeek's EPLB greedy (github.com/deepseek-ai/EPLB, eplb.py), and
brute-force device relabelings for the movement-minimising reorder.
"""

from __future__ import annotations

import itertools
from collections import Counter

import numpy as np
import pytest

from jaxserve.eplb.planner import (
    device_load,
    minimize_movement,
    plan_placement,
    replicate_experts,
)
from jaxserve.eplb.recorder import balancedness
from jaxserve.sharding.placement import placement_from_slots

# Worst ratio (planner max device load / optimal max device load) allowed on the tiny
# brute-force instances. Observed worst over 20,000 random instances (E = 4..6,
# ep = 2..3, S = E..E+2): exactly 4/3, from one dominant expert: replicate_experts gives
# it 3 replicas (best for max load / replicas), but 3 replicas on 2 devices put 2/3 of
# its load on one device, where the optimum gives it 2 replicas (1/2 each). DeepSeek's
# greedy has no better guarantee: r = ep + 1 replicas of one dominant expert give
# 2 ep / (ep + 1). Round-robin placement reaches 3x on the same instances.
TINY_RATIO_BOUND = 4 / 3 + 1e-9


def _random_load(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Integer counts, heavy-tailed (Zipf) or smooth (exponential) loads, with zeros."""
    kind = rng.integers(3)
    if kind == 0:
        return rng.integers(0, 20, shape).astype(np.float64)
    if kind == 1:
        return rng.zipf(1.3, shape).astype(np.float64)
    return rng.exponential(1.0, shape)


def _partitions(num_items: int, num_groups: int) -> np.ndarray:
    """[P, num_groups, num_items / num_groups]: every way to split items 0..n-1 into
    equal unordered groups (the first remaining item always opens the next group)."""
    size = num_items // num_groups
    out: list[list[tuple[int, ...]]] = []

    def rec(items: list[int], groups: list[tuple[int, ...]]) -> None:
        if not items:
            out.append(groups)
            return
        first, rest = items[0], items[1:]
        for comb in itertools.combinations(rest, size - 1):
            left = [x for x in rest if x not in comb]
            rec(left, groups + [(first, *comb)])

    rec(list(range(num_items)), [])
    return np.array(out)


def _compositions(total: int, parts: int):
    """Every vector of `parts` integers >= 1 summing to `total`."""
    for cuts in itertools.combinations(range(1, total), parts - 1):
        yield np.diff((0, *cuts, total))


def _optimal_max_device_load(load: np.ndarray, num_slots: int, partitions: np.ndarray) -> float:
    """Brute force: min over replica counts and slot-to-device assignments of the max
    device load, each replica carrying load / count."""
    best = np.inf
    for counts in _compositions(num_slots, load.shape[0]):
        slot_load = np.repeat(load / counts, counts)
        best = min(best, slot_load[partitions].sum(-1).max(-1).min())
    return float(best)


def _device_load_loop(load: np.ndarray, p2l: np.ndarray, ep: int) -> np.ndarray:
    """Reference per-device load of one layer, slot by slot."""
    counts = Counter(p2l.tolist())
    per_device = p2l.shape[0] // ep
    out = np.zeros(ep)
    for slot, expert in enumerate(p2l.tolist()):
        out[slot // per_device] += load[expert] / counts[expert]
    return out


def _round_robin(num_experts: int, num_slots: int, ep: int) -> np.ndarray:
    """Device d gets experts d, d + ep, ... (expert ids cycled over the slots)."""
    return (np.arange(num_slots) % num_experts).reshape(-1, ep).T.ravel()


def _deepseek_reference(load: np.ndarray, num_slots: int, ep: int) -> list[Counter]:
    """DeepSeek EPLB's global policy, restated plainly (eplb.py: replicate_experts then
    balanced_packing): the multiset of experts on each device."""
    counts = [1] * load.shape[0]
    for _ in range(num_slots - load.shape[0]):
        counts[max(range(len(counts)), key=lambda e: load[e] / counts[e])] += 1
    items = [(load[e] / counts[e], e) for e in range(len(counts)) for _ in range(counts[e])]
    order = sorted(range(len(items)), key=lambda i: -items[i][0])
    cap = num_slots // ep
    weights, members = [0.0] * ep, [Counter() for _ in range(ep)]
    for i in order:
        pack = min(
            (p for p in range(ep) if sum(members[p].values()) < cap), key=weights.__getitem__
        )
        weights[pack] += items[i][0]
        members[pack][items[i][1]] += 1
    return members


def _device_multisets(p2l: np.ndarray, ep: int) -> list[Counter]:
    return [Counter(d.tolist()) for d in p2l.reshape(ep, -1)]


@pytest.mark.parametrize("hierarchical", [False, True])
def test_plan_invariants_on_random_loads(hierarchical: bool) -> None:
    rng = np.random.default_rng(0)
    for _ in range(40):
        num_nodes = int(rng.choice([2, 4])) if hierarchical else 1
        ep = num_nodes * int(rng.integers(1, 5))
        num_groups = num_nodes * int(rng.integers(1, 4)) if hierarchical else None
        num_experts = (num_groups or 1) * int(rng.integers(1, 9))
        if rng.integers(2) and not hierarchical:
            num_experts += (-num_experts) % ep  # sometimes S == E
        num_slots = num_experts + (-num_experts) % ep + ep * int(rng.integers(0, 3))
        num_layers = int(rng.integers(1, 4))
        load = _random_load(rng, (num_layers, num_experts))
        if rng.integers(2):
            load = load.astype(np.int64)  # raw token counts are accepted too
        plan = plan_placement(load, num_slots, ep, num_nodes=num_nodes, num_groups=num_groups)

        assert plan.physical_to_logical.shape == (num_layers, num_slots)
        assert plan.physical_to_logical.dtype == np.int32
        for layer in range(num_layers):
            p2l = plan.physical_to_logical[layer]
            counts = np.bincount(p2l, minlength=num_experts)
            assert (counts >= 1).all(), "every expert has a slot"
            np.testing.assert_array_equal(plan.replica_counts[layer], counts)
            np.testing.assert_allclose(
                plan.device_load[layer], _device_load_loop(load[layer].astype(float), p2l, ep)
            )
            # The executor keeps max_replicas fixed at S - E + 1, the most any plan uses.
            tables = placement_from_slots(p2l, num_experts, num_slots - num_experts + 1)
            np.testing.assert_array_equal(tables.replica_counts, counts)
            for e in range(num_experts):
                held = tables.logical_to_physical[e, : counts[e]]
                assert (p2l[held] == e).all()
            if hierarchical:
                # All replicas of a group's experts sit on the devices of one node.
                node_of_slot = np.arange(num_slots) // (num_slots // num_nodes)
                group_of_slot = p2l // (num_experts // num_groups)
                for g in range(num_groups):
                    assert len(set(node_of_slot[group_of_slot == g].tolist())) == 1
                groups_per_node = Counter(
                    node_of_slot[group_of_slot == g][0] for g in range(num_groups)
                )
                assert set(groups_per_node.values()) == {num_groups // num_nodes}


def test_replicate_experts_minimises_max_load_per_replica() -> None:
    rng = np.random.default_rng(1)
    for _ in range(200):
        num_experts = int(rng.integers(1, 6))
        num_slots = num_experts + int(rng.integers(0, 5))
        load = _random_load(rng, (num_experts,))
        counts = replicate_experts(load, num_slots)
        assert counts.sum() == num_slots and (counts >= 1).all()
        best = min((load / c).max() for c in _compositions(num_slots, num_experts))
        assert (load / counts).max() == pytest.approx(best, rel=1e-12)


def test_zero_load_spreads_replicas_round_robin() -> None:
    np.testing.assert_array_equal(replicate_experts(np.zeros(4), 10), [3, 3, 2, 2])


def test_max_device_load_within_bound_of_brute_force_optimum() -> None:
    rng = np.random.default_rng(2)
    partitions: dict[tuple[int, int], np.ndarray] = {}
    checked = 0
    round_robin_flagged = 0
    while checked < 300:
        num_experts, ep = int(rng.integers(4, 7)), int(rng.integers(2, 4))
        sizes = [s for s in range(num_experts, num_experts + 3) if s % ep == 0]
        if not sizes:
            continue
        num_slots = sizes[int(rng.integers(len(sizes)))]
        load = _random_load(rng, (num_experts,))
        if load.sum() == 0:
            continue
        key = (num_slots, ep)
        if key not in partitions:
            partitions[key] = _partitions(num_slots, ep)
        optimum = _optimal_max_device_load(load, num_slots, partitions[key])
        planned = plan_placement(load[None], num_slots, ep).device_load.max()
        assert planned >= optimum * (1 - 1e-12), "the oracle must not beat brute force"
        assert planned <= TINY_RATIO_BOUND * optimum, (load, num_slots, ep)
        # The same check rejects a naive placement, so it can fail.
        naive = device_load(load, _round_robin(num_experts, num_slots, ep), ep).max()
        round_robin_flagged += naive > TINY_RATIO_BOUND * optimum
        checked += 1
    assert round_robin_flagged > 0


def test_global_policy_without_refinement_is_deepseeks_greedy() -> None:
    rng = np.random.default_rng(3)
    for _ in range(50):
        ep = int(rng.integers(1, 9))
        num_experts = int(rng.integers(1, 33))
        num_slots = num_experts + (-num_experts) % ep + ep * int(rng.integers(0, 3))
        load = rng.exponential(1.0, num_experts)  # continuous: no ties to break
        plan = plan_placement(load[None], num_slots, ep, refine=False)
        got = _device_multisets(plan.physical_to_logical[0], ep)
        assert got == _deepseek_reference(load, num_slots, ep)


def test_refinement_never_raises_max_device_load() -> None:
    # Wherever DeepSeek's plan already meets the planner's constraints (no expert twice
    # on a device, at most ep copies), the planner starts from that plan and only
    # improves it. Where it does not, a duplicate can beat every duplicate-free plan
    # (test_duplicates_can_beat_every_duplicate_free_plan), so there the bound is the
    # brute-force one (test_max_device_load_within_bound_of_brute_force_optimum).
    rng = np.random.default_rng(4)
    compared = 0
    for _ in range(100):
        ep = int(rng.integers(2, 9))
        num_experts = ep * int(rng.integers(1, 8))
        num_slots = num_experts + ep * int(rng.integers(0, 3))
        load = _random_load(rng, (2, num_experts))
        deepseek = plan_placement(load, num_slots, ep, refine=False)
        refined = plan_placement(load, num_slots, ep).device_load.max(-1)
        greedy = deepseek.device_load.max(-1)
        for layer in range(2):
            if _has_duplicates(deepseek.physical_to_logical[layer], ep):
                continue
            compared += 1
            assert refined[layer] <= greedy[layer] * (1 + 1e-12)
    assert compared > 50


def _has_duplicates(p2l: np.ndarray, ep: int) -> bool:
    """Some device holds an expert twice (so some expert may also exceed ep copies)."""
    per_device = np.sort(p2l.reshape(ep, -1), axis=1)
    return bool((per_device[:, 1:] == per_device[:, :-1]).any())


def test_duplicates_can_beat_every_duplicate_free_plan() -> None:
    # Found by random search: DeepSeek's greedy puts expert 3 twice on each of the 2
    # devices (4 copies of 47) and reaches 123.2; without duplicates 4 experts are on
    # both devices and the other 4 split 2 + 2, and no duplicate-free plan goes below
    # 124.5 (brute force below, over every such choice).
    load = np.array([1, 5, 27, 188, 1, 8, 1, 15], np.float64)
    deepseek = plan_placement(load[None], 12, 2, refine=False)
    assert _has_duplicates(deepseek.physical_to_logical[0], 2)
    best = np.inf
    for both in itertools.combinations(range(8), 4):
        single = [e for e in range(8) if e not in both]
        for side in itertools.combinations(single, 2):
            rest = [e for e in single if e not in side]
            shared = load[list(both)].sum() / 2
            best = min(best, shared + max(load[list(side)].sum(), load[rest].sum()))
    assert best == 124.5 > deepseek.device_load.max() == pytest.approx(123.2)
    planned = plan_placement(load[None], 12, 2)
    assert not _has_duplicates(planned.physical_to_logical[0], 2)
    assert best <= planned.device_load.max() <= TINY_RATIO_BOUND * best


def test_never_worse_than_identity_placement_when_slots_equal_experts() -> None:
    rng = np.random.default_rng(5)
    # A case found by random search where the greedy (with refinement) alone loses to
    # the identity placement (193 vs 192): the guard on `current` must catch it.
    hard = np.array([30, 25, 49, 38, 30, 3, 16, 30, 12, 27, 39, 32, 40, 12], np.float64)
    # Likewise for the duplicate-free planner (92 vs 91).
    hard_no_duplicates = np.array([49, 2, 2, 38, 34, 47, 5, 5], np.float64)
    cases = [(hard, 2), (hard_no_duplicates, 2)]
    for _ in range(200):
        ep = int(rng.choice([2, 3, 4, 8]))
        cases.append((_random_load(rng, (ep * int(rng.integers(1, 9)),)), ep))
    guard_used = 0
    for load, ep in cases:
        identity = np.arange(load.shape[0])
        baseline = device_load(load, identity, ep).max()
        plan = plan_placement(load[None], load.shape[0], ep, current=identity[None])
        assert plan.device_load.max() <= baseline
        guard_used += plan_placement(load[None], load.shape[0], ep).device_load.max() > baseline
    assert guard_used > 0


def test_current_kept_unless_plan_gains_more_than_min_improvement() -> None:
    rng = np.random.default_rng(12)
    popularity = rng.permutation(1.0 / np.arange(1, 33))
    windows = [rng.multinomial(4096, popularity / popularity.sum(), 6) for _ in range(2)]
    in_use = plan_placement(windows[0], 40, 8).physical_to_logical
    fresh = plan_placement(windows[1], 40, 8).physical_to_logical
    fresh_peak = device_load(windows[1], fresh, 8).max(-1)
    in_use_peak = device_load(windows[1], in_use, 8).max(-1)
    took_plan = 0
    for threshold in (0.0, 0.01, 0.03, 0.1):
        got = plan_placement(
            windows[1], 40, 8, current=in_use, min_improvement=threshold
        ).physical_to_logical
        take = fresh_peak < in_use_peak * (1 - threshold)
        np.testing.assert_array_equal(got[take], fresh[take])
        np.testing.assert_array_equal(got[~take], in_use[~take])
        took_plan += take.sum()
    assert 0 < took_plan < 4 * 6, "both branches are exercised"


def test_plan_is_deterministic() -> None:
    rng = np.random.default_rng(6)
    load = _random_load(rng, (4, 64))
    for kwargs in ({}, {"num_nodes": 2, "num_groups": 8}):
        first = plan_placement(load, 80, 8, **kwargs)
        second = plan_placement(load.copy(), 80, 8, **kwargs)
        np.testing.assert_array_equal(first.physical_to_logical, second.physical_to_logical)
        np.testing.assert_array_equal(first.device_load, second.device_load)


def _kept(current: np.ndarray, planned: np.ndarray, ep: int) -> int:
    """Slots that can keep their expert if each planned device set stays on its device."""
    return sum(
        sum((Counter(c.tolist()) & Counter(p.tolist())).values())
        for c, p in zip(current.reshape(ep, -1), planned.reshape(ep, -1), strict=True)
    )


def test_minimize_movement_keeps_device_sets_and_moves_least() -> None:
    rng = np.random.default_rng(7)
    for _ in range(100):
        ep = int(rng.integers(1, 5))
        num_experts = int(rng.integers(2, 10))
        num_slots = ep * int(rng.integers(1, 5))
        num_slots += ep * (-(-max(num_experts - num_slots, 0) // ep))
        current = plan_placement(_random_load(rng, (1, num_experts)), num_slots, ep)
        planned = plan_placement(_random_load(rng, (1, num_experts)), num_slots, ep)
        cur, new = current.physical_to_logical[0], planned.physical_to_logical[0]

        fixed, moved = minimize_movement(cur, new, ep, relabel_devices=False)
        assert _device_multisets(fixed, ep) == _device_multisets(new, ep)
        assert moved == int((fixed != cur).sum())
        assert moved <= int((new != cur).sum()), "never more than installing the plan as is"
        assert moved == num_slots - _kept(cur, new, ep), "the most slots a device can keep"

        relabeled, moved_relabeled = minimize_movement(cur, new, ep)
        sets = _device_multisets(relabeled, ep)
        assert sorted(map(sorted, sets)) == sorted(map(sorted, _device_multisets(new, ep)))
        assert moved_relabeled == int((relabeled != cur).sum())
        best = min(
            num_slots - _kept(cur, new.reshape(ep, -1)[list(perm)].ravel(), ep)
            for perm in itertools.permutations(range(ep))
        )
        assert moved_relabeled == best <= moved
        # Same device sets up to relabeling: the same device loads, permuted.
        load = np.arange(1.0, num_experts + 1)
        np.testing.assert_allclose(
            np.sort(device_load(load, relabeled, ep)), np.sort(device_load(load, new, ep))
        )


def test_minimize_movement_relabels_only_within_a_node() -> None:
    rng = np.random.default_rng(8)
    load = _random_load(rng, (2, 32))
    plans = plan_placement(load, 40, 8, num_nodes=2, num_groups=4).physical_to_logical
    fixed, _ = minimize_movement(plans[0], plans[1], 8, num_nodes=2)
    half = fixed.shape[0] // 2
    assert sorted(fixed[:half].tolist()) == sorted(plans[1][:half].tolist())
    assert sorted(fixed[half:].tolist()) == sorted(plans[1][half:].tolist())


def test_replanning_the_same_load_moves_nothing() -> None:
    rng = np.random.default_rng(9)
    load = _random_load(rng, (3, 48))
    plan = plan_placement(load, 56, 8).physical_to_logical
    for layer in range(3):
        # The placement in use: the plan with each device's slots shuffled and the
        # devices themselves permuted (as an earlier reorder may have left it).
        in_use = plan[layer].reshape(8, -1)[rng.permutation(8)]
        in_use = np.stack([rng.permutation(d) for d in in_use]).ravel()
        replanned = plan_placement(load, 56, 8).physical_to_logical[layer]
        fixed, moved = minimize_movement(in_use, replanned, 8)
        assert moved == 0
        np.testing.assert_array_equal(fixed, in_use)


def test_balancedness() -> None:
    rng = np.random.default_rng(10)
    loads = rng.exponential(1.0, (5, 8))
    np.testing.assert_allclose(balancedness(loads), loads.mean(-1) / loads.max(-1))
    assert balancedness(np.full(4, 3.0)) == 1.0
    assert balancedness(np.array([0.0, 0.0, 6.0, 0.0])) == 0.25
    assert balancedness(np.zeros(4)) == 1.0, "no load counts as balanced"
    np.testing.assert_array_equal(balancedness(np.zeros((2, 4))), [1.0, 1.0])
    assert isinstance(balancedness([1, 2]), float)


def test_plan_improves_balancedness_on_skewed_load() -> None:
    rng = np.random.default_rng(11)
    load = rng.zipf(1.2, (4, 64)).astype(np.float64)
    identity = np.tile(np.arange(64), (4, 1))
    before = balancedness(device_load(load, identity, 8))
    after = balancedness(plan_placement(load, 72, 8).device_load)
    assert (after >= before).all() and after.mean() > before.mean()


@pytest.mark.parametrize(
    ("load", "kwargs", "field"),
    [
        (np.ones(8), {"num_slots": 8, "ep": 2}, "expert_load"),
        (np.ones((1, 8)) * -1, {"num_slots": 8, "ep": 2}, "expert_load"),
        (np.full((1, 8), np.nan), {"num_slots": 8, "ep": 2}, "expert_load"),
        (np.ones((1, 8)), {"num_slots": 6, "ep": 2}, "num_slots"),
        (np.ones((1, 8)), {"num_slots": 9, "ep": 2}, "num_slots"),
        (np.ones((1, 8)), {"num_slots": 8, "ep": 0}, "ep"),
        (np.ones((1, 8)), {"num_slots": 8, "ep": 4, "num_nodes": 3}, "num_nodes"),
        (np.ones((1, 8)), {"num_slots": 8, "ep": 4, "num_nodes": 2}, "num_groups"),
        (np.ones((1, 8)), {"num_slots": 8, "ep": 4, "num_nodes": 2, "num_groups": 3}, "num_groups"),
        (np.ones((1, 8)), {"num_slots": 8, "ep": 2, "current": np.zeros((1, 8), int)}, "current"),
        (np.ones((1, 8)), {"num_slots": 8, "ep": 2, "current": np.arange(8)}, "current"),
        (np.ones((1, 8)), {"num_slots": 8, "ep": 2, "min_improvement": 1.0}, "min_improvement"),
    ],
)
def test_bad_input_names_the_field(load: np.ndarray, kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        plan_placement(load, **kwargs)


def test_minimize_movement_bad_input_names_the_field() -> None:
    with pytest.raises(ValueError, match="current/planned"):
        minimize_movement(np.arange(8), np.arange(6), 2)
    with pytest.raises(ValueError, match="ep"):
        minimize_movement(np.arange(8), np.arange(8), 3)
    with pytest.raises(ValueError, match="num_nodes"):
        minimize_movement(np.arange(8), np.arange(8), 4, num_nodes=3)

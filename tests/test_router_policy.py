"""Routing policies and load tracking, against brute force on the same state."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest
from router_helpers import leading_blocks

from jaxserve.engine.block_hash import hash_token_blocks
from jaxserve.router.load import LoadTracker
from jaxserve.router.policy import KvPolicy, make_policy
from jaxserve.router.router import Router

BS = 4


def test_kv_choice_is_a_brute_force_minimum_with_ties_to_the_less_loaded():
    rng = random.Random(1)
    for trial in range(300):
        router = Router(BS, "kv", weight=rng.choice([0.5, 1.0, 2.0]), seed=trial)
        replicas = list(range(rng.randrange(1, 6)))
        cached: dict[int, set[bytes]] = {}
        prompt = [rng.randrange(8) for _ in range(rng.randrange(1, 10 * BS))]
        hashes = hash_token_blocks(prompt, BS)
        for r in replicas:
            k = rng.randrange(len(hashes) + 1)
            router.index.store(r, None, hashes[:k])
            cached[r] = set(hashes[:k])
            for j in range(rng.randrange(3)):  # background load, in whole blocks
                router.load.dispatch(f"bg{r}.{j}", r, rng.randrange(0, 4) * BS, 0)
        w = router.policy.weight
        cost = {
            r: w * (len(hashes) - leading_blocks(cached[r], hashes)) + router.load.load(r)
            for r in replicas
        }
        low = min(cost.values())
        best = [r for r in replicas if math.isclose(cost[r], low)]
        low_load = min(router.load.load(r) for r in best)
        allowed = {r for r in best if math.isclose(router.load.load(r), low_load)}
        decision = router.route(f"req{trial}", prompt, replicas)
        assert decision.replica in allowed, (trial, cost)
        assert decision.matched_blocks == leading_blocks(cached[decision.replica], hashes)
        assert decision.num_blocks == len(hashes)
        assert math.isclose(decision.cost, low)


def test_exact_ties_are_broken_at_random_over_all_tied_replicas():
    policy = KvPolicy(rng=random.Random(0))
    load = LoadTracker(BS)
    picks = Counter(policy.choose([0, 1, 2], 3, {}, load).replica for _ in range(600))
    assert set(picks) == {0, 1, 2} and min(picks.values()) > 150


def test_a_stream_of_cache_misses_spreads_over_replicas():
    router = Router(BS, "kv", seed=0)
    rng = random.Random(0)
    for i in range(40):  # distinct prompts, none cached, all still running
        router.route(f"r{i}", [rng.randrange(10**6) for _ in range(3 * BS)], [0, 1, 2, 3])
    assert router.stats.decisions == {0: 10, 1: 10, 2: 10, 3: 10}


def test_a_loaded_cached_replica_loses_to_an_idle_one():
    prompt = list(range(8 * BS))
    hashes = hash_token_blocks(prompt, BS)
    router = Router(BS, "kv", weight=1.0, seed=0)
    router.index.store(0, None, hashes)
    assert router.route("warm", prompt, [0, 1]).replica == 0  # cached and idle: wins
    router.finish("warm")
    for j in range(5):  # 5 running requests of 4 blocks each on replica 0: load 20 > 8
        router.load.dispatch(f"busy{j}", 0, 4 * BS, 4 * BS)
    decision = router.route("r", prompt, [0, 1])
    assert decision.replica == 1 and decision.matched_blocks == 0


def test_temperature_samples_by_the_documented_softmax():
    t = 0.5
    policy = KvPolicy(temperature=t, rng=random.Random(0))
    load = LoadTracker(BS)
    matched = {0: 4, 1: 2, 2: 0}  # costs 0, 2, 4 for a 4-block prompt
    n = 20000
    picks = Counter(policy.choose([0, 1, 2], 4, matched, load).replica for _ in range(n))
    weights = [math.exp(-c / (t * 4)) for c in (0, 2, 4)]
    for r, wgt in enumerate(weights):
        p = wgt / sum(weights)
        assert abs(picks[r] / n - p) < 4 * math.sqrt(p * (1 - p) / n), (r, picks)


def test_load_tracker_matches_recomputation_and_never_drifts():
    rng = random.Random(2)
    tracker = LoadTracker(BS)
    live: dict[str, list] = {}  # id -> [replica, prefill tokens, tokens]
    for step in range(3000):
        op = rng.random()
        if op < 0.35:
            rid = f"q{step}"
            prompt, cached = rng.randrange(1, 50), rng.randrange(0, 50)
            r = rng.randrange(3)
            tracker.dispatch(rid, r, prompt, cached)
            live[rid] = [r, max(prompt - cached, 0), prompt]
        elif live and op < 0.6:
            rid = rng.choice(sorted(live))
            tracker.first_token(rid)
            live[rid][1] = 0
            k = rng.randrange(0, 9)
            tracker.add_tokens(rid, k)
            live[rid][2] += k
        elif op < 0.9:  # finish, sometimes twice, sometimes an unknown id
            rid = rng.choice(sorted(live) + ["never-sent"]) if live else "never-sent"
            tracker.finish(rid)
            tracker.finish(rid)
            live.pop(rid, None)
        for r in range(3):
            mine = [v for v in live.values() if v[0] == r]
            want = sum(v[1] for v in mine) / BS + sum(-(-v[2] // BS) for v in mine)
            assert math.isclose(tracker.load(r), want, abs_tol=1e-9), step
            assert tracker.num_requests(r) == len(mine)
    for rid in list(live):
        tracker.finish(rid)
    assert all(tracker.load(r) == 0 and tracker.num_requests(r) == 0 for r in range(3))


def test_remove_replica_forgets_its_entries_and_load():
    router = Router(BS, "kv", seed=0)
    prompt = list(range(4 * BS))
    router.index.store(1, None, hash_token_blocks(prompt, BS))
    router.route("a", prompt, [0, 1])
    assert router.load.replica_of("a") == 1
    assert router.remove_replica(1) == ["a"]
    assert router.load.load(1) == 0 and router.index.num_blocks(1) == 0
    assert router.route("b", prompt, [0]).replica == 0


def test_baseline_policies():
    load = LoadTracker(BS)
    rr = make_policy("round-robin")
    assert [rr.choose([2, 0, 1], 1, {}, load).replica for _ in range(6)] == [0, 1, 2] * 2
    load.dispatch("x", 0, 8, 0)
    ll = make_policy("least-loaded", rng=random.Random(0))
    assert {ll.choose([0, 1, 2], 1, {}, load).replica for _ in range(50)} == {1, 2}
    rnd = make_policy("random", rng=random.Random(0))
    assert {rnd.choose([0, 1, 2], 1, {}, load).replica for _ in range(50)} == {0, 1, 2}


def test_bad_policy_arguments_name_the_field():
    with pytest.raises(ValueError, match="router_policy"):
        make_policy("fastest")
    with pytest.raises(ValueError, match="temperature"):
        KvPolicy(temperature=-1)
    with pytest.raises(ValueError, match="weight"):
        KvPolicy(weight=float("nan"))
    with pytest.raises(ValueError, match="candidates"):
        Router(BS).route("a", [1, 2, 3], [])


def test_kv_ties_in_cost_and_load_go_to_the_fewest_cached_blocks():
    rng = random.Random(4)
    for trial in range(300):
        router = Router(BS, "kv", seed=trial)
        replicas = list(range(rng.randrange(1, 6)))
        prompt = [rng.randrange(8) for _ in range(rng.randrange(1, 6 * BS))]
        hashes = hash_token_blocks(prompt, BS)
        for r in replicas:
            k = rng.randrange(min(2, len(hashes)) + 1)  # few distinct matches: many ties
            router.index.store(r, None, hashes[:k])
            other = [rng.randrange(10**6) for _ in range(rng.randrange(3) * BS)]
            router.index.store(r, None, hash_token_blocks(other, BS))  # unrelated blocks
            if rng.random() < 0.3:
                router.load.dispatch(f"bg{r}", r, BS, 0)
        matched = router.index.match(hashes, replicas)
        cost = {r: len(hashes) - matched[r] + router.load.load(r) for r in replicas}
        best = [r for r in replicas if math.isclose(cost[r], min(cost.values()))]
        low_load = min(router.load.load(r) for r in best)
        best = [r for r in best if math.isclose(router.load.load(r), low_load)]
        fewest = min(router.index.num_blocks(r) for r in best)
        allowed = {r for r in best if router.index.num_blocks(r) == fewest}
        assert router.route(f"q{trial}", prompt, replicas).replica in allowed, (trial, cost)


def test_new_prefixes_on_idle_replicas_go_where_the_least_is_cached():
    """Four system prompts, one after another on four idle replicas (each request done
    and its blocks in the index before the next): one per replica, not at random."""
    for seed in range(20):
        rng = random.Random(seed)
        router = Router(BS, "kv", seed=seed)
        homes = []
        for i in range(4):
            prompt = [rng.randrange(10**6) for _ in range(6 * BS)]
            d = router.route(f"s{i}", prompt, [0, 1, 2, 3])
            router.on_output(f"s{i}", 1, finished=True)
            router.index.store(d.replica, None, hash_token_blocks(prompt, BS))
            homes.append(d.replica)
        assert sorted(homes) == [0, 1, 2, 3], (seed, homes)

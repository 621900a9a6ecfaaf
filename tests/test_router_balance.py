"""The kv policy's load terms and SGLang's balance gate, against brute force and in
constructed scenarios (an imbalanced load makes a cached replica lose; a balanced one
keeps the affinity)."""

from __future__ import annotations

import math
import random

import pytest
from router_helpers import leading_blocks

from jaxserve.engine.block_hash import hash_token_blocks
from jaxserve.router.load import LoadTracker
from jaxserve.router.options import SHARE_LIMIT
from jaxserve.router.policy import KvPolicy
from jaxserve.router.router import Router

BS = 4


def _brute_force_allowed(
    replicas, hashes, cached, requests, prefill, blocks, index_blocks, w, d, ab, rel
) -> set[int]:
    """The replicas the documented rule may pick, from the state recomputed here:
    requests / prefill tokens / held blocks per replica as the test booked them."""
    if ab is not None and len(replicas) > 1:
        hi = max(requests[r] for r in replicas)
        lo = min(requests[r] for r in replicas)
        if hi - lo > ab and hi > rel * lo:
            replicas = [r for r in replicas if requests[r] == lo]
    load = {r: prefill[r] / BS + blocks[r] for r in replicas}
    cost = {
        r: w * (len(hashes) - leading_blocks(cached[r], hashes)) + prefill[r] / BS + d * blocks[r]
        for r in replicas
    }
    best = [r for r in replicas if math.isclose(cost[r], min(cost.values()))]
    best = [r for r in best if math.isclose(load[r], min(load[x] for x in best))]
    fewest = min(index_blocks[r] for r in best)
    return {r for r in best if index_blocks[r] == fewest}


def test_kv_choice_with_balance_and_decode_weight_is_the_brute_force_rule():
    rng = random.Random(7)
    gated = 0
    for trial in range(400):
        w, d = rng.choice([0.5, 1.0, 4.0]), rng.choice([0.0, 0.25, 1.0])
        ab = rng.choice([None, 0, 1, 2])
        rel = rng.choice([1.0, 1.5, 3.0])
        router = Router(
            BS, "kv", weight=w, seed=trial, balance_abs=ab, balance_rel=rel, decode_weight=d
        )
        replicas = list(range(rng.randrange(1, 6)))
        prompt = [rng.randrange(8) for _ in range(rng.randrange(1, 10 * BS))]
        hashes = hash_token_blocks(prompt, BS)
        cached, requests, prefill, blocks, index_blocks = {}, {}, {}, {}, {}
        for r in replicas:
            k = rng.randrange(len(hashes) + 1)
            router.index.store(r, None, hashes[:k])
            cached[r], index_blocks[r] = set(hashes[:k]), k
            requests[r] = rng.randrange(5)
            prefill[r] = blocks[r] = 0
            for j in range(requests[r]):  # running requests: distinct prompts (no sharing)
                tokens, hit = rng.randrange(1, 5 * BS), rng.randrange(0, 3 * BS)
                router.load.dispatch(f"bg{r}.{j}", r, tokens, hit)
                prefill[r] += max(tokens - hit, 0)
                blocks[r] += -(-tokens // BS)
                if rng.random() < 0.5:  # its first token came: the prefill is done
                    router.on_output(f"bg{r}.{j}", 1, finished=False)
                    prefill[r] -= max(tokens - hit, 0)
                    blocks[r] += -(-(tokens + 1) // BS) - -(-tokens // BS)
        allowed = _brute_force_allowed(
            replicas, hashes, cached, requests, prefill, blocks, index_blocks, w, d, ab, rel
        )
        gated += router.policy.imbalanced(replicas, router.load)
        decision = router.route(f"req{trial}", prompt, replicas)
        assert decision.replica in allowed, (trial, allowed)
    assert gated > 50  # the gate was exercised, not only the cost


def _conversation_on(router: Router, replica: int, rng: random.Random) -> list[int]:
    """A prompt whose 16 full blocks replica `replica` caches (in its index entries)."""
    prompt = [rng.randrange(10**6) for _ in range(16 * BS)]
    router.index.store(replica, None, hash_token_blocks(prompt, BS))
    return prompt


def _busy(router: Router, replica: int, n: int, tokens: int = 40 * BS) -> None:
    """n running (decoding) requests of `tokens` tokens each on `replica`."""
    for j in range(n):
        rid = f"busy{replica}.{j}.{router.load.num_requests(replica)}"
        router.load.dispatch(rid, replica, tokens, tokens)
        router.load.first_token(rid)


def test_an_imbalanced_load_makes_the_cached_replica_lose():
    """Replica 0 holds the conversation but runs 4 requests, replica 1 none: with the
    gate at 2 (4 - 0 > 2, 4 > 1.5 x 0) the request goes to the idle replica, although a
    cache weight of 100 would keep it on the holder on cost alone."""
    rng = random.Random(0)
    router = Router(BS, "kv", weight=100.0, seed=0, balance_abs=2, balance_rel=1.5)
    prompt = _conversation_on(router, 0, rng) + [1, 2, 3]
    _busy(router, 0, 4)
    assert router.policy.imbalanced([0, 1], router.load)
    d = router.route("turn", prompt, [0, 1])
    assert (d.replica, d.matched_blocks) == (1, 0)
    # Without the gate, the same state keeps the request on the holder.
    plain = Router(BS, "kv", weight=100.0, seed=0)
    plain.index.store(0, None, hash_token_blocks(prompt, BS))
    _busy(plain, 0, 4)
    assert plain.route("turn", prompt, [0, 1]).replica == 0


def test_a_balanced_load_keeps_the_affinity_that_held_blocks_would_break():
    """Replica 0 holds the conversation and runs 2 long requests (80 held blocks), replica
    1 runs 1: balanced under the gate (2 - 1 <= 2). Held blocks at decode weight 0 do not
    count, so the 16 cached blocks win; with Dynamo's decode weight 1 the 40 extra held
    blocks outweigh them and the conversation moves (a miss)."""
    rng = random.Random(1)
    for d, want in ((0.0, 0), (1.0, 1)):
        router = Router(BS, "kv", seed=0, balance_abs=2, balance_rel=1.5, decode_weight=d)
        prompt = _conversation_on(router, 0, rng) + [7, 8]
        _busy(router, 0, 2)
        _busy(router, 1, 1)
        assert not router.policy.imbalanced([0, 1], router.load)
        assert router.route("turn", prompt, [0, 1]).replica == want, d


def test_pending_prefill_still_counts_at_decode_weight_0():
    """A replica with a long prefill queued loses a small cached advantage: the prefill
    ahead delays the first token (both replicas run one request, so balanced)."""
    rng = random.Random(2)
    router = Router(BS, "kv", seed=0, balance_abs=2, decode_weight=0.0)
    prompt = _conversation_on(router, 0, rng)[: 4 * BS] + [5, 6]  # 4 cached blocks on 0
    router.load.dispatch("long", 0, 64 * BS, 0)  # 64 blocks of prefill pending on 0
    _busy(router, 1, 1)
    assert router.route("turn", prompt, [0, 1]).replica == 1


def test_misses_under_the_gate_still_spread():
    """Distinct uncached prompts, all running: the gate never fires at abs 2 (the cost's
    load term spreads them first) and they end even, as without it."""
    router = Router(BS, "kv", seed=0, balance_abs=2, balance_rel=1.5, decode_weight=0.0)
    rng = random.Random(3)
    for i in range(40):
        router.route(f"r{i}", [rng.randrange(10**6) for _ in range(3 * BS)], [0, 1, 2, 3])
    assert router.stats.decisions == {0: 10, 1: 10, 2: 10, 3: 10}


def test_bad_balance_arguments_name_the_field():
    with pytest.raises(ValueError, match="balance_abs"):
        KvPolicy(balance_abs=-1)
    with pytest.raises(ValueError, match="balance_rel"):
        KvPolicy(balance_rel=0.5)
    with pytest.raises(ValueError, match="decode_weight"):
        KvPolicy(decode_weight=float("inf"))
    with pytest.raises(ValueError, match="share_limit"):
        KvPolicy(share_limit=0.5)


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_recent_decisions_are_a_decayed_count_of_dispatches():
    clock, rng = _Clock(), random.Random(5)
    tracker = LoadTracker(BS, window_s=7.0, clock=clock)
    times: dict[int, list[float]] = {0: [], 1: []}
    for i in range(300):
        clock.now += rng.expovariate(2.0)
        r = rng.randrange(2)
        samples = rng.choice([1, 1, 3])  # a request of 3 samples (a group) counts once
        group = f"g{i}" if samples > 1 else None
        for k in range(samples):
            tracker.dispatch(f"{i}.{k}", r, rng.randrange(1, 40), 0, group)
        times[r].append(clock.now)
        if rng.random() < 0.5:
            for k in range(samples):
                tracker.finish(f"{i}.{k}")  # finishing leaves the count as it is
        for x in (0, 1):
            want = sum(math.exp(-(clock.now - t) / 7.0) for t in times[x])
            assert math.isclose(tracker.recent(x), want, rel_tol=1e-9, abs_tol=1e-12), i


def _capped(recent: dict[int, float], c: float, ab: float | None) -> set[int]:
    cap = math.ceil(c * (sum(recent.values()) + 1) / len(recent))
    slack = min(recent.values()) + (ab or 0)
    under = {r for r, x in recent.items() if x + 1 <= cap or x <= slack}
    return under or set(recent)


def test_bounded_load_excludes_exactly_the_replicas_over_the_cap():
    rng = random.Random(6)
    for trial in range(300):
        c, ab = rng.choice([1.0, SHARE_LIMIT, 1.25, 2.0]), rng.choice([None, 0, 2])
        policy = KvPolicy(weight=100.0, share_limit=c, balance_abs=ab, rng=random.Random(trial))
        load = LoadTracker(BS, clock=_Clock())
        n = rng.randrange(2, 6)
        for r in range(n):
            for j in range(rng.randrange(6)):
                load.dispatch(f"{r}.{j}", r, BS, 0)
                load.finish(f"{r}.{j}")  # finished: only the recent count stays
        recent = {r: load.recent(r) for r in range(n)}
        allowed = _capped(recent, c, ab)
        matched = {r: 4 for r in range(n)}  # every replica caches it: the cap decides
        matched[rng.randrange(n)] = 8
        best = max(matched[r] for r in allowed)
        want = {r for r in allowed if matched[r] == best}
        assert policy.choose(list(range(n)), 8, matched, load).replica in want, trial


def test_bounded_load_moves_new_conversations_off_the_replica_that_took_too_many():
    """Replica 0 caches the one system prompt and has taken `old` requests lately,
    replica 1 none. With c = 1.25 and 6 (cap ceil(1.25 * 7 / 2) = 5) a new conversation
    goes to replica 1 although only replica 0 caches its system prompt; without the cap
    it stays on 0; with the gate's slack of 4 it stays after 4 (4 - 0 <= 4: a lone
    conversation keeps its replica) and moves after 6 (6 - 0 > 4, over the cap)."""
    rng = random.Random(8)
    system = [rng.randrange(10**6) for _ in range(6 * BS)]
    cases = [(1.25, None, 6, 1), (None, None, 6, 0), (1.25, 4, 4, 0), (1.25, 4, 6, 1)]
    for limit, ab, old, want in cases:
        router = Router(BS, "kv", seed=0, decode_weight=0.0, share_limit=limit, balance_abs=ab)
        router.index.store(0, None, hash_token_blocks(system, BS))
        for j in range(old):
            router.load.dispatch(f"old{j}", 0, 8 * BS, 8 * BS)
            router.finish(f"old{j}")
        d = router.route("new", system + [1, 2, 3], [0, 1])
        assert d.replica == want, (limit, ab, old)

"""Routing policies: which live replica gets a request (`kv`, `round-robin`, `least-loaded`,
`random`).

`kv` (the default with several replicas) scores each candidate replica r as

    cost_r = w * (prompt blocks not cached on r) + prefill_r + d * held_r

where the cached blocks are the longest prefix of the prompt in r's entries of the
`PrefixIndex`, prefill_r is the prefill the `LoadTracker` expects r still to compute
(pending prompt tokens / block_size, in blocks) and held_r the blocks its running
requests hold; with d = 1 this is NVIDIA Dynamo's KV router cost (`kv_router/
scheduler.rs`: overlap_score_weight * prefill blocks + active blocks; w is
`overlap_score_weight`). It takes the lowest cost. Ties go to the less loaded replica
(prefill_r + held_r), then to the one with the fewest blocks in the index, then to a
random one, so a stream of cache misses (every replica costs the same cache term)
spreads by load instead of piling onto the first replica, and on idle replicas (every
load 0) new prefixes go where the least is cached, as SGLang's cache-aware router sends
a miss to the worker with the smallest tree. With `temperature` t > 0 it samples
instead, with probability proportional to exp(-(cost_r - min cost) / (t * spread)),
spread = max cost - min cost (1 if all equal): t is relative to the candidates' spread,
as in Dynamo's KV router (softmax over normalized logits).

Balance gate (`balance_abs` set): SGLang's cache-aware router (sgl-router,
`policies/cache_aware.rs`) calls the load imbalanced when max - min > balance_abs and
max > balance_rel * min, over each candidate's active requests (dispatched, not yet
finished); then the request goes to a replica with the fewest (shortest queue; among
those, the lowest cost), whatever the cache. Otherwise the cost above decides. Held
blocks measure KV memory, not time to a first token: a replica decoding long
conversations holds many blocks yet starts a new prefill in its next step, so with the
gate, d < 1 keeps a conversation where its history is cached until the queues really
differ (d = 0 is SGLang's "best match while balanced").

Bounded load (`share_limit` c set): a replica whose recent decisions (`LoadTracker.
recent`: requests routed there, decaying over a minute) would pass
ceil(c * (all candidates' recent + 1) / candidates) with this one takes no request
while another is under that bound (Mirrokni, Thorup, Zadimoghaddam, "Consistent
Hashing with Bounded Loads", SODA 2018: each server's capacity is (1 + eps) times the
average load); with the balance gate on, a replica within balance_abs of the fewest
stays under it, so a few requests (one conversation at a low rate) keep their
affinity. Affinity alone piles conversations onto the replicas that first cached
their system prompt, and at a low rate the active requests are too few for the gate to
see it; this caps each replica's share of the traffic instead, moving only requests
(one miss each) from the replica over it.

`KvPolicy()` alone is Dynamo's cost (no gate, no bound, d = 1); `jaxserve serve` runs
it with the gate at 4 requests and 1.5x, d = 0 and c = 1.1 (`options.py`; the
measurement behind them is in README.md, "Replicas and KV-aware routing").

The others ignore the cache: for comparison in benchmarks, and for engines without
prefix caching.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

from jaxserve.router.load import LoadTracker
from jaxserve.router.prefix_index import ReplicaId

POLICIES = ("kv", "round-robin", "least-loaded", "random")
# Costs closer than this are a tie.
_TIE_EPS = 1e-9


@dataclass(slots=True)
class Choice:
    """A policy's pick: the replica and the cost it scored (kv only; else 0.0)."""

    replica: ReplicaId
    cost: float = 0.0


class Policy:
    """Chooses among candidate replicas. `name` is its `--router-policy` value."""

    name = ""
    uses_cache = False  # whether choose() reads `matched`

    def __init__(self, rng: random.Random | None = None) -> None:
        self.rng = rng or random.Random()

    def choose(
        self,
        candidates: Sequence[ReplicaId],
        num_blocks: int,
        matched: dict[ReplicaId, int],
        load: LoadTracker,
        cached: dict[ReplicaId, int] | None = None,
    ) -> Choice:
        """Pick one of `candidates` (non-empty, live replicas).

        Args:
            candidates: the replicas that may take the request.
            num_blocks: full blocks of the prompt.
            matched: {replica: leading prompt blocks it caches} (`PrefixIndex.match`).
            load: the active load per replica.
            cached: {replica: blocks it caches in all} (`PrefixIndex.num_blocks`), for
                the kv policy's last tie-break; None: not known (ties go at random).
        """
        raise NotImplementedError

    def _least_loaded(self, replicas: Sequence[ReplicaId], load: LoadTracker) -> ReplicaId:
        loads = [load.load(r) for r in replicas]
        low = min(loads)
        best = [r for r, x in zip(replicas, loads, strict=True) if x <= low + _TIE_EPS]
        return best[0] if len(best) == 1 else self.rng.choice(best)


class KvPolicy(Policy):
    """Lowest w * uncached blocks + load; ties to the less loaded, then random.

    Args:
        weight: w, the cost of one uncached prompt block relative to one block of
            pending prefill (>= 0; 0 ignores the cache).
        temperature: 0 picks the best; > 0 samples among the near-best (module docstring).
        balance_abs: the balance gate's absolute threshold, in active requests (>= 0);
            None: no gate (the cost alone decides).
        balance_rel: the gate's relative threshold (>= 1).
        decode_weight: d, the cost of one held block relative to one block of pending
            prefill (>= 0; 1: Dynamo's cost).
        share_limit: c, the bounded-load cap on recent decisions, relative to the mean
            (>= 1); None: no cap.

    Raises:
        ValueError: an argument out of range (or not finite), naming it.
    """

    name = "kv"
    uses_cache = True

    def __init__(
        self,
        weight: float = 1.0,
        temperature: float = 0.0,
        rng: random.Random | None = None,
        *,
        balance_abs: float | None = None,
        balance_rel: float = 1.0,
        decode_weight: float = 1.0,
        share_limit: float | None = None,
    ) -> None:
        super().__init__(rng)
        if not (math.isfinite(weight) and weight >= 0):
            raise ValueError(f"router weight: must be finite and >= 0, got {weight}")
        if not (math.isfinite(temperature) and temperature >= 0):
            raise ValueError(f"router temperature: must be finite and >= 0, got {temperature}")
        if balance_abs is not None and not (math.isfinite(balance_abs) and balance_abs >= 0):
            raise ValueError(f"router balance_abs: must be finite and >= 0, got {balance_abs}")
        if not (math.isfinite(balance_rel) and balance_rel >= 1):
            raise ValueError(f"router balance_rel: must be finite and >= 1, got {balance_rel}")
        if not (math.isfinite(decode_weight) and decode_weight >= 0):
            raise ValueError(f"router decode_weight: must be finite and >= 0, got {decode_weight}")
        if share_limit is not None and not (math.isfinite(share_limit) and share_limit >= 1):
            raise ValueError(f"router share_limit: must be finite and >= 1, got {share_limit}")
        self.weight = weight
        self.temperature = temperature
        self.share_limit = share_limit
        self.balance_abs = balance_abs
        self.balance_rel = balance_rel
        self.decode_weight = decode_weight

    def under_share(self, candidates: Sequence[ReplicaId], load: LoadTracker) -> list:
        """The candidates within the bounded-load cap (module docstring); all of them
        when none is (or share_limit is None)."""
        if self.share_limit is None or len(candidates) < 2:
            return list(candidates)
        recent = [load.recent(r) for r in candidates]
        cap = math.ceil(self.share_limit * (sum(recent) + 1) / len(candidates))
        slack = min(recent) + (self.balance_abs or 0.0)
        under = [r for r, x in zip(candidates, recent, strict=True) if x + 1 <= cap or x <= slack]
        return under or list(candidates)

    def imbalanced(self, candidates: Sequence[ReplicaId], load: LoadTracker) -> bool:
        """SGLang's test: max - min > balance_abs and max > balance_rel * min, over the
        candidates' active requests (`LoadTracker.num_requests`). False when disabled."""
        if self.balance_abs is None or len(candidates) < 2:
            return False
        counts = [load.num_requests(r) for r in candidates]
        hi, lo = max(counts), min(counts)
        return hi - lo > self.balance_abs and hi > self.balance_rel * lo

    def costs(
        self,
        candidates: Sequence[ReplicaId],
        num_blocks: int,
        matched: dict[ReplicaId, int],
        load: LoadTracker,
    ) -> list[float]:
        """cost_r for each candidate, in order (blocks; module docstring)."""
        w, d, bs = self.weight, self.decode_weight, load.block_size
        return [
            w * (num_blocks - matched.get(r, 0))
            + load.prefill_tokens(r) / bs
            + d * load.decode_blocks(r)
            for r in candidates
        ]

    def choose(self, candidates, num_blocks, matched, load, cached=None) -> Choice:
        candidates = self.under_share(candidates, load)
        if self.imbalanced(candidates, load):
            # Shortest queue: the fewest active requests; among those, the lowest cost.
            fewest = min(load.num_requests(r) for r in candidates)
            candidates = [r for r in candidates if load.num_requests(r) == fewest]
        costs = self.costs(candidates, num_blocks, matched, load)
        low = min(costs)
        if self.temperature > 0 and len(candidates) > 1:
            spread = (max(costs) - low) or 1.0
            weights = [math.exp(-(c - low) / (self.temperature * spread)) for c in costs]
            i = self.rng.choices(range(len(candidates)), weights)[0]
            return Choice(candidates[i], costs[i])
        best = [r for r, c in zip(candidates, costs, strict=True) if c <= low + _TIE_EPS]
        if len(best) > 1:
            loads = [load.load(r) for r in best]
            best = [r for r, x in zip(best, loads, strict=True) if x <= min(loads) + _TIE_EPS]
        if len(best) > 1 and cached is not None:
            fewest = min(cached.get(r, 0) for r in best)
            best = [r for r in best if cached.get(r, 0) == fewest]
        replica = best[0] if len(best) == 1 else self.rng.choice(best)
        return Choice(replica, low)


class RoundRobinPolicy(Policy):
    """Each request to the next candidate in turn (by a counter over the sorted ids)."""

    name = "round-robin"

    def __init__(self, rng: random.Random | None = None) -> None:
        super().__init__(rng)
        self._counter = itertools.count()

    def choose(self, candidates, num_blocks, matched, load, cached=None) -> Choice:
        ordered = sorted(candidates)
        return Choice(ordered[next(self._counter) % len(ordered)])


class LeastLoadedPolicy(Policy):
    """The replica with the least active load; ties at random."""

    name = "least-loaded"

    def choose(self, candidates, num_blocks, matched, load, cached=None) -> Choice:
        return Choice(self._least_loaded(candidates, load))


class RandomPolicy(Policy):
    """A uniformly random candidate."""

    name = "random"

    def choose(self, candidates, num_blocks, matched, load, cached=None) -> Choice:
        return Choice(self.rng.choice(list(candidates)))


def make_policy(
    name: str,
    *,
    weight: float = 1.0,
    temperature: float = 0.0,
    rng: random.Random | None = None,
    **kv_options,
) -> Policy:
    """The policy named `name` (one of POLICIES); kv_options: KvPolicy's keyword-only
    arguments (ignored by the others). Raises ValueError naming router_policy."""
    if name == "kv":
        return KvPolicy(weight, temperature, rng, **kv_options)
    classes = {"round-robin": RoundRobinPolicy, "least-loaded": LeastLoadedPolicy}
    classes["random"] = RandomPolicy
    if name not in classes:
        raise ValueError(f"router_policy: expected one of {', '.join(POLICIES)}, got {name!r}")
    return classes[name](rng)

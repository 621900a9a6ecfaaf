"""Routing policies: which live replica gets a request (`kv`, `round-robin`, `least-loaded`,
`random`).

`kv` (the default with several replicas) scores each candidate replica r as

    cost_r = w * (prompt blocks not cached on r) + load_r

where the cached blocks are the longest prefix of the prompt in r's entries of the
`PrefixIndex` and load_r is the `LoadTracker`'s active load (blocks), and takes the
lowest cost. Ties go to the less loaded replica, then to the one with the fewest blocks
in the index, then to a random one, so a stream of cache misses (every replica costs the
same cache term) spreads by load instead of piling onto the first replica, and on idle
replicas (every load 0) new prefixes go where the least is cached, as SGLang's
cache-aware router sends a miss to the worker with the smallest tree. With
`temperature` t > 0 it samples instead, with probability proportional to
exp(-(cost_r - min cost) / (t * spread)), spread = max cost - min cost (1 if all
equal): t is relative to the candidates' spread, as in NVIDIA Dynamo's KV
router (`kv_router/scheduler.rs`: softmax over normalized logits). The cost is Dynamo's
(`overlap_score_weight` is w); SGLang's cache-aware router instead switches between
"best match" and "shortest queue" by thresholds.

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
        weight: w, the cost of one uncached prompt block relative to one block of load
            (>= 0; 0 ignores the cache).
        temperature: 0 picks the best; > 0 samples among the near-best (module docstring).

    Raises:
        ValueError: weight < 0 or temperature < 0 (or not finite).
    """

    name = "kv"
    uses_cache = True

    def __init__(
        self, weight: float = 1.0, temperature: float = 0.0, rng: random.Random | None = None
    ) -> None:
        super().__init__(rng)
        if not (math.isfinite(weight) and weight >= 0):
            raise ValueError(f"router weight: must be finite and >= 0, got {weight}")
        if not (math.isfinite(temperature) and temperature >= 0):
            raise ValueError(f"router temperature: must be finite and >= 0, got {temperature}")
        self.weight = weight
        self.temperature = temperature

    def costs(
        self,
        candidates: Sequence[ReplicaId],
        num_blocks: int,
        matched: dict[ReplicaId, int],
        load: LoadTracker,
    ) -> list[float]:
        """cost_r for each candidate, in order."""
        w = self.weight
        return [w * (num_blocks - matched.get(r, 0)) + load.load(r) for r in candidates]

    def choose(self, candidates, num_blocks, matched, load, cached=None) -> Choice:
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
) -> Policy:
    """The policy named `name` (one of POLICIES). Raises ValueError naming router_policy."""
    if name == "kv":
        return KvPolicy(weight, temperature, rng)
    classes = {"round-robin": RoundRobinPolicy, "least-loaded": LeastLoadedPolicy}
    classes["random"] = RandomPolicy
    if name not in classes:
        raise ValueError(f"router_policy: expected one of {', '.join(POLICIES)}, got {name!r}")
    return classes[name](rng)

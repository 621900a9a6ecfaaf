"""`Router`: one routing decision per request: hash the prompt, match it in the prefix
index, let the policy choose among the live replicas, and book the load.

It joins the pieces of this package and holds no policy of its own: `PrefixIndex` (what
each replica caches, fed by `events.KvEventConsumer`), `LoadTracker` (what each replica
is working on, from this router's dispatches and completions) and a `Policy`. The
caller (the frontend's `ReplicaSet`) says which replicas are live, reports each
request's first output and end, and clears a replica that died. No sockets, no JAX.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from jaxserve.engine.block_hash import hash_token_blocks
from jaxserve.router.load import LoadTracker
from jaxserve.router.policy import Policy, make_policy
from jaxserve.router.prefix_index import PrefixIndex, ReplicaId


@dataclass(slots=True)
class Decision:
    """Where one request went and why.

    replica: the chosen replica. policy: the policy's name. matched_blocks: leading
    prompt blocks the index expects cached there. num_blocks: the prompt's full blocks.
    cost: the kv policy's cost of the choice (0.0 for the others). block_hashes: the
    prompt's full-block hashes (`decide` sets them; `dispatch` books the blocks that
    running requests share once, `LoadTracker`), or None.
    """

    replica: ReplicaId
    policy: str
    matched_blocks: int
    num_blocks: int
    cost: float = 0.0
    block_hashes: list | None = None


@dataclass(slots=True)
class RouterStats:
    """Cumulative decisions: requests per replica, and blocks matched / asked for."""

    decisions: dict[ReplicaId, int] = field(default_factory=dict)
    matched_blocks: int = 0
    prompt_blocks: int = 0


class Router:
    """Routes requests over replicas by a policy, over a shared prefix index and load.

    Args:
        block_size: tokens per KV block of every replica (> 0; they must agree).
        policy: a `Policy`, or a name for `make_policy`.
        weight / temperature / kv_options: for `make_policy("kv", ...)` when policy is a
            name (kv_options: `KvPolicy`'s keyword-only arguments).
        seed: seeds the tie-breaking and sampling (None: random).

    Raises:
        ValueError: block_size < 1, an unknown policy name (naming router_policy), or a
            weight / temperature out of range.
    """

    def __init__(
        self,
        block_size: int,
        policy: Policy | str = "kv",
        *,
        weight: float = 1.0,
        temperature: float = 0.0,
        seed: int | None = None,
        **kv_options,
    ) -> None:
        if isinstance(policy, str):
            policy = make_policy(
                policy,
                weight=weight,
                temperature=temperature,
                rng=random.Random(seed),
                **kv_options,
            )
        self.policy = policy
        self.block_size = block_size
        self.index = PrefixIndex()
        self.load = LoadTracker(block_size)
        self.stats = RouterStats()

    def route(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int] | np.ndarray,
        candidates: Sequence[ReplicaId],
    ) -> Decision:
        """Choose a replica for the request (`decide`) and book its load there (`dispatch`).

        Args:
            request_id: unique among active requests (the engine request id).
            prompt_token_ids: [P] int token ids.
            candidates: the live replicas, non-empty.

        Raises:
            ValueError: no candidates, or request_id already active.
        """
        decision = self.decide(prompt_token_ids, candidates)
        self.dispatch(request_id, decision, len(prompt_token_ids))
        return decision

    def decide(
        self, prompt_token_ids: Sequence[int] | np.ndarray, candidates: Sequence[ReplicaId]
    ) -> Decision:
        """The policy's choice for a prompt, without booking anything.

        Raises:
            ValueError: no candidates.
        """
        if not candidates:
            raise ValueError("candidates: no live replica to route to")
        hashes = hash_token_blocks(prompt_token_ids, self.block_size)
        matched = self.index.match(hashes, candidates)
        cached = None
        if self.policy.uses_cache:
            cached = {r: self.index.num_blocks(r) for r in candidates}
        choice = self.policy.choose(candidates, len(hashes), matched, self.load, cached)
        return Decision(
            choice.replica,
            self.policy.name,
            matched[choice.replica],
            len(hashes),
            choice.cost,
            hashes,
        )

    def dispatch(
        self, request_id: str, decision: Decision, num_prompt_tokens: int, group: str | None = None
    ) -> None:
        """Book a decision's load and count it (done by `route`). The n samples of one
        request share one decision: call this once per sample with the same `group`
        (`LoadTracker.dispatch`: their prompt's prefill and full blocks count once; the
        decision is counted once, on the first)."""
        # The engine always computes the prompt's last token (block_manager.lookup_prefix).
        cached = min(decision.matched_blocks * self.block_size, max(num_prompt_tokens - 1, 0))
        first = group is None or not self.load.has_group(group)
        self.load.dispatch(
            request_id, decision.replica, num_prompt_tokens, cached, group, decision.block_hashes
        )
        if not first:
            return
        s = self.stats
        s.decisions[decision.replica] = s.decisions.get(decision.replica, 0) + 1
        s.matched_blocks += decision.matched_blocks
        s.prompt_blocks += decision.num_blocks

    def on_output(self, request_id: str, num_new_tokens: int, finished: bool) -> None:
        """An output of the request arrived (its first ends the prefill)."""
        if finished:
            self.load.finish(request_id)
            return
        self.load.first_token(request_id)
        self.load.add_tokens(request_id, num_new_tokens)

    def finish(self, request_id: str) -> None:
        """The request ended without a final output (aborted, failed). Idempotent."""
        self.load.finish(request_id)

    def remove_replica(self, replica: ReplicaId) -> list[str]:
        """The replica died or restarted: forget its entries and its requests' load.
        Returns the request ids it had."""
        self.index.clear(replica)
        return self.load.finish_replica(replica)

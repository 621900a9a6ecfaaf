"""`LoadTracker`: each replica's active load, from the router's own dispatches and completions.

The load of a replica is what the router sent there and has not yet seen finish, in KV
blocks so that it adds to the policy's cache term:

    load = pending prefill tokens / block_size  +  blocks held by running requests

A request adds its uncached prompt tokens (prefill still to compute) and its prompt's
blocks (`dispatch`); its first output moves it from prefill to decode (`first_token`,
the prefill part leaves); it leaves entirely on its final output, an abort, an error or
its replica's death (`finish`). Every entry is keyed by request id and `finish` is
idempotent, so the counters cannot drift: a request that ends twice, or ends without
ever reaching the engine, leaves them where they were (the failure mode where drifting
counters send all new traffic to one replica). Health checks and engine stats never
change them. This is the "active blocks + potential prefill blocks" load of NVIDIA
Dynamo's KV router (`kv_router/scheduler.rs`), tracked here by the frontend alone.
"""

from __future__ import annotations

from dataclasses import dataclass

from jaxserve.router.prefix_index import ReplicaId


@dataclass(slots=True)
class _Active:
    replica: ReplicaId
    prefill_tokens: int  # uncached prompt tokens, until the first output
    blocks: int  # blocks of the prompt (grows with decoded tokens, `add_tokens`)
    tokens: int  # prompt + output tokens so far


class LoadTracker:
    """Active load per replica.

    Args:
        block_size: tokens per KV block (> 0), the unit of the load.

    Raises:
        ValueError: block_size < 1.
    """

    def __init__(self, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size: must be >= 1, got {block_size}")
        self.block_size = block_size
        self._active: dict[str, _Active] = {}
        self._prefill: dict[ReplicaId, int] = {}
        self._blocks: dict[ReplicaId, int] = {}
        self._requests: dict[ReplicaId, int] = {}

    def load(self, replica: ReplicaId) -> float:
        """The replica's load in blocks: pending prefill tokens / block_size + held blocks."""
        return self._prefill.get(replica, 0) / self.block_size + self._blocks.get(replica, 0)

    def num_requests(self, replica: ReplicaId) -> int:
        """Requests dispatched to `replica` and not finished."""
        return self._requests.get(replica, 0)

    def prefill_tokens(self, replica: ReplicaId) -> int:
        return self._prefill.get(replica, 0)

    def decode_blocks(self, replica: ReplicaId) -> int:
        return self._blocks.get(replica, 0)

    def replica_of(self, request_id: str) -> ReplicaId | None:
        """The replica an active request was dispatched to, or None."""
        active = self._active.get(request_id)
        return None if active is None else active.replica

    def dispatch(
        self, request_id: str, replica: ReplicaId, num_prompt_tokens: int, num_cached_tokens: int
    ) -> None:
        """`request_id` (prompt of `num_prompt_tokens`, of which the index expects
        `num_cached_tokens` cached there) was sent to `replica`.

        Raises:
            ValueError: request_id is active already (ids are the engine's, unique).
        """
        if request_id in self._active:
            raise ValueError(f"request_id: {request_id!r} is already active")
        prefill = max(num_prompt_tokens - num_cached_tokens, 0)
        blocks = -(-num_prompt_tokens // self.block_size)
        self._active[request_id] = _Active(replica, prefill, blocks, num_prompt_tokens)
        self._add(replica, prefill, blocks, 1)

    def first_token(self, request_id: str) -> None:
        """The request's first output arrived: its prefill is done. Idempotent."""
        active = self._active.get(request_id)
        if active is not None and active.prefill_tokens:
            self._add(active.replica, -active.prefill_tokens, 0, 0)
            active.prefill_tokens = 0

    def add_tokens(self, request_id: str, num_tokens: int) -> None:
        """`num_tokens` more output tokens: the request may hold more blocks now."""
        active = self._active.get(request_id)
        if active is None or num_tokens <= 0:
            return
        active.tokens += num_tokens
        blocks = -(-active.tokens // self.block_size)
        if blocks != active.blocks:
            self._add(active.replica, 0, blocks - active.blocks, 0)
            active.blocks = blocks

    def finish(self, request_id: str) -> ReplicaId | None:
        """The request ended (any way). Returns its replica, None if it was not active."""
        active = self._active.pop(request_id, None)
        if active is None:
            return None
        self._add(active.replica, -active.prefill_tokens, -active.blocks, -1)
        return active.replica

    def finish_replica(self, replica: ReplicaId) -> list[str]:
        """End every request of `replica` (it died). Returns their ids."""
        ids = [rid for rid, a in self._active.items() if a.replica == replica]
        for rid in ids:
            self.finish(rid)
        return ids

    def _add(self, replica: ReplicaId, prefill: int, blocks: int, requests: int) -> None:
        self._prefill[replica] = self._prefill.get(replica, 0) + prefill
        self._blocks[replica] = self._blocks.get(replica, 0) + blocks
        self._requests[replica] = self._requests.get(replica, 0) + requests

"""`LoadTracker`: each replica's active load, from the router's own dispatches and completions.

The load of a replica is what the router sent there and has not yet seen finish, in KV
blocks so that it adds to the policy's cache term:

    load = pending prefill tokens / block_size  +  blocks held by running requests

A request adds its uncached prompt tokens (prefill still to compute) and its prompt's
blocks (`dispatch`). Blocks held are counted as the engine holds them: a prompt's full
blocks before its last token (the engine computes the last token's block itself,
`block_manager.lookup_prefix`) are shared by every running request with the same
prefix, through the prefix cache, so when `dispatch` is given the prompt's block hashes
each such block counts once per replica however many running requests hold it (a
reference count per hash: a system prompt under 8 running chats is its blocks once,
not 8 times), as NVIDIA Dynamo's `ActiveSequences` (`kv_router/sequence.rs`) counts
its unique blocks. Without the hashes every request's blocks count apart. The n
samples of one request (`group`) share their prompt's full blocks (all but the last
token's) and their prefill in the engine (`ipc.EngineRequest.cache_group`), so these
are booked once per group, held until its last sample ends, and each sample adds only
its own blocks (the rest of the prompt, then its output). A request's first output
moves it from prefill to decode (`first_token`, the prefill part leaves); it leaves
entirely on its final output, an abort, an error or its replica's death (`finish`).
Every entry is keyed by request id and `finish` is idempotent, so the counters cannot
drift: a request that ends twice, or ends without ever reaching the engine, leaves
them where they were (the failure mode where drifting counters send all new traffic
to one replica). Health checks and engine stats never change them. This is the
"active blocks + potential prefill blocks" load of NVIDIA Dynamo's KV router
(`kv_router/scheduler.rs`), tracked here by the frontend alone.

Beside the active load, each replica's recent decisions (`recent`): every request (a
group once) routed there counts 1, decaying as exp(-age / window_s). Active requests
come and go within a second at a low rate, so they cannot show that one replica holds
more of the conversations than another (their later turns return where their history
is cached); the decayed count does, and the kv policy's share gate reads it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from jaxserve.engine.block_hash import BlockHash
from jaxserve.router.prefix_index import ReplicaId


@dataclass(slots=True)
class _Group:
    """What the samples of one request share: booked once, until the last one ends."""

    replica: ReplicaId
    prefill_tokens: int  # uncached tokens of the shared blocks, until any sample's output
    shared_blocks: int  # the prompt's full blocks before its last token
    members: int = 0
    hashes: tuple = ()  # their names, when known: held through the replica's counts


@dataclass(slots=True)
class _Active:
    replica: ReplicaId
    prefill_tokens: int  # its uncached prompt tokens (past its group's), until its first output
    blocks: int  # its own blocks: of the prompt (past the group's), then of its output
    tokens: int  # prompt + output tokens so far
    group: str | None = None
    shared_blocks: int = 0  # the group's (or its named) full prompt blocks, not in `blocks`
    hashes: tuple = ()  # its named shared prompt blocks (alone, not in a group)


class LoadTracker:
    """Active load per replica.

    Args:
        block_size: tokens per KV block (> 0), the unit of the load.
        window_s: the decay time of `recent` (seconds, > 0).
        clock: seconds, monotonic (time.monotonic; tests give their own).

    Raises:
        ValueError: block_size < 1 or window_s <= 0.
    """

    def __init__(
        self,
        block_size: int,
        window_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size: must be >= 1, got {block_size}")
        if not (math.isfinite(window_s) and window_s > 0):
            raise ValueError(f"window_s: must be finite and > 0, got {window_s}")
        self.block_size = block_size
        self.window_s = window_s
        self._clock = clock
        # replica -> (decayed decisions, when last updated)
        self._recent: dict[ReplicaId, tuple[float, float]] = {}
        self._active: dict[str, _Active] = {}
        self._groups: dict[str, _Group] = {}
        self._prefill: dict[ReplicaId, int] = {}
        self._blocks: dict[ReplicaId, int] = {}
        self._requests: dict[ReplicaId, int] = {}
        # replica -> {block hash: running requests (or groups) holding it}
        self._refs: dict[ReplicaId, dict[BlockHash, int]] = {}

    def load(self, replica: ReplicaId) -> float:
        """The replica's load in blocks: pending prefill tokens / block_size + held blocks."""
        return self._prefill.get(replica, 0) / self.block_size + self._blocks.get(replica, 0)

    def recent(self, replica: ReplicaId) -> float:
        """Requests (groups once) dispatched to `replica`, each weighted by
        exp(-age / window_s): about its request rate times window_s."""
        count, at = self._recent.get(replica, (0.0, 0.0))
        return count * math.exp(-(self._clock() - at) / self.window_s) if count else 0.0

    def _count_decision(self, replica: ReplicaId) -> None:
        self._recent[replica] = (self.recent(replica) + 1.0, self._clock())

    def num_requests(self, replica: ReplicaId) -> int:
        """Requests dispatched to `replica` and not finished."""
        return self._requests.get(replica, 0)

    def prefill_tokens(self, replica: ReplicaId) -> int:
        return self._prefill.get(replica, 0)

    def decode_blocks(self, replica: ReplicaId) -> int:
        return self._blocks.get(replica, 0)

    def has_group(self, group: str) -> bool:
        """True while a sample of `group` is active."""
        return group in self._groups

    def replica_of(self, request_id: str) -> ReplicaId | None:
        """The replica an active request was dispatched to, or None."""
        active = self._active.get(request_id)
        return None if active is None else active.replica

    def dispatch(
        self,
        request_id: str,
        replica: ReplicaId,
        num_prompt_tokens: int,
        num_cached_tokens: int,
        group: str | None = None,
        block_hashes: Sequence[BlockHash] | None = None,
    ) -> None:
        """`request_id` (prompt of `num_prompt_tokens`, of which the index expects
        `num_cached_tokens` cached there) was sent to `replica`. group: the samples of
        one request share it (the same prompt, replica and cached tokens); None alone.
        block_hashes: the prompt's full-block chained hashes (`block_hash.
        hash_token_blocks`), or None; with them, its full blocks before the last token
        count once per replica across running requests (module docstring).

        Raises:
            ValueError: request_id is active already (ids are the engine's, unique), or
                a group's sample sent to another replica than the group's.
        """
        if request_id in self._active:
            raise ValueError(f"request_id: {request_id!r} is already active")
        prefill = max(num_prompt_tokens - num_cached_tokens, 0)
        blocks = -(-num_prompt_tokens // self.block_size)
        # The engine's later samples (and later requests with the same prefix) reuse the
        # full blocks before the prompt's last token (`block_manager.lookup_prefix`) and
        # compute the rest themselves.
        shared = max(num_prompt_tokens - 1, 0) // self.block_size
        names = ()
        if block_hashes is not None and len(block_hashes) >= shared:
            names = tuple(block_hashes[:shared])
        if group is None or group not in self._groups:
            self._count_decision(replica)
        if group is None:
            if not names:
                self._active[request_id] = _Active(replica, prefill, blocks, num_prompt_tokens)
                self._add(replica, prefill, blocks, 1)
                return
            own = blocks - shared
            self._active[request_id] = _Active(
                replica, prefill, own, num_prompt_tokens, None, shared, names
            )
            self._add(replica, prefill, self._hold(replica, names) + own, 1)
            return
        g = self._groups.get(group)
        if g is None:
            shared_prefill = max(shared * self.block_size - num_cached_tokens, 0)
            g = self._groups[group] = _Group(replica, shared_prefill, shared, hashes=names)
            held = self._hold(replica, names) if names else shared
            self._add(replica, shared_prefill, held, 0)
        elif g.replica != replica:
            raise ValueError(f"group: {group!r} is on replica {g.replica}, not {replica}")
        g.members += 1
        own_prefill = num_prompt_tokens - max(shared * self.block_size, num_cached_tokens)
        own = blocks - shared
        self._active[request_id] = _Active(
            replica, max(own_prefill, 0), own, num_prompt_tokens, group, shared
        )
        self._add(replica, max(own_prefill, 0), own, 1)

    def first_token(self, request_id: str) -> None:
        """The request's first output arrived: its prefill is done (its group's, for a
        sample). Idempotent."""
        active = self._active.get(request_id)
        if active is None:
            return
        group = None if active.group is None else self._groups[active.group]
        for part in (active, group):
            if part is not None and part.prefill_tokens:
                self._add(active.replica, -part.prefill_tokens, 0, 0)
                part.prefill_tokens = 0

    def add_tokens(self, request_id: str, num_tokens: int) -> None:
        """`num_tokens` more output tokens: the request may hold more blocks now."""
        active = self._active.get(request_id)
        if active is None or num_tokens <= 0:
            return
        active.tokens += num_tokens
        blocks = -(-active.tokens // self.block_size) - active.shared_blocks
        if blocks != active.blocks:
            self._add(active.replica, 0, blocks - active.blocks, 0)
            active.blocks = blocks

    def finish(self, request_id: str) -> ReplicaId | None:
        """The request ended (any way). Returns its replica, None if it was not active."""
        active = self._active.pop(request_id, None)
        if active is None:
            return None
        released = self._release(active.replica, active.hashes) if active.hashes else 0
        self._add(active.replica, -active.prefill_tokens, -active.blocks - released, -1)
        if active.group is not None:
            g = self._groups[active.group]
            g.members -= 1
            if g.members == 0:  # the last sample: the shared part leaves too
                del self._groups[active.group]
                held = self._release(g.replica, g.hashes) if g.hashes else g.shared_blocks
                self._add(g.replica, -g.prefill_tokens, -held, 0)
        return active.replica

    def finish_replica(self, replica: ReplicaId) -> list[str]:
        """End every request of `replica` (it died). Returns their ids."""
        ids = [rid for rid, a in self._active.items() if a.replica == replica]
        for rid in ids:
            self.finish(rid)
        return ids

    def _hold(self, replica: ReplicaId, hashes: Sequence[BlockHash]) -> int:
        """One more holder of each block; returns how many were held by none before."""
        refs = self._refs.setdefault(replica, {})
        new = 0
        for h in hashes:
            n = refs.get(h, 0)
            new += n == 0
            refs[h] = n + 1
        return new

    def _release(self, replica: ReplicaId, hashes: Sequence[BlockHash]) -> int:
        """One holder less of each block; returns how many are held by none now."""
        refs = self._refs[replica]
        gone = 0
        for h in hashes:
            n = refs[h] - 1
            if n:
                refs[h] = n
            else:
                del refs[h]
                gone += 1
        return gone

    def _add(self, replica: ReplicaId, prefill: int, blocks: int, requests: int) -> None:
        self._prefill[replica] = self._prefill.get(replica, 0) + prefill
        self._blocks[replica] = self._blocks.get(replica, 0) + blocks
        self._requests[replica] = self._requests.get(replica, 0) + requests

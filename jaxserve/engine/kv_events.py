"""KV events: an engine replica's numbered record of full blocks entering and leaving its
prefix cache, for the KV-aware router (`jaxserve.router`).

`KvEventLog` is attached to the engine's block managers (`attach`), which call it where a
block is named (`stored`: the chained hashes of `engine.block_hash`, after the block
before them), where a name is dropped (`removed`: evicted, or forgotten by
`reset_prefix_cache`) and when the whole cache is forgotten (`cleared`). Events are
numbered 0, 1, 2, ... per engine process, and each process draws a random `epoch`, so a
consumer tells a restarted replica (new epoch) from a lost message (a gap in the
numbers). The first event of every epoch is `cleared`: a replica that restarts rejoins
with empty entries.

On a mesh every dp rank has its own block manager, and the same block may sit in
several ranks' caches; the router sees the replica as one cache, so a hash is counted
across ranks and reported stored when its first copy appears and removed when its last
copy goes. `snapshot()` lists every cached hash (parents before children where the
chain is known) with the number of the last event it includes; the engine loop sends
it on request (`ipc.KvSnapshotRequest`), after the events before it.

The event shape follows vLLM's KV events (`vllm/distributed/kv_events.py`: BlockStored
with parent_block_hash and block_hashes, BlockRemoved, AllBlocksCleared), which Dynamo's
router consumes. Blocks named only inside a `cache_group` (prefix caching off: the n
samples of one prompt) carry the group as an extra hash key and can never match another
request, so they produce no events. No JAX, no sockets: `flush` hands the batch to a
send function.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Any

from jaxserve.engine.block_hash import BlockHash
from jaxserve.ipc import KvEvents, KvSnapshot

STORED = "stored"
REMOVED = "removed"
CLEARED = "cleared"


class KvEventLog:
    """The numbered KV events of one engine replica (all its dp ranks).

    Args:
        epoch: this engine process's id among restarts (default: random 63-bit).
    """

    def __init__(self, epoch: int | None = None) -> None:
        self.epoch = random.getrandbits(63) if epoch is None else epoch
        self.next_seq = 0
        # hash -> [copies across dp ranks, parent hash or None], in insertion order.
        self._cached: dict[BlockHash, list] = {}
        self._pending: list[list[Any]] = []  # [seq, kind, parent, hashes]
        self.cleared()

    @property
    def num_cached(self) -> int:
        """Distinct hashes cached in any dp rank."""
        return len(self._cached)

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def _event(self, kind: str, parent: BlockHash | None, hashes: list[BlockHash]) -> None:
        self._pending.append([self.next_seq, kind, parent, hashes])
        self.next_seq += 1

    # ----- block manager hooks -------------------------------------------------------------

    def stored(self, chain: Sequence[BlockHash], indices: Sequence[int]) -> None:
        """Blocks chain[i] for i in `indices` (ascending) entered a cache; chain is a
        sequence's full-block hashes, so chain[i - 1] is the parent of chain[i]."""
        run: list[BlockHash] = []
        run_parent: BlockHash | None = None
        last = -2
        for i in indices:
            block_hash = chain[i]
            entry = self._cached.get(block_hash)
            parent = chain[i - 1] if i else None
            if entry is not None:  # another dp rank holds it: one more copy, no event
                entry[0] += 1
                continue
            self._cached[block_hash] = [1, parent]
            if run and i != last + 1:
                self._event(STORED, run_parent, run)
                run = []
            if not run:
                run_parent = parent
            run.append(block_hash)
            last = i
        if run:
            self._event(STORED, run_parent, run)

    def removed(self, hashes: Sequence[BlockHash]) -> None:
        """Blocks named `hashes` left a cache (evicted or forgotten)."""
        gone = []
        for block_hash in hashes:
            entry = self._cached.get(block_hash)
            if entry is None:
                continue
            entry[0] -= 1
            if entry[0] == 0:
                del self._cached[block_hash]
                gone.append(block_hash)
        if gone:
            self._event(REMOVED, None, gone)

    def cleared(self) -> None:
        """Every cache of this replica was emptied."""
        self._cached.clear()
        self._event(CLEARED, None, [])

    # ----- publishing ----------------------------------------------------------------------

    def drain(self) -> KvEvents | None:
        """The events since the last drain (None if there are none)."""
        if not self._pending:
            return None
        batch, self._pending = self._pending, []
        return KvEvents(self.epoch, batch)

    def flush(self, send: Callable[[Any], None]) -> None:
        """`send` the pending events, if any."""
        batch = self.drain()
        if batch is not None:
            send(batch)

    def snapshot(self) -> KvSnapshot:
        """Every cached hash as [parent, hash] pairs, with `seq` = the number of the last
        event it includes. Call after `flush`, so no pending event is left out."""
        blocks = [[entry[1], block_hash] for block_hash, entry in self._cached.items()]
        return KvSnapshot(self.epoch, self.next_seq - 1, blocks)


def attach(core: Any, log: KvEventLog | None = None) -> KvEventLog | None:
    """Attach a log to every block manager of an engine core (`core.block_managers`).

    Returns the log, or None when the core has no block managers (a mock engine) or its
    prefix caching is off (no block can match another request).
    """
    managers = getattr(core, "block_managers", None)
    if not managers or not all(bm.enable_prefix_caching for bm in managers):
        return None
    log = log or KvEventLog()
    for bm in managers:
        bm.events = log
    return log

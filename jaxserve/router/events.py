"""`ReplicaEvents`: applies one replica's numbered KV events and snapshots to the prefix index.

The engine side is `jaxserve.engine.kv_events`: events numbered from 0 per engine
process (`epoch`), the first of each epoch `cleared`. Events and snapshots of one replica
arrive in order on one socket, and the engine takes a snapshot after sending every
event before it, so a snapshot with number `seq` is the replica's cache after events
0..seq, and the events after it are numbered from seq + 1.

- Events in sequence are applied. A batch of a new epoch that starts at 0 is a restarted
  replica: its entries are cleared (the `cleared` event) and the new epoch followed.
- A gap (a number skipped: a dropped message, or a new epoch seen mid-way) makes it
  ask for a snapshot (`request_snapshot`) and drop events until the snapshot comes; the
  snapshot replaces the replica's entries. A request that gets no answer within
  `resync_timeout_s` is sent again (`poll`).
- A consumer that starts without knowing the replica's state (a restarted frontend)
  resyncs at once (`start`).

This mirrors NVIDIA Dynamo's KV router, whose indexer rebuilds a worker's tree from a
dump when its event ids jump. No sockets here: the frontend passes messages in.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from jaxserve.ipc import KvEvents, KvSnapshot
from jaxserve.router.prefix_index import PrefixIndex, ReplicaId

logger = logging.getLogger("jaxserve.router")

RESYNC_TIMEOUT_S = 2.0


class ReplicaEvents:
    """The KV event state of one replica.

    Args:
        replica: its id in the index.
        index: the shared prefix index.
        request_snapshot: sends a `KvSnapshotRequest` to the replica (reason given).
        resync_timeout_s: how long to wait for a snapshot before asking again.
    """

    def __init__(
        self,
        replica: ReplicaId,
        index: PrefixIndex,
        request_snapshot: Callable[[str], None],
        resync_timeout_s: float = RESYNC_TIMEOUT_S,
    ) -> None:
        self.replica = replica
        self.index = index
        self._request_snapshot = request_snapshot
        self.resync_timeout_s = resync_timeout_s
        self.epoch: int | None = None
        self.next_seq = 0
        self.resyncing_since: float | None = None
        self.num_events = 0
        self.num_resyncs = 0  # snapshots asked for
        self.num_snapshots = 0  # snapshots applied

    @property
    def resyncing(self) -> bool:
        return self.resyncing_since is not None

    def start(self) -> None:
        """The router does not know this replica's state: ask for a snapshot."""
        self.resync("router start")

    def resync(self, reason: str) -> None:
        """Ask for a snapshot and drop events until it arrives."""
        self.num_resyncs += 1
        self.resyncing_since = time.monotonic()
        logger.info("replica %s: KV index resync (%s)", self.replica, reason)
        self._request_snapshot(reason)

    def poll(self, now: float | None = None) -> None:
        """Ask again if a snapshot request is older than resync_timeout_s."""
        now = time.monotonic() if now is None else now
        if self.resyncing_since is not None and now - self.resyncing_since > self.resync_timeout_s:
            self.resync("no snapshot within the timeout")

    def reset(self) -> None:
        """The replica is gone (or restarting): forget its entries; follow whatever epoch
        comes next from event 0."""
        self.index.clear(self.replica)
        self.epoch, self.next_seq, self.resyncing_since = None, 0, None

    def on_events(self, msg: KvEvents) -> None:
        """Apply a batch of events, or detect a gap and resync."""
        if self.resyncing or not msg.events:
            return
        if msg.epoch != self.epoch:
            if msg.events[0][0] != 0:
                self.resync(f"new epoch {msg.epoch} seen from event {msg.events[0][0]}")
                return
            self.index.clear(self.replica)
            self.epoch, self.next_seq = msg.epoch, 0
        for seq, kind, parent, hashes in msg.events:
            if seq < self.next_seq:
                continue  # seen already
            if seq > self.next_seq:
                self.resync(f"events {self.next_seq}..{seq - 1} missing")
                return
            if kind == "stored":
                self.index.store(self.replica, parent, hashes)
            elif kind == "removed":
                self.index.remove(self.replica, hashes)
            elif kind == "cleared":
                self.index.clear(self.replica)
            else:
                logger.warning("replica %s: unknown KV event kind %r", self.replica, kind)
            self.next_seq = seq + 1
            self.num_events += 1

    def on_snapshot(self, msg: KvSnapshot) -> None:
        """Replace the replica's entries with the snapshot; follow its events after it."""
        self.index.clear(self.replica)
        for parent, block_hash in msg.blocks:
            self.index.store(self.replica, parent, [block_hash])
        self.epoch, self.next_seq = msg.epoch, msg.seq + 1
        self.resyncing_since = None
        self.num_snapshots += 1

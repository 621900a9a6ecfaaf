"""A replica's KV event channel on the frontend: the socket its engine's KV events and
snapshots arrive on (PULL, bound here at `addresses.kv_events`), the socket to its
control path that snapshot requests go out on (PUSH), and the task that reads the one
into the replica's `ReplicaEvents` (router/events.py: numbering, gaps, resyncs). The
`ReplicaSet` opens one per replica that has `kv_events`, and closes its sockets with
the replica. No JAX.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import zmq
import zmq.asyncio

from jaxserve.ipc import KvEvents, KvSnapshot, KvSnapshotRequest, decode, encode, make_socket
from jaxserve.router.events import ReplicaEvents
from jaxserve.router.metrics import RouterMetrics
from jaxserve.router.prefix_index import PrefixIndex
from jaxserve.router.replica import Replica

logger = logging.getLogger("jaxserve.router")


def open_kv_channel(
    rep: Replica,
    ctx: zmq.asyncio.Context,
    sync_ctx: zmq.Context,
    index: PrefixIndex,
    metrics: RouterMetrics | None,
) -> None:
    """Bind `rep`'s event socket, connect (or bind, `frontend_binds`) its control socket,
    set `rep.events` over `index` and start `rep.reader`; the replica is asked for a
    snapshot at once, since this frontend knows nothing of its cache yet. Each snapshot
    request is counted in `metrics` (None: not exported)."""
    a = rep.addresses
    rep.kv_socket = make_socket(ctx, zmq.PULL, a.kv_events, bind=True)
    rep.control = make_socket(
        sync_ctx, zmq.PUSH, a.kv_control or a.engine_control, bind=a.frontend_binds
    )

    def ask(reason: str, rep: Replica = rep) -> None:
        with contextlib.suppress(zmq.Again):  # a full queue: poll() asks again
            rep.control.send(encode(KvSnapshotRequest(reason)), zmq.NOBLOCK)
        if metrics is not None:
            metrics.resync(rep.index)

    rep.events = ReplicaEvents(rep.index, index, ask)
    rep.events.start()  # this frontend knows nothing yet: ask for a snapshot
    rep.reader = asyncio.create_task(_read_events(rep), name=f"kv-events-{rep.index}")


async def _read_events(rep: Replica) -> None:
    """Apply each message of `rep`'s event socket, until cancelled; messages from a dead
    replica are dropped, and one that fails to apply is logged and dropped."""
    while True:
        frame = await rep.kv_socket.recv()
        try:
            msg = decode(frame)
            if rep.client.dead_reason is not None:
                continue
            if isinstance(msg, KvEvents):
                rep.events.on_events(msg)
            elif isinstance(msg, KvSnapshot):
                rep.events.on_snapshot(msg)
        except Exception:
            logger.exception("%s: dropping a KV events message that failed to apply", rep.name)

"""Which transport each follower reads the steps from, agreed at join: the leader's
shared-memory ring (`jaxserve.distributed.shm_ring`) or its TCP data connection.

Right after the join, the leader offers the ring on each data connection ("shm
<segment> <token> <host identity>\\n", or "tcp\\n" when it has none: `offer`); a
follower takes it when the host identity (boot id and host name, `host_identity`) is its
own and it can map the segment and find the token in it, and answers "shm\\n" or
"tcp\\n" (`take_offer`). The leader unlinks the segment once every follower answered
(no name left in /dev/shm to leak on a later crash; one left by a crash during the join
is removed by the next leader on the host). `JAXSERVE_STEP_TRANSPORT=tcp` (or
`transport="tcp"`), on the leader or on a follower, keeps that end on TCP, for A/B runs.
"""

from __future__ import annotations

import logging
import os
import platform
import socket
import time
from pathlib import Path

from jaxserve.distributed import shm_ring
from jaxserve.distributed.step_sockets import read_line

logger = logging.getLogger(__name__)

# "tcp": every follower reads the steps from its TCP connection, even on the leader's
# host; "auto" (the default): the followers on the leader's host read the shared ring.
TRANSPORT_ENV = "JAXSERVE_STEP_TRANSPORT"


def chosen_transport(transport: str | None) -> str:
    """The transport asked for: the argument, else TRANSPORT_ENV, else "auto".

    Raises:
        ValueError: neither "tcp" nor "auto".
    """
    transport = transport or os.environ.get(TRANSPORT_ENV) or "auto"
    if transport not in ("tcp", "auto"):
        raise ValueError(f"{TRANSPORT_ENV}={transport!r}: expected 'tcp' or 'auto'")
    return transport


def host_identity() -> str:
    """This host as the step channel compares it at join: the kernel's boot id (one per
    boot of a machine, shared by its containers) and the host name, no spaces. Equal
    identities only make a follower try the segment; its token proves it."""
    try:
        boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot_id = "no-boot-id"
    return f"{boot_id}/{platform.node()}".replace(" ", "_")


def offer(conns: dict[int, socket.socket], transport: str | None, timeout_s: float):
    """The leader's side: offer a ring to the followers joined on `conns` (by process
    id >= 1, reader slot id - 1) and read their answers; unlink the segment then.

    Returns:
        (the ring, or None if no follower took it; the connections of the followers
        that did not, by process id).
    """
    ring = None
    if chosen_transport(transport) != "tcp" and shm_ring.available():
        ring = shm_ring.RingWriter(max(conns, default=0))
    line = "tcp\n" if ring is None else f"shm {ring.name} {ring.token} {host_identity()}\n"
    tcp = {}
    try:
        for conn in conns.values():
            conn.sendall(line.encode())
        deadline = time.monotonic() + timeout_s
        for process_id, conn in conns.items():
            conn.settimeout(max(0.1, deadline - time.monotonic()))
            answer = read_line(conn)
            conn.settimeout(None)
            if answer == "shm" and ring is not None:
                ring.activate(process_id - 1)
            else:
                tcp[process_id] = conn
    except BaseException:
        if ring is not None:
            ring.close()
        raise
    if ring is not None:
        ring.unlink()  # every follower has mapped it, or never will
        if not ring.active_readers:
            ring.close()
            ring = None
    logger.info(
        "step channel: %d follower(s) on the shared ring, %d on TCP", len(conns) - len(tcp),
        len(tcp),
    )  # fmt: skip
    return ring, tcp


def take_offer(conn: socket.socket, reader: int, transport: str | None, deadline: float):
    """A follower's side: read the leader's offer on `conn`, map its ring as reader slot
    `reader` when it is on this host (same `host_identity`, the segment opens, its token
    matches), and answer. Returns the ring, or None (the steps come over `conn`)."""
    conn.settimeout(max(0.1, deadline - time.monotonic()))
    words = read_line(conn).split()
    conn.settimeout(None)
    ring = None
    if words[:1] == ["shm"] and len(words) == 4 and chosen_transport(transport) != "tcp":
        _, name, token, host = words
        if host == host_identity() and shm_ring.available():
            try:
                ring = shm_ring.RingReader(name, int(token), reader)
            except (OSError, ValueError) as e:
                logger.warning("step channel: the leader's ring %s is not here (%s)", name, e)
    conn.sendall(b"shm\n" if ring is not None else b"tcp\n")
    return ring

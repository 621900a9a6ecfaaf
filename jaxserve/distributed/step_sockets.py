"""The step channel's TCP connections: opening them, the followers' join, reading them.

Each follower opens two plain TCP connections to the leader that live as long as the
run: data (the leader's port) and membership (port + 1), retrying until the leader
listens (`connect`). On each it first sends its process id ("<id>\\n"); the leader
accepts on both ports until every follower has joined both (`accept_followers`), so no
step is sent before a follower can get it. Every connection has TCP keepalive with short
timers (`keepalive`), so that a peer host that vanished without closing anything
(power, network) is noticed after about 11 s; the data connections have TCP_NODELAY.
What the connections then carry: `jaxserve.distributed.step_channel` (steps) and
`jaxserve.distributed.membership` (liveness, reports).
"""

from __future__ import annotations

import logging
import selectors
import socket
import time
from collections.abc import Callable

from jaxserve.frontend.server_address import join_host_port

logger = logging.getLogger(__name__)

# A write to a follower that is gone raises (EPIPE) rather than signalling the process.
NO_SIGNAL = getattr(socket, "MSG_NOSIGNAL", 0)
# TCP keepalive: a peer host that vanished without closing the connection is noticed
# after about IDLE + INTERVAL * COUNT seconds = 11 s.
_KEEPALIVE_IDLE_S = 5
_KEEPALIVE_INTERVAL_S = 2
_KEEPALIVE_COUNT = 3


def connect(
    host: str,
    port: int,
    deadline: float,
    timeout_s: float,
    retry_s: float = 0.05,
    on_first_refusal: Callable[[OSError], None] | None = None,
) -> socket.socket:
    """A TCP connection to the leader, retried every `retry_s` seconds until `deadline`
    (time.monotonic(); it may not listen yet). `on_first_refusal(error)`, if given, is
    called once, at the first try that fails.

    Raises:
        TimeoutError: no leader listening by then (`timeout_s` names the wait); its
            __cause__ is the last try's OSError.
    """
    refused = False
    while True:
        try:
            conn = socket.create_connection(
                (host, port), timeout=max(0.1, deadline - time.monotonic())
            )
        except OSError as e:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"step channel: no leader at {join_host_port(host, port)} after {timeout_s} s"
                ) from e
            if on_first_refusal is not None and not refused:
                on_first_refusal(e)
            refused = True
            time.sleep(min(retry_s, max(0.0, deadline - time.monotonic())))
            continue
        conn.settimeout(None)
        return conn


def keepalive(conn: socket.socket) -> None:
    """TCP keepalive with short timers (Linux names; elsewhere the system's defaults)."""
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (
        ("TCP_KEEPIDLE", _KEEPALIVE_IDLE_S),
        ("TCP_KEEPINTVL", _KEEPALIVE_INTERVAL_S),
        ("TCP_KEEPCNT", _KEEPALIVE_COUNT),
    ):
        if hasattr(socket, name):
            conn.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


def accept_followers(
    listeners: list[socket.socket], num_followers: int, timeout_s: float
) -> tuple[dict[int, socket.socket], dict[int, socket.socket]]:
    """Accept connections on the data and membership `listeners` until every follower
    1..num_followers has joined both with its process id ("<id>\\n").

    Returns:
        (data, membership) connections by process id, with keepalive (and TCP_NODELAY
        on data).

    Raises:
        TimeoutError: not every follower joined within `timeout_s`.
        ValueError: a follower sent a process id out of [1, num_followers] or twice.
    """
    data: dict[int, socket.socket] = {}
    members: dict[int, socket.socket] = {}
    pending: dict[socket.socket, tuple[dict, bytes]] = {}  # accepted, id not read yet
    deadline = time.monotonic() + timeout_s
    try:
        with selectors.DefaultSelector() as sel:
            for listener, joined in zip(listeners, (data, members), strict=True):
                sel.register(listener, selectors.EVENT_READ, joined)
            while min(len(data), len(members)) < num_followers:
                left = deadline - time.monotonic()
                if left < 0:
                    raise TimeoutError(
                        f"step channel: {len(members)} of {num_followers} "
                        f"followers joined in {timeout_s:.0f} s"
                    )
                for key, _ in sel.select(min(left, 0.1)):
                    if key.fileobj in listeners:
                        conn, _ = key.fileobj.accept()
                        pending[conn] = (key.data, b"")
                        sel.register(conn, selectors.EVENT_READ)
                    else:
                        _read_join(key.fileobj, pending, sel, num_followers, data)
    except BaseException:
        for conn in [*data.values(), *members.values()]:
            conn.close()
        raise
    finally:
        for conn in pending:
            conn.close()
    return data, members


def _read_join(conn, pending: dict, sel, num_followers: int, data: dict) -> None:
    """Read from a connection that has not joined yet; join it on a full line."""
    try:
        received = conn.recv(64)
    except OSError:
        received = b""
    joined, text = pending[conn]
    text += received
    pending[conn] = (joined, text)
    if received and not text.endswith(b"\n"):
        return
    sel.unregister(conn)
    del pending[conn]
    if not received or not text.strip().isdigit():
        # Closed before joining, or not a follower (e.g. a port scan).
        logger.warning("step channel: ignoring a join of %r", text[:32])
        conn.close()
        return
    process_id = int(text)
    if not 1 <= process_id <= num_followers or process_id in joined:
        conn.close()
        raise ValueError(
            f"step channel: a follower joined as process {process_id}, expected each "
            f"of 1..{num_followers} once (check --process-id / JAX_PROCESS_ID)"
        )
    keepalive(conn)
    if joined is data:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    joined[process_id] = conn


def read_exactly(conn: socket.socket, buffer) -> None:
    """Fill `buffer` (a writable bytes-like) from `conn` (one call unless a signal
    interrupts).

    Raises:
        ConnectionError: the leader closed the connection first.
    """
    view = memoryview(buffer).cast("B")
    while view.nbytes:
        n = conn.recv_into(view, view.nbytes, socket.MSG_WAITALL)
        if n == 0:
            raise ConnectionError(
                "step channel: process 0 (the leader) closed the connection without a clean stop"
            )
        view = view[n:]


def read_line(conn: socket.socket) -> str:
    """One short line from `conn`, read a byte at a time (what follows is not ours).

    Raises:
        ConnectionError: the peer closed the connection first.
    """
    line = b""
    while not line.endswith(b"\n") and len(line) < 512:
        byte = conn.recv(1)
        if not byte:
            raise ConnectionError("step channel: the peer closed the connection at join")
        line += byte
    return line.decode().strip()

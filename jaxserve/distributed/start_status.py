"""How the followers of a multi-process run learn that process 0 (the leader) failed to
start, within a second, instead of waiting out `jax.distributed.initialize`'s timeout
(300 s) or the coordination service's heartbeat and dying with a C++ stack trace.

The leader, when its start fails (a `jaxserve serve` start-up error of its own or of its
engine process), listens for a few seconds on the coordinator's port +
`START_STATUS_PORT_OFFSET` (the step channel has +1 and +2, `jaxserve.distributed.step_channel`) and
tells each follower that connects the one-line cause. Each follower polls that port from
a daemon thread (`watch_leader`) while it runs; a refused connection (the normal case,
nothing listens there) costs nothing. A follower whose own start fails first (a
collective that lost the leader) asks the port for a few seconds (`leader_failure`)
and reports the leader's cause instead of its collective's. No JAX here.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable

from jaxserve.distributed import DistributedConfig

logger = logging.getLogger(__name__)

START_STATUS_PORT_OFFSET = 3
# The first bytes of the leader's notice: anything else on that port is not ours.
MAGIC = b"jaxserve-leader-start-failed\n"
ANNOUNCE_GRACE_S = 5.0  # how long a failed leader waits for its followers to ask
POLL_INTERVAL_S = 0.5
_MAX_LINE_BYTES = 4096


def status_port(dist: DistributedConfig) -> int:
    return dist.coordinator_port + START_STATUS_PORT_OFFSET


def announce_failure(dist: DistributedConfig, line: str, grace_s: float = ANNOUNCE_GRACE_S) -> int:
    """Process 0: tell followers that connect within `grace_s` seconds that the start
    failed (`line`, the cause), until all `num_processes - 1` have been told. Returns how
    many were told. Never raises: a port that cannot be bound is logged and skipped (the
    followers then end by JAX's own timeouts)."""
    payload = MAGIC + line.encode("utf-8", "replace")[:_MAX_LINE_BYTES] + b"\n"
    try:
        server = socket.create_server(("", status_port(dist)), reuse_port=False)
    except OSError as e:
        logger.warning("cannot tell the followers that the start failed (port %d: %s)",
                       status_port(dist), e)  # fmt: skip
        return 0
    told = 0
    deadline = time.monotonic() + grace_s
    with server:
        while told < dist.num_processes - 1 and (left := deadline - time.monotonic()) > 0:
            server.settimeout(left)
            try:
                conn, _ = server.accept()
            except TimeoutError:
                break
            with conn:
                try:
                    conn.sendall(payload)
                    told += 1
                except OSError:
                    continue
    return told


def watch_leader(
    dist: DistributedConfig,
    on_failure: Callable[[str], None],
    interval_s: float = POLL_INTERVAL_S,
) -> threading.Thread:
    """A follower: poll the leader's status port every `interval_s` seconds from a daemon
    thread; when the leader announces a failed start, call `on_failure(cause)` (from that
    thread; it is expected to end the process)."""

    def poll() -> None:
        address = (dist.coordinator_host, status_port(dist))
        while True:
            cause = _ask(address, interval_s)
            if cause is not None:
                on_failure(cause)
                return
            time.sleep(interval_s)

    thread = threading.Thread(target=poll, name="leader-start-watch", daemon=True)
    thread.start()
    return thread


def leader_failure(dist: DistributedConfig, wait_s: float) -> str | None:
    """The cause process 0 announced for its failed start, asked for up to `wait_s`
    seconds (a follower whose own start just failed: was the leader first?); None if it
    announced nothing."""
    address = (dist.coordinator_host, status_port(dist))
    deadline = time.monotonic() + wait_s
    while True:
        cause = _ask(address, POLL_INTERVAL_S)
        if cause is not None or time.monotonic() >= deadline:
            return cause
        time.sleep(POLL_INTERVAL_S / 2)


def _ask(address: tuple[str, int], timeout_s: float) -> str | None:
    try:
        with socket.create_connection(address, timeout=timeout_s) as conn:
            data = b""
            while len(data) < len(MAGIC) + _MAX_LINE_BYTES + 1:  # the leader then closes
                chunk = conn.recv(4096)
                if not chunk:
                    break
                data += chunk
    except OSError:
        return None
    if not data.startswith(MAGIC):
        return None
    return data[len(MAGIC) :].decode("utf-8", "replace").strip() or "unknown cause"

"""The step channel's membership connections: is every peer still there, and how late
do the followers get the steps.

Each follower has one membership connection to the leader (`step_sockets`), beside its
data connection, read by a watcher thread on each end (`FollowersWatch` on the leader,
`LeaderWatch` on a follower): a follower's main thread may be blocked in a step's
collectives, so the step reads cannot watch.

- Reports: every REPORT_EVERY steps the follower sends the median transit it measured
  over them (leader's send -> arrays unpacked), "t <microseconds>\\n"; the leader keeps
  each follower's last one, and their maximum is the step agreement latency
  (`FollowersWatch.agreement_s`, exported for `jaxserve diagnose`).
- Liveness: a process that dies closes its connections (the kernel does, even on
  SIGKILL), so the other end reads EOF at once and names the lost process; TCP keepalive
  bounds the time to notice a host that vanished without closing anything. A clean stop
  says so first (the leader sends `_BYE` before closing; a follower closes only after
  STOP, when the leader no longer watches), so EOF without it means the peer is gone.
"""

from __future__ import annotations

import logging
import selectors
import socket
import threading
from collections.abc import Callable, Sequence

logger = logging.getLogger(__name__)

# Why a process is taken for gone: its membership connection ended without the clean
# stop's message (the kernel closes it even on SIGKILL; an unreachable host stops
# answering). The lines that report a loss say it.
LOST_CONNECTION = (
    "its step channel connection closed without a clean stop (it died, or its host is unreachable)"
)

# Sent by the leader on each membership connection right before a clean close.
_BYE = b"bye"
# A follower's transit report: b"t <microseconds>\n", the median over its last
# REPORT_EVERY steps.
_REPORT = b"t"
REPORT_EVERY = 64


class FollowersWatch:
    """The leader's watcher of the followers' membership connections (by process id),
    from a thread started here.

    on_lost: called with a follower's process id when its connection ends without a
        clean stop (before `stop_watching`), from the watcher thread.
    """

    def __init__(self, members: dict[int, socket.socket], on_lost: Callable[[int], None]):
        self._members = members
        self._on_lost = on_lost
        # Each follower's last reported median transit (s), REPORT_EVERY steps each.
        self.transit_s: dict[int, float] = {}
        self.lost: list[int] = []
        self._closing = threading.Event()
        # The watcher's wake-up: `stop_watching` writes here so that `select` returns.
        self._wake_r, self._wake_w = socket.socketpair()
        self._thread = threading.Thread(
            target=self._watch, name="step-channel-followers", daemon=True
        )
        self._thread.start()

    @property
    def agreement_s(self) -> float:
        """The step agreement latency: the slowest follower's last reported median
        transit (leader's send -> follower has the arrays), s; 0 before any report."""
        return max(self.transit_s.values(), default=0.0)

    def _watch(self) -> None:
        """Until `stop_watching`: record reports, report each connection that ends."""
        with selectors.DefaultSelector() as sel:
            sel.register(self._wake_r, selectors.EVENT_READ)
            for process_id, conn in self._members.items():
                sel.register(conn, selectors.EVENT_READ, process_id)
            partial: dict[int, bytes] = {}
            while len(sel.get_map()) > 1:
                for key, _ in sel.select():
                    if key.fileobj is self._wake_r or self._closing.is_set():
                        return
                    try:
                        data = key.fileobj.recv(256)
                    except OSError:  # reset, or keepalive timed out
                        data = b""
                    if data:
                        partial[key.data] = self._read_reports(
                            key.data, partial.get(key.data, b"") + data
                        )
                        continue
                    sel.unregister(key.fileobj)
                    if not self._closing.is_set():
                        self.lost.append(key.data)
                        self._on_lost(key.data)

    def _read_reports(self, process_id: int, buffered: bytes) -> bytes:
        """Record the complete transit reports ("t <microseconds>\\n") in `buffered`
        from follower `process_id`; return the incomplete tail. Other lines are ignored."""
        *lines, tail = buffered.split(b"\n")
        for line in lines:
            kind, _, value = line.partition(b" ")
            if kind == _REPORT and value.strip().isdigit():
                self.transit_s[process_id] = int(value) / 1e6
        return tail[-64:]

    def stop_watching(self) -> None:
        """From now on a connection that ends is a clean stop (the leader is stopping)."""
        self._closing.set()
        self._wake_w.send(b"x")

    def close(self) -> None:
        """Say bye on every connection (after `stop_watching` and the STOP step), then
        close them."""
        for conn in self._members.values():
            try:
                conn.sendall(_BYE)
            except OSError:
                pass  # that follower is gone already
        self._thread.join()
        for conn in [*self._members.values(), self._wake_r, self._wake_w]:
            conn.close()


class LeaderWatch:
    """A follower's watcher of its membership connection `conn`, from a thread started
    here; also sends its transit reports on it.

    on_lost: called when the connection ends without the leader's bye (before `close`),
        from the watcher thread, after `lost` is set.
    """

    def __init__(self, conn: socket.socket, on_lost: Callable[[], None]):
        self._conn = conn
        self._on_lost = on_lost
        self.lost = False
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="step-channel-leader", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        """Until `close` or the leader's bye: report the leader if its connection ends."""
        received = b""
        while True:
            try:
                data = self._conn.recv(64)
            except OSError:  # reset, keepalive timed out, or closed by `close`
                data = b""
            received += data
            if _BYE in received or self._closing.is_set():
                return
            if not data:
                break
        self.lost = True
        self._on_lost()

    def report(self, transit_s: Sequence[float]) -> None:
        """Send the leader the median of the last REPORT_EVERY `transit_s` (a few bytes;
        a lost leader is the watcher's to report)."""
        recent = sorted(transit_s[-REPORT_EVERY:])
        if not recent:
            return
        micros = round(1e6 * recent[len(recent) // 2])
        try:
            self._conn.sendall(_REPORT + b" %d\n" % micros)
        except OSError:
            pass

    def close(self) -> None:
        """Stop watching (after STOP) and close the connection."""
        self._closing.set()
        try:
            self._conn.shutdown(socket.SHUT_RDWR)  # wakes the watcher's recv
        except OSError:
            pass
        self._thread.join()
        self._conn.close()

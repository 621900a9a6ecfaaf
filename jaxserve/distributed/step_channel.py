"""The per-step agreement between processes: process 0 decides, the others follow.

In a multi-process run every process must launch the same jitted step with the same
inputs, or the collectives inside it hang. Process 0 (the leader) owns the scheduler;
each step it publishes the step's packed host inputs (token ids, positions, attention
metadata, sampling parameters: a few KB of NumPy arrays) in one message
(`step_message`), then launches the step itself. Followers block on the channel,
rebuild the same arrays and launch the same step. Nothing else crosses processes on the
host: results come back through the step's own (replicated) outputs. This module holds
the two ends, `StepPublisher` (the leader's) and `StepSubscriber` (a follower's); their
parts live beside it:

- `step_message`: the message and its bytes (serialised once, arrays as raw buffers,
  each layout parsed once by a follower);
- `step_sockets`: two TCP connections per follower, data and membership, opened by the
  follower and joined by the leader before its first step;
- `step_transport` and `shm_ring`: the followers on the leader's host read the steps
  from a shared-memory ring that the leader writes once and wakes them all with one
  futex call, so its cost does not grow with them; the others read them from their
  data connection, to which the leader writes the same bytes (TCP_NODELAY, one kernel
  write of a ready buffer per follower, from the publishing thread);
- `membership`: the followers' transit reports (the step agreement latency, for
  `diagnose`) and the liveness of every peer, read by a watcher thread on each end.

The exchange is off the device's critical path as far as it can be: the leader
publishes before dispatching its own step (so followers dispatch while it does). Its
cost per step is measured on both sides (`ChannelStats`) for export. Measured
(`scripts/bench_step_agreement.py`, 68 KB a step, interleaved, on a 2-core VM):
ZeroMQ PUB/SUB, used before, was 1.7-2x slower than the TCP writes (p50 237 / 441 / 783
us at 2 / 4 / 8 processes against 142 / 210 / 400: its hand-offs between the
application's thread and its I/O thread, on both ends, cost more than the writes; on
one machine a write over loopback also runs the receiver's side of TCP, about 25 us per
follower at 68 KB there; across hosts the NIC does that). The ring (load 1.3-1.7): the
leader's publish p50 81 / 95 / 104 us against TCP's 74 / 143 / 236; the agreement p50
170 / 263 / 465 against 154 / 271 / 526: there the followers' own work (wake, copy,
unpack; 7 of them on 2 cores) grows with them, which the transport cannot remove.
"""

from __future__ import annotations

import logging
import select
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from jaxserve.distributed import shm_ring, step_message, step_sockets, step_transport
from jaxserve.distributed.membership import (
    LOST_CONNECTION,
    REPORT_EVERY,
    FollowersWatch,
    LeaderWatch,
)
from jaxserve.distributed.step_message import RUN, STOP, StepMessage

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class ChannelStats:
    """Seconds per step: on the leader, packing and sending (`StepPublisher.stats`); on
    a follower, the transit from the leader's send to the unpacked arrays
    (`StepSubscriber.stats`; wall clocks, so across hosts it is as good as their clock
    sync; reported to the leader, `StepPublisher.agreement_s`) and, separately, the
    time blocked waiting (`StepSubscriber.wait_stats`, which includes the leader's own
    work between steps).
    """

    steps: int = 0
    total_s: float = 0.0
    last_s: float = 0.0
    samples_s: list[float] = field(default_factory=list)

    def record(self, seconds: float) -> None:
        self.steps += 1
        self.total_s += seconds
        self.last_s = seconds
        if len(self.samples_s) < 100_000:
            self.samples_s.append(seconds)

    @property
    def mean_us(self) -> float:
        return 1e6 * self.total_s / self.steps if self.steps else 0.0


class StepPublisher:
    """The leader's end. Listens on `host:port` (data) and `host:port+1` (membership) and
    waits until all `num_followers` have joined both.

    on_follower_lost: called with a follower's process id when its membership connection
        ends without a clean stop (the process died or its host is unreachable), from a
        watcher thread; it may exit the process. None: only logged and recorded in
        `lost_followers`.
    transport: "tcp" or "auto" (`step_transport.chosen_transport`).

    Raises:
        TimeoutError: not every follower joined within `timeout_s`.
        ValueError: a follower sent a process id out of [1, num_followers] or twice; a
            bad transport.
    """

    def __init__(
        self,
        host: str,
        port: int,
        num_followers: int,
        timeout_s: float = 120.0,
        *,
        on_follower_lost: Callable[[int], None] | None = None,
        transport: str | None = None,
    ):
        # A bad value fails before the join.
        transport = step_transport.chosen_transport(transport)
        address = socket.gethostbyname(host)
        self._ring: shm_ring.RingWriter | None = None
        # Joined connections by process id: data (the steps), and of those the ones of
        # the followers that read the steps there (not the ring).
        self._data: dict[int, socket.socket] = {}
        self._tcp: dict[int, socket.socket] = {}
        self._step = 0
        self.stats = ChannelStats()
        self.bytes_sent = 0
        self._on_lost = on_follower_lost
        listeners: list[socket.socket] = []
        members: dict[int, socket.socket] = {}
        try:
            for offset in (0, 1):
                listeners.append(socket.create_server((address, port + offset)))
            self._data, members = step_sockets.accept_followers(listeners, num_followers, timeout_s)
            self._ring, self._tcp = step_transport.offer(self._data, transport, timeout_s)
        except BaseException:
            for conn in [*self._data.values(), *members.values()]:
                conn.close()
            raise
        finally:
            for listener in listeners:
                listener.close()
        self._members = FollowersWatch(members, self._follower_lost)

    @property
    def shm_followers(self) -> int:
        """Followers that read the steps from the shared ring (the others: TCP)."""
        return 0 if self._ring is None else self._ring.active_readers

    @property
    def follower_transit_s(self) -> dict[int, float]:
        """Each follower's last reported median transit (s), REPORT_EVERY steps each."""
        return self._members.transit_s

    @property
    def agreement_s(self) -> float:
        """The step agreement latency: the slowest follower's last reported median
        transit (leader's send -> follower has the arrays), s; 0 before any report."""
        return self._members.agreement_s

    @property
    def lost_followers(self) -> list[int]:
        """The followers whose membership connection ended without a clean stop."""
        return self._members.lost

    def _follower_lost(self, process_id: int) -> None:
        if self._ring is not None:
            self._ring.drop_reader(process_id - 1)  # it no longer holds the ring back
        if self._on_lost is not None:
            self._on_lost(process_id)  # it logs the loss, with what it does about it
            return
        logger.error(
            "step channel: process %d (a follower) is gone: %s", process_id, LOST_CONNECTION
        )

    def publish(self, arrays: Sequence[np.ndarray], meta: dict | None = None, kind: str = RUN):
        """Send one step's inputs to every follower (raw array buffers, one message): once
        into the shared ring, and to each follower on TCP. Blocks only while a follower
        has a few MB unread (the ring's capacity, or its connection's kernel buffers)."""
        start = time.perf_counter()
        message = step_message.encode(self._step, arrays, meta, kind)
        if self._ring is not None:
            self._ring.write([message])
        for process_id, conn in list(self._tcp.items()):
            try:
                conn.sendall(message, step_sockets.NO_SIGNAL)
            except OSError:
                # That follower is gone: its membership watcher names it.
                logger.warning("step channel: process %d no longer receives steps", process_id)
                del self._tcp[process_id]
        self.bytes_sent += len(message)
        self._step += 1
        self.stats.record(time.perf_counter() - start)

    def close(self) -> None:
        """Tell the followers to stop, then close the sockets."""
        self._members.stop_watching()
        self.publish([], kind=STOP)
        self._members.close()
        for conn in self._data.values():
            conn.close()
        if self._ring is not None:
            self._ring.close()


class StepSubscriber:
    """A follower's end: connects to the leader's channel and joins it.

    on_leader_lost: called (with 0, the leader's process id) when the membership
        connection ends without the leader's clean stop, from a watcher thread; it may
        exit the process. None: only logged and recorded in `leader_lost`.
    transport: "tcp" or "auto" (`step_transport.chosen_transport`).

    Raises:
        TimeoutError: the leader did not answer within `timeout_s`.
    """

    def __init__(
        self,
        host: str,
        port: int,
        process_id: int,
        timeout_s: float = 120.0,
        *,
        on_leader_lost: Callable[[int], None] | None = None,
        transport: str | None = None,
    ):
        transport = step_transport.chosen_transport(transport)
        deadline = time.monotonic() + timeout_s
        self._data = step_sockets.connect(host, port, deadline, timeout_s)
        try:
            member = step_sockets.connect(host, port + 1, deadline, timeout_s)
        except BaseException:
            self._data.close()
            raise
        for conn in (self._data, member):
            step_sockets.keepalive(conn)
            conn.sendall(f"{process_id}\n".encode())
        self._data.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            self._ring = step_transport.take_offer(self._data, process_id - 1, transport, deadline)
        except BaseException:
            self._data.close()
            member.close()
            raise
        self._prefix = bytearray(step_message.PREFIX.size)
        self._decoder = step_message.StepDecoder()
        self._poll = select.poll()
        self._poll.register(self._data, select.POLLIN)
        self._on_lost = on_leader_lost
        self.stats = ChannelStats()
        self.wait_stats = ChannelStats()
        self._leader = LeaderWatch(member, self._leader_gone)

    @property
    def on_shm(self) -> bool:
        """Whether this follower reads the steps from the leader's shared ring."""
        return self._ring is not None

    @property
    def leader_lost(self) -> bool:
        """Whether the leader's membership connection ended without its clean stop."""
        return self._leader.lost

    def _leader_gone(self) -> None:
        if self._ring is not None:
            self._ring.wake()  # a `receive` waiting on the ring sees `leader_lost`
        if self._on_lost is not None:
            self._on_lost(0)  # it logs the loss, with what it does about it
            return
        logger.error("step channel: process 0 (the leader) is gone: %s", LOST_CONNECTION)

    def receive(self, timeout_s: float | None = None) -> StepMessage:
        """The next step.

        Raises:
            TimeoutError: nothing arrived within timeout_s (None waits for ever).
            ConnectionError: the leader closed the channel before STOP (it is gone; the
                membership watcher names it too).
        """
        start = time.perf_counter()
        if self._ring is not None:
            deadline = None if timeout_s is None else time.monotonic() + timeout_s
            self._read_ring(self._prefix, deadline)
        else:
            if timeout_s is not None and not self._poll.poll(max(0, int(timeout_s * 1000))):
                raise TimeoutError(f"step channel: no step from the leader in {timeout_s} s")
            step_sockets.read_exactly(self._data, self._prefix)
        header = self._decoder.header(self._prefix)
        body = self._decoder.new_body(header)
        if self._ring is not None:
            self._read_ring(body.data, None)
        else:
            step_sockets.read_exactly(self._data, body.data)
        message = self._decoder.decode(header, body)
        self.wait_stats.record(time.perf_counter() - start)
        self.stats.record(max(0.0, time.time() - header.sent))
        if self.stats.steps % REPORT_EVERY == 0:
            self._leader.report(self.stats.samples_s)
        return message

    def _read_ring(self, buffer, deadline: float | None) -> None:
        """Fill `buffer` from the shared ring (time.monotonic() `deadline` or None)."""
        try:
            self._ring.read_into(buffer, deadline, lambda: self.leader_lost)
        except ConnectionError as e:
            raise ConnectionError(
                "step channel: process 0 (the leader) is gone: nothing more on the ring"
            ) from e

    def close(self) -> None:
        """Leave the run (after STOP) and close the sockets."""
        self._leader.close()
        self._data.close()
        if self._ring is not None:
            self._ring.close()

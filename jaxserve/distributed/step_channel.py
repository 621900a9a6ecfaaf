"""The per-step agreement between processes: process 0 decides, the others follow.

In a multi-process run every process must launch the same jitted step with the same
inputs, or the collectives inside it hang. Process 0 (the leader) owns the scheduler;
each step it publishes the step's packed host inputs (token ids, positions, attention
metadata, sampling parameters: a few KB of NumPy arrays) in one message, then launches
the step itself. Followers block on the channel, rebuild the same arrays and launch the
same step. Nothing else crosses processes on the host: results come back through the
step's own (replicated) outputs.

The exchange is off the device's critical path as far as it can be: the leader
publishes before dispatching its own step (so followers dispatch while it does), the
arrays travel as raw buffers (no per-element encoding) and the follower parses each
array layout once. Its cost per step is measured on both sides (`ChannelStats`) for
export.

Transport: two plain TCP connections per follower, opened by the follower (retrying
until the leader listens), that live as long as the run. At start-up the follower
sends its process id on each ("<id>\\n"); the leader waits until every follower has
joined both before its first step, so no step is sent before a follower can get it.

- The data connection, to the leader's port, carries the steps to the followers on
  other hosts. The leader serialises a step once (`_PREFIX`, then one bytes object)
  and writes those bytes to each follower's connection (TCP_NODELAY) from the
  publishing thread: per follower one kernel write of a ready buffer, which is what a
  ZeroMQ PUB socket does per subscriber too, from its I/O thread. A follower reads a
  step with two `recv_into` calls (the prefix; the rest into a fresh buffer that the
  arrays are views of).
  ZeroMQ PUB/SUB, used before, was 1.7-2x slower on a 2-core VM
  (`scripts/bench_step_agreement.py`, 68 KB a step, interleaved: p50 237 / 441 / 783
  us at 2 / 4 / 8 processes against 142 / 210 / 400): its hand-offs between the
  application's thread and its I/O thread, on both ends, cost more than the writes.
  On one machine a write over loopback also runs the receiver's side of TCP, about
  25 us per follower at 68 KB there; across hosts the NIC does that.
- The followers on the leader's host read the same bytes from a shared-memory ring
  instead (`jaxserve.distributed.shm_ring`): the leader writes each step into it once
  and wakes them all with one futex call, so its cost does not grow with them. Right
  after the join, the leader offers the ring on each data connection ("shm <segment>
  <token> <host identity>\\n", or "tcp\\n" when it has none); a follower takes it when
  the host identity (boot id and host name, `shm_ring.host_identity`) is its own and it
  can map the segment and find the token in it, and answers "shm\\n" or "tcp\\n". The
  leader unlinks the segment once every follower answered (no name left in /dev/shm
  to leak on a later crash; one left by a crash during the join is removed by the next
  leader on the host). `JAXSERVE_STEP_TRANSPORT=tcp` (or `transport="tcp"`), on the leader
  or on a follower, keeps that end on TCP, for A/B runs. Measured on a 2-core VM (68 KB
  a step, interleaved, load 1.3-1.7): the leader's publish p50 81 / 95 / 104 us at
  2 / 4 / 8 processes against TCP's 74 / 143 / 236; the agreement p50 170 / 263 / 465
  against 154 / 271 / 526: there the followers' own work (wake, copy, unpack; 7 of them
  on 2 cores) grows with them, which the transport cannot remove.
- The membership connection, to the leader's port + 1, carries everything else, and
  is read by a watcher thread on each end (a follower's main thread may be blocked in
  a step's collectives, so the step reads cannot watch):

  - every REPORT_EVERY steps the follower sends on it the median transit it measured
    (leader's send -> arrays unpacked), so that the leader exports the step agreement
    latency (`StepPublisher.agreement_s`) for `diagnose`;
  - it is the liveness check. A process that dies closes its connections (the kernel
    does, even on SIGKILL), so the other end reads EOF at once and names the lost
    process (`on_follower_lost` / `on_leader_lost`); TCP keepalive bounds the time to
    notice a host that vanished without closing anything. A clean stop says so first
    (the leader sends `_BYE` before closing; a follower closes only after STOP, when the
    leader no longer watches), so EOF without it means the peer is gone.
"""

from __future__ import annotations

import logging
import math
import select
import selectors
import socket
import struct
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import msgpack
import numpy as np

from jaxserve.distributed import shm_ring

logger = logging.getLogger(__name__)

RUN = "run"
STOP = "stop"
# A new EPLB expert placement: arrays = [physical_to_logical [M, S] int32]; meta "steps":
# the RUN messages before it. Followers apply it before the next step, as the leader.
PLACEMENT = "placement"
# Each step message on a data connection: this prefix (step, kind, the leader's wall
# clock at the send, then the byte sizes of what follows), the meta map (msgpack), the
# arrays' layout (msgpack [(dtype, shape)]: its own bytes, so that a follower parses each
# layout once), the arrays' raw buffers one after the other, each from a multiple of
# _ALIGN bytes into what follows the prefix (zero padding between).
_PREFIX = struct.Struct("<qBdIII")
_ALIGN = 16
# A write to a follower that is gone raises (EPIPE) rather than signalling the process.
_NO_SIGNAL = getattr(socket, "MSG_NOSIGNAL", 0)
_KINDS = (RUN, STOP, PLACEMENT)
# Sent by the leader on each membership connection right before a clean close.
_BYE = b"bye"
# A follower's transit report on its membership connection: b"t <microseconds>\n", the
# median over its last REPORT_EVERY steps.
_REPORT = b"t"
REPORT_EVERY = 64
# TCP keepalive on membership connections: a peer host that vanished without closing them
# (power, network) is noticed after about IDLE + INTERVAL * COUNT seconds = 11 s.
_KEEPALIVE_IDLE_S = 5
_KEEPALIVE_INTERVAL_S = 2
_KEEPALIVE_COUNT = 3
TRANSPORT_ENV = shm_ring.TRANSPORT_ENV


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


@dataclass(frozen=True, slots=True)
class StepMessage:
    """One step's decision: kind (RUN, PLACEMENT or STOP), a small metadata map, the
    input arrays."""

    step: int
    kind: str
    meta: dict
    arrays: list[np.ndarray]


class StepPublisher:
    """The leader's end. Listens on `host:port` (data) and `host:port+1` (membership) and
    waits until all `num_followers` have joined both.

    on_follower_lost: called with a follower's process id when its membership connection
        ends without a clean stop (the process died or its host is unreachable), from a
        watcher thread; it may exit the process. None: only logged and recorded in
        `lost_followers`.

    Raises:
        TimeoutError: not every follower joined within `timeout_s`.
        ValueError: a follower sent a process id out of [1, num_followers] or twice.
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
        transport = shm_ring.chosen_transport(transport)  # a bad value fails before the join
        address = socket.gethostbyname(host)
        self._ring: shm_ring.RingWriter | None = None
        # The data connections of the followers that read the steps there (not the ring).
        self._tcp: dict[int, socket.socket] = {}
        self._listeners: list[socket.socket] = []
        # Joined connections by process id: data (the steps), membership (the rest).
        self._data: dict[int, socket.socket] = {}
        self._members: dict[int, socket.socket] = {}
        self._step = 0
        self.stats = ChannelStats()
        self.bytes_sent = 0
        # Each follower's last reported median transit (s), `REPORT_EVERY` steps each.
        self.follower_transit_s: dict[int, float] = {}
        self.lost_followers: list[int] = []
        self._on_lost = on_follower_lost
        self._closing = threading.Event()
        try:
            for offset in (0, 1):
                self._listeners.append(socket.create_server((address, port + offset)))
            self._wait_for_followers(num_followers, timeout_s)
            self._ring, self._tcp = shm_ring.offer(self._data, transport, timeout_s)
        except BaseException:
            self._close_sockets()
            raise
        for listener in self._listeners:
            listener.close()
        # The watcher's wake-up: closing writes here so that `select` returns.
        self._wake_r, self._wake_w = socket.socketpair()
        self._watcher = threading.Thread(
            target=self._watch_followers, name="step-channel-followers", daemon=True
        )
        self._watcher.start()

    def _wait_for_followers(self, num_followers: int, timeout_s: float) -> None:
        """Accept connections until every follower has joined both ports with its process
        id ("<id>\\n")."""
        pending: dict[socket.socket, tuple[dict, bytes]] = {}  # accepted, id not read yet
        deadline = time.monotonic() + timeout_s
        with selectors.DefaultSelector() as sel:
            for listener, joined in zip(self._listeners, (self._data, self._members), strict=True):
                sel.register(listener, selectors.EVENT_READ, joined)
            try:
                while min(len(self._data), len(self._members)) < num_followers:
                    left = deadline - time.monotonic()
                    if left < 0:
                        raise TimeoutError(
                            f"step channel: {len(self._members)} of {num_followers} "
                            f"followers joined in {timeout_s:.0f} s"
                        )
                    for key, _ in sel.select(min(left, 0.1)):
                        if key.fileobj in self._listeners:
                            conn, _ = key.fileobj.accept()
                            pending[conn] = (key.data, b"")
                            sel.register(conn, selectors.EVENT_READ)
                        else:
                            self._read_join(key.fileobj, pending, sel, num_followers)
            finally:
                for conn in pending:
                    conn.close()

    @property
    def shm_followers(self) -> int:
        """Followers that read the steps from the shared ring (the others: TCP)."""
        return 0 if self._ring is None else self._ring.active_readers

    def _read_join(self, conn, pending: dict, sel, num_followers: int) -> None:
        """Read from a connection that has not joined yet; join it on a full line."""
        try:
            data = conn.recv(64)
        except OSError:
            data = b""
        joined, text = pending[conn]
        text += data
        pending[conn] = (joined, text)
        if data and not text.endswith(b"\n"):
            return
        sel.unregister(conn)
        del pending[conn]
        if not data or not text.strip().isdigit():
            # Closed before joining, or not a follower (e.g. a port scan).
            logger.warning("step channel: ignoring a join of %r", text[:32])
            conn.close()
            return
        self._join(conn, joined, int(text), num_followers)

    def _join(self, conn: socket.socket, joined: dict, process_id: int, num_followers: int):
        if not 1 <= process_id <= num_followers or process_id in joined:
            conn.close()
            raise ValueError(
                f"step channel: a follower joined as process {process_id}, expected each "
                f"of 1..{num_followers} once (check --process-id / JAX_PROCESS_ID)"
            )
        _keepalive(conn)
        if joined is self._data:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        joined[process_id] = conn

    def _watch_followers(self) -> None:
        """Until `close`: report each follower whose membership connection ends."""
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
                    self._follower_lost(key.data)

    def _read_reports(self, process_id: int, buffered: bytes) -> bytes:
        """Record the complete transit reports ("t <microseconds>\\n") in `buffered`
        from follower `process_id`; return the incomplete tail. Other lines are ignored."""
        *lines, tail = buffered.split(b"\n")
        for line in lines:
            kind, _, value = line.partition(b" ")
            if kind == _REPORT and value.strip().isdigit():
                self.follower_transit_s[process_id] = int(value) / 1e6
        return tail[-64:]

    @property
    def agreement_s(self) -> float:
        """The step agreement latency: the slowest follower's last reported median
        transit (leader's send -> follower has the arrays), s; 0 before any report."""
        return max(self.follower_transit_s.values(), default=0.0)

    def _follower_lost(self, process_id: int) -> None:
        if self._closing.is_set():
            return
        self.lost_followers.append(process_id)
        if self._ring is not None:
            self._ring.drop_reader(process_id - 1)  # it no longer holds the ring back
        logger.error(
            "step channel: process %d (a follower) is gone: its connection to the leader "
            "closed without a clean stop (it died, or its host is unreachable)",
            process_id,
        )
        if self._on_lost is not None:
            self._on_lost(process_id)

    def publish(self, arrays: Sequence[np.ndarray], meta: dict | None = None, kind: str = RUN):
        """Send one step's inputs to every follower (raw array buffers, one message): once
        into the shared ring, and to each follower on TCP. Blocks only while a follower
        has a few MB unread (the ring's capacity, or its connection's kernel buffers)."""
        start = time.perf_counter()
        sent = time.time()
        arrays = [np.asarray(a, order="C") for a in arrays]
        packed_meta = msgpack.packb(meta or {})
        layout = msgpack.packb([(a.dtype.str, a.shape) for a in arrays])
        parts = [packed_meta, layout, _padding(len(packed_meta) + len(layout))]
        array_bytes = 0
        for a in arrays:
            parts += (a, _padding(a.nbytes))
            array_bytes += a.nbytes + len(parts[-1])
        prefix = _PREFIX.pack(
            self._step, _KINDS.index(kind), sent, len(packed_meta), len(layout), array_bytes
        )
        message = b"".join([prefix, *parts])
        if self._ring is not None:
            self._ring.write([message])
        for process_id, conn in list(self._tcp.items()):
            try:
                conn.sendall(message, _NO_SIGNAL)
            except OSError:
                # That follower is gone: its membership watcher names it.
                logger.warning("step channel: process %d no longer receives steps", process_id)
                del self._tcp[process_id]
        self.bytes_sent += len(message)
        self._step += 1
        self.stats.record(time.perf_counter() - start)

    def close(self) -> None:
        """Tell the followers to stop, then close the sockets."""
        self._closing.set()
        self._wake_w.send(b"x")
        self.publish([], kind=STOP)
        for conn in self._members.values():
            try:
                conn.sendall(_BYE)
            except OSError:
                pass  # that follower is gone already
        self._watcher.join()
        self._close_sockets()

    def _close_sockets(self) -> None:
        for conn in [*self._data.values(), *self._members.values(), *self._listeners]:
            conn.close()
        if self._ring is not None:
            self._ring.close()
        for end in (getattr(self, "_wake_r", None), getattr(self, "_wake_w", None)):
            if end is not None:
                end.close()


class StepSubscriber:
    """A follower's end: connects to the leader's channel and joins it.

    on_leader_lost: called (with 0, the leader's process id) when the membership
        connection ends without the leader's clean stop, from a watcher thread; it may
        exit the process. None: only logged and recorded in `leader_lost`.

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
        transport = shm_ring.chosen_transport(transport)
        deadline = time.monotonic() + timeout_s
        self._data = _connect(host, port, deadline, timeout_s)
        try:
            self._member = _connect(host, port + 1, deadline, timeout_s)
        except BaseException:
            self._data.close()
            raise
        for conn in (self._data, self._member):
            _keepalive(conn)
            conn.sendall(f"{process_id}\n".encode())
        self._data.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            self._ring = shm_ring.take_offer(self._data, process_id - 1, transport, deadline)
        except BaseException:
            self._data.close()
            self._member.close()
            raise
        self._prefix = bytearray(_PREFIX.size)
        # Parsed array layouts by their bytes: [(shape, dtype, offset)].
        self._layouts: dict[bytes, list[tuple[tuple, np.dtype, int]]] = {}
        self._poll = select.poll()
        self._poll.register(self._data, select.POLLIN)
        self.leader_lost = False
        self._on_lost = on_leader_lost
        self._closing = threading.Event()
        self._watcher = threading.Thread(
            target=self._watch_leader, name="step-channel-leader", daemon=True
        )
        self._watcher.start()
        self.stats = ChannelStats()
        self.wait_stats = ChannelStats()

    @property
    def on_shm(self) -> bool:
        """Whether this follower reads the steps from the leader's shared ring."""
        return self._ring is not None

    def _watch_leader(self) -> None:
        """Until `close` or the leader's bye: report the leader if its connection ends."""
        received = b""
        while True:
            try:
                data = self._member.recv(64)
            except OSError:  # reset, keepalive timed out, or closed by `close`
                data = b""
            received += data
            if _BYE in received or self._closing.is_set():
                return
            if not data:
                break
        self.leader_lost = True
        logger.error(
            "step channel: process 0 (the leader) is gone: its connection closed without "
            "a clean stop (it died, or its host is unreachable)"
        )
        if self._ring is not None:
            self._ring.wake()  # a `receive` waiting on the ring sees `leader_lost`
        if self._on_lost is not None:
            self._on_lost(0)

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
            self._read_exactly(self._prefix)
        step, kind, sent, meta_bytes, layout_bytes, array_bytes = _PREFIX.unpack(self._prefix)
        # A fresh buffer each step: the arrays are views of it and outlive this call.
        start_of_arrays = meta_bytes + layout_bytes
        start_of_arrays += len(_padding(start_of_arrays))
        body = np.empty(start_of_arrays + array_bytes, np.uint8)  # aligned to 16 bytes
        if self._ring is not None:
            self._read_ring(body.data, None)
        else:
            self._read_exactly(body.data)
        meta = msgpack.unpackb(body[:meta_bytes].data)
        layout_key = body[meta_bytes : meta_bytes + layout_bytes].tobytes()
        layout = self._layouts.get(layout_key)
        if layout is None:
            if len(self._layouts) >= 4096:  # one per step shape: bounded anyway
                self._layouts.clear()
            layout = self._layouts[layout_key] = _parse_layout(layout_key)
        arrays = [
            np.ndarray(shape, dtype, body, start_of_arrays + offset)
            for shape, dtype, offset in layout
        ]
        self.wait_stats.record(time.perf_counter() - start)
        self.stats.record(max(0.0, time.time() - sent))
        if self.stats.steps % REPORT_EVERY == 0:
            self._report()
        return StepMessage(step, _KINDS[kind], meta, arrays)

    def _read_ring(self, buffer, deadline: float | None) -> None:
        """Fill `buffer` from the shared ring (time.monotonic() `deadline` or None)."""
        try:
            self._ring.read_into(buffer, deadline, lambda: self.leader_lost)
        except ConnectionError as e:
            raise ConnectionError(
                "step channel: process 0 (the leader) is gone: nothing more on the ring"
            ) from e

    def _read_exactly(self, buffer) -> None:
        """Fill `buffer` from the data connection (one call unless a signal interrupts)."""
        view = memoryview(buffer).cast("B")
        while view.nbytes:
            n = self._data.recv_into(view, view.nbytes, socket.MSG_WAITALL)
            if n == 0:
                raise ConnectionError(
                    "step channel: process 0 (the leader) closed the connection without a "
                    "clean stop"
                )
            view = view[n:]

    def _report(self) -> None:
        """Send the leader the median transit of the last REPORT_EVERY steps (a few
        bytes on the membership connection; a lost leader is the watcher's to report)."""
        recent = sorted(self.stats.samples_s[-REPORT_EVERY:])
        if not recent:
            return
        micros = round(1e6 * recent[len(recent) // 2])
        try:
            self._member.sendall(_REPORT + b" %d\n" % micros)
        except OSError:
            pass

    def close(self) -> None:
        """Leave the run (after STOP) and close the sockets."""
        self._closing.set()
        try:
            self._member.shutdown(socket.SHUT_RDWR)  # wakes the watcher's recv
        except OSError:
            pass
        self._watcher.join()
        self._member.close()
        self._data.close()
        if self._ring is not None:
            self._ring.close()


def _parse_layout(packed: bytes) -> list[tuple[tuple, np.dtype, int]]:
    """(shape, dtype, byte offset) of each array of a message, from its packed layout."""
    layout, offset = [], 0
    for dtype_str, shape in msgpack.unpackb(packed):
        dtype, shape = np.dtype(dtype_str), tuple(shape)
        layout.append((shape, dtype, offset))
        nbytes = math.prod(shape) * dtype.itemsize
        offset += nbytes + len(_padding(nbytes))
    return layout


def _padding(nbytes: int) -> bytes:
    """The zero bytes that bring `nbytes` to a multiple of _ALIGN."""
    return bytes(-nbytes % _ALIGN)


def _connect(host: str, port: int, deadline: float, timeout_s: float) -> socket.socket:
    """A TCP connection to the leader, retried until `deadline` (it may not listen yet).

    Raises:
        TimeoutError: no leader listening by then.
    """
    while True:
        try:
            conn = socket.create_connection(
                (host, port), timeout=max(0.1, deadline - time.monotonic())
            )
        except OSError as e:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"step channel: no leader at {host}:{port} after {timeout_s} s"
                ) from e
            time.sleep(0.05)
            continue
        conn.settimeout(None)
        return conn


def _keepalive(conn: socket.socket) -> None:
    """TCP keepalive with short timers (Linux names; elsewhere the system's defaults)."""
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (
        ("TCP_KEEPIDLE", _KEEPALIVE_IDLE_S),
        ("TCP_KEEPINTVL", _KEEPALIVE_INTERVAL_S),
        ("TCP_KEEPCNT", _KEEPALIVE_COUNT),
    ):
        if hasattr(socket, name):
            conn.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)

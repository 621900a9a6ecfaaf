"""The per-step agreement between processes: process 0 decides, the others follow.

In a multi-process run every process must launch the same jitted step with the same
inputs, or the collectives inside it hang. Process 0 (the leader) owns the scheduler;
each step it publishes the step's packed host inputs (token ids, positions, attention
metadata, sampling parameters: a few KB of NumPy arrays) in ONE ZeroMQ multipart
message, then launches the step itself. Followers block on the channel, rebuild the same
arrays and launch the same step. Nothing else crosses processes on the host: results
come back through the step's own (replicated) outputs.

The exchange is off the device's critical path as far as it can be: the leader
publishes before dispatching its own step (so followers dispatch while it does), the
arrays travel as raw buffers (no per-element encoding), and the header is one small
msgpack map. Its cost per step is measured on both sides (`ChannelStats`) for export.

Transport: PUB/SUB from the leader to every follower (one send fans out), plus one
plain TCP "membership" connection per follower, to the leader's port + 1, that lives as
long as the run:

- at start-up the follower sends its process id on it once its subscription received
  a hello, which confirms the subscription (a PUB drops messages sent before a
  subscriber has joined: the "slow joiner");
- every REPORT_EVERY steps the follower sends on it the median transit it measured
  (leader's send -> arrays unpacked), so that the leader exports the step agreement
  latency (`StepPublisher.agreement_s`) for `diagnose`;
- and it is the liveness check. A process that dies closes its connections (the
  kernel does, even on SIGKILL), so the other end reads EOF at once and names the lost
  process (`on_follower_lost` / `on_leader_lost`); TCP keepalive bounds the time to
  notice a host that vanished without closing anything. A clean stop says so first
  (the leader sends `_BYE` before closing; a follower closes only after STOP, when the
  leader no longer watches), so EOF without it means the peer is gone.

Why not ZeroMQ for this too: a PUB or PULL socket does not tell which peer
disconnected (ROUTER_NOTIFY is a draft API, absent from pyzmq's bundled libzmq).
"""

from __future__ import annotations

import logging
import selectors
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import msgpack
import numpy as np
import zmq

logger = logging.getLogger(__name__)

RUN = "run"
STOP = "stop"
# A new EPLB expert placement: arrays = [physical_to_logical [M, S] int32]; meta "steps":
# the RUN messages before it. Followers apply it before the next step, as the leader.
PLACEMENT = "placement"
_HELLO = b"hello"
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


def _bind_address(host: str, port: int) -> str:
    return f"tcp://{socket.gethostbyname(host)}:{port}"


class StepPublisher:
    """The leader's end. Binds `host:port` (PUB) and `host:port+1` (membership) and
    waits until all `num_followers` have joined.

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
    ):
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, 0)  # never drop a step
        self._pub.setsockopt(zmq.LINGER, 5000)
        self._pub.bind(_bind_address(host, port))
        self._listener = socket.create_server((socket.gethostbyname(host), port + 1))
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
            self._wait_for_followers(num_followers, timeout_s)
        except BaseException:
            self._close_sockets()
            raise
        self._listener.close()
        # The watcher's wake-up: closing writes here so that `select` returns.
        self._wake_r, self._wake_w = socket.socketpair()
        self._watcher = threading.Thread(
            target=self._watch_followers, name="step-channel-followers", daemon=True
        )
        self._watcher.start()

    def _wait_for_followers(self, num_followers: int, timeout_s: float) -> None:
        """Send hellos until every follower's subscription got one and it has joined on
        the membership port with its process id ("<id>\\n")."""
        pending: dict[socket.socket, bytes] = {}  # accepted, process id not read yet
        deadline = time.monotonic() + timeout_s
        with selectors.DefaultSelector() as sel:
            sel.register(self._listener, selectors.EVENT_READ)
            try:
                while len(self._members) < num_followers:
                    if time.monotonic() > deadline:
                        raise TimeoutError(
                            f"step channel: {len(self._members)} of {num_followers} "
                            f"followers joined in {timeout_s:.0f} s"
                        )
                    self._pub.send_multipart([_HELLO])
                    for key, _ in sel.select(0.01):
                        if key.fileobj is self._listener:
                            conn, _ = self._listener.accept()
                            pending[conn] = b""
                            sel.register(conn, selectors.EVENT_READ)
                        else:
                            self._read_join(key.fileobj, pending, sel, num_followers)
            finally:
                for conn in pending:
                    conn.close()

    def _read_join(self, conn, pending: dict, sel, num_followers: int) -> None:
        """Read from a connection that has not joined yet; join it on a full line."""
        try:
            data = conn.recv(64)
        except OSError:
            data = b""
        pending[conn] += data
        if data and not pending[conn].endswith(b"\n"):
            return
        sel.unregister(conn)
        text = pending.pop(conn)
        if not data or not text.strip().isdigit():
            # Closed before joining, or not a follower (e.g. a port scan).
            logger.warning("step channel: ignoring a join of %r", text[:32])
            conn.close()
            return
        self._join(conn, int(text), num_followers)

    def _join(self, conn: socket.socket, process_id: int, num_followers: int) -> None:
        if not 1 <= process_id <= num_followers or process_id in self._members:
            conn.close()
            raise ValueError(
                f"step channel: a follower joined as process {process_id}, expected each "
                f"of 1..{num_followers} once (check --process-id / JAX_PROCESS_ID)"
            )
        _keepalive(conn)
        self._members[process_id] = conn

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
        logger.error(
            "step channel: process %d (a follower) is gone: its connection to the leader "
            "closed without a clean stop (it died, or its host is unreachable)",
            process_id,
        )
        if self._on_lost is not None:
            self._on_lost(process_id)

    def publish(self, arrays: Sequence[np.ndarray], meta: dict | None = None, kind: str = RUN):
        """Send one step's inputs to every follower (raw array buffers, one message)."""
        start = time.perf_counter()
        arrays = [np.ascontiguousarray(a) for a in arrays]
        header = {
            "step": self._step,
            "kind": kind,
            "meta": meta or {},
            "arrays": [(a.dtype.str, a.shape) for a in arrays],
            "sent": time.time(),
        }
        frames = [msgpack.packb(header), *arrays]
        self._pub.send_multipart(frames, copy=True)
        self.bytes_sent += sum(len(f) if isinstance(f, bytes) else f.nbytes for f in frames)
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
        for conn in self._members.values():
            conn.close()
        self._listener.close()
        for end in (getattr(self, "_wake_r", None), getattr(self, "_wake_w", None)):
            if end is not None:
                end.close()
        self._pub.close()
        self._ctx.term()


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
    ):
        self._ctx = zmq.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.setsockopt(zmq.RCVHWM, 0)
        self._sub.connect(f"tcp://{host}:{port}")
        if not self._sub.poll(int(timeout_s * 1000)):
            self._sub.close(linger=0)
            self._ctx.term()
            raise TimeoutError(f"step channel: no leader at {host}:{port} after {timeout_s} s")
        # The subscription works (a hello arrived): join, and stay joined for the run.
        try:
            self._member = socket.create_connection((host, port + 1), timeout=timeout_s)
        except OSError:
            self._sub.close(linger=0)
            self._ctx.term()
            raise
        self._member.settimeout(None)
        _keepalive(self._member)
        self._member.sendall(f"{process_id}\n".encode())
        self.leader_lost = False
        self._on_lost = on_leader_lost
        self._closing = threading.Event()
        self._watcher = threading.Thread(
            target=self._watch_leader, name="step-channel-leader", daemon=True
        )
        self._watcher.start()
        self.stats = ChannelStats()
        self.wait_stats = ChannelStats()

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
        if self._on_lost is not None:
            self._on_lost(0)

    def receive(self, timeout_s: float | None = None) -> StepMessage:
        """The next step (start-up hellos are skipped).

        Raises:
            TimeoutError: nothing arrived within timeout_s (None waits for ever).
        """
        start = time.perf_counter()
        while True:
            if timeout_s is not None and not self._sub.poll(int(timeout_s * 1000)):
                raise TimeoutError(f"step channel: no step from the leader in {timeout_s} s")
            frames = self._sub.recv_multipart(copy=False)
            if len(frames) == 1 and frames[0].bytes == _HELLO:
                continue
            break
        header = msgpack.unpackb(frames[0].bytes)
        arrays = [
            np.frombuffer(f.buffer, dtype=np.dtype(dt)).reshape(shape)
            for f, (dt, shape) in zip(frames[1:], header["arrays"], strict=True)
        ]
        self.wait_stats.record(time.perf_counter() - start)
        self.stats.record(max(0.0, time.time() - header["sent"]))
        if self.stats.steps % REPORT_EVERY == 0:
            self._report()
        return StepMessage(header["step"], header["kind"], header["meta"], arrays)

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
        self._sub.close(linger=0)
        self._ctx.term()


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

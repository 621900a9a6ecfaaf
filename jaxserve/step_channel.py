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

Transport: PUB/SUB from the leader to every follower (one send fans out), plus a
PUSH/PULL back-channel used only at start-up to confirm every follower's subscription
(a PUB drops messages sent before a subscriber has joined: the "slow joiner").
"""

from __future__ import annotations

import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import msgpack
import numpy as np
import zmq

RUN = "run"
STOP = "stop"
_HELLO = b"hello"


@dataclass(slots=True)
class ChannelStats:
    """Seconds per step: on the leader, packing and sending (`StepPublisher.stats`); on
    a follower, the transit from the leader's send to the unpacked arrays
    (`StepSubscriber.stats`; wall clocks, so across hosts it is as good as their clock
    sync) and, separately, the time blocked waiting (`StepSubscriber.wait_stats`,
    which includes the leader's own work between steps).
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
    """One step's decision: kind (RUN or STOP), a small metadata map, the input arrays."""

    step: int
    kind: str
    meta: dict
    arrays: list[np.ndarray]


def _bind_address(host: str, port: int) -> str:
    return f"tcp://{socket.gethostbyname(host)}:{port}"


class StepPublisher:
    """The leader's end. Binds `host:port` (PUB) and `host:port+1` (start-up acks) and
    waits until all `num_followers` have subscribed.

    Raises:
        TimeoutError: not every follower joined within `timeout_s`.
    """

    def __init__(self, host: str, port: int, num_followers: int, timeout_s: float = 120.0):
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, 0)  # never drop a step
        self._pub.setsockopt(zmq.LINGER, 5000)
        self._pub.bind(_bind_address(host, port))
        self._acks = self._ctx.socket(zmq.PULL)
        self._acks.bind(_bind_address(host, port + 1))
        self._step = 0
        self.stats = ChannelStats()
        self._wait_for_followers(num_followers, timeout_s)

    def _wait_for_followers(self, num_followers: int, timeout_s: float) -> None:
        joined: set[int] = set()
        deadline = time.monotonic() + timeout_s
        while len(joined) < num_followers:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"step channel: {len(joined)} of {num_followers} followers joined in "
                    f"{timeout_s:.0f} s"
                )
            self._pub.send_multipart([_HELLO])
            while self._acks.poll(10):
                joined.add(int(self._acks.recv()))

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
        self._pub.send_multipart([msgpack.packb(header), *arrays], copy=True)
        self._step += 1
        self.stats.record(time.perf_counter() - start)

    def close(self) -> None:
        """Tell the followers to stop, then close the sockets."""
        self.publish([], kind=STOP)
        self._pub.close()
        self._acks.close(linger=0)
        self._ctx.term()


class StepSubscriber:
    """A follower's end: connects to the leader's channel and confirms its subscription.

    Raises:
        TimeoutError: the leader did not answer within `timeout_s`.
    """

    def __init__(self, host: str, port: int, process_id: int, timeout_s: float = 120.0):
        self._ctx = zmq.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.setsockopt(zmq.RCVHWM, 0)
        self._sub.connect(f"tcp://{host}:{port}")
        acks = self._ctx.socket(zmq.PUSH)
        acks.connect(f"tcp://{host}:{port + 1}")
        if not self._sub.poll(int(timeout_s * 1000)):
            raise TimeoutError(f"step channel: no leader at {host}:{port} after {timeout_s} s")
        acks.send(str(process_id).encode())
        acks.close(linger=5000)
        self.stats = ChannelStats()
        self.wait_stats = ChannelStats()

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
        return StepMessage(header["step"], header["kind"], header["meta"], arrays)

    def close(self) -> None:
        self._sub.close(linger=0)
        self._ctx.term()

"""The step channel's shared-memory path (`jaxserve.distributed.shm_ring`, offered at join
by `step_transport`): the followers on the leader's host read each step from one ring
that the leader writes once.

Oracles: the arrays published (every step, in order, equal, 16-byte aligned), the ring's
own cursors (a lagging reader holds the writer back by exactly the capacity), the
transport each end reports, and the names left in /dev/shm.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from server_harness import free_port_range

from jaxserve.distributed import shm_ring, step_transport
from jaxserve.distributed.step_channel import StepPublisher, StepSubscriber
from jaxserve.distributed.step_message import STOP
from jaxserve.distributed.step_transport import TRANSPORT_ENV

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(not shm_ring.available(), reason="no futex ring on this host")


def _our_segments() -> set[str]:
    return {p.name for p in shm_ring.SHM_DIR.glob("jaxserve-step-*")}


def _odd_steps(n: int) -> list[list[np.ndarray]]:
    rng = np.random.default_rng(0)
    return [
        [
            rng.integers(0, 100, size=(i + 1,), dtype=np.uint8),  # odd sizes: padding
            rng.integers(0, 100, size=(3 * i + 1,), dtype=np.int32),
            rng.random((2, 3)),
            np.zeros((0, 3), np.float32),  # zero-size
            np.array(i, np.int64),  # 0-d
            rng.integers(0, 9, size=(40_000,), dtype=np.int64) if i % 7 == 0 else np.zeros(1),
        ]
        for i in range(n)
    ]


def _run_channel(followers: dict[int, dict], leader_transport: str | None, steps):
    """A leader and followers (threads; kwargs per follower id); every step published,
    then STOP. Returns the leader, the follower ends and what each received."""
    port = free_port_range()
    subs: dict[int, StepSubscriber] = {}
    received: dict[int, list] = {pid: [] for pid in followers}

    def follow(pid: int) -> None:
        sub = subs[pid] = StepSubscriber("127.0.0.1", port, pid, 30, **followers[pid])
        while (msg := sub.receive(timeout_s=30)).kind != STOP:
            received[pid].append(msg)
        sub.close()

    threads = [threading.Thread(target=follow, args=(pid,)) for pid in followers]
    for t in threads:
        t.start()
    before = _our_segments()
    leader = StepPublisher("127.0.0.1", port, len(followers), 30, transport=leader_transport)
    assert _our_segments() == before  # unlinked once all attached
    for i, arrays in enumerate(steps):
        leader.publish(arrays, meta={"bucket": i})
    leader.close()
    for t in threads:
        t.join(timeout=30)
        assert not t.is_alive()
    return leader, subs, received


def _check_delivery(received: list, steps) -> None:
    assert [m.step for m in received] == list(range(len(steps)))
    for msg, arrays in zip(received, steps, strict=True):
        assert msg.meta == {"bucket": msg.step}
        for got, want in zip(msg.arrays, arrays, strict=True):
            assert got.dtype == want.dtype and got.shape == want.shape
            assert got.ctypes.data % 16 == 0  # each array aligned, as if allocated alone
            np.testing.assert_array_equal(got, want)


def test_local_followers_read_every_step_in_order_from_the_ring():
    # 300 steps of up to 330 KB pass a 2 MiB ring several times over.
    steps = _odd_steps(300)
    leader, subs, received = _run_channel({1: {}, 2: {}, 3: {}}, None, steps)
    assert leader.shm_followers == 3 and all(s.on_shm for s in subs.values())
    for pid in subs:
        _check_delivery(received[pid], steps)
    # The transit reports still reach the leader (agreement_s) from the ring's followers.
    assert all(s.stats.steps == 301 for s in subs.values())


def test_forced_tcp_on_the_leader_or_on_one_follower(monkeypatch):
    steps = _odd_steps(30)
    leader, subs, received = _run_channel({1: {}, 2: {}}, "tcp", steps)
    assert leader.shm_followers == 0 and not any(s.on_shm for s in subs.values())
    for pid in subs:
        _check_delivery(received[pid], steps)
    # One follower forced onto TCP (argument), one by the environment, one on the ring.
    monkeypatch.setenv(TRANSPORT_ENV, "auto")
    leader, subs, received = _run_channel({1: {"transport": "tcp"}, 2: {}}, None, steps)
    assert leader.shm_followers == 1 and [subs[1].on_shm, subs[2].on_shm] == [False, True]
    for pid in subs:
        _check_delivery(received[pid], steps)
    monkeypatch.setenv(TRANSPORT_ENV, "tcp")
    leader, subs, _ = _run_channel({1: {}}, None, steps)
    assert leader.shm_followers == 0
    monkeypatch.setenv(TRANSPORT_ENV, "udp")
    with pytest.raises(ValueError, match="JAXSERVE_STEP_TRANSPORT"):
        StepPublisher("127.0.0.1", free_port_range(), 1, 1)


def test_a_follower_on_another_host_stays_on_tcp(monkeypatch):
    """A follower whose host identity differs from the leader's (another machine) does
    not try the segment."""
    real = step_transport.host_identity
    monkeypatch.setattr(
        step_transport,
        "host_identity",
        lambda: "other-host" if threading.current_thread().name == "remote" else real(),
    )
    port = free_port_range()
    subs = {}

    def follow(pid: int) -> None:
        subs[pid] = StepSubscriber("127.0.0.1", port, pid, 30)
        while subs[pid].receive(timeout_s=30).kind != STOP:
            pass
        subs[pid].close()

    threads = [threading.Thread(target=follow, args=(1,), name="remote")]
    threads.append(threading.Thread(target=follow, args=(2,), name="local"))
    for t in threads:
        t.start()
    leader = StepPublisher("127.0.0.1", port, 2, 30)
    leader.publish([np.arange(5)])
    leader.close()
    for t in threads:
        t.join(timeout=30)
    assert leader.shm_followers == 1 and [subs[1].on_shm, subs[2].on_shm] == [False, True]


def test_a_lagging_reader_holds_the_writer_back_by_the_capacity():
    capacity = 4096
    writer = shm_ring.RingWriter(2, capacity=capacity)
    try:
        fast = shm_ring.RingReader(writer.name, writer.token, 0)
        slow = shm_ring.RingReader(writer.name, writer.token, 1)
        writer.activate(0)
        writer.activate(1)
        writer.unlink()
        data = np.random.default_rng(1).integers(0, 256, 3 * capacity + 123, dtype=np.uint8)
        done = threading.Event()
        thread = threading.Thread(
            target=lambda: (writer.write([data.tobytes()]), done.set()), daemon=True
        )
        thread.start()
        fast_got = np.empty_like(data)
        reader = threading.Thread(
            target=fast.read_into, args=(fast_got, time.monotonic() + 10, lambda: False),
            daemon=True,
        )  # fmt: skip
        reader.start()
        time.sleep(0.3)
        # The slow reader has read nothing: the writer waits with exactly one ring written.
        assert not done.is_set() and writer._cursor == capacity
        slow_got = np.empty_like(data)
        slow.read_into(slow_got[:1000], time.monotonic() + 5, lambda: False)
        time.sleep(0.1)
        assert writer._cursor == capacity + 1000  # room for exactly what was read
        slow.read_into(slow_got[1000:], time.monotonic() + 5, lambda: False)
        assert done.wait(5)
        reader.join(5)
        np.testing.assert_array_equal(fast_got, data)  # larger than the ring: in pieces
        np.testing.assert_array_equal(slow_got, data)
        with pytest.raises(TimeoutError):
            slow.read_into(bytearray(1), time.monotonic() + 0.05, lambda: False)
        with pytest.raises(ConnectionError):
            slow.read_into(bytearray(1), None, lambda: True)
        # A reader that is gone (dropped) no longer holds the writer back.
        writer.write([bytes(capacity)])
        fast.read_into(bytearray(capacity), None, lambda: False)
        writer.drop_reader(1)
        writer.write([bytes(10)])  # the slow reader has not read the last ring: no wait
        fast.close()
        slow.close()
    finally:
        writer.close()


def test_a_segment_from_another_writer_is_refused():
    writer = shm_ring.RingWriter(1)
    try:
        with pytest.raises(ValueError, match="token"):
            shm_ring.RingReader(writer.name, writer.token + 1, 0)
        with pytest.raises(ValueError):
            shm_ring.RingReader("../etc/passwd", writer.token, 0)
        writer.unlink()
        with pytest.raises(OSError):
            shm_ring.RingReader(writer.name, writer.token, 0)
    finally:
        writer.close()


def test_the_segments_of_dead_writers_are_removed():
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], text=True,
                          capture_output=True, check=True)  # fmt: skip
    stale = shm_ring.SHM_DIR / f"jaxserve-step-{dead.stdout.strip()}-0123456789ab"
    stale.write_bytes(b"x")
    writer = shm_ring.RingWriter(1)
    try:
        assert not stale.exists()
        assert (shm_ring.SHM_DIR / writer.name).exists()  # a live writer's stays
        assert shm_ring.remove_stale_segments() == []
    finally:
        writer.close()
        stale.unlink(missing_ok=True)
    assert not (shm_ring.SHM_DIR / writer.name).exists()


_END = """
import sys, time
import numpy as np
from jaxserve.distributed.step_channel import StepPublisher, StepSubscriber
port, role = int(sys.argv[1]), sys.argv[2]
if role == "leader":
    end = StepPublisher("127.0.0.1", port, num_followers=1, timeout_s=30)
    print("joined", end.shm_followers, flush=True)
    end.publish([np.arange(7)])
else:
    end = StepSubscriber("127.0.0.1", port, process_id=1, timeout_s=30)
    print("joined", int(end.on_shm), flush=True)
time.sleep(120)
"""


def _end_process(port: int, role: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", _END, str(port), role],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )


def test_a_dead_leader_ends_a_receive_waiting_on_the_ring():
    port = free_port_range()
    child = _end_process(port, "leader")
    lost = threading.Event()
    try:
        sub = StepSubscriber("127.0.0.1", port, 1, 30, on_leader_lost=lambda _: lost.set())
        assert child.stdout.readline() == "joined 1\n" and sub.on_shm
        assert sub.receive(timeout_s=10).arrays[0].tolist() == list(range(7))
        errors = []

        def wait_for_a_step() -> None:
            try:
                sub.receive()  # no timeout: only the lost leader ends it
            except ConnectionError as e:
                errors.append(e)

        waiting = threading.Thread(target=wait_for_a_step)
        waiting.start()
        time.sleep(0.2)
        child.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        waiting.join(5)
        assert not waiting.is_alive() and time.monotonic() - killed < 2.0
        # The watcher calls on_leader_lost right after it lets the receive go.
        assert lost.wait(2) and sub.leader_lost and "leader" in str(errors[0])
        sub.close()
    finally:
        child.kill()
        child.communicate()


def test_a_dead_follower_that_stopped_reading_does_not_block_the_leader():
    port = free_port_range()
    child = _end_process(port, "follower")
    lost = threading.Event()
    try:
        pub = StepPublisher("127.0.0.1", port, 1, 30, on_follower_lost=lambda _: lost.set())
        assert child.stdout.readline() == "joined 1\n" and pub.shm_followers == 1
        step = [np.zeros(100_000, np.uint8)]
        done = threading.Event()

        def publish_more_than_the_ring() -> None:
            for _ in range(3 * shm_ring.DEFAULT_CAPACITY // step[0].nbytes):
                pub.publish(step)
            done.set()

        thread = threading.Thread(target=publish_more_than_the_ring)
        thread.start()
        assert not done.wait(0.5)  # the follower reads nothing: the ring is full
        child.send_signal(signal.SIGKILL)
        assert lost.wait(5) and done.wait(5)
        thread.join(5)
        pub.close()
    finally:
        child.kill()
        child.communicate()

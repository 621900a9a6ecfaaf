"""A one-writer, many-reader byte stream in shared memory: the step channel's transport to
the followers on the leader's host (`jaxserve.distributed.step_channel`; offered to them
at join by `jaxserve.distributed.step_transport`).

The writer (the leader) appends each message once to a ring of bytes in a file under
/dev/shm that every local reader maps; each reader copies it out at its own pace. So
publishing costs the leader one copy and one wake-up whatever the number of readers,
where the TCP path writes (and, over loopback, runs the receiver's TCP stack) once per
follower. After vLLM's `MessageQueue` (vllm/distributed/device_communicators/
shm_broadcast.py: a shared-memory ring for the readers on the writer's node, ZeroMQ for
the others), with two differences: a byte stream (a message of any size passes, in
pieces if it is larger than the ring) instead of fixed-size chunks, and futexes instead
of spinning (vLLM's readers poll the ring, which on an oversubscribed host takes the
cores the other processes need).

Layout of the segment (little-endian; x86-64 Linux only, `available()`):

- a header of uint64 words: magic, capacity (bytes of the ring), reader slots, the write
  cursor (bytes ever written), a random token (a reader checks it: it mapped the
  writer's segment), then two uint32 futex words: `_SEQ` (bumped after every write; the
  readers wait on it) and `_WRITER_WAITING` (1 while the writer waits for room; a reader
  that frees room wakes it);
- one cache line per reader slot: its read cursor and whether it is active. The writer
  never lets the write cursor pass an active reader's cursor by more than the capacity,
  so no byte is overwritten before every active reader has copied it; a reader that is
  gone is dropped (`drop_reader`, from the membership watcher) and no longer holds the
  writer back;
- the ring, from `data_offset(reader slots)`.

Ordering: the writer copies the bytes, then stores the cursor, then bumps `_SEQ` and
wakes every waiter (`futex.wake_all`, one system call). A reader loads `_SEQ`, then
the cursor, and sleeps in FUTEX_WAIT only while `_SEQ` still holds what it loaded: the
kernel compares it under the futex lock, so a wake-up between the two is never lost.
x86-64 keeps stores in order and loads in order (TSO), so plain aligned NumPy loads and
stores suffice. The writer's wait for room (a reader's store of its cursor, then its load
of `_WRITER_WAITING`, against the writer's store of that flag, then its loads of the
cursors) is not ordered so (a store may pass a later load): a wake-up lost there costs
at most `_ROOM_WAIT_S`. Every wait is bounded, so that the caller can also watch for a
lost peer.

The segment is a plain file (not `multiprocessing.shared_memory`, whose resource tracker
would unlink it when any process exits): named `jaxserve-step-<writer pid>-<random>`,
unlinked by the writer once every reader has attached (`unlink`), and at creation the
writer removes the segments of writers that no longer run (a crash before the unlink).
"""

from __future__ import annotations

import mmap
import os
import secrets
import time
from pathlib import Path

import numpy as np

from jaxserve.distributed import futex

SHM_DIR = Path("/dev/shm")
_PREFIX = "jaxserve-step-"
_MAGIC = 0x6A78_7374_6570_3031  # "jxstep01"
# uint64 words of the header.
_W_MAGIC, _W_CAPACITY, _W_READERS, _W_CURSOR, _W_TOKEN = range(5)
# uint32 futex words, as indices into the header viewed as uint32 (bytes 48 and 56).
_SEQ, _WRITER_WAITING = 12, 14
_READER_OFFSET = 64  # then one 64-byte line per reader: cursor, active
_LINE_WORDS = 8
# 2 MiB: 30 steps of 68 KB ahead of the slowest reader; a larger message passes in pieces.
DEFAULT_CAPACITY = 2 << 20

# Longest single sleep of a waiting reader or writer: each wait re-checks its stop
# condition (a lost peer, a deadline) at least this often.
_READ_WAIT_S = 0.05
_ROOM_WAIT_S = 0.001
# A reader may poll the ring this long before it sleeps in FUTEX_WAIT (an alternative
# measured with scripts/bench_step_agreement.py; 0, the default: it sleeps at once, as
# polling takes the core that another process of an oversubscribed host needs).
SPIN_ENV = "JAXSERVE_STEP_RING_SPIN_US"


def available() -> bool:
    """Whether this host can run the ring: Linux x86-64 (the futex system call's number
    and TSO are assumed) with a writable /dev/shm."""
    return futex.SUPPORTED and SHM_DIR.is_dir() and os.access(SHM_DIR, os.W_OK)


class _Segment:
    """A mapped segment: the header as uint64 and uint32 words, the reader lines, the ring."""

    def __init__(self, fd: int, size: int):
        # Every page mapped now (not faulted in on the first pass over the ring: measured,
        # about 2x the write's time in that pass).
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        self._map = mmap.mmap(fd, size, flags)
        os.close(fd)
        base = np.frombuffer(self._map, np.uint8)
        self.words = base[:_READER_OFFSET].view(np.uint64)
        self.words32 = base[:_READER_OFFSET].view(np.uint32)
        self.capacity = int(self.words[_W_CAPACITY])
        readers = int(self.words[_W_READERS])
        self.lines = base[_READER_OFFSET : data_offset(readers)].view(np.uint64)
        # The bytes are copied through memoryviews: a NumPy slice assignment costs a few
        # us more per call (measured: 35 against 14 us to write and read a 19-part step).
        self.ring = memoryview(self._map)[data_offset(readers) :][: self.capacity]
        self.seq_address = self.words32.ctypes.data + 4 * _SEQ
        self.waiting_address = self.words32.ctypes.data + 4 * _WRITER_WAITING

    def close(self) -> None:
        self.ring.release()
        self.words = self.words32 = self.lines = self.ring = None
        self._map.close()


def data_offset(num_readers: int) -> int:
    """Byte offset of the ring: after the header and the reader lines, page-aligned."""
    end = _READER_OFFSET + 8 * _LINE_WORDS * num_readers
    return -(-end // mmap.PAGESIZE) * mmap.PAGESIZE


class RingWriter:
    """The writer's end: creates the segment with `num_readers` reader slots (0-based;
    inactive until `activate`) and a ring of `capacity` bytes."""

    def __init__(self, num_readers: int, capacity: int = DEFAULT_CAPACITY):
        remove_stale_segments()
        self.token = secrets.randbits(63)
        self.name = f"{_PREFIX}{os.getpid()}-{secrets.token_hex(6)}"
        self.path = SHM_DIR / self.name
        size = data_offset(num_readers) + capacity
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, size)  # the pages, now (no SIGBUS later if /dev/shm is full)
            header = np.array([_MAGIC, capacity, num_readers, 0, self.token], np.uint64)
            os.pwrite(fd, header.tobytes(), 0)
            self._seg = _Segment(fd, size)
        except BaseException:
            self.unlink()
            raise
        self.num_readers = num_readers
        self._cursor = 0
        self._active: set[int] = set()

    def activate(self, reader: int) -> None:
        """Count reader `reader` (it attached, before the first write) from now on."""
        self._seg.lines[reader * _LINE_WORDS : reader * _LINE_WORDS + 2] = (self._cursor, 1)
        self._active.add(reader)

    def drop_reader(self, reader: int) -> None:
        """Stop waiting for reader `reader` (it is gone); safe from another thread."""
        self._active.discard(reader)
        self._seg.lines[reader * _LINE_WORDS + 1] = 0
        futex.wake_all(self._seg.waiting_address)

    @property
    def active_readers(self) -> int:
        return len(self._active)

    def write(self, parts) -> None:
        """Append the bytes-like `parts` one after the other for every active reader, then
        wake them (once, unless the ring fills up on the way). Blocks while the slowest
        active reader has not copied what the ring must overwrite."""
        seg, capacity = self._seg, self._seg.capacity
        cursor, room = self._cursor, 0
        # One part: a join costs less than a copy per part (measured).
        joined = parts[0] if len(parts) == 1 else b"".join(parts)
        with memoryview(joined) as view:
            src = view.cast("B") if view.nbytes else view
            done = 0
            while done < src.nbytes:
                if room == 0:
                    room = capacity - (cursor - self._slowest_cursor())
                    if room == 0:
                        self._publish(cursor)  # let the readers drain what is there
                        self._wait_for_room()
                        continue
                n = min(room, src.nbytes - done)
                start = cursor % capacity
                first = min(n, capacity - start)
                seg.ring[start : start + first] = src[done : done + first]
                seg.ring[: n - first] = src[done + first : done + n]
                done += n
                cursor += n
                room -= n
        self._publish(cursor)

    def _publish(self, cursor: int) -> None:
        """Make the bytes up to `cursor` readable and wake every waiting reader."""
        if cursor == self._cursor:
            return
        seg = self._seg
        self._cursor = cursor
        seg.words[_W_CURSOR] = cursor
        seg.words32[_SEQ] = (int(seg.words32[_SEQ]) + 1) & 0xFFFF_FFFF
        futex.wake_all(seg.seq_address)

    def _slowest_cursor(self) -> int:
        lines = self._seg.lines
        return min((int(lines[r * _LINE_WORDS]) for r in list(self._active)), default=self._cursor)

    def _wait_for_room(self) -> None:
        seg = self._seg
        seg.words32[_WRITER_WAITING] = 1
        if self._cursor - self._slowest_cursor() >= seg.capacity:
            futex.wait(seg.waiting_address, 1, _ROOM_WAIT_S)
        seg.words32[_WRITER_WAITING] = 0

    def unlink(self) -> None:
        """Remove the segment's name (the mappings stay); idempotent."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def close(self) -> None:
        self.unlink()
        if getattr(self, "_seg", None) is not None:
            self._seg.close()
            self._seg = None


class RingReader:
    """A reader's end: maps segment `name` as reader slot `reader`.

    Raises:
        OSError: no such segment here (the writer runs on another host, or in another
            /dev/shm namespace).
        ValueError: a segment of that name whose token or layout is not the writer's.
    """

    def __init__(self, name: str, token: int, reader: int):
        if not name.startswith(_PREFIX) or "/" in name:
            raise ValueError(f"not a step ring segment: {name!r}")
        fd = os.open(SHM_DIR / name, os.O_RDWR)
        self._seg = _Segment(fd, os.fstat(fd).st_size)
        magic, readers, their_token = (
            int(self._seg.words[w]) for w in (_W_MAGIC, _W_READERS, _W_TOKEN)
        )
        if magic != _MAGIC or their_token != token:
            self.close()
            raise ValueError(f"segment {name} is not the writer's (token differs)")
        if not 0 <= reader < readers:
            self.close()
            raise ValueError(f"reader slot {reader} out of range")
        self._line = reader * _LINE_WORDS
        self._cursor = 0
        self._spin_s = float(os.environ.get(SPIN_ENV) or 0) / 1e6

    def read_into(self, buffer, deadline: float | None, should_stop) -> None:
        """Fill `buffer` (a writable bytes-like) with the next bytes of the stream, waiting
        for the writer as needed.

        Raises:
            TimeoutError: `deadline` (time.monotonic()) passed first.
            ConnectionError: `should_stop()` became true while waiting (checked at least
                every _READ_WAIT_S).
        """
        view = memoryview(buffer)
        dst = view.cast("B") if view.nbytes else view
        seg, capacity = self._seg, self._seg.capacity
        done, spin_until = 0, None
        while done < dst.nbytes:
            seq = int(seg.words32[_SEQ])
            available = int(seg.words[_W_CURSOR]) - self._cursor
            if available == 0 and self._spin_s:
                spin_until = spin_until or time.perf_counter() + self._spin_s
                if time.perf_counter() < spin_until:
                    continue
            if available == 0:
                if should_stop():
                    raise ConnectionError("step ring: the writer is gone")
                wait = _READ_WAIT_S
                if deadline is not None:
                    wait = min(wait, deadline - time.monotonic())
                    if wait <= 0:
                        raise TimeoutError("step ring: nothing written before the deadline")
                futex.wait(seg.seq_address, seq, wait)
                continue
            n = min(available, dst.nbytes - done)
            start = self._cursor % capacity
            first = min(n, capacity - start)
            dst[done : done + first] = seg.ring[start : start + first]
            dst[done + first : done + n] = seg.ring[: n - first]
            done += n
            self._cursor += n
            seg.lines[self._line] = self._cursor
            if seg.words32[_WRITER_WAITING]:
                futex.wake_all(seg.waiting_address)

    def wake(self) -> None:
        """Wake every reader waiting on this segment (they re-check their stop condition)."""
        if self._seg is not None:
            futex.wake_all(self._seg.seq_address)

    def close(self) -> None:
        if self._seg is not None:
            self._seg.close()
            self._seg = None


def remove_stale_segments() -> list[str]:
    """Unlink the segments of writers that no longer run (named by their pid); return
    their names."""
    removed = []
    for path in SHM_DIR.glob(f"{_PREFIX}*"):
        pid = path.name[len(_PREFIX) :].partition("-")[0]
        if pid.isdigit() and not _alive(int(pid)):
            try:
                path.unlink()
                removed.append(path.name)
            except OSError:
                pass
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True

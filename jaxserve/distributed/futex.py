"""Futexes between processes: sleep on a 32-bit word of shared memory until another
process changes it and wakes the sleepers (Linux x86-64, through libc's `syscall`).

The wake-up primitive of the step channel's shared-memory ring
(`jaxserve.distributed.shm_ring`): its readers sleep on the ring's sequence word, the
writer on its "waiting for room" word, instead of spinning. Not FUTEX_PRIVATE_FLAG: the
word is shared between processes. Only the system call's number is per architecture;
x86-64 is the one known here (`SUPPORTED`).
"""

from __future__ import annotations

import ctypes
import platform

_SYS_FUTEX = {"x86_64": 202}.get(platform.machine())
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1
_INT_MAX = 2**31 - 1


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


_libc = ctypes.CDLL(None, use_errno=True) if _SYS_FUTEX is not None else None
# Whether this machine has the futex system call here.
SUPPORTED = _libc is not None


def wait(address: int, expected: int, timeout_s: float) -> None:
    """Sleep while the uint32 at `address` is `expected`, at most `timeout_s` (ctypes
    releases the GIL). Returns on a wake-up, a timeout, a signal, or at once (EAGAIN)
    if the word has changed: the kernel compares it under the futex lock, so a wake-up
    between the caller's load and this call is never lost."""
    ts = _Timespec(int(timeout_s), int((timeout_s % 1) * 1e9))
    _libc.syscall(
        _SYS_FUTEX,
        ctypes.c_void_p(address),
        _FUTEX_WAIT,
        ctypes.c_uint32(expected),
        ctypes.byref(ts),
        None,
        0,
    )


def wake_all(address: int) -> None:
    """Wake every process sleeping on the uint32 at `address` (one system call)."""
    _libc.syscall(_SYS_FUTEX, ctypes.c_void_p(address), _FUTEX_WAKE, _INT_MAX, None, None, 0)

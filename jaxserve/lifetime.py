"""Child-process lifetime: every child of `jaxserve serve` exits when its parent dies,
and the parent learns at once when a child exits.

Two mechanisms, because either alone has a gap: Linux `prctl(PR_SET_PDEATHSIG)` delivers
a signal the moment the parent dies (but only on Linux, and only when the thread that
spawned the child exits, so the launcher spawns from its main thread), and a watchdog
thread (portable, covers a parent that died before prctl ran) that blocks on the
parent's pidfd (Linux >= 5.3: readable once it exits), or else polls `os.getppid()`.
The parent's side (`wait_any_exit`) blocks on its children's pidfds too: an idle server
wakes for nothing. No JAX here: every process imports this.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import select
import signal
import subprocess
import sys
import threading
from collections.abc import Sequence

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def die_with_parent(parent_pid: int, *, poll_interval_s: float = 0.5) -> None:
    """Make this process exit when the process `parent_pid` (its parent) dies.

    parent_pid: the pid the parent passed down (compared with os.getppid(): a re-parented
        child sees another ppid).
    poll_interval_s: how often the watchdog thread checks, in seconds, where it cannot
        block on the parent's pidfd.
    """
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) != 0:
            logger.warning("prctl(PR_SET_PDEATHSIG) failed: errno %d", ctypes.get_errno())
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)

    def watch() -> None:
        # os._exit: a dying parent leaves nothing worth flushing, and sys.exit from a
        # thread would not end the process.
        try:
            fd = os.pidfd_open(parent_pid)
        except (AttributeError, OSError):
            fd = None  # no pidfd (or the parent is gone: the check below sees it)
        if fd is not None and os.getppid() == parent_pid:  # the pidfd is our parent's
            poller = select.poll()  # not select.select: fds above 1023 are common here
            poller.register(fd, select.POLLIN)
            poller.poll()  # blocks until the parent exits
            os._exit(1)
        stop = threading.Event()
        while not stop.wait(poll_interval_s):
            if os.getppid() != parent_pid:
                os._exit(1)

    threading.Thread(target=watch, name="parent-watchdog", daemon=True).start()


def ignore_sigint() -> None:
    """Ignore Ctrl-C in a child: the terminal sends SIGINT to the whole process group, and
    the launcher alone decides the order of shutdown (it sends SIGTERM)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


async def wait_any_exit(processes: Sequence[subprocess.Popen], poll_interval_s: float) -> int:
    """Wait until one of `processes` exits (and reap it); returns its index.

    Blocks on each process's pidfd in the running event loop (Linux >= 5.3); where there
    is none (or the loop cannot watch it), checks every `poll_interval_s` seconds."""
    loop = asyncio.get_running_loop()
    exited = asyncio.Event()
    fds: list[int] = []
    try:
        for process in processes:
            fds.append(os.pidfd_open(process.pid))
            loop.add_reader(fds[-1], exited.set)
    except (AttributeError, OSError, NotImplementedError):  # no pidfd, or reaped: poll
        _close_pidfds(loop, fds)
        fds = []
    try:
        while True:
            for i, process in enumerate(processes):
                if process.poll() is not None:
                    return i
            if fds:
                await exited.wait()
                exited.clear()
            else:
                await asyncio.sleep(poll_interval_s)
    finally:
        _close_pidfds(loop, fds)


def _close_pidfds(loop: asyncio.AbstractEventLoop, fds: list[int]) -> None:
    for fd in fds:
        loop.remove_reader(fd)
        os.close(fd)

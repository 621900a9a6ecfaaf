"""Child-process lifetime: every child of `jaxserve serve` exits when its parent dies.

Two mechanisms, because either alone has a gap: Linux `prctl(PR_SET_PDEATHSIG)` delivers
a signal the moment the parent dies (but only on Linux, and only when the thread that
spawned the child exits, so the launcher spawns from its main thread), and a watchdog
thread polls `os.getppid()` (portable, covers a parent that died before prctl ran).
No JAX here: every process imports this.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import threading

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def die_with_parent(parent_pid: int, *, poll_interval_s: float = 0.5) -> None:
    """Make this process exit when the process `parent_pid` (its parent) dies.

    parent_pid: the pid the parent passed down (compared with os.getppid(): a re-parented
        child sees another ppid).
    poll_interval_s: how often the watchdog thread checks, in seconds.
    """
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) != 0:
            logger.warning("prctl(PR_SET_PDEATHSIG) failed: errno %d", ctypes.get_errno())
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)

    def watch() -> None:
        stop = threading.Event()
        while not stop.wait(poll_interval_s):
            if os.getppid() != parent_pid:
                # os._exit: a dying parent leaves nothing worth flushing, and sys.exit
                # from a thread would not end the process.
                os._exit(1)

    threading.Thread(target=watch, name="parent-watchdog", daemon=True).start()


def ignore_sigint() -> None:
    """Ignore Ctrl-C in a child: the terminal sends SIGINT to the whole process group, and
    the launcher alone decides the order of shutdown (it sends SIGTERM)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)

"""The private folders that hold a server's ZeroMQ ipc:// sockets.

`jaxserve serve` makes one per run under the temp directory, named after its pid
(`jaxserve-<pid>-XXXXXXXX`), and removes it on exit. A server killed with SIGKILL cannot
remove its own: the next `serve` removes every such folder of this user whose pid no
longer runs (`remove_dead_socket_dirs`). A folder whose pid is alive (even if reused by
another program) is left alone, so nothing in use is ever removed.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile
from pathlib import Path

logger = logging.getLogger("jaxserve")

PREFIX = "jaxserve-"
_NAME = re.compile(rf"^{PREFIX}(\d+)-[A-Za-z0-9_]+$")


def make_socket_dir() -> str:
    """A new private folder (mode 0700) for this process's sockets; keep its path short
    (unix socket paths are limited to ~107 bytes)."""
    return tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def remove_dead_socket_dirs(root: str | None = None) -> list[str]:
    """Remove the socket folders (of this user, under `root`, default the temp
    directory) left by servers that no longer run. Returns the removed paths."""
    removed = []
    base = Path(root or tempfile.gettempdir())
    try:
        entries = list(base.iterdir())
    except OSError:
        return removed
    uid = os.getuid()
    for path in entries:
        m = _NAME.match(path.name)
        if m is None or int(m.group(1)) == os.getpid():
            continue
        try:
            if not path.is_dir() or path.is_symlink() or path.stat().st_uid != uid:
                continue
        except OSError:
            continue
        if not _alive(int(m.group(1))):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(str(path))
    if removed:
        logger.info("removed %d socket folder(s) of servers that died", len(removed))
    return removed

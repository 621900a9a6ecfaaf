"""Holding back a start's log lines (`jaxserve.logs.configure_logging(hold_start=True)`),
and printing those of every process of `jaxserve serve` in timestamp order.

Why hold: a start that fails prints only its one-line cause (README, "Serving"), not the
lines of the steps that went well before it. Lines below ERROR are held until the start
succeeds (`start_succeeded`), fails (`drop`: only the held warnings are printed, the cause after
them) or `hold_s` seconds have passed (`let_go`: a long start still shows its progress).
Warnings are held too, so that a process prints its lines in the order they were logged.
A warning about what the running server will do (no chat template, an address open to
anyone) is logged with `extra=IF_SERVING`: a failed start forgets it as an INFO line, so
that it does not read as the failure's cause.

Why hand over: each process held its own lines and printed them when it was ready, so
the engine's block (it is ready first) came before the frontend's older lines. Now the
frontend collects (`collect`, in the folder of its children's sockets, named to them by
START_LOG_DIR_ENV): a child that is ready writes its held lines to `<pid>.start-log`
there (`start_succeeded`) and holds what it logs next until the frontend has printed them; the
frontend, when ready, takes every such file and prints them with its own, ordered by
their timestamps (`record.created`). A child that finds the frontend already released
(a replica ready after the first) prints its own, as does one whose file nobody takes
within HANDOVER_WAIT_S. No JAX here.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from pathlib import Path

START_LOG_DIR_ENV = "JAXSERVE_START_LOG_DIR"
# Created by the collecting frontend once it printed the start's lines: a child ready
# later prints its own.
RELEASED_MARKER = "start-logs.released"
# A child whose handed-over lines nobody took within this many seconds prints them.
HANDOVER_WAIT_S = 5.0
_POLL_S = 0.02

# `logger.warning(..., extra=IF_SERVING)`: a warning that only a server that starts
# needs (a failed start drops it with its INFO lines).
IF_SERVING = {"jaxserve_if_serving": True}

# One held line: (record.created in s since the epoch, the level a failed start weighs
# it at (INFO for an IF_SERVING warning), the formatted text).
Line = tuple[float, int, str]


class StartLogHold(logging.Handler):
    """Passes records to `target` (a StreamHandler), holding back those below ERROR until
    `start_succeeded`, `let_go`, `drop` or `hold_s` seconds (`let_go`). Held records never reach
    the stream at exit: a start that ends without either ends quietly, as a failed one
    should. handover_dir: this process is a child of a collecting frontend (see the
    module docstring); collect() makes it the collector instead."""

    def __init__(
        self, target: logging.StreamHandler, hold_s: float, handover_dir: str | None = None
    ) -> None:
        super().__init__()
        self._target = target
        self._held: list[logging.LogRecord] | None = []
        self._handover_dir = Path(handover_dir) if handover_dir else None
        self._collect_dir: Path | None = None
        self._timer = threading.Timer(hold_s, self.let_go)
        self._timer.daemon = True
        self._timer.start()

    def emit(self, record: logging.LogRecord) -> None:  # under self.lock (Handler.handle)
        if self._held is not None and record.levelno < logging.ERROR:
            self._held.append(record)
        else:
            self._target.handle(record)

    def collect(self, folder: str) -> None:
        """Be the collector of the children started with START_LOG_DIR_ENV=folder."""
        self._collect_dir, self._handover_dir = Path(folder), None

    # Not `release`: logging.Handler's release() unlocks its lock.
    def start_succeeded(self) -> None:
        """The start succeeded: hand the held lines over to the collector, or print them."""
        if self._handover_dir is None or not self._hand_over(self._handover_dir):
            self.let_go()

    def let_go(self) -> None:
        self._end(send=True)

    def drop(self) -> None:
        self._end(send=False)

    def flush(self) -> None:
        self._target.flush()

    def _end(self, send: bool) -> None:
        """Print the held lines (all, or with send False the warnings only), the children's
        merged in when collecting, then pass everything on."""
        self._timer.cancel()
        with self.lock:
            held, self._held = self._held, None
            if held is None:
                return
            lines = [self._line(r) for r in held]
            taken: list[Path] = []
            if self._collect_dir is not None:
                with contextlib.suppress(OSError):  # gone: a failed start cleaned it up
                    for path in sorted(self._collect_dir.glob("**/*.start-log")):
                        if (mine := _take(path)) is not None:
                            taken.append(mine)
                            lines += _read(mine)
            lines.sort(key=lambda line: line[0])  # stable: one process's order kept
            self._write([line for line in lines if send or line[1] >= logging.WARNING])
            for path in taken:  # gone: a child waiting on it may print what came next
                path.unlink(missing_ok=True)
            if self._collect_dir is not None:
                # Only now: a child that sees it (and its file still there) was not taken
                # above, and prints its own lines after these.
                with contextlib.suppress(OSError):
                    (self._collect_dir / RELEASED_MARKER).touch()

    def _line(self, record: logging.LogRecord) -> Line:
        level = logging.INFO if getattr(record, "jaxserve_if_serving", False) else record.levelno
        return record.created, level, self._target.format(record)

    def _write(self, lines: list[Line]) -> None:
        if not lines:
            return
        self._target.acquire()
        try:
            stream = self._target.stream
            for _, _, text in lines:
                stream.write(text + self._target.terminator)
            stream.flush()
        except (OSError, ValueError):  # a closed stderr: nothing to tell
            pass
        finally:
            self._target.release()

    def _hand_over(self, folder: Path) -> bool:
        """Write the held lines to the collector's folder and hold on until it has printed
        them (a thread watches); False when it already released (print them here)."""
        if (folder / RELEASED_MARKER).exists():
            return False
        self._timer.cancel()
        path = folder / f"{os.getpid()}.start-log"
        with self.lock:
            if self._held is None:
                return True
            lines, self._held = [self._line(r) for r in self._held], []
            try:
                tmp = path.with_suffix(".tmp")
                tmp.write_text("".join(json.dumps(line) + "\n" for line in lines))
                os.replace(tmp, path)  # whole, never half-written, when the collector looks
            except OSError:  # the folder is gone: print them here
                self._write(lines)
                return False
        watcher = threading.Thread(target=self._wait_collected, args=(path,), daemon=True)
        watcher.start()
        return True

    def _wait_collected(self, path: Path) -> None:
        """Until the collector printed `path` (it and its .taken are gone); if instead
        the collector released without it, or HANDOVER_WAIT_S pass, print it here.
        Then print what was held since."""
        taken = path.with_name(path.name + ".taken")
        released = path.parent / RELEASED_MARKER
        deadline = time.monotonic() + HANDOVER_WAIT_S
        while path.exists() or taken.exists():
            late = released.exists() and path.exists()
            if (late or time.monotonic() >= deadline) and (mine := _take(path)) is not None:
                self._write(_read(mine))
                mine.unlink(missing_ok=True)
                break
            if time.monotonic() >= deadline:
                break
            time.sleep(_POLL_S)
        self.let_go()


def _take(path: Path) -> Path | None:
    """`path` renamed to path.taken, or None if another process took it first."""
    mine = path.with_name(path.name + ".taken")
    try:
        os.rename(path, mine)
    except OSError:
        return None
    return mine


def _read(path: Path) -> list[Line]:
    try:
        return [tuple(json.loads(text)) for text in path.read_text().splitlines() if text]
    except (OSError, ValueError):
        return []

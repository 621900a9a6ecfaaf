"""Logging set-up shared by every jaxserve process (frontend, engine, detokenizer, follower).

No JAX here: the frontend and the detokenizer import this.
"""

from __future__ import annotations

import logging
import os

from jaxserve.start_log_hold import START_LOG_DIR_ENV, StartLogHold

# Loggers of libraries whose INFO lines are noise at every start, raised to WARNING:
# jax._src.xla_bridge logs "Unable to initialize backend 'tpu'" (and 'cuda' on a CPU-only
# machine) while JAX looks for its platforms; Orbax logs through absl's logger ("absl",
# some modules "orbax...") a dozen lines (its version, handlers, read throughput) each
# time `jaxserve serve` restores a `jaxserve convert` folder.
QUIET_LOGGERS = ("jax._src.xla_bridge", "absl", "orbax")


# A start's lines below ERROR are held back (`hold_start`) until the start succeeds
# (`release_start_logs`), fails (`drop_start_logs`: its one-line cause says it all, after
# the held warnings), or this many seconds have passed: a long start (loading, compiling)
# still shows its progress, and a start that fails within them prints only its cause
# (README, "Serving"). jaxserve.start_log_hold has the why and the how; `jaxserve serve`'s
# frontend prints its children's held lines with its own, in timestamp order.
START_LOG_HOLD_ENV = "JAXSERVE_START_LOG_HOLD_S"
DEFAULT_START_LOG_HOLD_S = 10.0

_HOLD: StartLogHold | None = None


def _hold_seconds() -> float:
    try:
        return float(os.environ.get(START_LOG_HOLD_ENV, DEFAULT_START_LOG_HOLD_S))
    except ValueError:
        return DEFAULT_START_LOG_HOLD_S


def configure_logging(level: str, process_name: str, hold_start: bool = False) -> None:
    """Log to stderr at `level` ("INFO", "debug", ...), each line tagged `[process_name]`;
    the `QUIET_LOGGERS` log only warnings and errors (unless `level` is DEBUG, which keeps
    everything for debugging).

    hold_start: hold back the lines below ERROR of this process's start (see
    `START_LOG_HOLD_ENV`; never at DEBUG, nor with a hold of 0 s) until
    `release_start_logs` or `drop_start_logs`.

    Raises ValueError if `level` is not a logging level name.
    """
    global _HOLD
    level = level.upper()
    root = logging.getLogger()
    before = list(root.handlers)
    logging.basicConfig(
        level=level, format=f"%(asctime)s %(levelname)s [{process_name}] %(message)s"
    )
    if logging.getLevelName(level) != logging.DEBUG:
        for name in QUIET_LOGGERS:
            logging.getLogger(name).setLevel(logging.WARNING)
        added = [h for h in root.handlers if h not in before]
        hold_s = _hold_seconds()
        if hold_start and hold_s > 0 and len(added) == 1 and _HOLD is None:
            _HOLD = StartLogHold(added[0], hold_s, os.environ.get(START_LOG_DIR_ENV))
            root.removeHandler(added[0])
            root.addHandler(_HOLD)


def collect_start_logs(folder: str) -> None:
    """This process (the frontend) prints the held start lines of the children it starts
    after this call with its own, in timestamp order: they hand them over in `folder`
    (a folder of this run only; the children learn it from START_LOG_DIR_ENV)."""
    if _HOLD is not None:
        _HOLD.collect(folder)
        os.environ[START_LOG_DIR_ENV] = folder


def release_start_logs() -> None:
    """The start succeeded: print the held lines (in timestamp order; a child hands them
    to the collecting frontend instead) and hold no more."""
    if _HOLD is not None:
        _HOLD.start_succeeded()


def drop_start_logs() -> None:
    """The start failed and its one-line cause follows: print the held warnings, forget
    the rest."""
    if _HOLD is not None:
        _HOLD.drop()


# Set by `jaxserve serve` in each child's environment: the file where a child that fails
# to start writes its one-line cause, which the parent prints as its last line.
START_ERROR_FILE_ENV = "JAXSERVE_START_ERROR_FILE"

_PLAIN_ERRORS = (ValueError, RuntimeError, OSError)

# A failed start's exit code (README, "Serving"): 2 for a bad setting, 1 when the system
# refused. A bad setting is a ValueError, ours naming the flag or file: a flag out of
# range, a mesh that cannot hold the model or has too few devices, a model folder whose
# files are broken (a truncated or incomplete checkpoint, like a broken config.json); the
# system refusing is everything else (a busy port, memory, a device or runtime error).
EXIT_BAD_SETTING = 2
EXIT_SYSTEM_REFUSED = 1


def start_failure_code(error: BaseException) -> int:
    """The exit code of a start that failed with `error`: EXIT_BAD_SETTING for a
    ValueError, else EXIT_SYSTEM_REFUSED."""
    return EXIT_BAD_SETTING if isinstance(error, ValueError) else EXIT_SYSTEM_REFUSED


def describe_error(error: BaseException) -> str:
    """One line for an exception: its message's first line (ValueError / RuntimeError /
    OSError messages, ours among them, name the field; others get their type name first,
    e.g. "KeyError: 'x'")."""
    lines = str(error).strip().splitlines()
    message = lines[0].strip() if lines else ""
    if not message:
        return type(error).__name__
    if isinstance(error, _PLAIN_ERRORS):
        return message
    return f"{type(error).__name__}: {message}"


# Callables that may explain a start-up failure better than the exception does (a
# follower asks whether process 0 failed first: `add_start_failure_explainer`).
_EXPLAINERS: list = []


def add_start_failure_explainer(explain) -> None:
    """Register `explain() -> str | None`: a better one-line cause of a start-up failure
    in this process (e.g. "process 0 (the leader) failed to start: ..." where the
    exception only says that a collective lost its peer); None when it has none."""
    _EXPLAINERS.append(explain)


def report_start_failure(what: str, error: BaseException, logger: logging.Logger) -> str:
    """Report that `what` ("engine", "follower 2") failed to start, as one line.

    The line (`what: cause`) goes to the parent's start-error file when the parent set
    `START_ERROR_FILE_ENV` (it prints the line last, once, and exits with the code of
    `start_failure_code`, written on the file's second line), else to `logger` at ERROR.
    The traceback is logged only at DEBUG (`--log-level debug`). Returns the line.
    """
    line = f"{what} failed to start: {describe_error(error)}"
    for explain in _EXPLAINERS:
        better = explain()
        if better:
            line = better
            break
    if logger.isEnabledFor(logging.DEBUG):
        logger.debug("%s failed to start", what, exc_info=error)
    drop_start_logs()  # the line below says why; the start's INFO lines would bury it
    path = os.environ.get(START_ERROR_FILE_ENV)
    if path:
        try:
            with open(path, "w", encoding="utf-8") as f:
                f.write(f"{line}\n{start_failure_code(error)}\n")
            return line
        except OSError:
            pass  # the parent's folder is gone: log it here instead
    logger.error("%s", line)
    return line


def read_start_failure(path: str) -> str | None:
    """The line a child wrote with `report_start_failure`, or None."""
    return read_start_failure_code(path)[0]


def read_start_failure_code(path: str) -> tuple[str | None, int]:
    """The line a child wrote with `report_start_failure` (None if it wrote none) and the
    exit code it asks for (EXIT_SYSTEM_REFUSED when it gave none)."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().strip().splitlines()
    except OSError:
        return None, EXIT_SYSTEM_REFUSED
    code = EXIT_SYSTEM_REFUSED
    if len(lines) > 1 and lines[1].strip() == str(EXIT_BAD_SETTING):
        code = EXIT_BAD_SETTING
    return (lines[0].strip() or None) if lines else None, code


class ProgressLog:
    """A progress bar's logging equivalent (it reads the same in a terminal, a pipe and a
    log collector): `what: k/N unit (p%, t s)` lines at 0, then at each quarter of the
    total and at least every `interval_s` seconds between them. Thread-safe `advance`.
    """

    def __init__(
        self,
        logger: logging.Logger,
        what: str,
        total: int,
        unit: str = "",
        interval_s: float = 10.0,
    ) -> None:
        import threading
        import time

        self._time = time.monotonic
        self._lock = threading.Lock()
        self._logger, self._what, self._total, self._unit = logger, what, total, unit
        self._interval_s = interval_s
        self._done = 0
        self._start = self._last = self._time()
        self._quarters = 0  # quarters of the total reached at the last line
        self._emit()

    def advance(self, n: int = 1) -> None:
        with self._lock:
            self._done = min(self._done + n, self._total)
            now = self._time()
            quarters = 4 * self._done // self._total if self._total else 4
            if quarters > self._quarters or now - self._last >= self._interval_s:
                self._quarters, self._last = quarters, now
                self._emit()

    def _emit(self) -> None:
        pct = 100.0 * self._done / self._total if self._total else 100.0
        unit = f" {self._unit}" if self._unit else ""
        self._logger.info(
            "%s: %d/%d%s (%.0f%%, %.1f s)",
            self._what, self._done, self._total, unit, pct, self._time() - self._start,
        )  # fmt: skip

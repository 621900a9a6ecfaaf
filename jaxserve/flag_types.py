"""The argparse types of the command-line flags: each turns the text of one flag into a
checked value (an int in a range, a finite float, a fraction, a log level, ...) or a
usage error that names the flag and the range, raised before any process starts.
No JAX here.
"""

from __future__ import annotations

import argparse
import errno
import os
import tempfile
from pathlib import Path

from jaxserve.config import block_size_error


def _bounded_int(low: int, high: int | None, *, not_int: str, bound: str):
    """An argparse type: an int in [low, high] (high None: no upper bound). Text that is
    no int is the usage error "{not_int}: 'text'"; an int out of range is
    "must be {bound}, got {value}" (the wording is the caller's: see its two users)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{not_int}: {text!r}") from None
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"must be {bound}, got {value}")
        return value

    return parse


def int_at_least(low: int, high: int | None = None):
    """An argparse type: an int in [low, high], else a usage error naming the range."""
    bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
    return _bounded_int(low, high, not_int="not an integer", bound=bound)


PORT = int_at_least(0, 65535)
POSITIVE = int_at_least(1)


def block_size(text: str) -> int:
    """An argparse type: a KV block size the engine takes (`config.block_size_error`)."""
    value = POSITIVE(text)
    error = block_size_error(value)
    if error:
        raise argparse.ArgumentTypeError(error)
    return value


def model_name(text: str) -> str:
    """An argparse type: a non-empty model name (what clients send as `model`)."""
    if not text.strip():
        raise argparse.ArgumentTypeError(
            "must not be empty (clients name the model with it; leave the flag out to use "
            "the model id or folder name)"
        )
    return text


def _float(text: str, ok, bound: str, shown) -> float:
    """`text` as a float for which ok(value) holds. Text that is no number is the usage
    error "not a number: 'text'"; a value out of range is "must be {bound}, got {shown}"
    (shown: the text or the value, as each caller has always said it)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not ok(value):
        raise argparse.ArgumentTypeError(f"must be {bound}, got {shown(text, value)}")
    return value


def _text(text: str, value: float) -> str:
    return text


def _value(text: str, value: float) -> float:
    return value


def non_negative_float(text: str) -> float:
    """An argparse type: a finite float >= 0."""
    return _float(text, lambda v: 0.0 <= v < float("inf"), "a finite number >= 0", _text)


def positive_float(text: str) -> float:
    """An argparse type: a finite float > 0 (seconds of a timeout or a capture; NaN,
    inf, 0 and negatives are usage errors naming the flag, not a call that fails later)."""
    return _float(text, lambda v: 0.0 < v < float("inf"), "a finite number > 0", _text)


# The longest client deadline taken (about 11.6 days): gRPC's deadline clock overflows
# near 9.2e9 s and then fails the call at once with DEADLINE_EXCEEDED.
MAX_TIMEOUT_S = 1e6


def timeout_seconds(text: str) -> float:
    """An argparse type: a client deadline in seconds, in (0, MAX_TIMEOUT_S]."""
    return _float(text, lambda v: 0.0 < v <= MAX_TIMEOUT_S, f"in (0, {MAX_TIMEOUT_S:g}]", _text)


INT32 = (-(2**31), 2**31 - 1)
INT64 = (-(2**63), 2**63 - 1)


def int_within(low: int, high: int):
    """An argparse type: an int in [low, high], the range of the request field it fills
    (a proto int32 or int64), so that a value out of it is a usage error naming the flag
    and the range, as the HTTP API says it, not protobuf's "Value out of range"."""
    return _bounded_int(low, high, not_int="invalid int value", bound=f"within [{low}, {high}]")


def fraction_open(text: str) -> float:
    """An argparse type: a float in (0, 1]."""
    return _float(text, lambda v: 0.0 < v <= 1.0, "in (0, 1]", _value)


def fraction(text: str) -> float:
    """An argparse type: a float in [0, 1)."""
    return _float(text, lambda v: 0.0 <= v < 1.0, "in [0, 1)", _value)


_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def log_level(text: str) -> str:
    """An argparse type: a logging level name, any case."""
    if text.upper() not in _LOG_LEVELS:
        raise argparse.ArgumentTypeError(
            f"unknown log level {text!r}; expected one of {', '.join(_LOG_LEVELS)} (any case)"
        )
    return text.upper()


def check_writable(flag: str, path: str, *, folder: bool = False) -> None:
    """Raise ValueError("{flag}: cannot write ...") unless `path` can be written: a file
    (its parent folder is created) or, with `folder`, a folder (created). Called before a
    command's work, so that a bad output path ends it in one line, not in a traceback
    after the work is done. Probes by creating a file, since os.access says yes to root
    on folders such as /proc where nothing can be created; an existing file is opened
    for appending and left as it was, a probe file removed."""
    target = Path(path)
    try:
        if folder:
            target.mkdir(parents=True, exist_ok=True)
            tempfile.TemporaryFile(dir=target).close()
            return
        if target.is_dir():
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR))
        target.parent.mkdir(parents=True, exist_ok=True)
        existed = target.exists()
        with open(target, "a"):
            pass
        if not existed:
            target.unlink()
    except OSError as e:
        raise ValueError(f"{flag}: cannot write {path} ({e.strerror or e})") from None

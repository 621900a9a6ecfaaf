"""Profiling a running engine: a JAX profiler trace plus a host timeline of its loop.

`jaxserve profile` (observability/profile_rpc.py) asks the frontend, which sends the
engine a `ipc.ProfileRequest(out_dir, seconds)`. The engine loop starts a
`ProfileSession`: `jax.profiler.start_trace(out_dir)` (the XLA trace: TensorBoard / XProf
read `plugins/profile/*/*.xplane.pb`, Perfetto and chrome://tracing `*.trace.json.gz`),
and the host `Timeline` records the loop's phases (drain inputs, schedule, pack,
dispatch, wait for the device, outputs, send, poll) as Chrome trace events. After
`seconds` the loop stops the timeline and hands the rest to a thread, so that the loop
goes on stepping (and sending heartbeats) while `jax.profiler.stop_trace` collects and
writes the trace, which takes seconds (measured: over 60 s on the loaded 2-core machine,
long enough for the frontend to call a blocked engine stalled). The thread writes
`host_timeline.json` (chrome://tracing, ui.perfetto.dev), then `profile.json`, the
manifest the frontend waits for: the files, the window, the steps recorded, or the error
that stopped the capture. One capture at a time: the next waits until the manifest.

The timeline costs one `perf_counter` call and one attribute test per phase while no
capture runs (`TIMELINE.active` False). No JAX at module level.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path

logger = logging.getLogger("jaxserve.engine")

MANIFEST = "profile.json"
HOST_TIMELINE = "host_timeline.json"
MAX_SECONDS = 600.0
MAX_EVENTS = 2_000_000  # ~200 MB of JSON; past it the timeline stops recording


class Timeline:
    """Host-side spans of the engine loop, in Chrome trace event format (ph "X").

    `now()` is a timestamp (perf_counter seconds); `span(name, start)` records
    [start, now) when a capture is active (a span begun before the capture is clipped to
    its start), and does nothing otherwise."""

    def __init__(self) -> None:
        self.active = False
        self.events: list[tuple[str, float, float]] = []
        self._origin = 0.0

    now = staticmethod(time.perf_counter)

    def span(self, name: str, start: float) -> None:
        if self.active and len(self.events) < MAX_EVENTS:
            self.events.append((name, max(start, self._origin), time.perf_counter()))

    def start(self) -> None:
        self.events = []
        self._origin = time.perf_counter()
        self.active = True

    def stop(self) -> list[dict]:
        """End the capture; the Chrome trace events (microseconds from its start)."""
        self.active = False
        o = self._origin
        return [
            {"name": n, "ph": "X", "ts": (a - o) * 1e6, "dur": (b - a) * 1e6, "pid": 1,
             "tid": 1 if n in _LOOP_PHASES else 2, "cat": "engine"}
            for n, a, b in self.events
        ]  # fmt: skip


# Phases of the engine loop (thread 1 of the trace); inside a step (thread 2): schedule,
# pack, dispatch, wait for the device, outputs.
_LOOP_PHASES = frozenset({"drain inputs", "step", "send outputs", "poll (idle)"})

TIMELINE = Timeline()


class ProfileSession:
    """One capture: started by the engine loop on a `ProfileRequest`, `poll(now)`ed every
    loop turn, finished (files written) once its seconds are over.

    Args:
        out_dir: where the files go (created).
        seconds: capture length, in (0, MAX_SECONDS].
        jax_trace: whether to run jax.profiler too (False: the host timeline only, e.g.
            a mock engine without JAX).
    """

    def __init__(self, out_dir: str, seconds: float, jax_trace: bool = True) -> None:
        self.out = Path(out_dir)
        self.seconds = seconds
        self.jax_trace = jax_trace
        self.error: str | None = None
        self.steps = 0
        self._end = time.monotonic() + seconds
        self._started = time.time()
        try:
            if not 0 < seconds <= MAX_SECONDS:
                raise ValueError(f"seconds: must be in (0, {MAX_SECONDS:g}], got {seconds}")
            self.out.mkdir(parents=True, exist_ok=True)
            (self.out / MANIFEST).unlink(missing_ok=True)
            self._before = _trace_files(self.out)
            if jax_trace:
                import jax  # noqa: PLC0415 - the engine process only

                jax.profiler.start_trace(str(self.out))
        except Exception as e:  # noqa: BLE001 - a bad request must never stop the engine
            self.error = f"{type(e).__name__}: {e}"
            self._end = 0.0
            self.jax_trace = False
        TIMELINE.start()
        logger.info("profiling for %g s into %s", seconds, self.out)

    def due(self, now: float) -> bool:
        return now >= self._end

    @property
    def done(self) -> bool:
        """The manifest is written (or the capture was never stopped)."""
        return self._writer is not None and not self._writer.is_alive()

    _writer: threading.Thread | None = None
    _before: dict[Path, int] = {}  # the trace files already there at the start

    def stop(self) -> None:
        """End the capture: the timeline now, the JAX trace and the files in a thread."""
        events = TIMELINE.stop()
        self._writer = threading.Thread(
            target=self.finish, args=(events,), name="profile-writer", daemon=True
        )
        self._writer.start()

    def finish(self, events: list[dict] | None = None) -> dict:
        """Stop the JAX trace, write the files and the manifest (blocking); returns it."""
        if events is None:
            events = TIMELINE.stop()
        files = []
        if self.jax_trace:
            try:
                import jax  # noqa: PLC0415

                jax.profiler.stop_trace()
            except Exception as e:  # noqa: BLE001
                self.error = f"stop_trace: {type(e).__name__}: {e}"
        manifest = {"out_dir": str(self.out.resolve()), "seconds": self.seconds,
                    "started": self._started, "steps": self.steps, "error": self.error}  # fmt: skip
        try:
            if self.out.is_dir():
                timeline = self.out / HOST_TIMELINE
                timeline.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
                # This capture's files only: not an earlier capture's in the same folder
                # (the XLA trace goes to a new plugins/profile/<time>/ each time), nor
                # whatever else the folder holds (it walked all of --out, $HOME if given).
                before = self._before
                files = [str(timeline)] + sorted(
                    str(p) for p, mtime in _trace_files(self.out).items()
                    if before.get(p) != mtime
                )  # fmt: skip
            manifest["files"] = files
            manifest["host_timeline"] = str((self.out / HOST_TIMELINE).resolve())
            manifest["xplane"] = [f for f in files if f.endswith(".xplane.pb")]
            manifest["trace_json"] = [f for f in files if f.endswith(".trace.json.gz")]
            tmp = self.out / (MANIFEST + ".tmp")
            tmp.write_text(json.dumps(manifest, indent=1))
            os.replace(tmp, self.out / MANIFEST)  # whole, or not at all
        except OSError as e:
            logger.error("profile: cannot write %s: %s", self.out, e)
        logger.info("profile written to %s (%d steps)", self.out, self.steps)
        return manifest


def _trace_files(out: Path) -> dict[Path, int]:
    """The files under OUT/plugins/profile (where jax.profiler writes its traces) and their
    modification times (ns): those new or rewritten since a capture began are its own."""
    found = {}
    for p in (out / "plugins" / "profile").rglob("*"):
        try:
            if p.is_file():
                found[p] = p.stat().st_mtime_ns
        except OSError:
            pass
    return found

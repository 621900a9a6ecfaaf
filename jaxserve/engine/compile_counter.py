"""`CompileCounter`: the process-wide count of XLA compilations, through JAX's
monitoring events, split into warm-up compilations (the step shapes compiled at
start-up, some of them in the background while serving) and all others (which a healthy
engine never has after start-up).

Must not: compile anything itself.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import jax


class CompileCounter:
    """Counts XLA executables built in this process (persistent-cache hits included),
    through JAX's monitoring events. One listener for the process, installed once.

    count: compilations outside warm-up threads; warmup_count: those inside one (a thread
    that runs `warming_up()`: the start-up compilation of the step shapes, which with
    background compilation goes on while the engine serves, `engine.warmup`).
    """

    count = 0
    warmup_count = 0
    _installed = False
    _local = threading.local()

    @classmethod
    @contextlib.contextmanager
    def warming_up(cls) -> Iterator[None]:
        """Count this thread's compilations as warm-up, not in `count`, while inside."""
        outer = getattr(cls._local, "warmup", False)
        cls._local.warmup = True
        try:
            yield
        finally:
            cls._local.warmup = outer

    @classmethod
    def install(cls) -> None:
        if not cls._installed:
            jax.monitoring.register_event_duration_secs_listener(cls._on_event)
            cls._installed = True

    @classmethod
    def _on_event(cls, event: str, duration: float, **kwargs) -> None:
        if event == BACKEND_COMPILE_EVENT:
            if getattr(cls._local, "warmup", False):
                cls.warmup_count += 1
            else:
                cls.count += 1


# The event JAX records around every backend compilation (jax/_src/dispatch.py).
BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"

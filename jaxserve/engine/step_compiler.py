"""`StepCompiler`: the compiled executables of a model runner's step shapes.

Every executable is compiled ahead of time at start-up (`jax.jit(...).lower(...).compile()`,
as vLLM's tpu-inference precompiles its padded shapes); asking for any other shape raises
instead of compiling. Compilation can also run in the background while steps are served
(`engine.warmup`): a shape announced (`expect_shapes`) but not compiled yet makes the
step that needs it wait for its executable. What a shape lowers to (the step function,
its shardings and abstract arguments) is the runner's `lower` callable.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import jax

from jaxserve.engine.compile_counter import CompileCounter
from jaxserve.engine.step_shapes import StepShape
from jaxserve.logs import ProgressLog

logger = logging.getLogger(__name__)

# Tracing/lowering one step shape and compiling (or loading from the persistent cache)
# another never overlap: a CI run segfaulted inside jax's compilation-cache read
# (`get_executable_and_time`) while a second thread lowered, during a background
# compile. Compiles still run beside steps being served.
_XLA_LOCK = threading.Lock()


class CompilationStopped(RuntimeError):
    """`StepCompiler.compile_shapes` was stopped (its `stop` event) before it finished."""


class StepCompiler:
    """The executables of the step shapes, by shape.

    Args:
        lower: traces and lowers the step of one shape (called under the XLA lock).

    Attributes:
        num_compile_waits: steps that waited for their shape's compilation (`executable`;
            0 on the engine's leader process, by `engine.warmup`'s budget).
    """

    def __init__(self, lower: Callable[[StepShape], jax.stages.Lowered]):
        self._lower = lower
        self._executables: dict[StepShape, jax.stages.Compiled] = {}
        # Shapes being compiled (`compile_shapes`): their executables, once ready.
        self._pending: dict[StepShape, Future] = {}
        self.num_compile_waits = 0

    def compile_shapes(
        self,
        shapes: list[StepShape],
        max_workers: int | None = None,
        what: str = "compiling step shapes",
        progress: ProgressLog | None = None,
        stop: threading.Event | None = None,
    ) -> float:
        """Compile the step for `shapes`, in that order. Returns the seconds taken.

        Tracing runs in this thread (it is Python); each shape's XLA compilation starts
        as soon as it is traced, in parallel threads (they release the GIL),
        `max_workers` at a time (default: CPU count). Progress lines (`what`, or the
        caller's `progress` spanning several calls) count the shapes done. While it
        runs, `executable` of one of these shapes waits for it (the runner's
        `run_buffers` on a multi-process follower compiling in the background).

        stop: once set, no other shape starts tracing or compiling (the compilations
            under way finish); then CompilationStopped.

        Raises:
            CompilationStopped: `stop` was set before every shape was compiled.
            whatever tracing or compiling raises (the first failure; the others finish).
        """
        start = time.perf_counter()
        shapes = [s for s in shapes if s not in self._executables]
        if not shapes:
            return 0.0
        futures = {shape: self._pending.setdefault(shape, Future()) for shape in shapes}
        workers = max_workers or min(len(shapes), os.cpu_count() or 1)
        if progress is None:
            progress = ProgressLog(logger, what, len(shapes), "shapes")

        def check_stop() -> None:
            if stop is not None and stop.is_set():
                raise CompilationStopped("step compilation stopped")

        def compile_one(shape: StepShape, low: jax.stages.Lowered) -> None:
            try:
                check_stop()
                with CompileCounter.warming_up(), _XLA_LOCK:
                    exe = low.compile()
            except BaseException as e:
                if not futures[shape].done():
                    futures[shape].set_exception(e)
                raise
            self._executables[shape] = exe
            futures[shape].set_result(exe)
            progress.advance()

        try:
            with ThreadPoolExecutor(max_workers=workers) as pool:
                jobs = []
                for shape in shapes:
                    try:
                        check_stop()
                        with CompileCounter.warming_up(), _XLA_LOCK:
                            low = self._lower(shape)
                    except BaseException as e:
                        for f in futures.values():
                            if not f.done():
                                f.set_exception(e)
                        raise
                    jobs.append(pool.submit(compile_one, shape, low))
                for job in jobs:
                    job.result()
        finally:
            for shape in shapes:
                self._pending.pop(shape, None)
        return time.perf_counter() - start

    def expect_shapes(self, shapes: list[StepShape]) -> None:
        """Announce shapes a later `compile_shapes` will compile: until then
        `executable` of one waits for it instead of raising."""
        for shape in shapes:
            if shape not in self._executables:
                self._pending.setdefault(shape, Future())

    def fail_pending(self, error: BaseException) -> None:
        """End every announced, not compiled shape's wait with `error`."""
        for shape, future in list(self._pending.items()):
            if not future.done():
                future.set_exception(error)
            self._pending.pop(shape, None)

    def is_compiled(self, shape: StepShape) -> bool:
        """Whether `shape`'s executable is ready."""
        return shape in self._executables

    def executable(self, shape: StepShape) -> jax.stages.Compiled:
        """The executable of `shape`, waiting for it if it is announced or being compiled.

        Raises:
            RuntimeError: the shape was not compiled.
        """
        executable = self._executables.get(shape)
        if executable is None:
            pending = self._pending.get(shape)
            if pending is None:
                raise RuntimeError(f"step shape {shape} was not compiled; call compile_all()")
            # A multi-process follower ahead of its background compilation (the leader's
            # `WarmUp` budget never schedules a shape that is not compiled there).
            self.num_compile_waits += 1
            executable = pending.result()
        return executable

"""Stopping the background compilation at shutdown (WarmUp.stop, StepCompiler's `stop`):
no other shape starts, the one under way finishes, and the end is logged as a stop, not
as a compilation failure. A stand-in runner (no JAX compilation): a few seconds at most."""

from __future__ import annotations

import logging
import threading
from types import SimpleNamespace

from jaxserve.engine.step_compiler import CompilationStopped, StepCompiler
from jaxserve.engine.step_shapes import StepShape
from jaxserve.engine.warmup import WarmUp

TOKEN_BUCKETS = (8, 16, 32)


class _Lowered:
    """A stand-in for jax.stages.Lowered whose compile() blocks until `release` is set
    (after `started` is), then returns `result` (or raises it, an exception)."""

    def __init__(self, shape, started, release, result):
        self.shape, self.started, self.release, self.result = shape, started, release, result

    def compile(self):
        self.started.set()
        assert self.release.wait(10)
        if isinstance(self.result, BaseException):
            raise self.result
        return f"exe{self.shape}"


def _runner(lowered):
    """A stand-in ModelRunner: a plain and a full step per token bucket, no multi-step
    decode; `lowered(shape)` gives each shape's _Lowered."""
    shapes = [StepShape(t, t, h) for t in TOKEN_BUCKETS for h in (0, 64)]
    return SimpleNamespace(
        buckets=lambda: list(shapes),
        token_buckets=TOKEN_BUCKETS,
        rows_for=lambda t: t,
        builder=SimpleNamespace(decode_row_buckets=(), decode_steps=1),
        compiler=StepCompiler(lowered),
        run_once=lambda shapes: 0.0,
    )


def _scheduler():
    return SimpleNamespace(
        max_num_batched_tokens=TOKEN_BUCKETS[-1],
        max_num_seqs=TOKEN_BUCKETS[-1],
        num_decode_steps=1,
        enable_chunked_prefill=True,
    )


def test_compile_shapes_stops_before_the_next_shape():
    stop, release = threading.Event(), threading.Event()
    started = {s: threading.Event() for s in (StepShape(8, 8), StepShape(16, 16))}
    compiler = StepCompiler(lambda s: _Lowered(s, started[s], release, None))
    errors = []

    def compile_both():
        try:
            compiler.compile_shapes(list(started), max_workers=1, stop=stop)
        except BaseException as e:  # noqa: BLE001 - the test checks it
            errors.append(e)

    thread = threading.Thread(target=compile_both)
    thread.start()
    assert started[StepShape(8, 8)].wait(10)
    stop.set()
    release.set()
    thread.join(10)
    assert not thread.is_alive()
    assert len(errors) == 1 and isinstance(errors[0], CompilationStopped)
    # The shape under way finished; the next one never started compiling.
    assert compiler.is_compiled(StepShape(8, 8))
    assert not compiler.is_compiled(StepShape(16, 16))
    assert not started[StepShape(16, 16)].is_set()


def _background_warmup(result_of_second_tier):
    """A started WarmUp whose first tier compiled and whose background thread is inside
    the compilation of the second tier's first shape (it ends with
    `result_of_second_tier` once `release` is set). Returns (warmup, release)."""
    release, started = threading.Event(), threading.Event()
    first = threading.Event()
    first.set()

    def lowered(shape):
        if shape.num_tokens == TOKEN_BUCKETS[0]:
            return _Lowered(shape, threading.Event(), first, None)
        return _Lowered(shape, started, release, result_of_second_tier)

    warmup = WarmUp(_runner(lowered), _scheduler(), background=True, max_workers=2)
    warmup.start()
    assert warmup.ready_tokens == TOKEN_BUCKETS[0] and started.wait(10)
    return warmup, release


def test_stop_ends_the_background_compilation_without_an_error(caplog):
    # What JAX raised under a compilation at shutdown (seen in a multi-process stop).
    shutdown_error = RuntimeError("cannot schedule new futures after interpreter shutdown")
    warmup, release = _background_warmup(shutdown_error)
    with caplog.at_level(logging.INFO, logger="jaxserve.engine.warmup"):
        assert not warmup.stop(timeout=0.05)  # the compilation under way is still on
        release.set()
        assert warmup.stop(timeout=10)
    assert warmup.done.is_set() and warmup.ready_tokens == TOKEN_BUCKETS[0]
    assert warmup.num_compiled() == 2 and warmup.pending_shapes() == 0
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert any("stopped by the shutdown, 2 of 6" in r.getMessage() for r in caplog.records)


def test_a_failure_while_serving_is_still_an_error(caplog):
    warmup, release = _background_warmup(RuntimeError("out of memory"))
    with caplog.at_level(logging.INFO, logger="jaxserve.engine.warmup"):
        release.set()
        assert warmup.wait(10)
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "failed at 16 tokens" in errors[0]
    assert "out of memory" in errors[0] and isinstance(warmup.error, RuntimeError)
    assert warmup.stop(timeout=10)  # no thread left: stop is a no-op


def test_stop_without_a_background_thread_returns_at_once():
    done = threading.Event()
    done.set()
    runner = _runner(lambda s: _Lowered(s, threading.Event(), done, None))
    warmup = WarmUp(runner, _scheduler(), background=False, max_workers=1)
    warmup.start()
    assert warmup.done.is_set() and warmup.num_compiled() == 6
    assert warmup.stop(timeout=0)

"""Start-up compilation of the step shapes, in the order the first requests need them.

All of the step shapes (`InputBuilder.shapes`, 18 with the defaults) take minutes to
compile on a small CPU host; the first requests need only the smallest token bucket.
`WarmUp` orders the shapes by token bucket T, in tiers: tier T holds the plain and the
full step of T and the multi-step decode calls of the row buckets up to T's rows.

- Without background compilation (`background=False`: the offline `LLM`, tests) `start`
  compiles every shape before it returns, as before.
- With it (`jaxserve serve`): `start` compiles the first tier (T = the smallest bucket,
  2 shapes) and returns; a daemon thread compiles the other tiers, smallest first.
  Until a tier is ready the scheduler runs under the budget of the largest ready one
  (`poll`, called before every scheduling decision): at most T tokens and T rows per
  step, and single-step decode until the multi-step calls of the rows allowed are
  compiled. So no request ever waits on a compilation: a long prompt is prefilled in
  chunks of T tokens, and a burst waits in the queue a little longer, until the bigger
  buckets are ready (the trade-off: lower throughput during the first minutes after a
  cold start, none after a warm one, where the tiers load from the persistent cache in
  seconds). Chunked prefill off needs the full budget at once: then every shape is
  compiled before `start` returns.

At shutdown, `stop` (`EngineCore.close`, a follower's end) lets no other shape start
compiling and waits a little for those under way, before JAX shuts down under them;
what they raise then is logged as the stop it is, not as a failure.

The warm-up compilations are counted apart (`CompileCounter.warming_up`), so the
engine's `num_compilations` stays 0 while the background tiers compile.

The shapes compiled by `start` also run once there, on padding (`ModelRunner.run_once`:
an executable's first run costs more than later ones); with one process only, since on
several every process must run the same steps. A background tier's shapes cannot run in
the background thread (a run needs the KV cache, which the serving loop owns), so they
queue for `run_next_first`, which the engine loop calls while it has no requests: one
shape a call, so that a request arriving meanwhile waits for one run at most.

Must not: run steps with requests, or compile shapes outside the runner's `buckets()`.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque

import jax

from jaxserve.engine.compile_counter import CompileCounter
from jaxserve.engine.model_runner import ModelRunner
from jaxserve.engine.scheduler import Scheduler
from jaxserve.engine.step_shapes import StepShape, pick_bucket
from jaxserve.logs import ProgressLog

logger = logging.getLogger(__name__)

# `WarmUp.stop`: how long to wait for the background compilations under way (they cannot
# be cut short) before JAX shuts down; the process's exit still waits for them (the
# frontend's grace for its engine: launcher.MULTI_PROCESS_ENGINE_TERM_TIMEOUT_S).
STOP_WAIT_S = 2.0


def warmup_tiers(runner: ModelRunner) -> list[tuple[int, list[StepShape]]]:
    """[(T, shapes)]: for every token bucket T ascending, its plain and full step, then
    (a tier of its own, so that the first tier is 2 shapes) the multi-step decode calls
    that T's rows may pick and no smaller T's tier holds. Together: `runner.buckets()`.
    """
    all_shapes = runner.buckets()
    plain = {s.num_tokens: s for s in all_shapes if s.num_steps == 1 and not s.history_len}
    full = {s.num_tokens: s for s in all_shapes if s.num_steps == 1 and s.history_len}
    decode = sorted((s for s in all_shapes if s.num_steps > 1), key=lambda s: s.num_rows)
    tiers, prev_limit = [], 0
    for t in runner.token_buckets:
        tiers.append((t, [plain[t], full[t]]))
        limit = _decode_bucket(runner, runner.rows_for(t))
        calls = [s for s in decode if prev_limit < s.num_rows <= limit]
        if calls:
            tiers.append((t, calls))
        prev_limit = max(prev_limit, limit)
    covered = {s for _, shapes in tiers for s in shapes}
    tiers[-1][1].extend(s for s in all_shapes if s not in covered)
    return tiers


def _decode_bucket(runner: ModelRunner, rows: int) -> int:
    """The largest decode row bucket a multi-step call of at most `rows` rows picks (0:
    no multi-step calls)."""
    buckets = runner.builder.decode_row_buckets if runner.builder.decode_steps > 1 else ()
    if not buckets:
        return 0
    return pick_bucket(buckets, min(rows, buckets[-1]))


class WarmUp:
    """Compiles a runner's step shapes tier by tier and holds the scheduler to what is
    compiled (see the module docstring).

    Args:
        runner: the `ModelRunner` to compile.
        scheduler: the engine's `Scheduler` (every dp rank's); its max_num_batched_tokens,
            max_num_seqs and num_decode_steps at construction are the targets.
        background: compile all but the first tier in a background thread.
        max_workers: parallel XLA compilations of the first tier (default: CPU count);
            the background uses one fewer (at least 1), leaving a core to serve.

    Attributes:
        ready_tokens: the largest token bucket whose tier (and every smaller) is compiled.
        done: set once every shape is compiled (or the background failed: `error`).
        compile_time_s: seconds `start` took (its first runs included); first_run_s:
            seconds of first runs so far (start's and `run_next_first`'s);
            background_time_s: seconds of the background thread (None until it ends).
    """

    def __init__(
        self,
        runner: ModelRunner,
        scheduler: Scheduler,
        *,
        background: bool,
        max_workers: int | None = None,
    ) -> None:
        self.runner = runner
        self.scheduler = scheduler
        s = scheduler
        self._targets = (s.max_num_batched_tokens, s.max_num_seqs, s.num_decode_steps)
        self.background = background and s.enable_chunked_prefill
        self.max_workers = max_workers or os.cpu_count() or 1
        self.tiers = warmup_tiers(runner)
        self.ready_tokens = 0
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.compile_time_s = 0.0
        self.first_run_s = 0.0
        # First runs only with one process: on several, every process must run the same steps.
        self._first_runs_here = jax.process_count() == 1
        # Background-compiled shapes not run yet, in compile order (the background thread
        # appends, the engine loop pops: deque's append and popleft are thread-safe).
        self._first_runs: deque[StepShape] = deque()
        self.background_time_s: float | None = None
        self._applied: tuple[int, int, int] | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()  # `stop`: no other background shape starts

    @property
    def num_shapes(self) -> int:
        return sum(len(shapes) for _, shapes in self.tiers)

    def start(self) -> float:
        """Compile the first tier (every tier without background compilation), start the
        background thread for the rest, and apply the budget. Returns the seconds taken.

        Raises:
            whatever tracing or compiling the first tier raises.
        """
        start = time.perf_counter()
        self.runner.compiler.expect_shapes([s for _, tier in self.tiers for s in tier])
        first = self.tiers if not self.background else self.tiers[:1]
        shapes = [s for _, tier in first for s in tier]
        what = "compiling step shapes" if len(first) == len(self.tiers) else (
            f"compiling the first {len(shapes)} of {self.num_shapes} step shapes"
        )  # fmt: skip
        self.runner.compiler.compile_shapes(shapes, self.max_workers, what)
        if self._first_runs_here:
            self.first_run_s = self.runner.run_once(shapes)
        self.ready_tokens = first[-1][0]
        self.compile_time_s = time.perf_counter() - start
        if len(first) == len(self.tiers):
            logger.info("compiled %d step shapes in %.1f s", len(shapes), self.compile_time_s)
            self.background_time_s = 0.0
            self.done.set()
        else:
            logger.info(
                "compiled %d of %d step shapes in %.1f s; the other %d compile in the "
                "background, until then at most %d tokens and %d requests per step",
                len(shapes), self.num_shapes, self.compile_time_s, self.num_shapes - len(shapes),
                self.ready_tokens, min(self.ready_tokens, self._targets[1]),
            )  # fmt: skip
            self._thread = threading.Thread(
                target=self._compile_rest, name="jaxserve-warmup", daemon=True
            )
            self._thread.start()
        self.poll()
        return self.compile_time_s

    def _compile_rest(self) -> None:
        start = time.perf_counter()
        rest = self.tiers[1:]
        progress_total = sum(len(s) for _, s in rest)
        workers = max(1, self.max_workers - 1)
        progress = ProgressLog(
            logger, "compiling the other step shapes in the background", progress_total, "shapes"
        )
        try:
            with CompileCounter.warming_up():
                for t, shapes in rest:
                    self.runner.compiler.compile_shapes(
                        shapes, workers, progress=progress, stop=self._stop
                    )
                    if self._first_runs_here:
                        self._first_runs.extend(shapes)
                    self.ready_tokens = t
        except BaseException as e:  # noqa: BLE001 - serving goes on with the ready tiers
            self.error = e
            self.runner.compiler.fail_pending(e)
            if self._stop.is_set():
                # The engine is stopping: whatever the compilations under way raised then
                # (JAX shutting down under them) is no failure of the server.
                logger.info(
                    "background compilation stopped by the shutdown, %d of %d step shapes "
                    "compiled", self.num_compiled(), self.num_shapes,
                )  # fmt: skip
                logger.debug("background compilation's end", exc_info=e)
                self.done.set()
                return
            logger.error(
                "background compilation failed at %d tokens per step; serving on with at "
                "most %d: %s", t, self.ready_tokens, e,
            )  # fmt: skip
        else:
            self.background_time_s = time.perf_counter() - start
            logger.info(
                "all %d step shapes compiled (the last %d in the background in %.1f s); "
                "full budget: %d tokens and %d requests per step",
                self.num_shapes, progress_total, self.background_time_s, *self._targets[:2],
            )  # fmt: skip
        self.done.set()

    def stop(self, timeout: float | None = STOP_WAIT_S) -> bool:
        """Stop the background compilation (at shutdown, before JAX shuts down): no other
        shape starts compiling, and this waits up to `timeout` seconds for those under
        way (an XLA compilation cannot be cut short). Returns whether the background
        thread ended (True without one)."""
        self._stop.set()
        if self._thread is None:
            return True
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def num_compiled(self) -> int:
        """Step shapes compiled so far."""
        return sum(self.runner.compiler.is_compiled(s) for _, t in self.tiers for s in t)

    def run_next_first(self) -> bool:
        """Run the next background-compiled shape that has not run yet, once on padding
        (`ModelRunner.run_once`); call only while no step with requests is in flight or
        due. Returns whether more such shapes are ready to run."""
        if self._first_runs:
            self.first_run_s += self.runner.run_once([self._first_runs.popleft()])
        return bool(self._first_runs)

    def pending_shapes(self) -> int:
        """Step shapes not compiled yet (0 once warm-up is done, or when it failed: the
        rest then never compiles and the budget stays where it is)."""
        if self.done.is_set():
            return 0
        return sum(not self.runner.compiler.is_compiled(s) for s in self.runner.buckets())

    def budget(self) -> tuple[int, int, int]:
        """(max_num_batched_tokens, max_num_seqs, num_decode_steps) the scheduler may
        use now: every step they can schedule fits a compiled shape."""
        tokens, seqs, k = self._targets
        if self.ready_tokens >= self.runner.token_buckets[-1]:
            return self._targets
        t = self.ready_tokens
        rows = min(seqs, self.runner.rows_for(t))
        # Multi-step decode only once every decode call of up to `rows` rows is compiled.
        decode_ok = k > 1 and all(
            self.runner.compiler.is_compiled(s)
            for s in self.runner.buckets()
            if s.num_steps > 1 and s.num_rows <= _decode_bucket(self.runner, rows)
        )
        return (min(tokens, t), rows, k if decode_ok else 1)

    def poll(self) -> None:
        """Apply the budget to the scheduler when it changed (cheap: call it before
        every scheduling decision)."""
        if self._applied == self._targets:
            return
        budget = self.budget()
        if budget == self._applied:
            return
        s = self.scheduler
        s.max_num_batched_tokens, s.max_num_seqs, s.num_decode_steps = budget
        self._applied = budget

    def wait(self, timeout: float | None = None) -> bool:
        """Block until every shape is compiled (or the background failed); then apply
        the full budget. Returns whether it finished within `timeout` seconds."""
        finished = self.done.wait(timeout)
        self.poll()
        return finished

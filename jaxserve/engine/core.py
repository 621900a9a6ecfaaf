"""`EngineCore`: one engine replica's loop body: requests in, one step, token outputs out.

A step reads as vLLM v1's: schedule -> execute -> update from the output. The core owns
the scheduler (who runs, KV blocks) and the queue of steps in flight; it reaches the
devices through an `Executor` (`engine.executor`: one process, or the multi-process
leader of `jaxserve.distributed.executor`) and packs inputs with the runner's builder.
It validates requests at the door (`engine.validation`). Used in-process by the offline
`LLM` and by the engine process, whose busy loop calls `add_request` / `abort_requests`
/ `step`. Nothing here touches a socket or text: outputs are token ids. Building the
engine (load, mesh, KV sizing, EP calibration, compile) is `engine.builder`.

With `async_scheduling` (the default on an accelerator; off on the CPU, where host and
"device" share the cores: `config.resolve_async_scheduling`) a step overlaps host and
device work, as vLLM v1's async scheduling does: while the device runs step N, the host
schedules and packs step N+1 (each of N's sampling rows counts as one pending token);
then it waits for N's tokens, writes them into N+1's inputs, dispatches N+1, and only
then turns N's tokens into outputs, so the device idles only for the copy back and the
dispatch. A request that N stops (EOS, stop token) wastes its row of N+1, whose result
is discarded.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import numpy as np

from jaxserve.config import EngineConfig
from jaxserve.engine.block_manager import BlockManager
from jaxserve.engine.builder import CompileCounter, build_engine
from jaxserve.engine.core_stats import engine_counters, engine_stats
from jaxserve.engine.executor import Executor
from jaxserve.engine.model_runner import InFlightStep, ModelRunner
from jaxserve.engine.request import Request
from jaxserve.engine.sampling_metadata import uses_penalties
from jaxserve.engine.scheduler_output import SchedulerOutput
from jaxserve.engine.step_inputs import StepInputs
from jaxserve.engine.validation import error_output, validate_request
from jaxserve.ipc import EngineRequest, EngineStats, TokenOutput
from jaxserve.observability.profile import TIMELINE
from jaxserve.observability.stats import LATENCY_BUCKETS_S, EngineCounters, Histogram
from jaxserve.observability.step_cost import StepCostModel, StepMeter

logger = logging.getLogger(__name__)


class EngineCore:
    """Builds the engine (`builder.build_engine`), then serves: requests in, steps, outputs.

    Args:
        config: the engine configuration.
        executor: makes the executor from the compiled runner (default: `Executor`, one
            process); the multi-process leader passes a `LeaderExecutor` factory.

    Each dp rank has its own requests and KV pool in the one scheduler (`scheduler.Rank`;
    one device is one rank), and each step runs every rank's batch at once (DP attention).

    Raises:
        ValueError / MeshError: as `build_engine` (a config field out of range, named in
            the message; a mesh that cannot hold the model; EPLB with several processes).

    EPLB (config.eplb, on an expert-parallel mesh): every `step_interval` steps the
    expert placement is re-planned from the load window; a new one is applied between
    two steps, after draining the step in flight (`eplb.controller`). With ep = 1 it is
    disabled with a warning; with several processes the engine refuses to start.

    Counters for the metrics layer: `counters()` (an `EngineCounters`), in `stats()`
    (both built by `engine.core_stats`). The expert load of MoE models is
    `runner.expert_load` (an `eplb.recorder.ExpertLoadRecorder`), summarized in `stats()`.
    """

    def __init__(
        self,
        config: EngineConfig,
        executor: Callable[[ModelRunner], Executor] = Executor,
    ):
        self.config = config
        parts = build_engine(config)
        self.model_config = parts.model_config
        self.mesh = parts.mesh
        self.dp = config.mesh.dp
        self.max_model_len = parts.max_model_len
        self.scheduler = parts.scheduler
        self.runner = parts.runner
        self.warmup = parts.warmup
        self.eplb_config = parts.eplb_config
        self.eplb = parts.eplb
        self.compile_time_s = parts.compile_time_s
        self.startup_time_s = parts.startup_time_s
        self._compiles_at_ready = parts.compiles_at_ready
        self.executor = executor(self.runner)
        # Resolved once by the builder (None in the config: the backend's default).
        self.async_scheduling = parts.async_scheduling
        # The async batch queue: the dispatched step whose outputs are not processed yet.
        self._inflight: InFlightStep | None = None
        self._rng = np.random.default_rng(config.seed)
        self._rejected: list[TokenOutput] = []
        # Requests ended because their sampling row could not be packed: request id ->
        # error, turned into their final output's error (see `_end_unpackable_rows`).
        self._row_errors: dict[str, str] = {}
        self.num_steps = 0
        self.host_time_s = 0.0
        self.device_time_s = 0.0
        self.last_host_s = 0.0
        self.last_device_s = 0.0
        # Layer metrics (observability.step_cost): per-step cost and time, queue time,
        # the KV high-water mark.
        self.step_meter = StepMeter(
            StepCostModel(self.model_config, config.dtype), parts.peak, config.dtype
        )
        self.queue_time = Histogram(LATENCY_BUCKETS_S)
        self.kv_blocks_used_max = 0

    @property
    def block_managers(self) -> list[BlockManager]:
        """The scheduler's KV block pools, one per dp rank."""
        return self.scheduler.block_managers

    @property
    def block_manager(self) -> BlockManager:
        """Rank 0's KV block pool (one rank: the pool)."""
        return self.scheduler.bm

    @property
    def num_compilations(self) -> int:
        """XLA compilations in this process since start-up finished (0 when healthy)."""
        return CompileCounter.count - self._compiles_at_ready

    # ----- requests ----------------------------------------------------------------------

    def add_request(self, req: EngineRequest, cache_group: str | None = None) -> None:
        """Queue a request. Never raises for a bad request: it ends with an error output
        on the next `step()` instead.

        cache_group: requests given the same group (the n samples of one prompt) share
            their prompt's KV blocks even when prefix caching is off. Defaults to
            `req.cache_group` (set by the gRPC frontend for the samples of one request).
        """
        if cache_group is None:
            cache_group = req.cache_group
        try:
            params, prompt = validate_request(
                req, self.model_config.vocab_size, self.scheduler.requests
            )
        except Exception as e:  # noqa: BLE001 - a bad request must never stop the engine
            self._rejected.append(error_output(req, str(e)))
            return
        seed = params.seed if params.seed is not None else int(self._rng.integers(2**63))
        seq = Request(
            request_id=req.request_id,
            token_ids=prompt,
            num_prompt_tokens=len(prompt),
            params=params,
            seed=seed,
            arrival_time=req.arrival_time or time.time(),
            single_step_only=uses_penalties(params) or params.prompt_logprobs is not None,
            prompt_logprobs=[] if params.prompt_logprobs is not None else None,
            cache_group=cache_group,
        )
        self.scheduler.add(seq)

    def abort_requests(self, request_ids: list[str]) -> None:
        """Abort waiting or running requests; unknown ids are ignored. Each aborted request
        gets one final output (finish_reason "abort") on the next `step()`."""
        self.scheduler.abort(request_ids)

    def has_work(self) -> bool:
        return bool(self._rejected) or self._inflight is not None or self.scheduler.has_unfinished()

    def idle_work(self) -> bool:
        """While idle (no work): one first run of a background-compiled shape
        (`WarmUp.run_next_first`). Returns whether more are pending."""
        return not self.has_work() and self.warmup.run_next_first()

    def close(self) -> None:
        """Stop the background compilation, release the executor (the multi-process
        leader stops its followers, which stop theirs meanwhile), then wait up to
        `WarmUp.stop`'s default for the compilations under way (idempotent)."""
        self.warmup.stop(timeout=0)
        self.executor.close()
        self.warmup.stop()

    # ----- the step ----------------------------------------------------------------------

    def step(self) -> list[TokenOutput]:
        """One scheduling decision and at most one device call; with async scheduling,
        the outputs returned are those of the step dispatched by the previous call.

        Returns:
            Outputs of every request that got a token or finished in this step.
        """
        start = time.perf_counter()
        waited = self.runner.wait_time_s
        outputs, self._rejected = self._rejected, []
        self.warmup.poll()  # the step budget of the shapes compiled so far
        if self.async_scheduling:
            outputs += self._step_async()
        else:
            outputs += self._step_sync()
        if self.eplb is not None and self.eplb.step_done():
            outputs += self._rebalance()
        if self._row_errors:
            _mark_errors(outputs, self._row_errors)
        self.num_steps += 1
        self.last_device_s = self.runner.wait_time_s - waited
        self.last_host_s = time.perf_counter() - start - self.last_device_s
        self.device_time_s += self.last_device_s
        self.host_time_s += self.last_host_s
        used = sum(bm.num_usable_blocks - bm.num_free_blocks for bm in self.block_managers)
        self.kv_blocks_used_max = max(self.kv_blocks_used_max, used)
        return outputs

    def _step_sync(self) -> list[TokenOutput]:
        """schedule -> execute -> update, one step at a time."""
        sched = self._schedule()
        if sched.is_empty:
            return self.scheduler.drain_finished()
        x = self._prepare(sched)
        samples = self._fetch(self._dispatch(x, sched))
        return self._update(sched, samples)

    def _step_async(self) -> list[TokenOutput]:
        """The batch queue of depth one: schedule and pack step N + 1 while N runs, then
        fetch N, dispatch N + 1 with N's tokens filled in, and update from N."""
        if self._inflight is None:
            sched = self._schedule()
            if sched.is_empty:
                return self.scheduler.drain_finished()
            self._inflight = self._dispatch(self._prepare(sched), sched)
        done = self._inflight
        nxt = self._schedule()
        x = None if nxt.is_empty else self._prepare(nxt, in_flight=done.sched)
        samples = self._fetch(done)
        self._inflight = None
        if x is not None:
            self.runner.fill_pending(x, samples)
            self._inflight = self._dispatch(x, nxt)
        return self._update(done.sched, samples)

    def _rebalance(self) -> list[TokenOutput]:
        """Re-place the experts if the EPLB plan changes any layer. The step in flight
        (async scheduling) is finished first, since the move donates the weights it
        reads; its outputs are returned."""
        plan = self.eplb.plan()
        if plan is None:
            return []
        outputs = []
        if self._inflight is not None:
            done, self._inflight = self._inflight, None
            outputs = self._update(done.sched, self._fetch(done))
        self.executor.publish_placement(plan.physical_to_logical)
        self.eplb.apply(plan)
        return outputs

    # The step's phases, each a span of the profiler's host timeline (observability.profile).

    def _schedule(self) -> SchedulerOutput:
        t = TIMELINE.now()
        sched = self.scheduler.schedule()
        TIMELINE.span("schedule", t)
        return sched

    def _update(self, sched, samples) -> list[TokenOutput]:
        t = TIMELINE.now()
        outputs = self.scheduler.update(sched, samples)
        TIMELINE.span("outputs", t)
        return outputs

    def _dispatch(self, x: StepInputs, sched: SchedulerOutput) -> InFlightStep:
        """`executor.dispatch`, metered: queue times of first-scheduled requests, the
        step's shapes and its start (`observability.step_cost.StepMeter`)."""
        now = time.time()
        for row in sched.requests:
            if row.seq.first_scheduled_time is None:
                row.seq.first_scheduled_time = now
                self.queue_time.observe(max(now - row.seq.arrival_time, 0.0))
        t = TIMELINE.now()
        step = self.executor.dispatch(x, sched)
        TIMELINE.span("dispatch", t)
        self.step_meter.dispatched(step, sched)
        return step

    def _fetch(self, step: InFlightStep):
        """`executor.fetch`, metered (the step's time: dispatch to results here)."""
        t = TIMELINE.now()
        samples = self.executor.fetch(step)
        TIMELINE.span("wait for device", t)
        self.step_meter.fetched(step)
        return samples

    def _prepare(
        self, sched: SchedulerOutput, in_flight: SchedulerOutput | None = None
    ) -> StepInputs:
        """The runner's packed inputs of `sched` (tokens `in_flight` still samples left
        pending), after ending every request whose sampling row could not be packed
        (see `_end_unpackable_rows`)."""
        t = TIMELINE.now()
        x = self.runner.prepare(sched, in_flight)
        self._end_unpackable_rows(sched, x)
        TIMELINE.span("pack", t)
        return x

    def _end_unpackable_rows(self, sched: SchedulerOutput, x: StepInputs) -> None:
        """Abort the requests of x's `row_errors`; their final output becomes an error.

        Defence in depth: `SamplingParams.validate` at `add_request` should reject every
        request the sampler cannot pack, so this only runs on a validation gap (logged
        as an engine bug). The step still runs with those rows as padding; aborting frees
        their blocks, and the step's results for them are discarded by `update` (as for
        any request aborted while a step that holds it is in flight).
        """
        failed = {sched.requests[row].seq.request_id: e for row, e in x.row_errors.items()}
        if not failed:
            return
        logger.error(
            "ending %d request(s) whose sampling parameters passed validation but could "
            "not be packed (a validation gap): %s",
            len(failed),
            failed,
        )
        self._row_errors.update(failed)
        self.scheduler.abort(list(failed))

    # ----- facts -------------------------------------------------------------------------

    def request_counts(self) -> tuple[int, int]:
        """(running, waiting) requests: `stats()`'s two counts, without building the rest."""
        return self.scheduler.num_running, self.scheduler.num_waiting

    def stats(self) -> EngineStats:
        """Engine facts and gauges (`core_stats.engine_stats`). Free blocks include cached
        blocks no request holds."""
        return engine_stats(self)

    def counters(self) -> EngineCounters:
        """Monotonic counters and last-step timings, for the metrics layer
        (`core_stats.engine_counters`)."""
        return engine_counters(self)


def _mark_errors(outputs: list[TokenOutput], errors: dict[str, str]) -> None:
    """Turn the "abort" final outputs of the requests in `errors` into "error" ones
    (popping them from `errors`)."""
    for out in outputs:
        if out.finish_reason == "abort" and out.request_id in errors:
            out.finish_reason, out.error = "error", errors.pop(out.request_id)

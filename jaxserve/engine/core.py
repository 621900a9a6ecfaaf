"""`EngineCore`: one engine replica's loop body: requests in, one step, token outputs out.

Wires the scheduler (who runs, KV blocks) to the model runner (the compiled device
step) and validates requests at the door, so that a bad request becomes an error output
instead of an exception. Used in-process by the offline `LLM` and by the engine process,
whose busy loop calls `add_request` / `abort_requests` / `step`. Nothing here touches a
socket or text: outputs are token ids.

With `async_scheduling` (the default) a step overlaps host and device work, as vLLM
v1's async scheduling does: while the device runs step N, the host schedules and packs
step N+1 (each of N's sampling rows counts as one pending token); then it waits for N's
tokens, writes them into N+1's inputs, dispatches N+1, and only then turns N's tokens
into outputs, so the device idles only for the copy back and the dispatch. A request
that N stops (EOS, stop token) wastes its row of N+1, whose result is discarded.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config import EngineConfig, EplbConfig
from jaxserve.engine.block_manager import BlockManager
from jaxserve.engine.dp_scheduler import DPScheduler, DPSchedulerOutput
from jaxserve.engine.model_runner import (
    MIN_TOKEN_BUCKET,
    CompileCounter,
    ModelRunner,
    StepHandle,
    enable_compilation_cache,
    num_kv_blocks,
)
from jaxserve.engine.sampler import uses_penalties
from jaxserve.engine.scheduler import Scheduler, SchedulerOutput
from jaxserve.engine.sequence import Sequence
from jaxserve.engine.step_inputs import (
    MIN_DECODE_ROWS,
    DPStepInputs,
    StepInputs,
    StepShape,
    pow2_buckets,
)
from jaxserve.ipc import EngineRequest, EngineStats, RequestOutput
from jaxserve.models.loader import load_config, load_model
from jaxserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from jaxserve.step_channel import StepPublisher, StepSubscriber

logger = logging.getLogger(__name__)

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


class EngineCore:
    """Loads the model, allocates the KV cache, compiles every step bucket, then serves.

    Args:
        config: the engine configuration.

    On a mesh (config.mesh larger than dp=1,tp=1) the model is sharded over it
    (`sharding.load`), each dp rank gets its own scheduler and KV pool
    (`dp_scheduler.DPScheduler`; cache.num_blocks counts one rank's pool) and each step
    runs every rank's batch at once (DP attention). Several processes: `lead` / `follow`.

    Raises:
        ValueError: a config field is out of range (named in the message), e.g.
            max_model_len above the model's max_position_embeddings, or a max_model_len
            given explicitly that one dp rank's KV pool cannot hold (see `fit_kv_cache`).
        MeshError (a ValueError): the mesh cannot be built or cannot hold the model.
        ValueError: eplb.num_redundant_experts makes the expert slots not divisible by
            dp * tp, or EPLB with several processes.

    EPLB (config.eplb, on an expert-parallel mesh): every `step_interval` steps the
    expert placement is re-planned from the load window; a new one is applied between
    two steps, after draining the step in flight (`eplb.controller`). With ep = 1 it is
    disabled with a warning; with several processes the engine refuses to start.

    Counters for the metrics layer (plain attributes, monotonic unless noted):
        num_steps, host_time_s (seconds the engine thread worked: scheduling, packing
        inputs, dispatching, turning tokens into outputs) and device_time_s (seconds it
        waited for the device: without async scheduling, the device time of the steps;
        with it, the device time that host work did not hide), last_host_s /
        last_device_s (the last step), plus the scheduler's num_preemptions,
        num_prefix_queries / num_prefix_hits (tokens) and prefill/decode token counts.
        The expert load of MoE models is `runner.expert_load` (an
        `eplb.recorder.ExpertLoadRecorder`), summarized in `stats()`; with EPLB, the
        re-placements applied and their seconds (`eplb`: an `EplbController`, None when
        off) are the counters eplb_rebalances / eplb_rebalance_s.
    """

    def __init__(self, config: EngineConfig):
        self.config = config
        if config.dtype not in _DTYPES:
            raise ValueError(f"dtype: expected one of {sorted(_DTYPES)}, got {config.dtype!r}")
        enable_compilation_cache(config.compilation_cache_dir)
        CompileCounter.install()
        start = time.perf_counter()

        dtype = _DTYPES[config.dtype]
        sc, cc = config.scheduler, config.cache
        self.eplb_config = _check_eplb(config)
        if sc.max_model_len is not None and cc.num_blocks is not None:
            # Both given: fail before loading the weights.
            fit_kv_cache(sc.max_model_len, True, cc.num_blocks, cc.block_size)
        self.mesh = None
        if config.mesh.size == 1:
            model, self.model_config = load_model(config.model, dtype)
        else:
            model, self.model_config, self.mesh = _load_on_mesh(config, dtype)
        mc = self.model_config
        self.dp = config.mesh.dp
        max_model_len = _max_model_len(sc.max_model_len, mc.max_position_embeddings)
        # Blocks per dp rank (each rank's pool has its own null block 0).
        num_blocks = cc.num_blocks or num_kv_blocks(
            mc,
            cc.block_size,
            dtype,
            cc.memory_fraction,
            sc.max_num_seqs,
            max_model_len,
            kv_head_shards=config.mesh.tp,
        )
        # The effective limit (reported in stats()): one sequence must fit in one rank's pool.
        self.max_model_len = fit_kv_cache(
            max_model_len, sc.max_model_len is not None, num_blocks, cc.block_size
        )
        self.block_managers = [
            BlockManager(num_blocks, cc.block_size, cc.enable_prefix_caching)
            for _ in range(self.dp)
        ]
        ranks = [
            Scheduler(
                bm,
                max_num_seqs=sc.max_num_seqs,
                max_num_batched_tokens=sc.max_num_batched_tokens,
                max_model_len=self.max_model_len,
                eos_token_ids=mc.eos_token_ids,
                enable_chunked_prefill=sc.enable_chunked_prefill,
                num_decode_steps=sc.num_decode_steps,
            )
            for bm in self.block_managers
        ]
        self.block_manager = self.block_managers[0]
        self.scheduler: Scheduler | DPScheduler = ranks[0] if self.dp == 1 else DPScheduler(ranks)
        self.runner = ModelRunner(
            model,
            mc,
            mesh=self.mesh,
            num_blocks=self.dp * num_blocks,
            block_size=cc.block_size,
            max_model_len=self.max_model_len,
            max_num_seqs=sc.max_num_seqs,
            max_num_batched_tokens=sc.max_num_batched_tokens,
            kv_dtype=dtype,
            num_decode_steps=sc.num_decode_steps,
            expert_load_window=self.eplb_config.window_size,
        )
        # Built (its move compiled) before the start-up compilations are counted.
        self.eplb = self._build_eplb()
        self.async_scheduling = sc.async_scheduling
        # The dispatched step whose outputs are not processed yet (async scheduling).
        self._inflight: tuple[SchedulerOutput, StepHandle] | None = None
        self.compile_time_s = self.runner.compile_all()
        self._compiles_at_ready = CompileCounter.count
        self.startup_time_s = time.perf_counter() - start
        self._rng = np.random.default_rng(config.seed)
        self._rejected: list[RequestOutput] = []
        # Requests ended because their sampling row could not be packed: request id ->
        # error, turned into their final output's error (see `_end_unpackable_rows`).
        self._row_errors: dict[str, str] = {}
        self.num_steps = 0
        self.host_time_s = 0.0
        self.device_time_s = 0.0
        self.last_host_s = 0.0
        self.last_device_s = 0.0
        # Multi-process: seconds spent publishing steps to the followers (leader only).
        self.coordination_time_s = 0.0
        self.last_coordination_s = 0.0
        self._publisher: StepPublisher | None = None
        self._follow_pending = None
        logger.info(
            "engine ready in %.1f s: %s, %d usable KV blocks of %d tokens (per dp rank; "
            "one more is the null block), max_model_len %d",
            self.startup_time_s,
            config.model,
            num_blocks - 1,
            cc.block_size,
            self.max_model_len,
        )

    def _build_eplb(self):
        """The `EplbController` when EPLB is on and the model has MoE layers, else None."""
        ec = self.eplb_config
        if not ec.enabled:
            return None
        if self.runner.expert_load is None:
            logger.warning("--enable-eplb: %s has no MoE layers; EPLB is off", self.config.model)
            return None
        from jaxserve.eplb.controller import EplbController  # noqa: PLC0415

        controller = EplbController(
            self.runner,
            self.mesh,
            self.model_config.num_experts,
            ec.num_redundant_experts + 1,
            step_interval=ec.step_interval,
            min_improvement=ec.min_improvement,
        )
        logger.info(
            "EPLB on: %d expert slots per MoE layer (%d redundant), re-plan every %d steps "
            "from a %d-step load window; placement move compiled in %.1f s",
            controller.executor.num_slots,
            ec.num_redundant_experts,
            ec.step_interval,
            ec.window_size,
            controller.executor.compile_seconds,
        )
        return controller

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
            params, prompt = self._validate(req)
        except Exception as e:  # noqa: BLE001 - a bad request must never stop the engine
            self._rejected.append(_error_output(req, str(e)))
            return
        seed = params.seed if params.seed is not None else int(self._rng.integers(2**63))
        seq = Sequence(
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

    def _validate(self, req: EngineRequest) -> tuple[SamplingParams, list[int]]:
        if req.request_id in self.scheduler.requests:
            raise ValueError(f"request_id: {req.request_id!r} is already running")
        try:
            params = SamplingParams.from_dict(req.sampling)
        except TypeError as e:
            raise ValueError(f"sampling: {e}") from None
        vocab = self.model_config.vocab_size
        params.validate(vocab)
        if params.n != 1:
            raise ValueError(
                f"n: the engine runs one sample per request (fan out n > 1 before it), "
                f"got {params.n}"
            )
        prompt = np.asarray(req.prompt_token_ids).reshape(-1)
        if prompt.size == 0:
            raise ValueError("prompt_token_ids: the prompt is empty")
        if not np.issubdtype(prompt.dtype, np.integer):
            raise ValueError(f"prompt_token_ids: expected integers, got {prompt.dtype}")
        bad = prompt[(prompt < 0) | (prompt >= vocab)]
        if bad.size:
            raise ValueError(f"prompt_token_ids: token id {int(bad[0])} outside [0, {vocab})")
        return params, prompt.astype(np.int64).tolist()

    def abort_requests(self, request_ids: list[str]) -> None:
        """Abort waiting or running requests; unknown ids are ignored. Each aborted request
        gets one final output (finish_reason "abort") on the next `step()`."""
        self.scheduler.abort(request_ids)

    def has_work(self) -> bool:
        return bool(self._rejected) or self._inflight is not None or self.scheduler.has_unfinished()

    # ----- the step ----------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One scheduling decision and at most one device call; with async scheduling,
        the outputs returned are those of the step dispatched by the previous call.

        Returns:
            Outputs of every request that got a token or finished in this step.
        """
        start = time.perf_counter()
        outputs, self._rejected = self._rejected, []
        if self.async_scheduling:
            outputs += self._step_overlapped()
        else:
            outputs += self._step_sync()
        wait_s = self.runner.last_wait_s
        if self.eplb is not None and self.eplb.step_done():
            outputs += self._rebalance()
            wait_s += self.runner.last_wait_s
        if self._row_errors:
            _mark_errors(outputs, self._row_errors)
        total = time.perf_counter() - start
        self.num_steps += 1
        self.last_device_s = wait_s
        self.last_host_s = total - self.last_device_s
        self.device_time_s += self.last_device_s
        self.host_time_s += self.last_host_s
        return outputs

    def _step_sync(self) -> list[RequestOutput]:
        self.runner.last_wait_s = 0.0
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return self.scheduler.drain_finished()
        x = self._prepare(sched)
        return self.scheduler.update(sched, self.runner.fetch(self.runner.dispatch(x, sched)))

    def _step_overlapped(self) -> list[RequestOutput]:
        self.runner.last_wait_s = 0.0
        if self._inflight is None:
            sched = self.scheduler.schedule()
            if sched.is_empty:
                return self.scheduler.drain_finished()
            self._inflight = sched, self.runner.dispatch(self._prepare(sched), sched)
        sched, handle = self._inflight
        # Step N runs on the device: schedule and pack N + 1 meanwhile.
        nxt = self.scheduler.schedule()
        x = None if nxt.is_empty else self._prepare(nxt)
        samples = self.runner.fetch(handle)
        self._inflight = None
        if x is not None:
            self.runner.fill_pending(x, samples)
            self._inflight = nxt, self.runner.dispatch(x, nxt)
        return self.scheduler.update(sched, samples)

    def _rebalance(self) -> list[RequestOutput]:
        """Re-place the experts if the EPLB plan changes any layer. The step in flight
        (async scheduling) is finished first, since the move donates the weights it
        reads; its outputs are returned."""
        plan = self.eplb.plan()
        if plan is None:
            return []
        outputs = []
        self.runner.last_wait_s = 0.0
        if self._inflight is not None:
            sched, handle = self._inflight
            self._inflight = None
            outputs = self.scheduler.update(sched, self.runner.fetch(handle))
        self.eplb.apply(plan)
        return outputs

    def _prepare(self, sched: SchedulerOutput | DPSchedulerOutput) -> StepInputs | DPStepInputs:
        """The runner's packed inputs of `sched`, after ending every request whose
        sampling row could not be packed (see `_end_unpackable_rows`)."""
        x = self.runner.prepare(sched)
        self._end_unpackable_rows(sched, x)
        return x

    def _end_unpackable_rows(
        self, sched: SchedulerOutput | DPSchedulerOutput, x: StepInputs | DPStepInputs
    ) -> None:
        """Abort the requests of x's `row_errors`; their final output becomes an error.

        Defence in depth: `SamplingParams.validate` at `add_request` should reject every
        request the sampler cannot pack, so this only runs on a validation gap (logged
        as an engine bug). The step still runs with those rows as padding; aborting frees
        their blocks, and the step's results for them are discarded by `update` (as for
        any request aborted while a step that holds it is in flight).
        """
        pairs = (
            zip(sched.ranks, x.ranks, strict=True) if isinstance(x, DPStepInputs) else [(sched, x)]
        )
        failed: dict[str, str] = {}
        for rank_sched, rank_x in pairs:
            for row, error in rank_x.row_errors.items():
                failed[rank_sched.requests[row].seq.request_id] = error
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

    def stats(self) -> EngineStats:
        """Engine facts and gauges. Free blocks include cached blocks no request holds."""
        s, bms = self.scheduler, self.block_managers
        return EngineStats(
            model=self.config.served_model_name or Path(self.config.model).name,
            max_model_len=self.max_model_len,
            block_size=self.block_manager.block_size,
            num_blocks_total=sum(bm.num_usable_blocks for bm in bms),
            num_blocks_free=sum(bm.num_free_blocks for bm in bms),
            vocab_size=self.model_config.vocab_size,
            num_running=s.num_running,
            num_waiting=s.num_waiting,
            ready=True,
            extra=self.counters(),
            **self.expert_load_stats(),
        )

    def expert_load_stats(self) -> dict:
        """The `EngineStats` expert-load fields: per MoE layer (decoder-layer index) the
        balancedness over the EP ranks in the recorder's window, and the routed tokens
        since start-up; {} for a model without MoE layers."""
        recorder = self.runner.expert_load
        if recorder is None:
            return {}
        return {
            "expert_layers": list(self.runner.moe_layers),
            "expert_balancedness": recorder.balancedness().tolist(),
            "expert_routed_tokens": recorder.total_routed_tokens(),
        }

    # ----- several processes --------------------------------------------------------------

    def lead(self, publisher: StepPublisher) -> None:
        """Make this engine (process 0 of a multi-process run) publish every step's
        packed inputs on `publisher` before dispatching it, so that `follow`ing engines
        run the same step. Its time per step is the `coordination_time_s` counter."""

        def publish(buffers: tuple[np.ndarray, ...], shape) -> None:
            publisher.publish(buffers, meta={"shape": list(shape)})
            self.coordination_time_s += publisher.stats.last_s
            self.last_coordination_s = publisher.stats.last_s

        self._publisher = publisher
        self.runner.publish = publish

    def close(self) -> None:
        """Stop the followers, if leading (idempotent)."""
        if self._publisher is not None:
            self._publisher.close()
            self._publisher = None
            self.runner.publish = None

    def follow(self, subscriber: StepSubscriber, timeout_s: float | None = None) -> int:
        """Run the leader's steps until it sends STOP (processes 1..N-1 of a run, built
        from the same EngineConfig, hence the same executables and KV cache layout).
        Their outputs are not read: the leader's replicated copy is the result.

        Returns:
            The number of steps run.

        Raises:
            TimeoutError: no message from the leader within timeout_s.
        """
        from jaxserve.step_channel import STOP  # noqa: PLC0415

        steps = 0
        while (msg := subscriber.receive(timeout_s)).kind != STOP:
            out = self.runner.run_buffers(StepShape(*msg.meta["shape"]), msg.arrays)
            steps += 1
            # Bound the device queue (and the host buffers it holds) to one step.
            if self._follow_pending is not None:
                jax.block_until_ready(self._follow_pending)
            self._follow_pending = out.token_ids
        self._follow_pending = None
        return steps

    def counters(self) -> dict[str, float]:
        """Monotonic counters and last-step timings, for the metrics layer."""
        s = self.scheduler
        return {
            "coordination_time_s": self.coordination_time_s,
            "last_coordination_s": self.last_coordination_s,
            "num_steps": self.num_steps,
            "num_preemptions": s.num_preemptions,
            "prefix_cache_queries": s.num_prefix_queries,
            "prefix_cache_hits": s.num_prefix_hits,
            "prefill_tokens": s.num_prefill_tokens_computed,
            "decode_tokens": s.num_decode_tokens_computed,
            "host_time_s": self.host_time_s,
            "device_time_s": self.device_time_s,
            "last_host_s": self.last_host_s,
            "last_device_s": self.last_device_s,
            "num_compilations": self.num_compilations,
            "eplb_rebalances": 0 if self.eplb is None else self.eplb.num_rebalances,
            "eplb_rebalance_s": 0.0 if self.eplb is None else self.eplb.rebalance_time_s,
        }


def _load_on_mesh(config: EngineConfig, dtype: jnp.dtype):
    """(model, model config, mesh): the model sharded on config.mesh, with the MoE
    replicated-token threshold measured at the engine's step sizes (dp x each token
    bucket).

    Raises:
        MeshError (a ValueError): the mesh cannot be built or cannot hold the model.
    """
    from jaxserve.sharding.ep_calibration import measure_replicated_max_tokens  # noqa: PLC0415
    from jaxserve.sharding.load import load_sharded_model  # noqa: PLC0415
    from jaxserve.sharding.mesh import build_mesh_from_config, check_model_fits  # noqa: PLC0415

    mesh = build_mesh_from_config(config.mesh)
    mc = load_config(config.model)
    redundant = config.eplb.num_redundant_experts if mc.num_experts > 0 else 0
    if redundant and (mc.num_experts + redundant) % config.mesh.size:
        raise ValueError(
            f"num_redundant_experts (--num-redundant-experts): {mc.num_experts} experts + "
            f"{redundant} redundant slots = {mc.num_experts + redundant} is not divisible by "
            f"ep = dp*tp = {config.mesh.size}"
        )
    # Before timing anything: a clear error at start-up.
    check_model_fits(
        mc, mesh, num_physical_experts=mc.num_experts + redundant if redundant else None
    )
    threshold = 0
    if mc.num_experts > 0:
        sc = config.scheduler
        buckets = pow2_buckets(MIN_TOKEN_BUCKET, sc.max_num_batched_tokens)
        buckets += pow2_buckets(MIN_DECODE_ROWS, sc.max_num_seqs)
        threshold = measure_replicated_max_tokens(
            mesh,
            sorted({config.mesh.dp * t for t in buckets}),
            mc.hidden_size,
            mc.moe_intermediate_size,
            mc.num_experts + redundant,
            mc.num_experts_per_tok,
            dtype,
        )
    model, mc = load_sharded_model(
        config.model,
        mesh,
        dtype,
        replicated_max_tokens=threshold,
        num_redundant_experts=redundant,
    )
    return model, mc, mesh


def _check_eplb(config: EngineConfig) -> EplbConfig:
    """The EPLB settings the engine runs with: config.eplb, validated; turned off (with
    a warning) on one device, where there is no expert parallelism to balance.

    Raises:
        ValueError: an out-of-range field (named), or EPLB with several processes (the
            followers would need every new placement: not supported yet).
    """
    ec = config.eplb
    ec.validate()
    if config.mesh.size == 1 and (ec.enabled or ec.num_redundant_experts):
        logger.warning(
            "--enable-eplb / --num-redundant-experts: need an expert-parallel mesh "
            "(dp*tp > 1), got dp=1,tp=1; running without EPLB and redundant experts"
        )
        return dataclasses.replace(ec, enabled=False, num_redundant_experts=0)
    if ec.enabled and jax.process_count() > 1:
        raise ValueError(
            "enable_eplb (--enable-eplb): not supported with several processes yet (the "
            "followers would need every new expert placement)"
        )
    return ec


def _max_model_len(requested: int | None, max_position_embeddings: int) -> int:
    if requested is None:
        return max_position_embeddings
    if not 2 <= requested <= max_position_embeddings:
        raise ValueError(
            f"max_model_len: must be in [2, {max_position_embeddings}] "
            f"(the model's max_position_embeddings), got {requested}"
        )
    return requested


def fit_kv_cache(max_model_len: int, explicit: bool, num_blocks: int, block_size: int) -> int:
    """The max_model_len that one dp rank's KV pool can hold, as vLLM checks at start-up.

    Every token of a sequence has a slot in its rank's pool, which has `num_blocks`
    blocks of `block_size` tokens, one of them the null block: the capacity is
    (num_blocks - 1) * block_size tokens. A longer max_model_len would admit requests
    that can never run (they would wait or be preempted forever).

    Args:
        max_model_len: tokens (prompt + output) of one request, from the user or from
            the model's max_position_embeddings.
        explicit: whether the user set max_model_len (then it is never lowered).
        num_blocks: KV blocks of one dp rank, null block included.
        block_size: tokens per KV block.

    Returns:
        max_model_len, or the capacity when that is smaller and max_model_len came from
        the model (with a warning in the log).

    Raises:
        ValueError: an explicit max_model_len above the capacity, or a capacity below 2
            tokens (one prompt token and one output token).
    """
    capacity = (num_blocks - 1) * block_size
    if max_model_len <= capacity:
        return max_model_len
    if explicit:
        raise ValueError(
            f"max_model_len: {max_model_len} tokens do not fit in the KV cache, which holds "
            f"{capacity} tokens per dp rank ({num_blocks - 1} usable blocks of {block_size}); "
            f"pass --max-model-len {capacity} or less, or give the KV cache more blocks "
            f"(--num-blocks, a larger memory fraction, or more device memory)"
        )
    if capacity < 2:
        raise ValueError(
            f"num_blocks: the KV cache holds {capacity} token(s) per dp rank "
            f"({num_blocks - 1} usable blocks of {block_size}); a request needs at least 2"
        )
    logger.warning(
        "max_model_len: the model's %d tokens do not fit in the KV cache (%d tokens per dp "
        "rank: %d usable blocks of %d); serving max_model_len %d. Set --max-model-len, or "
        "give the KV cache more blocks or memory.",
        max_model_len, capacity, num_blocks - 1, block_size, capacity,
    )  # fmt: skip
    return capacity


def _mark_errors(outputs: list[RequestOutput], errors: dict[str, str]) -> None:
    """Turn the "abort" final outputs of the requests in `errors` into "error" ones
    (popping them from `errors`)."""
    for out in outputs:
        if out.finish_reason == "abort" and out.request_id in errors:
            out.finish_reason, out.error = "error", errors.pop(out.request_id)


def _error_output(req: EngineRequest, error: str) -> RequestOutput:
    try:
        prompt = np.asarray(req.prompt_token_ids, np.int64).reshape(-1)
    except (TypeError, ValueError):
        prompt = np.zeros(0, np.int64)
    return RequestOutput(
        request_id=req.request_id,
        new_token_ids=[],
        finish_reason="error",
        num_prompt_tokens=int(prompt.size),
        error=error,
        first={"prompt_token_ids": prompt, "sampling": req.sampling},
    )

"""Building an engine: load the model (on its mesh), size the KV cache, build the
scheduler, the runner and EPLB, compile every step shape.

`build_engine(config)` returns the parts `EngineCore` serves with (`EngineParts`); a
multi-process follower builds the same parts and uses only the runner, so that every
process holds the same executables and KV cache layout. Also here: the process-wide
compilation counter and JAX's persistent compilation cache.

Must not: run steps or hold requests.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

from jaxserve.config import EngineConfig, EplbConfig, resolve_async_scheduling
from jaxserve.engine.block_manager import BlockManager
from jaxserve.engine.compile_counter import BACKEND_COMPILE_EVENT, CompileCounter  # noqa: F401
from jaxserve.engine.kv_sizing import (
    check_max_model_len,
    check_num_blocks,
    fit_kv_cache,
    kv_token_bytes,
    num_kv_blocks,
)
from jaxserve.engine.model_runner import ModelRunner
from jaxserve.engine.scheduler import Scheduler
from jaxserve.engine.step_shapes import MIN_DECODE_ROWS, MIN_TOKEN_BUCKET, pow2_buckets
from jaxserve.engine.warmup import WarmUp
from jaxserve.models.config import ModelConfig
from jaxserve.models.loader import load_config, load_model
from jaxserve.observability.peaks import Peak, engine_peak

if TYPE_CHECKING:
    from jaxserve.eplb.controller import EplbController

logger = logging.getLogger(__name__)

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def enable_compilation_cache(cache_dir: str | None) -> None:
    """Turn on JAX's persistent compilation cache in `cache_dir` (None: leave it off).

    Every executable is cached, however fast it compiled: start-up compiles dozens of
    small buckets and a warm restart should load all of them.
    """
    if not cache_dir:
        return
    os.makedirs(cache_dir, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


@dataclass(slots=True)
class EngineParts:
    """What `build_engine` built, ready to serve.

    model_config: the model's config; mesh: its (dp, tp) mesh (one device: 1 x 1).
    max_model_len: the effective limit (one sequence fits in one dp rank's KV pool).
    async_scheduling: whether the engine overlaps host and device work: the config's
        setting, or for None the backend's default (`config.resolve_async_scheduling`:
        on for an accelerator, off for the CPU). Resolved here, once.
    num_blocks: KV blocks of one dp rank, its null block included.
    scheduler: the `Scheduler` over one `BlockManager` per dp rank.
    runner: the compiled `ModelRunner`.
    warmup: its `WarmUp`: with background compilation, the shapes still compiling and
        the budget the schedulers run under meanwhile (`poll` before each decision).
    eplb_config: the EPLB settings in force (`check_eplb`); eplb: the controller, or
        None when EPLB is off.
    compile_time_s / startup_time_s: seconds compiling the steps (before ready: with
        background compilation, the first tier only) / building it all.
    compiles_at_ready: `CompileCounter.count` once built (the base of the engine's
        num_compilations).
    peak: the mesh's peak bandwidth and FLOP/s (`peaks.engine_peak`), or None.
    """

    model_config: ModelConfig
    mesh: jax.sharding.Mesh
    max_model_len: int
    async_scheduling: bool
    num_blocks: int
    scheduler: Scheduler
    runner: ModelRunner
    warmup: WarmUp
    eplb_config: EplbConfig
    eplb: EplbController | None
    compile_time_s: float
    startup_time_s: float
    compiles_at_ready: int
    peak: Peak | None


def build_engine(config: EngineConfig) -> EngineParts:
    """Load, size, build and compile an engine for `config`.

    On a mesh larger than dp=1,tp=1 the model is sharded over it (`sharding.load`) with
    the MoE replicated-token threshold measured at the engine's step sizes; on one
    device (a 1 x 1 mesh) it is the plain model, with no mesh-dependent parts. Each dp
    rank has its own KV pool in the scheduler (cache.num_blocks counts one rank's pool).

    Raises:
        ValueError: a config field is out of range (named in the message), e.g. dtype,
            a block_size that is not a power of two up to 256 (`CacheConfig.validate`),
            max_model_len above the model's max_position_embeddings, or a max_model_len
            given explicitly that one dp rank's KV pool cannot hold (`fit_kv_cache`).
        MeshError (a ValueError): the mesh cannot be built or cannot hold the model.
        ValueError: eplb.num_redundant_experts makes the expert slots not divisible by
            dp * tp, or EPLB with several processes.
    """
    if config.dtype not in DTYPES:
        raise ValueError(f"dtype: expected one of {sorted(DTYPES)}, got {config.dtype!r}")
    enable_compilation_cache(config.compilation_cache_dir)
    CompileCounter.install()
    start = time.perf_counter()

    dtype = DTYPES[config.dtype]
    sc, cc = config.scheduler, config.cache
    cc.validate()
    eplb_config = check_eplb(config)
    if sc.max_model_len is not None and cc.num_blocks is not None:
        # Both given: fail before loading the weights.
        fit_kv_cache(sc.max_model_len, True, cc.num_blocks, cc.block_size)
    model, mc, mesh = _load_on_mesh(config, dtype)
    dp = config.mesh.dp
    max_model_len = check_max_model_len(sc.max_model_len, mc.max_position_embeddings)
    # Blocks per dp rank (each rank's pool has its own null block 0).
    # What the cache holds per token is the model's declaration (per-head K/V, MLA latent).
    kv_layout = model.kv_layout()
    if cc.num_blocks is not None:
        check_num_blocks(
            cc.num_blocks, mc, cc.block_size, dtype, kv_head_shards=config.mesh.tp,
            layout=kv_layout,
        )  # fmt: skip
    num_blocks = cc.num_blocks or num_kv_blocks(
        mc,
        cc.block_size,
        dtype,
        cc.memory_fraction,
        sc.max_num_seqs,
        max_model_len,
        kv_head_shards=config.mesh.tp,
        layout=kv_layout,
    )
    max_model_len = fit_kv_cache(
        max_model_len, sc.max_model_len is not None, num_blocks, cc.block_size
    )
    scheduler = Scheduler(
        [BlockManager(num_blocks, cc.block_size, cc.enable_prefix_caching) for _ in range(dp)],
        max_num_seqs=sc.max_num_seqs,
        max_num_batched_tokens=sc.max_num_batched_tokens,
        max_model_len=max_model_len,
        eos_token_ids=mc.eos_token_ids,
        enable_chunked_prefill=sc.enable_chunked_prefill,
        num_decode_steps=sc.num_decode_steps,
    )
    runner = ModelRunner(
        model,
        mc,
        mesh=mesh,
        num_blocks=dp * num_blocks,
        block_size=cc.block_size,
        max_model_len=max_model_len,
        max_num_seqs=sc.max_num_seqs,
        max_num_batched_tokens=sc.max_num_batched_tokens,
        kv_dtype=dtype,
        num_decode_steps=sc.num_decode_steps,
        expert_load_window=eplb_config.window_size,
    )
    # The steps of a multi-step call follow its row bucket (more for small ones on the CPU).
    scheduler.decode_steps_for_rows = runner.builder.decode_steps_for_rows
    # Built (its move compiled) before the start-up compilations are counted.
    eplb = _build_eplb(config, eplb_config, runner, mesh, mc)
    # Before any step compiles: on the CPU the peak is measured (`peaks.cpu_ceiling`), and
    # beside the compile threads it came out up to 10x low (diagnose reported MFU 1.2-2.1).
    peak = engine_peak(mesh)
    warmup = WarmUp(runner, scheduler, background=config.background_compile)
    compile_time_s = warmup.start()
    async_scheduling = resolve_async_scheduling(sc.async_scheduling, mesh.devices.flat[0].platform)
    parts = EngineParts(
        model_config=mc,
        mesh=mesh,
        max_model_len=max_model_len,
        async_scheduling=async_scheduling,
        num_blocks=num_blocks,
        scheduler=scheduler,
        runner=runner,
        warmup=warmup,
        eplb_config=eplb_config,
        eplb=eplb,
        compile_time_s=compile_time_s,
        startup_time_s=time.perf_counter() - start,
        compiles_at_ready=CompileCounter.count,
        peak=peak,
    )
    logger.info(
        "engine ready in %.1f s: %s, %d usable KV blocks of %d tokens (per dp rank; "
        "one more is the null block), max_model_len %d, KV %d bytes per token (%s), "
        "async scheduling %s%s",
        parts.startup_time_s,
        config.model,
        num_blocks - 1,
        cc.block_size,
        max_model_len,
        kv_token_bytes(mc, dtype, kv_layout),
        kv_layout.label,
        "on" if async_scheduling else "off",
        f" (the {mesh.devices.flat[0].platform} default)" if sc.async_scheduling is None else "",
    )
    return parts


def _build_eplb(
    config: EngineConfig,
    ec: EplbConfig,
    runner: ModelRunner,
    mesh: jax.sharding.Mesh,
    mc: ModelConfig,
) -> EplbController | None:
    """The `EplbController` when EPLB is on and the model has MoE layers, else None."""
    if not ec.enabled:
        return None
    if runner.expert_load is None:
        logger.warning("--enable-eplb: %s has no MoE layers; EPLB is off", config.model)
        return None
    from jaxserve.eplb.controller import EplbController  # noqa: PLC0415

    controller = EplbController(
        runner,
        mesh,
        mc.num_experts,
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


def _load_on_mesh(config: EngineConfig, dtype: jnp.dtype):
    """(model, model config, mesh): the model on config.mesh. On one device (1 x 1) the
    plain model (`models.loader.load_model`: nothing to shard, no expert parallelism to
    calibrate); else sharded (`sharding.load`), with the MoE replicated-token threshold
    config.mesh.ep_replicated_max_tokens, or when that is None measured at the engine's
    step sizes (dp x each token bucket).

    Raises:
        MeshError (a ValueError): the mesh cannot be built or cannot hold the model.
        ValueError: an out-of-range config.mesh field (named: `MeshConfig.validate`).
    """
    from jaxserve.sharding.ep_calibration import measure_replicated_max_tokens  # noqa: PLC0415
    from jaxserve.sharding.load import load_sharded_model  # noqa: PLC0415
    from jaxserve.sharding.mesh import build_mesh_from_config, check_model_fits  # noqa: PLC0415

    config.mesh.validate()
    mesh = build_mesh_from_config(config.mesh)
    if mesh.size == 1:
        model, mc = load_model(config.model, dtype)
        return model, mc, mesh
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
    if mc.num_experts > 0 and config.mesh.ep_replicated_max_tokens is not None:
        threshold = config.mesh.ep_replicated_max_tokens
        logger.info(
            "MoE on dp=%d,tp=%d: replicated-token path for steps of <= %d tokens, all_to_all "
            "above (given by --ep-replicated-max-tokens, not measured)",
            config.mesh.dp,
            config.mesh.tp,
            threshold,
        )
    elif mc.num_experts > 0:
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


def check_eplb(config: EngineConfig) -> EplbConfig:
    """The EPLB settings the engine runs with: config.eplb, validated; turned off (with
    a warning) on one device, where there is no expert parallelism to balance.

    Raises:
        ValueError: an out-of-range field (named). With several processes EPLB runs on
            every process: the leader publishes each new placement on the step channel
            and the followers apply it between the same two steps (`distributed.follow`).
    """
    ec = config.eplb
    ec.validate()
    effective = ec.for_mesh(config.mesh.size)
    if effective is not ec:
        logger.warning(
            "--enable-eplb / --num-redundant-experts: need an expert-parallel mesh "
            "(dp*tp > 1), got dp=1,tp=1; running without EPLB and redundant experts"
        )
    return effective

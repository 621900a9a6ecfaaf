"""The configs that the parsed `jaxserve serve` flags (serve_args.py) make: `engine_config`
and `server_config` turn them into `EngineConfig` / `ServerConfig`, checking what needs
no device (contradictory flags raise ValueError naming them). `jaxserve engine` makes
its EngineConfig here too. No JAX here.
"""

from __future__ import annotations

import argparse
import os

from jaxserve.config import (
    DEMO_MODEL_DIR,
    CacheConfig,
    EngineConfig,
    EplbConfig,
    MeshConfig,
    SchedulerConfig,
    ServerConfig,
    resolve_dtype,
)


def mesh_config(args: argparse.Namespace) -> MeshConfig:
    """--mesh, or vLLM's --data-parallel-size / --tensor-parallel-size; both forms must
    agree when both are given. Raises ValueError naming the flags."""
    mesh = MeshConfig.parse(args.mesh) if args.mesh is not None else MeshConfig()
    for flag, field, value in (
        ("--data-parallel-size", "dp", args.data_parallel_size),
        ("--tensor-parallel-size", "tp", args.tensor_parallel_size),
    ):
        if value is None:
            continue
        if args.mesh is not None and getattr(mesh, field) != value:
            raise ValueError(
                f"{flag} {value} contradicts --mesh {args.mesh} ({field}={getattr(mesh, field)});"
                " give one of them"
            )
        setattr(mesh, field, value)
    mesh.ep_replicated_max_tokens = args.ep_replicated_max_tokens
    return mesh


def model_argument(args: argparse.Namespace) -> str:
    """The model the user named: `serve MODEL` or `--model MODEL` (the demo if neither).
    Raises ValueError when both are given and differ, or one is given empty (`serve ""`
    served the demo, as if no model were named)."""
    for given in (args.model_tag, args.model):
        if given is not None and not given.strip():
            raise ValueError(f"model: empty, got {given!r} (leave it out for the demo model)")
    if args.model_tag and args.model and args.model_tag != args.model:
        raise ValueError(
            f"model: given twice, as {args.model_tag!r} (positional) and --model {args.model!r}"
        )
    return args.model_tag or args.model or str(DEMO_MODEL_DIR)


def engine_config(args: argparse.Namespace, model: str | None = None) -> EngineConfig:
    """EngineConfig from the serve flags; an unset flag keeps the config default.

    model: the local folder to serve (the resolved Hub snapshot of a model id); by
    default the model argument as given. --dtype auto is resolved from its config.json.
    Raises ValueError naming the flag of a bad or contradictory value.
    """

    def given(**kw):
        return {k: v for k, v in kw.items() if v is not None}

    named = model_argument(args)
    model = model or named
    cache = CacheConfig(
        **given(
            block_size=args.block_size,
            num_blocks=args.num_blocks,
            memory_fraction=args.gpu_memory_utilization,
        ),
        enable_prefix_caching=args.enable_prefix_caching is not False,
    )
    scheduler = SchedulerConfig(
        **given(
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=args.max_model_len,
            async_scheduling=args.async_scheduling,
            num_decode_steps=args.num_decode_steps,
            stream_interval=args.stream_interval,
            burst_gather_ms=args.burst_gather_ms,
        )
    )
    if scheduler.max_num_batched_tokens < scheduler.max_num_seqs:
        # The scheduler's rule, found here before any process starts (it was found by the
        # engine after loading the weights).
        raise ValueError(
            f"max-num-batched-tokens: must be >= --max-num-seqs ({scheduler.max_num_seqs}), "
            f"got {scheduler.max_num_batched_tokens}"
        )
    eplb = EplbConfig(
        enabled=args.enable_eplb,
        **given(
            num_redundant_experts=args.num_redundant_experts,
            window_size=args.eplb_window_size,
            step_interval=args.eplb_step_interval,
            min_improvement=args.eplb_min_improvement,
        ),
    )
    eplb.validate()
    # Reported name (GetServerInfo, metrics): the flag, else the id or folder name typed.
    served = args.served_model_name or (
        os.path.basename(os.path.normpath(named)) if os.path.isdir(named) else named
    )
    config = EngineConfig(
        model=model,
        cache=cache,
        scheduler=scheduler,
        mesh=mesh_config(args),
        eplb=eplb,
        dtype=resolve_dtype(args.dtype, model),
        served_model_name=served,
        **given(seed=args.seed),
    )
    config.background_compile = not args.compile_all_at_start
    if args.no_compilation_cache:
        config.compilation_cache_dir = None
    elif args.compilation_cache_dir is not None:
        config.compilation_cache_dir = args.compilation_cache_dir
    return config


def server_config(args: argparse.Namespace) -> ServerConfig:
    """ServerConfig from the serve flags."""
    return ServerConfig(
        host=args.host,
        port=args.port,
        metrics_port=args.metrics_port,
        http_port=args.http_port,
        chat_template=args.chat_template,
        stats_log_interval_s=0.0 if args.disable_log_stats else args.stats_log_interval,
    )

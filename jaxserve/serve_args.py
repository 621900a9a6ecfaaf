"""The flags of `jaxserve serve` and the configs they make: ours, with vLLM's names beside
them where the meaning is the same (`--tensor-parallel-size`, `--max-model-len`,
`--gpu-memory-utilization`, ...), and the positional MODEL of `vllm serve MODEL`. Every
help text says its default (tests/test_cli.py checks it).

`add_serve_arguments` declares them (grouped as `--help` shows them); `engine_config` and
`server_config` turn the parsed flags into `EngineConfig` / `ServerConfig`. No JAX here.
"""

from __future__ import annotations

import argparse
import os

from jaxserve import distributed
from jaxserve.config import (
    DEFAULT_MEMORY_FRACTION,
    DEMO_MODEL_DIR,
    DTYPE_CHOICES,
    MAX_STREAM_INTERVAL,
    CacheConfig,
    EngineConfig,
    EplbConfig,
    MeshConfig,
    SchedulerConfig,
    ServerConfig,
    block_size_error,
    resolve_dtype,
)


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


def _int_at_least(low: int, high: int | None = None):
    """An argparse type: an int in [low, high], else a usage error naming the range."""
    bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
    return _bounded_int(low, high, not_int="not an integer", bound=bound)


PORT = _int_at_least(0, 65535)
POSITIVE = _int_at_least(1)


def _block_size(text: str) -> int:
    """An argparse type: a KV block size the engine takes (`config.block_size_error`)."""
    value = POSITIVE(text)
    error = block_size_error(value)
    if error:
        raise argparse.ArgumentTypeError(error)
    return value


def _model_name(text: str) -> str:
    """An argparse type: a non-empty model name (what clients send as `model`)."""
    if not text.strip():
        raise argparse.ArgumentTypeError(
            "must not be empty (clients name the model with it; leave the flag out to use "
            "the model id or folder name)"
        )
    return text


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
    return mesh


def model_argument(args: argparse.Namespace) -> str:
    """The model the user named: `serve MODEL` or `--model MODEL` (the demo if neither).
    Raises ValueError when both are given and differ."""
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


def _non_negative_float(text: str) -> float:
    """An argparse type: a finite float >= 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0.0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def positive_float(text: str) -> float:
    """An argparse type: a finite float > 0 (seconds of a timeout or a capture; NaN,
    inf, 0 and negatives are usage errors naming the flag, not a call that fails later)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0.0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


INT32 = (-(2**31), 2**31 - 1)
INT64 = (-(2**63), 2**63 - 1)


def int_within(low: int, high: int):
    """An argparse type: an int in [low, high], the range of the request field it fills
    (a proto int32 or int64), so that a value out of it is a usage error naming the flag
    and the range, as the HTTP API says it, not protobuf's "Value out of range"."""
    return _bounded_int(low, high, not_int="invalid int value", bound=f"within [{low}, {high}]")


def _fraction_open(text: str) -> float:
    """An argparse type: a float in (0, 1]."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {value}")
    return value


def _fraction(text: str) -> float:
    """An argparse type: a float in [0, 1)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {value}")
    return value


def _add_eplb_arguments(s: argparse.ArgumentParser) -> None:
    """The EPLB flags of `serve` (vLLM's names; see `config.EplbConfig`)."""
    s.add_argument(
        "--enable-eplb",
        action="store_true",
        help="re-place MoE experts by their measured load (needs a mesh with dp*tp > 1) "
        "(default: off)",
    )
    s.add_argument(
        "--num-redundant-experts",
        type=_int_at_least(0),
        metavar="R",
        help="extra expert slots per MoE layer for replicas (E + R divisible by dp*tp) "
        f"(default: {EplbConfig().num_redundant_experts})",
    )
    s.add_argument(
        "--eplb-window-size",
        type=POSITIVE,
        metavar="STEPS",
        help=f"engine steps of the expert-load window (default: {EplbConfig().window_size})",
    )
    s.add_argument(
        "--eplb-step-interval",
        type=POSITIVE,
        metavar="STEPS",
        help=f"engine steps between re-placements (default: {EplbConfig().step_interval})",
    )
    s.add_argument(
        "--eplb-min-improvement",
        type=_fraction,
        metavar="F",
        help="re-place a layer only if its peak device load drops by more than F "
        f"(default: {EplbConfig().min_improvement:g})",
    )


_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def _log_level(text: str) -> str:
    """An argparse type: a logging level name, any case."""
    if text.upper() not in _LOG_LEVELS:
        raise argparse.ArgumentTypeError(
            f"unknown log level {text!r}; expected one of {', '.join(_LOG_LEVELS)} (any case)"
        )
    return text.upper()


def add_serve_arguments(s: argparse.ArgumentParser) -> None:
    """The flags of `serve`: ours, with vLLM's names beside them where they mean the same.
    Every help text says the default."""
    cache, sched, eng = CacheConfig(), SchedulerConfig(), EngineConfig()
    m = s.add_argument_group("model")
    m.add_argument(
        "model_tag",
        nargs="?",
        metavar="MODEL",
        help="HF model folder, `jaxserve convert` folder or Hugging Face model id "
        "(org/name[@revision], from the HF cache or downloaded; honours HF_HOME and "
        "HF_HUB_OFFLINE) (default: the bundled demo model)",
    )
    m.add_argument("--model", help="the same as the positional MODEL (default: the demo model)")
    m.add_argument(
        "--served-model-name",
        type=_model_name,
        metavar="NAME",
        help="model name reported by GetServerInfo and the metrics (default: the model id "
        "or folder name given)",
    )
    m.add_argument(
        "--dtype",
        choices=DTYPE_CHOICES,
        default="auto",
        help="weight and activation dtype; auto takes the checkpoint's config.json dtype "
        "(float32 stays float32) (default: %(default)s)",
    )
    m.add_argument(
        "--seed", type=_int_at_least(0), help=f"sampling seed of the engine (default: {eng.seed})"
    )

    srv = s.add_argument_group("server")
    srv.add_argument(
        "--host",
        default=ServerConfig().host,
        help="bind address, IPv4, IPv6 (::1) or a name (default: %(default)s)",
    )
    srv.add_argument(
        "--port", type=PORT, default=ServerConfig().port, help="gRPC port; 0 picks a free "
        "port (default: %(default)s)"
    )  # fmt: skip
    srv.add_argument(
        "--metrics-port",
        type=PORT,
        help="serve Prometheus /metrics on this port (default: off)",
    )
    srv.add_argument(
        "--http-port",
        type=PORT,
        help="serve the OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, "
        "...) on this port; 0 picks a free one (default: off)",
    )
    srv.add_argument(
        "--chat-template",
        metavar="FILE",
        help="Jinja chat template (or a JSON file with a chat_template entry) replacing "
        "the model's, for /v1/chat/completions; needs --http-port (default: the model "
        "folder's)",
    )
    srv.add_argument(
        "--stats-log-interval",
        type=_non_negative_float,
        metavar="SECONDS",
        default=ServerConfig().stats_log_interval_s,
        help="seconds between the stats log lines while serving (throughput, requests, KV "
        "usage, prefix-cache hits, preemptions); 0 turns them off (default: %(default)s)",
    )
    srv.add_argument(
        "--disable-log-stats",
        action="store_true",
        help="no stats log lines, as --stats-log-interval 0 (default: off)",
    )
    srv.add_argument(
        "--log-level",
        type=_log_level,
        default="INFO",
        help="DEBUG, INFO, WARNING, ERROR or CRITICAL; DEBUG also prints tracebacks of "
        "start-up errors (default: %(default)s)",
    )

    kv = s.add_argument_group("KV cache")
    kv.add_argument(
        "--block-size",
        type=_block_size,
        help="tokens per KV block, a power of two up to 256; the GPU kernels take 8 or more "
        f"(default: {cache.block_size})",
    )
    kv.add_argument(
        "--num-blocks",
        type=_int_at_least(2),
        metavar="N",
        help="KV blocks per dp rank, one of them reserved (the null block), so N - 1 are "
        "usable (default: from --gpu-memory-utilization; on the CPU without it, enough for "
        "--max-num-seqs requests of --max-model-len tokens, capped at 256 MiB)",
    )
    kv.add_argument(
        "--gpu-memory-utilization",
        "--kv-memory-fraction",
        type=_fraction_open,
        metavar="F",
        help="fraction of the memory left after the weights that the KV cache takes: the "
        "device's on a GPU, the host's available memory on the CPU (default: "
        f"{DEFAULT_MEMORY_FRACTION} on a GPU; on the CPU see --num-blocks)",
    )
    kv.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="reuse the KV blocks of shared prompt prefixes (default: on)",
    )
    kv.add_argument(
        "--no-prefix-caching",
        dest="enable_prefix_caching",
        action="store_false",
        help="the same as --no-enable-prefix-caching",
    )

    sc = s.add_argument_group("scheduler")
    sc.add_argument(
        "--max-num-seqs",
        type=POSITIVE,
        help=f"most requests in one step, per dp rank (default: {sched.max_num_seqs})",
    )
    sc.add_argument(
        "--max-num-batched-tokens",
        type=POSITIVE,
        help=f"token budget of one step (default: {sched.max_num_batched_tokens})",
    )
    sc.add_argument(
        "--max-model-len",
        type=_int_at_least(2),
        help="most tokens (prompt + output) per request (default: the model's "
        "max_position_embeddings, lowered to what the KV cache holds)",
    )
    sc.add_argument(
        "--num-decode-steps",
        type=_int_at_least(1, 64),
        metavar="N",
        help="decode steps per device call while every running request decodes; 1 "
        f"disables multi-step decode (default: {sched.num_decode_steps}; on the CPU, "
        "batches of up to 8 rows run 2-4x more)",
    )
    sc.add_argument(
        "--stream-interval",
        type=_int_at_least(1, MAX_STREAM_INTERVAL),
        metavar="N",
        help="tokens a stream message carries at least (a request's first and last "
        "excepted): fewer, larger messages cost the frontend, sidecar and client less CPU "
        f"per token, at the price of smoothness (default: {sched.stream_interval}, every "
        "engine step's tokens at once)",
    )
    sc.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="schedule and pack the next step while the device runs this one (default: "
        "on for a GPU or other accelerator, off for the CPU, where both share the cores)",
    )

    par = s.add_argument_group("parallelism")
    par.add_argument(
        "--mesh",
        help="device mesh dp=D,tp=T: attention data parallel x tensor parallel, experts "
        "over all D*T devices (default: dp=1,tp=1)",
    )
    par.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=POSITIVE,
        metavar="T",
        help="the tp of --mesh (default: 1)",
    )
    par.add_argument(
        "--data-parallel-size",
        "-dp",
        type=POSITIVE,
        metavar="D",
        help="the dp of --mesh (default: 1)",
    )
    par.add_argument(
        "--enable-expert-parallel",
        action="store_true",
        help="accepted for vLLM compatibility: here MoE experts are always expert parallel "
        "over all dp*tp devices (default: on, cannot be turned off)",
    )
    _add_eplb_arguments(s.add_argument_group("EPLB (expert-parallel load balancing)"))

    comp = s.add_argument_group("compilation")
    comp.add_argument(
        "--compilation-cache-dir",
        help=f"JAX persistent compilation cache (default: {eng.compilation_cache_dir})",
    )
    comp.add_argument(
        "--no-compilation-cache",
        action="store_true",
        help="do not read or write the persistent compilation cache (default: off)",
    )
    comp.add_argument(
        "--compile-all-at-start",
        action="store_true",
        help="compile every step shape before serving (default: off: serve once the "
        "smallest shapes are compiled and compile the others in the background, with "
        "smaller steps until they are ready; jaxserve/engine/warmup.py)",
    )
    from jaxserve.router.cli_args import add_router_arguments  # noqa: PLC0415

    add_router_arguments(s)  # --replicas, --router-policy, ... (jaxserve.router)
    # module:Class run instead of EngineCore; used by tests to serve a mock engine.
    s.add_argument("--engine-class", help=argparse.SUPPRESS)
    distributed.add_arguments(s)


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

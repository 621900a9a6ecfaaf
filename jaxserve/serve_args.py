"""The flags of `jaxserve serve`: ours, with vLLM's names beside them where the meaning
is the same (`--tensor-parallel-size`, `--max-model-len`, `--gpu-memory-utilization`,
...), and the positional MODEL of `vllm serve MODEL`. Every help text says its default
(tests/test_cli_usage.py checks it).

`add_serve_arguments` declares them, grouped as `--help` shows them; their value types
are flag_types.py's, the configs they make serve_config.py's. No JAX here.
"""

from __future__ import annotations

import argparse

from jaxserve import distributed
from jaxserve.config import (
    DEFAULT_MEMORY_FRACTION,
    DTYPE_CHOICES,
    MAX_STREAM_INTERVAL,
    CacheConfig,
    EngineConfig,
    EplbConfig,
    SchedulerConfig,
    ServerConfig,
)
from jaxserve.flag_types import (
    PORT,
    POSITIVE,
    block_size,
    fraction,
    fraction_open,
    int_at_least,
    log_level,
    model_name,
    non_negative_float,
)


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
        type=int_at_least(0),
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
        type=fraction,
        metavar="F",
        help="re-place a layer only if its peak device load drops by more than F "
        f"(default: {EplbConfig().min_improvement:g})",
    )


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
        type=model_name,
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
        "--seed", type=int_at_least(0), help=f"sampling seed of the engine (default: {eng.seed})"
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
        help="serve Prometheus /metrics on this port; 0 picks a free one (default: off)",
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
        type=non_negative_float,
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
        type=log_level,
        default="INFO",
        help="DEBUG, INFO, WARNING, ERROR or CRITICAL; DEBUG also prints tracebacks of "
        "start-up errors (default: %(default)s)",
    )

    kv = s.add_argument_group("KV cache")
    kv.add_argument(
        "--block-size",
        type=block_size,
        help="tokens per KV block, a power of two up to 256; the GPU kernels take 8 or more "
        f"(default: {cache.block_size})",
    )
    kv.add_argument(
        "--num-blocks",
        type=int_at_least(2),
        metavar="N",
        help="KV blocks per dp rank, one of them reserved (the null block), so N - 1 are "
        "usable (default: from --gpu-memory-utilization; on the CPU without it, enough for "
        "--max-num-seqs requests of --max-model-len tokens, capped at 256 MiB)",
    )
    kv.add_argument(
        "--gpu-memory-utilization",
        "--kv-memory-fraction",
        type=fraction_open,
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
        help="the same as --no-enable-prefix-caching (default: off: prefix caching on)",
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
        type=int_at_least(2),
        help="most tokens (prompt + output) per request (default: the model's "
        "max_position_embeddings, lowered to what the KV cache holds)",
    )
    sc.add_argument(
        "--num-decode-steps",
        type=int_at_least(1, 64),
        metavar="N",
        help="decode steps per device call while every running request decodes; 1 "
        f"disables multi-step decode (default: {sched.num_decode_steps}; on the CPU, "
        "2x more, 4x at batch 1)",
    )
    sc.add_argument(
        "--stream-interval",
        type=int_at_least(1, MAX_STREAM_INTERVAL),
        metavar="N",
        help="tokens a stream message carries at least (a request's first and last "
        "excepted): fewer, larger messages cost the frontend, sidecar and client less CPU "
        f"per token, at the price of smoothness (default: {sched.stream_interval}, every "
        "engine step's tokens at once)",
    )
    sc.add_argument(
        "--burst-gather-ms",
        type=non_negative_float,
        metavar="MS",
        help="an idle engine that receives a request waits while more keep arriving, each "
        "within MS of the last (at most 0.1 s in all), and prefills them in one step "
        "instead of several: a burst's throughput for up to MS more time to first token "
        "(default: 2 on the CPU, 0 (off) on an accelerator)",
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
    par.add_argument(
        "--ep-replicated-max-tokens",
        type=int_at_least(0),
        metavar="N",
        help="MoE steps of at most N tokens (all dp ranks together) take the "
        "replicated-token path, larger ones all_to_all; 0: always all_to_all. Given, "
        "start-up skips timing both paths and every run picks the same ones (default: "
        "measured at start-up on the mesh)",
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

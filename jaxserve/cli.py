"""The `jaxserve` command.

    jaxserve serve [--model DIR] [--host H] [--port P] [--block-size N] [--max-num-seqs N] ...
    jaxserve generate [--server HOST:PORT] [--max-tokens N] [--temperature T] ... "prompt"

Each subcommand is a `_cmd_*` function registered in `build_parser`. Imports that pull in
heavy libraries stay inside the command functions, and none of them imports JAX in this
process (the engine process does).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from jaxserve import convert, distributed
from jaxserve.config import (
    DEFAULT_MEMORY_FRACTION,
    DEMO_MODEL_DIR,
    DTYPE_CHOICES,
    CacheConfig,
    EngineConfig,
    EplbConfig,
    MeshConfig,
    SchedulerConfig,
    ServerConfig,
    resolve_dtype,
)
from jaxserve.hub import resolve_model
from jaxserve.logs import configure_logging, describe_error


def _int_at_least(low: int, high: int | None = None):
    """An argparse type: an int in [low, high], else a usage error naming the range."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if value < low or (high is not None and value > high):
            bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
            raise argparse.ArgumentTypeError(f"must be {bound}, got {value}")
        return value

    return parse


class _Parser(argparse.ArgumentParser):
    """argparse, with a usage error as one line (`jaxserve serve: error: ...`), not the
    whole usage block of a command with dozens of flags before it."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("jaxserve")
    except PackageNotFoundError:
        return "unknown (not installed)"


PORT = _int_at_least(0, 65535)
POSITIVE = _int_at_least(1)


def _mesh_config(args: argparse.Namespace) -> MeshConfig:
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


def _model_argument(args: argparse.Namespace) -> str:
    """The model the user named: `serve MODEL` or `--model MODEL` (the demo if neither).
    Raises ValueError when both are given and differ."""
    if args.model_tag and args.model and args.model_tag != args.model:
        raise ValueError(
            f"model: given twice, as {args.model_tag!r} (positional) and --model {args.model!r}"
        )
    return args.model_tag or args.model or str(DEMO_MODEL_DIR)


def _engine_config(args: argparse.Namespace, model: str | None = None) -> EngineConfig:
    """EngineConfig from the serve flags; an unset flag keeps the config default.

    model: the local folder to serve (the resolved Hub snapshot of a model id); by
    default the model argument as given. --dtype auto is resolved from its config.json.
    Raises ValueError naming the flag of a bad or contradictory value.
    """

    def given(**kw):
        return {k: v for k, v in kw.items() if v is not None}

    named = _model_argument(args)
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
        )
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
        mesh=_mesh_config(args),
        eplb=eplb,
        dtype=resolve_dtype(args.dtype, model),
        served_model_name=served,
        **given(seed=args.seed),
    )
    if args.no_compilation_cache:
        config.compilation_cache_dir = None
    elif args.compilation_cache_dir is not None:
        config.compilation_cache_dir = args.compilation_cache_dir
    return config


def _fail(error: BaseException, code: int, dist=None) -> int:
    """`serve`'s end after a start-up error: one line on stderr naming the cause (the
    traceback too at --log-level debug). Process 0 of a multi-process run then tells its
    followers (`jaxserve.start_status`), so that they end too. Returns `code`."""
    logging.getLogger("jaxserve").debug("start-up error", exc_info=error)
    line = describe_error(error)
    print(f"jaxserve serve: error: {line}", file=sys.stderr, flush=True)
    if dist is not None and dist.is_leader:
        from jaxserve.start_status import announce_failure

        announce_failure(dist, line)
    return code


def _leader_failed(cause: str) -> None:
    """A follower's end when process 0 announced that its start failed."""
    print(
        f"jaxserve serve: error: process 0 (the leader) failed to start: {cause}",
        file=sys.stderr,
        flush=True,
    )
    logging.shutdown()
    os._exit(2)  # now, from the watcher thread: the main thread may be inside JAX


def _cmd_serve(args: argparse.Namespace) -> int:
    from jaxserve import preflight
    from jaxserve.launcher import serve

    # The frontend; a follower process (below) runs its engine steps in this process.
    configure_logging(args.log_level, "frontend")
    try:
        dist = distributed.from_arguments(args)
    except ValueError as e:
        return _fail(e, 2)
    if dist is not None and not dist.is_leader:
        from jaxserve.start_status import watch_leader

        watch_leader(dist, _leader_failed)
    try:
        config = _engine_config(args, model=resolve_model(_model_argument(args)))
        # Mistakes that need no device, found before any process starts (exit code 2).
        preflight.check_model_folder(config.model, check_model=args.engine_class is None)
        if dist is not None and config.eplb.enabled:
            raise ValueError(
                "--enable-eplb: not supported with several processes yet (the followers "
                "would need every new expert placement)"
            )
    except (ValueError, OSError) as e:
        return _fail(e, 2, dist)
    if dist is not None and not dist.is_leader:
        # Processes 1..N-1 serve no clients: they run process 0's steps, in this process.
        from jaxserve.engine.process import run_follower

        return run_follower(config, dist)
    # The engine process joins the run where this process stands (heartbeat included).
    dist_args = dist.to_arguments() if dist is not None else []
    server = ServerConfig(
        host=args.host,
        port=args.port,
        metrics_port=args.metrics_port,
        stats_log_interval_s=0.0 if args.disable_log_stats else args.stats_log_interval,
    )
    try:
        preflight.check_bind("port", server.host, server.port)
        if server.metrics_port is not None:
            preflight.check_bind("metrics-port", server.host, server.metrics_port)
        return serve(
            config,
            server,
            engine_class=args.engine_class,
            log_level=args.log_level,
            distributed_args=dist_args,
        )
    except (OSError, ValueError, RuntimeError) as e:
        return _fail(e, 1, dist)


def _cmd_generate(args: argparse.Namespace) -> int:
    import grpc

    from jaxserve.frontend.client import JaxserveClient

    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    params = dict(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        seed=args.seed,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
    )
    if args.n is not None:
        params["n"] = args.n
    last = None
    completions = []
    with JaxserveClient(args.server) as client:
        try:
            if args.n is not None and args.n > 1:
                # n samples interleave in the stream: print each whole once all are done.
                completions = client.complete(prompt, timeout=args.timeout, **params)
                _print_samples(completions)
            else:
                for delta in client.generate(prompt, timeout=args.timeout, **params):
                    sys.stdout.write(delta.text)
                    sys.stdout.flush()
                    last = delta
                # End the output with a newline, terminal or pipe, as `llm` does: the
                # shell prompt starts on its own line, and a file of it is a text file.
                sys.stdout.write("\n")
                sys.stdout.flush()
        except grpc.RpcError as e:
            print(f"\njaxserve generate: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:  # leaving the loop cancelled the request on the server
            print(file=sys.stderr)
            return 130
        except BrokenPipeError:  # e.g. `| head`: the reader is gone, so is the output
            # Point stdout at /dev/null so the interpreter's final flush cannot fail too
            # (the recipe in Python's signal module documentation).
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 141
    if args.verbose:
        for c in completions or ([last] if last is not None else []):
            print(_summary(c, len(completions) > 1), file=sys.stderr)
    return 0


def _summary(result, with_index: bool) -> str:
    """The `-v` line of one sample (a GenerateDelta or a Completion): how it finished and
    its token counts."""
    sample = f"sample={result.index} " if with_index else ""
    return (
        f"[{sample}finish_reason={result.finish_reason} stop_reason={result.stop_reason!r} "
        f"prompt_tokens={result.prompt_tokens} completion_tokens={result.completion_tokens}]"
    )


def _print_samples(completions) -> None:
    """Each sample of an n > 1 request under a header naming its index and finish."""
    for c in completions:
        print(f"--- sample {c.index} (finish_reason={c.finish_reason}) ---")
        print(c.text)


def _non_negative_float(text: str) -> float:
    """An argparse type: a finite float >= 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0.0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


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
        help=f"engine steps of the expert-load window (default {EplbConfig().window_size})",
    )
    s.add_argument(
        "--eplb-step-interval",
        type=POSITIVE,
        metavar="STEPS",
        help=f"engine steps between re-placements (default {EplbConfig().step_interval})",
    )
    s.add_argument(
        "--eplb-min-improvement",
        type=_fraction,
        metavar="F",
        help="re-place a layer only if its peak device load drops by more than F "
        f"(default {EplbConfig().min_improvement:g})",
    )


_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def _log_level(text: str) -> str:
    """An argparse type: a logging level name, any case."""
    if text.upper() not in _LOG_LEVELS:
        raise argparse.ArgumentTypeError(
            f"unknown log level {text!r}; expected one of {', '.join(_LOG_LEVELS)} (any case)"
        )
    return text.upper()


def _add_serve_arguments(s: argparse.ArgumentParser) -> None:
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
    m.add_argument("--seed", type=int, help=f"sampling seed of the engine (default: {eng.seed})")

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
        type=POSITIVE,
        help=f"tokens per KV block (default: {cache.block_size})",
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
    # module:Class run instead of EngineCore; used by tests to serve a mock engine.
    s.add_argument("--engine-class", help=argparse.SUPPRESS)
    distributed.add_arguments(s)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="jaxserve", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    s = sub.add_parser("serve", help="serve a model over gRPC")
    _add_serve_arguments(s)
    s.set_defaults(func=_cmd_serve)

    g = sub.add_parser("generate", help="stream a completion from a server to the terminal")
    g.add_argument("prompt", help='prompt text ("-" reads stdin)')
    g.add_argument("--server", default=f"{ServerConfig().host}:{ServerConfig().port}")
    g.add_argument("--max-tokens", type=int)
    g.add_argument("--temperature", type=float)
    g.add_argument("--top-k", type=int)
    g.add_argument("--top-p", type=float)
    g.add_argument("--min-p", type=float)
    g.add_argument("--seed", type=int)
    g.add_argument("-n", "--n", type=int, help="samples of the prompt (printed one by one)")
    g.add_argument(
        "--stop",
        action="append",
        default=[],
        help="stop string (repeatable; a shell passes \\n literally: use $'\\n')",
    )
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--timeout", type=float, help="seconds for the whole call")
    g.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="print each sample's finish reason and token counts to stderr",
    )
    g.set_defaults(func=_cmd_generate)

    convert.add_subparser(sub)  # `jaxserve convert`: HF folder -> Orbax checkpoint
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    sys.exit(args.func(args))


if __name__ == "__main__":
    main()

"""The `jaxserve` command.

    jaxserve serve [--model DIR] [--host H] [--port P] [--block-size N] [--max-num-seqs N] ...
    jaxserve generate [--server HOST:PORT] [--max-tokens N] [--temperature T] ... "prompt"
    jaxserve bench [--server HOST:PORT] [--dataset random] [--request-rate R] ... (benchmark/)

Each subcommand is a `_cmd_*` function registered in `build_parser`. Imports that pull in
heavy libraries stay inside the command functions, and none of them imports JAX in this
process (the engine process does).
"""

from __future__ import annotations

import argparse
import os
import sys

from jaxserve import convert, distributed
from jaxserve.benchmark import cli as bench_cli
from jaxserve.config import (
    DEMO_MODEL_DIR,
    CacheConfig,
    EngineConfig,
    EplbConfig,
    MeshConfig,
    SchedulerConfig,
    ServerConfig,
)
from jaxserve.logs import configure_logging


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


PORT = _int_at_least(0, 65535)
POSITIVE = _int_at_least(1)


def _engine_config(args: argparse.Namespace) -> EngineConfig:
    """EngineConfig from the serve flags; an unset flag keeps the config default."""

    def given(**kw):
        return {k: v for k, v in kw.items() if v is not None}

    cache = CacheConfig(
        **given(block_size=args.block_size, num_blocks=args.num_blocks),
        enable_prefix_caching=not args.no_prefix_caching,
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
    config = EngineConfig(
        model=args.model,
        cache=cache,
        scheduler=scheduler,
        mesh=MeshConfig.parse(args.mesh),
        eplb=eplb,
        **given(dtype=args.dtype, seed=args.seed),
    )
    if args.no_compilation_cache:
        config.compilation_cache_dir = None
    elif args.compilation_cache_dir is not None:
        config.compilation_cache_dir = args.compilation_cache_dir
    return config


def _cmd_serve(args: argparse.Namespace) -> int:
    from jaxserve.launcher import serve

    # The frontend; a follower process (below) runs its engine steps in this process.
    configure_logging(args.log_level, "frontend")
    try:
        config = _engine_config(args)
    except ValueError as e:
        print(f"jaxserve serve: error: {e}", file=sys.stderr)
        return 2
    try:
        dist = distributed.from_arguments(args)
    except ValueError as e:
        print(f"jaxserve serve: error: {e}", file=sys.stderr)
        return 2
    if dist is not None and config.eplb.enabled:
        print(
            "jaxserve serve: error: --enable-eplb: not supported with several processes "
            "yet (the followers would need every new expert placement)",
            file=sys.stderr,
        )
        return 2
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
        http_port=args.http_port,
        chat_template=args.chat_template,
    )
    try:
        options = _frontend_options(args)
    except ValueError as e:
        print(f"jaxserve serve: error: {e}", file=sys.stderr)
        return 2
    try:
        return serve(
            config,
            server,
            engine_class=args.engine_class,
            log_level=args.log_level,
            distributed_args=dist_args,
            frontend_options=options,
        )
    except (OSError, ValueError, RuntimeError) as e:
        print(f"jaxserve serve: error: {e}", file=sys.stderr)
        return 1


def _frontend_options(args: argparse.Namespace):
    """FrontendOptions from the admission, stall, TLS and API-key flags. Raises
    ValueError naming the flag."""
    from jaxserve.frontend.admission import AdmissionLimits
    from jaxserve.frontend.auth import TlsFiles, resolve_api_key
    from jaxserve.frontend.options import FrontendOptions

    if (args.tls_cert is None) != (args.tls_key is None):
        raise ValueError("tls-cert: --tls-cert and --tls-key go together")
    if args.tls_client_ca is not None and args.tls_cert is None:
        raise ValueError("tls-client-ca: needs --tls-cert and --tls-key")
    tls = None
    if args.tls_cert is not None:
        tls = TlsFiles(args.tls_cert, args.tls_key, args.tls_client_ca)
        tls.read()  # an unreadable file is a usage error, before anything starts
    if not args.stall_timeout_s > 0:
        raise ValueError(f"stall-timeout-s: must be > 0, got {args.stall_timeout_s}")
    return FrontendOptions(
        admission=AdmissionLimits(
            max_requests=args.max_pending_requests,
            max_queued_prompt_tokens=args.max_queued_prompt_tokens,
            max_request_bytes=args.max_inflight_request_bytes,
        ),
        stall_timeout_s=args.stall_timeout_s,
        tls=tls,
        api_key=resolve_api_key(args.api_key, args.api_key_file),
    )


def _add_frontend_arguments(s: argparse.ArgumentParser) -> None:
    """Admission control, stall detection, TLS and API-key flags of `serve` (issue 12)."""
    from jaxserve.frontend.admission import (
        DEFAULT_MAX_QUEUED_PROMPT_TOKENS,
        DEFAULT_MAX_REQUEST_BYTES,
        DEFAULT_MAX_REQUESTS,
    )
    from jaxserve.frontend.liveness import DEFAULT_STALL_TIMEOUT_S

    s.add_argument(
        "--max-pending-requests", type=POSITIVE, default=DEFAULT_MAX_REQUESTS,
        help="most requests (samples) running or waiting; past it RESOURCE_EXHAUSTED "
        "(default %(default)s)",
    )  # fmt: skip
    s.add_argument(
        "--max-queued-prompt-tokens", type=POSITIVE, default=DEFAULT_MAX_QUEUED_PROMPT_TOKENS,
        help="most prompt tokens waiting for prefill (default %(default)s)",
    )  # fmt: skip
    s.add_argument(
        "--max-inflight-request-bytes", type=POSITIVE, default=DEFAULT_MAX_REQUEST_BYTES,
        help="most bytes of open requests held at once (default %(default)s)",
    )  # fmt: skip
    s.add_argument(
        "--stall-timeout-s", type=float, default=DEFAULT_STALL_TIMEOUT_S,
        help="heartbeat silence after which the engine or sidecar counts as stalled: "
        "health NOT_SERVING, requests UNAVAILABLE (default %(default)s)",
    )  # fmt: skip
    s.add_argument("--tls-cert", help="PEM certificate chain: serve gRPC and metrics over TLS")
    s.add_argument("--tls-key", help="PEM private key of --tls-cert")
    s.add_argument("--tls-client-ca", help="PEM CA: require client certificates (mutual TLS)")
    s.add_argument(
        "--api-key",
        help="require 'authorization: Bearer KEY' on every RPC but health "
        "(also --api-key-file, or the JAXSERVE_API_KEY variable)",
    )
    s.add_argument("--api-key-file", help="file whose first line is the API key")


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
        help="re-place MoE experts by their measured load (needs a mesh with dp*tp > 1)",
    )
    s.add_argument(
        "--num-redundant-experts",
        type=_int_at_least(0),
        metavar="R",
        help="extra expert slots per MoE layer for replicas (E + R divisible by dp*tp)",
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxserve", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="serve a model over gRPC (and HTTP with --http-port)")
    s.add_argument("--model", default=str(DEMO_MODEL_DIR), help="HF model folder (default: demo)")
    s.add_argument("--host", default=ServerConfig().host, help="bind address (default %(default)s)")
    s.add_argument("--port", type=PORT, default=ServerConfig().port, help="0 picks a free port")
    s.add_argument("--metrics-port", type=PORT, help="serve Prometheus /metrics on this port")
    s.add_argument(
        "--http-port",
        type=PORT,
        help="serve the OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, "
        "...) on this port; 0 picks a free one",
    )
    s.add_argument(
        "--chat-template",
        metavar="FILE",
        help="Jinja chat template (or a JSON file with a chat_template entry) replacing "
        "the model's, for /v1/chat/completions",
    )
    s.add_argument("--dtype", choices=["float32", "bfloat16"])
    s.add_argument("--seed", type=int)
    s.add_argument("--block-size", type=POSITIVE, help="tokens per KV block")
    s.add_argument(
        "--num-blocks",
        type=_int_at_least(2),
        metavar="N",
        help="KV blocks per dp rank, one of them reserved (the null block), so N - 1 are "
        "usable (default: from memory)",
    )
    s.add_argument("--no-prefix-caching", action="store_true")
    s.add_argument("--max-num-seqs", type=POSITIVE, help="most requests in one step")
    s.add_argument("--max-num-batched-tokens", type=POSITIVE, help="token budget of one step")
    s.add_argument("--max-model-len", type=_int_at_least(2), help="most tokens per request")
    s.add_argument("--mesh", default="dp=1,tp=1", help="device mesh, e.g. dp=2,tp=4")
    _add_eplb_arguments(s)
    s.add_argument("--compilation-cache-dir", help="JAX persistent compilation cache")
    s.add_argument("--no-compilation-cache", action="store_true")
    s.add_argument("--log-level", default="INFO")
    # module:Class run instead of EngineCore; used by tests to serve a mock engine.
    s.add_argument("--engine-class", help=argparse.SUPPRESS)
    distributed.add_arguments(s)
    _add_frontend_arguments(s)
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
    bench_cli.add_subparser(sub)  # `jaxserve bench`: the serving benchmark client
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    sys.exit(args.func(args))


if __name__ == "__main__":
    main()

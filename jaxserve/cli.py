"""The `jaxserve` command.

    jaxserve serve [MODEL] [--host H] [--port P] [--block-size N] [--max-num-seqs N] ...
    jaxserve engine [MODEL] --frontend HOST:PORT [engine flags of serve] (router/headless.py)
    jaxserve generate [--server HOST:PORT] [--max-tokens N] [--temperature T] ... "prompt"
    jaxserve bench [--server HOST:PORT] [--dataset random] [--request-rate R] ... (benchmark/)
    jaxserve diagnose --server HOST:METRICS_PORT | --from bench.json [--json] (observability/)
    jaxserve profile --server HOST:PORT --seconds N --out DIR (observability/)

`serve` is `_cmd_serve` here, its flags in `serve_args.py` (and the frontend's below);
every other subcommand registers itself from its module (`add_subparser`) in
`build_parser`. Imports that pull in heavy libraries stay inside the command functions,
and none of them imports JAX in this process (the engine process does).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

from jaxserve import convert, distributed, generate_cli
from jaxserve.benchmark import cli as bench_cli
from jaxserve.flag_types import POSITIVE
from jaxserve.hub import resolve_model
from jaxserve.logs import (
    add_start_failure_explainer,
    configure_logging,
    describe_error,
    drop_start_logs,
)
from jaxserve.observability import cli as observability_cli
from jaxserve.serve_args import add_serve_arguments
from jaxserve.serve_config import engine_config as _engine_config  # tests import this name
from jaxserve.serve_config import model_argument, server_config


class _Parser(argparse.ArgumentParser):
    """argparse, with a usage error as one line (`jaxserve serve: error: ...`), not the
    whole usage block of a command with dozens of flags before it."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class _SubParser(_Parser):
    """A subcommand's parser: it refuses the arguments it does not know itself, so the
    error names it (`jaxserve serve: error: unrecognized arguments: ...`); argparse hands
    them back to the top parser, whose error names only `jaxserve`."""

    def parse_known_args(self, args=None, namespace=None):
        namespace, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return namespace, extras


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("jaxserve")
    except PackageNotFoundError:
        return "unknown (not installed)"


# A follower whose start failed asks process 0 this long whether it failed first.
LEADER_ASK_S = 3.0


def _fail(error: BaseException, code: int, dist=None) -> int:
    """`serve`'s end after a start-up error: one line on stderr naming the cause (the
    traceback too at --log-level debug). Process 0 of a multi-process run then tells its
    followers (`jaxserve.distributed.start_status`), so that they end too. Returns `code`."""
    logging.getLogger("jaxserve").debug("start-up error", exc_info=error)
    drop_start_logs()  # the start's INFO lines, held back: this line is all it says
    line = in_flag_words(describe_error(error), "serve")
    print(f"jaxserve serve: error: {line}", file=sys.stderr, flush=True)
    if dist is not None and dist.is_leader:
        from jaxserve.distributed.start_status import announce_failure

        announce_failure(dist, line)
    return code


def in_flag_words(line: str, command: str) -> str:
    """A start-up error's line with the field it names as the flag of `command` ("serve",
    "engine") the user typed ("port: cannot bind" -> "--port: cannot bind"), as the
    client commands and argparse say theirs; a field that is no flag of it keeps its
    name. "model" stays: it is mostly given as the positional MODEL."""
    from jaxserve.frontend.client_auth import flag_error

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    known = set(sub.choices[command]._option_string_actions) - {"--model"}
    # A child's line ("engine failed to start: num_blocks: ...") names its field after
    # the child's words.
    head, sep, cause = line.partition(" failed to start: ")
    if sep:
        return head + sep + flag_error(ValueError(cause), known=known)
    return flag_error(ValueError(line), known=known)


def _leader_failed(cause: str) -> None:
    """A follower's end when process 0 announced that its start failed."""
    drop_start_logs()
    print(
        f"jaxserve serve: error: process 0 (the leader) failed to start: {cause}",
        file=sys.stderr,
        flush=True,
    )
    logging.shutdown()
    os._exit(2)  # now, from the watcher thread: the main thread may be inside JAX


def log_tag(dist) -> str:
    """The [tag] of `serve`'s log lines: "frontend", or "follower <i>" on process i > 0
    of a multi-process run (it serves no clients: it runs the leader's engine steps)."""
    if dist is None or dist.is_leader:
        return "frontend"
    return f"follower {dist.process_id}"


def _cmd_serve(args: argparse.Namespace) -> int:
    from jaxserve import preflight
    from jaxserve.launcher import StartupError, serve

    # The frontend; a follower process (below) runs its engine steps in this process,
    # tagged as such. INFO lines wait for the start to succeed: a failed start prints one.
    try:
        dist = distributed.from_arguments(args)
        if dist is not None:
            # One wait for the coordinator: its name resolves, then (a follower) its port
            # accepts; a pod's name resolves only once the pod runs.
            wait_s = distributed.init_timeout_s()
            deadline = time.monotonic() + wait_s
            distributed.check_coordinator_host(dist, wait_s)
    except ValueError as e:
        configure_logging(args.log_level, "frontend", hold_start=True)
        return _fail(e, 2)
    configure_logging(args.log_level, log_tag(dist), hold_start=True)
    if dist is not None and not dist.is_leader:
        from jaxserve.distributed.start_status import leader_failure, watch_leader

        watch_leader(dist, _leader_failed)
        add_start_failure_explainer(
            lambda: (
                f"process 0 (the leader) failed to start: {cause}"
                if (cause := leader_failure(dist, LEADER_ASK_S))
                else None
            )
        )
    try:
        config = _engine_config(args, model=resolve_model(model_argument(args)))
        # Mistakes that need no device, found before any process starts (exit code 2).
        preflight.check_engine_settings(config, check_model=args.engine_class is None)
    except (ValueError, OSError) as e:
        return _fail(e, 2, dist)
    if dist is not None and not dist.is_leader:
        # Processes 1..N-1 serve no clients: they run process 0's steps, in this process.
        from jaxserve.distributed.processes import run_follower

        try:  # before jax.distributed.initialize, which aborts in C++ when it never answers
            distributed.wait_for_coordinator(dist, wait_s, deadline)
        except ValueError as e:
            return _fail(e, 2)
        return run_follower(config, dist)
    # The engine process joins the run where this process stands (heartbeat included).
    dist_args = dist.to_arguments() if dist is not None else []
    server = server_config(args)
    try:
        options = _frontend_options(args)
        from jaxserve.router.cli_args import router_options as _router_options

        routing = _router_options(args)
        if routing.replicas > 1 and dist is not None:
            raise ValueError("--replicas: not supported with several processes per replica yet")
        if dist is None:
            routing.check_mesh(config.mesh.dp * config.mesh.tp)
        preflight.check_distinct_ports(server.port, server.metrics_port, server.http_port)
        preflight.check_host(server.host)  # a bad --host is a setting (2), not a busy port
        if server.chat_template is not None:
            if server.http_port is None:
                raise ValueError(
                    "chat-template: it is for the HTTP API's /v1/chat/completions; give "
                    "--http-port too"
                )
            from jaxserve.frontend.http.chat_template import load_chat_template

            # A template that cannot be read or compiled: exit 2 before any process starts.
            load_chat_template(config.model, server.chat_template)
    except ValueError as e:
        return _fail(e, 2, dist)
    try:
        preflight.check_ports(server.host, server.port, server.metrics_port, server.http_port)
        if routing.replica_listen is not None and routing.replica_listen[1]:
            preflight.check_bind("replica-listen", *routing.replica_listen)
        return serve(
            config,
            server,
            engine_class=args.engine_class,
            log_level=args.log_level,
            distributed_args=dist_args,
            frontend_options=options,
            router_options=routing,
        )
    except StartupError as e:  # a child's cause; the engine told the followers itself
        return _fail(e, e.exit_code)
    except (OSError, ValueError, RuntimeError) as e:
        return _fail(e, 1, dist)


def _frontend_options(args: argparse.Namespace):
    """FrontendOptions from the admission, stall, stream-buffer, TLS and API-key flags.
    Raises ValueError naming the flag."""
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
        tls.check()  # a bad file is a usage error (exit 2), before anything starts
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
        max_stream_buffer_bytes=args.max_stream_buffer_bytes,
    )


def _add_frontend_arguments(s: argparse.ArgumentParser) -> None:
    """Admission control, stall detection, TLS and API-key flags of `serve` (issue 12)."""
    from jaxserve.frontend.admission import (
        DEFAULT_MAX_QUEUED_PROMPT_TOKENS,
        DEFAULT_MAX_REQUEST_BYTES,
        DEFAULT_MAX_REQUESTS,
    )
    from jaxserve.frontend.liveness import DEFAULT_STALL_TIMEOUT_S
    from jaxserve.frontend.request_stream import DEFAULT_MAX_STREAM_BUFFER_BYTES

    # Groups of their own, as serve_args' are, so that --help shows them by topic.
    adm = s.add_argument_group("admission control and stall detection")
    adm.add_argument(
        "--max-pending-requests", type=POSITIVE, default=DEFAULT_MAX_REQUESTS,
        help="most requests (samples) running or waiting; past it RESOURCE_EXHAUSTED "
        "(default: %(default)s)",
    )  # fmt: skip
    adm.add_argument(
        "--max-queued-prompt-tokens", type=POSITIVE, default=DEFAULT_MAX_QUEUED_PROMPT_TOKENS,
        help="most prompt tokens waiting for prefill (default: %(default)s)",
    )  # fmt: skip
    adm.add_argument(
        "--max-inflight-request-bytes", type=POSITIVE, default=DEFAULT_MAX_REQUEST_BYTES,
        help="most bytes of open requests held at once (default: %(default)s)",
    )  # fmt: skip
    adm.add_argument(
        "--max-stream-buffer-bytes", type=POSITIVE, default=DEFAULT_MAX_STREAM_BUFFER_BYTES,
        help="most output (estimated bytes) a stream holds unread by its client; past it the "
        "request is aborted (default: %(default)s)",
    )  # fmt: skip
    adm.add_argument(
        "--stall-timeout-s", type=float, default=DEFAULT_STALL_TIMEOUT_S,
        help="heartbeat silence after which the engine or sidecar counts as stalled: "
        "health NOT_SERVING, requests UNAVAILABLE (default: %(default)s)",
    )  # fmt: skip
    tls = s.add_argument_group("TLS")
    tls.add_argument(
        "--tls-cert",
        help="PEM certificate chain: serve gRPC, the HTTP API (--http-port) and metrics over "
        "TLS (default: off)",
    )
    tls.add_argument("--tls-key", help="PEM private key of --tls-cert (default: none)")
    tls.add_argument(
        "--tls-client-ca", help="PEM CA: require client certificates (mutual TLS) (default: off)"
    )
    key = s.add_argument_group("API key")
    key.add_argument(
        "--api-key",
        help="require 'authorization: Bearer KEY' on every RPC but health "
        "(also --api-key-file, or the JAXSERVE_API_KEY variable) (default: none)",
    )
    key.add_argument("--api-key-file", help="file whose first line is the API key (default: none)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="jaxserve",
        description="An inference server for Mixture-of-Experts LLMs on JAX. Start with "
        "`jaxserve serve [MODEL]` (default: the bundled demo model), then `jaxserve "
        "generate 'a prompt'` in another shell; `jaxserve COMMAND --help` for each.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_SubParser)

    s = sub.add_parser("serve", help="serve a model over gRPC (and HTTP with --http-port)")
    add_serve_arguments(s)
    _add_frontend_arguments(s)
    s.set_defaults(func=_cmd_serve)

    generate_cli.add_subparser(sub)  # `jaxserve generate`: a completion to the terminal
    from jaxserve.router import headless  # noqa: PLC0415

    headless.add_subparser(sub)  # `jaxserve engine`: a headless replica joining a frontend
    convert.add_subparser(sub)  # `jaxserve convert`: HF folder -> Orbax checkpoint
    bench_cli.add_subparser(sub)  # `jaxserve bench`: the serving benchmark client
    observability_cli.add_subparsers(sub)  # `jaxserve diagnose`, `jaxserve profile`
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        code = args.func(args)
    except KeyboardInterrupt:
        # Ctrl-C in a client command (generate, bench, diagnose): no traceback; its open
        # requests end on the server with the connection. `serve` handles SIGINT itself.
        print(file=sys.stderr)
        code = 130
    sys.exit(code)


if __name__ == "__main__":
    main()

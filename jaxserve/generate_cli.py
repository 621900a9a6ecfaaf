"""`jaxserve generate`: stream one completion from a running server to the terminal.

    jaxserve generate [--server HOST:PORT] [--max-tokens N] [--temperature T] ... "prompt"

A gRPC client (`frontend.client.JaxserveClient`): one sample streams its text as it
comes; n > 1 samples print whole, one under the other, once all are done. An unset
sampling flag takes the server's default. Exit codes: 0; 1 the server answered with an
error (its status and details on stderr); 2 a bad flag or request (one line naming it:
the server's INVALID_ARGUMENT names its field, printed as the flag, `--top-p: ...`);
130 Ctrl-C (the request is cancelled on the server); 141 stdout closed (`| head`).
No JAX here.
"""

from __future__ import annotations

import argparse
import os
import sys

from jaxserve.config import ServerConfig
from jaxserve.flag_types import INT32, INT64, MAX_TIMEOUT_S, int_within, timeout_seconds
from jaxserve.frontend import client_auth, server_address
from jaxserve.sampling_params import MAX_N

# The flags that are fields of the request by the same name (`JaxserveClient.generate`).
_REQUEST_FLAGS = (
    "max_tokens", "temperature", "top_k", "top_p", "min_p", "seed", "stop", "ignore_eos",
)  # fmt: skip


def add_subparser(sub) -> None:
    """Register `jaxserve generate` on the subcommands `sub`."""
    g = sub.add_parser("generate", help="stream a completion from a server to the terminal")
    _add_arguments(g)
    g.set_defaults(func=cmd_generate)


def _add_arguments(g: argparse.ArgumentParser) -> None:
    """The flags of `jaxserve generate`; an unset sampling flag takes the server's default,
    which the help names (frontend/proto/jaxserve.proto)."""
    from jaxserve.frontend.validation import DEFAULT_MAX_TOKENS

    g.add_argument(
        "prompt",
        help='prompt text ("-" reads stdin, less one trailing newline: `echo hi | jaxserve '
        'generate -` sends "hi"; other whitespace is kept)',
    )
    g.add_argument(
        "--server",
        type=server_address.grpc_server_arg,
        default=f"{ServerConfig().host}:{ServerConfig().port}",
        help="the server's gRPC host:port (default: %(default)s)",
    )
    g.add_argument(
        "--max-tokens",
        type=int_within(1, INT32[1]),
        help=f"most tokens to generate (default: the server's, {DEFAULT_MAX_TOKENS}, cut to "
        "the room the prompt leaves)",
    )
    g.add_argument("--temperature", type=float, help="0 is greedy (default: the server's, 1.0)")
    g.add_argument(
        "--top-k", type=int_within(*INT32), help="keep the k most likely tokens (default: -1, off)"
    )
    g.add_argument("--top-p", type=float, help="nucleus sampling, in (0, 1] (default: 1.0, off)")
    g.add_argument(
        "--min-p", type=float, help="drop tokens below min_p x the top one (default: 0.0, off)"
    )
    g.add_argument(
        "--seed", type=int_within(*INT64), help="sampling seed (default: none, unseeded)"
    )
    g.add_argument(
        "-n",
        "--n",
        type=int_within(1, MAX_N),  # the server's limit, not only what the proto holds
        help="samples of the prompt, printed one by one (default: 1)",
    )
    g.add_argument(
        "--stop",
        action="append",
        default=[],
        help="stop string (repeatable; a shell passes \\n literally: use $'\\n') (default: none)",
    )
    g.add_argument(
        "--ignore-eos", action="store_true", help="go on past the EOS token (default: off)"
    )
    g.add_argument(
        "--timeout",
        type=timeout_seconds,
        help=f"seconds for the whole call, at most {MAX_TIMEOUT_S:g} (default: no limit)",
    )
    g.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="print each sample's finish reason and token counts to stderr (default: off)",
    )
    client_auth.add_flags(g)


def cmd_generate(args: argparse.Namespace) -> int:
    """Run `jaxserve generate`; returns the exit code (0, 1 an RPC error, 2 a bad request
    or flag, 130 interrupted, 141 a closed stdout)."""
    if args.prompt == "-" and sys.stdin is None:  # started with stdin closed (<&-)
        print("jaxserve generate: error: prompt: '-' reads stdin, which is closed", file=sys.stderr)
        return 2
    # After that check: with fd 0 closed, gRPC's poller took it for its epoll fd, and a
    # CI run's process aborted in it at exit ("epoll_wait error: Bad file descriptor").
    import grpc

    from jaxserve.frontend.client import JaxserveClient

    prompt = stdin_prompt(sys.stdin.read()) if args.prompt == "-" else args.prompt
    params = {name: getattr(args, name) for name in _REQUEST_FLAGS}
    if args.n is not None:
        params["n"] = args.n
    last = None
    completions = []
    streamed = False  # some text is on stdout: an error ends its line first
    try:
        auth = client_auth.from_args(args)
        client = JaxserveClient(args.server, **auth.client_kwargs())
    except ValueError as e:
        print(f"jaxserve generate: error: {client_auth.flag_error(e)}", file=sys.stderr)
        return 2
    with client:
        try:
            if args.n is not None and args.n > 1:
                # n samples interleave in the stream: print each whole once all are done.
                completions = client.complete(prompt, timeout=args.timeout, **params)
                _print_samples(completions)
            else:
                for delta in client.generate(prompt, timeout=args.timeout, **params):
                    sys.stdout.write(delta.text)
                    sys.stdout.flush()
                    streamed = streamed or bool(delta.text)
                    last = delta
                # End the output with a newline, terminal or pipe, as `llm` does: the
                # shell prompt starts on its own line, and a file of it is a text file.
                sys.stdout.write("\n")
                sys.stdout.flush()
        except ValueError as e:  # the request itself is bad (build_generate_request)
            print(f"jaxserve generate: error: {e}", file=sys.stderr)
            return 2
        except grpc.RpcError as e:
            if streamed:  # end the text's line; nothing printed: no empty line
                sys.stdout.write("\n")
                sys.stdout.flush()
            elif e.code() == grpc.StatusCode.INVALID_ARGUMENT:  # a flag's value, as argparse's
                why = client_auth.flag_error(ValueError(e.details()), {"prompt": "prompt"})
                print(f"jaxserve generate: error: {why}", file=sys.stderr)
                return 2
            hint = _unavailable_hint(e, args.server, auth.uses_tls)
            if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED and args.timeout is not None:
                hint = (
                    f"; --timeout {args.timeout:g} s passed (raise it, or leave it out: no limit)"
                )
            print(f"jaxserve generate: {e.code().name}: {e.details()}{hint}", file=sys.stderr)
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


def stdin_prompt(text: str) -> str:
    """`text` (stdin) less one trailing newline, LF or CRLF: the one `echo` or an editor
    ends a file with, which no one means as part of the prompt. Only one, unlike a
    shell's $(...), which takes all: a prompt may end on an empty line on purpose.
    (Python's stdin keeps a CR on Linux, so a CRLF file would leave one.)"""
    return text.removesuffix("\r\n") if text.endswith("\r\n") else text.removesuffix("\n")


# gRPC's own words for a connection that failed, as opposed to a server's UNAVAILABLE
# (its engine starting or gone), which needs no hint.
_REFUSED = "Connection refused"
_TRANSPORT = ("Socket closed", "Connection reset", "failed to connect", "handshake")


def _unavailable_hint(e, server: str, tls: bool) -> str:
    """What to check after an UNAVAILABLE that gRPC raised itself: nothing listens at
    `server`, an HTTP/1 server answered there (the HTTP API or metrics port, not the gRPC
    one), or (no TLS flag given) a TLS server closed the plaintext connection, which
    gRPC reports only as "Socket closed". "" for any other status."""
    import grpc

    from jaxserve.frontend.client import NotGrpcServerError, http1_hint

    details = e.details() or ""
    if e.code() != grpc.StatusCode.UNAVAILABLE:
        return ""
    if _REFUSED in details:
        return f"; is `jaxserve serve` running at {server}?"
    if isinstance(e, NotGrpcServerError):  # an HTTP/1 server answered: TLS is not the cause
        return f" ({http1_hint(server, 'generate')})"
    if not tls and any(word in details for word in _TRANSPORT):
        return " (is the server using TLS? pass --tls / --tls-ca-cert)"
    return ""


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

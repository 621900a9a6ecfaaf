"""The `jaxserve diagnose` and `jaxserve profile` subcommands (argument parsing and
printing only; the work is `observability.diagnose` and `observability.profile`).

    jaxserve diagnose --server HOST:METRICS_PORT [--seconds 10] [--json]
    jaxserve diagnose --from bench.json [--json]
    jaxserve profile --server HOST:PORT --seconds N --out DIR

Both reach a server with --tls-cert / --api-key through `frontend.client_auth`'s flags
(--tls-ca-cert ..., --api-key for profile; the metrics port checks no key).

Exit status: 0 done; 1 the server could not be reached or read (or refused the
capture); 2 a usage error: a bad flag value, or a --from file that cannot be read or is
no bench result (one line naming the flag). No JAX.
"""

from __future__ import annotations

import argparse
import json
import sys

from jaxserve.flag_types import positive_float
from jaxserve.frontend import client_auth, server_address


def add_subparsers(sub) -> None:
    """Register `diagnose` and `profile` on the `jaxserve` subparsers."""
    d = sub.add_parser(
        "diagnose",
        help="sample a server's metrics and name the layer that holds it back",
        description="Sample the metrics of a running server (its --metrics-port) for a while, "
        "walk the symptom -> layer -> tool tree, print the suspected layer, the numbers that "
        "point there and the next tool or flag to try.",
    )
    src = d.add_mutually_exclusive_group(required=True)
    src.add_argument(
        "--server",
        metavar="HOST:PORT",
        type=server_address.metrics_server_arg,
        help="the server's metrics endpoint",
    )
    src.add_argument("--from", dest="from_file", metavar="BENCH.json",
                     help="a jaxserve bench --out file (client-side numbers only)")  # fmt: skip
    d.add_argument("--seconds", type=float, default=10.0,
                   help="sampling window, at most 3600 (default %(default)s)")  # fmt: skip
    d.add_argument("--interval", type=float, default=None,
                   help="seconds between scrapes, at least 0.05 (default 0.5, or "
                   "--seconds when shorter)")  # fmt: skip
    d.add_argument("--json", action="store_true", help="print the diagnosis as JSON")
    client_auth.add_flags(d, api_key=False)  # the metrics port is HTTPS with --tls-cert
    d.set_defaults(func=_cmd_diagnose)

    p = sub.add_parser(
        "profile",
        help="capture a JAX profiler trace and the engine loop's timeline of a running server",
        description="Ask a running server's engine to record a JAX profiler trace "
        "(Perfetto / TensorBoard / XProf) and a Chrome-trace timeline of its loop phases "
        "for N seconds, without a restart. DIR is written by the engine, on its host.",
    )
    p.add_argument(
        "--server",
        required=True,
        metavar="HOST:PORT",
        type=server_address.grpc_server_arg,
        help="the gRPC address",
    )
    p.add_argument(
        "--seconds",
        type=positive_float,
        default=5.0,
        help="capture length, at most 600 (default %(default)s)",
    )
    p.add_argument("--out", required=True, metavar="DIR", help="output folder (created)")
    client_auth.add_flags(p)
    p.set_defaults(func=_cmd_profile)


def _cmd_diagnose(args: argparse.Namespace) -> int:
    import http.client

    from jaxserve.observability import diagnose, diagnose_bench

    try:
        if not 0 < args.seconds <= diagnose.MAX_SECONDS:
            raise ValueError(
                f"--seconds: must be in (0, {diagnose.MAX_SECONDS:g}], got {args.seconds}"
            )
        if args.interval is None:  # a short window alone is no error of a flag not given
            args.interval = min(0.5, args.seconds)
        elif not diagnose.MIN_INTERVAL_S <= args.interval <= args.seconds:
            raise ValueError(
                f"--interval: must be in [{diagnose.MIN_INTERVAL_S:g}, --seconds], "
                f"got {args.interval}"
            )
        if args.from_file:
            result = diagnose_bench.load_bench(args.from_file)
        else:
            auth = client_auth.from_args(args)
            result = diagnose.diagnose_server(args.server, args.seconds, args.interval, auth)
    except ValueError as e:
        print(f"jaxserve diagnose: error: {client_auth.flag_error(e)}", file=sys.stderr)
        return 2
    except (OSError, http.client.HTTPException) as e:
        if args.from_file:  # a file the user named: a usage error, as a bad flag is
            why = e.strerror if isinstance(e, OSError) and e.strerror else e
            print(f"jaxserve diagnose: error: --from: cannot read {args.from_file} ({why})",
                  file=sys.stderr)  # fmt: skip
            return 2
        # A gRPC port answers HTTP/1 badly (BadStatusLine); the HTTP API port serves
        # /metrics too.
        auth = client_auth.from_args(args)
        where = auth.url(args.server, "/metrics")
        why = e if isinstance(e, OSError) else f"not an HTTP metrics endpoint ({type(e).__name__})"
        # A TLS port closes a plaintext request during the handshake: the metrics port may
        # be the right one, spoken to without TLS.
        tls = ""
        if _closed_early(e) and not auth.uses_tls:
            tls = "; if the server runs with --tls-cert, pass --tls-ca-cert"
        print(f"jaxserve diagnose: error: cannot read {where}: {why}; --server takes the "
              "address of serve's --metrics-port (or its --http-port), not its gRPC port"
              f"{tls}", file=sys.stderr)  # fmt: skip
        return 1
    print(json.dumps(result.to_json(), indent=1) if args.json else result.render())
    return 0


def _closed_early(e: BaseException) -> bool:
    """Whether a scrape failed as a TLS port answers plain HTTP: the connection reset or
    closed before a response (urllib wraps the socket error in URLError)."""
    import http.client
    import urllib.error

    if isinstance(e, urllib.error.URLError) and isinstance(e.reason, BaseException):
        e = e.reason
    return isinstance(
        e, (ConnectionResetError, ConnectionAbortedError, BrokenPipeError,
            http.client.RemoteDisconnected),
    )  # fmt: skip


# The fields of a Capture request (profile_rpc.validate) that the flags name otherwise.
_PROFILE_FLAGS = {"out_dir": "--out"}


def _cmd_profile(args: argparse.Namespace) -> int:
    from jaxserve.observability import profile_rpc as profile

    try:
        auth = client_auth.from_args(args)
        result = profile.request_profile(args.server, args.seconds, args.out, auth)
    except ValueError as e:
        print(f"jaxserve profile: error: {client_auth.flag_error(e, _PROFILE_FLAGS)}",
              file=sys.stderr)  # fmt: skip
        return 2
    except (OSError, RuntimeError) as e:
        print(f"jaxserve profile: error: {e}", file=sys.stderr)
        return 1
    print(profile.describe(result))
    return 0

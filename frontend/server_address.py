"""The server address a client tool is given (`--server HOST:PORT` of generate, bench,
diagnose and profile; `JaxserveClient(target)`): its port is range-checked here, before
gRPC or urllib see it (gRPC takes a port modulo 65536, so 127.0.0.1:99999 would reach
a server on 34463).

    port_error("127.0.0.1:99999")  # "port must be in [1, 65535], got 99999"
    server_arg("[::1]:50051")      # argparse type: the text, or a usage error
    join_host_port("::1", 50051)   # "[::1]:50051": how the server prints its addresses
    wait_until_resolves("frontend", "jaxserve-0.jaxserve", 60.0)  # a peer's name, at start

Forms checked: HOST:PORT, [IPV6]:PORT, and a URL (scheme://HOST:PORT/...) as bench's
http backend and diagnose take: the port a number in range, the host not empty and
without spaces (gRPC would say only "errors resolving ..." and the client exit as if
the server were down). Other gRPC target forms (unix:PATH, dns:///...) pass unchanged,
as does a host without a port for the URL-taking tools; the gRPC ones refuse it
(`grpc_target_error`: gRPC would dial port 443).
"""

from __future__ import annotations

import argparse
import logging
import re
import socket
import time

logger = logging.getLogger(__name__)

_HOST_PORT = re.compile(r"^(\[[^\]]*\]|[^:/\[\]]*):([^:]*)$")
# gRPC's own target schemes (grpc/doc/naming.md): "unix:/path" is no HOST:PORT.
_GRPC_SCHEMES = ("dns:", "unix:", "unix-abstract:", "ipv4:", "ipv6:", "vsock:", "xds:")


# An IPv6 literal and a port without the brackets ("::1:50051"), which gRPC cannot split.
_BARE_IPV6_PORT = re.compile(r"^[0-9A-Fa-f.]*:[0-9A-Fa-f.:]*:[0-9]+$")


def join_host_port(host: str, port: int) -> str:
    """HOST:PORT as a URL or a gRPC target writes it: an IPv6 literal in brackets
    ("::1" or "[::1]" -> "[::1]:50051"), any other host as given ("127.0.0.1:50051")."""
    bare = host.strip("[]")
    return f"[{bare}]:{port}" if ":" in bare else f"{bare}:{port}"


def port_error(address: str) -> str | None:
    """What is wrong with the HOST:PORT of `address`: "port must be in [1, 65535], got N",
    "port must be a number in [1, 65535], got 'abc'", "host must not be empty" or "host
    must not contain spaces"; None for a good one or a form without a port of its own."""
    netloc = address
    if "://" in address:
        netloc = address.split("://", 1)[1].split("/", 1)[0].rpartition("@")[2]
    elif address.startswith(_GRPC_SCHEMES):
        return None
    m = _HOST_PORT.match(netloc)
    if m is None:
        return None
    host, port = m.group(1).strip("[]"), m.group(2)
    if not port.isdigit() or not port.isascii():
        return f"port must be a number in [1, 65535], got {port!r} in {address}"
    if not host:
        return f"host must not be empty, got {address} (e.g. 127.0.0.1:{port})"
    if re.search(r"\s", host):
        return f"host must not contain spaces, got {host!r}"
    return None if 1 <= int(port) <= 65535 else f"port must be in [1, 65535], got {int(port)}"


def check(field: str, address: str) -> None:
    """Raise ValueError("FIELD: ...") for a gRPC target `grpc_target_error` refuses (a
    port out of range, an http(s):// URL)."""
    error = grpc_target_error(address)
    if error is not None:
        raise ValueError(f"{field}: {error}")


def grpc_target_error(address: str) -> str | None:
    """What is wrong with `address` as a gRPC target: an http(s):// URL (as the HTTP API's
    ready line prints it) is no gRPC target, nor is an IPv6 literal without brackets
    (::1:50051), and gRPC would say only "Misformatted domain name"; a host without a port
    ("localhost"), which gRPC would dial on port 443. None for any other form."""
    error = port_error(address)
    if error is None and address.startswith(("http://", "https://")):
        error = (
            f"{address} is an HTTP URL; the gRPC API takes HOST:PORT with serve's --port "
            "(e.g. 127.0.0.1:50051)"
        )
    elif error is None and _BARE_IPV6_PORT.match(address):
        error = f"an IPv6 host goes in brackets before the port ([::1]:50051), got {address}"
    elif error is None and not address.strip():
        error = "must not be empty (e.g. 127.0.0.1:50051)"
    elif error is None and (":" not in address or re.fullmatch(r"\[[^\]]*\]", address)):
        # gRPC would dial port 443
        error = (
            f"{address} has no port; the gRPC API takes HOST:PORT with serve's --port "
            f"(e.g. {address}:50051)"
        )
    return error


# Two argparse types on purpose: bench (its http backend) and diagnose (a metrics
# endpoint) take a URL as --server, so only the gRPC tools (generate, profile) refuse one.
def server_arg(text: str) -> str:
    """argparse `type` of --server: `text` unchanged; a bad HOST:PORT (`port_error`) is a
    usage error ("argument --server: port must be in [1, 65535], got N", exit 2)."""
    return _usage_checked(text, port_error(text))


def metrics_server_arg(text: str) -> str:
    """argparse `type` of diagnose's --server (serve's --metrics-port): as `server_arg`,
    and a host with neither a port nor a URL scheme, or nothing, is a usage error too:
    "127.0.0.1" was read as http://127.0.0.1/metrics, port 80, and failed later."""
    error = port_error(text)
    if error is None and not text.strip():
        error = "must not be empty (e.g. 127.0.0.1:9090, serve's --metrics-port)"
    elif error is None and "://" not in text and not _HOST_PORT.match(text):
        error = f"{text} has no port; give serve's --metrics-port (e.g. {text}:9090)"
    return _usage_checked(text, error)


def grpc_server_arg(text: str) -> str:
    """argparse `type` of a gRPC tool's --server: as `server_arg`, and an http(s):// URL
    is a usage error too (`grpc_target_error`)."""
    return _usage_checked(text, grpc_target_error(text))


def _usage_checked(text: str, error: str | None) -> str:
    if error is not None:
        raise argparse.ArgumentTypeError(error)
    return text


def wait_until_resolves(what: str, host: str, timeout_s: float, family: int = 0) -> None:
    """Return once `host` resolves (the system's resolver: DNS, /etc/hosts; `family`
    0 any, socket.AF_INET IPv4 only), trying once a second for up to `timeout_s`.

    For a peer's name given at start-up (engine --frontend, the coordinator address): a
    name that never resolves would otherwise be retried as "nothing listens" until some
    other timeout, while a name that resolves only once its host starts (a Kubernetes
    pod's, behind a headless Service) must be waited for. The first failure logs one
    WARNING naming `what` and the host.

    Raises ValueError naming `what` once `timeout_s` has passed without an address.
    """
    deadline = time.monotonic() + timeout_s
    warned = False
    while True:
        try:
            socket.getaddrinfo(host, None, family=family, type=socket.SOCK_STREAM)
            return
        except socket.gaierror as e:
            error = e.strerror
        left = deadline - time.monotonic()
        if left <= 0:
            raise ValueError(
                f"{what}: host {host} does not resolve ({error}) after {timeout_s:g} s; give "
                "an address or a host name that resolves"
                + (" to an IPv4 address" if family == socket.AF_INET else "")
            )
        if not warned:
            logger.warning(
                "%s: host %s does not resolve yet (%s); trying again for up to %g s",
                what, host, error, timeout_s,
            )  # fmt: skip
            warned = True
        time.sleep(min(1.0, left))

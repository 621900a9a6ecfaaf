"""TLS and API-key authentication for the gRPC and metrics ports.

TLS: `TlsFiles` (--tls-cert, --tls-key, optional --tls-client-ca for mutual TLS, where
a client must present a certificate signed by that CA) gives gRPC server credentials
(`grpc_credentials`), the arguments of prometheus_client's HTTPS server
(`metrics_kwargs`) and of uvicorn for the OpenAI HTTP port (`uvicorn_kwargs`).

API key: `ApiKeyInterceptor` checks the `authorization: Bearer <key>` metadata (the
OpenAI convention) of every RPC except the health service (load balancers probe it
without credentials), comparing in constant time; a missing or wrong key is
UNAUTHENTICATED. On the HTTP port, `ApiKeyMiddleware` checks the same header on every
path but /health (401 in OpenAI's error shape). The key comes from --api-key,
--api-key-file or the JAXSERVE_API_KEY environment variable (`resolve_api_key`).

`insecure_bind_warning` says when an address other than loopback is served without TLS
or without a key.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import os
from dataclasses import dataclass
from pathlib import Path

import grpc

from jaxserve.frontend.client_auth import check_certificates, check_key_pair

API_KEY_ENV = "JAXSERVE_API_KEY"
HEALTH_PREFIX = "/grpc.health.v1.Health/"


@dataclass(frozen=True, slots=True)
class TlsFiles:
    """PEM files: the server's certificate chain and key, and optionally the CA that
    client certificates must chain to (mutual TLS)."""

    cert: str
    key: str
    client_ca: str | None = None

    def read(self) -> tuple[bytes, bytes, bytes | None]:
        """(cert, key, client CA or None) bytes. Raises ValueError naming the flag of a
        file that cannot be read."""
        out = []
        for flag, path in (
            ("tls-cert", self.cert),
            ("tls-key", self.key),
            ("tls-client-ca", self.client_ca),
        ):
            if path is None:
                out.append(None)
                continue
            try:
                out.append(Path(path).read_bytes())
            except OSError as e:
                raise ValueError(f"{flag}: cannot read {path} ({e.strerror})") from None
        return out[0], out[1], out[2]

    def check(self) -> None:
        """Raise ValueError naming the flag of a file that cannot be read, is not PEM, or
        (--tls-key) is not the key of --tls-cert. `jaxserve serve` checks before any
        process starts (exit code 2): gRPC would refuse them only when it binds, as a
        port it cannot bind, with C-core log lines."""
        check_key_pair("tls-cert", self.cert, "tls-key", self.key)
        if self.client_ca is not None:
            check_certificates("tls-client-ca", self.client_ca)

    def grpc_credentials(self) -> grpc.ServerCredentials:
        cert, key, ca = self.read()
        return grpc.ssl_server_credentials(
            [(key, cert)], root_certificates=ca, require_client_auth=ca is not None
        )

    def uvicorn_kwargs(self) -> dict:
        """Keyword arguments of uvicorn.Config for HTTPS (the OpenAI HTTP port)."""
        import ssl  # noqa: PLC0415

        self.read()
        kwargs = {"ssl_certfile": self.cert, "ssl_keyfile": self.key}
        if self.client_ca is not None:
            kwargs |= {"ssl_ca_certs": self.client_ca, "ssl_cert_reqs": ssl.CERT_REQUIRED}
        return kwargs

    def metrics_kwargs(self) -> dict:
        """Keyword arguments of prometheus_client.start_http_server for HTTPS."""
        self.read()  # fail with the flag's name, not deep inside ssl
        return {
            "certfile": self.cert,
            "keyfile": self.key,
            "client_cafile": self.client_ca,
            "client_auth_required": self.client_ca is not None,
        }


def resolve_api_key(api_key: str | None, api_key_file: str | None) -> str | None:
    """The API key from the flag, else the file (its first line, stripped), else the
    JAXSERVE_API_KEY variable; None when none is set. Raises ValueError naming the flag
    for an unreadable file or an empty key."""
    if api_key_file is not None:
        try:
            text = Path(api_key_file).read_text().strip()
        except OSError as e:
            raise ValueError(f"api-key-file: cannot read {api_key_file} ({e.strerror})") from None
        api_key = api_key if api_key is not None else text.splitlines()[0] if text else ""
        flag = "api-key-file"
    else:
        flag = "api-key"
        if api_key is None:
            api_key, flag = os.environ.get(API_KEY_ENV), API_KEY_ENV
    if api_key is not None and not api_key.strip():
        raise ValueError(f"{flag}: the API key is empty")
    if api_key is not None:
        api_key = api_key.strip()
        # It travels as a header value (gRPC metadata, HTTP Authorization): printable
        # ASCII only. A client sending another said "GetServerInfo failed (INTERNAL:
        # Invalid metadata)"; a server given one could not be reached. The key itself
        # is a secret: only the offending character's position is named.
        bad = next((i for i, c in enumerate(api_key) if not " " <= c <= "~"), None)
        if bad is not None:
            raise ValueError(
                f"{flag}: the API key must be printable ASCII (it is sent as a header); "
                f"character {bad + 1} is not"
            )
    return api_key


def is_loopback(host: str) -> bool:
    """True for a loopback address or "localhost"."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def insecure_bind_warning(host: str, tls: bool, api_key: bool) -> str | None:
    """A warning for serving a non-loopback address without TLS or without a key."""
    if is_loopback(host) or (tls and api_key):
        return None
    missing = " and ".join(
        what for what, ok in (("TLS (--tls-cert/--tls-key)", tls), ("an API key", api_key))
        if not ok
    )  # fmt: skip
    return f"serving {host} without {missing}: anyone who reaches it can use it"


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every RPC but health's without `authorization: Bearer <key>`."""

    def __init__(self, api_key: str) -> None:
        self._key = api_key.encode()

    def _authorized(self, metadata) -> bool:
        for name, value in metadata or ():
            if name == "authorization":
                if isinstance(value, bytes):
                    value = value.decode("latin-1")
                scheme, _, token = value.partition(" ")
                return scheme.lower() == "bearer" and hmac.compare_digest(
                    token.strip().encode(), self._key
                )
        return False

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(HEALTH_PREFIX):
            return handler
        if self._authorized(handler_call_details.invocation_metadata):
            return handler
        return _denying_handler(handler)


_DENIED = "authorization: a valid API key is required (metadata 'authorization: Bearer <key>')"
# The HTTP port's words name what an HTTP client sets: a header, not gRPC metadata.
_HTTP_DENIED = (
    "authorization: a valid API key is required (HTTP header 'Authorization: Bearer <key>')"
)


def _denying_handler(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` that answers UNAUTHENTICATED."""

    async def deny(request_or_iterator, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, _DENIED)

    des, ser = handler.request_deserializer, handler.response_serializer
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(deny, des, ser)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(deny, des, ser)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(deny, des, ser)
    return grpc.unary_unary_rpc_method_handler(deny, des, ser)


# Served without the API key, as vLLM serves every path outside /v1: /version holds
# jaxserve's version only.
_OPEN_PATHS = ("/health", "/metrics", "/version")


class ApiKeyMiddleware:
    """ASGI middleware: 401 for every HTTP request but /health, /metrics and /version
    without `Authorization: Bearer <key>` (what OpenAI clients send with api_key=...).
    /metrics needs no key, as on --metrics-port and on vLLM's API port."""

    def __init__(self, app, api_key: str) -> None:
        self._app = app
        self._key = api_key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("path") in _OPEN_PATHS:
            return await self._app(scope, receive, send)
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                if scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self._key):
                    return await self._app(scope, receive, send)
                break
        body = json.dumps(
            {"error": {"message": _HTTP_DENIED, "type": "invalid_request_error", "param": None,
                       "code": "invalid_api_key"}}
        ).encode()  # fmt: skip
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [(b"content-type", b"application/json"),
                            (b"www-authenticate", b"Bearer")],
            }
        )  # fmt: skip
        await send({"type": "http.response.body", "body": body})

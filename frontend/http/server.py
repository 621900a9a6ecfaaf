"""uvicorn serving an ASGI app inside the frontend's running event loop, beside grpc.aio.

`uvicorn.Server.serve()` would install its own SIGINT/SIGTERM handlers and own the loop's
lifetime; here the launcher owns both, so the server is driven through its parts:
`startup(sockets=...)` on a socket bound here (so that port 0 reports the port it got and a
busy port is an error naming the flag), `main_loop()` as a task (it refreshes the Date
header and watches `should_exit`), and `shutdown()` on stop. uvicorn's own logging set-up
is skipped (log_config=None): its loggers propagate to jaxserve's handlers, and access
lines are off.
"""

from __future__ import annotations

import asyncio
import logging
import socket

import uvicorn

logger = logging.getLogger("jaxserve.frontend.http")

# Open HTTP connections (and their requests) at most; the request body deadline is
# `responses.BODY_READ_TIMEOUT_S`.
MAX_HTTP_CONNECTIONS = 4096


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (port 0 picks a free one; SO_REUSEADDR, no
    SO_REUSEPORT, so a busy port fails). Raises RuntimeError("http-port: cannot bind
    HOST:PORT (reason)"), in the style of the other ports' errors."""
    try:
        family, type_, proto, _, address = socket.getaddrinfo(
            host.strip("[]"), port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        sock = socket.socket(family, type_, proto)
    except OSError as e:
        raise RuntimeError(f"http-port: cannot bind {host}:{port} ({e})") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(2048)
    except OSError as e:
        sock.close()
        raise RuntimeError(f"http-port: cannot bind {host}:{port} ({e})") from None
    sock.setblocking(False)
    return sock


class HttpServer:
    """One uvicorn server of `app`; `start` and `stop` run in the serving loop."""

    def __init__(self, app, tls: dict | None = None) -> None:
        """tls: uvicorn's ssl_* options (`frontend.auth.TlsFiles.uvicorn_kwargs`), or None."""
        self._config = uvicorn.Config(
            app,
            log_config=None,
            access_log=False,
            lifespan="off",
            # Several idle streams per client are normal (benchmarks, SDK pools).
            timeout_keep_alive=30,
            # Connections beyond this get 503 at once: clients that open connections
            # and never finish a request (slowloris) must not use up the process's file
            # descriptors, which the gRPC port and the metrics share.
            limit_concurrency=MAX_HTTP_CONNECTIONS,
            **(tls or {}),
        )
        self._server: uvicorn.Server | None = None
        self._ticker: asyncio.Task | None = None
        self._sock: socket.socket | None = None

    async def start(self, host: str, port: int) -> int:
        """Bind and serve; returns the bound port. Raises RuntimeError naming http-port
        when the address cannot be bound."""
        self._sock = bind(host, port)
        config = self._config
        config.load()
        server = uvicorn.Server(config)
        server.lifespan = config.lifespan_class(config)
        await server.startup(sockets=[self._sock])
        self._server = server
        self._ticker = asyncio.create_task(server.main_loop(), name="http-server-ticks")
        return self._sock.getsockname()[1]

    async def stop(self, grace_s: float) -> None:
        """Stop accepting connections; open responses get `grace_s` seconds, then are
        cancelled (which aborts their requests in the engine)."""
        server = self._server
        if server is None:
            return
        self._server = None
        server.should_exit = True
        if self._ticker is not None:
            await asyncio.gather(self._ticker, return_exceptions=True)
        server.config.timeout_graceful_shutdown = grace_s
        await server.shutdown(sockets=[self._sock])

"""uvicorn serving an ASGI app inside the frontend's running event loop, beside grpc.aio.

`uvicorn.Server.serve()` would install its own SIGINT/SIGTERM handlers and own the loop's
lifetime; here the launcher owns both, so the server is driven through its parts:
`startup(sockets=...)` on a socket bound here (so that port 0 reports the port it got and a
busy port is an error naming the flag), its `on_tick` once a second as a task (`_ticks`:
it refreshes the Date header; uvicorn's `main_loop` would wake ten times a second to
watch `should_exit`, which nothing here needs), and `shutdown()` on stop. uvicorn's own
logging set-up is skipped (log_config=None): its loggers propagate to jaxserve's
handlers, and access lines are off.

A request uvicorn's HTTP parser (httptools, else h11) refuses, such as a Content-Length
that is not a number or given twice, is answered by uvicorn itself, before any ASGI app
sees it: the app cannot answer it. `JsonErrorProtocol` makes that answer a 400 in the
API's JSON error shape (`errors.error_body`) instead of uvicorn's plain text, and
`MalformedRequestLog` turns uvicorn's WARNING per such request (a scanner sending garbage
would flood the log) into a DEBUG line, with a WARNING counting them: the first at once,
then those since, at most once a minute and within a minute (`CountedWarning`), and any
left at `HttpServer.stop`; uvicorn's "Shutting down" is dropped (the launcher logs its
own "shutting down").

Open connections are capped (`MAX_HTTP_CONNECTIONS`), so that clients that open
connections and never finish a request cannot use up the process's file descriptors,
which the gRPC port and the metrics share. A connection past the cap takes the place of
the connection idle the longest (no request in progress: never sent one, or kept alive
after its response), which is closed; only when every connection has a request in
progress is the new one answered 503 (JSON, `server_busy`) and closed (and counted:
`HttpServer`'s on_busy, `jaxserve_requests_rejected_total{limit="http_connections"}` in
`jaxserve serve`). So idle sockets, however many, cannot lock clients out (uvicorn's
own cap, `limit_concurrency`, answers the newcomer with a plain-text 503 and a WARNING
each: 4096 idle sockets held the API).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import struct
import threading
import time
from collections.abc import Callable

import uvicorn
from uvicorn.protocols.http.auto import AutoHTTPProtocol

from jaxserve.frontend.http.errors import error_body
from jaxserve.frontend.http.responses import ABORT_CONNECTION, BODY_READ_TIMEOUT_S
from jaxserve.frontend.server_address import join_host_port

logger = logging.getLogger("jaxserve.frontend.http")

# Open HTTP connections (and their requests) at most (see the module docstring); the
# request body deadline is `responses.BODY_READ_TIMEOUT_S`.
MAX_HTTP_CONNECTIONS = 4096
BUSY_MESSAGE = (
    f"server busy: {MAX_HTTP_CONNECTIONS} HTTP connections all have a request in progress; retry"
)


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
        raise RuntimeError(f"http-port: cannot bind {join_host_port(host, port)} ({e})") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(2048)
    except OSError as e:
        sock.close()
        raise RuntimeError(f"http-port: cannot bind {join_host_port(host, port)} ({e})") from None
    sock.setblocking(False)
    return sock


# What uvicorn logs (at WARNING, on "uvicorn.error") for each request its parser refuses.
_UVICORN_MALFORMED = "Invalid HTTP request received."
MALFORMED_MESSAGE = (
    "request: not a valid HTTP/1.1 request (a malformed request line or header, such as a "
    "Content-Length that is not one decimal number)"
)
MALFORMED_WARNING_INTERVAL_S = 60.0


class JsonErrorProtocol(AutoHTTPProtocol):
    """uvicorn's HTTP protocol, whose 400 for a request its parser refuses is JSON in the
    API's error shape (the connection closes after it, as uvicorn's own 400 does), which
    keeps open connections under `MAX_HTTP_CONNECTIONS` (module docstring), and which
    tells every request of a closed connection that its client is gone, pipelined ones
    included (`connection_lost`)."""

    # loop.time() since when the connection has had no request in progress; None while
    # one is (from its first bytes to its response's end).
    idle_since: float | None = None
    # Called for each connection refused with 503 at the cap (`HttpServer`'s on_busy).
    on_busy: Callable[[], None] | None = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        # httptools: the requests of this connection whose responses have not ended. With
        # pipelining (several requests sent before the first answer) uvicorn's
        # connection_lost tells only the last one parsed (queued) that its client is gone;
        # the one running computed its whole answer, sent it into the closed transport
        # and ended "without completing response" (uvicorn's ERROR). connection_lost
        # tells them all here.
        self._open_cycles: list = []
        self.idle_since = self.loop.time()
        if len(self.connections) <= MAX_HTTP_CONNECTIONS:
            return
        idle = [c for c in self.connections if c is not self and c.idle_since is not None]
        if idle:
            oldest = min(idle, key=lambda c: c.idle_since)
            oldest.idle_since = None  # counted out at once: its close comes later
            oldest.transport.close()
            _CAP_LOG.note("closed the longest idle HTTP connection for a new one")
            return
        _CAP_LOG.note("refused an HTTP connection with 503: every one has a request")
        if self.on_busy is not None:
            self.on_busy()
        self._send_json_error(503, "Service Unavailable", BUSY_MESSAGE, "server_busy")

    _head_timer: asyncio.TimerHandle | None = None

    def data_received(self, data: bytes) -> None:
        if self.idle_since is not None:  # a request begins: its head has a deadline
            self.idle_since = None
            self._head_timer = self.loop.call_later(BODY_READ_TIMEOUT_S, self._head_timed_out)
        super().data_received(data)

    def on_headers_complete(self) -> None:
        self._cancel_head_timer()
        # The request's way to drop its connection at once (`responses.EventStreamResponse
        # .cut`): close() would wait for a client that does not read to take the buffer.
        self.scope.setdefault("extensions", {})[ABORT_CONNECTION] = self.reset
        super().on_headers_complete()
        cycle = getattr(self, "cycle", None)  # httptools' request; h11 makes its own later
        if cycle is not None:
            self._open_cycles = [c for c in self._open_cycles if not c.response_complete]
            self._open_cycles.append(cycle)

    def reset(self) -> None:
        """Drop the connection now with a TCP reset, what the kernel and the transport
        hold for it unsent included (as nginx's reset_timedout_connection): a plain close
        would leave the socket sending that to a client that does not read."""
        sock = self.transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.transport.abort()

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        """A request head not complete within BODY_READ_TIMEOUT_S of its first byte (a
        slowloris) is a 408, as a body that stops coming is (`responses.read_body`)."""
        self._head_timer = None
        if not self.transport.is_closing():
            message = f"request: the request head was not received within {BODY_READ_TIMEOUT_S:g} s"
            self._send_json_error(408, "Request Timeout", message, "request_timeout")

    def connection_lost(self, exc) -> None:
        self._cancel_head_timer()
        for cycle in self._open_cycles:
            if not cycle.response_complete:  # as uvicorn does for the last one
                cycle.disconnected = True
                cycle.message_event.set()  # its receive() returns http.disconnect
        self._open_cycles = []
        super().connection_lost(exc)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self.idle_since = self.loop.time()

    def send_400_response(self, msg: str) -> None:
        self._send_json_error(400, "Bad Request", MALFORMED_MESSAGE, "invalid_http_request")

    def _send_json_error(self, status: int, reason: str, message: str, code: str) -> None:
        data = json.dumps(error_body(status, message, None, code)).encode()
        head = [f"HTTP/1.1 {status} {reason}\r\n".encode()]
        head += [
            name + b": " + value + b"\r\n" for name, value in self.server_state.default_headers
        ]
        head += [
            b"content-type: application/json\r\n",
            b"content-length: " + str(len(data)).encode() + b"\r\n",
            b"connection: close\r\n\r\n",
        ]
        self.transport.write(b"".join(head) + data)
        self.transport.close()


class CountedWarning:
    """A WARNING of jaxserve.frontend.http counting the events noted (`template`'s %d):
    the first event's at once, then one for those noted since, `interval_s` after the
    last WARNING (a timer thread: it used to wait for the next event, which might come
    hours later or never, so that a burst's count went unreported), and any count left at
    `flush`. Each event is a DEBUG line. Thread-safe: events come from the serving loop,
    the summary from the timer."""

    def __init__(self, template: str, interval_s: float = MALFORMED_WARNING_INTERVAL_S) -> None:
        self._template = template + "; at most one such line a minute, each at --log-level debug"
        self._interval_s = interval_s
        self._lock = threading.Lock()
        self._count = 0
        self._last = -float("inf")  # time.monotonic() of the last WARNING
        self._timer: threading.Timer | None = None

    def note(self, event: str) -> None:
        logger.debug(event)
        with self._lock:
            self._count += 1
            wait = self._last + self._interval_s - time.monotonic()
            if wait > 0:  # counted now, said when the interval ends
                if self._timer is None:
                    self._timer = threading.Timer(wait, self.flush)
                    self._timer.daemon = True
                    self._timer.start()
                return
            count = self._take()
        logger.warning(self._template, count)

    def flush(self) -> None:
        """The WARNING of the events not yet counted in one, now (none: no line)."""
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()  # a no-op from the timer's own thread
                self._timer = None
            count = self._take()
        if count:
            logger.warning(self._template, count)

    def _take(self) -> int:
        """The count not yet said, reset as said now (under the lock)."""
        count, self._count = self._count, 0
        if count:
            self._last = time.monotonic()
        return count


_CAP_LOG = CountedWarning(
    f"%d HTTP connection(s) came past the cap of {MAX_HTTP_CONNECTIONS} (the one idle the "
    "longest was closed for each, or the new one refused with 503 when all had a request)"
)


class MalformedRequestLog(logging.Filter):
    """A filter of the "uvicorn.error" logger: its WARNING for each request the parser
    refuses becomes a DEBUG line of jaxserve.frontend.http, counted by a `CountedWarning`.
    uvicorn's other lines pass."""

    def __init__(self) -> None:
        super().__init__()
        self._warning = CountedWarning(
            "refused %d malformed HTTP request(s) with 400 (such as a bad Content-Length, or "
            "a gRPC client given the HTTP port)"
        )

    def filter(self, record: logging.LogRecord) -> bool:
        if record.getMessage() != _UVICORN_MALFORMED:
            return True
        self._warning.note("refused a malformed HTTP request with 400")
        return False

    def flush(self) -> None:
        self._warning.flush()


_MALFORMED_LOG = MalformedRequestLog()


def no_second_shutdown_line(record: logging.LogRecord) -> bool:
    """A filter of the "uvicorn.error" logger: its "Shutting down" (in `stop`) followed the
    launcher's own "shutting down" line on every SIGINT/SIGTERM, and its "Waiting for
    connections to close. (CTRL+C to force quit)" offered a key the launcher handles
    itself (open streams get their final error event, then close); uvicorn's other lines
    pass."""
    message = record.getMessage()
    return message != "Shutting down" and not message.startswith("Waiting for connections")


class HttpServer:
    """One uvicorn server of `app`; `start` and `stop` run in the serving loop."""

    def __init__(
        self, app, tls: dict | None = None, on_busy: Callable[[], None] | None = None
    ) -> None:
        """tls: uvicorn's ssl_* options (`frontend.auth.TlsFiles.uvicorn_kwargs`), or None.
        on_busy: called once for each connection refused with 503 at the connection cap
        (module docstring), or None."""
        protocol = JsonErrorProtocol
        if on_busy is not None:
            # uvicorn builds each connection's protocol from a class: this server's own
            # subclass carries the hook (a staticmethod, so that it is not bound).
            hook = {"on_busy": staticmethod(on_busy)}
            protocol = type("JsonErrorProtocol", (JsonErrorProtocol,), hook)
        self._config = uvicorn.Config(
            app,
            log_config=None,
            access_log=False,
            lifespan="off",
            # Several idle streams per client are normal (benchmarks, SDK pools).
            timeout_keep_alive=30,
            # The connection cap is JsonErrorProtocol's (module docstring), not uvicorn's.
            limit_concurrency=None,
            http=protocol,
            **(tls or {}),
        )
        uvicorn_log = logging.getLogger("uvicorn.error")
        for log_filter in (_MALFORMED_LOG, no_second_shutdown_line):
            if log_filter not in uvicorn_log.filters:
                uvicorn_log.addFilter(log_filter)
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
        self._ticker = asyncio.create_task(_ticks(server), name="http-server-ticks")
        return self._sock.getsockname()[1]

    async def stop(self, grace_s: float) -> None:
        """Stop accepting connections; open responses get `grace_s` seconds, then are
        cancelled (which aborts their requests in the engine)."""
        server = self._server
        if server is None:
            return
        self._server = None
        for counted in (_MALFORMED_LOG, _CAP_LOG):  # what the next interval would say
            counted.flush()
        server.should_exit = True
        if self._ticker is not None:
            self._ticker.cancel()
            await asyncio.gather(self._ticker, return_exceptions=True)
        server.config.timeout_graceful_shutdown = grace_s
        await server.shutdown(sockets=[self._sock])


async def _ticks(server: uvicorn.Server) -> None:
    """Run `server.on_tick` (counter 0: its once-a-second work, the Date header) at each
    whole second of the wall clock, until cancelled: the header turns to the next second
    within the event loop's timer slack (milliseconds); uvicorn's own loop turns it every
    tenth 0.1 s sleep, up to a second late."""
    while True:
        await server.on_tick(0)
        await asyncio.sleep(1.0 - time.time() % 1.0)

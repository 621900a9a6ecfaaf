"""ASGI responses that end their request's work when the client goes away, and the body
reader with its size limit.

A response here runs its work (streaming server-sent events, or computing a JSON body)
beside a task that waits for the client's `http.disconnect`; whichever ends first
cancels the other. Cancelling the work closes the generation it iterates, which aborts
the request in the engine (frontend/requests.py), so a client that closes its connection
frees its KV blocks within one engine step, whether it was streaming or waiting for a
whole answer. (Starlette's own StreamingResponse stops listening for the disconnect on
ASGI servers of spec 2.4, uvicorn among them, and notices only at its next send.)

Server-sent events are written as OpenAI writes them: `data: <json>\\n\\n` per chunk and
`data: [DONE]\\n\\n` at the end.

A stream whose request was aborted because its client does not read (`cut`: past
--max-stream-buffer-bytes) has `CUT_GRACE_S` to write its last error event; then its
connection is aborted, ended or not (`EventStreamResponse.cut`; through the
`ABORT_CONNECTION` scope extension that `http.server.JsonErrorProtocol` provides), which
drops what the transport holds and ends the response without an error from uvicorn.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

from starlette.requests import ClientDisconnect, Request
from starlette.types import Receive, Scope, Send

from jaxserve.frontend.http.errors import HttpError

logger = logging.getLogger("jaxserve.frontend.http")

SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),  # proxies (nginx) must not buffer the stream
]
JSON_HEADERS = [(b"content-type", b"application/json")]
# Seconds a client has to send a whole request body (408 after): a 32 MiB body at
# 1 MB/s takes half of it.
BODY_READ_TIMEOUT_S = 60.0
DONE = b"data: [DONE]\n\n"
# Seconds a cut stream's writer has to send its last event before its connection is aborted.
CUT_GRACE_S = 1.0
# The scope["extensions"] key of the connection's abort (a callable, no arguments).
ABORT_CONNECTION = "jaxserve.abort_connection"


def dumps(obj) -> bytes:
    """Compact JSON, UTF-8 (non-ASCII text as is, like OpenAI's)."""
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()


def sse_event(obj) -> bytes:
    return b"data: " + dumps(obj) + b"\n\n"


def check_json_content_type(request: Request) -> str | None:
    """Raise HttpError 400 unless the request says its body is JSON (`Content-Type:
    application/json`, parameters such as `; charset=utf-8` allowed), as vLLM's API server
    refuses any other media type, a missing header included (its validate_json_request:
    "Only 'application/json' is allowed", a 400 since it raises RequestValidationError);
    OpenAI's API answers 400 too. A form or text body is then not parsed as JSON by
    accident: `curl -d` without `-H 'Content-Type: application/json'` sends a form.

    Returns the charset parameter (unquoted), or None: it is not read, only named when
    the body is not UTF-8 (`body_text`)."""
    given = request.headers.get("content-type")
    media_type, *params = (given or "").split(";")
    media_type = media_type.strip().lower()
    if media_type != "application/json":
        got = f"got {given!r}" if given is not None else "got no Content-Type header"
        raise HttpError(
            400,
            f"Content-Type: the body must be sent as application/json, {got}",
            None,
            "unsupported_media_type",
        )
    for param in params:
        name, _, value = param.partition("=")
        if name.strip().lower() == "charset":
            return value.strip().strip('"')
    return None


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, at most `limit` bytes, within BODY_READ_TIMEOUT_S. Raises
    HttpError 415 for a Content-Encoding other than identity (before anything is read),
    413 beyond the limit (judged from Content-Length when given, before anything is
    read), 408 past the deadline: a client that sends part of a body and stops must not
    hold its connection (and a file descriptor) for ever."""
    _check_identity_encoding(request)
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(int(declared), limit)
    chunks, size = [], 0
    try:
        async with asyncio.timeout(BODY_READ_TIMEOUT_S):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise _too_large(size, limit)
                chunks.append(chunk)
    except TimeoutError:
        raise HttpError(
            408, f"body: not received within {BODY_READ_TIMEOUT_S:g} s ({size} bytes came)",
            "body", "request_timeout",
        ) from None  # fmt: skip
    except ClientDisconnect:
        # A client that hangs up mid-body is gone, not a server error: no traceback (a
        # client doing it in a loop must not flood the log); nobody reads the answer.
        logging.getLogger("jaxserve.frontend.http").debug("client left while sending a body")
        raise HttpError(
            400, "body: the client disconnected", "body", "client_disconnected"
        ) from None
    return b"".join(chunks)


def _check_identity_encoding(request: Request) -> None:
    """Raise HttpError 415 unless the body is sent as is: no decoder for gzip, deflate or
    br is run (a compressed body would otherwise be called "not valid JSON in UTF-8",
    which does not say why). 415 is RFC 7694's answer to a Content-Encoding that a
    server does not take."""
    given = request.headers.get("content-encoding")
    if given is None or given.strip().lower() in ("", "identity"):
        return
    raise HttpError(
        415,
        f"body: Content-Encoding {given.strip()} is not supported; send plain JSON "
        "(no Content-Encoding header)",
        "body",
        "unsupported_content_encoding",
    )


def _too_large(size: int, limit: int) -> HttpError:
    return HttpError(
        413,
        f"body: {size} bytes is over the limit of {limit} bytes",
        "body",
        "request_too_large",
    )


async def _wait_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def _until_disconnect(
    work: Awaitable[None], receive: Receive, on_close: Callable[[], None] | None
) -> None:
    """Run `work` until it ends or the client disconnects (then it is cancelled); then
    call `on_close` in any case (even when `work` never got to run)."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_wait_disconnect(receive))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (task, gone):
            t.cancel()
        await asyncio.gather(task, gone, return_exceptions=True)
        if on_close is not None:
            on_close()
    if task.done() and not task.cancelled() and (e := task.exception()) is not None:
        if _client_gone(e):
            logger.debug("response not sent: the client is gone (%s)", e)
        else:
            logger.error("response failed", exc_info=e)


def _client_gone(error: BaseException) -> bool:
    """Whether `error` is a send to a client that closed its connection: an OSError
    (uvicorn's ClientDisconnected is one), or uvloop's RuntimeError "unable to perform
    operation on <TCPTransport closed=True ...>" when the transport closed under a
    response of a pipelined request (a client that sent several requests on one
    connection and closed it before reading their answers)."""
    return isinstance(error, OSError) or (
        isinstance(error, RuntimeError) and "closed=True" in str(error)
    )


class EventStreamResponse:
    """200, text/event-stream: each bytes item of `events` is sent as it comes.
    on_close: called once the response ended, however (it releases the requests that
    `events` reads, should `events` never have started)."""

    def __init__(
        self, events: AsyncIterator[bytes], on_close: Callable[[], None] | None = None
    ) -> None:
        self._events = events
        self._on_close = on_close
        self._abort_connection: Callable[[], None] | None = None
        self._cut_timer: asyncio.TimerHandle | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self._abort_connection = scope.get("extensions", {}).get(ABORT_CONNECTION)
        await _until_disconnect(self._stream(send), receive, self._on_close)

    def cut(self) -> None:
        """The request was aborted while its client does not read (module docstring):
        abort the connection in CUT_GRACE_S, whether or not the response has ended by
        then. An ended one may still sit unsent in the transport's and the kernel's
        buffers: when the abort came while the writer was slow rather than held by flow
        control (a busy CPU), its last events fitted there and the response ended, and
        the connection stayed open with them (a CI run saw it). Idempotent."""
        if self._cut_timer is None:
            loop = asyncio.get_running_loop()
            self._cut_timer = loop.call_later(CUT_GRACE_S, self._abort)

    def _abort(self) -> None:
        if self._abort_connection is not None:
            logger.debug("aborting the connection of a stream whose client does not read")
            self._abort_connection()

    async def _stream(self, send: Send) -> None:
        async with contextlib.aclosing(self._events) as events:
            await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
            async for event in events:
                await send({"type": "http.response.body", "body": event, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})


class DeferredJSONResponse:
    """A JSON answer computed by `compute()` while the client waits; the client leaving
    cancels it. An HttpError raised by `compute` is answered in the error shape.
    on_close: as for EventStreamResponse."""

    def __init__(
        self, compute: Callable[[], Awaitable[dict]], on_close: Callable[[], None] | None = None
    ) -> None:
        self._compute = compute
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await _until_disconnect(self._respond(send), receive, self._on_close)

    async def _respond(self, send: Send) -> None:
        try:
            status, body = 200, await self._compute()
        except HttpError as e:
            status, body = e.status, e.body()
        data = dumps(body)
        headers = [*JSON_HEADERS, (b"content-length", str(len(data)).encode())]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": data, "more_body": False})

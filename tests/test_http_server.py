"""frontend/http/server.py: uvicorn inside the frontend's loop (`HttpServer`): the cap on
open connections (idle ones make room, busy ones get a JSON 503), the deadline of a
request head, and a request uvicorn's parser refuses (a JSON 400, counted in a WARNING
rather than logged each). The body and its fields: tests/test_http_body.py."""

import asyncio
import json
import logging


def _serve(app, run, on_busy=None, loop_factory=None):
    """Start an HttpServer of `app` (and `on_busy`) on a free port, await run(port), stop it
    (in an event loop of `loop_factory`, None: asyncio's default)."""
    from jaxserve.frontend.http import server as http_server

    async def go():
        srv = http_server.HttpServer(app, on_busy=on_busy)
        port = await srv.start("127.0.0.1", 0)
        try:
            return await run(port)
        finally:
            await srv.stop(1.0)

    return asyncio.run(go(), loop_factory=loop_factory)


def _get(port: int, head: bytes = b"GET / HTTP/1.1\r\nhost: x\r\n\r\n") -> bytes:
    import socket

    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(head)
        return s.recv(4096)


async def _ok(scope, receive, send):
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


def test_idle_connections_past_the_cap_make_room(monkeypatch):
    """HttpServer caps open connections (MAX_HTTP_CONNECTIONS) so that they cannot use up
    the file descriptors; idle ones (that never sent a request, or kept alive after
    theirs) cannot lock clients out: a newcomer past the cap is served, and the
    connection idle the longest is closed for it."""
    import socket

    from jaxserve.frontend.http import server as http_server

    monkeypatch.setattr(http_server, "MAX_HTTP_CONNECTIONS", 2)

    async def run(port):
        first = socket.create_connection(("127.0.0.1", port), timeout=10)
        await asyncio.sleep(0.2)
        second = socket.create_connection(("127.0.0.1", port), timeout=10)
        await asyncio.sleep(0.2)  # the server has accepted both, the first idle longer
        try:
            answer = await asyncio.to_thread(_get, port)
            closed = await asyncio.to_thread(first.recv, 100)  # b"": closed by the server
            second.setblocking(False)
            try:
                second.recv(100)
                still_open = False
            except BlockingIOError:
                still_open = True
            return answer, closed, still_open
        finally:
            first.close()
            second.close()

    refused = []
    answer, closed, still_open = _serve(_ok, run, on_busy=lambda: refused.append(1))
    assert answer.startswith(b"HTTP/1.1 200"), answer
    assert closed == b"" and still_open
    assert refused == []  # closing an idle connection refuses no request


def test_busy_connections_past_the_cap_get_a_json_503(monkeypatch):
    """When every connection under the cap has a request in progress, the next one is
    answered 503 in the API's error shape and closed, and counted once by on_busy
    (`jaxserve_requests_rejected_total{limit="http_connections"}` in a server)."""
    import threading

    from jaxserve.frontend.http import server as http_server

    monkeypatch.setattr(http_server, "MAX_HTTP_CONNECTIONS", 2)
    release = threading.Event()

    async def slow(scope, receive, send):
        await asyncio.to_thread(release.wait, 10)
        await _ok(scope, receive, send)

    async def run(port):
        busy = [asyncio.create_task(asyncio.to_thread(_get, port)) for _ in range(2)]
        await asyncio.sleep(0.3)  # both requests are in the app
        try:
            return await asyncio.to_thread(_get, port)
        finally:
            release.set()
            await asyncio.gather(*busy)

    refused = []
    answer = _serve(slow, run, on_busy=lambda: refused.append(1))
    assert refused == [1]
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 503") and b"content-type: application/json" in head
    error = json.loads(body)["error"]
    assert error["code"] == "server_busy" and "request in progress" in error["message"]


def test_a_request_head_that_stops_coming_is_a_408(monkeypatch):
    """A client that sends part of a request head and then nothing (slowloris) gets 408
    at the deadline, so that it cannot hold a connection as "in progress" for ever."""
    from jaxserve.frontend.http import server as http_server

    monkeypatch.setattr(http_server, "BODY_READ_TIMEOUT_S", 0.3)

    async def run(port):
        return await asyncio.to_thread(_get, port, b"GET / HTTP/1.1\r\nhost: x\r\n")

    answer = _serve(_ok, run)
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), answer
    assert json.loads(body)["error"]["code"] == "request_timeout"


def test_a_request_uvicorn_cannot_parse_gets_the_json_error_shape_and_no_warning_each(
    caplog, monkeypatch
):
    """A bad Content-Length is refused by uvicorn's HTTP parser before the app sees the
    request: the 400 is JSON in the API's error shape (it was uvicorn's plain text), and
    uvicorn's WARNING per request is a DEBUG line, with a counting WARNING: the first at
    once, the rest within a minute (test_a_counted_warning_...) or, here, at stop."""
    import socket

    from jaxserve.frontend.http import server as http_server

    async def app(scope, receive, send):
        raise AssertionError("the parser refuses these before any app")

    bad = [b"content-length: abc", b"content-length: -1", b"content-length: 2\r\ncontent-length: 3"]

    async def go():
        srv = http_server.HttpServer(app)
        port = await srv.start("127.0.0.1", 0)

        def post(header: bytes) -> bytes:
            with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n" + header + b"\r\n\r\n{}")
                return b"".join(iter(lambda: s.recv(4096), b""))  # until it closes

        try:
            return [await asyncio.to_thread(post, header) for header in bad]
        finally:
            await srv.stop(1.0)

    # A fresh count for this test: an earlier server's filter may have warned already.
    uvicorn_log = logging.getLogger("uvicorn.error")
    monkeypatch.setattr(http_server, "_MALFORMED_LOG", http_server.MalformedRequestLog())
    monkeypatch.setattr(uvicorn_log, "filters", [])
    with caplog.at_level(logging.DEBUG):
        answers = asyncio.run(go())
    for answer in answers:
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 400") and b"content-type: application/json" in head
        error = json.loads(body)["error"]
        assert error["message"].startswith("request: not a valid HTTP/1.1 request"), error
        assert error["type"] == "invalid_request_error"
        assert error["code"] == "invalid_http_request"
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert [w.split(" malformed")[0] for w in warnings] == ["refused 1", "refused 2"], warnings
    refused = [r for r in caplog.records if r.getMessage().startswith("refused a malformed")]
    assert len(refused) == 3 and all(r.levelno == logging.DEBUG for r in refused)


def test_a_counted_warning_reports_a_burst_within_its_interval_without_another_event(caplog):
    """The first event is a WARNING at once; those after it in the interval are counted in
    one WARNING when the interval ends, whether or not another event comes (the count
    used to wait for the next event: a burst of malformed requests was reported only
    when the next one came, hours later or never); flush says what is left, now."""
    import time

    from jaxserve.frontend.http.server import CountedWarning

    interval_s = 0.3
    counted = CountedWarning("%d things happened", interval_s=interval_s)

    def said() -> list[str]:
        records = caplog.records
        return [r.getMessage().split(";")[0] for r in records if r.levelno >= logging.WARNING]

    with caplog.at_level(logging.DEBUG, logger="jaxserve.frontend.http"):
        start = time.monotonic()
        for _ in range(4):
            counted.note("a thing")
        assert said() == ["1 things happened"]  # at once; the other 3 wait for the interval
        while len(said()) < 2 and time.monotonic() - start < 10:
            time.sleep(0.02)
        assert said() == ["1 things happened", "3 things happened"]
        assert time.monotonic() - start >= interval_s * 0.9  # not before the interval ends
        counted.note("a thing")  # within the new interval: counted, not said yet
        assert len(said()) == 2
        counted.flush()
        counted.flush()  # nothing left: no line
        time.sleep(2 * interval_s)  # the flushed timer does not fire
        assert said() == ["1 things happened", "3 things happened", "1 things happened"]
    debug = [r for r in caplog.records if r.getMessage() == "a thing"]
    assert len(debug) == 5 and all(r.levelno == logging.DEBUG for r in debug)


def test_a_client_that_pipelines_requests_then_closes_is_gone_for_the_running_one(caplog):
    """Three requests pipelined on one connection; the client reads the first answer's
    start and closes while the second is computed. uvicorn told only the last parsed
    request (queued) that its client left: the second computed its whole answer, sent it
    into the closed transport, and uvicorn logged ERROR "ASGI callable returned without
    completing response." (a fresh-user trial; under uvloop, the server's loop). Now the
    second's work is cancelled when the connection closes, and nothing is an ERROR."""
    import socket

    import uvloop

    from jaxserve.frontend.http.responses import DeferredJSONResponse

    events = []

    async def compute():
        k = 1 + sum(e.startswith("started") for e in events)
        events.append(f"started {k}")
        try:
            await asyncio.sleep(0.1 if k == 1 else 2.0)
        except asyncio.CancelledError:
            events.append(f"cancelled {k}")
            raise
        events.append(f"finished {k}")
        return {"ok": True}

    async def app(scope, receive, send):
        await DeferredJSONResponse(compute, on_close=lambda: events.append("closed"))(
            scope, receive, send
        )

    async def run(port):
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n" * 3)
            await asyncio.sleep(0.5)  # the first answered, the second being computed
            assert s.recv(50).startswith(b"HTTP/1.1 200")
        await asyncio.sleep(2.0)  # as long as the second's answer would have taken

    with caplog.at_level(logging.DEBUG):
        _serve(app, run, loop_factory=uvloop.new_event_loop)
    work = [e for e in events if e != "closed"]
    assert work == ["started 1", "finished 1", "started 2", "cancelled 2"], events
    assert events.count("closed") == 2, events  # each response's on_close, once
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == [], errors

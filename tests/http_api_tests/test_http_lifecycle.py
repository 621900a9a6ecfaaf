"""The OpenAI-compatible HTTP API around the engine's lifetime, on the mock engine
(tests/mock_engine.py): 503 while it starts, 400 without a chat template once ready, a
dead engine ends open streams with an error event and answers 503, SIGTERM ends an open
stream cleanly and stops the server.
"""

from __future__ import annotations

import json
import time

import pytest

from http_api_tests.helpers import CHAT, http_request, mock_server, post, sse_lines

pytestmark = pytest.mark.slow


def test_no_chat_template_is_400_and_starting_engine_is_503(mock_model_dir):
    srv = mock_server(mock_model_dir, start_delay_s=3.0)
    try:
        r = post(srv, "/v1/completions", {"prompt": "def ", "max_tokens": 2})
        assert r.status_code == 503, r.text
        assert r.json()["error"]["message"].startswith("engine unavailable: ")
        assert http_request("GET", srv.http_url + "/health").status_code == 503
        srv.wait_ready()
        assert http_request("GET", srv.http_url + "/health").status_code == 200
        r = post(srv, "/v1/chat/completions", {"messages": CHAT})
        assert r.status_code == 400 and r.json()["error"]["code"] == "no_chat_template"
        assert "chat template" in r.json()["error"]["message"]
    finally:
        srv.terminate(15)


def test_engine_death_ends_streams_and_answers_503(mock_model_dir):
    srv = mock_server(mock_model_dir).wait_ready()
    try:
        body = {"prompt": "def ", "max_tokens": 3000, "stream": True, "extra": 1}
        body["ignore_eos"] = True
        events = []
        with sse_lines(srv.http_url + "/v1/completions", body) as lines:
            for line in lines:
                events.append(line)
                if len(events) == 3:
                    srv.kill_child("jaxserve.engine.process")
        assert events[-1] == "data: [DONE]"
        error = json.loads(events[-2].removeprefix("data: "))["error"]
        assert error["message"].startswith("engine unavailable: ")
        r = post(srv, "/v1/completions", {"prompt": "def "})
        assert r.status_code == 503
    finally:
        srv.kill()


def test_sigterm_with_an_open_stream_ends_it_and_stops_within_10_s(mock_model_dir):
    """A stream still open after the shutdown grace ends as one whose engine died: an
    error event saying the server is shutting down, then `data: [DONE]` (it used to be
    cut, curl rc 18, with uvicorn's 40-line CancelledError traceback in the log)."""
    import signal

    srv = mock_server(mock_model_dir).wait_ready()
    try:
        body = {"prompt": "def ", "max_tokens": 3000, "ignore_eos": True, "stream": True}
        lines = []
        with sse_lines(srv.http_url + "/v1/completions", body) as stream:
            for line in stream:
                lines.append(line)
                if len(lines) == 4:
                    start = time.monotonic()
                    srv.proc.send_signal(signal.SIGTERM)
        srv.proc.wait(10)
        assert time.monotonic() - start < 10
        assert srv.proc.returncode == 0
        assert lines[-1] == "data: [DONE]", lines[-3:]
        error = json.loads(lines[-2].removeprefix("data: "))["error"]
        assert "shutting down" in error["message"], error
        assert "Traceback" not in srv.log() and "Exception in ASGI" not in srv.log(), srv.log()
    finally:
        srv.kill() if srv.proc.poll() is None else None

"""frontend/http/responses.read_body: the body limit and a client that leaves mid-body."""

import asyncio
import logging

import pytest
from starlette.requests import Request

from jaxserve.frontend.http.errors import HttpError
from jaxserve.frontend.http.responses import read_body


def _request(messages: list[dict], headers: list[tuple[bytes, bytes]] = ()) -> Request:
    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": list(headers)}
    queue = list(messages)

    async def receive():
        return queue.pop(0)

    return Request(scope, receive)


def test_client_leaving_mid_body_is_a_quiet_400(caplog):
    request = _request(
        [{"type": "http.request", "body": b'{"pro', "more_body": True}, {"type": "http.disconnect"}]
    )
    with caplog.at_level(logging.INFO), pytest.raises(HttpError) as info:
        asyncio.run(read_body(request, 1000))
    assert info.value.status == 400 and "disconnected" in str(info.value)
    assert not [r for r in caplog.records if r.levelno >= logging.INFO]  # no traceback, no noise


def test_body_over_the_limit_is_413_whole_body_returned_under_it():
    big = _request([{"type": "http.request", "body": b"x" * 11, "more_body": False}])
    with pytest.raises(HttpError) as info:
        asyncio.run(read_body(big, 10))
    assert info.value.status == 413
    parts = [{"type": "http.request", "body": b"ab", "more_body": True},
             {"type": "http.request", "body": b"cd", "more_body": False}]  # fmt: skip
    assert asyncio.run(read_body(_request(parts), 10)) == b"abcd"


def test_union_field_errors_name_the_real_cause():
    from jaxserve.frontend.http.protocol import MAX_STOP, CompletionRequest, FieldError, parse_body

    too_many = b'{"prompt": "a", "stop": [' + b",".join([b'"x"'] * (MAX_STOP + 1)) + b"]}"
    with pytest.raises(FieldError) as info:
        parse_body(CompletionRequest, too_many)
    assert str(info.value).startswith("stop") and f"at most {MAX_STOP}" in str(info.value)
    with pytest.raises(FieldError) as info:
        parse_body(CompletionRequest, b'{"prompt": [1.5, 2]}')
    assert str(info.value).startswith("prompt[0]")  # the element at fault, not the union

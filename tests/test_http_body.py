"""frontend/http/responses.read_body: the body limit and a client that leaves mid-body;
protocol.parse_body: how the fields of a body that is not a request are named (what its
bytes are read as: tests/test_http_body_text.py)."""

import asyncio
import json
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


def test_a_body_that_stops_coming_is_a_408_at_the_deadline(monkeypatch):
    """A client that sends part of a body and then nothing (slowloris) gets 408 once
    BODY_READ_TIMEOUT_S has passed, instead of holding its connection for ever."""
    from jaxserve.frontend.http import responses

    monkeypatch.setattr(responses, "BODY_READ_TIMEOUT_S", 0.2)
    sent = [{"type": "http.request", "body": b"{", "more_body": True}]

    async def receive():
        if sent:
            return sent.pop(0)
        await asyncio.Event().wait()  # the rest never comes

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": []}
    with pytest.raises(HttpError) as info:
        asyncio.run(read_body(Request(scope, receive), 1000))
    assert info.value.status == 408 and "not received within 0.2 s (1 bytes came)" in str(
        info.value
    )


def _field_error(model, body: bytes):
    from jaxserve.frontend.http.protocol import FieldError, parse_body

    with pytest.raises(FieldError) as info:
        parse_body(model, body)
    return info.value.param, str(info.value)


def test_list_limits_are_said_as_the_shared_rules_say_them():
    """Too many stop strings or stop token ids: the HTTP 400 says it in the words of the
    shared rules (the gRPC INVALID_ARGUMENT text), not pydantic's "List should have at
    most 64 items after validation"."""
    from jaxserve.frontend.http.protocol import MAX_STOP, MAX_STOP_TOKEN_IDS, CompletionRequest
    from jaxserve.sampling_params import SamplingParams

    for field, value in (
        ("stop", ["x"] * (MAX_STOP + 1)),
        ("stop_token_ids", [1] * (MAX_STOP_TOKEN_IDS + 1)),
    ):
        param, message = _field_error(
            CompletionRequest, json.dumps({"prompt": "a", field: value}).encode()
        )
        with pytest.raises(ValueError) as grpc_rule:
            SamplingParams(**{field: value})
        assert param == field and message == str(grpc_rule.value), (message, grpc_rule.value)


CHAT = {"role": "user", "content": "hi"}


@pytest.mark.parametrize(
    ("model", "body", "param", "message"),
    [
        ("chat", {"messages": []}, "messages", "messages: must not be empty"),
        ("chat", {"messages": [CHAT] * 4097}, "messages",
         "messages: at most 4096 messages are supported, got 4097"),
        ("chat", {"messages": [CHAT], "tools": [{}] * 257}, "tools",
         "tools: at most 256 tools are supported, got 257"),
        ("chat", {}, "messages", "messages: required, missing from the body"),
        ("chat", {"messages": [CHAT], "top_logprobs": 1.5}, "top_logprobs",
         "top_logprobs: must be an integer, got a number (1.5)"),
        ("completions", {"prompt": "a", "max_tokens": "3"}, "max_tokens",
         "max_tokens: must be an integer, got a string"),
        ("completions", {"prompt": "a", "temperature": "hot"}, "temperature",
         "temperature: must be a number, got a string"),
        ("completions", {"prompt": "a", "stream": "yes"}, "stream",
         "stream: must be a boolean (true or false), got a string"),
        ("completions", {"prompt": "a", "stop": 5}, "stop",
         "stop: must be a string or a list of strings, got a number (5)"),
        ("completions", {"prompt": "a", "stop": ["a", 5]}, "stop[1]",
         "stop[1]: must be a string, got a number (5)"),
        ("completions", {"prompt": "a", "stream_options": "yes"}, "stream_options",
         "stream_options: must be a JSON object, got a string"),
    ],
)  # fmt: skip
def test_pydantic_errors_are_said_in_our_words(model, body, param, message):
    """Every 400 of a body's shape names the field first and says what it must be, as the
    gRPC messages do; no pydantic wording ("Input should be", "List should have")."""
    from jaxserve.frontend.http.protocol import ChatCompletionRequest, CompletionRequest

    cls = ChatCompletionRequest if model == "chat" else CompletionRequest
    assert _field_error(cls, json.dumps(body).encode()) == (param, message)


@pytest.mark.parametrize(
    ("header", "accepted"),
    [
        (b"application/json", True),
        (b"Application/JSON; charset=utf-8", True),
        (b"text/plain", False),
        (b"application/x-www-form-urlencoded", False),  # curl -d without -H
        (None, False),
    ],
)
def test_only_a_json_content_type_is_read_as_json(header, accepted):
    """As vLLM (validate_json_request) and OpenAI: a body not sent as application/json is
    a 400 saying so, not parsed as JSON anyway."""
    from jaxserve.frontend.http.responses import check_json_content_type

    headers = [] if header is None else [(b"content-type", header)]
    request = _request([], headers)
    if accepted:
        check_json_content_type(request)
        return
    with pytest.raises(HttpError) as info:
        check_json_content_type(request)
    error = info.value.body()["error"]
    assert info.value.status == 400 and error["code"] == "unsupported_media_type"
    assert error["message"].startswith("Content-Type: the body must be sent as application/json")
    assert error["type"] == "invalid_request_error"


def test_json_nested_too_deeply_is_said_so_naming_the_limit():
    """10000 '[' used to be "not valid JSON" (jiter's "recursion limit exceeded"): the
    400 says the body nests too deeply and names the limit, which is jiter's own."""
    from jaxserve.frontend.http.protocol import (
        JSON_MAX_DEPTH,
        CompletionRequest,
        FieldError,
        parse_body,
    )

    for body in (b"[" * 10000, b'{"prompt": "a", "user": ' + b"[" * 300 + b"]" * 300 + b"}"):
        with pytest.raises(FieldError) as info:
            parse_body(CompletionRequest, body)
        assert info.value.param == "body"
        assert str(info.value).startswith(
            f"body: JSON nested too deeply (more than {JSON_MAX_DEPTH} levels of arrays and "
            "objects, at line 1 column "
        ), str(info.value)
    deepest = b"[" * JSON_MAX_DEPTH + b"]" * JSON_MAX_DEPTH  # parses: only not an object
    assert _field_error(CompletionRequest, deepest)[1].startswith("body: not a JSON object")
    one_more = b"[" * (JSON_MAX_DEPTH + 1) + b"]" * (JSON_MAX_DEPTH + 1)
    assert "nested too deeply" in _field_error(CompletionRequest, one_more)[1]


@pytest.mark.parametrize(
    ("encoding", "refused"), [(b"gzip", True), (b"br", True), (b"identity", False)]
)
def test_a_compressed_body_is_a_415_naming_its_content_encoding(encoding, refused):
    """No body decoder runs: Content-Encoding gzip (or any but identity) is a 415 that
    names it, before the body is read; a gzip body sent without the header is a 400
    that says it looks compressed, not only "byte b'\\x8b' is not UTF-8"."""
    import gzip
    import zlib

    from jaxserve.frontend.http.protocol import CompletionRequest

    plain = b'{"prompt": "a"}'
    body = gzip.compress(plain) if refused else plain
    request = _request(
        [{"type": "http.request", "body": body, "more_body": False}],
        [(b"content-encoding", encoding)],
    )
    if not refused:
        assert asyncio.run(read_body(request, 1000)) == plain
        return
    with pytest.raises(HttpError) as info:
        asyncio.run(read_body(request, 1000))
    error = info.value.body()["error"]
    assert info.value.status == 415 and error["code"] == "unsupported_content_encoding"
    assert error["message"] == (
        f"body: Content-Encoding {encoding.decode()} is not supported; send plain JSON "
        "(no Content-Encoding header)"
    )
    param, message = _field_error(CompletionRequest, gzip.compress(plain))
    assert param == "body" and "starts with bytes 1f 8b, as gzip data does" in message
    for level in (1, 6, 9):  # zlib's header byte differs by level: 78 01, 78 9c, 78 da
        deflated = zlib.compress(plain, level)
        param, message = _field_error(CompletionRequest, deflated)
        assert param == "body"
        assert f"starts with bytes 78 {deflated[1]:02x}, as zlib (deflate) data does" in message

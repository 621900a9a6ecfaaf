"""The OpenAI-compatible HTTP API's errors: a bad field is a 400 naming it (in the same
words as gRPC's INVALID_ARGUMENT) while another request streams on; an unknown model is
a 404; a body over the limit is a 413, bad JSON or a wrong content type a 400 (on the
mock engine, tests/mock_engine.py, which starts in a second).
"""

from __future__ import annotations

import json
import socket
import threading
import urllib.error
import urllib.request

import grpc
import openai
import pytest

from http_api_tests.helpers import CHAT, LONG, TIMEOUT_S, http_request, mock_server
from jaxserve import SamplingParams

pytestmark = pytest.mark.slow


def _grpc_details(grpc_client, **kwargs) -> str:
    with pytest.raises(grpc.RpcError) as err:
        list(grpc_client.generate(timeout=TIMEOUT_S, **kwargs))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    return err.value.details()


# (field, completions kwargs, the same request over gRPC or None)
BAD = [
    ("prompt", dict(prompt=""), dict(prompt="")),
    ("prompt", dict(prompt="import os\n" * 400), dict(prompt="import os\n" * 400)),
    ("max_tokens", dict(max_tokens=0), dict(max_tokens=0)),
    ("max_tokens", dict(max_tokens=600), dict(max_tokens=600)),
    ("temperature", dict(temperature=-1.0), dict(temperature=-1.0)),
    ("top_p", dict(top_p=1.5), dict(top_p=1.5)),
    ("top_k", dict(extra_body={"top_k": -2}), dict(top_k=-2)),
    ("min_p", dict(extra_body={"min_p": 2.0}), dict(min_p=2.0)),
    ("presence_penalty", dict(presence_penalty=3.0), dict(presence_penalty=3.0)),
    ("frequency_penalty", dict(frequency_penalty=-3.0), dict(frequency_penalty=-3.0)),
    ("repetition_penalty", dict(extra_body={"repetition_penalty": 0.0}), None),
    ("n", dict(n=0), dict(n=0)),
    ("n", dict(n=129), dict(n=129)),
    ("logprobs", dict(logprobs=21), dict(logprobs=21)),
    ("stop[0]", dict(stop=[""]), dict(stop=[""])),
    # Named by its JSON path in the body (gRPC says "prompt.token_ids", "logit_bias").
    ("logit_bias.100000", dict(logit_bias={"100000": 1.0}), None),
    ("logit_bias.abc", dict(logit_bias={"abc": 1.0}), None),
    ("stop_token_ids[0]", dict(extra_body={"stop_token_ids": [10**6]}), None),
    ("prompt[2]", dict(prompt=[1, 2, 10**6]), None),
    ("temperature", dict(extra_body={"temperature": "hot"}), None),
    ("echo", dict(echo=True), None),
    # vLLM's completions extra: refused as in chat, not ignored (plain text is no JSON).
    ("response_format", dict(extra_body={"response_format": {"type": "json_object"}}), None),
    ("seed", dict(seed=2**70), None),
]


@pytest.fixture(scope="module")
def long_want(llm):
    """The offline LLM's text of the LONG stream (greedy: the same for every case below)."""
    (want,) = llm.generate(
        [LONG["prompt"]], SamplingParams(temperature=0, max_tokens=160, ignore_eos=True)
    )
    return want


@pytest.mark.parametrize(
    "field,kwargs,grpc_kwargs", BAD, ids=[f"{b[0]}-{i}" for i, b in enumerate(BAD)]
)
def test_bad_field_is_400_beside_a_running_stream(
    client, grpc_client, long_want, model_name, field, kwargs, grpc_kwargs
):
    want = long_want
    running = threading.Event()
    result = {}

    def run():
        text = ""
        for chunk in client.completions.create(model=model_name, stream=True, **LONG):
            text += chunk.choices[0].text
            running.set()
        result["text"] = text

    t = threading.Thread(target=run)
    t.start()
    assert running.wait(TIMEOUT_S)
    request = {"prompt": "def ", "max_tokens": 8, **kwargs}
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=model_name, **request)
    error = err.value.body
    assert error["param"] == field, error
    assert error["message"].startswith(f"{field}:"), error
    assert error["type"] == "invalid_request_error"
    if grpc_kwargs is not None:  # the same words as gRPC's INVALID_ARGUMENT
        g = {"prompt": "def ", "max_tokens": 8, **grpc_kwargs}
        assert _grpc_details(grpc_client, **g) == error["message"]
    t.join(TIMEOUT_S)
    assert result["text"] == want.text


CHAT_BAD = [
    ("messages", dict(messages=[])),
    ("messages[0].role", dict(messages=[{"content": "hi"}])),
    (
        "messages[0].content[0]",
        dict(messages=[{"role": "user", "content": [{"type": "image_url"}]}]),
    ),
    ("top_logprobs", dict(messages=CHAT, logprobs=True, top_logprobs=21)),
    ("top_logprobs", dict(messages=CHAT, top_logprobs=2)),
    ("max_completion_tokens", dict(messages=CHAT, max_completion_tokens=0)),
    ("messages", dict(messages=[{"role": "user", "content": "import os\n" * 400}])),
    ("response_format", dict(messages=CHAT, response_format={"type": "json_object"})),
]


@pytest.mark.parametrize(
    "field,kwargs", CHAT_BAD, ids=[f"{b[0]}-{i}" for i, b in enumerate(CHAT_BAD)]
)
def test_bad_chat_field_is_400(client, model_name, field, kwargs):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=model_name, max_tokens=4, **kwargs)
    assert err.value.body["param"] == field, err.value.body


def test_unknown_model_is_404_unknown_fields_are_ignored(server, client, model_name):
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="gpt-5", prompt="def ", max_tokens=2)
    assert err.value.body["param"] == "model" and err.value.body["code"] == "model_not_found"
    got = client.completions.create(
        model=model_name, prompt="def ", max_tokens=2, extra_body={"no_such_field": [1, 2]}
    )
    assert got.choices[0].finish_reason is not None
    assert "Traceback" not in server.log()


# ---------------------------------------------------------------- bodies (mock engine)


def _raw_post_head(url: str, content_length: int, first_bytes: bytes) -> tuple[int, dict]:
    """POST headers announcing `content_length` bytes and only `first_bytes` of them;
    returns the status and JSON body of the answer (sent before the rest of the body)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=TIMEOUT_S) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % content_length + first_bytes
        )
        data = b""
        while b"\r\n\r\n" not in data:
            data += sock.recv(65536)
        head, _, body = data.partition(b"\r\n\r\n")
        length = int(next(
            line.split(b":")[1] for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length:")
        ))  # fmt: skip
        while len(body) < length:
            body += sock.recv(65536)
    return int(head.split()[1]), json.loads(body)


def test_body_over_limit_is_413_and_bad_json_is_400(mock_model_dir):
    srv = mock_server(mock_model_dir).wait_ready()
    try:
        status, body = _raw_post_head(srv.http_url, 32 * 1024 * 1024 + 1, b'{"prompt": "')
        assert status == 413 and body["error"]["code"] == "request_too_large"
        r = http_request("POST", srv.http_url + "/v1/completions", b'{"prompt": ')
        assert r.status_code == 400 and r.json()["error"]["param"] == "body"
        r = http_request("POST", srv.http_url + "/v1/completions", b'{"prompt": "\\ud800"}')
        assert r.status_code == 400 and r.json()["error"]["param"] == "body"
        assert r.json()["error"]["message"].startswith("body: not valid JSON in UTF-8")
        r = http_request("GET", srv.http_url + "/v1/nothing")
        assert r.status_code == 404 and "error" in r.json()
        # JSON sent as text/plain: refused as vLLM refuses it, not read as JSON.
        req = urllib.request.Request(
            srv.http_url + "/v1/completions", data=b'{"prompt": "a"}', method="POST",
            headers={"Content-Type": "text/plain"},
        )  # fmt: skip
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(req, timeout=TIMEOUT_S)
        error = json.loads(refused.value.read())["error"]
        assert refused.value.code == 400 and error["code"] == "unsupported_media_type", error
        assert "'text/plain'" in error["message"]
        assert "Traceback" not in srv.log()
    finally:
        srv.terminate(15)

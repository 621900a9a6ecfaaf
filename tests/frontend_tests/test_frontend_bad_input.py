"""Bad requests to the gRPC frontend: INVALID_ARGUMENT naming the field, beside a
running stream, never a crash.
"""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from frontend_tests.helpers import (
    RPC_TIMEOUT_S,
    _assert_invalid,
    _expected_ids,
    _wait_idle,
    _wait_running,
)
from jaxserve.frontend.client import build_generate_request
from jaxserve.frontend.proto import jaxserve_pb2 as pb
from jaxserve.frontend.proto import jaxserve_pb2_grpc as pb_grpc
from jaxserve.frontend.server import MAX_RECEIVE_MESSAGE_BYTES
from jaxserve.frontend.validation import (
    MAX_N,
)
from jaxserve.sampling_params import MAX_LOGIT_BIAS

# ---------------------------------------------------------------- bad input


BAD_REQUESTS = [
    ("empty text", dict(prompt=""), "prompt"),
    ("empty token ids", dict(prompt=[]), "prompt.token_ids"),
    ("prompt too long", dict(prompt=[5] * 4096), "prompt"),
    ("prompt + max_tokens too long", dict(prompt=[5] * 100, max_tokens=4000), "max_tokens"),
    ("max_tokens 0", dict(prompt="hi", max_tokens=0), "max_tokens"),
    ("max_tokens negative", dict(prompt="hi", max_tokens=-3), "max_tokens"),
    ("negative temperature", dict(prompt="hi", temperature=-0.5), "temperature"),
    ("top_p 0", dict(prompt="hi", top_p=0.0), "top_p"),
    ("top_p above 1", dict(prompt="hi", top_p=1.5), "top_p"),
    ("top_k below -1", dict(prompt="hi", top_k=-2), "top_k"),
    ("token id at vocab size", dict(prompt=[1, "VOCAB"]), "prompt.token_ids"),
    ("negative token id", dict(prompt=[1, -1]), "prompt.token_ids"),
    ("stop token outside vocab", dict(prompt="hi", stop_token_ids=["VOCAB"]), "stop_token_ids[0]"),
    ("empty stop string", dict(prompt="hi", stop=["ok", ""]), "stop[1]"),
    ("n 0", dict(prompt="hi", n=0), "n"),
    ("n negative", dict(prompt="hi", n=-1), "n"),
    ("n above the maximum", dict(prompt="hi", n=MAX_N + 1), "n"),
    # Control characters (C0, DEL, C1), among them the engine ids' separator.
    ("request_id with a newline", dict(prompt="hi", request_id="a\nb"), "request_id"),
    ("request_id with a unit separator", dict(prompt="hi", request_id="a\x1f#0.1"), "request_id"),
    ("request_id with DEL", dict(prompt="hi", request_id="a\x7f"), "request_id"),
    ("request_id with a C1 control", dict(prompt="hi", request_id="\x85a"), "request_id"),
    # The sampler holds MAX_LOGIT_BIAS biases per request, in float32.
    (
        "logit_bias above its maximum entries",
        dict(prompt="hi", logit_bias=dict.fromkeys(range(MAX_LOGIT_BIAS + 1), 1.0)),
        "logit_bias",
    ),
    ("logit_bias beyond float32", dict(prompt="hi", logit_bias={5: 1e308}), "logit_bias.5"),
    ("temperature beyond float32", dict(prompt="hi", temperature=1e308), "temperature"),
    (
        "repetition_penalty beyond float32",
        dict(prompt="hi", repetition_penalty=1e308),
        "repetition_penalty",
    ),
]


def _resolve(value, vocab_size):
    if value == "VOCAB":
        return vocab_size
    if isinstance(value, list):
        return [_resolve(v, vocab_size) for v in value]
    return value


def test_bad_inputs_rejected_beside_a_running_stream(server, client, tok, vocab):
    stub = pb_grpc.JaxserveStub(grpc.insecure_channel(server.target))
    running_id = "long-running"
    long_ids = _expected_ids(tok, vocab, [3, 1, 4], 300)
    result: dict = {}

    def run_long():
        try:
            deltas = list(
                client.generate(
                    [3, 1, 4], request_id=running_id, max_tokens=300, timeout=RPC_TIMEOUT_S
                )
            )
            result["deltas"] = deltas
        except Exception as e:  # reported by the assertion below
            result["error"] = e

    thread = threading.Thread(target=run_long)
    thread.start()
    try:
        _wait_running(client)
        for name, kwargs, field in BAD_REQUESTS:
            kwargs = {k: _resolve(v, vocab[0]) for k, v in kwargs.items()}
            n = kwargs.pop("n", None)
            req = build_generate_request(**kwargs)
            if n is not None:
                req.sampling.n = n
            _assert_invalid(stub, req, field, name)
        _assert_invalid(stub, pb.GenerateRequest(), "prompt", "no prompt")
        dup = build_generate_request("hi", request_id=running_id)
        _assert_invalid(stub, dup, "request_id", "duplicate request id")
        assert thread.is_alive(), "the long stream should still be running"
    finally:
        thread.join(RPC_TIMEOUT_S)
    assert "error" not in result, result.get("error")
    deltas = result["deltas"]
    assert deltas[-1].finish_reason == "length" and deltas[-1].completion_tokens == 300
    assert "".join(d.text for d in deltas) == tok.decode(long_ids)
    _wait_idle(client)


# Raw request bytes that do not parse: invalid UTF-8 in each string field, and a message
# cut short. Field tags: request_id = 1 (0x0a), text = 2 (0x12), stop = 6 (0x32).
UNDECODABLE_GENERATE = [
    ("bad UTF-8 in text", b"\x12\x03\xff\xfeA"),
    ("bad UTF-8 in request_id", b"\x0a\x02\xff\xfe\x12\x02hi"),
    ("bad UTF-8 in stop", b"\x12\x02hi\x32\x02\xff\xfe"),
    ("truncated", b"\x12\x05hi"),
]


def test_undecodable_requests_are_invalid_argument_without_a_traceback(server, client):
    log_start = len(server.lines)
    with grpc.insecure_channel(server.target) as channel:
        generate = channel.unary_stream(
            "/jaxserve.v1.Jaxserve/Generate",
            request_serializer=lambda b: b,
            response_deserializer=pb.GenerateResponse.FromString,
        )
        abort = channel.unary_unary(
            "/jaxserve.v1.Jaxserve/Abort",
            request_serializer=lambda b: b,
            response_deserializer=pb.AbortResponse.FromString,
        )
        calls = [(name, lambda d=data: list(generate(d, timeout=RPC_TIMEOUT_S)), "GenerateRequest")
                 for name, data in UNDECODABLE_GENERATE]  # fmt: skip
        calls.append(
            ("Abort, bad UTF-8", lambda: abort(b"\x0a\x02\xff\xfe", timeout=10), "AbortRequest")
        )
        for name, call, message in calls:
            with pytest.raises(grpc.RpcError) as info:
                call()
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, name
            assert info.value.details().startswith(f"request: not a valid {message} ("), (
                name, info.value.details()
            )  # fmt: skip
        # The same raw path with valid bytes reaches the servicer.
        ok = list(generate(build_generate_request([1, 2], max_tokens=3).SerializeToString()))
        assert ok[-1].finish_reason == "length" and ok[-1].completion_tokens == 3
    # grpc.aio logs a traceback for a deserializer that raises: none here (the log line
    # of a rejected call is written before its status is sent, so it would be in by now).
    client.server_info(timeout=RPC_TIMEOUT_S)
    time.sleep(0.2)
    new_log = "".join(server.lines[log_start:])
    assert "Traceback" not in new_log and "DecodeError" not in new_log, new_log


def test_prompt_over_4_mib_reaches_the_prompt_check(server):
    stub = pb_grpc.JaxserveStub(grpc.insecure_channel(server.target))
    # Above gRPC's default 4 MiB receive limit, below MAX_RECEIVE_MESSAGE_BYTES.
    big = build_generate_request("x" * (5 * 1024 * 1024))
    _assert_invalid(stub, big, "prompt", "5 MiB text prompt")
    huge = build_generate_request("x" * (MAX_RECEIVE_MESSAGE_BYTES + 1))
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(huge, timeout=RPC_TIMEOUT_S))
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED

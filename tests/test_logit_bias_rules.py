"""logit_bias has one rule on every path (gRPC, the OpenAI HTTP API, the offline
SamplingParams): at most MAX_LOGIT_BIAS entries, each value in [-100, 100] as OpenAI's
API requires, with the same message naming the field. Over HTTP a key is a string of
ASCII digits (the JSON object's keys are strings; the other paths take ints)."""

from __future__ import annotations

import json

import pytest

from jaxserve.config import DEMO_MODEL_DIR
from jaxserve.frontend.http.inputs import completion_requests
from jaxserve.frontend.http.protocol import CompletionRequest, FieldError, parse_body
from jaxserve.frontend.proto import jaxserve_pb2 as pb
from jaxserve.frontend.tokenizer import load_tokenizer
from jaxserve.frontend.validation import ModelLimits, build_engine_request
from jaxserve.sampling_params import MAX_LOGIT_BIAS, MAX_LOGIT_BIAS_VALUE, SamplingParams

LIMITS = ModelLimits(max_model_len=256, vocab_size=1000)
TOKENIZER = load_tokenizer(DEMO_MODEL_DIR)


def _grpc(bias: dict[int, float]) -> str | None:
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2]), max_tokens=4)
    request.sampling.logit_bias.update(bias)
    try:
        build_engine_request(request, "r", TOKENIZER, LIMITS)
    except ValueError as e:
        return str(e)
    return None


def _http(bias: dict[int, float]) -> str | None:
    body = {"model": "m", "prompt": [1, 2], "max_tokens": 4, "logit_bias": bias}
    try:
        (request,) = completion_requests(
            parse_body(CompletionRequest, json.dumps(body).encode()), "r", LIMITS
        )
        build_engine_request(request, "r", TOKENIZER, LIMITS)
    except ValueError as e:
        return str(e)
    return None


def _offline(bias: dict[int, float]) -> str | None:
    try:
        SamplingParams(logit_bias=bias).validate(LIMITS.vocab_size)
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.parametrize(
    "bias, error",
    [
        ({5: MAX_LOGIT_BIAS_VALUE, 6: -MAX_LOGIT_BIAS_VALUE}, None),
        ({t: 1.0 for t in range(MAX_LOGIT_BIAS)}, None),
        ({5: 100.5}, "logit_bias.5: the bias of token 5 must be in [-100, 100], got 100.5"),
        ({5: -101.0}, "logit_bias.5: the bias of token 5 must be in [-100, 100], got -101.0"),
        (
            {t: 1.0 for t in range(MAX_LOGIT_BIAS + 1)},
            f"logit_bias: at most {MAX_LOGIT_BIAS} entries are supported, got 65",
        ),
        ({t: 1.0 for t in range(1000)}, "logit_bias: at most 64 entries are supported, got 1000"),
    ],
)
def test_grpc_http_and_offline_agree(bias, error):
    assert MAX_LOGIT_BIAS_VALUE == 100.0  # OpenAI's documented range
    assert _grpc(bias) == error
    assert _http(bias) == error
    assert _offline(bias) == error


def _http_keys(bias: dict[str, float]) -> dict[int, float]:
    """The token ids an HTTP body's logit_bias (string keys) becomes."""
    body = {"model": "m", "prompt": [1, 2], "max_tokens": 4, "logit_bias": bias}
    parsed = parse_body(CompletionRequest, json.dumps(body).encode())
    (request,) = completion_requests(parsed, "r", LIMITS)
    return dict(request.sampling.logit_bias)


def test_http_keys_are_ascii_digits_only():
    assert _http_keys({"0": 1.0, "10": -2.0, "007": 3.0}) == {0: 1.0, 10: -2.0, 7: 3.0}
    for key in (" 1", "1 ", "+1", "1_0", "\uff11", "\u0661", "1.0", "0x1", "", "-", "9" * 5000):
        with pytest.raises(FieldError) as info:
            _http_keys({"5": 1.0, key: 1.0})
        assert info.value.param == f"logit_bias.{key}", key
        assert (
            str(info.value) == f"logit_bias.{key}: key {key!r} is not a token id (digits 0-9 only)"
        )
    # "-1" is an id, out of range: worded by the range check, as over gRPC and offline.
    with pytest.raises(FieldError) as info:
        _http_keys({"-1": 1.0})
    assert str(info.value).startswith("logit_bias.-1: token id -1 "), info.value

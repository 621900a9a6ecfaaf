"""The HTTP API's integer fields (protocol.Int) take a JSON number that is an integer
however written (8.0, 8e0: vLLM's lax pydantic models take it) as that int; 8.5, a
float past 2**53, a string and a boolean are 400s naming the field. A count
(protocol.Count: max_tokens, n, ...) takes a float past 2**53 as the integer it holds,
for its range check to refuse by its limit. The number fields (protocol.Float:
temperature, a logit_bias value, ...) take any JSON number and refuse a string and a
boolean the same way."""

import json
from decimal import Decimal

import pytest

from jaxserve.frontend.http.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    FieldError,
    parse_body,
)

CHAT = [{"role": "user", "content": "hi"}]
# (model, body without the field, the field): every field declared Int, either endpoint.
FIELDS = [
    (CompletionRequest, {"prompt": "a"}, "max_tokens"),
    (CompletionRequest, {"prompt": "a"}, "max_completion_tokens"),
    (CompletionRequest, {"prompt": "a"}, "n"),
    (CompletionRequest, {"prompt": "a"}, "seed"),
    (CompletionRequest, {"prompt": "a"}, "top_k"),
    (CompletionRequest, {"prompt": "a"}, "logprobs"),
    (ChatCompletionRequest, {"messages": CHAT}, "max_tokens"),
    (ChatCompletionRequest, {"messages": CHAT}, "top_logprobs"),
]


def _parse(model, body: dict):
    return parse_body(model, json.dumps(body).encode())


def _refused(model, body: dict) -> tuple[str | None, str]:
    with pytest.raises(FieldError) as info:
        _parse(model, body)
    return info.value.param, str(info.value)


@pytest.mark.parametrize(
    "model,base,field", FIELDS, ids=[f"{m.__name__}.{f}" for m, _, f in FIELDS]
)
def test_an_integral_float_is_the_int_and_others_are_refused_by_name(model, base, field):
    for written in ("8.0", "8e0", "0.8e1"):
        raw = json.dumps(base)[:-1] + f', "{field}": {written}}}'
        got = getattr(parse_body(model, raw.encode()), field)
        assert got == 8 and type(got) is int, (written, got)
    assert _refused(model, {**base, field: 8.5}) == (
        field, f"{field}: must be an integer, got a number (8.5)"
    )  # fmt: skip
    if field == "seed":  # an int64 past 2**53: a float would silently be another seed
        assert _refused(model, {**base, field: 1e30}) == (
            field, f"{field}: must be an integer, got a number (1e+30), past 2**53, where a "
            "JSON number with an exponent or fraction is no exact integer: write its digits"
        )  # fmt: skip
    else:  # far past the count's range, which names its limit (tests/test_http_port.py)
        assert getattr(_parse(model, {**base, field: 1e16}), field) == 10**16
        exact = int(Decimal(1e30))  # the float's own digits: 1000000000000000019884624838656
        assert getattr(_parse(model, {**base, field: 1e30}), field) == exact
    assert _refused(model, {**base, field: True}) == (
        field, f"{field}: must be an integer, got a boolean (true)"
    )  # fmt: skip
    assert _refused(model, {**base, field: "8"}) == (
        field, f"{field}: must be an integer, got a string"
    )  # fmt: skip


@pytest.mark.parametrize(
    "model,base,field", FIELDS, ids=[f"{m.__name__}.{f}" for m, _, f in FIELDS]
)
def test_an_integer_of_thousands_of_digits_is_named_by_its_field(model, base, field):
    """Past Python's int-string limit (4300 digits) jiter refused the body as "number out
    of range", and the 400 named `body`; now the field, as its other errors do."""
    for sign, size in (("", "large"), ("-", "small")):
        raw = json.dumps(base)[:-1] + f', "{field}": {sign}{"9" * 5000}}}'
        with pytest.raises(FieldError) as info:
            parse_body(model, raw.encode())
        assert (info.value.param, str(info.value)) == (
            field, f"{field}: too {size} (an integer of 5000 digits)"
        )  # fmt: skip


def test_an_integer_of_thousands_of_digits_inside_a_list_or_object_is_named_by_its_path():
    huge = "1" * 4301  # one digit past the limit
    raw = '{"prompt": [1, 2, HUGE], "max_tokens": 3}'.replace("HUGE", huge)
    with pytest.raises(FieldError, match=r"^prompt\[2\]: too large \(an integer of 4301"):
        parse_body(CompletionRequest, raw.encode())
    raw = '{"prompt": "a", "logit_bias": {"5": 1, "7": HUGE}}'.replace("HUGE", huge)
    with pytest.raises(FieldError, match=r"^logit_bias\.7: too large \(an integer of 4301"):
        parse_body(CompletionRequest, raw.encode())
    # A body that is no JSON object, or no JSON, keeps its own message.
    with pytest.raises(FieldError, match=r"^body: not valid JSON in UTF-8 \(number out of"):
        parse_body(CompletionRequest, f"[{huge}]".encode())
    with pytest.raises(FieldError, match=r"^body: not valid JSON in UTF-8 \(number out of"):
        parse_body(CompletionRequest, ('{"prompt": "a", "n": ' + huge).encode())


def test_token_ids_written_as_integral_floats_are_ids():
    got = _parse(CompletionRequest, {"prompt": [5.0, 6], "stop_token_ids": [2.0, 3]})
    assert got.prompt == [5, 6] and got.stop_token_ids == [2, 3]
    assert all(type(t) is int for t in got.prompt + got.stop_token_ids)
    assert _parse(CompletionRequest, {"prompt": [[5], [6.0, 7.0]]}).prompt == [[5], [6, 7]]


@pytest.mark.parametrize(
    "body,param",
    [
        ({"prompt": [5.0, 6.5]}, "prompt[1]"),
        ({"prompt": [[5.0], [6, True]]}, "prompt[1][1]"),
        ({"prompt": "a", "stop_token_ids": [2.0, 3.5]}, "stop_token_ids[1]"),
    ],
)
def test_a_token_id_that_is_no_integer_is_named_by_its_index(body, param):
    got, message = _refused(CompletionRequest, body)
    assert got == param and message.startswith(f"{param}: "), message


# (model, body without the field, the field): every field declared Float, either endpoint.
FLOAT_FIELDS = [
    (model, base, field)
    for model, base in (
        (CompletionRequest, {"prompt": "a"}),
        (ChatCompletionRequest, {"messages": CHAT}),
    )
    for field in (
        "temperature",
        "top_p",
        "min_p",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
    )
]


@pytest.mark.parametrize(
    "model,base,field", FLOAT_FIELDS, ids=[f"{m.__name__}.{f}" for m, _, f in FLOAT_FIELDS]
)
def test_a_number_field_takes_numbers_and_refuses_strings_by_name(model, base, field):
    for written, want in (("0.5", 0.5), ("0", 0.0), ("5e-1", 0.5)):
        raw = json.dumps(base)[:-1] + f', "{field}": {written}}}'
        assert getattr(parse_body(model, raw.encode()), field) == want, written
    for sent in ("0", " 0 ", "0.5", "nan"):
        assert _refused(model, {**base, field: sent}) == (
            field, f"{field}: must be a number, got a string"
        )  # fmt: skip
    assert _refused(model, {**base, field: False}) == (
        field, f"{field}: must be a number, got a boolean (false)"
    )  # fmt: skip


def test_a_logit_bias_value_that_is_no_number_is_named_by_its_key():
    got = _parse(CompletionRequest, {"prompt": "a", "logit_bias": {"5": 1, "6": -0.5}})
    assert got.logit_bias == {"5": 1.0, "6": -0.5}
    for sent, kind in (("1", "a string"), (" 1 ", "a string"), (True, "a boolean (true)")):
        body = {"prompt": "a", "logit_bias": {"5": 1.0, "7": sent}}
        assert _refused(CompletionRequest, body) == (
            "logit_bias.7", f"logit_bias.7: must be a number, got {kind}"
        )  # fmt: skip

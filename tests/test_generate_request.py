"""The Python client's GenerateRequest building (frontend/generate_request.py): a str
stop is one stop string, and a wrong type or out-of-range value is an error naming the
argument, never a silent conversion (found by session 18's fresh-user trial)."""

from __future__ import annotations

import numpy as np
import pytest

from jaxserve.frontend.client import build_generate_request


def test_a_str_stop_is_one_stop_string_as_in_the_http_api():
    assert list(build_generate_request("def f(", stop="return").stop) == ["return"]
    assert list(build_generate_request("def f(", stop="\n\n").stop) == ["\n\n"]
    assert list(build_generate_request("x", stop=["a", "bc"]).stop) == ["a", "bc"]


def test_token_ids_prompt_and_lists_take_ints_of_any_int_type():
    req = build_generate_request([1, np.int32(2), np.int64(3)], stop_token_ids=(np.int64(7),))
    assert list(req.token_ids.ids) == [1, 2, 3] and list(req.stop_token_ids) == [7]
    req = build_generate_request("x", logit_bias={np.int64(5): 1.5, 6: -2})
    assert dict(req.sampling.logit_bias) == {5: 1.5, 6: -2.0}
    assert req.HasField("sampling")  # present with every field unset, as before


@pytest.mark.parametrize(
    ("kwargs", "error", "names"),
    [
        (dict(prompt=b"def "), TypeError, "prompt: expected str text or a sequence of int"),
        (dict(prompt=[1.9]), TypeError, "prompt[0]: expected an int, got float"),
        (dict(prompt=["7"]), TypeError, "prompt[0]: expected an int, got str"),
        (dict(prompt=[True]), TypeError, "prompt[0]: expected an int, got bool"),
        (dict(prompt=None), TypeError, "prompt: expected"),
        (dict(max_tokens="8"), TypeError, "max_tokens:"),
        (dict(max_tokens=2**31), ValueError, "max_tokens:"),
        (dict(n=2**31), ValueError, "n:"),
        (dict(seed=2**64), ValueError, "seed:"),
        (dict(temperature="hot"), TypeError, "temperature:"),
        (dict(logit_bias={"5": 1.0}), TypeError, "logit_bias key '5': expected an int"),
        (dict(logit_bias={5: "a"}), TypeError, "logit_bias[5]:"),
        (dict(logit_bias=[(5, 1.0)]), TypeError, "logit_bias: expected a mapping"),
        (
            dict(stop=["ok", "\udcff"]),
            ValueError,
            "stop[1]: not valid UTF-8 text (byte b'\\xff' is not UTF-8 at 0)",
        ),
        (dict(stop=[3]), TypeError, "stop[0]: expected a str, got int"),
        (dict(stop_token_ids=[2**40]), ValueError, "stop_token_ids:"),
        (dict(stop_token_ids="12"), TypeError, "stop_token_ids[0]: expected an int, got str"),
        (dict(request_id="\udcff"), ValueError, "request_id:"),
    ],
)
def test_a_bad_argument_is_an_error_naming_it(kwargs, error, names):
    kwargs = {"prompt": "def f(", **kwargs}
    with pytest.raises(error) as got:
        build_generate_request(kwargs.pop("prompt"), **kwargs)
    assert str(got.value).startswith(names), str(got.value)

"""SamplingParams.validate: every limit the engine's sampler has is checked at the door,
with an error naming the field (no JAX, no engine)."""

from __future__ import annotations

import re

import numpy as np
import pytest

from jaxserve.engine import sampling_metadata
from jaxserve.sampling_params import FLOAT32_MAX, MAX_LOGIT_BIAS, SamplingParams

VOCAB = 1000


def test_logit_bias_limit_is_the_samplers():
    # The sampler's bias arrays are [rows, MAX_LOGIT_BIAS]: the limit validate enforces
    # must be exactly their width.
    md = sampling_metadata.prepare_sampling_metadata([], 1, VOCAB, 0)
    assert md.logit_bias_ids.shape[1] == MAX_LOGIT_BIAS
    SamplingParams(logit_bias={t: 1.0 for t in range(MAX_LOGIT_BIAS)}).validate(VOCAB)
    too_many = {t: 1.0 for t in range(MAX_LOGIT_BIAS + 1)}
    with pytest.raises(ValueError, match=f"^logit_bias: at most {MAX_LOGIT_BIAS} entries"):
        SamplingParams(logit_bias=too_many).validate(VOCAB)
    with pytest.raises(ValueError, match="^logit_bias"):
        SamplingParams(logit_bias=too_many)  # also without a vocabulary: at construction


def test_float32_max_is_numpys():
    assert FLOAT32_MAX == float(np.finfo(np.float32).max)
    assert np.isfinite(np.float32(FLOAT32_MAX))


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(temperature=1e308), "temperature"),
        (dict(temperature=3.5e38), "temperature"),
        (dict(temperature=10**400), "temperature"),  # an int no float holds
        (dict(temperature=float("inf")), "temperature"),
        (dict(repetition_penalty=1e308), "repetition_penalty"),
        (dict(repetition_penalty=float("nan")), "repetition_penalty"),
        (dict(repetition_penalty=1e-300), "repetition_penalty"),  # 0 in float32
        (dict(top_p=1e-300), "top_p"),  # 0 in float32: would keep no token
        (dict(min_p=float("nan")), "min_p"),
        (dict(presence_penalty=-1e308), "presence_penalty"),
        (dict(frequency_penalty=float("-inf")), "frequency_penalty"),
        (dict(logit_bias={5: 1e308}), "logit_bias.5"),
        (dict(logit_bias={5: -1e308}), "logit_bias.5"),
        (dict(logit_bias={5: float("nan")}), "logit_bias.5"),
    ],
)
def test_floats_beyond_float32_are_rejected_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"^{re.escape(field)}:"):
        SamplingParams(**kwargs).validate(VOCAB)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(temperature=FLOAT32_MAX),
        dict(repetition_penalty=FLOAT32_MAX),
        dict(repetition_penalty=1e-40),  # a float32 subnormal, still > 0
        dict(top_p=1e-40),
    ],
)
def test_float32_extremes_are_accepted(kwargs):
    (value,) = kwargs.values()
    values = value.values() if isinstance(value, dict) else [value]
    # The premise: each value is a finite, non-zero float32.
    assert all(np.isfinite(np.float32(v)) and np.float32(v) != 0 for v in values)
    SamplingParams(**kwargs).validate(VOCAB)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(seed=1.5), "seed"),
        (dict(top_k=2.5), "top_k"),
        (dict(max_tokens=3.0), "max_tokens"),
        (dict(logprobs=2.5), "logprobs"),
        (dict(prompt_logprobs="3"), "prompt_logprobs"),
        (dict(temperature="hot"), "temperature"),
        (dict(top_p=None), "top_p"),
        (dict(stop=["ok", 3]), "stop"),
        (dict(stop_token_ids=["a"]), "stop_token_ids"),
        (dict(logit_bias={"a": 1.0}), "logit_bias"),
        (dict(logit_bias={5: "big"}), "logit_bias.5"),
        (dict(logit_bias=[(5, 1.0)]), "logit_bias"),
        # bool is an int to Python, but True is no count or id (it was taken as 1).
        (dict(max_tokens=True), "max_tokens"),
        (dict(n=True), "n"),
        (dict(top_k=False), "top_k"),
        (dict(seed=True), "seed"),
        (dict(logprobs=True), "logprobs"),
        (dict(stop_token_ids=[1, True]), "stop_token_ids"),
        (dict(logit_bias={True: 1.0}), "logit_bias"),
    ],
)
def test_wrong_types_are_rejected_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"^{re.escape(field)}:"):
        SamplingParams(**kwargs).validate(VOCAB)


def test_numpy_numbers_are_accepted():
    SamplingParams(
        temperature=np.float32(0.5),
        top_k=np.int64(5),
        seed=np.int64(7),
        logit_bias={np.int32(3): np.float64(2.0)},
    ).validate(VOCAB)


def test_from_dict_names_logit_bias_on_bad_entries():
    with pytest.raises(ValueError, match="^logit_bias:"):
        SamplingParams.from_dict({"logit_bias": {"x": 1.0}})
    with pytest.raises(ValueError, match="^logit_bias:"):
        SamplingParams.from_dict({"logit_bias": {"1": None}})
    params = SamplingParams.from_dict({"logit_bias": {"3": 2}})
    assert params.logit_bias == {3: 2.0}


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(temperature=-1.0), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(n=0), "n"),
        (dict(stop=[""]), "stop[0]"),
        (dict(stop=["ok", "x" * 257]), "stop[1]"),
        (dict(logit_bias={5: 101.0}), "logit_bias.5"),
        (dict(logprobs=21), "logprobs"),
        (dict(top_k=-2), "top_k"),
    ],
)
def test_validated_at_construction_as_vllm(kwargs, field):
    """vLLM's SamplingParams raises at construction; so does ours, naming the field (and
    the element of a list or map: stop[1], logit_bias.5, as the HTTP API's param)."""
    with pytest.raises(ValueError, match=f"^{re.escape(field)}: "):
        SamplingParams(**kwargs)


def test_top_k_0_is_disabled_as_in_vllm():
    # It was refused ("must be -1 (disabled) or >= 1"); vLLM takes 0 or -1 for "all tokens".
    assert SamplingParams(top_k=0).top_k == -1  # the sampler's "disabled"
    assert SamplingParams(top_k=-1).top_k == -1 and SamplingParams(top_k=1).top_k == 1
    params = SamplingParams()
    params.top_k = 0  # assigned after construction: validate normalizes it too
    params.validate(VOCAB)
    assert params.top_k == -1


def test_stop_string_is_a_list_of_one_and_token_ids_wait_for_the_vocab():
    assert SamplingParams(stop="\n").stop == ["\n"]
    params = SamplingParams(stop_token_ids=[10**6])  # no vocabulary known yet
    with pytest.raises(ValueError, match=r"^stop_token_ids\[0\]: token id 1000000 outside"):
        params.validate(VOCAB)


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({}, None),
        ({"stop_token_ids": [1, VOCAB - 1], "logit_bias": {0: 1.0, VOCAB - 1: -1.0}}, None),
        ({"stop_token_ids": [1, VOCAB]}, f"stop_token_ids[1]: token id {VOCAB} "),
        ({"logit_bias": {3: 1.0, VOCAB + 2: 2.0, -1: 0.5}}, f"logit_bias.{VOCAB + 2}: "),
        # Both out: the logit_bias key is named first, as validate names it.
        ({"stop_token_ids": [VOCAB + 5], "logit_bias": {VOCAB: 1.0}}, f"logit_bias.{VOCAB}: "),
    ],
)
def test_check_token_ids_raises_what_validate_with_the_vocab_adds(kwargs, named):
    """The engine's door check (validate_request) runs check_token_ids on parameters
    from_dict already validated, instead of a second full validate(vocab_size): the
    two must accept and refuse the same parameters with the same words."""

    def outcome(check) -> str | None:
        try:
            check()
        except ValueError as e:
            return str(e)
        return None

    params = SamplingParams.from_dict(SamplingParams(**kwargs).to_dict())
    expected = outcome(lambda: params.validate(VOCAB))
    assert outcome(lambda: params.check_token_ids(VOCAB)) == expected
    if named is None:
        assert expected is None
    else:
        assert expected.startswith(named) and expected.endswith(f"[0, {VOCAB})"), expected


def test_a_token_id_outside_the_vocabulary_has_one_wording_everywhere():
    """Every place that checks a token id against the vocabulary (the shared rule, the
    gRPC prompt check, the HTTP API's own check, the engine's sampler packing) says it
    in the same words; they used to be "outside [0, V)" in some and "outside the
    vocabulary [0, V)" in others."""
    import json

    from jaxserve.frontend.http.inputs import completion_requests
    from jaxserve.frontend.http.protocol import CompletionRequest, parse_body
    from jaxserve.frontend.proto import jaxserve_pb2 as pb
    from jaxserve.frontend.validation import ModelLimits, build_engine_request

    def error(call) -> str:
        with pytest.raises(ValueError) as e:
            call()
        return str(e.value)

    def http(**fields):
        body = parse_body(CompletionRequest, json.dumps({"prompt": "a", **fields}).encode())
        return completion_requests(body, "r", ModelLimits(max_model_len=64, vocab_size=VOCAB))

    grpc_prompt = pb.GenerateRequest()
    grpc_prompt.token_ids.ids.append(VOCAB)
    md = sampling_metadata.prepare_sampling_metadata([], 1, VOCAB, 0)
    big = 2**31  # past the proto's int32: refused by the HTTP API itself
    messages = {
        # Named by index and key, as the HTTP API's JSON paths (gRPC said only the field).
        ("stop_token_ids[1]", VOCAB): error(
            lambda: SamplingParams(stop_token_ids=[1, VOCAB]).validate(VOCAB)
        ),
        (f"logit_bias.{VOCAB}", VOCAB): error(
            lambda: SamplingParams(logit_bias={VOCAB: 1.0}).validate(VOCAB)
        ),
        ("logit_bias", VOCAB + 1): error(
            lambda: sampling_metadata._fill_logit_bias(md, 0, {VOCAB + 1: 1.0}, VOCAB)
        ),
        ("prompt.token_ids", VOCAB): error(
            lambda: build_engine_request(
                grpc_prompt, "r", None, ModelLimits(max_model_len=64, vocab_size=VOCAB)
            )
        ),
        # The HTTP API names the id by its JSON path in the body.
        ("stop_token_ids[0]", big): error(lambda: http(stop_token_ids=[big])),
        ("logit_bias.-1", -1): error(lambda: http(logit_bias={"-1": 1.0})),
    }
    tails = set()
    for (field, token_id), message in messages.items():
        head = f"{field}: token id {token_id} "
        assert message.startswith(head), message
        tails.add(message[len(head) :])
    assert len(tails) == 1, tails
    (tail,) = tails
    assert tail.endswith(f"[0, {VOCAB})") and "vocabulary" in tail, tail

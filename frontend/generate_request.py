"""`build_generate_request`: the Python client's arguments as one `GenerateRequest`.

The client checks only what protobuf could not carry or would change silently (a type, a
range of the message's fields, text that is not UTF-8), each error naming its argument as
the server's do; the server checks the rest (INVALID_ARGUMENT naming the field). A str
where a list of strings is expected is one item (`stop="\n\n"` is one stop string, as in
the HTTP API and OpenAI's), never split into characters.
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Iterable, Mapping, Sequence

from jaxserve.frontend.proto import jaxserve_pb2 as pb
from jaxserve.sampling_params import check_prompt_text


def build_generate_request(
    prompt: str | Sequence[int],
    *,
    request_id: str | None = None,
    max_tokens: int | None = None,
    temperature: float | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
    seed: int | None = None,
    repetition_penalty: float | None = None,
    presence_penalty: float | None = None,
    frequency_penalty: float | None = None,
    logit_bias: Mapping[int, float] | None = None,
    n: int | None = None,
    stop: str | Sequence[str] = (),
    stop_token_ids: Sequence[int] = (),
    ignore_eos: bool = False,
    skip_special_tokens: bool | None = None,
    return_token_ids: bool = False,
    logprobs: int | None = None,
    prompt_logprobs: int | None = None,
) -> pb.GenerateRequest:
    """The GenerateRequest for these arguments; None leaves a field unset (server default,
    see jaxserve.proto). A str prompt is text; a sequence of ints is token ids. `stop`: a
    str or a sequence of str.

    Raises:
        TypeError: an argument of the wrong type (the message names it: e.g. a bytes
            prompt, a float token id, max_tokens="8").
        ValueError: a str that is not valid UTF-8 text (e.g. bytes decoded with
            surrogateescape, as sys.stdin does with invalid bytes), or a number outside
            its field's protobuf range (e.g. max_tokens=2**31); the message names it.
    """
    req = pb.GenerateRequest()
    with _named("request_id"):
        req.request_id = request_id or ""
    if isinstance(prompt, str):
        check_prompt_text("prompt", prompt)
        req.text = prompt
    else:
        ids = _int_list("prompt", prompt, "str text or a sequence of int token ids")
        with _named("prompt"):
            req.token_ids.ids.extend(ids)
    sampling = req.sampling
    sampling.SetInParent()  # present, as before, even with every field unset
    _set_given(
        sampling,
        dict(
            temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed,
            repetition_penalty=repetition_penalty, presence_penalty=presence_penalty,
            frequency_penalty=frequency_penalty, n=n,
        ),
    )  # fmt: skip
    if logit_bias:
        if not isinstance(logit_bias, Mapping):
            raise TypeError(
                f"logit_bias: expected a mapping of token id to bias, got {_kind(logit_bias)}"
            )
        for token, bias in logit_bias.items():
            key = _index(f"logit_bias key {token!r}", token)
            with _named(f"logit_bias[{key}]"):
                sampling.logit_bias[key] = bias
    for i, text in enumerate([stop] if isinstance(stop, str) else _sequence("stop", stop)):
        if not isinstance(text, str):
            raise TypeError(f"stop[{i}]: expected a str, got {_kind(text)}")
        check_prompt_text(f"stop[{i}]", text)
        req.stop.append(text)
    stop_ids = _int_list("stop_token_ids", stop_token_ids)
    with _named("stop_token_ids"):
        req.stop_token_ids.extend(stop_ids)
    _set_given(
        req,
        dict(
            ignore_eos=ignore_eos, return_token_ids=return_token_ids, max_tokens=max_tokens,
            skip_special_tokens=skip_special_tokens, logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
        ),
    )  # fmt: skip
    return req


def _kind(value) -> str:
    return type(value).__name__


@contextlib.contextmanager
def _named(name: str):
    """Re-raise a TypeError or ValueError from protobuf (a wrong type, a number outside the
    field's range, a str it cannot encode) with a message that starts with `name`."""
    try:
        yield
    except UnicodeError as e:  # its subclasses take no plain message
        raise ValueError(f"{name}: {e}") from None
    except (TypeError, ValueError) as e:
        raise type(e)(f"{name}: {e}") from None


def _set_given(message, fields: dict) -> None:
    """Set each field of `fields` that is not None on `message` (None leaves it unset)."""
    for name, value in fields.items():
        if value is not None:
            with _named(name):
                setattr(message, name, value)


def _sequence(name: str, value, expected: str = "a sequence") -> Iterable:
    if isinstance(value, bytes | bytearray | Mapping) or not isinstance(value, Iterable):
        raise TypeError(f"{name}: expected {expected}, got {_kind(value)}")
    return value


def _index(name: str, value) -> int:
    """value as an int: ints (numpy's too), not floats, bools or strings."""
    if isinstance(value, bool):
        raise TypeError(f"{name}: expected an int, got bool")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name}: expected an int, got {_kind(value)} {value!r:.40}") from None


def _int_list(name: str, values, expected: str = "a sequence of int") -> list[int]:
    return [_index(f"{name}[{i}]", v) for i, v in enumerate(_sequence(name, values, expected))]

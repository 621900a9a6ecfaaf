"""chat_template_kwargs on /v1/chat/completions (frontend/http/inputs.py): as in vLLM,
they reach the template as variables and override the named fields; `messages` is
reserved; and the words of inputs.py's own range checks (max_tokens past int32). Host
only: the request is built as the server builds it, no server."""

from __future__ import annotations

import json

import pytest

from jaxserve.config import DEMO_MODEL_DIR
from jaxserve.frontend.http.chat_template import ChatTemplate
from jaxserve.frontend.http.inputs import chat_request
from jaxserve.frontend.http.protocol import ChatCompletionRequest, FieldError, parse_body
from jaxserve.frontend.tokenizer import load_tokenizer
from jaxserve.frontend.validation import ModelLimits

LIMITS = ModelLimits(max_model_len=256, vocab_size=1000)
TOKENIZER = load_tokenizer(DEMO_MODEL_DIR)
# Prints the variables the test sets, so the rendered text shows what the template saw.
TEMPLATE = ChatTemplate(
    "{% for m in messages %}{{ m.role }}:{{ m.content }};{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}{{ flavour | default('') }}"
)


def _prompt(**fields) -> str:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    request = chat_request(
        parse_body(ChatCompletionRequest, json.dumps(body).encode()), "r", TEMPLATE,
        TOKENIZER, LIMITS,
    )  # fmt: skip
    return TOKENIZER.decode(list(request.token_ids.ids))


def test_kwargs_are_template_variables_and_override_named_fields():
    assert _prompt() == "user:hi;assistant:"
    assert _prompt(chat_template_kwargs={"flavour": "X"}) == "user:hi;assistant:X"
    assert _prompt(chat_template_kwargs={"add_generation_prompt": False}) == "user:hi;"


def test_continue_final_message_alone_says_to_unset_add_generation_prompt():
    """add_generation_prompt defaults to true (as vLLM), so continue_final_message alone
    is a 400; its message names both fields and the value to send, and sending that
    renders the last message open."""
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hel"}]
    with pytest.raises(FieldError) as e:
        _prompt(messages=chat, continue_final_message=True)
    assert e.value.param == "continue_final_message"
    assert str(e.value).startswith("continue_final_message: ")
    assert "add_generation_prompt: false" in str(e.value)
    fixed = _prompt(messages=chat, continue_final_message=True, add_generation_prompt=False)
    assert fixed == "user:hi;assistant:Hel"


def test_messages_in_kwargs_is_a_field_error():
    with pytest.raises(FieldError, match="^chat_template_kwargs: 'messages' is reserved") as e:
        _prompt(chat_template_kwargs={"messages": []})
    assert e.value.param == "chat_template_kwargs"


def test_a_chat_too_long_for_the_model_is_refused_before_tokenizing():
    """A chat whose rendered text has more characters than max_model_len tokens can hold
    is a 400 naming `messages` from its length alone, as a completions prompt is (it
    used to be tokenized first: 40 s of the frontend for 32 MB)."""
    from jaxserve.frontend.validation import max_prompt_chars

    limit = max_prompt_chars(TOKENIZER, LIMITS)
    with pytest.raises(FieldError, match="cannot fit in max_model_len 256") as e:
        _prompt(messages=[{"role": "user", "content": "ab " * (limit // 3 + 1)}])
    assert e.value.param == "messages" and f"at most {limit})" in str(e.value)


def _completion(**fields) -> list:
    from jaxserve.frontend.http.inputs import completion_requests
    from jaxserve.frontend.http.protocol import CompletionRequest

    body = parse_body(CompletionRequest, json.dumps({"prompt": [1], **fields}).encode())
    return completion_requests(body, "r", LIMITS)


def _accepted(max_tokens: int) -> bool:
    """Whether the shared rule (the gRPC path) takes max_tokens for a one-token prompt."""
    from jaxserve.frontend.proto import jaxserve_pb2 as pb
    from jaxserve.frontend.validation import RequestValidationError, build_engine_request

    request = pb.GenerateRequest(max_tokens=max_tokens)
    request.token_ids.ids.append(1)
    try:
        build_engine_request(request, "r", TOKENIZER, LIMITS)
    except RequestValidationError:
        return False
    return True


@pytest.mark.parametrize("name", ["max_tokens", "max_completion_tokens"])
@pytest.mark.parametrize("value", [2**31, -(2**31) - 1, 10**30])
def test_max_tokens_past_int32_names_the_range_the_server_accepts(name, value):
    """A max_tokens that cannot fit the proto's int32 used to be refused with int32's
    range ("must be within [-2147483648, 2147483647]"), though the server refuses every
    value below 1. The message gives the real range: each end is accepted by the shared
    rule and the values just past it are refused."""
    import re

    make = (lambda: _completion(**{name: value})) if name == "max_tokens" else (
        lambda: _prompt(**{name: value})
    )  # fmt: skip
    with pytest.raises(FieldError) as e:
        make()
    assert e.value.param == name and str(e.value).startswith(f"{name}: "), str(e.value)
    low, high = map(int, re.search(r"within \[(-?\d+), (-?\d+)\]", str(e.value)).groups())
    assert _accepted(low) and _accepted(high)
    assert not _accepted(low - 1) and not _accepted(high + 1)
    assert str(value) in str(e.value)


def _shared_rule_error(field: str, value: int) -> str:
    """The shared rule's (gRPC's) message for `field` = value on a one-token prompt."""
    from jaxserve.frontend.proto import jaxserve_pb2 as pb
    from jaxserve.frontend.validation import RequestValidationError, build_engine_request

    request = pb.GenerateRequest(max_tokens=4)
    request.token_ids.ids.append(1)
    if field == "logprobs":
        request.logprobs = value
    else:
        setattr(request.sampling, field, value)
    with pytest.raises(RequestValidationError) as e:
        build_engine_request(request, "r", TOKENIZER, LIMITS)
    return str(e.value)


@pytest.mark.parametrize(
    ("name", "rule_field", "refused"),
    [("n", "n", 10**6), ("top_k", "top_k", -5), ("logprobs", "logprobs", 10**6),
     ("top_logprobs", "logprobs", 10**6)],
)  # fmt: skip
@pytest.mark.parametrize("value", [2**31, -(2**31) - 1])
def test_other_ints_past_int32_get_the_shared_rules_words(name, rule_field, refused, value):
    """n, top_k, logprobs and top_logprobs past int32 used to say "must be within
    [-2147483648, 2147483647]"; they now say what the shared rule says of a refused value
    that fits int32 (its accepted values), naming the HTTP field; top_k, whose rule has
    no upper end, also says int32's (">= 1, got 2147483648" contradicted itself)."""
    if name == "top_logprobs":
        make = lambda: _prompt(logprobs=True, top_logprobs=value)  # noqa: E731
    else:
        make = lambda: _completion(**{name: value})  # noqa: E731
    with pytest.raises(FieldError) as e:
        make()
    assert e.value.param == name
    shared = _shared_rule_error(rule_field, refused)
    want = shared.replace(str(refused), str(value)).replace(rule_field, name, 1)
    if name == "top_k":
        want = want.replace(", got ", ", at most 2147483647, got ")
    assert str(e.value) == want


@pytest.mark.parametrize(
    ("message", "words"),
    [
        ({"content": "hi"}, "is required"),
        ({"role": None, "content": "hi"}, "must be a string, got null"),
        ({"role": 5, "content": "hi"}, "must be a string, got a number (5)"),
        ({"role": ["user"], "content": "hi"}, "must be a string, got a list"),
        ({"role": "", "content": "hi"}, "must not be empty"),
    ],
)
def test_a_bad_role_is_named_with_what_is_wrong(message, words):
    """A message without a role said "messages[1].role: must be a string" (fresh-user
    trial); a missing role is now "is required", as a missing content is, and a wrong
    one says what came."""
    with pytest.raises(FieldError) as e:
        _prompt(messages=[{"role": "user", "content": "hi"}, message])
    assert e.value.param == "messages[1].role"
    assert str(e.value) == f"messages[1].role: {words}"
    with pytest.raises(FieldError) as e:  # the content's words, for comparison
        _prompt(messages=[{"role": "user"}])
    assert str(e.value) == "messages[0].content: is required"


CALL = {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}}


@pytest.mark.parametrize(
    ("fields", "param", "count", "limit"),
    [
        ({"messages": [{"role": "assistant", "content": "x", "tool_calls": [CALL] * 257}]},
         "messages[0].tool_calls", 257, 256),
        ({"messages": [{"role": "user", "content": "x", "extra": {"l": [0] * 4097}}]},
         "messages[0].extra.l", 4097, 4096),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"a": {"enum": list(range(4097))}}}}}]},
         "tools[0].function.parameters.properties.a.enum", 4097, 4096),
        ({"chat_template_kwargs": {"docs": [[1] * 4097]}}, "chat_template_kwargs.docs[0]",
         4097, 4096),
    ],
)  # fmt: skip
def test_lists_the_template_gets_have_a_limit_named_by_path(fields, param, count, limit):
    """Lists inside messages, tools and chat_template_kwargs go to the template as given:
    each has a limit (256 tool calls a message, 4096 items elsewhere), and one past it
    is a 400 naming its path; at the limit it is fine."""
    with pytest.raises(FieldError) as e:
        _prompt(**fields)
    assert e.value.param == param
    assert str(e.value) == f"{param}: at most {limit} items, got {count}"


def test_lists_at_the_limit_pass():
    message = {"role": "assistant", "content": "x", "tool_calls": [CALL] * 256}
    ok = _prompt(messages=[message], chat_template_kwargs={"docs": [0] * 4096})
    assert ok.startswith("assistant:x;")

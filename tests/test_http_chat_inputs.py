"""chat_template_kwargs on /v1/chat/completions (frontend/http/inputs.py): as in vLLM,
they reach the template as variables and override the named fields; `messages` is
reserved. Host only: the request is built as the server builds it, no server."""

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

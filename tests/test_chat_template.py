"""Chat templates (frontend/http/chat_template.py) against transformers' apply_chat_template.

Two real template styles are written here: a Qwen2.5-style ChatML template (a default
system prompt, tool definitions rendered with tojson, tool calls, a namespace) and a
Llama-2-style one (bos_token/eos_token variables, the system prompt folded into the first
user turn, raise_exception on turns that do not alternate). transformers renders the same
messages with a PreTrainedTokenizerFast over the same tokenizer.json; text and token ids
must be equal.
"""

from __future__ import annotations

import json
import re

import pytest
from mock_engine import train_test_tokenizer

from jaxserve.frontend.http.chat_template import (
    ChatTemplate,
    ChatTemplateError,
    encode_chat,
    load_chat_template,
    special_tokens,
)

# Qwen2.5's template (its structure: tools block, default system prompt, tool calls and
# tool responses), written out here.
QWEN_STYLE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(turns=0) %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first)
            or (message.role == "assistant" and not message.tool_calls) %}
        {%- set ns.turns = ns.turns + 1 %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

# Llama-2-chat's template, as Meta's tokenizer_config.json ships it.
LLAMA2_STYLE = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system_message = messages[0]['content'] %}{% else %}"
    "{% set loop_messages = messages %}{% set system_message = false %}{% endif %}"
    "{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}"
    "{% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' '  + content.strip() + ' ' + eos_token }}"
    "{% endif %}{% endfor %}"
)

# Zephyr's template: plain blocks on their own lines, so the output depends on
# trim_blocks / lstrip_blocks exactly as transformers sets them.
ZEPHYR_STYLE = """{% for message in messages %}
{% if message['role'] == 'user' %}
{{ '<|user|>\n' + message['content'] + eos_token }}
{% elif message['role'] == 'system' %}
{{ '<|system|>\n' + message['content'] + eos_token }}
{% elif message['role'] == 'assistant' %}
{{ '<|assistant|>\n'  + message['content'] + eos_token }}
{% endif %}
    {% if loop.last and add_generation_prompt %}
{{ '<|assistant|>' }}
    {% endif %}
{% endfor %}"""
STYLES = {"qwen": QWEN_STYLE, "llama2": LLAMA2_STYLE, "zephyr": ZEPHYR_STYLE}

TOKENIZER_CONFIG = {
    "bos_token": "<|endoftext|>",
    "eos_token": {"__type": "AddedToken", "content": "<|im_end|>", "special": True},
    "pad_token": "<|endoftext|>",
    "unk_token": None,
}

CHATS = {
    "user": [{"role": "user", "content": "def add(a, b):"}],
    "system_user": [
        {"role": "system", "content": "You write Python. 🐍"},
        {"role": "user", "content": "Ünïcödé, 你好"},
    ],
    "multi_turn": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "import os"},
        {"role": "assistant", "content": "print(os.getcwd())", "name": None},
        {"role": "user", "content": "  and sys?  "},
    ],
}

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather of a city <b>now</b>",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
TOOL_CHAT = [
    {"role": "user", "content": "Weather in Zürich?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Zürich"}},
            }
        ],
    },
    {"role": "tool", "content": '{"temp": 21}'},
]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("chat_tokenizer")
    train_test_tokenizer().save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps({**TOKENIZER_CONFIG, "tokenizer_class": "PreTrainedTokenizerFast"})
    )
    return path


@pytest.fixture(scope="module")
def hf_tokenizer(tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir)


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))


def _hf(hf_tokenizer, template, messages, **kwargs):
    text = hf_tokenizer.apply_chat_template(
        messages, chat_template=template, tokenize=False, **kwargs
    )
    ids = hf_tokenizer.apply_chat_template(
        messages, chat_template=template, tokenize=True, return_dict=False, **kwargs
    )
    return text, list(ids)


CASES = [
    (style, chat, gen)
    for style in STYLES
    for chat in CHATS
    for gen in (True, False)
    if not (style == "llama2" and gen)  # Llama-2's template has no generation prompt
]


@pytest.mark.parametrize("style,chat,add_generation_prompt", CASES)
def test_render_equals_transformers(hf_tokenizer, tokenizer, style, chat, add_generation_prompt):
    source = STYLES[style]
    messages = CHATS[chat]
    want_text, want_ids = _hf(
        hf_tokenizer, source, messages, add_generation_prompt=add_generation_prompt
    )
    template = ChatTemplate(source, special_tokens(TOKENIZER_CONFIG))
    text = template.render(messages, add_generation_prompt=add_generation_prompt)
    assert text == want_text
    assert encode_chat(tokenizer, text) == want_ids
    if style == "llama2":  # the special-token variables reached the template
        assert text.startswith("<|endoftext|>[INST] ")


def test_tools_and_tool_calls_equal_transformers(hf_tokenizer, tokenizer):
    want_text, want_ids = _hf(
        hf_tokenizer, QWEN_STYLE, TOOL_CHAT, tools=TOOLS, add_generation_prompt=True
    )
    text = ChatTemplate(QWEN_STYLE).render(TOOL_CHAT, tools=TOOLS, add_generation_prompt=True)
    assert text == want_text
    assert "<b>now</b>" in text and "Zürich" in text  # tojson escapes neither HTML nor UTF-8
    assert encode_chat(tokenizer, text) == want_ids


def test_continue_final_message_equals_transformers(hf_tokenizer):
    messages = [*CHATS["user"], {"role": "assistant", "content": "    return a"}]
    want, _ = _hf(hf_tokenizer, QWEN_STYLE, messages, continue_final_message=True)
    text = ChatTemplate(QWEN_STYLE).render(
        messages, add_generation_prompt=False, continue_final_message=True
    )
    assert text == want
    assert text.endswith("    return a")


def test_raise_exception_is_a_messages_error(hf_tokenizer):
    import jinja2

    bad = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(jinja2.TemplateError):
        _hf(hf_tokenizer, LLAMA2_STYLE, bad)
    with pytest.raises(ChatTemplateError, match=r"^messages: .*roles must alternate"):
        ChatTemplate(LLAMA2_STYLE, special_tokens(TOKENIZER_CONFIG)).render(bad)


@pytest.mark.parametrize(
    "source, error",
    [
        ("{% for i in range(10**9) %}{{ i }}{% endfor %}", "OverflowError: Range too big"),
        ("{{ messages | length // 0 }}", "ZeroDivisionError: "),
    ],
)
def test_any_error_the_template_raises_is_a_messages_error(source, error):
    """Not only Jinja's own errors: the sandbox's OverflowError, Python's arithmetic."""
    with pytest.raises(ChatTemplateError) as info:
        ChatTemplate(source).render(CHATS["user"])
    assert str(info.value).startswith(f"messages: the chat template failed: {error}")


def test_the_sandbox_refuses_unsafe_attributes():
    import jinja2.exceptions

    evil = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises((ChatTemplateError, jinja2.exceptions.SecurityError)):
        ChatTemplate(evil).render(CHATS["user"])


def test_where_the_template_comes_from(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    assert load_chat_template(model) is None
    config = {**TOKENIZER_CONFIG, "chat_template": [{"name": "default", "template": "D"}]}
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    got = load_chat_template(model)
    assert got.source == "D" and got.special["eos_token"] == "<|im_end|>"
    (model / "chat_template.jinja").write_text("J")
    assert load_chat_template(model).source == "J"  # the .jinja file wins
    override = tmp_path / "mine.jinja"
    override.write_text("O{{ bos_token }}")
    got = load_chat_template(model, override)
    assert got.render([]) == "O<|endoftext|>"  # the override, with the model's tokens
    as_json = tmp_path / "tokenizer_config.json"
    as_json.write_text(json.dumps({"chat_template": "From JSON"}))
    assert load_chat_template(model, as_json).source == "From JSON"
    (model / "chat_template.jinja").unlink()
    config["chat_template"] = [{"name": "tool_use", "template": "T"}]
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(
        ChatTemplateError, match=r"has no template named 'default' \(it has \['tool_use'\]\)"
    ):
        load_chat_template(model)
    bad_entries = {
        "[]": "chat_template is an empty list",
        "[5]": "chat_template[0] must be",
        '[{"name": "default"}]': "chat_template[0] must be",
        '[{"name": "default", "template": 5}]': "chat_template[0] must be",
    }
    for entries, cause in bad_entries.items():
        config["chat_template"] = json.loads(entries)
        (model / "tokenizer_config.json").write_text(json.dumps(config))
        with pytest.raises(
            ChatTemplateError, match=f"^model: .*tokenizer_config.json: {re.escape(cause)}"
        ):
            load_chat_template(model)
    config["chat_template"] = "{% for %}"  # not valid Jinja: the model's file is named
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(
        ChatTemplateError, match="^model: .*tokenizer_config.json: not a valid Jinja"
    ):
        load_chat_template(model)
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% if %}")
    with pytest.raises(ChatTemplateError, match="^chat-template: not a valid Jinja"):
        load_chat_template(model, broken)
    with pytest.raises(ChatTemplateError, match="^chat-template: cannot read"):
        load_chat_template(model, tmp_path / "missing.jinja")

"""Chat templates: a model folder's Jinja template, rendered as transformers'
`tokenizer.apply_chat_template` renders it, without importing transformers.

Where the template comes from, first found wins: `--chat-template FILE` (a Jinja file, or
a JSON file holding {"chat_template": ...} such as a tokenizer_config.json), the model
folder's `chat_template.jinja`, then the `chat_template` entry of its
`tokenizer_config.json` (a string, or a list of {"name", "template"} of which "default"
is used, as transformers does). A model with none has no `ChatTemplate`, and
/v1/chat/completions answers 400.

Rendering follows transformers (`utils/chat_template_utils.py`): a jinja2
`ImmutableSandboxedEnvironment` with trim_blocks and lstrip_blocks, the loopcontrols
extension, a `{% generation %}` block that renders its body, `raise_exception`,
`strftime_now`, a `tojson` filter that does not escape HTML (ensure_ascii False), message
keys whose value is null dropped, and the tokenizer's special tokens (bos_token,
eos_token, ...) as variables. The rendered text is tokenized without adding special
tokens (`encode_chat`), as apply_chat_template(tokenize=True) does.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

# The special-token attributes of a transformers tokenizer (SPECIAL_TOKENS_ATTRIBUTES):
# those set in tokenizer_config.json are template variables.
SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


class ChatTemplateError(ValueError):
    """A template that cannot be loaded (raised at start-up) or that failed to render
    these messages (a 400 naming messages: e.g. its raise_exception("...") fired)."""


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (transformers marks assistant tokens with
    it); here the block renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller) -> str:
        return caller()


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationBlock, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _token_text(value) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def special_tokens(tokenizer_config: dict) -> dict[str, str]:
    """The special-token template variables of a tokenizer_config.json ({} for none)."""
    out = {}
    for name in SPECIAL_TOKEN_NAMES:
        text = _token_text(tokenizer_config.get(name))
        if text is not None:
            out[name] = text
    return out


def _pick_template(value, source: str, setting: str = "chat-template") -> str:
    """The template of a `chat_template` entry: a string, or transformers' list of named
    templates ({"name", "template"}), of which "default" is the one used. Raises
    ChatTemplateError "`setting`: `source`...": setting is the flag or the model folder
    ("model") that gave the file, as the other start-up errors name their cause."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {}
        for i, entry in enumerate(value):
            if not (
                isinstance(entry, dict)
                and isinstance(entry.get("name"), str)
                and isinstance(entry.get("template"), str)
            ):
                raise ChatTemplateError(
                    f"{setting}: {source}: chat_template[{i}] must be a "
                    f'{{"name": str, "template": str}} object, got {_shown(entry)}'
                )
            named[entry["name"]] = entry["template"]
        if "default" in named:  # as transformers picks it when no name is asked for
            return named["default"]
        if not named:
            raise ChatTemplateError(f"{setting}: {source}: chat_template is an empty list")
        raise ChatTemplateError(
            f"{setting}: {source}: chat_template has no template named 'default' "
            f"(it has {sorted(named)})"
        )
    if value is None:
        raise ChatTemplateError(f"{setting}: {source} has no chat_template entry")
    raise ChatTemplateError(
        f"{setting}: {source}: chat_template must be a string or a list of "
        f'{{"name", "template"}} objects, got {_shown(value)}'
    )


def _shown(value) -> str:
    """`value` as JSON, cut to 40 characters (for an error message)."""
    shown = json.dumps(value)
    return shown if len(shown) <= 40 else shown[:37] + "..."


class ChatTemplate:
    """A compiled chat template and the special tokens it may use.

    Raises ChatTemplateError if `source` is not valid Jinja, its message starting with
    `origin`: what gave the template (the flag, or "model: FILE").
    """

    def __init__(
        self, source: str, special: dict[str, str] | None = None, origin: str = "chat-template"
    ) -> None:
        self.source = source
        self.special = dict(special or {})
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise ChatTemplateError(f"{origin}: not a valid Jinja template ({e})") from e

    def render(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict] | None = None,
        documents: list[dict] | None = None,
        **kwargs: Any,
    ) -> str:
        """The prompt text of `messages` (dicts with role and content; keys whose value is
        None are dropped first, and a reasoning text is passed under every name templates
        read it by, as transformers does). `kwargs` become template variables (vLLM's
        chat_template_kwargs) and override the special tokens. continue_final_message:
        end the text where the last message's content ends (no end-of-turn after it),
        with transformers' marker method; it excludes add_generation_prompt.

        Raises ChatTemplateError("messages: ...") when the template fails on them, or
        "continue_final_message: ..." when it cannot be honoured.
        """
        chat = [_normalized(m) for m in messages]
        variables = {**self.special, **kwargs}
        tag = _CONTINUE_TAG
        final = None
        if continue_final_message:
            if add_generation_prompt:
                # add_generation_prompt defaults to true (as in vLLM), so a request that
                # sets only continue_final_message lands here: say what to send.
                raise ChatTemplateError(
                    "continue_final_message: cannot be combined with add_generation_prompt, "
                    "which is true unless set: send add_generation_prompt: false with "
                    "continue_final_message: true"
                )
            final = chat[-1].get("content")
            if not isinstance(final, str):
                raise ChatTemplateError(
                    "continue_final_message: the last message has no text content"
                )
            chat[-1]["content"] = final + tag
        try:
            text = self._template.render(
                messages=chat,
                tools=tools,
                documents=documents,
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"messages: the chat template failed: {e}") from None
        except Exception as e:  # the template is code: whatever it raises
            # (the sandbox's OverflowError for range(10**9), 1 // 0, ...) is about the
            # messages it was given, a 400 like raise_exception's, not a 500.
            raise ChatTemplateError(
                f"messages: the chat template failed: {type(e).__name__}: {e}"
            ) from None
        if final is None:
            return text
        if final.strip() not in text or tag.strip() not in text:
            raise ChatTemplateError(
                "continue_final_message: the chat template does not render the last "
                "message's content"
            )
        at = text.rindex(tag.strip())
        return text[:at] if text[at : at + len(tag)] == tag else text[:at].rstrip()


# transformers' marker for continue_final_message.
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
# The names a message's reasoning text goes by; templates read the first (gpt-oss ones
# read "thinking"): each is filled from whichever is set (transformers does the same).
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _normalized(message: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in message.items() if v is not None}
    reasoning = next((out[k] for k in _REASONING_FIELDS if k in out), None)
    if reasoning is not None:
        out = {"thinking": reasoning, **out, "reasoning_content": reasoning}
    return out


def encode_chat(tokenizer: Tokenizer, text: str) -> list[int]:
    """Token ids of a rendered chat: the template wrote the special tokens itself, so the
    tokenizer adds none (apply_chat_template(tokenize=True) does the same)."""
    return tokenizer.encode(text, add_special_tokens=False).ids


def load_chat_template(model_dir: str | Path, override: str | Path | None = None):
    """The model's ChatTemplate (see the module docstring for the order), or None when
    neither the override nor the folder has one.

    Raises ChatTemplateError naming --chat-template for an override that cannot be read,
    is empty or cannot be compiled, or a tokenizer_config.json template that is not valid
    Jinja.
    """
    model_dir = Path(model_dir)
    config_path = model_dir / "tokenizer_config.json"
    config: dict = {}
    if config_path.is_file():
        try:
            config = json.loads(config_path.read_text())
        except (OSError, ValueError) as e:
            raise ChatTemplateError(f"chat-template: cannot read {config_path}: {e}") from e
    special = special_tokens(config)
    if override is not None:
        path = Path(override)
        try:
            text = path.read_text()
        except OSError as e:
            raise ChatTemplateError(f"chat-template: cannot read {path}: {e}") from e
        if path.suffix == ".json":
            try:
                text = _pick_template(json.loads(text).get("chat_template"), str(path))
            except ChatTemplateError:
                raise  # it names the file already
            except (ValueError, AttributeError) as e:
                raise ChatTemplateError(f"chat-template: {path}: {e}") from e
        if not text.strip():
            # Every chat would render to no tokens (a 400 per request): refuse it now.
            raise ChatTemplateError(f"chat-template: {path} is empty (no template text)")
        return ChatTemplate(text, special)
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.is_file():
        return ChatTemplate(jinja_file.read_text(), special, origin=f"model: {jinja_file}")
    if config.get("chat_template") is not None:  # null: none, as transformers reads it
        text = _pick_template(config["chat_template"], str(config_path), setting="model")
        return ChatTemplate(text, special, origin=f"model: {config_path}")
    return None

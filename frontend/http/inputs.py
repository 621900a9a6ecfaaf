"""OpenAI request bodies -> `jaxserve.v1.GenerateRequest` messages, the form every request
of the frontend takes before the shared validation (frontend/requests.py).

Nothing here checks a range: a bad temperature or top_p reaches `validation.py` and gets
the same message as over gRPC. What is checked here is what only the HTTP API has: the
OpenAI spellings (`stop` as a string, `logit_bias` keys as strings, chat `logprobs` +
`top_logprobs`, `max_completion_tokens`, which must agree with `max_tokens` when both
are given), fields that cannot be honoured (echo, suffix, best_of > n, tool_choice other
than none/auto, a response_format other than text), the number of samples over all
prompts, and chat messages (roles, text-only content).
"""

from __future__ import annotations

import logging
from typing import Any

from tokenizers import Tokenizer

from jaxserve.frontend.http.chat_template import ChatTemplate, ChatTemplateError, encode_chat
from jaxserve.frontend.http.protocol import (
    MAX_CONTENT_PARTS,
    MAX_NESTED_LIST,
    MAX_TOOL_CALLS,
    ChatCompletionRequest,
    CompletionRequest,
    FieldError,
    json_kind,
)
from jaxserve.frontend.proto import jaxserve_pb2 as pb
from jaxserve.frontend.validation import MAX_N, ModelLimits, max_prompt_chars
from jaxserve.sampling_params import (
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    TOP_K_ACCEPTED,
    logit_bias_count_error,
    token_id_error,
)

logger = logging.getLogger("jaxserve.frontend.http")

INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1
# top_k's values: the shared rule's, which has no upper end, and the proto's int32 one.
_TOP_K_IN_INT32 = f"{TOP_K_ACCEPTED}, at most {INT32_MAX}"


def log_unknown_fields(body, endpoint: str) -> None:
    """One debug line naming the fields of `body` that this server does not know (they
    are ignored, as vLLM ignores them)."""
    if body.model_extra:
        logger.debug("%s: ignoring unknown fields %s", endpoint, sorted(body.model_extra))


def _check_int(
    name: str,
    value: int | None,
    high: int = INT32_MAX,
    low: int = -INT32_MAX - 1,
    accepted: str | None = None,
) -> None:
    """Refuse a value the proto's field cannot hold ([low, high]). `accepted`: the values
    the shared rule takes, in its words ("in [1, 128]"), named instead of the field's
    range, which would suggest that values the server refuses anyway are fine."""
    if value is not None and not low <= value <= high:
        rule = accepted or f"within [{low}, {high}]"
        raise FieldError(name, f"{name}: must be {rule}, got {_shown_int(value)}")


def _shown_int(value: int) -> str:
    """An integer for an error message, a huge one abbreviated: JSON's 1e300 is an int here
    (pydantic takes a float without a fraction) and its 301 digits would fill the error."""
    text = str(value)
    return text if len(text) <= 40 else f"{text[:12]}... ({len(text.lstrip('-'))} digits)"


def _token_ids(name: str, ids: list[int], limits: ModelLimits) -> list[int]:
    """Token ids of a list field (a prompt, `stop_token_ids`), each in the vocabulary; a bad
    one is named by its JSON path in the body (`prompt[2]`, `prompt[1][1]`,
    `stop_token_ids[0]`), as the body's type errors name it, not by the gRPC field the
    shared rules name (`prompt.token_ids`)."""
    for j, t in enumerate(ids):
        _check_token_id(f"{name}[{j}]", t, limits)
    return ids


def _check_token_id(path: str, token_id: int, limits: ModelLimits) -> None:
    """FieldError(path) in the shared rule's words for an id outside the vocabulary."""
    if not 0 <= token_id < limits.vocab_size:
        raise FieldError(path, token_id_error(path, token_id, limits.vocab_size))


def _token_id_key(path: str, key: str) -> int:
    """A logit_bias key as its token id. Only ASCII digits, with an optional "-", make one
    ("10", "007", "-1"): int() would also take " 1", "+1", "1_0" (10) and full-width "１",
    none of which a client means as a token id. A negative id is returned for the range
    check, which words it as gRPC and offline do ("token id -1 is outside ...").
    Raises FieldError(path) for any other key, and for digits too many for int() (past
    the vocabulary anyway)."""
    digits = key.removeprefix("-")
    if digits.isascii() and digits.isdigit():
        try:
            return int(key)
        except ValueError:  # more than sys.get_int_max_str_digits() digits
            pass
    raise FieldError(path, f"{path}: key {key!r} is not a token id (digits 0-9 only)")


def _sampling(body, request: pb.GenerateRequest, limits: ModelLimits) -> None:
    """The sampling fields both endpoints share, onto `request` (unset stays unset)."""
    s = request.sampling
    for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty"):
        value = getattr(body, name)
        if value is not None:
            setattr(s, name, value)
    if body.repetition_penalty is not None:
        s.repetition_penalty = body.repetition_penalty
    _check_int("top_k", body.top_k, accepted=_TOP_K_IN_INT32)
    if body.top_k is not None:
        s.top_k = body.top_k
    if body.n is not None:
        _check_int("n", body.n, accepted=f"in [1, {MAX_N}]")
        s.n = body.n
    _check_int("seed", body.seed, INT64_MAX, -INT64_MAX - 1)
    if body.seed is not None:
        s.seed = body.seed
    if body.logit_bias:
        if len(body.logit_bias) > MAX_LOGIT_BIAS:  # before a loop over a hostile map
            raise FieldError("logit_bias", logit_bias_count_error(len(body.logit_bias)))
        for key, bias in body.logit_bias.items():
            path = f"logit_bias.{key}"  # as the body's type errors name a bad bias
            token_id = _token_id_key(path, key)
            _check_token_id(path, token_id, limits)
            s.logit_bias[token_id] = bias
    if body.stop is not None:
        request.stop.extend([body.stop] if isinstance(body.stop, str) else body.stop)
    if body.stop_token_ids:
        request.stop_token_ids.extend(_token_ids("stop_token_ids", body.stop_token_ids, limits))
    request.ignore_eos = body.ignore_eos
    if body.skip_special_tokens is not None:
        request.skip_special_tokens = body.skip_special_tokens
    if body.stream_options is not None and not body.stream:
        raise FieldError(
            "stream_options", "stream_options: only allowed when stream is true (as OpenAI)"
        )
    best_of = (body.model_extra or {}).get("best_of")
    if best_of is not None and best_of != (body.n or 1):
        raise FieldError("best_of", "best_of: only best_of = n is supported")


def _max_tokens(
    name: str, value: int | None, request: pb.GenerateRequest, limits: ModelLimits
) -> None:
    """`value` onto `request`. One that cannot fit the proto's int32 is refused here with
    the range the shared rule accepts (>= 1, and prompt + max_tokens <= max_model_len; at
    most max_model_len - 1, for a one-token prompt), not int32's; any other value is left
    to that rule (validation.py), so it gets gRPC's words."""
    if value is None:
        return
    if not -INT32_MAX - 1 <= value <= INT32_MAX:
        high = limits.max_model_len - 1
        raise FieldError(
            name, f"{name}: must be within [1, {high}] (prompt + {name} <= max_model_len "
            f"{limits.max_model_len}), got {_shown_int(value)}",
        )  # fmt: skip
    request.max_tokens = value


def _set_max_tokens(body, request: pb.GenerateRequest, limits: ModelLimits) -> bool:
    """`max_completion_tokens`, else `max_tokens`, onto `request` (either endpoint: after
    `_check_one_max_tokens` they agree when both are given). False when neither is."""
    if body.max_completion_tokens is not None:
        _max_tokens("max_completion_tokens", body.max_completion_tokens, request, limits)
    elif body.max_tokens is not None:
        _max_tokens("max_tokens", body.max_tokens, request, limits)
    else:
        return False
    return True


def _check_one_max_tokens(first: str, max_tokens, second: str, max_completion_tokens) -> None:
    """`max_tokens` and `max_completion_tokens` (OpenAI's newer name; vLLM's chat reads
    it first, its completions ignore it, here both endpoints take it) are one limit: both
    given with different values is a 400 naming both, not one of them silently winning."""
    if max_tokens is None or max_completion_tokens is None or max_tokens == max_completion_tokens:
        return
    values = {"max_tokens": max_tokens, "max_completion_tokens": max_completion_tokens}
    raise FieldError(
        first, f"{first}: {values[first]!r} differs from {second}: {values[second]!r}; they "
        "are one limit: give one of them, or the same value in both",
    )  # fmt: skip


def _check_response_format(response_format) -> None:
    """Raises FieldError unless response_format is absent or {"type": "text"}."""
    if response_format is None:
        return
    if not isinstance(response_format, dict) or response_format.get("type") != "text":
        raise FieldError("response_format", "response_format: only type 'text' is supported")


def completion_requests(
    body: CompletionRequest, request_id: str, limits: ModelLimits
) -> list[pb.GenerateRequest]:
    """One GenerateRequest per prompt of a /v1/completions body, prompt i under the id
    f"{request_id}-{i}". Raises FieldError naming the field."""
    if body.echo:
        raise FieldError("echo", "echo: not supported")
    if body.suffix is not None:
        raise FieldError("suffix", "suffix: not supported")
    # Not an OpenAI completions field, but vLLM's (structured output): refused as in chat,
    # not ignored, so that nobody takes plain text for the JSON they asked for.
    _check_response_format((body.model_extra or {}).get("response_format"))
    prompt = body.prompt  # of one of the shapes of protocol.prompt_shape
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        prompts = [prompt]
    else:
        prompts = list(prompt)
    if not prompts:
        raise FieldError("prompt", "prompt: must not be empty")
    n = body.n if body.n is not None else 1
    if len(prompts) > 1 and n * len(prompts) > MAX_N:
        raise FieldError("n", f"n: n x prompts must be at most {MAX_N}, got {n} x {len(prompts)}")
    template = pb.GenerateRequest()
    _sampling(body, template, limits)
    _check_one_max_tokens(
        "max_tokens", body.max_tokens, "max_completion_tokens", body.max_completion_tokens
    )
    _set_max_tokens(body, template, limits)
    _check_int("logprobs", body.logprobs, accepted=f"in [0, {MAX_LOGPROBS}]")
    if body.logprobs is not None:
        template.logprobs = body.logprobs
    out = []
    for i, p in enumerate(prompts):
        request = pb.GenerateRequest()
        request.CopyFrom(template)
        request.request_id = f"{request_id}-{i}" if len(prompts) > 1 else request_id
        if isinstance(p, str):
            request.text = p
        else:
            name = f"prompt[{i}]" if len(prompts) > 1 else "prompt"
            request.token_ids.ids.extend(_token_ids(name, p, limits))
        out.append(request)
    return out


def prompt_aliases(index: int, num_prompts: int) -> dict[str, str]:
    """The names the shared rules' prompt fields take in the error of prompt `index` of a
    completions body: `prompt[i]` when the body has several prompts (as gRPC has one, its
    words are "prompt" and "prompt.token_ids")."""
    if num_prompts == 1:
        return {}
    return {"prompt": f"prompt[{index}]", "prompt.token_ids": f"prompt[{index}]"}


def _content_text(index: int, content: Any) -> str | None:
    """A message's content as the template gets it: a string (text parts joined with
    newlines, as vLLM joins them), or None."""
    name = f"messages[{index}].content"
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise FieldError(name, f"{name}: must be a string, a list of text parts or null")
    if len(content) > MAX_CONTENT_PARTS:
        raise FieldError(name, f"{name}: at most {MAX_CONTENT_PARTS} parts, got {len(content)}")
    texts = []
    for j, part in enumerate(content):
        if not (isinstance(part, dict) and part.get("type") == "text"):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise FieldError(
                f"{name}[{j}]", f"{name}[{j}]: only text parts are supported, got {kind!r}"
            )
        text = part.get("text")
        if not isinstance(text, str):
            raise FieldError(f"{name}[{j}].text", f"{name}[{j}].text: must be a string")
        texts.append(text)
    return "\n".join(texts)


def check_nested_lists(value: Any, path: str, limit: int = MAX_NESTED_LIST) -> None:
    """Refuse a list of more than `limit` items anywhere in `value` (a JSON value the chat
    template gets as given), named by its path ("tools[0].function.parameters.enum").
    Iterative: the body's nesting is already bounded (`protocol.JSON_MAX_DEPTH`), this
    walks it once. Raises FieldError."""
    stack = [(value, path)]
    while stack:
        node, where = stack.pop()
        if isinstance(node, dict):
            stack.extend((v, f"{where}.{k}") for k, v in node.items())
        elif isinstance(node, list):
            if len(node) > limit:
                raise FieldError(where, f"{where}: at most {limit} items, got {len(node)}")
            stack.extend((v, f"{where}[{j}]") for j, v in enumerate(node))


def _check_role(index: int, message: dict[str, Any]) -> None:
    """Raises FieldError naming messages[index].role unless it is a non-empty string, in
    the words of the other fields: missing, "is required" (as a missing content); else
    what it must be and what came ("must be a string, got a number (5)")."""
    name = f"messages[{index}].role"
    if "role" not in message:
        raise FieldError(name, f"{name}: is required")
    role = message["role"]
    if not isinstance(role, str):
        raise FieldError(name, f"{name}: must be a string, got {json_kind(role)}")
    if not role:
        raise FieldError(name, f"{name}: must not be empty")


def chat_messages(body: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The messages as the chat template gets them: each has a string role and a string
    (or null) content; every other key is passed on unchanged, within the list limits
    (`MAX_TOOL_CALLS`, `MAX_NESTED_LIST`)."""
    out = []
    for i, message in enumerate(body.messages):
        _check_role(i, message)
        if "content" not in message and "tool_calls" not in message:
            raise FieldError(f"messages[{i}].content", f"messages[{i}].content: is required")
        calls = message.get("tool_calls")
        if isinstance(calls, list) and len(calls) > MAX_TOOL_CALLS:
            name = f"messages[{i}].tool_calls"
            raise FieldError(name, f"{name}: at most {MAX_TOOL_CALLS} items, got {len(calls)}")
        for key, value in message.items():
            if key != "content":  # checked as parts by _content_text
                check_nested_lists(value, f"messages[{i}].{key}")
        out.append({**message, "content": _content_text(i, message.get("content"))})
    return out


def check_request_template(body: ChatCompletionRequest) -> None:
    """Refuse a chat template sent with the request, as vLLM does by default (without
    its --trust-request-chat-template, which jaxserve does not offer): the server renders
    chats with the model's template (or --chat-template) only, since a client's Jinja
    would run in the frontend with every other request's CPU. So `chat_template`, of any
    length, and a `chat_template` key of chat_template_kwargs (vLLM reads the template
    from there too) are a 400 naming the field, never silently ignored.

    Raises FieldError("chat_template" or "chat_template_kwargs.chat_template")."""
    if body.chat_template is not None:
        raise FieldError(
            "chat_template",
            "chat_template: a chat template sent with the request is refused (as vLLM "
            "without --trust-request-chat-template); the server renders chats with the "
            "model's template, or the one given to jaxserve serve --chat-template FILE",
        )
    if (body.chat_template_kwargs or {}).get("chat_template") is not None:
        raise FieldError(
            "chat_template_kwargs.chat_template",
            "chat_template_kwargs.chat_template: a chat template sent with the request is "
            "refused (as vLLM without --trust-request-chat-template); the server renders "
            "chats with the model's template, or the one given to jaxserve serve "
            "--chat-template FILE",
        )


def chat_request(
    body: ChatCompletionRequest,
    request_id: str,
    template: ChatTemplate,
    tokenizer: Tokenizer,
    limits: ModelLimits,
) -> pb.GenerateRequest:
    """The GenerateRequest of a /v1/chat/completions body: the messages rendered by the
    chat template and tokenized (CPU work: call it off the event loop). An unset
    max_tokens (and max_completion_tokens) is the room the model length leaves after the
    prompt, as in vLLM. Raises FieldError naming the field."""
    check_request_template(body)
    _check_response_format(body.response_format)
    tool_choice = (body.model_extra or {}).get("tool_choice")
    if tool_choice not in (None, "none", "auto"):
        raise FieldError("tool_choice", "tool_choice: only 'none' and 'auto' are supported")
    request = pb.GenerateRequest(request_id=request_id)
    _check_one_max_tokens(
        "max_completion_tokens", body.max_tokens, "max_tokens", body.max_completion_tokens
    )
    _sampling(body, request, limits)
    if body.top_logprobs is not None and not body.logprobs:
        raise FieldError("top_logprobs", "top_logprobs: needs logprobs set to true")
    _check_int("top_logprobs", body.top_logprobs, accepted=f"in [0, {MAX_LOGPROBS}]")
    if body.logprobs:
        request.logprobs = body.top_logprobs or 0
    messages = chat_messages(body)
    check_nested_lists(body.tools, "tools")
    check_nested_lists(body.chat_template_kwargs, "chat_template_kwargs")
    kwargs = {
        "add_generation_prompt": body.add_generation_prompt,
        "continue_final_message": body.continue_final_message,
        "tools": body.tools,
    }
    extra = body.chat_template_kwargs or {}
    if "messages" in extra:
        raise FieldError(
            "chat_template_kwargs", "chat_template_kwargs: 'messages' is reserved (the "
            "request's messages are the template's messages)",
        )  # fmt: skip
    kwargs.update(extra)  # as in vLLM, chat_template_kwargs override the named fields
    try:
        text = template.render(messages, **kwargs)
    except ChatTemplateError as e:
        param = str(e).split(":", 1)[0]
        raise FieldError(param, str(e)) from None
    # As for a completions prompt: a chat this long cannot fit whatever it encodes to;
    # tokenizing megabytes would hold the frontend for seconds (measured: 40 s for 32 MB).
    if len(text) > (max_chars := max_prompt_chars(tokenizer, limits)):
        raise FieldError(
            "messages", f"messages: the chat renders to {len(text)} characters, which cannot "
            f"fit in max_model_len {limits.max_model_len} tokens (at most {max_chars})",
        )  # fmt: skip
    ids = encode_chat(tokenizer, text)
    if not ids:
        raise FieldError("messages", "messages: the chat renders to no tokens")
    request.token_ids.ids.extend(ids)
    if not _set_max_tokens(body, request, limits):
        request.max_tokens = max(1, limits.max_model_len - len(ids))
    return request

"""The JSON bodies of the OpenAI API that jaxserve accepts, as pydantic models.

Only the shape of each field is checked here (types, the sizes of lists); the ranges of
the sampling fields are the shared rules of `frontend/validation.py` and
`SamplingParams.validate`, applied after the body becomes a `GenerateRequest`. Fields that
are not declared are kept (`model_extra`) and ignored with a debug log line, as vLLM does.
vLLM's extra sampling fields (top_k, min_p, repetition_penalty, ignore_eos,
skip_special_tokens, stop_token_ids) are accepted beside OpenAI's.

Limits of the lists a body carries (a longer one is a 400 naming the field):
`MAX_PROMPTS` prompts in one completions request, `MAX_MESSAGES` chat messages,
`MAX_CONTENT_PARTS` parts in one message's content, `MAX_STOP` stop strings,
`MAX_STOP_TOKEN_IDS` stop token ids, `MAX_TOOLS` tools; logit_bias has the sampler's
limit (`sampling_params.MAX_LOGIT_BIAS`, checked by the shared rules). The body itself is
at most `MAX_BODY_BYTES` (413 beyond it), which is also the only bound on the keys of a
message, of a tool and of chat_template_kwargs (they go to the chat template as given).
A chat `chat_template` (vLLM's extra) is declared only to be refused, whatever its length
(`inputs.check_request_template`): no client Jinja is compiled.

Every 400 names the exact field, with list indices (`prompt[1]`, `messages[0].content`,
`stream_options.include_usage`); "body" only when the bytes are not valid JSON in UTF-8
(a lone surrogate escape such as "\ud800" included) or not a JSON object. A
completions `prompt` that fails its union type is named by `prompt_shape`, by hand: the
union's errors name the branch that failed first, not the element at fault.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, ValidationError

from jaxserve import sampling_params

# The gRPC request-message bound (server.MAX_RECEIVE_MESSAGE_BYTES): a prompt too long for
# the model reaches the prompt-length check (400 naming prompt) instead of the body limit.
MAX_BODY_BYTES = 32 * 1024 * 1024
MAX_PROMPTS = 128  # validation.MAX_N: every prompt is at least one engine request
MAX_MESSAGES = 4096
MAX_CONTENT_PARTS = 256
MAX_STOP = sampling_params.MAX_STOP_STRINGS
MAX_STOP_TOKEN_IDS = sampling_params.MAX_STOP_TOKEN_IDS
MAX_TOOLS = 256

Int = StrictInt  # no "3" -> 3 or 2.0 -> 2: a JSON number that is not an integer is a 400


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")

    include_usage: StrictBool = False


class _SamplingFields(BaseModel):
    """The fields both endpoints share (OpenAI's and vLLM's extras)."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: Int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: Int | None = None
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP)] | None = None
    seed: Int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None  # accepted and ignored
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    # vLLM's extra sampling fields.
    top_k: Int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: StrictBool = False
    skip_special_tokens: StrictBool | None = None
    stop_token_ids: Annotated[list[Int], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None


class CompletionRequest(_SamplingFields):
    """POST /v1/completions. prompt: a string, a list of strings, a list of token ids or
    a list of token-id lists (each is its own request; choice i * n + j is sample j of
    prompt i, as in OpenAI's API)."""

    # Checked in Rust on the JSON (a 32 MiB list of ids in ~0.1 s, on the event loop);
    # a prompt that fails is named by `prompt_shape` (parse_body).
    prompt: (
        str
        | Annotated[list[str], Field(min_length=1, max_length=MAX_PROMPTS)]
        | Annotated[list[Int], Field(min_length=1)]
        | Annotated[list[Annotated[list[Int], Field(min_length=1)]], Field(max_length=MAX_PROMPTS)]
    )
    logprobs: Int | None = None  # top-N alternatives per token
    echo: StrictBool = False  # only False is supported
    suffix: str | None = None  # only None is supported


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions. messages are dicts with at least `role` and `content`
    (a string, a list of {"type": "text", "text": ...} parts, or null); every other key of
    a message (name, tool_calls, tool_call_id, ...) reaches the chat template as is."""

    messages: Annotated[list[dict[str, Any]], Field(min_length=1, max_length=MAX_MESSAGES)]
    max_completion_tokens: Int | None = None
    logprobs: StrictBool = False
    top_logprobs: Int | None = None
    tools: Annotated[list[dict[str, Any]], Field(max_length=MAX_TOOLS)] | None = None
    response_format: dict[str, Any] | None = None  # only {"type": "text"} is supported
    # vLLM's chat extras.
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    chat_template_kwargs: dict[str, Any] | None = None
    # Declared to be refused, not ignored: see inputs.check_request_template.
    chat_template: Any = None


def _json_kind(value: Any) -> str:
    """How JSON calls `value`'s type, with the value for a scalar ("a number (1e+30)")."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"a boolean ({str(value).lower()})"
    if isinstance(value, int | float):
        return f"a number ({value!r})" if len(repr(value)) <= 24 else "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "a list"
    return "an object"


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def prompt_shape(prompt: Any) -> str:
    """The kind of a completions prompt: "text" (a string), "texts" (a list of strings),
    "ids" (a list of token ids) or "id_lists" (a list of token-id lists); the kind is
    the first element's, and every element must be of it. A Python loop over every id:
    for the error path (parse_body), not for every request.

    Raises FieldError naming the exact element: `prompt` (not a string or a list, an
    empty list, more than MAX_PROMPTS prompts), `prompt[i]` (an element of another kind,
    an empty token-id list), `prompt[i][j]` (a token id that is not an integer). Token
    ids are checked against the vocabulary later, by the shared rules.
    """
    if isinstance(prompt, str):
        return "text"
    if not isinstance(prompt, list):
        raise FieldError(
            "prompt",
            "prompt: must be a string, a list of strings, a list of token ids or a list "
            f"of token-id lists, got {_json_kind(prompt)}",
        )
    if not prompt:
        raise FieldError("prompt", "prompt: must not be empty")
    first = prompt[0]
    if _is_token_id(first):
        for i, t in enumerate(prompt):
            if not _is_token_id(t):
                raise FieldError(
                    f"prompt[{i}]",
                    f"prompt[{i}]: must be a token id (an integer) like prompt[0], got "
                    f"{_json_kind(t)}",
                )
        return "ids"
    if not isinstance(first, str | list):
        raise FieldError(
            "prompt[0]",
            "prompt[0]: must be a string, a token id (an integer) or a list of token ids, "
            f"got {_json_kind(first)}",
        )
    if len(prompt) > MAX_PROMPTS:
        raise FieldError(
            "prompt", f"prompt: at most {MAX_PROMPTS} prompts in one request, got {len(prompt)}"
        )
    if isinstance(first, str):
        for i, p in enumerate(prompt):
            if not isinstance(p, str):
                raise FieldError(
                    f"prompt[{i}]",
                    f"prompt[{i}]: must be a string like prompt[0], got {_json_kind(p)}",
                )
        return "texts"
    for i, ids in enumerate(prompt):
        name = f"prompt[{i}]"
        if not isinstance(ids, list):
            raise FieldError(
                name, f"{name}: must be a list of token ids like prompt[0], got {_json_kind(ids)}"
            )
        if not ids:
            raise FieldError(name, f"{name}: must not be empty (a prompt of no tokens)")
        for j, t in enumerate(ids):
            if not _is_token_id(t):
                raise FieldError(
                    f"{name}[{j}]",
                    f"{name}[{j}]: must be a token id (an integer), got {_json_kind(t)}",
                )
    return "id_lists"


class FieldError(ValueError):
    """A bad field of a body: `param` names it (dotted path, list indices in brackets);
    the message starts with it, like every validation error of the frontend."""

    def __init__(self, param: str | None, message: str) -> None:
        super().__init__(message)
        self.param = param


def field_path(loc: tuple[Any, ...]) -> str:
    """pydantic's error location as a field path: ("messages", 0, "content") ->
    "messages[0].content". Union-member tags (e.g. "list[int]") are dropped."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif "[" in part or part in ("str", "int", "float", "bool", "function-after"):
            continue
        else:
            out += f".{part}" if out else part
    return out


def _name_the_prompt_element(errors: list[dict]) -> None:
    """Raise prompt_shape's FieldError if `prompt` failed its union type. Each branch's
    error at depth 2 (("prompt", "str"), ...) carries the whole prompt as its input."""
    branches = [err for err in errors if len(err["loc"]) == 2 and err["loc"][0] == "prompt"]
    if branches:
        prompt_shape(branches[0]["input"])  # a shape it accepts: the generic error follows


# pydantic's words for a value that is not a JSON object, in ours.
_NOT_AN_OBJECT = ("model_type", "model_attributes_type", "dict_type")


def parse_body(model: type[BaseModel], body: bytes) -> Any:
    """The body as `model`. Raises FieldError naming the first bad field, by its path
    (`field_path`: "stream_options", "messages[0].role"); "body" only when the bytes are
    not valid JSON in UTF-8 (pydantic's position of the fault kept) or not a JSON object."""
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        errors = e.errors(include_url=False)
        if model is CompletionRequest:
            try:
                _name_the_prompt_element(errors)
            except FieldError as named:
                raise named from None
        # A field that is a union (stop: str | list[str]) fails once per branch, and the
        # first is the plain-string one ("Input should be a valid string"), which hides
        # the cause: a list past its limit wins, then the error deepest inside the value.
        first = min(errors, key=lambda err: (err["type"] != "too_long", -len(err["loc"])))
        if not first["loc"]:  # the body itself
            if first["type"] == "json_invalid":  # not JSON text, or a string not Unicode
                why = first["msg"].removeprefix("Invalid JSON: ")
                raise FieldError("body", f"body: not valid JSON in UTF-8 ({why})") from None
            raise FieldError("body", f"body: not a JSON object ({first['msg']})") from None
        param = field_path(first["loc"])
        if first["type"] in _NOT_AN_OBJECT:
            raise FieldError(param, f"{param}: must be a JSON object") from None
        raise FieldError(param, f"{param}: {first['msg']}") from None

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


def parse_body(model: type[BaseModel], body: bytes) -> Any:
    """The body as `model`. Raises FieldError naming the first bad field ("body" when the
    bytes are not a JSON object)."""
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        errors = e.errors(include_url=False)
        # A field that is a union (stop: str | list[str]) fails once per branch, and the
        # first is the plain-string one ("Input should be a valid string"), which hides
        # the cause: a list past its limit wins, then the error deepest inside the value.
        first = min(errors, key=lambda err: (err["type"] != "too_long", -len(err["loc"])))
        if first["type"] in ("json_invalid", "model_type", "model_attributes_type"):
            raise FieldError("body", f"body: not a JSON object ({first['msg']})") from None
        param = field_path(first["loc"])
        raise FieldError(param, f"{param}: {first['msg']}") from None

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
`MAX_STOP_TOKEN_IDS` stop token ids, `MAX_TOOLS` tools, `MAX_TOOL_CALLS` tool calls in one
message, and `MAX_NESTED_LIST` items in any other list inside a message, a tool or
chat_template_kwargs (they go to the chat template as given; `inputs.check_nested_lists`);
logit_bias has the sampler's limit (`sampling_params.MAX_LOGIT_BIAS`, checked by the
shared rules). The body itself is at most `MAX_BODY_BYTES` (413 beyond it), which is also
the only bound on the keys of a message, of a tool and of chat_template_kwargs.
A chat `chat_template` (vLLM's extra) is declared only to be refused, whatever its length
(`inputs.check_request_template`): no client Jinja is compiled.

Every 400 names the exact field, with list indices (`prompt[1]`, `messages[0].content`,
`stream_options.include_usage`), in the words of the shared rules (`_in_our_words`:
"stop: at most 64 stop strings are supported, got 65", "max_tokens: must be an integer,
got a string"), not pydantic's; "body" only when the bytes are not valid JSON text (in
UTF-8, or UTF-16/UTF-32 as `body_text` reads them; a lone surrogate escape such as
"\ud800" included, said so), nested deeper than
`JSON_MAX_DEPTH`, or not a JSON object. A
completions `prompt` that fails its union type is named by `prompt_shape`, by hand: the
union's errors name the branch that failed first, not the element at fault.
"""

from __future__ import annotations

import json
import sys
from typing import Annotated, Any

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    ValidationError,
)
from pydantic_core import PydanticCustomError

from jaxserve import sampling_params
from jaxserve.frontend.http import body_text

# The gRPC request-message bound (server.MAX_RECEIVE_MESSAGE_BYTES): a prompt too long for
# the model reaches the prompt-length check (400 naming prompt) instead of the body limit.
MAX_BODY_BYTES = 32 * 1024 * 1024
MAX_PROMPTS = 128  # validation.MAX_N: every prompt is at least one engine request
MAX_MESSAGES = 4096
MAX_CONTENT_PARTS = 256
MAX_STOP = sampling_params.MAX_STOP_STRINGS
MAX_STOP_TOKEN_IDS = sampling_params.MAX_STOP_TOKEN_IDS
MAX_TOOLS = 256
MAX_TOOL_CALLS = 256
MAX_NESTED_LIST = 4096

# Up to 2**53 a float holds every integer exactly (float64's 53-bit significand).
_MAX_EXACT_FLOAT = 2**53


def _is_integral_float(value: Any) -> bool:
    return isinstance(value, float) and value.is_integer() and abs(value) <= _MAX_EXACT_FLOAT


def _whole(value: float) -> int:
    """An integral float, past 2**53 too, as the integer it holds exactly (1e16 ->
    10**16). Raises pydantic's int_from_float error for 8.5, inf and nan."""
    if value.is_integer():
        return int(value)
    raise PydanticCustomError("int_from_float", "Input should be a valid integer")


def _integral(value: float) -> int:
    """A JSON number written with a fraction or an exponent that is an integer (8.0, 1e3)
    as that int (`_whole`), within 2**53. Raises pydantic's int_from_float error
    otherwise (8.5, 1e30: past 2**53 a float is no exact integer)."""
    if abs(value) <= _MAX_EXACT_FLOAT:
        return _whole(value)
    if value.is_integer():  # 1e18: said as such, not as "must be an integer" alone
        raise PydanticCustomError("int_inexact_float", "Input should be an exact integer")
    raise PydanticCustomError("int_from_float", "Input should be a valid integer")


# An integer field takes a JSON integer and an integral float (8.0 -> 8, as vLLM's lax
# pydantic models do); 8.5 is a 400 naming the field. Unlike vLLM, "8" and true are refused
# too (a string or a boolean is no number; OpenAI's API refuses a string). A JSON integer
# takes the first branch, checked in Rust: a long prompt of token ids calls no Python.
Int = Annotated[
    StrictInt | Annotated[StrictFloat, AfterValidator(_integral)],
    Field(union_mode="left_to_right"),
]
# A count bounded far below 2**53 (max_tokens, n, top_k, logprobs): any integral float is
# the integer it holds, so that 1e16 gets the field's range error naming its limit
# ("max_tokens: must be within [1, 1023] ..., got 10000000000000000"), not "must be an
# integer". Int's exactness matters only where such a value is valid: seed (int64).
Count = Annotated[
    StrictInt | Annotated[StrictFloat, AfterValidator(_whole)],
    Field(union_mode="left_to_right"),
]
# A number field (temperature, top_p, a logit_bias value, ...) takes a JSON number, an
# integer too (1 -> 1.0); "0.5" and true are refused as the integer fields refuse them
# (pydantic's lax float would parse the string, " 0 " included).
Float = StrictFloat


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")

    include_usage: StrictBool = False


class _SamplingFields(BaseModel):
    """The fields both endpoints share (OpenAI's and vLLM's extras)."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: Count | None = None
    max_completion_tokens: Count | None = None  # OpenAI's newer name of max_tokens
    temperature: Float | None = None
    top_p: Float | None = None
    n: Count | None = None
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP)] | None = None
    seed: Int | None = None
    presence_penalty: Float | None = None
    frequency_penalty: Float | None = None
    logit_bias: dict[str, Float] | None = None
    user: str | None = None  # accepted and ignored
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    # vLLM's extra sampling fields.
    top_k: Count | None = None
    min_p: Float | None = None
    repetition_penalty: Float | None = None
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
    logprobs: Count | None = None  # top-N alternatives per token
    echo: StrictBool = False  # only False is supported
    suffix: str | None = None  # only None is supported


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions. messages are dicts with at least `role` and `content`
    (a string, a list of {"type": "text", "text": ...} parts, or null); every other key of
    a message (name, tool_calls, tool_call_id, ...) reaches the chat template as is."""

    messages: Annotated[list[dict[str, Any]], Field(min_length=1, max_length=MAX_MESSAGES)]
    logprobs: StrictBool = False
    top_logprobs: Count | None = None
    tools: Annotated[list[dict[str, Any]], Field(max_length=MAX_TOOLS)] | None = None
    response_format: dict[str, Any] | None = None  # only {"type": "text"} is supported
    # vLLM's chat extras.
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    chat_template_kwargs: dict[str, Any] | None = None
    # Declared to be refused, not ignored: see inputs.check_request_template.
    chat_template: Any = None


def json_kind(value: Any) -> str:
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
    """Whether `Int` takes `value` (an int, or an integral float; no bool)."""
    return (isinstance(value, int) and not isinstance(value, bool)) or _is_integral_float(value)


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
            f"of token-id lists, got {json_kind(prompt)}",
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
                    f"{json_kind(t)}",
                )
        return "ids"
    if not isinstance(first, str | list):
        raise FieldError(
            "prompt[0]",
            "prompt[0]: must be a string, a token id (an integer) or a list of token ids, "
            f"got {json_kind(first)}",
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
                    f"prompt[{i}]: must be a string like prompt[0], got {json_kind(p)}",
                )
        return "texts"
    for i, ids in enumerate(prompt):
        name = f"prompt[{i}]"
        if not isinstance(ids, list):
            raise FieldError(
                name, f"{name}: must be a list of token ids like prompt[0], got {json_kind(ids)}"
            )
        if not ids:
            raise FieldError(name, f"{name}: must not be empty (a prompt of no tokens)")
        for j, t in enumerate(ids):
            if not _is_token_id(t):
                raise FieldError(
                    f"{name}[{j}]",
                    f"{name}[{j}]: must be a token id (an integer), got {json_kind(t)}",
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

# pydantic's error types of a value of the wrong JSON type: what the field must be.
_EXPECTED = {
    "int_type": "an integer",
    "int_parsing": "an integer",
    "int_from_float": "an integer",
    "float_type": "a number",
    "float_parsing": "a number",
    "bool_type": "a boolean (true or false)",
    "bool_parsing": "a boolean (true or false)",
    "string_type": "a string",
    "list_type": "a list",
}
# Fields of a union type, in words (each branch fails with its own type error).
_UNION_KINDS = {"stop": "a string or a list of strings"}
# What the items of a list field are called in a "too many" message, as the shared
# rules (gRPC) call them: "stop: at most 64 stop strings are supported, got 65".
_ITEMS = {"stop": "stop strings", "stop_token_ids": "ids", "messages": "messages", "tools": "tools"}


def _cause_first(error: dict) -> tuple[bool, bool, int]:
    """The sort key of a field's errors that puts the one naming the cause first."""
    return error["type"] != "too_long", error["type"] != "int_inexact_float", -len(error["loc"])


def _in_our_words(error: dict, param: str) -> str:
    """pydantic's error on `param` as the frontend's other messages say it: the field
    first, then what it must be and what came ("max_tokens: must be an integer, got a
    string"), in the words of the shared rules where they have the same check."""
    kind, ctx = error["type"], error.get("ctx") or {}
    if kind in _NOT_AN_OBJECT:
        return f"{param}: must be a JSON object, got {json_kind(error['input'])}"
    if kind == "missing":
        return f"{param}: required, missing from the body"
    if kind == "too_long" and "max_length" in ctx:
        items = _ITEMS.get(param, "items")
        got = ctx.get("actual_length")
        return f"{param}: at most {ctx['max_length']} {items} are supported" + (
            f", got {got}" if got is not None else ""
        )
    if kind == "too_short":
        return f"{param}: must not be empty"
    if kind == "int_inexact_float":
        return (
            f"{param}: must be an integer, got {json_kind(error['input'])}, past 2**53, "
            "where a JSON number with an exponent or fraction is no exact integer: "
            "write its digits"
        )
    if kind in _EXPECTED:
        expected = _UNION_KINDS.get(param, _EXPECTED[kind])
        return f"{param}: must be {expected}, got {json_kind(error['input'])}"
    return f"{param}: {error['msg']}"


# The deepest nesting of arrays and objects a body may have: pydantic's JSON parser
# (jiter) stops past it with "recursion limit exceeded" (its counter of 200 lets 201
# levels through; tests/test_http_body.py pins the number). No request field nests deeper
# than a few levels.
JSON_MAX_DEPTH = 201


class _HugeInt(str):
    """An integer literal too long for Python's int (`sys.get_int_max_str_digits`)."""


def _huge_int(body: bytes) -> FieldError | None:
    """The FieldError naming the field of the first integer in `body` with more digits
    than Python converts (4300): jiter refuses it as "number out of range" and names only
    a column, which would make the 400 name `body`. Python's json finds it (the literal
    is kept as text); None when it finds none (the body is not JSON after all)."""
    limit = sys.get_int_max_str_digits() or float("inf")

    def parse_int(text: str):
        return _HugeInt(text) if len(text.lstrip("-")) > limit else int(text)

    try:
        doc = json.loads(body, parse_int=parse_int)
    except (ValueError, RecursionError):  # RecursionError: nested past Python's stack
        return None
    if not isinstance(doc, dict):  # "body: not a JSON object" is the first fault
        return None
    stack: list[tuple[tuple, Any]] = [((), doc)]
    while stack:  # depth first, in the body's order
        loc, value = stack.pop()
        if isinstance(value, _HugeInt):
            param = field_path(loc) or "body"
            size = "small" if value.startswith("-") else "large"
            digits = len(value.lstrip("-"))
            return FieldError(param, f"{param}: too {size} (an integer of {digits} digits)")
        if isinstance(value, dict | list):
            items = value.items() if isinstance(value, dict) else enumerate(value)
            stack.extend(reversed([((*loc, k), v) for k, v in items]))
    return None


def parse_body(model: type[BaseModel], body: bytes, charset: str | None = None) -> Any:
    """The body as `model`. Raises FieldError naming the first bad field, by its path
    (`field_path`: "stream_options", "messages[0].role"); "body" only when the bytes are
    not valid JSON in UTF-8 (pydantic's position of the fault kept) or not a JSON object.
    The bytes are read as vLLM's and SGLang's FastAPI read them (`body_text.utf8`): UTF-8,
    a leading byte-order mark skipped (jiter would call it "expected value at line 1
    column 1"), or UTF-16 / UTF-32; `charset` (Content-Type's) is only named in the 400 of
    a body that is not UTF-8."""
    try:
        body, encoding = body_text.utf8(body)
    except ValueError as e:
        raise FieldError("body", str(e)) from None
    if not body.strip():  # jiter would say "EOF while parsing a value at line 1 column 0"
        raise FieldError("body", "body: empty; send a JSON object")
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
        # the cause: a list past its limit wins, then an integer past float's exactness
        # (Int's float branch: its int branch says only "not an int"), then the error
        # deepest inside the value.
        first = min(errors, key=_cause_first)
        if not first["loc"]:  # the body itself
            if first["type"] == "json_invalid":  # not JSON text, or a string not Unicode
                why = first["msg"].removeprefix("Invalid JSON: ")
                if why.startswith("recursion limit exceeded"):  # valid JSON, maybe
                    where = why.removeprefix("recursion limit exceeded").strip()
                    raise FieldError(
                        "body",
                        f"body: JSON nested too deeply (more than {JSON_MAX_DEPTH} levels of "
                        f"arrays and objects, {where})",
                    ) from None
                if why.startswith("number out of range") and (huge := _huge_int(body)):
                    raise huge from None
                why = body_text.why_not_json(body, why, charset)
                raise FieldError("body", f"body: not valid JSON in {encoding} ({why})") from None
            got = json_kind(first["input"])
            raise FieldError("body", f"body: not a JSON object (got {got})") from None
        param = field_path(first["loc"])
        raise FieldError(param, _in_our_words(first, param)) from None

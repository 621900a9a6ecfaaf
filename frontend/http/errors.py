"""HTTP errors in OpenAI's JSON shape: {"error": {"message", "type", "param", "code"}}.

Statuses: 400 a bad field (param names it; the message is the shared validation's text,
the same as gRPC's INVALID_ARGUMENT), 404 an unknown model or path, 405 a wrong method,
413 a body over `protocol.MAX_BODY_BYTES`, 415 a compressed body (Content-Encoding),
429 past an admission limit (the message names it) or a stream's output buffer
(`stream_buffer_full`), 503 while the engine starts or after it died, 500 anything else
(logged with its traceback here, never sent to the client).
"""

from __future__ import annotations

import re

from starlette.responses import JSONResponse

_TYPES = {
    400: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
}


class HttpError(Exception):
    """An error answer: status, message, the field it is about (param) and a code."""

    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def error_body(status: int, message: str, param: str | None = None, code: str | None = None):
    """The error object of OpenAI's API for an HTTP status."""
    return {
        "error": {
            "message": message,
            "type": _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error"),
            "param": param,
            "code": code,
        }
    }


def bad_field(message: str, aliases: dict[str, str] | None = None) -> HttpError:
    """A 400 from a validation message "field: ...": param is the field, renamed by
    `aliases` where the HTTP body spells it differently (chat: prompt -> messages,
    logprobs -> top_logprobs; prompt -> prompt[i] in a list of prompts), and the message
    then names the field by its HTTP name throughout ("max_completion_tokens: prompt (36
    tokens) + max_completion_tokens (5000) exceeds ...", not "+ max_tokens (5000)")."""
    field = message.split(":", 1)[0] if ":" in message else None
    if field is not None and " " in field:
        field = None
    if field is not None and aliases and field in aliases:
        # The name as a whole word only: not "prompt" of "prompt_logprobs",
        # "prompt.token_ids" or "prompt[0]".
        word = re.compile(rf"(?<![\w.]){re.escape(field)}(?![\w\[]|\.\w)")
        message = aliases[field] + word.sub(lambda _: aliases[field], message[len(field) :])
        field = aliases[field]
    return HttpError(400, message, field)


def unavailable(message: str) -> HttpError:
    return HttpError(503, message, None, "engine_unavailable")


def stream_buffer_full(message: str) -> HttpError:
    """A request aborted past --max-stream-buffer-bytes (`requests.StreamOverflowError`)."""
    return HttpError(429, message, None, "stream_buffer_full")

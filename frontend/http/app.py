"""The OpenAI-compatible HTTP API (a Starlette app) over the frontend's shared request path.

    POST /v1/completions        prompt(s) -> text (SSE with "stream": true)
    POST /v1/chat/completions   messages -> the chat template -> text (SSE with "stream")
    GET  /v1/models             the served model (`created`: the server's start, unix s)
    GET  /v1/models/{id}        that model's object; 404 (model_not_found) for another id
    GET  /health                200 once the engine is ready, 503 before and after it died
    GET  /version               {"version": ...}
    GET  /metrics               Prometheus metrics, as vLLM serves them on its API port: the
                                registry and exposition of --metrics-port (prometheus_client's
                                ASGI app over `RequestPath.metrics.registry`), no API key

Each body is parsed (protocol.py), translated into `GenerateRequest`s (inputs.py) and sent
through `RequestPath.start`, the same validation and engine path as a gRPC Generate;
outputs become OpenAI JSON (outputs.py), a whole body or an event stream
(generation_response.py). A client that closes its connection cancels its
request in the engine (responses.py). Errors are OpenAI's shape (errors.py); an error
after a stream started is sent as a last `data: {"error": ...}` event before
`data: [DONE]`. A streaming client that leaves more than --max-stream-buffer-bytes of
output unread has its request aborted (frontend/requests.py), gets that error event (429,
code `stream_buffer_full`) if it reads again within `responses.CUT_GRACE_S`, after which
its connection is reset either way.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from importlib import metadata

from prometheus_client import make_asgi_app
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from jaxserve.frontend.http.chat_template import ChatTemplate
from jaxserve.frontend.http.errors import (
    HttpError,
    bad_field,
    error_body,
    unavailable,
)
from jaxserve.frontend.http.generation_response import respond
from jaxserve.frontend.http.inputs import (
    chat_request,
    check_request_template,
    completion_requests,
    log_unknown_fields,
    prompt_aliases,
)
from jaxserve.frontend.http.outputs import ResponseWriter, TokenTexts
from jaxserve.frontend.http.protocol import (
    MAX_BODY_BYTES,
    ChatCompletionRequest,
    CompletionRequest,
    FieldError,
    parse_body,
)
from jaxserve.frontend.http.responses import (
    check_json_content_type,
    read_body,
)
from jaxserve.frontend.proto import jaxserve_pb2 as pb
from jaxserve.frontend.requests import (
    AdmissionError,
    AdmissionGroup,
    EngineUnavailableError,
    Generation,
    RequestPath,
    RequestValidationError,
)

logger = logging.getLogger("jaxserve.frontend.http")

# Shared-rule field names that a chat body spells differently.
_CHAT_ALIASES = {"prompt": "messages", "prompt.token_ids": "messages", "logprobs": "top_logprobs"}


def _limit_alias(body) -> dict[str, str]:
    """The shared rules' `max_tokens` named `max_completion_tokens` in a 400 when the body
    gave the limit by that name (either endpoint reads it first)."""
    if body.max_completion_tokens is not None:
        return {"max_tokens": "max_completion_tokens"}
    return {}


def _version() -> str:
    try:
        return metadata.version("jaxserve")
    except metadata.PackageNotFoundError:
        return "unknown"


class OpenAIApi:
    """The routes, over `requests` (the shared path) and the model's chat template (None:
    chat completions answer 400). `.app` is the ASGI app."""

    def __init__(self, requests: RequestPath, chat_template: ChatTemplate | None = None) -> None:
        self._requests = requests
        self._chat_template = chat_template
        self._texts = TokenTexts(requests.tokenizer)
        self._created = int(time.time())  # the models' `created`: when this server started
        self.app = Starlette(
            routes=[
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
                Route("/v1/models", self.models, methods=["GET"]),
                # :path, as model ids may hold a "/" (Qwen/Qwen3-0.6B)
                Route("/v1/models/{model_id:path}", self.model, methods=["GET"]),
                Route("/health", self.health, methods=["GET"]),
                Route("/version", self.version, methods=["GET"]),
                Route(
                    "/metrics",
                    _AsgiEndpoint(make_asgi_app(requests.metrics.registry)),
                    methods=["GET"],
                ),
            ],
            exception_handlers={HTTPException: _http_exception, Exception: _internal_error},
        )

    # ----- small endpoints

    async def health(self, request: Request):
        if not self._requests.engine.ready:
            return unavailable(self._requests.unavailable_message()).response()
        return JSONResponse({"status": "ok"})

    async def version(self, request: Request):
        return JSONResponse({"version": _version()})

    def _model_card(self) -> dict:
        """The served model's object (OpenAI's Model, with vLLM's root and max_model_len).
        Raises EngineUnavailableError before the engine is ready."""
        limits = self._requests.limits()
        name = self._requests.engine.stats.model
        return {
            "id": name,
            "object": "model",
            "created": self._created,
            "owned_by": "jaxserve",
            "root": name,
            "max_model_len": limits.max_model_len,
        }

    async def models(self, request: Request):
        try:
            card = self._model_card()
        except EngineUnavailableError as e:
            return unavailable(str(e)).response()
        return JSONResponse({"object": "list", "data": [card]})

    async def model(self, request: Request):
        """OpenAI's retrieve-model (`client.models.retrieve(id)`)."""
        try:
            card = self._model_card()
        except EngineUnavailableError as e:
            return unavailable(str(e)).response()
        model_id = request.path_params["model_id"]
        if model_id != card["id"]:
            return HttpError(
                404,
                f"model: the model {model_id!r} does not exist (this server serves {card['id']!r})",
                "model",
                "model_not_found",
            ).response()
        return JSONResponse(card)

    # ----- completions

    async def completions(self, request: Request):
        try:
            charset = check_json_content_type(request)
            raw = await read_body(request, MAX_BODY_BYTES)
            body = parse_body(CompletionRequest, raw, charset)
            log_unknown_fields(body, "completions")
            model = self._model(body.model)
            response_id = f"cmpl-{uuid.uuid4().hex}"
            messages = completion_requests(body, response_id, self._requests.limits())
            generations = await self._start(messages, _limit_alias(body))
        except (FieldError, HttpError, EngineUnavailableError) as e:
            return _start_error(e).response()
        writer = ResponseWriter(
            response_id, model, chat=False, logprobs=body.logprobs is not None, texts=self._texts
        )
        return respond(body, generations, writer)

    async def chat_completions(self, request: Request):
        try:
            charset = check_json_content_type(request)
            raw = await read_body(request, MAX_BODY_BYTES)
            body = parse_body(ChatCompletionRequest, raw, charset)
            log_unknown_fields(body, "chat.completions")
            model = self._model(body.model)
            check_request_template(body)
            if self._chat_template is None:
                raise HttpError(
                    400,
                    "messages: the model has no chat template (its folder has no "
                    "chat_template.jinja and its tokenizer_config.json no chat_template); "
                    "serve it with --chat-template FILE",
                    "messages",
                    "no_chat_template",
                )
            response_id = f"chatcmpl-{uuid.uuid4().hex}"
            message = await asyncio.to_thread(
                chat_request,
                body,
                response_id,
                self._chat_template,
                self._requests.tokenizer,
                self._requests.limits(),
            )
            generations = await self._start([message], {**_CHAT_ALIASES, **_limit_alias(body)})
        except (FieldError, HttpError, EngineUnavailableError) as e:
            return _start_error(e).response()
        writer = ResponseWriter(
            response_id, model, chat=True, logprobs=body.logprobs, texts=self._texts
        )
        return respond(body, generations, writer)

    # ----- the shared part

    def _model(self, name: str | None) -> str:
        """The served model's name; HttpError 503 before the engine is ready, 404 when
        `name` is given and is not it."""
        try:
            self._requests.check_ready()
        except EngineUnavailableError as e:
            raise unavailable(str(e)) from None
        served = self._requests.engine.stats.model
        if name is not None and name != served:
            raise HttpError(
                404,
                f"model: the model {name!r} does not exist (this server serves {served!r})",
                "model",
                "model_not_found",
            )
        return served

    async def _start(self, messages: list[pb.GenerateRequest], aliases) -> list[Generation]:
        """Start every prompt's request; on an error, release those already started and
        raise HttpError (400 naming the field, 503)."""
        generations: list[Generation] = []
        group = AdmissionGroup()  # the call's prompts are admitted as one request
        try:
            for message in messages:
                generations.append(await self._requests.start(message, group=group))
        except BaseException as e:
            for g in generations:
                g.release(abandoned="refused")
            if isinstance(e, RequestValidationError):
                own = prompt_aliases(len(generations), len(messages))
                raise bad_field(str(e), {**aliases, **own}) from None
            if isinstance(e, AdmissionError):  # past an admission limit: retry later
                raise HttpError(429, str(e), None, "overloaded") from None
            raise
        return generations


class _AsgiEndpoint:
    """An ASGI app as a Route's endpoint: Starlette calls a function endpoint with a
    Request, any other callable with (scope, receive, send)."""

    def __init__(self, app) -> None:
        self._app = app

    async def __call__(self, scope, receive, send) -> None:
        await self._app(scope, receive, send)


async def _http_exception(request: Request, exc: HTTPException):
    """Starlette's own errors (unknown path 404, wrong method 405) in OpenAI's shape."""
    return JSONResponse(
        error_body(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}"),
        status_code=exc.status_code,
        headers=getattr(exc, "headers", None),
    )


async def _internal_error(request: Request, exc: Exception):
    """A bug: logged with its traceback here, answered 500 without one."""
    logger.error("%s %s failed", request.method, request.url.path, exc_info=exc)
    return JSONResponse(
        error_body(500, "internal server error (the server's log has the details)"),
        status_code=500,
    )


def _start_error(error: FieldError | HttpError | EngineUnavailableError) -> HttpError:
    """The answer to an error raised before a generation starts: 400 naming the field, the
    HttpError itself, or 503 while the engine is unavailable."""
    if isinstance(error, FieldError):
        return HttpError(400, str(error), error.param)
    if isinstance(error, EngineUnavailableError):
        return unavailable(str(error))
    return error

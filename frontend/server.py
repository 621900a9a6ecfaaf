"""The gRPC frontend: the `jaxserve.v1.Jaxserve` service, health and reflection (grpc.aio).

Runs in the launcher's process on a uvloop event loop and never imports JAX. A Generate
call is validated and tokenized here (frontend/validation.py), sent to the engine, and
answered from the request's stream of text deltas (frontend/engine_client.py). A call
with n > 1 sends n engine requests (one per sample, as `jaxserve.LLM` does) and answers
from their merged stream, each response naming its sample in `index`. Status codes:
INVALID_ARGUMENT for a bad field (the message names it) or for bytes that do not parse
as the method's request message (e.g. invalid UTF-8 in a string field), UNAVAILABLE while
the engine starts or after it died, RESOURCE_EXHAUSTED for a message larger than
`MAX_RECEIVE_MESSAGE_BYTES`. A client that cancels aborts its request (every sample) in
the engine, and the metrics count it as finished with reason "abort".

A request_id is the client's: unique among running requests (INVALID_ARGUMENT naming
request_id otherwise), free again as soon as its stream ends for any reason, and the one
every GenerateResponse and Abort use. The engine never sees it alone: each sample runs
under an engine id of its own (`engine_client.engine_request_id`, which contains it).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import AsyncIterator, Callable

import grpc
from google.protobuf.message import DecodeError, Message
from google.protobuf.message_factory import GetMessageClass
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from tokenizers import Tokenizer

from jaxserve.frontend.engine_client import AsyncEngineClient
from jaxserve.frontend.proto import jaxserve_pb2 as pb
from jaxserve.frontend.proto import jaxserve_pb2_grpc as pb_grpc
from jaxserve.frontend.requests import (
    EngineUnavailableError,
    RequestPath,
    RequestValidationError,
    SampleFailedError,
)
from jaxserve.ipc import TextOutput
from jaxserve.metrics import Metrics

logger = logging.getLogger("jaxserve.frontend")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Jaxserve"].full_name

# The largest request message the server reads (gRPC's default is 4 MiB). Large enough
# that an over-long prompt reaches the prompt-length check and gets INVALID_ARGUMENT naming
# `prompt` (32 MiB is millions of tokens, beyond any max_model_len); a larger message is
# refused by gRPC itself with RESOURCE_EXHAUSTED before it is parsed.
MAX_RECEIVE_MESSAGE_BYTES = 32 * 1024 * 1024


def _token_logprob(token_id: int, logprob: float, top) -> pb.TokenLogprob:
    return pb.TokenLogprob(
        token_id=token_id,
        logprob=logprob,
        top=[pb.TopLogprob(token_id=t, logprob=lp) for t, lp in top],
    )


def _response(request_id: str, outputs: list[TextOutput], return_token_ids: bool):
    """One GenerateResponse from consecutive outputs of one request (deltas concatenated)."""
    resp = pb.GenerateResponse(request_id=request_id, text="".join(o.text for o in outputs))
    for out in outputs:
        if return_token_ids:
            resp.token_ids.extend(out.token_ids)
        for token_id, (logprob, top) in zip(out.token_ids, out.logprobs or (), strict=False):
            resp.logprobs.append(_token_logprob(token_id, logprob, top))
        for token_id, logprob, top in out.prompt_logprobs or ():
            resp.prompt_logprobs.append(_token_logprob(token_id, logprob, top))
    last = outputs[-1]
    if last.finish_reason is not None:
        resp.finish_reason = last.finish_reason
        if isinstance(last.stop_reason, str):
            resp.stop_string = last.stop_reason
        elif last.stop_reason is not None:
            resp.stop_token_id = last.stop_reason
        resp.prompt_tokens = last.prompt_tokens
        resp.completion_tokens = last.completion_tokens
    return resp


class JaxserveServicer(pb_grpc.JaxserveServicer):
    """Generate / Abort / GetServerInfo over the shared request path (frontend/requests.py)."""

    def __init__(
        self,
        engine: AsyncEngineClient,
        tokenizer: Tokenizer,
        metrics: Metrics | None = None,
        requests: RequestPath | None = None,
    ) -> None:
        self._engine = engine
        self._requests = requests or RequestPath(engine, tokenizer, metrics)

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        try:
            generation = await self._requests.start(request)
        except RequestValidationError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except EngineUnavailableError as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        request_id = generation.request_id
        # aclosing: a client that cancels (or a status below) releases the request at
        # once: unfinished samples are aborted and counted as aborts.
        async with contextlib.aclosing(generation.batches()) as batches:
            try:
                async for groups in batches:
                    for index, sample_outputs in groups:
                        resp = _response(request_id, sample_outputs, request.return_token_ids)
                        resp.index = index
                        if (
                            resp.finish_reason
                            or resp.text
                            or resp.token_ids
                            or resp.logprobs
                            or resp.prompt_logprobs
                        ):
                            yield resp
            except EngineUnavailableError as e:
                await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
            except SampleFailedError as e:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))

    async def Abort(
        self, request: pb.AbortRequest, context: grpc.aio.ServicerContext
    ) -> pb.AbortResponse:
        # Matches client request ids only; with n > 1 it aborts every sample.
        return pb.AbortResponse(found=self._engine.abort(request.request_id))

    async def GetServerInfo(
        self, request: pb.GetServerInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.ServerInfo:
        if not self._engine.ready:
            await context.abort(grpc.StatusCode.UNAVAILABLE, self._requests.unavailable_message())
        s = self._engine.stats
        return pb.ServerInfo(
            model=s.model,
            max_model_len=s.max_model_len,
            block_size=s.block_size,
            kv_blocks_total=s.num_blocks_total,
            kv_blocks_free=s.num_blocks_free,
            num_running=s.num_running,
            num_waiting=s.num_waiting,
            vocab_size=s.vocab_size,
        )


class _Undecodable:
    """What the lenient deserializer gives for bytes that are not a valid request message;
    the method's handler answers it with INVALID_ARGUMENT instead of calling the servicer."""

    __slots__ = ("message",)

    def __init__(self, message: str) -> None:
        self.message = message


def _lenient_deserializer(message_class: type[Message]) -> Callable[[bytes], object]:
    """`message_class.FromString` that returns `_Undecodable` instead of raising.

    grpc.aio turns an exception raised by a request deserializer into UNKNOWN
    ("Unexpected <class DecodeError>") and logs its traceback, once per such request; a
    client sending bad bytes (invalid UTF-8 in a string field, a truncated message) could
    flood the log. The handler (`_checked_handler`) rejects it instead.
    """
    name = message_class.DESCRIPTOR.name

    def deserialize(data: bytes) -> object:
        try:
            return message_class.FromString(data)
        except DecodeError as e:
            return _Undecodable(f"request: not a valid {name} ({e})")

    return deserialize


async def _reject_undecodable(request: _Undecodable, context: grpc.aio.ServicerContext) -> None:
    logger.debug("rejected an undecodable request: %s", request.message)
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)


def _checked_handler(method, server_streaming: bool):
    """The servicer's method behind a check that answers `_Undecodable` requests with
    INVALID_ARGUMENT (and one debug log line); valid requests reach `method` unchanged."""
    if server_streaming:

        async def stream(request, context):
            if isinstance(request, _Undecodable):
                await _reject_undecodable(request, context)
            # aclosing: the servicer's generator runs its cleanup (aborting the request in
            # the engine) when this one is closed, not whenever it is garbage-collected.
            async with contextlib.aclosing(method(request, context)) as responses:
                async for response in responses:
                    yield response

        return stream

    async def unary(request, context):
        if isinstance(request, _Undecodable):
            await _reject_undecodable(request, context)
        return await method(request, context)

    return unary


def add_servicer_to_server(servicer: pb_grpc.JaxserveServicer, server: grpc.aio.Server) -> None:
    """Register `servicer` as the `jaxserve.v1.Jaxserve` service, like the generated
    `add_JaxserveServicer_to_server`, but with request deserializers that never raise:
    bytes that do not parse as the method's request get INVALID_ARGUMENT ("request: not a
    valid GenerateRequest (...)") instead of UNKNOWN and a logged traceback. The handlers
    are built from the service descriptor, so every method of the proto is registered."""
    handlers = {}
    for method in pb.DESCRIPTOR.services_by_name["Jaxserve"].methods:
        if method.client_streaming:
            raise NotImplementedError(f"{method.name}: client streaming is not handled")
        request_class = GetMessageClass(method.input_type)
        response_class = GetMessageClass(method.output_type)
        make = (
            grpc.unary_stream_rpc_method_handler
            if method.server_streaming
            else grpc.unary_unary_rpc_method_handler
        )
        handlers[method.name] = make(
            _checked_handler(getattr(servicer, method.name), method.server_streaming),
            request_deserializer=_lenient_deserializer(request_class),
            response_serializer=response_class.SerializeToString,
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)


def _bind_error(host: str, port: int) -> str:
    """Why host:port cannot be bound, as the OS says it (gRPC's own error only says that it
    failed): a plain TCP bind of the same address, closed at once."""
    try:
        infos = socket.getaddrinfo(
            host.strip("[]"), port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
        family, type_, proto, _, address = infos[0]
        with socket.socket(family, type_, proto) as probe:
            probe.bind(address)
    except OSError as e:
        return str(e)
    return "refused by gRPC"  # the address binds now: it was released meanwhile


class FrontendServer:
    """The grpc.aio server with the Jaxserve, health and reflection services, and, after
    `start_http`, the OpenAI HTTP API (frontend/http/) on the same event loop; both go
    through one `RequestPath` (frontend/requests.py).

    Health ("" and the Jaxserve service name) is NOT_SERVING until `set_serving(True)`.
    chat_template: the model's (frontend/http/chat_template.py), for /v1/chat/completions.
    """

    def __init__(
        self,
        engine: AsyncEngineClient,
        tokenizer: Tokenizer,
        metrics: Metrics | None = None,
        chat_template=None,
    ) -> None:
        self._engine = engine
        self._requests = RequestPath(engine, tokenizer, metrics)
        self._chat_template = chat_template
        self._http = None
        # No SO_REUSEPORT: a second server on a busy port must fail, not share the port.
        self._server = grpc.aio.server(
            options=[
                ("grpc.so_reuseport", 0),
                ("grpc.max_receive_message_length", MAX_RECEIVE_MESSAGE_BYTES),
            ]
        )
        self._health = health.aio.HealthServicer()
        servicer = JaxserveServicer(engine, tokenizer, requests=self._requests)
        add_servicer_to_server(servicer, self._server)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), self._server
        )

    async def start_http(self, host: str, port: int) -> int:
        """Serve the OpenAI HTTP API on host:port (0 picks a free port); returns the bound
        port. Raises RuntimeError("http-port: cannot bind HOST:PORT (reason)")."""
        from jaxserve.frontend.http.app import OpenAIApi
        from jaxserve.frontend.http.server import HttpServer

        http = HttpServer(OpenAIApi(self._requests, self._chat_template).app)
        bound = await http.start(host, port)
        self._http = http
        return bound

    async def start(self, host: str, port: int) -> int:
        """Bind host:port (port 0 picks a free one) and start; returns the bound port.
        Raises RuntimeError("port: cannot bind HOST:PORT (reason)") if the address cannot
        be bound (the port is busy, the address is not local), in the style of the
        metrics port's error."""
        await self.set_serving(False)
        try:
            # An IPv6 literal ("::1") needs brackets in a gRPC address.
            literal6 = ":" in host and not host.startswith("[")
            address = f"[{host}]:{port}" if literal6 else f"{host}:{port}"
            bound = self._server.add_insecure_port(address)
        except RuntimeError:  # grpc.aio raises "Failed to bind to address ..."
            bound = 0
        if bound == 0:
            raise RuntimeError(f"port: cannot bind {host}:{port} ({_bind_error(host, port)})")
        await self._server.start()
        return bound

    async def set_serving(self, serving: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for service in ("", SERVICE_NAME):
            await self._health.set(service, status)

    async def engine_died(self, reason: str) -> None:
        """Open streams end with UNAVAILABLE; new requests get UNAVAILABLE; health drops."""
        self._engine.mark_dead(reason)
        await self.set_serving(False)

    async def stop(self, grace_s: float) -> None:
        """Stop accepting calls; open calls get `grace_s` seconds, then are cancelled."""
        await self._health.enter_graceful_shutdown()
        if self._http is not None:
            await asyncio.gather(self._server.stop(grace_s), self._http.stop(grace_s))
        else:
            await self._server.stop(grace_s)

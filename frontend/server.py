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
import time
import uuid
from collections.abc import AsyncIterator, Callable

import grpc
from google.protobuf.message import DecodeError, Message
from google.protobuf.message_factory import GetMessageClass
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from tokenizers import Tokenizer

from jaxserve.frontend.engine_client import (
    AsyncEngineClient,
    EngineDeadError,
    RequestStream,
    SampleOutput,
)
from jaxserve.frontend.proto import jaxserve_pb2 as pb
from jaxserve.frontend.proto import jaxserve_pb2_grpc as pb_grpc
from jaxserve.frontend.validation import (
    ModelLimits,
    RequestValidationError,
    build_engine_request,
    split_samples,
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


def _by_sample(outputs: list[SampleOutput]) -> list[tuple[int, list[TextOutput]]]:
    """Outputs grouped by sample index (a stream mixes its samples), each group in
    arrival order, the groups in order of their first output."""
    by_index: dict[int, list[TextOutput]] = {}
    for index, out in outputs:
        by_index.setdefault(index, []).append(out)
    return list(by_index.items())


class _RequestTiming:
    """Client-facing latencies of one request, as the frontend sees them (vLLM's definitions):
    TTFT = first output token - arrival; ITL = gap between token deliveries, per token;
    TPOT = (last token - first token) / (output tokens - 1); e2e = final output - arrival."""

    def __init__(self, metrics: Metrics) -> None:
        self._m = metrics
        self._start = time.perf_counter()
        self._first: float | None = None
        self._last: float | None = None
        self.num_tokens = 0  # output tokens delivered so far

    def observe(self, outputs: list[TextOutput]) -> None:
        """Record one batch of consecutive outputs of the request (the last may be final)."""
        now = time.perf_counter()
        n_tokens = sum(len(o.token_ids) for o in outputs)
        self.num_tokens += n_tokens
        if n_tokens:
            if self._first is None:
                self._first = now
                self._m.ttft.observe(now - self._start)
            elif self._last is not None:
                gap = (now - self._last) / n_tokens
                for _ in range(n_tokens):
                    self._m.itl.observe(gap)
            self._last = now
        last = outputs[-1]
        if last.finish_reason is not None:
            self._finish(last.finish_reason, last.prompt_tokens, last.completion_tokens, now)

    def cancelled(self, prompt_tokens: int) -> None:
        """The client left before the final output: count the request as finished with
        reason "abort" and the tokens delivered up to now (vLLM counts an aborted request
        with the tokens it generated). Its final output, which arrives after the stream is
        detached, is never observed, so this is the request's only count."""
        self._finish("abort", prompt_tokens, self.num_tokens, time.perf_counter())

    def _finish(
        self, finish_reason: str, prompt_tokens: int, completion_tokens: int, now: float
    ) -> None:
        self._m.request_finished(finish_reason)
        self._m.e2e.observe(now - self._start)
        self._m.prompt_tokens.inc(prompt_tokens)
        self._m.generation_tokens.inc(completion_tokens)
        if self._first is not None and completion_tokens > 1:
            self._m.tpot.observe((self._last - self._first) / (completion_tokens - 1))


class JaxserveServicer(pb_grpc.JaxserveServicer):
    """Generate / Abort / GetServerInfo over an AsyncEngineClient."""

    def __init__(
        self, engine: AsyncEngineClient, tokenizer: Tokenizer, metrics: Metrics | None = None
    ) -> None:
        self._engine = engine
        self._tokenizer = tokenizer
        self._metrics = metrics or Metrics()

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        stream, prompt_tokens = await self._start(request, context)
        timings = [_RequestTiming(self._metrics) for _ in range(stream.num_samples)]
        pending = set(range(stream.num_samples))  # samples whose final was not yielded yet
        try:
            while pending:
                try:
                    outputs = await stream.next_batch()
                except EngineDeadError as e:
                    pending.clear()  # nothing left to abort
                    await context.abort(grpc.StatusCode.UNAVAILABLE, f"engine unavailable: {e}")
                for index, sample_outputs in _by_sample(outputs):
                    last = sample_outputs[-1]
                    finished = last.finish_reason is not None
                    if finished:
                        pending.discard(index)
                    timings[index].observe(sample_outputs)
                    if last.finish_reason == "error":
                        await context.abort(
                            grpc.StatusCode.INVALID_ARGUMENT,
                            f"engine rejected the request: {last.error}",
                        )
                    resp = _response(stream.request_id, sample_outputs, request.return_token_ids)
                    resp.index = index
                    if (
                        finished
                        or resp.text
                        or resp.token_ids
                        or resp.logprobs
                        or resp.prompt_logprobs
                    ):
                        yield resp
        finally:
            # The client cancelled, a sample failed, or the server is stopping: each
            # sample not finished counts once, as an abort.
            for index in pending:
                timings[index].cancelled(prompt_tokens)
            # Aborts the samples the engine still runs and frees the request_id at once.
            self._engine.release(stream)

    async def _start(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> tuple[RequestStream, int]:
        """Validate, tokenize and send the request (its n samples); abort the call with a
        status if not. Returns the stream of every sample's outputs and the number of
        prompt tokens."""
        engine = self._engine
        if not engine.ready:
            await context.abort(grpc.StatusCode.UNAVAILABLE, self._unavailable_message())
        request_id = request.request_id or uuid.uuid4().hex
        stats = engine.stats
        limits = ModelLimits(max_model_len=stats.max_model_len, vocab_size=stats.vocab_size)
        try:
            # Fail fast on a duplicate id (add_request checks again, after tokenizing).
            if engine.is_running(request_id):
                raise RequestValidationError(f"request_id: {request_id!r} is already running")
            # Tokenizing is CPU work: off the event loop, so other streams keep flowing.
            engine_request = await asyncio.to_thread(
                build_engine_request, request, request_id, self._tokenizer, limits
            )
            stream = engine.add_request(request_id, split_samples(engine_request))
            return stream, len(engine_request.prompt_token_ids)
        except (RequestValidationError, ValueError) as e:
            # ValueError: a duplicate request_id that arrived while this one was tokenized.
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except EngineDeadError as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"engine unavailable: {e}")

    async def Abort(
        self, request: pb.AbortRequest, context: grpc.aio.ServicerContext
    ) -> pb.AbortResponse:
        # Matches client request ids only; with n > 1 it aborts every sample.
        return pb.AbortResponse(found=self._engine.abort(request.request_id))

    async def GetServerInfo(
        self, request: pb.GetServerInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.ServerInfo:
        if not self._engine.ready:
            await context.abort(grpc.StatusCode.UNAVAILABLE, self._unavailable_message())
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

    def _unavailable_message(self) -> str:
        reason = self._engine.dead_reason or "the engine is starting"
        return f"engine unavailable: {reason}"


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
    """The grpc.aio server with the Jaxserve, health and reflection services.

    Health ("" and the Jaxserve service name) is NOT_SERVING until `set_serving(True)`.
    """

    def __init__(
        self, engine: AsyncEngineClient, tokenizer: Tokenizer, metrics: Metrics | None = None
    ) -> None:
        self._engine = engine
        # No SO_REUSEPORT: a second server on a busy port must fail, not share the port.
        self._server = grpc.aio.server(
            options=[
                ("grpc.so_reuseport", 0),
                ("grpc.max_receive_message_length", MAX_RECEIVE_MESSAGE_BYTES),
            ]
        )
        self._health = health.aio.HealthServicer()
        add_servicer_to_server(JaxserveServicer(engine, tokenizer, metrics), self._server)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), self._server
        )

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
        await self._server.stop(grace_s)

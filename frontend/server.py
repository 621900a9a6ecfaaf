"""The gRPC frontend: the `jaxserve.v1.Jaxserve` service, health and reflection (grpc.aio).

Runs in the launcher's process on a uvloop event loop and never imports JAX. A Generate
call is validated and tokenized here (frontend/validation.py), sent to the engine, and
answered from the request's stream of text deltas (frontend/engine_client.py). A call
with n > 1 sends n engine requests (one per sample, as `jaxserve.LLM` does) and answers
from their merged stream, each response naming its sample in `index`. Status codes:
INVALID_ARGUMENT for a bad field (the message names it) or for bytes that do not parse
as the method's request message (e.g. invalid UTF-8 in a string field), UNAVAILABLE while
the engine starts, is stalled or after it died, RESOURCE_EXHAUSTED for a message larger
than `MAX_RECEIVE_MESSAGE_BYTES` or past an admission limit (frontend/admission.py),
DEADLINE_EXCEEDED, UNAUTHENTICATED without the API key (frontend/auth.py), INTERNAL when
the sidecar could not detokenize an output. A client that cancels aborts its request
(every sample) in the engine, and the metrics count it as finished with reason "abort".
A client that leaves more than --max-stream-buffer-bytes of output unread has its request
aborted at once (frontend/requests.py); its call ends with RESOURCE_EXHAUSTED naming the
limit once gRPC's flow control lets the message being written go (the client reads
again), else when the client leaves or its deadline passes (gRPC sends a status behind
the messages written before it).
Health and reflection are registered with the same never-raising deserializers
(frontend/lenient_services.py).

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
from collections.abc import AsyncIterator

import grpc
from grpc_health.v1 import health, health_pb2
from grpc_reflection.v1alpha import reflection, reflection_pb2
from grpc_reflection.v1alpha._async import ReflectionServicer as AsyncReflectionServicer
from tokenizers import Tokenizer

from jaxserve.frontend import memory
from jaxserve.frontend.admission import AdmissionController, AdmissionError
from jaxserve.frontend.auth import ApiKeyInterceptor, ApiKeyMiddleware
from jaxserve.frontend.engine_client import AsyncEngineClient
from jaxserve.frontend.lenient_services import add_lenient_service
from jaxserve.frontend.options import FrontendOptions
from jaxserve.frontend.proto import jaxserve_pb2 as pb
from jaxserve.frontend.proto import jaxserve_pb2_grpc as pb_grpc
from jaxserve.frontend.requests import (
    EngineUnavailableError,
    RequestPath,
    RequestValidationError,
    SampleFailedError,
    StreamOverflowError,
)
from jaxserve.frontend.server_address import join_host_port
from jaxserve.ipc import TextOutput
from jaxserve.observability import profile_rpc
from jaxserve.observability.loop_lag import watch_loop_lag
from jaxserve.observability.metrics import Metrics

logger = logging.getLogger("jaxserve.frontend")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Jaxserve"].full_name

# The largest request message the server reads (gRPC's default is 4 MiB). Large enough
# that an over-long prompt reaches the prompt-length check and gets INVALID_ARGUMENT naming
# `prompt` (32 MiB is millions of tokens, beyond any max_model_len); a larger message is
# refused by gRPC itself with RESOURCE_EXHAUSTED before it is parsed.
MAX_RECEIVE_MESSAGE_BYTES = 32 * 1024 * 1024
# At shutdown, after the grace: how long the streams still open have to send their last
# event (the error, then HTTP's [DONE]) before they are cancelled.
END_STREAMS_S = 1.0


def _token_logprob(token_id: int, logprob: float, top) -> pb.TokenLogprob:
    return pb.TokenLogprob(
        token_id=token_id,
        logprob=logprob,
        top=[pb.TopLogprob(token_id=t, logprob=lp) for t, lp in top],
    )


def _response(request_id: str, outputs: list[TextOutput], return_token_ids: bool, index: int):
    """One GenerateResponse of sample `index` from consecutive outputs of one request
    (deltas concatenated)."""
    # One output per response is the common case (a stream message per engine step): its
    # text as it is, no join; and the log-prob loops only where there are log-probs.
    text = outputs[0].text if len(outputs) == 1 else "".join(o.text for o in outputs)
    resp = pb.GenerateResponse(request_id=request_id, text=text, index=index)
    for out in outputs:
        if return_token_ids:
            resp.token_ids.extend(out.token_ids)
        if out.logprobs:
            for token_id, (logprob, top) in zip(out.token_ids, out.logprobs, strict=False):
                resp.logprobs.append(_token_logprob(token_id, logprob, top))
        if out.prompt_logprobs:
            for token_id, logprob, top in out.prompt_logprobs:
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
        remaining = context.time_remaining()
        if remaining is not None and remaining <= 0:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline: already passed")
        # The client's deadline travels to the engine, which aborts the request after it.
        deadline = time.time() + remaining if remaining is not None else None
        refusal = None
        try:
            generation = await self._requests.start(request, deadline=deadline)
        except RequestValidationError as e:
            refusal = (grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except EngineUnavailableError as e:
            refusal = (grpc.StatusCode.UNAVAILABLE, str(e))
        except AdmissionError as e:
            refusal = (grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        if refusal is not None:
            # Outside the except blocks: an abort raised in one would chain the error,
            # whose traceback holds the request (megabytes) while gRPC keeps it.
            await context.abort(*refusal)
        request_id = generation.request_id
        # aclosing: a client that cancels (or a status below) releases the request at
        # once: unfinished samples are aborted and counted as aborts.
        async with contextlib.aclosing(generation.batches()) as batches:
            try:
                async for groups in batches:
                    for index, sample_outputs in groups:
                        resp = _response(
                            request_id, sample_outputs, request.return_token_ids, index
                        )
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
                code = grpc.StatusCode.INTERNAL if e.internal else grpc.StatusCode.INVALID_ARGUMENT
                await context.abort(code, str(e))
            except StreamOverflowError as e:
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))

    async def Abort(
        self, request: pb.AbortRequest, context: grpc.aio.ServicerContext
    ) -> pb.AbortResponse:
        # Matches client request ids only; with n > 1 it aborts every sample. Never fails:
        # an abort the engine cannot take now waits in the engine client until it can.
        return pb.AbortResponse(found=self._engine.abort(request.request_id))

    async def GetServerInfo(
        self, request: pb.GetServerInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.ServerInfo:
        if not self._engine.ready:
            await context.abort(grpc.StatusCode.UNAVAILABLE, self._requests.unavailable_message())
        s = self._engine.stats
        info = pb.ServerInfo(
            model=s.model,
            max_model_len=s.max_model_len,
            block_size=s.block_size,
            kv_blocks_total=s.num_blocks_total,
            kv_blocks_free=s.num_blocks_free,
            num_running=s.num_running,
            num_waiting=s.num_waiting,
            vocab_size=s.vocab_size,
            kv_bytes_per_token=s.kv_bytes_per_token,
            kv_layout=s.kv_layout,
            warmup_pending_shapes=s.counters.warmup_pending_shapes,
            prefix_cache_queries=s.counters.prefix_cache_queries,
            prefix_cache_hits=s.counters.prefix_cache_hits,
        )
        # Several replicas (jaxserve.router.replicas.ReplicaSet): one entry each.
        for replica in getattr(self._engine, "replica_info", list)():
            info.replicas.append(pb.ReplicaInfo(**replica))
        return info


def add_servicer_to_server(servicer: pb_grpc.JaxserveServicer, server: grpc.aio.Server) -> None:
    """Register `servicer` as the `jaxserve.v1.Jaxserve` service, like the generated
    `add_JaxserveServicer_to_server`, but with request deserializers that never raise:
    bytes that do not parse as the method's request get INVALID_ARGUMENT ("request: not a
    valid GenerateRequest (...)") instead of UNKNOWN and a logged traceback
    (`frontend.lenient_services`). The handlers are built from the service descriptor, so
    every method of the proto is registered."""
    add_lenient_service(servicer, pb.DESCRIPTOR.services_by_name["Jaxserve"], server)


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
    options: admission limits, TLS and the API key (`frontend.options`); the defaults
    serve plaintext without authentication.
    """

    def __init__(
        self,
        engine: AsyncEngineClient,
        tokenizer: Tokenizer,
        metrics: Metrics | None = None,
        chat_template=None,
        options: FrontendOptions | None = None,
    ) -> None:
        self._engine = engine
        self._options = options = options or FrontendOptions()
        # After a burst of large requests, freed memory goes back to the OS.
        self.trimmer = memory.Trimmer()
        admission = AdmissionController(options.admission, on_drained=self.trimmer.request)
        self._requests = RequestPath(
            engine, tokenizer, metrics, admission=admission,
            max_stream_buffer_bytes=options.max_stream_buffer_bytes,
        )  # fmt: skip
        self._chat_template = chat_template
        self._http = None
        # Application-layer metrics: detokenizer lag per output batch, event-loop lag
        # (a task from `start` to `stop`).
        self._metrics = metrics
        self._loop_lag: asyncio.Task | None = None
        if metrics is not None:
            engine.add_outputs_listener(metrics.outputs_received)
        interceptors = [ApiKeyInterceptor(options.api_key)] if options.api_key else []
        # No SO_REUSEPORT: a second server on a busy port must fail, not share the port.
        self._server = grpc.aio.server(
            interceptors=interceptors,
            options=[
                ("grpc.so_reuseport", 0),
                ("grpc.max_receive_message_length", MAX_RECEIVE_MESSAGE_BYTES),
            ],
        )
        self._health = health.aio.HealthServicer()
        servicer = JaxserveServicer(engine, tokenizer, requests=self._requests)
        add_servicer_to_server(servicer, self._server)
        # `jaxserve profile`: a JSON method beside the service (observability/profile_rpc).
        self._server.add_generic_rpc_handlers((profile_rpc.handler(engine),))
        # Health and reflection too, with deserializers that never raise: garbage bytes
        # get INVALID_ARGUMENT, never UNKNOWN and a logged traceback.
        add_lenient_service(
            self._health, health_pb2.DESCRIPTOR.services_by_name["Health"], self._server
        )
        add_lenient_service(
            AsyncReflectionServicer((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME)),
            reflection_pb2.DESCRIPTOR.services_by_name["ServerReflection"],
            self._server,
        )

    async def start_http(self, host: str, port: int) -> int:
        """Serve the OpenAI HTTP API on host:port (0 picks a free port); returns the bound
        port. Raises RuntimeError("http-port: cannot bind HOST:PORT (reason)")."""
        from jaxserve.frontend.http.app import OpenAIApi
        from jaxserve.frontend.http.server import HttpServer

        app = OpenAIApi(self._requests, self._chat_template).app
        if self._options.api_key:
            app = ApiKeyMiddleware(app, self._options.api_key)
        tls = self._options.tls.uvicorn_kwargs() if self._options.tls is not None else None
        metrics = self._requests.metrics
        http = HttpServer(app, tls, on_busy=lambda: metrics.request_rejected("http_connections"))
        bound = await http.start(host, port)
        self._http = http
        return bound

    async def start(self, host: str, port: int) -> int:
        """Bind host:port (port 0 picks a free one) and start; returns the bound port.
        Raises RuntimeError("port: cannot bind HOST:PORT (reason)") if the address cannot
        be bound (the port is busy, the address is not local), in the style of the
        metrics port's error."""
        await self.set_serving(False)
        tls = self._options.tls
        try:
            address = join_host_port(host, port)  # gRPC takes an IPv6 literal in brackets
            if tls is not None:
                bound = self._server.add_secure_port(address, tls.grpc_credentials())
            else:
                bound = self._server.add_insecure_port(address)
        except RuntimeError:  # grpc.aio raises "Failed to bind to address ..."
            bound = 0
        if bound == 0:
            raise RuntimeError(f"port: cannot bind {address} ({_bind_error(host, port)})")
        await self._server.start()
        if self._metrics is not None and self._loop_lag is None:
            self._loop_lag = asyncio.create_task(
                watch_loop_lag(self._metrics.event_loop_lag.observe)
            )
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
        """Stop accepting calls; open calls get `grace_s` seconds to finish. Then the
        streams still open end as if the engine had died (`AsyncEngineClient.shut_down`:
        gRPC UNAVAILABLE, HTTP an error event and `data: [DONE]`), and what has not ended
        `END_STREAMS_S` later (a client that does not read) is cancelled."""
        await self._health.enter_graceful_shutdown()
        if self._loop_lag is not None:
            self._loop_lag.cancel()
        servers = [self._server.stop(grace_s + END_STREAMS_S)]
        if self._http is not None:
            servers.append(self._http.stop(grace_s + END_STREAMS_S))
        stopped = asyncio.ensure_future(asyncio.gather(*servers))
        await asyncio.wait({stopped}, timeout=grace_s)
        if not stopped.done():
            self._engine.shut_down()
        await stopped

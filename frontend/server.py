"""The gRPC frontend: the `jaxserve.v1.Jaxserve` service, health and reflection (grpc.aio).

Runs in the launcher's process on a uvloop event loop and never imports JAX. A Generate
call is validated and tokenized here (frontend/validation.py), sent to the engine, and
answered from the request's stream of text deltas (frontend/engine_client.py). A call
with n > 1 sends n engine requests (one per sample, as `jaxserve.LLM` does) and answers
from their merged stream, each response naming its sample in `index`. Status codes:
INVALID_ARGUMENT for a bad field (the message names it), UNAVAILABLE while the engine
starts or after it died. A client that cancels aborts its request (every sample) in the
engine.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from tokenizers import Tokenizer

from jaxserve.frontend.engine_client import AsyncEngineClient, EngineDeadError, RequestStream
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


def _by_request(outputs: list[TextOutput]) -> list[tuple[str, list[TextOutput]]]:
    """Outputs grouped by request id (a group's stream mixes its samples), each group in
    arrival order, the groups in order of their first output."""
    by_id: dict[str, list[TextOutput]] = {}
    for out in outputs:
        by_id.setdefault(out.request_id, []).append(out)
    return list(by_id.items())


class _RequestTiming:
    """Client-facing latencies of one request, as the frontend sees them (vLLM's definitions):
    TTFT = first output token - arrival; ITL = gap between token deliveries, per token;
    TPOT = (last token - first token) / (output tokens - 1); e2e = final output - arrival."""

    def __init__(self, metrics: Metrics) -> None:
        self._m = metrics
        self._start = time.perf_counter()
        self._first: float | None = None
        self._last: float | None = None

    def observe(self, outputs: list[TextOutput]) -> None:
        now = time.perf_counter()
        n_tokens = sum(len(o.token_ids) for o in outputs)
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
        if last.finish_reason is None:
            return
        self._m.request_finished(last.finish_reason)
        self._m.e2e.observe(now - self._start)
        self._m.prompt_tokens.inc(last.prompt_tokens)
        self._m.generation_tokens.inc(last.completion_tokens)
        if self._first is not None and last.completion_tokens > 1:
            self._m.tpot.observe((self._last - self._first) / (last.completion_tokens - 1))


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
        request_id, indices, stream = await self._start(request, context)
        timings = {sample_id: _RequestTiming(self._metrics) for sample_id in indices}
        pending = set(indices)  # engine ids of the samples whose final has not come yet
        try:
            while pending:
                try:
                    outputs = await stream.next_batch()
                except EngineDeadError as e:
                    pending.clear()  # nothing left to abort
                    await context.abort(grpc.StatusCode.UNAVAILABLE, f"engine unavailable: {e}")
                for sample_id, sample_outputs in _by_request(outputs):
                    last = sample_outputs[-1]
                    finished = last.finish_reason is not None
                    if finished:
                        pending.discard(sample_id)
                    timings[sample_id].observe(sample_outputs)
                    if last.finish_reason == "error":
                        await context.abort(
                            grpc.StatusCode.INVALID_ARGUMENT,
                            f"engine rejected the request: {last.error}",
                        )
                    resp = _response(request_id, sample_outputs, request.return_token_ids)
                    resp.index = indices[sample_id]
                    if (
                        finished
                        or resp.text
                        or resp.token_ids
                        or resp.logprobs
                        or resp.prompt_logprobs
                    ):
                        yield resp
        finally:
            if pending:  # the client cancelled, a sample failed, or the server is stopping
                self._engine.abort(request_id)  # with n > 1: every sample still running
                self._engine.detach(request_id)

    async def _start(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> tuple[str, dict[str, int], RequestStream]:
        """Validate, tokenize and send the request (its n samples); abort the call with a
        status if not. Returns the request id, {engine request id: sample index} and the
        stream of every sample's outputs."""
        engine = self._engine
        if not engine.ready:
            await context.abort(grpc.StatusCode.UNAVAILABLE, self._unavailable_message())
        request_id = request.request_id or uuid.uuid4().hex
        if engine.is_reserved(request_id):
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"request_id: {request_id!r} is already running"
            )
        stats = engine.stats
        limits = ModelLimits(max_model_len=stats.max_model_len, vocab_size=stats.vocab_size)
        try:
            # Tokenizing is CPU work: off the event loop, so other streams keep flowing.
            engine_request = await asyncio.to_thread(
                build_engine_request, request, request_id, self._tokenizer, limits
            )
            samples = split_samples(engine_request)
            if len(samples) == 1:
                stream = engine.add_request(samples[0])
            else:
                stream = engine.add_request_group(request_id, samples)
            return request_id, {r.request_id: i for i, r in enumerate(samples)}, stream
        except (RequestValidationError, ValueError) as e:
            # ValueError: a duplicate request_id (or sample id) that arrived while this one
            # was tokenized.
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except EngineDeadError as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"engine unavailable: {e}")

    async def Abort(
        self, request: pb.AbortRequest, context: grpc.aio.ServicerContext
    ) -> pb.AbortResponse:
        # A request with n > 1 is a group in the engine client: this aborts every sample.
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


class FrontendServer:
    """The grpc.aio server with the Jaxserve, health and reflection services.

    Health ("" and the Jaxserve service name) is NOT_SERVING until `set_serving(True)`.
    """

    def __init__(
        self, engine: AsyncEngineClient, tokenizer: Tokenizer, metrics: Metrics | None = None
    ) -> None:
        self._engine = engine
        # No SO_REUSEPORT: a second server on a busy port must fail, not share the port.
        self._server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        self._health = health.aio.HealthServicer()
        pb_grpc.add_JaxserveServicer_to_server(
            JaxserveServicer(engine, tokenizer, metrics), self._server
        )
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), self._server
        )

    async def start(self, host: str, port: int) -> int:
        """Bind host:port (port 0 picks a free one) and start; returns the bound port.
        Raises RuntimeError if the address cannot be bound."""
        await self.set_serving(False)
        bound = self._server.add_insecure_port(f"{host}:{port}")
        if bound == 0:
            raise RuntimeError(f"port: cannot bind {host}:{port}")
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

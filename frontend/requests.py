"""The one request path of the frontend: validate and tokenize a request, send its samples
to the engine, and fan its outputs out per sample, with the client-facing metrics.

The gRPC servicer (frontend/server.py) and the OpenAI HTTP handlers (frontend/http/) both
go through `RequestPath`: a request is a `jaxserve.v1.GenerateRequest` message (the HTTP
layer translates its JSON into one), checked by `validation.build_engine_request`, so a bad
field gets the same message on both. Each caller maps the two errors raised here to its
own status: `RequestValidationError` (INVALID_ARGUMENT / HTTP 400),
`EngineUnavailableError` (UNAVAILABLE / HTTP 503) and `AdmissionError` (past an admission
limit, frontend/admission.py: RESOURCE_EXHAUSTED / HTTP 429).

A `Generation` is one running client request (its n samples). Iterating it yields its
outputs grouped by sample; leaving the iteration in any way (the last final output, a
client that went away, an error) releases it: unfinished samples are aborted in the engine
(their KV blocks return) and count as finished with reason "abort" in the metrics.
A client that leaves more than `max_stream_buffer_bytes` of output unread (request_stream.py)
has its request aborted at once, whether its handler runs or waits on the transport: the
iteration then raises `StreamOverflowError` (gRPC RESOURCE_EXHAUSTED, HTTP a last error
event), and the unfinished samples count as abandoned with reason "slow_client".
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable

from tokenizers import Tokenizer

from jaxserve.frontend.admission import (
    AdmissionController,
    AdmissionError,
    AdmissionGroup,
    Ticket,
)
from jaxserve.frontend.engine_client import AsyncEngineClient
from jaxserve.frontend.proto import jaxserve_pb2 as pb
from jaxserve.frontend.request_stream import (
    DEFAULT_MAX_STREAM_BUFFER_BYTES,
    EngineDeadError,
    RequestStream,
    SampleOutput,
    StreamOverflowError,
    token_bytes,
)
from jaxserve.frontend.validation import (
    ModelLimits,
    RequestValidationError,
    build_engine_request,
    split_samples,
)
from jaxserve.ipc import TextOutput
from jaxserve.observability.metrics import Metrics
from jaxserve.observability.request_timing import RequestTiming

# How long a request waits for its request_id to be released by a call that was just
# cancelled (the cancel and the new call race within the server), seconds.
REQUEST_ID_REUSE_GRACE_S = 0.5
# Requests up to this many bytes (the serialized message) are tokenized on the event loop:
# tens of microseconds, less than the hop to a worker thread, which under load also waits
# up to the interpreter's GIL switch interval (5 ms) for the loop to let it run. Larger
# ones go to a thread so that a huge prompt cannot stall every other stream.
INLINE_TOKENIZE_MAX_BYTES = 8192

logger = logging.getLogger("jaxserve.frontend")

__all__ = [
    "AdmissionError",
    "AdmissionGroup",
    "EngineUnavailableError",
    "Generation",
    "RequestPath",
    "RequestValidationError",
    "SampleFailedError",
    "StreamOverflowError",
]


class EngineUnavailableError(RuntimeError):
    """The engine is starting or has died; the message says which ("engine unavailable:
    ..."), the same text on gRPC (UNAVAILABLE) and HTTP (503)."""


class SampleFailedError(RuntimeError):
    """The engine ended a sample with finish_reason "error" (a request it could not run
    although it passed validation); the message says why. `internal`: the sidecar could
    not detokenize the output (not the client's fault: INTERNAL / HTTP 500)."""

    def __init__(self, message: str, internal: bool = False) -> None:
        super().__init__(message)
        self.internal = internal


def by_sample(outputs: list[SampleOutput]) -> list[tuple[int, list[TextOutput]]]:
    """Outputs grouped by sample index (a stream mixes its samples), each group in
    arrival order, the groups in order of their first output."""
    if len(outputs) == 1:  # the common case (one stream message), without the dict
        index, out = outputs[0]
        return [(index, [out])]
    by_index: dict[int, list[TextOutput]] = {}
    for index, out in outputs:
        by_index.setdefault(index, []).append(out)
    return list(by_index.items())


class Generation:
    """One running client request: its stream of outputs and its metrics.

    request_id: the client's id. num_samples: n. prompt_tokens: the prompt's length.
    prompt_token_ids: the prompt as the engine got it ([P] int32 numpy array).
    max_unsent_bytes / bytes_per_token: the stream's bound (`RequestStream.bound`).
    on_overflow: called (no arguments) after the request was aborted past that bound,
    while the handler may still wait on its transport (HTTP closes the connection there).
    """

    def __init__(
        self,
        engine: AsyncEngineClient,
        stream: RequestStream,
        prompt_token_ids,
        metrics: Metrics,
        start: float,
        ticket: Ticket | None = None,
        deadline: float | None = None,
        max_unsent_bytes: int = DEFAULT_MAX_STREAM_BUFFER_BYTES,
        bytes_per_token: int = token_bytes(None),
    ) -> None:
        self._engine = engine
        self._stream = stream
        self._metrics = metrics
        self._ticket = ticket
        self._deadline = deadline
        self.prompt_token_ids = prompt_token_ids
        self.prompt_tokens = len(prompt_token_ids)
        self._timings = [RequestTiming(metrics, start) for _ in range(stream.num_samples)]
        self._pending = set(range(stream.num_samples))  # samples whose final is not out yet
        self._released = False
        self._past_bound = False  # the stream passed its bound (`_overflowed`)
        self._max_unsent_bytes = max_unsent_bytes
        self.on_overflow: Callable[[], None] | None = None
        stream.bound(max_unsent_bytes, bytes_per_token, self._overflowed)

    @property
    def request_id(self) -> str:
        return self._stream.request_id

    @property
    def num_samples(self) -> int:
        return self._stream.num_samples

    async def batches(self) -> AsyncIterator[list[tuple[int, list[TextOutput]]]]:
        """Yield the outputs as they come, each batch grouped by sample (`by_sample`),
        until every sample has sent its final output; then release the request.

        Raises EngineUnavailableError if the engine died, SampleFailedError if the engine
        ended a sample with an error, StreamOverflowError past the stream's bound (the
        request is released either way). Closing the iterator early (a client that left)
        releases the request too.
        """
        try:
            # Past the bound, _pending is cleared at once; the stream still holds the
            # StreamOverflowError for the handler.
            while self._pending or self._past_bound:
                try:
                    outputs = await self._stream.next_batch()
                except EngineDeadError as e:
                    if self._engine.dead_reason is not None:
                        self._pending.clear()  # dead: nothing left to abort or to count
                    # else stalled: release() queues the aborts until the engine is back
                    raise EngineUnavailableError(f"engine unavailable: {e}") from None
                if self._ticket is not None:
                    self._ticket.prompt_done()
                groups = by_sample(outputs)
                for index, sample_outputs in groups:
                    last = sample_outputs[-1]
                    if last.finish_reason is not None:
                        self._pending.discard(index)
                    self._timings[index].observe(sample_outputs)
                    if last.finish_reason == "error":
                        error = last.error or ""
                        if error.startswith("detokenizer:"):
                            raise SampleFailedError(error, internal=True)
                        raise SampleFailedError(f"engine rejected the request: {error}")
                yield groups
        finally:
            self.release()

    def release(self, abandoned: str | None = None) -> None:
        """End the request: samples not finished count once each as aborts (in
        `jaxserve_request_success_total` and `jaxserve_requests_abandoned_total`), the
        engine aborts them, and the client id is free again. Idempotent. abandoned: why
        unfinished samples were left (the latter's reason), when not the client's cancel
        or deadline: "refused" for the prompts started before their API call was refused."""
        if self._released:
            return
        self._released = True
        if self._pending:
            late = self._deadline is not None and time.time() >= self._deadline
            reason = abandoned or ("deadline" if late else "cancelled")
            self._metrics.request_abandoned(reason, len(self._pending))
        for index in self._pending:
            self._timings[index].cancelled(self.prompt_tokens)
        self._pending.clear()
        self._engine.release(self._stream)
        if self._ticket is not None:
            self._ticket.release()

    def _overflowed(self, unsent: int) -> None:
        """The stream passed its bound (its queue is dropped already): abort the request."""
        logger.warning(
            "request %s aborted: its client left about %d bytes of output unread, past "
            "--max-stream-buffer-bytes %d",
            self.request_id, unsent, self._max_unsent_bytes,
        )  # fmt: skip
        self._past_bound = True
        self.release(abandoned="slow_client")
        if self.on_overflow is not None:
            self.on_overflow()


class RequestPath:
    """Validation, tokenization and sending of requests, for every protocol of the
    frontend (gRPC, HTTP). Holds no per-request state."""

    def __init__(
        self,
        engine: AsyncEngineClient,
        tokenizer: Tokenizer,
        metrics: Metrics | None = None,
        admission: AdmissionController | None = None,
        max_stream_buffer_bytes: int = DEFAULT_MAX_STREAM_BUFFER_BYTES,
    ) -> None:
        """max_stream_buffer_bytes: the estimated bytes of output each stream may hold
        for its client (`Generation`)."""
        self.engine = engine
        self.tokenizer = tokenizer
        self.metrics = metrics or Metrics()
        self.admission = admission or AdmissionController()
        self.max_stream_buffer_bytes = max_stream_buffer_bytes

    def check_ready(self) -> None:
        """Raises EngineUnavailableError unless the engine is ready and alive."""
        if not self.engine.ready:
            raise EngineUnavailableError(self.unavailable_message())

    def unavailable_message(self) -> str:
        engine = self.engine
        reason = engine.dead_reason or engine.stalled_reason or "the engine is starting"
        return f"engine unavailable: {reason}"

    def limits(self) -> ModelLimits:
        """The model limits the engine reported. Raises EngineUnavailableError before
        the engine is ready."""
        self.check_ready()
        stats = self.engine.stats
        return ModelLimits(max_model_len=stats.max_model_len, vocab_size=stats.vocab_size)

    async def start(
        self,
        request: pb.GenerateRequest,
        deadline: float | None = None,
        group: AdmissionGroup | None = None,
    ) -> Generation:
        """Admit, validate and tokenize `request` (a large one off the event loop:
        `INLINE_TOKENIZE_MAX_BYTES`), then send its n samples to the engine. An empty
        request_id gets a random one. deadline: time.time() after which the engine
        aborts the request (the client's deadline), or None.

        Raises RequestValidationError naming the field (validation.build_engine_request,
        or a request_id already running), EngineUnavailableError (starting, stalled or
        dead), AdmissionError naming the admission limit it would pass (counted in
        `jaxserve_requests_rejected_total` by its limit; the other errors are not). group: the
        admission group of the API call's requests, when it sends several (HTTP prompt
        lists; `frontend.admission`).
        """
        start = time.perf_counter()
        limits = self.limits()
        request_id = request.request_id or uuid.uuid4().hex
        engine = self.engine
        size = request.ByteSize()
        ticket = None
        admitted = False
        try:
            ticket = self.admission.reserve(size, group)
            # A client that cancelled a request and reuses its id at once may get here
            # before that call's cleanup ran: give it a moment to release the id.
            if engine.is_running(request_id):
                await engine.wait_released(request_id, REQUEST_ID_REUSE_GRACE_S)
            # Fail fast on a duplicate id (add_request checks again, after tokenizing).
            if engine.is_running(request_id):
                raise RequestValidationError(f"request_id: {request_id!r} is already running")
            args = (request, request_id, self.tokenizer, limits)
            if size <= INLINE_TOKENIZE_MAX_BYTES:
                engine_request = build_engine_request(*args)
            else:
                engine_request = await asyncio.to_thread(build_engine_request, *args)
            engine_request.deadline = deadline
            samples = split_samples(engine_request)
            ticket.admit(len(samples), len(engine_request.prompt_token_ids))
            try:
                stream = engine.add_request(request_id, samples)
            except ValueError as e:  # a duplicate request_id that arrived while tokenizing
                raise RequestValidationError(str(e)) from None
            except EngineDeadError as e:
                raise EngineUnavailableError(f"engine unavailable: {e}") from None
            admitted = True
        except AdmissionError as e:
            # Counted here, where both protocols pass: once per refused call (an HTTP
            # call's later prompts are not tried after the refused one).
            self.metrics.request_rejected(e.limit)
            raise
        finally:
            if not admitted and ticket is not None:
                ticket.release()  # refused: nothing stays reserved
        return Generation(
            engine, stream, engine_request.prompt_token_ids, self.metrics, start,
            ticket=ticket, deadline=deadline, max_unsent_bytes=self.max_stream_buffer_bytes,
            bytes_per_token=token_bytes(engine_request.sampling.get("logprobs")),
        )  # fmt: skip

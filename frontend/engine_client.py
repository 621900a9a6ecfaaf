"""The frontend's side of the IPC: requests and aborts out to the engine, text deltas in
from the sidecar, fanned out to one `RequestStream` (request_stream.py) per open client
request (asyncio, no JAX).

Client request ids and engine request ids are two namespaces. A client request (its id
chosen by the client, unique among running requests) with n samples becomes n engine
requests whose ids (`engine_request_id`) are unique for the life of this process. So a
client id can be reused as soon as its stream ends (finished, cancelled, aborted, failed):
the engine may still hold the old engine ids for a few milliseconds, and their late
outputs are dropped without touching the new request. `abort` takes a client id only.
When the engine (or the sidecar) dies, `mark_dead` ends every open stream with
`EngineDeadError` and refuses new requests; `shut_down` does the same when the server
stops, after its grace.

Aborts go on the engine's control path (`IpcAddresses.engine_control`), not behind the
requests. They are never dropped: ids the socket cannot take now (a stalled engine) wait
in a set here, coalesced, and are sent as soon as it can (retried every
`ABORT_RETRY_S`). The set holds at most one entry per engine id sent, and admission
control bounds those. `last_heartbeat` says when each process last proved alive
(`ipc.Heartbeat`), for the stall watchdog (`frontend.liveness`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import time
from collections.abc import Callable

import zmq
import zmq.asyncio

from jaxserve.frontend.request_stream import EngineDeadError, RequestStream
from jaxserve.ipc import (
    AbortRequest,
    EngineRequest,
    EngineStats,
    Heartbeat,
    IpcAddresses,
    TextOutput,
    TextOutputs,
    bound_endpoint,
    decode,
    encode,
    make_socket,
)

logger = logging.getLogger("jaxserve.frontend")

# Separates the client id from the serial in an engine request id. It is a control
# character (ASCII unit separator), which `validation.check_request_id` rejects in client
# ids; the "#" after it keeps the id readable in logs that print it raw ("r#12.0").
ENGINE_ID_SEPARATOR = "\x1f#"
# How often aborts the control socket could not take are sent again (seconds).
ABORT_RETRY_S = 0.05


def engine_request_id(request_id: str, serial: int, index: int) -> str:
    """The engine request id of sample `index` of the client request `request_id`, the
    `serial`-th request this engine client accepted: f"{request_id}\\x1f#{serial}.{index}".

    It cannot collide with another engine id: the client id holds no control character,
    so the id splits back at its only "\\x1f" into (client id, serial, index), and no two
    samples share (serial, index). Nor can it equal a client id, which has no "\\x1f".
    """
    return f"{request_id}{ENGINE_ID_SEPARATOR}{serial}.{index}"


# Why open streams end when the server stops (`AsyncEngineClient.shut_down`).
SHUTTING_DOWN = "the server is shutting down"


class AsyncEngineClient:
    """Sends EngineRequest/AbortRequest to the engine; receives TextOutputs and EngineStats.

    Call `start()` inside the running event loop, `close()` at the end.
    """

    def __init__(self, addresses: IpcAddresses) -> None:
        self._addresses = addresses
        self._ctx: zmq.asyncio.Context | None = None
        # Sends are non-blocking and immediate, so the engine socket is a plain one.
        self._sync_ctx: zmq.Context | None = None
        self._to_engine: zmq.Socket | None = None
        self._to_control: zmq.Socket | None = None
        self._pending_aborts: dict[str, None] = {}  # ordered set of engine ids to abort
        self._abort_retry: asyncio.TimerHandle | None = None
        # process name ("engine", "detokenizer") -> time.monotonic() of its last heartbeat
        self.last_heartbeat: dict[str, float] = {}
        self._from_sidecar: zmq.asyncio.Socket | None = None
        self._reader: asyncio.Task | None = None
        # client request id -> its open stream; engine id -> the stream of its client request.
        self._requests: dict[str, RequestStream] = {}
        self._by_engine_id: dict[str, RequestStream] = {}
        self._serials = itertools.count()
        self._ready = asyncio.Event()
        self._stats_listeners: list[Callable[[EngineStats], None]] = []
        self._outputs_listeners: list[Callable[[TextOutputs], None]] = []
        self.stats: EngineStats | None = None
        self.dead_reason: str | None = None
        self.stalled_reason: str | None = None  # set by the stall watchdog (liveness.py)

    async def start(self) -> None:
        self._ctx = zmq.asyncio.Context()
        self._sync_ctx = zmq.Context()
        a = self._addresses
        binds = a.frontend_binds  # a remote replica: its engine connects to these
        self._to_engine = make_socket(self._sync_ctx, zmq.PUSH, a.engine_input, bind=binds)
        if a.engine_control:
            self._to_control = make_socket(self._sync_ctx, zmq.PUSH, a.engine_control, bind=binds)
        self._from_sidecar = make_socket(self._ctx, zmq.PULL, a.frontend_input, bind=True)
        if binds:  # the ports the OS chose for "*"
            self._addresses = dataclasses.replace(
                a,
                engine_input=bound_endpoint(self._to_engine),
                engine_control=bound_endpoint(self._to_control) if a.engine_control else "",
                frontend_input=bound_endpoint(self._from_sidecar),
            )
        self._reader = asyncio.create_task(self._read_loop(), name="engine-output-reader")

    @property
    def addresses(self) -> IpcAddresses:
        """Its endpoints; after `start`, the bound ports of a remote replica's."""
        return self._addresses

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
        if self._abort_retry is not None:
            self._abort_retry.cancel()
        for sock in (self._to_engine, self._to_control, self._from_sidecar):
            if sock is not None:
                sock.close()
        for ctx in (self._ctx, self._sync_ctx):
            if ctx is not None:
                ctx.term()

    @property
    def ready(self) -> bool:
        """The engine finished start-up, is alive and not stalled."""
        return self._ready.is_set() and self.dead_reason is None and self.stalled_reason is None

    async def wait_ready(self) -> EngineStats:
        """Wait for the engine's ready handshake; returns its stats."""
        await self._ready.wait()
        assert self.stats is not None
        return self.stats

    def add_stats_listener(self, listener: Callable[[EngineStats], None]) -> None:
        self._stats_listeners.append(listener)

    def send_control(self, msg) -> None:
        """Send a control message (e.g. `ipc.ProfileRequest`) on the engine's control path
        (its request queue without one). Raises EngineDeadError when the engine is dead,
        starting or not taking messages."""
        self._check_alive()
        sock = self._to_control if self._to_control is not None else self._to_engine
        try:
            sock.send(encode(msg), zmq.NOBLOCK)
        except zmq.Again as e:
            raise EngineDeadError("the engine is not taking requests") from e

    def add_outputs_listener(self, listener: Callable[[TextOutputs], None]) -> None:
        """Call `listener(msg)` on each TextOutputs as it arrives, before its streams get
        it (the metrics' detokenizer lag)."""
        self._outputs_listeners.append(listener)

    def is_running(self, request_id: str) -> bool:
        """True while the client request `request_id` has an open stream."""
        return request_id in self._requests

    def add_request(self, request_id: str, samples: list[EngineRequest]) -> RequestStream:
        """Send the n samples (`validation.split_samples`) of the client request
        `request_id`; returns one stream of all their outputs.

        Sample i is sent with the engine id `engine_request_id(request_id, serial, i)`;
        with n > 1 the samples share one cache_group (so the engine computes the prompt's
        KV blocks once), unique to this request. The client id stays taken until the
        last sample's final output arrives or `release(stream)`, whichever comes first.

        Raises EngineDeadError if the engine is not ready or died (samples already sent
        are then aborted), ValueError naming request_id if it is running already or holds
        a control character (`ENGINE_ID_SEPARATOR`, which would make engine ids ambiguous).
        """
        self._check_alive()
        if not samples:
            raise ValueError(f"request_id: {request_id!r} has no samples")
        if ENGINE_ID_SEPARATOR[0] in request_id:
            raise ValueError(f"request_id: {request_id!r} holds a control character")
        if request_id in self._requests:
            raise ValueError(f"request_id: {request_id!r} is already running")
        serial = next(self._serials)
        engine_ids = [engine_request_id(request_id, serial, i) for i in range(len(samples))]
        if len(samples) > 1:
            group = f"{request_id}{ENGINE_ID_SEPARATOR}{serial}"  # the engine ids' prefix
            samples = [dataclasses.replace(s, cache_group=group) for s in samples]
        stream = RequestStream(request_id, engine_ids)
        self._requests[request_id] = stream
        for engine_id in engine_ids:
            self._by_engine_id[engine_id] = stream
        for i, (engine_id, sample) in enumerate(zip(engine_ids, samples, strict=True)):
            try:
                self._send(dataclasses.replace(sample, request_id=engine_id))
            except EngineDeadError:
                for unsent in engine_ids[i:]:
                    stream._unfinished.pop(unsent)
                self.release(stream)  # aborts the samples already sent
                raise
        return stream

    def abort(self, request_id: str) -> bool:
        """Ask the engine to abort every unfinished sample of the client request
        `request_id`; its stream then ends with finish_reason "abort" for each. Returns
        False if no client request with this id is running (engine ids never match).
        Never raises: the abort is queued here until the engine can take it."""
        if self.dead_reason is not None:
            return False
        stream = self._requests.get(request_id)
        if stream is None:
            return False
        self._abort(stream.unfinished_engine_ids())
        return True

    async def wait_released(self, request_id: str, timeout: float) -> None:
        """Wait up to `timeout` seconds for the open stream of `request_id` (if any) to
        be released."""
        stream = self._requests.get(request_id)
        if stream is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stream.released.wait(), timeout)

    def mark_stalled(self, reason: str | None) -> None:
        """A process stopped sending heartbeats (reason says which), or None: it is back.
        While stalled, new requests are refused (`ready` is False) and every open stream
        ends with EngineDeadError(reason); ending it aborts its samples, queued here
        (`_pending_aborts`) until the engine takes them again."""
        if reason == self.stalled_reason:
            return
        was_stalled = self.stalled_reason is not None
        self.stalled_reason = reason
        if reason is not None and was_stalled:
            # Still stalled: the reason's text counts the silent seconds up, so it changes
            # every check; keep it current for new refusals, log and end streams once.
            return
        if reason is None:
            logger.warning("the stalled process is back: serving again")
            self._flush_aborts()
            return
        logger.error("stalled: %s", reason)
        for stream in list(self._requests.values()):
            stream.fail(EngineDeadError(reason))

    @property
    def num_pending_aborts(self) -> int:
        """Engine ids whose abort waits for the engine's control socket to take it."""
        return len(self._pending_aborts)

    def _abort(self, engine_ids: list[str]) -> None:
        """Queue aborts and send what the control socket takes now (never raises)."""
        if not engine_ids or self.dead_reason is not None:
            return
        for engine_id in engine_ids:
            self._pending_aborts[engine_id] = None
        self._flush_aborts()

    def _flush_aborts(self) -> None:
        if self._abort_retry is not None:
            self._abort_retry.cancel()
        self._abort_retry = None
        if not self._pending_aborts or self.dead_reason is not None:
            self._pending_aborts.clear()
            return
        try:
            self._send(AbortRequest(list(self._pending_aborts)))
        except EngineDeadError:  # the socket is full: keep them, try again soon
            with contextlib.suppress(RuntimeError):  # no loop: the next abort retries
                loop = asyncio.get_running_loop()
                self._abort_retry = loop.call_later(ABORT_RETRY_S, self._flush_aborts)
            return
        self._pending_aborts.clear()

    def release(self, stream: RequestStream) -> None:
        """The stream ended (finished, cancelled, failed): abort its unfinished samples in
        the engine, drop their later outputs, and free the client id at once for reuse.
        Idempotent; a newer request with the same client id is left alone."""
        self._abort(stream.unfinished_engine_ids())
        stream._unfinished.clear()
        stream.released.set()
        for engine_id in stream.engine_ids:
            if self._by_engine_id.get(engine_id) is stream:
                del self._by_engine_id[engine_id]
        if self._requests.get(stream.request_id) is stream:
            del self._requests[stream.request_id]

    def mark_dead(self, reason: str) -> None:
        """End every open stream with EngineDeadError(reason) and refuse new requests.

        Logs nothing: whoever saw the death (the launcher's child watcher, the replica
        watchers) logs it once, with what it does about it; a second ERROR line here
        made one death read as two failures."""
        self._end_streams(reason)

    def shut_down(self) -> None:
        """The server stops (SIGINT/SIGTERM) and its grace is over: end every open stream
        as `mark_dead` does, with SHUTTING_DOWN (gRPC UNAVAILABLE; HTTP an error event and
        `data: [DONE]`), so that none is cut mid-stream. Not an error: no error line."""
        self._end_streams(SHUTTING_DOWN)

    def _end_streams(self, reason: str) -> None:
        if self.dead_reason is not None:
            return
        self.dead_reason = reason
        for stream in self._requests.values():
            stream.put(EngineDeadError(reason))
        self._requests.clear()
        self._by_engine_id.clear()

    def _check_alive(self) -> None:
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        if not self._ready.is_set():
            raise EngineDeadError("the engine is starting")

    def _send(self, msg: EngineRequest | AbortRequest) -> None:
        # NOBLOCK: the engine's input queue (high-water mark 1000 frames) never fills
        # while the engine lives; a full queue means it is stuck, so fail loudly.
        # Aborts take the control path when there is one (`_flush_aborts` retries them).
        sock = self._to_engine
        if isinstance(msg, AbortRequest) and self._to_control is not None:
            sock = self._to_control
        try:
            sock.send(encode(msg), zmq.NOBLOCK)
        except zmq.Again as e:
            raise EngineDeadError("the engine is not taking requests") from e

    async def _read_loop(self) -> None:
        sock = self._from_sidecar
        # The frames already queued are read with a plain non-blocking recv on the same
        # socket: each awaited recv of zmq.asyncio builds a future and a recv event and
        # polls the socket's events, while a frame that is ready makes the awaited recv
        # return without yielding to the event loop anyway (so the order in which the
        # streams see outputs is the same).
        ready = zmq.Socket.shadow(sock.underlying)
        while True:
            frame = await sock.recv()
            while frame is not None:
                self._apply(frame)
                try:
                    frame = ready.recv(zmq.NOBLOCK)
                except zmq.Again:
                    frame = None

    def _apply(self, frame: bytes) -> None:
        """Decode one frame from the sidecar and act on it."""
        # One bad message must not stop the loop: every open stream depends on it.
        try:
            msg = decode(frame)
            if isinstance(msg, TextOutputs):
                for listener in self._outputs_listeners:
                    listener(msg)
                self._dispatch(msg.outputs)
            elif isinstance(msg, EngineStats):
                self._on_stats(msg)
            elif isinstance(msg, Heartbeat):
                self.last_heartbeat[msg.source] = time.monotonic()
            else:
                logger.warning("ignoring unexpected %s", type(msg).__name__)
        except Exception:
            logger.exception("dropping a message from the sidecar that failed to apply")

    def _dispatch(self, outputs: list[TextOutput]) -> None:
        for out in outputs:
            # None: a sample of a request whose stream already ended (late output).
            stream = self._by_engine_id.get(out.request_id)
            if stream is None:
                continue
            if out.finish_reason is not None:
                del self._by_engine_id[out.request_id]
            if stream.put(out):
                # The last final: free the client id before the client can see it, so
                # a request sent right after it never finds the id taken.
                self.release(stream)

    def _on_stats(self, stats: EngineStats) -> None:
        self.stats = stats
        if stats.ready and not self._ready.is_set():
            self._ready.set()
        for listener in self._stats_listeners:
            listener(stats)

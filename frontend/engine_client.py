"""The frontend's side of the IPC: requests and aborts out to the engine, text deltas in
from the sidecar, fanned out to one queue per open request (asyncio, no JAX).

A request id stays reserved from `add_request` until the engine's final output for it
arrives (even when the client went away first), so a new request can never reuse an id
the engine still holds. When the engine (or the sidecar) dies, `mark_dead` ends every open
stream with `EngineDeadError` and refuses new requests.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import zmq
import zmq.asyncio

from jaxserve.ipc import (
    AbortRequest,
    EngineRequest,
    EngineStats,
    IpcAddresses,
    TextOutput,
    TextOutputs,
    decode,
    encode,
    make_socket,
)

logger = logging.getLogger("jaxserve.frontend")


class EngineDeadError(RuntimeError):
    """The engine process is gone (or not ready yet); the message says which."""


class RequestStream:
    """The text outputs of one request, in order, as the sidecar sends them."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self._queue: asyncio.Queue[TextOutput | EngineDeadError] = asyncio.Queue()

    def put(self, item: TextOutput | EngineDeadError) -> None:
        self._queue.put_nowait(item)

    async def next_batch(self) -> list[TextOutput]:
        """Wait for the next output, then take every output already queued with it (so a
        slow client gets fewer, larger deltas). Raises EngineDeadError if the engine died."""
        items = [await self._queue.get()]
        while not self._queue.empty():
            items.append(self._queue.get_nowait())
        for i, item in enumerate(items):
            if isinstance(item, EngineDeadError):
                if i == 0:
                    raise item
                self._queue.put_nowait(item)  # deliver what came before it first
                return items[:i]  # type: ignore[return-value]
        return items  # type: ignore[return-value]


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
        self._from_sidecar: zmq.asyncio.Socket | None = None
        self._reader: asyncio.Task | None = None
        # request id -> stream; None once the client left but the engine still holds it.
        self._requests: dict[str, RequestStream | None] = {}
        self._ready = asyncio.Event()
        self._stats_listeners: list[Callable[[EngineStats], None]] = []
        self.stats: EngineStats | None = None
        self.dead_reason: str | None = None

    async def start(self) -> None:
        self._ctx = zmq.asyncio.Context()
        self._sync_ctx = zmq.Context()
        self._to_engine = make_socket(
            self._sync_ctx, zmq.PUSH, self._addresses.engine_input, bind=False
        )
        self._from_sidecar = make_socket(
            self._ctx, zmq.PULL, self._addresses.frontend_input, bind=True
        )
        self._reader = asyncio.create_task(self._read_loop(), name="engine-output-reader")

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
        for sock in (self._to_engine, self._from_sidecar):
            if sock is not None:
                sock.close()
        for ctx in (self._ctx, self._sync_ctx):
            if ctx is not None:
                ctx.term()

    @property
    def ready(self) -> bool:
        """The engine finished start-up and is alive."""
        return self._ready.is_set() and self.dead_reason is None

    async def wait_ready(self) -> EngineStats:
        """Wait for the engine's ready handshake; returns its stats."""
        await self._ready.wait()
        assert self.stats is not None
        return self.stats

    def add_stats_listener(self, listener: Callable[[EngineStats], None]) -> None:
        self._stats_listeners.append(listener)

    def is_reserved(self, request_id: str) -> bool:
        """True while the engine may still hold a request with this id."""
        return request_id in self._requests

    def add_request(self, request: EngineRequest) -> RequestStream:
        """Send a validated request; returns the stream of its outputs.

        Raises EngineDeadError if the engine is not ready or died, ValueError if the id is
        still reserved (the caller checks `is_reserved` first to report it).
        """
        self._check_alive()
        if request.request_id in self._requests:
            raise ValueError(f"request_id: {request.request_id!r} is already running")
        stream = RequestStream(request.request_id)
        self._requests[request.request_id] = stream
        self._send(request)
        return stream

    def abort(self, request_id: str) -> bool:
        """Ask the engine to abort a request; its stream (if still open) then ends with
        finish_reason "abort". Returns False if no request with this id is running."""
        if request_id not in self._requests or self.dead_reason is not None:
            return False
        self._send(AbortRequest([request_id]))
        return True

    def detach(self, request_id: str) -> None:
        """The client left: drop the stream, keep the id reserved until the engine's final."""
        if self._requests.get(request_id) is not None:
            self._requests[request_id] = None

    def mark_dead(self, reason: str) -> None:
        """End every open stream with EngineDeadError(reason) and refuse new requests."""
        if self.dead_reason is not None:
            return
        self.dead_reason = reason
        logger.error("engine unavailable: %s", reason)
        for stream in self._requests.values():
            if stream is not None:
                stream.put(EngineDeadError(reason))
        self._requests.clear()

    def _check_alive(self) -> None:
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        if not self._ready.is_set():
            raise EngineDeadError("the engine is starting")

    def _send(self, msg: EngineRequest | AbortRequest) -> None:
        # NOBLOCK: the engine's input queue (high-water mark 1000 frames) never fills
        # while the engine lives; a full queue means it is stuck, so fail loudly.
        try:
            self._to_engine.send(encode(msg), zmq.NOBLOCK)
        except zmq.Again as e:
            raise EngineDeadError("the engine is not taking requests") from e

    async def _read_loop(self) -> None:
        while True:
            frame = await self._from_sidecar.recv()
            # One bad message must not stop the loop: every open stream depends on it.
            try:
                msg = decode(frame)
                if isinstance(msg, TextOutputs):
                    self._dispatch(msg.outputs)
                elif isinstance(msg, EngineStats):
                    self._on_stats(msg)
                else:
                    logger.warning("ignoring unexpected %s", type(msg).__name__)
            except Exception:
                logger.exception("dropping a message from the sidecar that failed to apply")

    def _dispatch(self, outputs: list[TextOutput]) -> None:
        for out in outputs:
            if out.finish_reason is not None:
                stream = self._requests.pop(out.request_id, None)
            else:
                stream = self._requests.get(out.request_id)
            if stream is not None:
                stream.put(out)

    def _on_stats(self, stats: EngineStats) -> None:
        self.stats = stats
        if stats.ready and not self._ready.is_set():
            self._ready.set()
        for listener in self._stats_listeners:
            listener(stats)

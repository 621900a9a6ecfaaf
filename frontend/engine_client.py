"""The frontend's side of the IPC: requests and aborts out to the engine, text deltas in
from the sidecar, fanned out to one queue per open request (asyncio, no JAX).

A request id stays reserved from `add_request` until the engine's final output for it
arrives (even when the client went away first), so a new request can never reuse an id
the engine still holds. The n samples of one client request (`add_request_group`) are n
engine requests that feed one stream; the group's id stays reserved, and `abort` of it
aborts every sample, until the last sample's final output. When the engine (or the
sidecar) dies, `mark_dead` ends every open stream with `EngineDeadError` and refuses new
requests.
"""

from __future__ import annotations

import asyncio
import contextlib
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
    """The text outputs of one request, in order, as the sidecar sends them. The stream of
    a request group carries the outputs of all its samples (each names its request_id),
    in arrival order: every sample's outputs are in order, and none waits behind another."""

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
        # group id -> its samples' request ids still held by the engine, and back.
        self._groups: dict[str, set[str]] = {}
        self._group_of: dict[str, str] = {}
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
        """True while the engine may still hold a request (or a group) with this id."""
        return request_id in self._requests or request_id in self._groups

    def add_request(self, request: EngineRequest) -> RequestStream:
        """Send a validated request; returns the stream of its outputs.

        Raises EngineDeadError if the engine is not ready or died, ValueError if the id is
        still reserved (the caller checks `is_reserved` first to report it).
        """
        self._check_alive()
        self._check_free(request.request_id)
        stream = RequestStream(request.request_id)
        self._requests[request.request_id] = stream
        self._send(request)
        return stream

    def add_request_group(self, group_id: str, requests: list[EngineRequest]) -> RequestStream:
        """Send the samples of one client request; returns one stream of all their outputs.

        `group_id` and every sample's id are reserved together before anything is sent;
        `abort(group_id)` then aborts every sample still running.

        Raises EngineDeadError if the engine is not ready or died (samples already sent are
        then aborted), ValueError naming request_id if the group id or any sample id is
        still reserved, or if the ids are not distinct.
        """
        self._check_alive()
        ids = [r.request_id for r in requests]
        if len(set(ids)) != len(ids) or group_id in ids:
            raise ValueError(f"request_id: the samples of {group_id!r} need distinct ids")
        for request_id in (group_id, *ids):
            self._check_free(request_id)
        stream = RequestStream(group_id)
        self._groups[group_id] = set(ids)
        for request_id in ids:
            self._requests[request_id] = stream
            self._group_of[request_id] = group_id
        for i, request in enumerate(requests):
            try:
                self._send(request)
            except EngineDeadError:
                for unsent in ids[i:]:
                    self._release(unsent)
                with contextlib.suppress(EngineDeadError):  # the engine is stuck anyway
                    self.abort(group_id)
                self.detach(group_id)
                raise
        return stream

    def abort(self, request_id: str) -> bool:
        """Ask the engine to abort a request, or every sample of a group; each stream (if
        still open) then ends with finish_reason "abort". Returns False if no request or
        group with this id is running. Raises EngineDeadError if the engine is stuck."""
        if self.dead_reason is not None:
            return False
        if request_id in self._groups:
            ids = sorted(self._groups[request_id])
        elif request_id in self._requests:
            ids = [request_id]
        else:
            return False
        self._send(AbortRequest(ids))
        return True

    def detach(self, request_id: str) -> None:
        """The client left: drop the stream (of a request, or of every sample of a group),
        keep the ids reserved until the engine's finals."""
        for rid in self._groups.get(request_id, (request_id,)):
            if self._requests.get(rid) is not None:
                self._requests[rid] = None

    def mark_dead(self, reason: str) -> None:
        """End every open stream with EngineDeadError(reason) and refuse new requests."""
        if self.dead_reason is not None:
            return
        self.dead_reason = reason
        logger.error("engine unavailable: %s", reason)
        # A group's stream is held by each of its samples: end each stream once.
        streams = {id(s): s for s in self._requests.values() if s is not None}
        for stream in streams.values():
            stream.put(EngineDeadError(reason))
        self._requests.clear()
        self._groups.clear()
        self._group_of.clear()

    def _check_free(self, request_id: str) -> None:
        if self.is_reserved(request_id):
            raise ValueError(f"request_id: {request_id!r} is already running")

    def _release(self, request_id: str) -> RequestStream | None:
        """Forget a request (the engine no longer holds it); returns its stream, if open."""
        stream = self._requests.pop(request_id, None)
        group_id = self._group_of.pop(request_id, None)
        if group_id is not None:
            samples = self._groups[group_id]
            samples.discard(request_id)
            if not samples:
                del self._groups[group_id]
        return stream

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
                stream = self._release(out.request_id)
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

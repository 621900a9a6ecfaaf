"""`RequestStream`: the outputs of the n samples of one client request, as the frontend's
engine client (engine_client.py) fans them out to it from the sidecar, and the
`EngineDeadError` that ends it when the engine dies, stalls or the server stops
(asyncio, no JAX).
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import NamedTuple

from jaxserve.ipc import TextOutput


class EngineDeadError(RuntimeError):
    """The engine process is gone (or not ready yet); the message says which."""


class SampleOutput(NamedTuple):
    """One text output of one sample of a client request."""

    index: int  # the sample, in [0, n)
    output: TextOutput  # output.request_id is the sample's engine request id


class RequestStream:
    """The outputs of the n samples of one client request, in arrival order (each sample's
    outputs in order, none waiting behind another's), as `SampleOutput`s.

    request_id: the client's id. num_samples: n. engine_ids: the samples' engine ids.
    """

    def __init__(self, request_id: str, engine_ids: list[str]) -> None:
        self.request_id = request_id
        self.engine_ids = engine_ids
        self._index = {engine_id: i for i, engine_id in enumerate(engine_ids)}
        # engine id -> sample index, for the samples whose final output has not come yet.
        self._unfinished = dict(self._index)
        # The queue: a deque and the one reader's wake-up future, not an asyncio.Queue,
        # whose put_nowait/get_nowait/empty are several Python calls per item (maxsize,
        # task accounting, putters) that a stream with one reader and no bound never needs.
        self._items: deque[SampleOutput | EngineDeadError] = deque()
        self._waiter: asyncio.Future | None = None
        self.released = asyncio.Event()  # set by AsyncEngineClient.release

    @property
    def num_samples(self) -> int:
        return len(self.engine_ids)

    def unfinished_engine_ids(self) -> list[str]:
        """The engine ids of the samples the engine has not sent a final output for."""
        return list(self._unfinished)

    def put(self, item: TextOutput | EngineDeadError) -> bool:
        """Queue an output of one of this request's samples (or the engine's death).
        Returns True when it was the final output of the last unfinished sample."""
        if isinstance(item, EngineDeadError):
            self._unfinished.clear()
            self.fail(item)
            return False
        if item.finish_reason is not None:
            self._unfinished.pop(item.request_id)
        self._append(SampleOutput(self._index[item.request_id], item))
        return item.finish_reason is not None and not self._unfinished

    def fail(self, error: EngineDeadError) -> None:
        """Queue `error` behind the outputs queued so far, leaving the unfinished samples
        as they are (a stall: `release` still aborts them)."""
        self._append(error)

    def _append(self, item: SampleOutput | EngineDeadError) -> None:
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def next_batch(self) -> list[SampleOutput]:
        """Wait for the next output, then take every output already queued with it (so a
        slow client gets fewer, larger deltas). Raises EngineDeadError if the engine died."""
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        items = list(self._items)
        self._items.clear()
        for i, item in enumerate(items):
            if isinstance(item, EngineDeadError):
                if i == 0:
                    raise item
                self._items.append(item)  # deliver what came before it first
                return items[:i]  # type: ignore[return-value]
        return items  # type: ignore[return-value]

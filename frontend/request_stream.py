"""`RequestStream`: the outputs of the n samples of one client request, as the frontend's
engine client (engine_client.py) fans them out to it from the sidecar, and the
`EngineDeadError` that ends it when the engine dies, stalls or the server stops
(asyncio, no JAX).
"""

from __future__ import annotations

import asyncio
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
        self._queue: asyncio.Queue[SampleOutput | EngineDeadError] = asyncio.Queue()
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
            self._queue.put_nowait(item)
            return False
        if item.finish_reason is not None:
            self._unfinished.pop(item.request_id)
        self._queue.put_nowait(SampleOutput(self._index[item.request_id], item))
        return item.finish_reason is not None and not self._unfinished

    async def next_batch(self) -> list[SampleOutput]:
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

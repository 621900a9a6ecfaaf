"""`RequestStream`: the outputs of the n samples of one client request, as the frontend's
engine client (engine_client.py) fans them out to it from the sidecar, and the
`EngineDeadError` that ends it when the engine dies, stalls or the server stops
(asyncio, no JAX).

The outputs its reader has not taken yet are bounded (`bound`): a client that stops
reading its stream holds its writer in the transport's flow control (uvicorn's drain,
gRPC's HTTP/2 window) while the engine keeps generating, and without a bound the frontend
would keep that request's whole output in memory (4 unread HTTP streams of n=32, 1000
tokens and 20 top log-probs each took 257 MiB). Past the bound the queue is dropped for a
`StreamOverflowError` and the stream's owner (`requests.Generation`) aborts the request.
vLLM's Python frontend merges a slow reader's outputs into one (RequestOutputCollector),
unbounded; a proposed change to its Rust frontend (vLLM PR 56094) bounds each request's
channel at 256 outputs and aborts the request past it. Here the bound is in bytes, since
an output's size varies a hundredfold with the tokens it carries and their top log-probs:
OUTPUT_BYTES and `token_bytes` estimate what the frontend holds for an output, calibrated
with tracemalloc on decoded sidecar messages.
"""

from __future__ import annotations

import asyncio
import sys
from collections import deque
from collections.abc import Callable
from typing import NamedTuple

from jaxserve.ipc import TextOutput


class EngineDeadError(RuntimeError):
    """The engine process is gone (or not ready yet); the message says which."""


class StreamOverflowError(RuntimeError):
    """The stream's client left more output unread than its bound allows; the message
    names the limit (gRPC RESOURCE_EXHAUSTED; HTTP a last error event)."""


_ENDINGS = (EngineDeadError, StreamOverflowError)  # the items that end a stream

# Estimated bytes of output a stream may hold for its client (`RequestStream.bound`),
# --max-stream-buffer-bytes: a reader of n=128 samples with 20 top log-probs each (about
# 430 KiB a step) may fall 38 engine steps behind before its request is aborted.
DEFAULT_MAX_STREAM_BUFFER_BYTES = 16 * 2**20

# What the frontend holds for one queued output (a decoded `TextOutput` and its queue
# entry) beside its tokens, and for each token without log-probs, then with them: a
# token's [logprob, top] entry and each of its top [id, logprob] pairs (tracemalloc, on
# outputs of 1 and 8 tokens with 0, 1, 5 and 20 top log-probs: within 10% of these).
OUTPUT_BYTES = 400
TOKEN_BYTES = 48
LOGPROB_TOKEN_BYTES = 248
TOP_LOGPROB_BYTES = 136


def token_bytes(logprobs: int | None) -> int:
    """The estimated frontend bytes of one output token of a request that asks for
    `logprobs` top log-probs per token (None: none; 0: the chosen token's only)."""
    if logprobs is None:
        return TOKEN_BYTES
    return TOKEN_BYTES + LOGPROB_TOKEN_BYTES + TOP_LOGPROB_BYTES * logprobs


class SampleOutput(NamedTuple):
    """One text output of one sample of a client request."""

    index: int  # the sample, in [0, n)
    output: TextOutput  # output.request_id is the sample's engine request id


class RequestStream:
    """The outputs of the n samples of one client request, in arrival order (each sample's
    outputs in order, none waiting behind another's), as `SampleOutput`s.

    request_id: the client's id. num_samples: n. engine_ids: the samples' engine ids.
    Unbounded until `bound` is called.
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
        self._items: deque[SampleOutput | EngineDeadError | StreamOverflowError] = deque()
        self._waiter: asyncio.Future | None = None
        self.released = asyncio.Event()  # set by AsyncEngineClient.release
        # Estimated bytes of the queued outputs (`bound`): one add and one compare a put.
        self._unsent = 0
        self._max_unsent = sys.maxsize
        self._token_bytes = TOKEN_BYTES
        self._on_overflow: Callable[[int], None] | None = None

    def bound(
        self, max_bytes: int, token_bytes: int, on_overflow: Callable[[int], None] | None
    ) -> None:
        """Bound the outputs queued for the reader to `max_bytes` estimated bytes, each
        output counted as OUTPUT_BYTES + its tokens x `token_bytes` (`token_bytes()`).
        Past it the queue is dropped for one `StreamOverflowError` naming the limit,
        `on_overflow(estimated bytes queued)` runs (the owner aborts the request), and
        `put` returns True."""
        self._max_unsent = max_bytes
        self._token_bytes = token_bytes
        self._on_overflow = on_overflow

    @property
    def num_samples(self) -> int:
        return len(self.engine_ids)

    def unfinished_engine_ids(self) -> list[str]:
        """The engine ids of the samples the engine has not sent a final output for."""
        return list(self._unfinished)

    def put(self, item: TextOutput | EngineDeadError) -> bool:
        """Queue an output of one of this request's samples (or the engine's death).
        Returns True when the stream takes no more outputs: this was the final output of
        the last unfinished sample, or it passed the bound (`bound`)."""
        if isinstance(item, EngineDeadError):
            self._unfinished.clear()
            self.fail(item)
            return False
        if item.finish_reason is not None:
            self._unfinished.pop(item.request_id)
        self._append(SampleOutput(self._index[item.request_id], item))
        self._unsent += OUTPUT_BYTES + len(item.token_ids) * self._token_bytes
        if self._unsent > self._max_unsent:
            self._overflow()
            return True
        return item.finish_reason is not None and not self._unfinished

    def _overflow(self) -> None:
        unsent, limit = self._unsent, self._max_unsent
        self._items.clear()
        self._unsent, self._max_unsent = 0, sys.maxsize  # once
        self._append(
            StreamOverflowError(
                f"stream: the client left more than {limit} bytes of output unread "
                f"(--max-stream-buffer-bytes {limit}); the request was aborted"
            )
        )
        if self._on_overflow is not None:
            self._on_overflow(unsent)

    def fail(self, error: EngineDeadError) -> None:
        """Queue `error` behind the outputs queued so far, leaving the unfinished samples
        as they are (a stall: `release` still aborts them)."""
        self._append(error)

    def _append(self, item: SampleOutput | EngineDeadError | StreamOverflowError) -> None:
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def next_batch(self) -> list[SampleOutput]:
        """Wait for the next output, then take every output already queued with it (so a
        slow client gets fewer, larger deltas). Raises EngineDeadError if the engine died,
        StreamOverflowError past the bound."""
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        items = list(self._items)
        self._items.clear()
        self._unsent = 0
        for i, item in enumerate(items):
            if isinstance(item, _ENDINGS):
                if i == 0:
                    raise item
                self._items.append(item)  # deliver what came before it first
                return items[:i]  # type: ignore[return-value]
        return items  # type: ignore[return-value]

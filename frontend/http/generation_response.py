"""Started generations -> the HTTP answer to a completions or chat request: one JSON
body once every generation is done (`DeferredJSONResponse`), or a stream of server-sent
events as their outputs come (`EventStreamResponse`). Several prompts' generations are
merged in OpenAI's choice order (prompt i's sample j is choice i * n + j), each taken
only as fast as the client takes the answer, so that --max-stream-buffer-bytes holds.
What the body says (JSON shapes) is outputs.py's; how a response ends its work when the
client leaves is responses.py's."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from jaxserve.frontend.http.errors import HttpError, error_body, stream_buffer_full, unavailable
from jaxserve.frontend.http.outputs import Choice, ResponseWriter
from jaxserve.frontend.http.responses import (
    DONE,
    DeferredJSONResponse,
    EventStreamResponse,
    sse_event,
)
from jaxserve.frontend.requests import (
    EngineUnavailableError,
    Generation,
    SampleFailedError,
    StreamOverflowError,
)
from jaxserve.ipc import TextOutput


async def _merged(
    generations: list[Generation], n: int
) -> AsyncIterator[tuple[int, list[TextOutput]]]:
    """(choice index, outputs) of every generation as they come; generation i's sample j
    is choice i * n + j. Closing it releases every generation. A generation's outputs are
    taken from its stream only as fast as the caller takes them (one batch each at most
    waits here), so that the stream's bound (--max-stream-buffer-bytes) holds."""
    if len(generations) == 1:
        async with contextlib.aclosing(generations[0].batches()) as batches:
            async for groups in batches:
                for item in groups:
                    yield item
        return
    queue: asyncio.Queue = asyncio.Queue(maxsize=len(generations))

    async def pump(i: int, generation: Generation) -> None:
        try:
            async with contextlib.aclosing(generation.batches()) as batches:
                async for groups in batches:
                    await queue.put((i, groups))
            await queue.put((i, None))
        except Exception as e:  # delivered to the reader, which raises it
            await queue.put((i, e))

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(generations)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                for sample, outputs in item:
                    yield i * n + sample, outputs
    finally:
        for t in tasks:
            t.cancel()
        for g in generations:
            g.release()


def respond(body, generations: list[Generation], writer: ResponseWriter):
    """The answer to a request whose `generations` (one per prompt, n samples each) have
    started: with `body.stream`, an `EventStreamResponse` of OpenAI chunks (an error after
    it began is its last event, before [DONE]); else a `DeferredJSONResponse` of the whole
    completion (its error as that status). Either releases every generation when done."""
    n = generations[0].num_samples
    prompt_tokens = sum(g.prompt_tokens for g in generations)

    def release() -> None:
        for g in generations:
            g.release()

    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        events = _events(generations, n, writer, prompt_tokens, include_usage)
        response = EventStreamResponse(events, release)
        for g in generations:  # past the stream's bound: the connection is cut
            g.on_overflow = response.cut
        return response

    async def compute() -> dict:
        choices = [Choice(i) for i in range(n * len(generations))]
        try:
            async for index, outputs in _merged(generations, n):
                choices[index].add(outputs, keep=writer.logprobs)
        except EngineUnavailableError as e:
            raise unavailable(str(e)) from None
        except SampleFailedError as e:
            raise HttpError(400, str(e)) from None
        except StreamOverflowError as e:
            raise stream_buffer_full(str(e)) from None
        return writer.response(choices, prompt_tokens)

    return DeferredJSONResponse(compute, release)


async def _events(
    generations: list[Generation],
    n: int,
    writer: ResponseWriter,
    prompt_tokens: int,
    include_usage: bool,
) -> AsyncIterator[bytes]:
    started: set[int] = set()
    tokens: dict[int, int] = {}
    try:
        async for index, outputs in _merged(generations, n):
            event = writer.event(index, outputs, index not in started, include_usage)
            started.add(index)
            last = outputs[-1]
            if last.finish_reason is not None:
                tokens[index] = last.completion_tokens
            else:
                tokens[index] = tokens.get(index, 0) + sum(len(o.token_ids) for o in outputs)
            if event is not None:
                yield event
        if include_usage:
            yield sse_event(writer.usage_chunk(prompt_tokens, sum(tokens.values())))
    except EngineUnavailableError as e:
        yield sse_event(unavailable(str(e)).body())
    except SampleFailedError as e:
        yield sse_event(error_body(400, str(e)))
    except StreamOverflowError as e:
        yield sse_event(stream_buffer_full(str(e)).body())
    yield DONE

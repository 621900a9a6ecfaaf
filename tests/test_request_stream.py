"""`RequestStream`: outputs come out in arrival order, everything queued at once in one
batch; the engine's death ends the stream after the outputs that came before it; past its
bound, what is queued is dropped for one StreamOverflowError."""

from __future__ import annotations

import asyncio

import pytest

from jaxserve.frontend.request_stream import (
    OUTPUT_BYTES,
    EngineDeadError,
    RequestStream,
    StreamOverflowError,
    token_bytes,
)
from jaxserve.ipc import TextOutput


def _out(engine_id: str, text: str, final: bool = False) -> TextOutput:
    return TextOutput(engine_id, text, [1], finish_reason="length" if final else None)


def test_a_waiting_reader_gets_each_output_and_then_what_queued_meanwhile():
    async def go():
        stream = RequestStream("r", ["a", "b"])
        reader = asyncio.ensure_future(stream.next_batch())
        await asyncio.sleep(0)  # the reader waits on an empty stream
        assert not reader.done()
        stream.put(_out("b", "x"))
        first = await reader
        stream.put(_out("a", "y"))
        last = stream.put(_out("b", "z", final=True))
        assert not last  # "a" is unfinished
        assert stream.put(_out("a", "w", final=True))  # the last final
        second = await stream.next_batch()
        return first, second, stream.unfinished_engine_ids()

    first, second, unfinished = asyncio.run(go())
    assert [(i, o.text) for i, o in first] == [(1, "x")]
    assert [(i, o.text) for i, o in second] == [(0, "y"), (1, "z"), (0, "w")]
    assert unfinished == []


def test_death_comes_after_the_outputs_queued_before_it():
    async def go():
        stream = RequestStream("r", ["a"])
        stream.put(_out("a", "x"))
        stream.fail(EngineDeadError("stalled"))
        before = await stream.next_batch()
        unfinished = stream.unfinished_engine_ids()  # a stall leaves them to abort
        with pytest.raises(EngineDeadError, match="stalled"):
            await stream.next_batch()
        return before, unfinished

    before, unfinished = asyncio.run(go())
    assert [o.text for _, o in before] == ["x"]
    assert unfinished == ["a"]


def test_death_wakes_a_waiting_reader_and_clears_the_unfinished():
    async def go():
        stream = RequestStream("r", ["a", "b"])
        reader = asyncio.ensure_future(stream.next_batch())
        await asyncio.sleep(0)
        assert stream.put(EngineDeadError("gone")) is False
        with pytest.raises(EngineDeadError, match="gone"):
            await reader
        return stream.unfinished_engine_ids()

    assert asyncio.run(go()) == []


def test_a_cancelled_reader_leaves_the_stream_usable():
    async def go():
        stream = RequestStream("r", ["a"])
        reader = asyncio.ensure_future(stream.next_batch())
        await asyncio.sleep(0)
        reader.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reader
        stream.put(_out("a", "x", final=True))
        return await asyncio.wait_for(stream.next_batch(), 1.0)

    assert [o.text for _, o in asyncio.run(go())] == ["x"]


def test_token_bytes_grow_with_the_top_logprobs():
    assert token_bytes(None) == 48
    assert token_bytes(0) == 48 + 248
    assert token_bytes(20) == 48 + 248 + 20 * 136


def test_past_its_bound_the_queue_is_dropped_for_one_overflow_error():
    async def go():
        stream = RequestStream("r", ["a", "b"])
        seen = []
        # Two outputs of 3 tokens at 100 bytes a token fit (2 x 700 bytes); a third not.
        stream.bound(2 * (OUTPUT_BYTES + 300), 100, seen.append)
        assert not stream.put(TextOutput("a", "x", [1, 2, 3]))
        taken = await stream.next_batch()  # taken: no longer counted
        assert not stream.put(TextOutput("a", "y", [1, 2, 3]))
        assert not stream.put(TextOutput("b", "z", [1, 2, 3]))
        assert seen == []
        assert stream.put(TextOutput("b", "w", [1]))  # the stream takes no more
        with pytest.raises(StreamOverflowError, match="more than 1400 bytes"):
            await stream.next_batch()
        return taken, seen

    taken, seen = asyncio.run(go())
    assert [o.text for _, o in taken] == ["x"]
    assert seen == [3 * OUTPUT_BYTES + 700]  # y, z and w: what was dropped

"""`jaxserve.ipc.encode` / `decode`: the wire form `[type_name, {field: value}]` (msgpack),
built here by hand, and the dataclasses it decodes back to: nested messages inside list
fields are revived, lists and dicts that are not messages come back as they were sent."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

from jaxserve import ipc
from jaxserve.observability.stats import EngineCounters


def test_encode_is_the_documented_msgpack_form():
    out = ipc.TextOutput("r\x1f#0.0", "hi", [7, 8], finish_reason="length", completion_tokens=2)
    fields = {
        "request_id": "r\x1f#0.0", "text": "hi", "token_ids": [7, 8], "finish_reason": "length",
        "stop_reason": None, "prompt_tokens": 0, "completion_tokens": 2, "error": None,
        "logprobs": None, "prompt_logprobs": None,
    }  # fmt: skip
    want = msgpack.packb(["TextOutputs", {"outputs": [["TextOutput", fields]], "engine_time": 1.5}])
    assert ipc.encode(ipc.TextOutputs([out], 1.5)) == want


@pytest.mark.parametrize(
    "msg",
    [
        ipc.TextOutputs(
            [ipc.TextOutput(f"r{i}", "t", [i], logprobs=[[-0.5, [[i, -0.5]]]]) for i in range(3)],
            2.0,
        ),
        ipc.EngineOutputs([ipc.TokenOutput("a", [1, 2], num_output_tokens=2)], step=4),
        ipc.EngineStats(model="m", counters=EngineCounters(num_steps=9), expert_layers=[1, 3]),
        ipc.KvEvents(1, [[0, "stored", None, [b"h" * 16]], [1, "cleared", None, []]]),
    ],
)
def test_messages_round_trip(msg):
    assert ipc.decode(ipc.encode(msg)) == msg


def test_only_list_values_are_searched_for_messages():
    """A [type_name, fields] pair inside a list field is a message; inside a dict that is
    not a message's fields (a request's sampling) it stays a plain list."""
    pair = ["Heartbeat", {"source": "engine", "time": 0.0}]
    frame = msgpack.packb(
        ["EngineRequest", {
            "request_id": "a", "prompt_token_ids": [1], "sampling": {"stop": [pair]},
            "arrival_time": 0.0, "cache_group": None, "deadline": None,
        }]
    )  # fmt: skip
    assert ipc.decode(frame).sampling == {"stop": [pair]}
    frame = msgpack.packb(["KvEvents", {"epoch": 1, "events": [pair]}])
    assert ipc.decode(frame).events == [ipc.Heartbeat("engine", 0.0)]


def test_arrays_travel_as_arrays():
    req = ipc.EngineRequest("a", np.arange(4, dtype=np.int32), {"max_tokens": 3})
    got = ipc.decode(ipc.encode(req))
    assert got.prompt_token_ids.dtype == np.int32
    assert got.prompt_token_ids.tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize("raw", [[1, 2], 5, ["Nope", {}]])
def test_a_frame_that_is_no_message_is_refused(raw):
    with pytest.raises(ValueError, match="not a jaxserve message"):
        ipc.decode(msgpack.packb(raw))


def test_a_new_sockets_monitor_does_not_collide_with_a_closed_ones():
    """pyzmq names a monitor's endpoint after the socket's file descriptor, which the OS
    reuses once the socket is closed, while the closed socket's monitor may still hold
    the name ("Address already in use": a CI run's reused remote replica slot lost its
    disconnect watch so). `monitor_socket` gives every monitor an endpoint of its own."""
    import zmq

    from jaxserve.ipc import monitor_socket

    ctx = zmq.Context()
    try:
        for _ in range(20):
            old = ctx.socket(zmq.PULL)
            old.bind("tcp://127.0.0.1:*")
            monitor_socket(old, zmq.EVENT_DISCONNECTED).close()
            old.close()
            new = ctx.socket(zmq.PULL)  # most often the closed socket's descriptor
            new.bind("tcp://127.0.0.1:*")
            monitor_socket(new, zmq.EVENT_DISCONNECTED).close()
            new.close()
    finally:
        ctx.destroy(linger=0)

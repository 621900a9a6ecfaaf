"""In-process ZeroMQ socket pairs around an `engine.process.EngineLoop`, for tests that run
the loop in a thread against a fake core."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import zmq


@contextlib.contextmanager
def loop_sockets(name: str) -> Iterator[tuple[zmq.Socket, zmq.Socket, zmq.Socket, zmq.Socket]]:
    """(to_loop, loop_in, loop_out, from_loop): send on to_loop what the loop reads on
    loop_in; read on from_loop what it sends on loop_out. `name` keeps the inproc
    addresses of tests apart. Closed (and the context ended) on exit."""
    ctx = zmq.Context()
    to_loop, loop_in = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    loop_out, from_loop = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    loop_in.bind(f"inproc://{name}-in")
    to_loop.connect(f"inproc://{name}-in")
    from_loop.bind(f"inproc://{name}-out")
    loop_out.connect(f"inproc://{name}-out")
    try:
        yield to_loop, loop_in, loop_out, from_loop
    finally:
        for s in (to_loop, loop_in, loop_out, from_loop):
            s.close(linger=0)
        ctx.term()

"""`serve --burst-gather-ms` (`EngineLoop._gather_burst`): an idle engine that receives a
request takes the ones that keep arriving before its first step, within the gap, and for
at most `BURST_GATHER_MAX_S` in all; with 0 it steps at once. Unset, the gap follows the
backend (`config.resolve_burst_gather_ms`)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from engine_loop_sockets import loop_sockets

from jaxserve import ipc


class _BatchCore:
    """Finishes every request it holds in each step, recording how many that was."""

    def __init__(self) -> None:
        self.held: list[str] = []
        self.step_sizes: list[int] = []

    def add_request(self, req) -> None:
        self.held.append(req.request_id)

    def abort_requests(self, ids) -> None:
        pass

    def has_work(self) -> bool:
        return bool(self.held)

    def step(self) -> list[ipc.TokenOutput]:
        self.step_sizes.append(len(self.held))
        outs = [
            ipc.TokenOutput(r, [1], finish_reason="length", num_output_tokens=1) for r in self.held
        ]
        self.held = []
        return outs

    def stats(self):
        return ipc.EngineStats()


def _run(gather_ms: float, num: int, every_s: float, name: str) -> list[int]:
    """Send `num` requests `every_s` apart to an idle loop; returns the core's step sizes
    once every request has its final output."""
    from jaxserve.engine.process import EngineLoop

    core = _BatchCore()
    with loop_sockets(name) as (to_loop, loop_in, loop_out, from_loop):
        loop = EngineLoop(core, loop_in, loop_out, burst_gather_ms=gather_ms)
        thread = threading.Thread(target=loop.run)
        thread.start()
        for i in range(num):
            to_loop.send(ipc.encode(ipc.EngineRequest(f"r{i}", np.asarray([1], np.int32), {})))
            time.sleep(every_s)
        finished = 0
        while finished < num:
            assert from_loop.poll(10_000), "the loop published no final output"
            msg = ipc.decode(from_loop.recv())
            if isinstance(msg, ipc.EngineOutputs):
                finished += len(msg.outputs)
        to_loop.send(ipc.encode(ipc.Shutdown("test")))
        thread.join(10)
    assert sum(core.step_sizes) == num
    return core.step_sizes


def test_a_burst_is_taken_in_one_step():
    """8 requests 5 ms apart, a 500 ms gap: one step takes them all (without the gather
    each step would take the few that arrived while the last one ran)."""
    assert _run(500.0, 8, 0.005, "burst-one") == [8]


def test_the_gather_ends_after_its_cap_while_requests_keep_coming():
    """Requests every 5 ms for 0.5 s, a 500 ms gap: the first step starts once
    BURST_GATHER_MAX_S (0.1 s) is over, not when the stream of requests ends."""
    from jaxserve.engine.process import BURST_GATHER_MAX_S

    assert BURST_GATHER_MAX_S < 0.5
    sizes = _run(500.0, 100, 0.005, "burst-cap")
    assert sizes[0] < 100 and len(sizes) > 1


def test_the_serve_flag_reaches_the_scheduler_config_and_refuses_a_negative_gap():
    from jaxserve.cli import build_parser
    from jaxserve.serve_config import engine_config

    parser = build_parser()
    args = parser.parse_args(["serve", "--burst-gather-ms", "2.5"])
    assert engine_config(args).scheduler.burst_gather_ms == 2.5
    assert engine_config(parser.parse_args(["serve"])).scheduler.burst_gather_ms is None
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--burst-gather-ms", "-1"])


def test_unset_the_gap_follows_the_backend():
    """None: CPU_BURST_GATHER_MS on the CPU, off elsewhere (a GPU, the mock engine);
    a value given, 0 too, is kept on every backend."""
    from jaxserve.config import CPU_BURST_GATHER_MS, resolve_burst_gather_ms

    assert CPU_BURST_GATHER_MS > 0
    assert resolve_burst_gather_ms(None, "cpu") == CPU_BURST_GATHER_MS
    assert resolve_burst_gather_ms(None, "gpu") == resolve_burst_gather_ms(None, "none") == 0
    assert resolve_burst_gather_ms(0.0, "cpu") == 0 and resolve_burst_gather_ms(3, "gpu") == 3

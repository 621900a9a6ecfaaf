"""The stream interval (`engine.stream_interval.OutputCoalescer`): against a brute-force
replay of random engine output streams, and through the engine loop's sockets."""

from __future__ import annotations

import random
import threading

import numpy as np
import pytest
from engine_loop_sockets import loop_sockets

from jaxserve.engine.stream_interval import OutputCoalescer
from jaxserve.ipc import EngineOutputs, EngineRequest, Shutdown, TokenOutput, decode, encode


def _random_run(rng: random.Random, num_requests: int, num_steps: int):
    """Per step, the engine's outputs: each live request gets 1-4 tokens (with log-probs
    on odd requests) or, now and then, nothing (preempted / not scheduled); a request
    finishes (stop, length or abort, sometimes with no tokens) at a random step."""
    steps: list[list[TokenOutput]] = []
    produced = {f"r{i}": 0 for i in range(num_requests)}
    live = set(produced)
    for _ in range(num_steps):
        outs = []
        for rid in sorted(live):
            if rng.random() < 0.15:
                continue  # no token this step
            finish = rng.choice([None] * 8 + ["stop", "length", "abort"])
            n = 0 if finish == "abort" else rng.randint(1, 4)
            first = produced[rid] == 0
            tokens = [rng.randrange(1000) for _ in range(n)]
            produced[rid] += n
            logprobs = [[-0.5, []] for _ in tokens] if int(rid[1:]) % 2 else None
            outs.append(
                TokenOutput(
                    rid, tokens, finish_reason=finish, num_output_tokens=produced[rid],
                    first={"sampling": {}} if first else None, logprobs=logprobs,
                )
            )  # fmt: skip
            if finish:
                live.discard(rid)
        steps.append(outs)
    return steps


def _copy(out: TokenOutput) -> TokenOutput:
    return TokenOutput(
        out.request_id, list(out.new_token_ids), out.finish_reason, out.stop_reason,
        out.num_prompt_tokens, out.num_output_tokens, out.error, out.first,
        None if out.logprobs is None else list(out.logprobs), out.prompt_logprobs,
    )  # fmt: skip


@pytest.mark.parametrize("interval", [1, 2, 5, 16])
@pytest.mark.parametrize("seed", range(6))
def test_coalescer_against_a_replay_of_the_stream(interval, seed):
    """Every token arrives, in order, with its log-prob; the first output and every
    final output go out in the step they are made; a message in between carries at
    least `interval` tokens unless its request got nothing in that step, and then its
    held tokens go out in that step; nothing is held once every request finished."""
    rng = random.Random(seed)
    steps = _random_run(rng, num_requests=12, num_steps=40)
    coalescer = OutputCoalescer(interval)
    want: dict[str, list[int]] = {}
    got: dict[str, list[int]] = {}
    got_logprobs: dict[str, int] = {}
    finished: set[str] = set()
    for outs in steps:
        present = {o.request_id for o in outs}
        for o in outs:
            want.setdefault(o.request_id, []).extend(o.new_token_ids)
        sent = coalescer.take([_copy(o) for o in outs])
        assert len({o.request_id for o in sent}) == len(sent)  # one message per request
        by_id = {o.request_id: o for o in sent}
        for o in outs:
            if o.first is not None or o.finish_reason is not None:
                assert o.request_id in by_id, "first and final outputs are never held"
        for o in sent:
            rid = o.request_id
            assert rid not in finished
            is_first = rid not in got
            got.setdefault(rid, []).extend(o.new_token_ids)
            assert o.num_output_tokens == len(got[rid])
            if o.logprobs is not None:
                got_logprobs[rid] = got_logprobs.get(rid, 0) + len(o.logprobs)
            if o.finish_reason is not None:
                finished.add(rid)
            elif not is_first and rid in present:
                assert len(o.new_token_ids) >= interval
        for rid in want.keys() - present:  # got nothing this step: nothing of it waits
            assert len(got.get(rid, [])) == len(want[rid])
    assert coalescer.num_held == 0
    assert got == want
    for rid, tokens in want.items():
        if int(rid[1:]) % 2:
            assert got_logprobs.get(rid, 0) == len(tokens)


def test_coalescer_refuses_an_interval_out_of_range():
    for bad in (0, -1, 1025):
        with pytest.raises(ValueError, match="stream_interval"):
            OutputCoalescer(bad)


class _CountingCore:
    """A core that gives its one request 1 token a step for 10 steps, then finishes it."""

    def __init__(self) -> None:
        self.rid: str | None = None
        self.n = 0

    def add_request(self, req) -> None:
        self.rid = req.request_id

    def abort_requests(self, ids) -> None:
        pass

    def has_work(self) -> bool:
        return self.rid is not None

    def step(self) -> list[TokenOutput]:
        self.n += 1
        done = self.n == 10
        out = TokenOutput(
            self.rid, [self.n], finish_reason="length" if done else None,
            num_output_tokens=self.n, first={"sampling": {}} if self.n == 1 else None,
        )  # fmt: skip
        if done:
            self.rid = None
        return [out]

    def stats(self):
        from jaxserve.ipc import EngineStats

        return EngineStats()


def test_engine_loop_publishes_by_the_stream_interval():
    """Through EngineLoop's sockets with stream_interval 4: 10 tokens, one a step, go out
    as [1], [2..5], [6..9], [10] (first at once, then 4 at a time, the final with the rest)."""
    from jaxserve.engine.process import EngineLoop

    with loop_sockets("stream-interval") as (to_loop, loop_in, loop_out, from_loop):
        loop = EngineLoop(_CountingCore(), loop_in, loop_out, stream_interval=4)
        thread = threading.Thread(target=loop.run)
        thread.start()
        to_loop.send(encode(EngineRequest("r", np.asarray([1], np.int32), {})))
        messages = []
        while not messages or messages[-1][-1].finish_reason is None:
            assert from_loop.poll(10_000), "the loop published no final output"
            msg = decode(from_loop.recv())
            if isinstance(msg, EngineOutputs):
                messages.append(msg.outputs)
        to_loop.send(encode(Shutdown("test")))
        thread.join(10)
    assert [[o.new_token_ids for o in m] for m in messages] == [
        [[1]],
        [[2, 3, 4, 5]],
        [[6, 7, 8, 9]],
        [[10]],
    ]

"""The stream interval: a running request's tokens go out in messages of at least N tokens
(`SchedulerConfig.stream_interval`, `serve --stream-interval`), as vLLM's and SGLang's
`--stream-interval`.

Each message a request's tokens travel in costs every process after the engine: the
sidecar's decode and encode, the frontend's fan-out, one gRPC or SSE message, the
client's parse. On a host whose cores the engine shares with the serving stack that cost
is taken from the engine (scripts/bench_serve.py prints each process's CPU per token).
Fewer, larger messages cut it; the price is smoothness: a client sees N tokens at a time.

What is never held back: a request's first output (its TTFT is unchanged, and it carries
the `first` header the sidecar learns the request from), its final output (which carries
every token held for it), and a held request that got no tokens in a step (preempted or
not scheduled: it is sent at once rather than wait for the request to run again). So no
token waits longer than the engine takes to produce N of them.
"""

from __future__ import annotations

from jaxserve.config import MAX_STREAM_INTERVAL
from jaxserve.ipc import TokenOutput


def merge(held: TokenOutput, new: TokenOutput) -> TokenOutput:
    """One TokenOutput with `held`'s tokens, then `new`'s: the finish state, counts and
    error of `new` (the later); the `first` header and prompt log-probs of whichever has
    them (only a request's first output does). `held` is updated in place and returned."""
    held.new_token_ids += new.new_token_ids
    if new.logprobs is not None:
        held.logprobs = (held.logprobs or []) + new.logprobs
    held.finish_reason, held.stop_reason, held.error = new.finish_reason, new.stop_reason, new.error
    held.num_prompt_tokens, held.num_output_tokens = new.num_prompt_tokens, new.num_output_tokens
    held.first = held.first or new.first
    held.prompt_logprobs = held.prompt_logprobs or new.prompt_logprobs
    return held


class OutputCoalescer:
    """Holds back running requests' outputs until they carry `interval` tokens (module
    docstring). interval 1 passes every output through unchanged.

    The held map has one entry per running request at most (an entry leaves with the
    request's final output or the first step it gets no token in).

    Raises:
        ValueError: interval is not within [1, MAX_STREAM_INTERVAL].
    """

    def __init__(self, interval: int = 1) -> None:
        if not 1 <= interval <= MAX_STREAM_INTERVAL:
            raise ValueError(
                f"stream_interval: must be within [1, {MAX_STREAM_INTERVAL}], got {interval}"
            )
        self.interval = interval
        self._held: dict[str, TokenOutput] = {}

    @property
    def num_held(self) -> int:
        """Requests with tokens held back now."""
        return len(self._held)

    def take(self, outputs: list[TokenOutput]) -> list[TokenOutput]:
        """The outputs to send after one engine step, given the step's `outputs` (one
        per request at most, in the engine's order); the rest is held for later steps."""
        if self.interval == 1:
            return outputs
        send: list[TokenOutput] = []
        seen: set[str] = set()
        for out in outputs:
            rid = out.request_id
            seen.add(rid)
            held = self._held.pop(rid, None)
            if held is not None:
                out = merge(held, out)
            elif out.first is not None or out.num_output_tokens <= len(out.new_token_ids):
                send.append(out)  # the first output: TTFT is not delayed
                continue
            if out.finish_reason is not None or len(out.new_token_ids) >= self.interval:
                send.append(out)
            else:
                self._held[rid] = out
        # Held requests that got nothing this step (preempted, not scheduled) go now.
        for rid in [rid for rid in self._held if rid not in seen]:
            send.append(self._held.pop(rid))
        return send

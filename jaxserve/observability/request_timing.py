"""Request timing: the client-facing latencies (TTFT, ITL, TPOT, e2e) of one sample as the
frontend sees them, observed into the frontend's `Metrics`. The frontend's request path
(frontend/requests.py) keeps one `RequestTiming` per sample. No JAX here."""

from __future__ import annotations

import time

from jaxserve.ipc import TextOutput
from jaxserve.observability.metrics import Metrics, observe_repeated


class RequestTiming:
    """Client-facing latencies of one sample, as the frontend sees them (vLLM's definitions):
    TTFT = first output token - arrival; ITL = gap between token deliveries, per token
    after the first (a delivery of n tokens counts n gaps of 1/n of its wait);
    TPOT = (last token - first token) / (output tokens - 1); e2e = final output - arrival."""

    def __init__(self, metrics: Metrics, start: float | None = None) -> None:
        self._m = metrics
        self._start = time.perf_counter() if start is None else start
        self._first: float | None = None
        self._last: float | None = None
        self.num_tokens = 0  # output tokens delivered so far

    def observe(self, outputs: list[TextOutput]) -> None:
        """Record one batch of consecutive outputs of the sample (the last may be final)."""
        now = time.perf_counter()
        if len(outputs) == 1:  # the common case, without the generator
            n_tokens = len(outputs[0].token_ids)
        else:
            n_tokens = sum(len(o.token_ids) for o in outputs)
        self.num_tokens += n_tokens
        if n_tokens:
            if self._first is None:
                self._first = now
                self._m.ttft.observe(now - self._start)
                # Tokens delivered with the first one (a slow reader's merged outputs, a
                # multi-token first output) came 0 s after it: every token but the first
                # has one ITL, so the ITLs' count is tokens - 1 and their mean the TPOT.
                observe_repeated(self._m.itl, 0.0, n_tokens - 1)
            elif self._last is not None:
                # n_tokens inter-token latencies of the same gap, in one observation.
                observe_repeated(self._m.itl, (now - self._last) / n_tokens, n_tokens)
            self._last = now
        last = outputs[-1]
        if last.finish_reason is not None:
            self._finish(last.finish_reason, last.prompt_tokens, last.completion_tokens, now)

    def cancelled(self, prompt_tokens: int) -> None:
        """The client left before the final output: count the sample as finished with
        reason "abort" and the tokens delivered up to now (vLLM counts an aborted request
        with the tokens it generated). Its final output, which arrives after the stream is
        detached, is never observed, so this is the sample's only count."""
        self._finish("abort", prompt_tokens, self.num_tokens, time.perf_counter())

    def _finish(
        self, finish_reason: str, prompt_tokens: int, completion_tokens: int, now: float
    ) -> None:
        self._m.request_finished(finish_reason)
        self._m.e2e.observe(now - self._start)
        self._m.prompt_tokens.inc(prompt_tokens)
        self._m.generation_tokens.inc(completion_tokens)
        if self._first is not None and completion_tokens > 1:
            self._m.tpot.observe((self._last - self._first) / (completion_tokens - 1))

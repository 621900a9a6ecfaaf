"""Admission control: what the frontend lets in, so that overload is answered at once.

Three limits, each a `jaxserve serve` flag; past any of them a new request gets
RESOURCE_EXHAUSTED at once, with a message naming the limit and its flag, instead of
queueing until its deadline (vLLM and SGLang queue without bound):

- `max_requests` (--max-pending-requests): engine requests (samples: a request with n
  samples counts n) running or waiting;
- `max_queued_prompt_tokens` (--max-queued-prompt-tokens): prompt tokens of requests
  whose first output has not come yet (the prefill backlog; a request's n samples share
  its prompt, counted once);
- `max_request_bytes` (--max-inflight-request-bytes): serialized request bytes of open
  calls (what a burst of large requests holds in frontend memory).

A request always gets in when nothing else is in flight, whatever its size, so no
single valid request is refused forever. The prompts of one API call (an HTTP request
with a list of prompts, each its own engine request) share an `AdmissionGroup`: what the
call's earlier prompts hold does not count against its later ones, so the call is judged
as one request (a lone call of 5 prompts under a limit of 4 gets in, as a lone gRPC
request with n = 5 does). Plain Python on the event loop; no locks.
When the bytes in flight fall back to zero after a burst, `on_drained` runs (the server
returns freed memory to the OS there: `frontend.memory`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from jaxserve.frontend.memory import TRIM_AFTER_BYTES

DEFAULT_MAX_REQUESTS = 4096
DEFAULT_MAX_QUEUED_PROMPT_TOKENS = 2**20  # ~1M tokens of prefill backlog
DEFAULT_MAX_REQUEST_BYTES = 256 * 2**20  # 256 MiB of requests held at once


class AdmissionError(Exception):
    """A request refused by admission control; the message names the limit.
    `limit` is the limit's short name ("requests", "queued_prompt_tokens", "bytes")."""

    def __init__(self, limit: str, message: str) -> None:
        super().__init__(message)
        self.limit = limit


@dataclass(frozen=True, slots=True)
class AdmissionLimits:
    """The three limits (see the module docstring); each must be >= 1."""

    max_requests: int = DEFAULT_MAX_REQUESTS
    max_queued_prompt_tokens: int = DEFAULT_MAX_QUEUED_PROMPT_TOKENS
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES


class AdmissionGroup:
    """What the admitted requests of one API call hold together (module docstring):
    samples, prompt tokens waiting for prefill, bytes."""

    __slots__ = ("samples", "prompt_tokens", "bytes")

    def __init__(self) -> None:
        self.samples = self.prompt_tokens = self.bytes = 0


class Ticket:
    """One request's share of the limits; `release()` returns it (idempotent)."""

    __slots__ = ("_ctl", "_group", "_bytes", "_samples", "_prompt_tokens")

    def __init__(self, ctl: AdmissionController, request_bytes: int, group: AdmissionGroup) -> None:
        self._ctl = ctl
        self._group = group
        self._bytes = request_bytes
        self._samples = 0
        self._prompt_tokens = 0
        group.bytes += request_bytes

    def admit(self, num_samples: int, prompt_tokens: int) -> None:
        """Take the request's samples and prompt tokens. Raises AdmissionError (and
        releases the ticket) past a limit."""
        ctl, lim, own = self._ctl, self._ctl.limits, self._group
        # Only other calls' holdings refuse a call; the messages count them and the call.
        others = ctl.num_requests - own.samples
        if others and ctl.num_requests + num_samples > lim.max_requests:
            mine = own.samples + num_samples
            self.release()
            raise AdmissionError(
                "requests",
                f"overloaded: {others} {'request is' if others == 1 else 'requests are'} "
                "running or waiting; "
                f"{mine} more would pass the limit of {lim.max_requests} "
                "(--max-pending-requests)",
            )
        others = ctl.queued_prompt_tokens - own.prompt_tokens
        if others and ctl.queued_prompt_tokens + prompt_tokens > lim.max_queued_prompt_tokens:
            mine = own.prompt_tokens + prompt_tokens
            self.release()
            raise AdmissionError(
                "queued_prompt_tokens",
                f"overloaded: {others} "
                f"{'prompt token waits' if others == 1 else 'prompt tokens wait'} for prefill; "
                f"{mine} more would pass the limit of "
                f"{lim.max_queued_prompt_tokens} (--max-queued-prompt-tokens)",
            )
        self._samples, self._prompt_tokens = num_samples, prompt_tokens
        ctl.num_requests += num_samples
        ctl.queued_prompt_tokens += prompt_tokens
        own.samples += num_samples
        own.prompt_tokens += prompt_tokens

    def prompt_done(self) -> None:
        """The request's first output came: its prompt no longer waits."""
        self._ctl.queued_prompt_tokens -= self._prompt_tokens
        self._group.prompt_tokens -= self._prompt_tokens
        self._prompt_tokens = 0

    def release(self) -> None:
        ctl, own = self._ctl, self._group
        self.prompt_done()
        ctl.num_requests -= self._samples
        ctl.request_bytes -= self._bytes
        own.samples -= self._samples
        own.bytes -= self._bytes
        self._samples = self._bytes = 0
        ctl.maybe_drained()


class AdmissionController:
    """Counts what is in flight against `AdmissionLimits`."""

    def __init__(
        self, limits: AdmissionLimits | None = None, on_drained: Callable[[], None] | None = None
    ) -> None:
        self.limits = limits or AdmissionLimits()
        self.on_drained = on_drained
        self.num_requests = 0
        self.queued_prompt_tokens = 0
        self.request_bytes = 0
        self.seen_bytes = 0  # bytes of requests (admitted or not) since the last drain

    def maybe_drained(self) -> None:
        """Call `on_drained` when the requests of a burst (TRIM_AFTER_BYTES or more,
        refused ones included) have all ended."""
        if self.request_bytes == 0 and self.seen_bytes >= TRIM_AFTER_BYTES:
            self.seen_bytes = 0
            if self.on_drained is not None:
                self.on_drained()

    def reserve(self, request_bytes: int, group: AdmissionGroup | None = None) -> Ticket:
        """A ticket holding `request_bytes` (before the request is tokenized); group: the
        API call's, when it sends several requests (None: a call of one). Raises
        AdmissionError past --max-inflight-request-bytes."""
        group = group or AdmissionGroup()
        lim = self.limits.max_request_bytes
        self.seen_bytes += request_bytes
        others = self.request_bytes - group.bytes
        if others and self.request_bytes + request_bytes > lim:
            raise AdmissionError(
                "bytes",
                f"overloaded: {others} {'byte' if others == 1 else 'bytes'} of requests "
                f"{'is' if others == 1 else 'are'} in flight; "
                f"{group.bytes + request_bytes} more would pass the limit of {lim} "
                "(--max-inflight-request-bytes)",
            )
        self.request_bytes += request_bytes
        return Ticket(self, request_bytes, group)

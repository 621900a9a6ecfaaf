"""Wait for a server's background compilation before a benchmark run.

`jaxserve serve` compiles the smallest step shapes, starts serving, and compiles the rest
in the background (`jaxserve.engine.warmup`): until then every step runs under the budget
of the compiled shapes, and the compiles take CPU from the steps. A run started then
measures warm-up, not the server (measured: 0.66x the steady-state tokens/s at
concurrency 1 on a 2-core CPU). vLLM compiles before it serves, so `vllm bench serve`
needs no such wait; `jaxserve bench` asks GetServerInfo's `warmup_pending_shapes` and
waits until it is 0 (at most `--warmup-timeout` seconds), saying so on stderr.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

# Seconds between two GetServerInfo calls while the server compiles.
POLL_S = 1.0

_ASK = object()  # wait_for_warmup: no answer in hand, ask first


def wait_for_warmup(
    pending_shapes: Callable[[], int | None],
    timeout_s: float,
    log: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True),
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
    *,
    first: int | None | object = _ASK,
) -> dict:
    """Poll `pending_shapes()` (the server's step shapes still compiling; None: it cannot
    be asked, e.g. the HTTP backend or a server that is down) until it is 0 or `timeout_s`
    seconds have passed (0: no wait). `first`: the count already in hand (the start-up
    probe's, `probe.ask_server`), which saves the first call; by default it is asked.

    Returns the record for the run's JSON: `pending_at_start` (None when unknown),
    `waited_s`, and `pending_at_run` (what was still compiling when the run began: not 0
    means the numbers include warm-up).
    """
    start = clock()
    pending = first = pending_shapes() if first is _ASK else first
    if pending:
        if timeout_s > 0:
            log(
                f"server: {pending} step shapes still compiling in the background (below "
                f"steady-state speed until done): waiting up to {timeout_s:g} s "
                "(--warmup-timeout 0 runs now)"
            )
        while pending and clock() - start < timeout_s:
            sleep(POLL_S)
            pending = pending_shapes()
        waited = clock() - start
        if pending:
            log(
                f"server: {pending} step shapes still compiling: the numbers below include "
                "its warm-up"
            )
        else:
            log(f"server: every step shape compiled after {waited:.1f} s; the run starts")
    return {"pending_at_start": first, "waited_s": clock() - start, "pending_at_run": pending}

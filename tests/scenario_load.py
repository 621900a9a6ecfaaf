"""Load generators of the diagnosis scenario tests (tests/test_diagnose_scenarios.py):
bursts of gRPC requests from threads."""

from __future__ import annotations

import threading

from jaxserve.frontend.client import JaxserveClient

RPC_TIMEOUT_S = 300


def burst(target: str, prompts: list[str], max_tokens: int, **params) -> list[int]:
    """Send every prompt at once (one thread each), wait for all; returns the number of
    output tokens of each (a failed request raises in its thread and counts -1)."""
    counts = [-1] * len(prompts)

    def run(i: int) -> None:
        with JaxserveClient(target) as c:
            n = 0
            for delta in c.generate(prompts[i], max_tokens=max_tokens, temperature=0.0,
                                    ignore_eos=True, timeout=RPC_TIMEOUT_S, **params):  # fmt: skip
                n += len(delta.token_ids) if delta.token_ids else 1
            counts[i] = n

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(RPC_TIMEOUT_S)
    return counts


class Background:
    """Run `fn()` in a thread repeatedly until stopped (load while diagnose samples)."""

    def __init__(self, fn) -> None:
        self._stop = threading.Event()
        self.rounds = 0
        self._thread = threading.Thread(target=self._loop, args=(fn,), daemon=True)
        self._thread.start()

    def _loop(self, fn) -> None:
        while not self._stop.is_set():
            fn()
            self.rounds += 1

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(RPC_TIMEOUT_S)

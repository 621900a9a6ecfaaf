"""HTTP body parsing A/B: this tree's `protocol.parse_body` against a git ref's, on one
completions body of token ids near the 32 MiB body limit (the largest input it parses).

The two parse the same bytes alternately (new, old, new, ...), so machine load drifts
over both alike; prints each one's median ms and new/old, with the load average.

    python scripts/bench_parse_body.py [--baseline-ref HEAD] [--ids 5500000] [--rounds 7]

The baseline's protocol.py is loaded from `git show REF:frontend/http/protocol.py` as a
module of its own (it must import against this tree's other modules).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from module_at_ref import ROOT, load_module_at_ref  # noqa: E402  (beside this script)


def load_baseline(ref: str):
    return load_module_at_ref(ref, "frontend/http/protocol.py", "baseline_protocol")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline-ref", default="HEAD")
    ap.add_argument("--ids", type=int, default=5_500_000, help="token ids in the prompt")
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from jaxserve.frontend.http import protocol  # noqa: PLC0415

    old = load_baseline(args.baseline_ref)
    ids = ",".join(str(1000 + i % 50_000) for i in range(args.ids))
    body = ('{"prompt": [' + ids + '], "max_tokens": 1}').encode()
    times: dict[str, list[float]] = {"new": [], "old": []}
    print(f"{len(body) / 2**20:.1f} MiB body, load average {os.getloadavg()[0]:.2f}")
    for _ in range(args.rounds):
        for name, module in (("new", protocol), ("old", old)):
            start = time.perf_counter()
            module.parse_body(module.CompletionRequest, body)
            times[name].append(time.perf_counter() - start)
    new, base = (statistics.median(times[k]) * 1000 for k in ("new", "old"))
    print(f"new {new:.0f} ms, {args.baseline_ref} {base:.0f} ms, new/old {new / base:.3f}")
    print(f"load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()

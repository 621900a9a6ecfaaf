"""KV-aware router benchmark.

    .venv/bin/python scripts/bench_router.py --micro [--replicas 4] [--blocks 10000]
        [--prompt-tokens 1024] [--block-size 16] [--json PATH]

--micro: the router's own cost per request (`jaxserve.router.router.Router.route`:
hash the prompt, match it in the prefix index, choose, book the load, then the request's
finish), with --blocks cached blocks per replica in the index: each replica caches
conversations of --prompt-tokens tokens that share a system prompt of a quarter of that,
and each routed prompt extends one cached conversation (so the match walks about half
its blocks on one replica and the system prompt on all). Prints the median and p99 of
--requests timed routes (time.perf_counter, one thread), with the hashing alone beside
it, and writes JSON (default bench_results/router_micro.json). The machine load
(`uptime`) is printed with the numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import time
from pathlib import Path

import numpy as np

from jaxserve.engine.block_hash import hash_token_blocks
from jaxserve.router.router import Router


def _uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def micro(args: argparse.Namespace) -> dict:
    rng = np.random.default_rng(0)
    bs, p = args.block_size, args.prompt_tokens
    router = Router(bs, "kv", seed=0)
    system = rng.integers(0, 50000, p // 4, dtype=np.int32)
    convs: list[tuple[int, np.ndarray]] = []
    for r in range(args.replicas):
        while router.index.num_blocks(r) < args.blocks:
            conv = np.concatenate([system, rng.integers(0, 50000, p - len(system), np.int32)])
            router.index.store(r, None, hash_token_blocks(conv, bs))
            convs.append((r, conv))
    pick = random.Random(0)
    route_us, hash_us, matched = [], [], []
    replicas = list(range(args.replicas))
    for i in range(args.requests):
        _, conv = pick.choice(convs)
        prompt = np.concatenate([conv[: p // 2], rng.integers(0, 50000, p // 2, np.int32)])
        t0 = time.perf_counter()
        decision = router.route(f"r{i}", prompt, replicas)
        router.on_output(f"r{i}", 1, finished=True)
        t1 = time.perf_counter()
        hash_token_blocks(prompt, bs)
        t2 = time.perf_counter()
        route_us.append((t1 - t0) * 1e6)
        hash_us.append((t2 - t1) * 1e6)
        matched.append(decision.matched_blocks)
    result = {
        "replicas": args.replicas,
        "blocks_per_replica": args.blocks,
        "index_nodes": router.index.num_nodes,
        "prompt_tokens": p,
        "block_size": bs,
        "requests": args.requests,
        "route_us_p50": statistics.median(route_us),
        "route_us_p99": _pct(route_us, 0.99),
        "hash_us_p50": statistics.median(hash_us),
        "matched_blocks_mean": statistics.mean(matched),
        "uptime": _uptime(),
    }
    print(f"# {result['uptime']}")
    print("replicas  blocks/replica  nodes   prompt  route p50 us  route p99 us  hash p50 us")
    print(
        f"{args.replicas:8d}  {args.blocks:14d}  {router.index.num_nodes:6d}  {p:6d}  "
        f"{result['route_us_p50']:12.1f}  {result['route_us_p99']:12.1f}  "
        f"{result['hash_us_p50']:11.1f}"
    )
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--micro", action="store_true", help="the router's cost per request")
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--blocks", type=int, default=10000, help="cached blocks per replica")
    ap.add_argument("--prompt-tokens", type=int, default=1024)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--requests", type=int, default=5000)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if not args.micro:
        ap.error("choose --micro")
    result = micro(args)
    path = args.json or Path("bench_results/router_micro.json")
    os.makedirs(path.parent, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

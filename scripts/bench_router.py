"""KV-aware router benchmark.

    .venv/bin/python scripts/bench_router.py --micro [--replicas 4] [--blocks 10000]
        [--prompt-tokens 1024] [--block-size 16] [--json PATH]
    .venv/bin/python scripts/bench_router.py --workload [--replicas 4]
        [--policies kv round-robin least-loaded random] [--rates 2 4 8 16]
        [--conversations 64] [--turns 6] [--system-prompts 4] [--json PATH]

--workload: a multi-turn chat on `jaxserve serve --replicas N` (the demo model, CPU;
one server per policy (`kv:W`: the kv policy with --router-weight W; `LABEL=FLAGS`:
the router flags FLAGS, e.g. "kvb=--router-policy kv --router-balance-abs 2"), started by this
script on a free port, every step shape
compiled before it serves: `--compile-all-at-start`, after one 1-replica start that
fills the persistent compilation cache, so that no background compilation runs during
a measurement): --conversations conversations of --turns turns, each starting with one
of --system-prompts shared system prompts (--system-tokens tokens); every turn adds
--user-tokens new tokens and the previous answer (--output-tokens, greedy, EOS
ignored) to the history, so a turn's prompt is its conversation's whole history.
Requests arrive as a Poisson process at each --rates rate (req/s); an arrival takes
the next turn of the least advanced conversation whose previous turn has finished
(ties at random; it waits while none has), so the conversations advance together, as
a population of users each sending a message every ~conversations/rate seconds.

Why these defaults. A prefix hit saves prefill; on the demo model (4 layers, hidden
128) a step's cost is mostly fixed (host work, dispatch), so a hit shortens TTFT only
where the prompt is long against the step's token budget: long shared system prompts
and a history that grows every turn, as in SGLang's and Dynamo's router benchmarks
(multi-turn chat, prefixes of 1-2k tokens). Here: 384-token system prompts, 64 user
tokens and 32 answer tokens a turn, 6 turns, so the last prompt is 928 tokens, near
the demo model's 1024 positions; the engine's own step budget (512 tokens, 8 requests
per step on each replica). --num-blocks (default) gives each replica room for its
share of the conversations' final histories with 25% to spare (at least --max-num-seqs
full-length requests): the replicas' caches together hold every conversation, one
replica's does not, which is the regime a router is for (a policy that sends every
conversation everywhere evicts; one replica with an unlimited cache, the oracle, never
does).

Per policy and rate: the engines' own prefix-cache hit rate (hit / looked-up prompt
tokens, summed over replicas from GetServerInfo), TTFT p50 and p99 (client side),
output tokens/s over the run, max/mean of the requests routed per replica and of the
work per replica (prompt tokens computed, not hit, plus output tokens), the hit rate
of an oracle, one replica with an unlimited cache, on the same requests in the same
order (every full block of every earlier prompt and answer whose K/V was computed,
i.e. all but the answer's last token, cached: `block_hash` names, the engine's hit
rule), and saturation, measured: the served rate (of the completions, (requests - 1) /
(last finish - first finish)) against the offered one (of the Poisson schedule,
(requests - 1) / (sum of the gaps between arrivals)), and the requests waiting in
the engines' queues (GetServerInfo every second, mean and max over the run); a row
whose served rate is under 90% of the offered one is marked saturated. One server per
policy; each rate draws new system prompts and conversations (its own seed), so what
an earlier rate cached cannot hit. Writes bench_results/router_workload.json.

--micro: the router's own cost per request (`jaxserve.router.router.Router.route`:
hash the prompt, match it in the prefix index, choose, book the load, then the request's
finish; the kv policy with `jaxserve serve`'s defaults), with --blocks cached blocks
per replica in the index: each replica caches conversations of --prompt-tokens tokens
that share a system prompt of a quarter of that, and each routed prompt extends one
cached conversation (so the match walks about half its blocks on one replica and the
system prompt on all). Prints the median and p99 of
--requests timed routes (time.perf_counter, one thread), with the hashing alone beside
it, and writes JSON (default bench_results/router_micro.json). The machine load
(`uptime`) is printed with the numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from jaxserve.engine.block_hash import hash_token_blocks
from jaxserve.router.options import RouterOptions
from jaxserve.router.router import Router

# The --workload's servers, traffic and oracle (scripts/ is on sys.path when a script
# runs; inserted for an import from elsewhere).
sys.path.insert(0, str(Path(__file__).resolve().parent))
from router_workload import Server, final_history, pct, run_rate  # noqa: E402


def _uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def micro(args: argparse.Namespace) -> dict:
    rng = np.random.default_rng(0)
    bs, p = args.block_size, args.prompt_tokens
    # The kv policy as `jaxserve serve` runs it (its default gate, cap and weights).
    router = Router(bs, "kv", seed=0, **RouterOptions().kv_options())
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
        "route_us_p99": pct(route_us, 0.99),
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


_HEADER = (
    "policy        rate  offered  served  sat  waiting  hit    oracle  hit/oracle  "
    "TTFT p50 s  TTFT p99 s  out tok/s  max/mean  work max/mean"
)


def _line(r: dict) -> str:
    ratio = r["hit_rate"] / r["oracle_hit_rate"] if r["oracle_hit_rate"] else 0.0
    return (
        f"{r['policy']:12s} {r['rate']:5.2f}  {r['offered_req_s']:7.2f}  {r['served_req_s']:6.2f}"
        f"  {'yes' if r['saturated'] else 'no ':3s}  {r['waiting_mean']:7.1f}  "
        f"{r['hit_rate']:.3f}  {r['oracle_hit_rate']:.3f}   {ratio:9.2f}  "
        f"{r['ttft_p50_s']:10.3f}  {r['ttft_p99_s']:10.3f}  {r['output_tok_s']:9.1f}  "
        f"{r['max_mean_load']:8.2f}  {r['max_mean_work']:13.2f}"
    )


def workload(args: argparse.Namespace) -> dict:
    if final_history(args) > args.max_model_len:
        raise SystemExit(
            f"--max-model-len {args.max_model_len} < a conversation's final history "
            f"({final_history(args)} tokens): fewer --turns or shorter turns"
        )
    if args.num_blocks is None:
        per_conv = -(-final_history(args) // args.block_size)
        share = -(-args.conversations * per_conv // args.replicas)
        args.num_blocks = max(int(1.25 * share), args.max_num_seqs * per_conv) + 1
    print(f"# {args.num_blocks} KV blocks per replica; {_uptime()}", flush=True)
    # One replica first, with the same engine flags: it fills the persistent compilation
    # cache, so the N replicas of each policy load the shapes instead of each compiling
    # them on the same cores.
    if not args.no_prime:
        prime = Server(args, "round-robin", 1)  # the router flags change no shape
        try:
            t = time.perf_counter()
            prime.wait(args.start_timeout)
            print(f"# compiled (1 replica) in {time.perf_counter() - t:.0f} s", flush=True)
        finally:
            prime.stop()
    rows = []
    for policy in args.policies:
        server = Server(args, policy, args.replicas)
        try:
            t = time.perf_counter()
            server.wait(args.start_timeout)
            print(f"# {policy}: {args.replicas} replicas serving in "
                  f"{time.perf_counter() - t:.0f} s", flush=True)  # fmt: skip
            for i, rate in enumerate(args.rates):
                # A new seed per rate: new system prompts and conversations, so the
                # caches the previous rate left cannot hit.
                row = asyncio.run(run_rate(args, server.port, rate, seed=1000 + i))
                row["policy"] = policy.partition("=")[0]
                row["policy_spec"] = policy
                row["uptime"] = _uptime()
                rows.append(row)
                print(_line(row) + f"  # {row['uptime']}", flush=True)
                if row["errors"]:
                    print(f"#   {len(row['errors'])} errors, first: {row['errors'][0]}")
        finally:
            server.stop()
    print()
    print(_HEADER)
    for r in rows:
        print(_line(r))
    return {"config": {k: str(v) for k, v in vars(args).items() if k != "json"}, "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--micro", action="store_true", help="the router's cost per request")
    ap.add_argument("--workload", action="store_true", help="multi-turn chat on N replicas")
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--blocks", type=int, default=10000, help="--micro: cached blocks/replica")
    ap.add_argument("--prompt-tokens", type=int, default=1024, help="--micro")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--requests", type=int, default=5000, help="--micro: timed routes")
    ap.add_argument("--policies", nargs="+", default=["kv", "round-robin", "least-loaded",
                                                     "random"])  # fmt: skip
    ap.add_argument("--rates", nargs="+", type=float, default=[2.0, 4.0, 8.0, 16.0])
    ap.add_argument("--conversations", type=int, default=64)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--system-prompts", type=int, default=4)
    ap.add_argument("--system-tokens", type=int, default=384)
    ap.add_argument("--user-tokens", type=int, default=64)
    ap.add_argument("--output-tokens", type=int, default=32)
    ap.add_argument("--num-blocks", type=int, default=None,
                    help="KV blocks per replica (default: its share of the conversations' "
                         "final histories + 25%%; module docstring)")  # fmt: skip
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--start-timeout", type=float, default=1800.0)
    ap.add_argument("--no-prime", action="store_true",
                    help="skip the 1-replica start (the compilation cache is warm)")  # fmt: skip
    ap.add_argument("--serve-args", default="", help="more `jaxserve serve` flags (one string)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if args.micro == args.workload:
        ap.error("choose one of --micro, --workload")
    result = micro(args) if args.micro else workload(args)
    name = "router_micro.json" if args.micro else "router_workload.json"
    path = args.json or Path("bench_results") / name
    os.makedirs(path.parent, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

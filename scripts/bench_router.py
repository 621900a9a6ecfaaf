"""KV-aware router benchmark.

    .venv/bin/python scripts/bench_router.py --micro [--replicas 4] [--blocks 10000]
        [--prompt-tokens 1024] [--block-size 16] [--json PATH]
    .venv/bin/python scripts/bench_router.py --workload [--replicas 4]
        [--policies kv round-robin least-loaded random] [--rates 1 2 4]
        [--conversations 64] [--turns 6] [--system-prompts 4] [--json PATH]

--workload: a multi-turn chat on `jaxserve serve --replicas N` (the demo model, CPU;
one server per policy, started by this script on a free port): --conversations
conversations of --turns turns, each starting with one of --system-prompts shared system
prompts (--system-tokens tokens); every turn adds --user-tokens new tokens and the
previous answer (--output-tokens, greedy, EOS ignored) to the history, so a turn's prompt
is its conversation's whole history. Requests arrive as a Poisson process at each
--rates rate (req/s); an arrival takes the next turn of a conversation whose previous
turn has finished (it waits while none has). Per policy and rate: the engines' own
prefix-cache hit rate (hit / looked-up prompt tokens, summed over replicas from
GetServerInfo), TTFT p50 and p99 (client side), output tokens/s over the run, max/mean
of the requests routed per replica, and the hit rate of an oracle, one replica with an
unlimited cache, on the same requests in the same order (every full block of every
earlier prompt and answer cached: `block_hash` names, the engine's hit rule). One server
per policy; each rate draws new system prompts and conversations (its own seed), so
what an earlier rate cached cannot hit. Writes bench_results/router_workload.json.

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
import asyncio
import json
import os
import random
import re
import shlex
import socket
import statistics
import subprocess
import sys
import threading
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


# ----- the workload -------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class _Server:
    """`jaxserve serve --replicas N` on a free loopback port, until stop()."""

    def __init__(self, args: argparse.Namespace, policy: str) -> None:
        self.port = _free_port()
        cmd = [
            sys.executable, "-m", "jaxserve.cli", "serve", "--port", str(self.port),
            "--replicas", str(args.replicas), "--router-policy", policy,
            "--block-size", str(args.block_size), "--num-blocks", str(args.num_blocks),
            "--max-num-seqs", str(args.max_num_seqs),
            "--max-num-batched-tokens", str(args.max_num_batched_tokens),
            "--max-model-len", str(args.max_model_len), "--stats-log-interval", "0",
            *shlex.split(args.serve_args),
        ]  # fmt: skip
        self.proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
        self.ready = threading.Event()
        self.log: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.log.append(line)
            if re.search(r"jaxserve ready", line):
                self.ready.set()

    def wait(self, timeout: float) -> None:
        from jaxserve.frontend.client import JaxserveClient

        if not self.ready.wait(timeout):
            raise RuntimeError("server did not start:\n" + "".join(self.log[-30:]))
        with JaxserveClient(f"127.0.0.1:{self.port}") as c:
            deadline = time.monotonic() + timeout
            while not all(r.state == "serving" for r in _replicas(c)):
                if time.monotonic() > deadline:
                    raise RuntimeError("replicas did not all start")
                time.sleep(0.5)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def _replicas(client) -> list:
    from jaxserve.frontend.proto import jaxserve_pb2 as pb

    info = client._stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=30)
    return sorted(info.replicas, key=lambda r: r.replica)


def _conversations(args: argparse.Namespace, rng: np.random.Generator, high: int) -> list[dict]:
    systems = [
        rng.integers(100, high, args.system_tokens).tolist() for _ in range(args.system_prompts)
    ]
    return [
        {"history": list(systems[i % len(systems)]), "turn": 0, "busy": False}
        for i in range(args.conversations)
    ]


async def _run_rate(args: argparse.Namespace, port: int, rate: float, seed: int) -> dict:
    import grpc

    from jaxserve.frontend.client import build_generate_request
    from jaxserve.frontend.proto import jaxserve_pb2_grpc as pb_grpc

    rng = np.random.default_rng(seed)
    high = min(2000, _vocab_size(port))
    convs = _conversations(args, rng, high)
    errors: list[str] = []
    total = args.conversations * args.turns
    log: list[tuple[list[int], list[int]]] = []  # (prompt, output) in issue order
    ttfts: list[float] = []
    out_tokens = 0
    done = asyncio.Event()
    finished = 0
    ready = asyncio.Condition()

    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = pb_grpc.JaxserveStub(channel)

        async def one(conv: dict) -> None:
            nonlocal out_tokens, finished
            conv["history"] += rng.integers(100, high, args.user_tokens).tolist()
            prompt = list(conv["history"])
            entry = (prompt, [])
            log.append(entry)
            req = build_generate_request(
                prompt, max_tokens=args.output_tokens, temperature=0.0, ignore_eos=True,
                return_token_ids=True,
            )  # fmt: skip
            start = time.perf_counter()
            first = None
            try:
                async for resp in stub.Generate(req, timeout=600):
                    if resp.token_ids and first is None:
                        first = time.perf_counter() - start
                    entry[1].extend(resp.token_ids)
            except grpc.RpcError as e:
                errors.append(f"{e.code().name}: {e.details()}")
            ttfts.append(first if first is not None else time.perf_counter() - start)
            out_tokens += len(entry[1])
            conv["history"] += entry[1]
            conv["turn"] += 1
            conv["busy"] = False
            finished += 1
            async with ready:
                ready.notify_all()
            if finished == total:
                done.set()

        def pick() -> dict | None:
            free = [c for c in convs if not c["busy"] and c["turn"] < args.turns]
            return free[int(rng.integers(len(free)))] if free else None

        before = _replicas_sync(port)
        t0 = time.perf_counter()
        tasks = []
        for _ in range(total):
            await asyncio.sleep(float(rng.exponential(1.0 / rate)))
            async with ready:
                while (conv := pick()) is None:
                    await ready.wait()
            conv["busy"] = True
            tasks.append(asyncio.create_task(one(conv)))
        await done.wait()
        elapsed = time.perf_counter() - t0
        await asyncio.gather(*tasks)
    after = _replicas_sync(port)
    pairs = list(zip(after, before, strict=True))
    queries = sum(a.prefix_cache_queries - b.prefix_cache_queries for a, b in pairs)
    hits = sum(a.prefix_cache_hits - b.prefix_cache_hits for a, b in pairs)
    routed = [a.router_decisions - b.router_decisions for a, b in pairs]
    return {
        "rate": rate,
        "requests": total,
        "hit_rate": hits / queries if queries else 0.0,
        "oracle_hit_rate": _oracle_hit_rate(log, args.block_size),
        "ttft_p50_s": statistics.median(ttfts),
        "ttft_p99_s": _pct(ttfts, 0.99),
        "output_tok_s": out_tokens / elapsed,
        "routed": routed,
        "max_mean_load": max(routed) / statistics.mean(routed) if any(routed) else 0.0,
        "elapsed_s": elapsed,
        "errors": errors,
    }


def _vocab_size(port: int) -> int:
    from jaxserve.frontend.client import JaxserveClient

    with JaxserveClient(f"127.0.0.1:{port}") as c:
        return c.server_info(timeout=30).vocab_size


def _replicas_sync(port: int) -> list:
    from jaxserve.frontend.client import JaxserveClient

    with JaxserveClient(f"127.0.0.1:{port}") as c:
        return _replicas(c)


def _oracle_hit_rate(log: list[tuple[list[int], list[int]]], bs: int) -> float:
    """Hit rate of one replica with an unlimited cache on the same requests, in order:
    every full block of every earlier prompt + answer is cached; a prompt hits its
    leading cached blocks, leaving at least one token to compute (the engine's rule)."""
    cached: set[bytes] = set()
    hits = queries = 0
    for prompt, output in log:
        names = hash_token_blocks(prompt, bs)
        n = 0
        while n < min(len(names), (len(prompt) - 1) // bs) and names[n] in cached:
            n += 1
        hits += n * bs
        queries += len(prompt)
        cached.update(hash_token_blocks(prompt + output, bs))
    return hits / queries if queries else 0.0


def workload(args: argparse.Namespace) -> dict:
    rows = []
    for policy in args.policies:
        server = _Server(args, policy)
        try:
            server.wait(args.start_timeout)
            for i, rate in enumerate(args.rates):
                # A new seed per rate: new system prompts and conversations, so the
                # caches the previous rate left cannot hit.
                row = asyncio.run(_run_rate(args, server.port, rate, seed=1000 + i))
                row["policy"] = policy
                row["uptime"] = _uptime()
                rows.append(row)
                print(
                    f"{policy:12s} {rate:5.2f} req/s  hit {row['hit_rate']:.3f} "
                    f"(oracle {row['oracle_hit_rate']:.3f})  TTFT p50 {row['ttft_p50_s']:.3f} "
                    f"s p99 {row['ttft_p99_s']:.3f} s  {row['output_tok_s']:.1f} tok/s  "
                    f"max/mean {row['max_mean_load']:.2f}  # {row['uptime']}",
                    flush=True,
                )
        finally:
            server.stop()
    print()
    print(
        "policy        rate  hit    oracle  hit/oracle  TTFT p50 s  TTFT p99 s  out tok/s  max/mean"
    )
    for r in rows:
        ratio = r["hit_rate"] / r["oracle_hit_rate"] if r["oracle_hit_rate"] else 0.0
        print(
            f"{r['policy']:12s} {r['rate']:5.2f}  {r['hit_rate']:.3f}  {r['oracle_hit_rate']:.3f}"
            f"   {ratio:9.2f}  {r['ttft_p50_s']:10.3f}  {r['ttft_p99_s']:10.3f}  "
            f"{r['output_tok_s']:9.1f}  {r['max_mean_load']:8.2f}"
        )
    return {"config": {k: v for k, v in vars(args).items() if k != "json"}, "rows": rows}


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
    ap.add_argument("--rates", nargs="+", type=float, default=[1.0, 2.0, 4.0])
    ap.add_argument("--conversations", type=int, default=64)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--system-prompts", type=int, default=4)
    ap.add_argument("--system-tokens", type=int, default=128)
    ap.add_argument("--user-tokens", type=int, default=24)
    ap.add_argument("--output-tokens", type=int, default=16)
    ap.add_argument("--num-blocks", type=int, default=160, help="KV blocks per replica")
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--max-num-batched-tokens", type=int, default=64)
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--start-timeout", type=float, default=1800.0)
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

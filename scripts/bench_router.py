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
from jaxserve.router.options import RouterOptions
from jaxserve.router.router import Router


def _uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


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

    def __init__(self, args: argparse.Namespace, policy: str, replicas: int) -> None:
        self.port = _free_port()
        # "LABEL=FLAGS": the router flags given (--router-policy among them);
        # "kv:W": the kv policy with weight W; else a policy name.
        label, eq, flags = policy.partition("=")
        name, _, weight = label.partition(":")
        router = shlex.split(flags) if eq else [
            "--router-policy", name, *(["--router-weight", weight] if weight else []),
        ]  # fmt: skip
        cmd = [
            sys.executable, "-m", "jaxserve.cli", "serve", "--port", str(self.port),
            "--replicas", str(replicas), *router,
            "--block-size", str(args.block_size), "--num-blocks", str(args.num_blocks),
            "--max-num-seqs", str(args.max_num_seqs),
            "--max-num-batched-tokens", str(args.max_num_batched_tokens),
            "--max-model-len", str(args.max_model_len), "--stats-log-interval", "0",
            "--compile-all-at-start", *shlex.split(args.serve_args),
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


def _final_history(args: argparse.Namespace) -> int:
    """Tokens of a conversation after its last answer."""
    return args.system_tokens + args.turns * (args.user_tokens + args.output_tokens)


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
    from jaxserve.frontend.proto import jaxserve_pb2 as pb
    from jaxserve.frontend.proto import jaxserve_pb2_grpc as pb_grpc

    rng = np.random.default_rng(seed)
    high = min(2000, _vocab_size(port))
    convs = _conversations(args, rng, high)
    errors: list[str] = []
    total = args.conversations * args.turns
    log: list[tuple[list[int], list[int]]] = []  # (prompt, output) in issue order
    ttfts: list[float] = []
    finish_times: list[float] = []
    out_tokens = 0
    done = asyncio.Event()
    finished = 0
    ready = asyncio.Condition()
    waiting: list[int] = []  # requests waiting in the engines' queues, sampled each second

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
            finish_times.append(time.perf_counter())
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
            if not free:
                return None
            low = min(c["turn"] for c in free)
            least = [c for c in free if c["turn"] == low]
            return least[int(rng.integers(len(least)))]

        async def sample_queues() -> None:
            while not done.is_set():
                try:
                    info = await stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10)
                    waiting.append(sum(r.num_waiting for r in info.replicas))
                except grpc.RpcError:
                    pass
                await asyncio.sleep(1.0)

        before = _replicas_sync(port)
        gaps = rng.exponential(1.0 / rate, total)
        # The offered rate: of the Poisson schedule itself (arrivals blocked waiting for a
        # free conversation do not lower it).
        offered = (total - 1) / float(gaps[1:].sum()) if total > 1 else rate
        sampler = asyncio.create_task(sample_queues())
        t0 = None  # the first send
        tasks = []
        for gap in gaps:
            await asyncio.sleep(float(gap))
            async with ready:
                while (conv := pick()) is None:
                    await ready.wait()
            conv["busy"] = True
            t0 = time.perf_counter() if t0 is None else t0
            tasks.append(asyncio.create_task(one(conv)))
        await done.wait()
        elapsed = max(finish_times) - t0
        await asyncio.gather(*tasks)
        await sampler
    after = _replicas_sync(port)
    pairs = list(zip(after, before, strict=True))
    queries = [a.prefix_cache_queries - b.prefix_cache_queries for a, b in pairs]
    hits = [a.prefix_cache_hits - b.prefix_cache_hits for a, b in pairs]
    routed = [a.router_decisions - b.router_decisions for a, b in pairs]
    # Work per replica: prompt tokens it computed (not hit) + output tokens it decoded.
    work = [q - h + n * args.output_tokens for q, h, n in zip(queries, hits, routed, strict=True)]
    # The completion rate, as the offered one over the gaps between events: it keeps up
    # with the arrivals unless a queue grows during the run (saturation).
    span = max(finish_times) - min(finish_times)
    served = (total - 1) / span if total > 1 and span > 0 else float(total)
    return {
        "rate": rate,
        "offered_req_s": offered,
        "served_req_s": served,
        "saturated": served < 0.9 * offered,
        "waiting_mean": statistics.mean(waiting) if waiting else 0.0,
        "waiting_max": max(waiting, default=0),
        "requests": total,
        "hit_rate": sum(hits) / sum(queries) if sum(queries) else 0.0,
        "oracle_hit_rate": _oracle_hit_rate(log, args.block_size),
        "ttft_p50_s": statistics.median(ttfts),
        "ttft_p99_s": _pct(ttfts, 0.99),
        "output_tok_s": out_tokens / elapsed,
        "routed": routed,
        "work_tokens": work,
        "max_mean_load": _max_mean(routed),
        "max_mean_work": _max_mean(work),
        "elapsed_s": elapsed,
        "errors": errors,
    }


def _max_mean(xs: list[int]) -> float:
    return max(xs) / statistics.mean(xs) if any(xs) else 0.0


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
    every full block of every earlier prompt + answer whose K/V was computed (all but
    the answer's last token: it is sampled, never fed back) is cached; a prompt hits its
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
        cached.update(hash_token_blocks((prompt + output)[:-1], bs))
    return hits / queries if queries else 0.0


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
    if _final_history(args) > args.max_model_len:
        raise SystemExit(
            f"--max-model-len {args.max_model_len} < a conversation's final history "
            f"({_final_history(args)} tokens): fewer --turns or shorter turns"
        )
    if args.num_blocks is None:
        per_conv = -(-_final_history(args) // args.block_size)
        share = -(-args.conversations * per_conv // args.replicas)
        args.num_blocks = max(int(1.25 * share), args.max_num_seqs * per_conv) + 1
    print(f"# {args.num_blocks} KV blocks per replica; {_uptime()}", flush=True)
    # One replica first, with the same engine flags: it fills the persistent compilation
    # cache, so the N replicas of each policy load the shapes instead of each compiling
    # them on the same cores.
    if not args.no_prime:
        prime = _Server(args, "round-robin", 1)  # the router flags change no shape
        try:
            t = time.perf_counter()
            prime.wait(args.start_timeout)
            print(f"# compiled (1 replica) in {time.perf_counter() - t:.0f} s", flush=True)
        finally:
            prime.stop()
    rows = []
    for policy in args.policies:
        server = _Server(args, policy, args.replicas)
        try:
            t = time.perf_counter()
            server.wait(args.start_timeout)
            print(f"# {policy}: {args.replicas} replicas serving in "
                  f"{time.perf_counter() - t:.0f} s", flush=True)  # fmt: skip
            for i, rate in enumerate(args.rates):
                # A new seed per rate: new system prompts and conversations, so the
                # caches the previous rate left cannot hit.
                row = asyncio.run(_run_rate(args, server.port, rate, seed=1000 + i))
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

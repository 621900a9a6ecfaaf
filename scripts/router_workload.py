"""The --workload of `bench_router.py`: its servers, its traffic and its oracle.

`Server` starts `jaxserve serve --replicas N` (one router policy, every step shape
compiled at start) on a free loopback port; `run_rate` drives one rate of the
multi-turn chat against it (Poisson arrivals, each the next turn of the least advanced
idle conversation) and returns the row's numbers; `oracle_hit_rate` is the hit rate of
one replica with an unlimited cache on the same requests. What the numbers mean and why
the defaults: bench_router.py's docstring. Imported by path (scripts/ on sys.path).
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import statistics
import sys
import time

import numpy as np
from serve_process import ServeProcess, free_port

from jaxserve.engine.block_hash import hash_token_blocks


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


class Server(ServeProcess):
    """`jaxserve serve --replicas N` on a free loopback port, until stop()."""

    def __init__(self, args: argparse.Namespace, policy: str, replicas: int) -> None:
        self.port = free_port()
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
        super().__init__(cmd)

    def wait(self, timeout: float) -> None:
        from jaxserve.frontend.client import JaxserveClient

        if not self.ready.wait(timeout):
            raise RuntimeError("server did not start:\n" + "".join(self.log[-30:]))
        with JaxserveClient(f"127.0.0.1:{self.port}") as c:
            deadline = time.monotonic() + timeout
            while not all(r.state == "serving" for r in replica_infos(c)):
                if time.monotonic() > deadline:
                    raise RuntimeError("replicas did not all start")
                time.sleep(0.5)


def replica_infos(client) -> list:
    from jaxserve.frontend.proto import jaxserve_pb2 as pb

    info = client._stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=30)
    if not info.replicas:  # one engine (--replicas 1): the server's own line, as replica 0
        return [  # (GetServerInfo answers UNAVAILABLE until the engine serves)
            pb.ReplicaInfo(
                replica=0,
                state="serving",
                prefix_cache_queries=info.prefix_cache_queries,
                prefix_cache_hits=info.prefix_cache_hits,
            )
        ]
    return sorted(info.replicas, key=lambda r: r.replica)


def final_history(args: argparse.Namespace) -> int:
    """Tokens of a conversation after its last answer."""
    return args.system_tokens + args.turns * (args.user_tokens + args.output_tokens)


def conversations(args: argparse.Namespace, rng: np.random.Generator, high: int) -> list[dict]:
    systems = [
        rng.integers(100, high, args.system_tokens).tolist() for _ in range(args.system_prompts)
    ]
    return [
        {"history": list(systems[i % len(systems)]), "turn": 0, "busy": False}
        for i in range(args.conversations)
    ]


async def run_rate(args: argparse.Namespace, port: int, rate: float, seed: int) -> dict:
    import grpc

    from jaxserve.frontend.client import build_generate_request
    from jaxserve.frontend.proto import jaxserve_pb2 as pb
    from jaxserve.frontend.proto import jaxserve_pb2_grpc as pb_grpc

    rng = np.random.default_rng(seed)
    high = min(2000, vocab_size(port))
    convs = conversations(args, rng, high)
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
                    waiting.append(info.num_waiting)  # summed over the replicas
                except grpc.RpcError:
                    pass
                await asyncio.sleep(1.0)

        before = replica_infos_at(port)
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
    after = replica_infos_at(port)
    pairs = list(zip(after, before, strict=True))
    queries = [a.prefix_cache_queries - b.prefix_cache_queries for a, b in pairs]
    hits = [a.prefix_cache_hits - b.prefix_cache_hits for a, b in pairs]
    routed = [a.router_decisions - b.router_decisions for a, b in pairs]
    if len(routed) == 1:  # one engine: no router, every request went there
        routed = [total]
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
        "oracle_hit_rate": oracle_hit_rate(log, args.block_size),
        "ttft_p50_s": statistics.median(ttfts),
        "ttft_p99_s": pct(ttfts, 0.99),
        "output_tok_s": out_tokens / elapsed,
        "routed": routed,
        "work_tokens": work,
        "max_mean_load": max_mean(routed),
        "max_mean_work": max_mean(work),
        "elapsed_s": elapsed,
        "errors": errors,
    }


def max_mean(xs: list[int]) -> float:
    return max(xs) / statistics.mean(xs) if any(xs) else 0.0


def vocab_size(port: int) -> int:
    from jaxserve.frontend.client import JaxserveClient

    with JaxserveClient(f"127.0.0.1:{port}") as c:
        return c.server_info(timeout=30).vocab_size


def replica_infos_at(port: int) -> list:
    from jaxserve.frontend.client import JaxserveClient

    with JaxserveClient(f"127.0.0.1:{port}") as c:
        return replica_infos(c)


def oracle_hit_rate(log: list[tuple[list[int], list[int]]], bs: int) -> float:
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

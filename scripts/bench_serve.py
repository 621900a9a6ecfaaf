"""Serving throughput: `jaxserve serve` over gRPC (and HTTP) against the offline `LLM.generate`.

Starts the server as a subprocess (three processes: frontend, engine, detokenizer) on a
free loopback port and sends the same prompts at concurrency 1, 16, 64 and 256; at each
level the same prompts also run through the in-process `LLM.generate`, `concurrency`
prompts per call (the same requests in flight), interleaved with the served runs
(--repeats of each, the order alternating; medians). The ratio served/offline ("vs
offline") is the cost of the frontend, the IPC and the sidecar (goal: >= 0.95x at every
level). Also times start-up to the first token with an empty JAX compilation cache
(cold) and with it filled (warm); the load starts only once the server has compiled
every step shape in the background (`engine.warmup`): steady state, not warm-up.

    python scripts/bench_serve.py [--model DIR] [--max-tokens 64] [--out bench_results/serve.json]
    python scripts/bench_serve.py --http [--repeats 3] [--skip-offline] [--skip-cold-start]

With --http the server also serves the OpenAI API (--http-port), and every level runs
over gRPC and over HTTP (streamed /v1/completions, SSE) on the same prompts, interleaved
(the order alternates per repeat); the table gives each path's median over the repeats
and HTTP/gRPC. Both clients run in this process, on the machine of the server, so a
client's CPU time is taken from the server: the HTTP client is aiohttp (its HTTP parser
is C, as grpc.aio's core is), reading the SSE lines itself (the `openai` client's httpx
transport parses HTTP in Python, which would bill client work to the server).
--cache-dir keeps the JAX compilation cache between runs (default: a new empty one).

--stream-interval 1,16 starts one server per value (`serve --stream-interval`: tokens per
stream message) and runs them interleaved with the rest ("vs gRPC" is then against the
server at 1). --serve-flags='--num-decode-steps 2' (repeatable) likewise starts one more
server with those `jaxserve serve` flags added: an A/B of serve options in one run. Every
served row also gives each process's CPU microseconds per output
token: engine, frontend, detokenizer sidecar, and this process's client (psutil), the
share the serving stack takes from an engine whose cores it shares; an offline row gives
its engine's (this process), and "cores" is CPU seconds of all of them per second;
"stack" is the same of all but the engine: on cores the engine shares, serving loses
about what the offline engine loses beside a co-runner process of that many cores
(scripts/bench_interference.py: on the 2-core CPU, 0.05 cores cost it 4-5%, 0.1 cores 4-11%).
Every row also gives the engine's steps and device seconds per run (medians): served
device seconds above offline's for the same tokens are XLA's threads slowed by the other
processes on their cores; more steps are requests arriving one by one (each new prompt
costs a prefill step, and a step with a prefill cannot run multi-step decode).

--engine-cpus 0 pins the engine to those CPUs and everything else to the rest, on both
paths (served: the engine process vs the frontend, the sidecar and this process's client;
offline: this process while its LLM.generate runs), as vLLM's CPU backend advises
(VLLM_CPU_OMP_THREADS_BIND): the engine on cores of its own, as on a host with more cores
than the engine uses, so the stack and the client no longer take the engine's CPU.

For a load of its own shape (datasets, request rate, latency percentiles, goodput) use
`jaxserve bench` against a running server; this script's load levels run through it.

Prints one table; writes JSON beside it. Requests are greedy with ignore_eos so every
request produces exactly --max-tokens tokens on both paths.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import json
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/, when imported
from serve_process import ServeProcess, free_port  # noqa: E402

PROMPTS = [
    "import ", "def ", "class ", "from collections import ", "for i in range(",
    "if __name__ == ", "return ", "with open(", "    def __init__(self, ", "try:\n    ",
    "raise ValueError(", "# Copyright", '"""', "self.", "while True:\n    ", "lambda x: ",
]  # fmt: skip


class Server(ServeProcess):
    """`jaxserve serve` in a subprocess; records when its first token could be served."""

    def __init__(self, model: str | None, cache_dir: str, extra: list[str], http: bool = False):
        self.port = free_port()
        self.http_port = free_port() if http else None
        self.metrics_port = free_port()
        cmd = [sys.executable, "-m", "jaxserve.cli", "serve", "--port", str(self.port)]
        cmd += ["--metrics-port", str(self.metrics_port)]
        if http:
            cmd += ["--http-port", str(self.http_port)]
        cmd += ["--compilation-cache-dir", cache_dir, *extra]
        if model:
            cmd += ["--model", model]
        self.t0 = time.perf_counter()
        # Every step shape compiled (`engine.warmup`): until then the step budget is held
        # to the compiled shapes, and the background compiles take CPU from the steps.
        self.warm = threading.Event()
        super().__init__(cmd, stdout=subprocess.DEVNULL, stop_timeout_s=15)
        # `jaxserve serve` outlives its parent (only its own children die with it): stop
        # it when this script exits, also on an error before the load's try/finally.
        atexit.register(self.stop)

    def on_line(self, line: str) -> None:
        if re.search(r"all \d+ step shapes compiled|compiled \d+ step shapes in", line):
            self.warm.set()

    def wait_warm(self, timeout: float = 900) -> float:
        """Wait until the server's background compilation is done; returns the seconds
        waited. Raises RuntimeError if it is not done within `timeout`."""
        t0 = time.perf_counter()
        self._wait(self.warm, timeout, "background compilation not done")
        return time.perf_counter() - t0

    def _wait(self, event: threading.Event, timeout: float, what: str) -> None:
        """Wait for `event`; RuntimeError(`what` and the log's tail) past `timeout` or as
        soon as the server exits (a flag it refuses, e.g. from --serve-flags)."""
        deadline = time.perf_counter() + timeout
        while not event.wait(0.5):
            code = self.proc.poll()
            if code is not None or time.perf_counter() > deadline:
                self.stop()
                why = f" (the server exited with {code})" if code is not None else ""
                raise RuntimeError(f"{what}{why}:\n" + "".join(self.log[-30:]))

    def time_to_first_token(self, timeout: float = 900) -> float:
        """Seconds from process start to the first streamed token of one request."""
        from jaxserve.frontend.client import JaxserveClient

        self._wait(self.ready, timeout, "server did not become ready")
        with JaxserveClient(f"127.0.0.1:{self.port}") as c:
            for d in c.generate("import ", max_tokens=1, temperature=0):
                if d.token_ids or d.text or d.finish_reason:
                    return time.perf_counter() - self.t0
        raise RuntimeError("no token")

    def cpu_seconds(self) -> dict[str, float]:
        """CPU seconds (user + system, all threads) each process of the server has used:
        "frontend" (the serve process), "engine" and "detokenizer" (its children)."""
        import psutil

        root = psutil.Process(self.proc.pid)
        used = {"frontend": _cpu(root), "engine": 0.0, "detokenizer": 0.0}
        for child in root.children(recursive=True):
            try:
                used[_role(child)] += _cpu(child)
            except psutil.NoSuchProcess:
                continue
        return used

    def pin(self, engine_cpus: set[int], other_cpus: set[int]) -> None:
        """Every thread of the engine process on engine_cpus, of the others on other_cpus."""
        import psutil

        root = psutil.Process(self.proc.pid)
        _pin(root.pid, other_cpus)
        for child in root.children(recursive=True):
            try:
                _pin(child.pid, engine_cpus if _role(child) == "engine" else other_cpus)
            except psutil.NoSuchProcess:
                continue

    def engine_counters(self) -> dict[str, float]:
        """The engine's step count and device seconds so far (`ENGINE_COUNTERS`), from the
        server's metrics endpoint (`jaxserve diagnose`'s scrape)."""
        from jaxserve.observability.metrics_window import scrape

        values = scrape(f"http://127.0.0.1:{self.metrics_port}/metrics")
        return {k: values.get(name, 0.0) for k, name in ENGINE_COUNTERS.items()}


# What each run reports of the engine (the served engine's metrics, the offline one's
# `EngineCore.stats()`): its steps and the seconds its steps took on the device (on the
# CPU, XLA's threads). Device seconds above offline's for the same tokens are the engine
# slowed by the other processes on its cores.
ENGINE_COUNTERS = {
    "steps": "jaxserve_engine_steps_total",
    "device_s": "jaxserve_engine_device_time_seconds_total",
}
# The processes whose CPU a served run reports (Server.cpu_seconds, and this one).
CPU_ROLES = ("engine", "frontend", "detokenizer", "client")


def _role(child) -> str:
    """A server child process's role: "detokenizer" (the sidecar) or "engine"."""
    return "detokenizer" if "detokenizer_process" in " ".join(child.cmdline()) else "engine"


def _pin(pid: int, cpus: set[int]) -> None:
    """Every thread of pid on cpus: sched_setaffinity sets one thread (a thread started
    later inherits its creator's), so each of /proc/PID/task."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except (ProcessLookupError, PermissionError):
            continue  # the thread ended meanwhile


def _cpu(proc) -> float:
    t = proc.cpu_times()
    return t.user + t.system


def _served_run(srv: Server, load):
    """Run `load` (a coroutine) against srv; returns its result plus each process's CPU
    seconds in the run, the client's ("client": this process) among them."""
    before, client = srv.cpu_seconds(), time.process_time()
    counters = srv.engine_counters()
    result = asyncio.run(load)
    client = time.process_time() - client
    cpu = {k: v - before[k] for k, v in srv.cpu_seconds().items()}
    time.sleep(0.1)  # the engine's stats of its last step reach the frontend
    engine = {k: v - counters[k] for k, v in srv.engine_counters().items()}
    return (*result, {**cpu, "client": client}, engine)


async def _run_load(
    backend: str, server: str, prompts: list[str], concurrency: int, max_tokens: int
):
    """Send every prompt, at most `concurrency` in flight, through `jaxserve bench`'s
    driver (jaxserve/benchmark/), greedy with ignore_eos: backend "grpc" (Generate) or
    "http" (streamed /v1/completions over aiohttp, one kept-alive connection per request
    in flight).

    Returns (seconds, output tokens, texts, TTFTs)."""
    from jaxserve.benchmark import client
    from jaxserve.benchmark.backends import Sampling, make_backend
    from jaxserve.benchmark.datasets import BenchRequest, Session

    sessions = [Session([BenchRequest(p, 0, max_tokens)]) for p in prompts]
    async with make_backend(backend, server, timeout_s=600) as b:
        run = await client.run(
            b, sessions, sampling=Sampling(0.0, ignore_eos=True), max_concurrency=concurrency
        )
    if failed := [o.error for o in run.outputs if not o.success]:
        raise RuntimeError(f"{len(failed)} requests failed: {failed[0]}")
    outs = run.outputs
    return (
        run.duration,
        sum(o.output_len for o in outs),
        [o.text for o in outs],
        [o.ttft for o in outs],
    )


def _median(values: list[float]) -> float:
    values = sorted(values)
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2


def _prompts(n: int) -> list[str]:
    return [PROMPTS[i % len(PROMPTS)] for i in range(n)]


def _parse_serve_flags(ap, texts: list[str]) -> dict[str, list[str]]:
    """--serve-flags values -> {the value as given: its flags}, shell-split."""
    variants = {}
    for text in texts:
        try:
            flags = shlex.split(text)
        except ValueError as e:
            ap.error(f"--serve-flags {text!r}: {e}")
        if not flags:
            ap.error(f"--serve-flags {text!r}: no flags in it")
        if text in variants:
            ap.error(f"--serve-flags {text!r}: given twice (each value starts one server)")
        variants[text] = flags
    return variants


def _parse_pinning(ap, text: str | None) -> tuple[set[int], set[int]] | None:
    """--engine-cpus -> (engine CPUs, the other CPUs this process may use), or None."""
    if text is None:
        return None
    allowed = os.sched_getaffinity(0)
    try:
        engine = {int(c) for c in text.split(",")}
    except ValueError:
        ap.error(f"--engine-cpus: comma-separated CPU numbers, got {text!r}")
    if not engine <= allowed:
        ap.error(f"--engine-cpus {text}: not among this process's CPUs {sorted(allowed)}")
    if not allowed - engine:
        ap.error(f"--engine-cpus {text}: every CPU; leave one for the frontend and client")
    return engine, allowed - engine


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", help="HF model folder (default: the bundled demo model)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--concurrency", default="1,16,64,256")
    ap.add_argument("--requests-per-level", type=int, default=64, help="requests at each level")
    ap.add_argument("--skip-cold-start", action="store_true")
    ap.add_argument("--out", default="bench_results/serve.json")
    ap.add_argument("--http", action="store_true", help="also measure the OpenAI HTTP API")
    ap.add_argument("--repeats", type=int, default=3, help="runs per path and level (median)")
    ap.add_argument("--skip-offline", action="store_true")
    ap.add_argument("--cache-dir", help="JAX compilation cache to use (default: a new one)")
    ap.add_argument(
        "--stream-interval",
        default="1",
        help="serve --stream-interval values, comma-separated: one server each, all measured "
        "interleaved over gRPC (default: 1)",
    )
    ap.add_argument(
        "--serve-flags",
        action="append",
        default=[],
        help="extra `jaxserve serve` flags (one string: --serve-flags='--num-decode-steps 2') "
        "for one more server, measured interleaved with the rest; repeatable",
    )
    ap.add_argument(
        "--engine-cpus",
        help="CPUs (e.g. 0 or 0,1) for the engine on both paths; the frontend, sidecar and "
        "client get the others (default: no pinning, all share every CPU)",
    )
    args = ap.parse_args()
    pinning = _parse_pinning(ap, args.engine_cpus)
    variants = _parse_serve_flags(ap, args.serve_flags)
    levels = [int(c) for c in args.concurrency.split(",")]
    repeats = args.repeats
    extra = ["--max-num-seqs", str(max(levels))]
    machine = f"{platform.machine()} x{os.cpu_count()} cores, Python {platform.python_version()}"
    rows, result = [], {"machine": machine, "load_before": os.getloadavg()}

    # Start-up: cold (empty compilation cache) then warm (the same cache, filled).
    cache = args.cache_dir
    if cache is None:  # a new one, removed at exit (runs left 5 MB folders in /tmp)
        cache = tempfile.mkdtemp(prefix="jaxserve-bench-cache-")
        atexit.register(shutil.rmtree, cache, ignore_errors=True)
    if not args.skip_cold_start:
        srv = Server(args.model, cache, extra)
        result["startup_cold_s"] = srv.time_to_first_token()
        srv.stop()
    intervals = [int(x) for x in args.stream_interval.split(",")]
    servers: dict[str, Server] = {}  # path name -> its server
    for i, interval in enumerate(intervals):
        name = "serve (gRPC)" if interval == 1 else f"serve (gRPC) si={interval}"
        flags = [*extra, "--stream-interval", str(interval)]
        servers[name] = Server(args.model, cache, flags, http=args.http and i == 0)
        if i == 0:
            result["startup_warm_s"] = servers[name].time_to_first_token()
    for text, flags in variants.items():
        servers[f"serve {text}"] = Server(args.model, cache, [*extra, *flags])
    # Steady state only: the load starts once every step shape is compiled (a served
    # run during the background compile measured 0.66x at concurrency 1).
    result["background_compile_wait_s"] = max(s.wait_warm() for s in servers.values())
    if pinning:
        for srv in servers.values():
            srv.pin(*pinning)
        result["engine_cpus"], result["other_cpus"] = (sorted(c) for c in pinning)
    paths = {}
    for name, srv in servers.items():
        target = f"127.0.0.1:{srv.port}"
        paths[name] = lambda p, c, t=target: _run_load("grpc", t, p, c, args.max_tokens)
    srv = next(iter(servers.values()))
    if args.http:
        url = f"http://127.0.0.1:{srv.http_port}"
        servers["serve (HTTP)"] = srv
        paths["serve (HTTP)"] = lambda p, c: _run_load("http", url, p, c, args.max_tokens)
    # Offline: the same prompts through LLM.generate in this process, `concurrency` at a
    # time (the same requests in flight as the server gets), interleaved with the served
    # runs of each level (the order alternates per repeat), so that a change of machine
    # load hits both sides alike. The server idles meanwhile, and the offline engine
    # while the server runs.
    if not args.skip_offline:
        from jaxserve import LLM, SamplingParams

        kwargs = dict(max_num_seqs=max(levels))
        llm = LLM(model=args.model, **kwargs) if args.model else LLM(**kwargs)
        sp = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
        llm.generate(_prompts(2), sp)  # warm-up

        def engine_counters() -> dict[str, float]:
            c = llm.engine.stats().counters
            return {"steps": c.num_steps, "device_s": c.device_time_s}

        def offline(prompts: list[str], c: int):
            t0, cpu, counters = time.perf_counter(), time.process_time(), engine_counters()
            outs = []
            for i in range(0, len(prompts), c):
                outs += llm.generate(prompts[i : i + c], sp)
            secs, cpu = time.perf_counter() - t0, time.process_time() - cpu
            engine = {k: v - counters[k] for k, v in engine_counters().items()}
            tokens = sum(len(o.token_ids) for o in outs)
            return secs, tokens, [o.text for o in outs], [], {"engine": cpu}, engine

        paths["offline LLM.generate"] = offline
    try:
        for c in levels:
            n = max(c, args.requests_per_level if c > 1 else min(8, args.requests_per_level))
            runs: dict[str, list] = {name: [] for name in paths}
            for rep in range(repeats):
                order = list(paths) if rep % 2 == 0 else list(paths)[::-1]
                for name in order:
                    if name.startswith("offline"):
                        if pinning:
                            _pin(os.getpid(), pinning[0])  # this process is the engine now
                        runs[name].append(paths[name](_prompts(n), c))
                    else:
                        if pinning:
                            _pin(os.getpid(), pinning[1])  # this process is the client
                        load = paths[name](_prompts(n), c)
                        runs[name].append(_served_run(servers[name], load))
            texts = runs[next(iter(servers))][0][2]
            for name, results in runs.items():
                p50s = [sorted(r[3])[len(r[3]) // 2] for r in results if r[3]]
                same = sum(a == b for a, b in zip(results[0][2], texts, strict=True))
                rows.append({
                    "path": name, "concurrency": c, "requests": n, "repeats": repeats,
                    "seconds": _median([r[0] for r in results]),
                    "output_tok_s": _median([r[1] / r[0] for r in results]),
                    "req_s": _median([n / r[0] for r in results]),
                    "ttft_p50_s": _median(p50s) if p50s else None,
                    "output_tok_s_runs": [r[1] / r[0] for r in results],
                    "texts_equal_to_served": f"{same}/{n}",
                    "load": os.getloadavg()[0],
                })  # fmt: skip
                rows[-1]["cpu_us_per_token"] = {  # offline: the engine's (this process)
                    k: _median([r[4][k] / r[1] * 1e6 for r in results])
                    for k in CPU_ROLES
                    if k in results[0][4]
                }
                rows[-1]["cores_used"] = _median([sum(r[4].values()) / r[0] for r in results])
                rows[-1]["stack_cores"] = _median(
                    [  # 0 offline: it has no stack
                        sum(v for k, v in r[4].items() if k != "engine") / r[0] for r in results
                    ]
                )
                rows[-1].update({f"engine_{k}": _median([r[5][k] for r in results])
                                 for k in ENGINE_COUNTERS})  # fmt: skip
    finally:
        for srv in set(servers.values()):
            srv.stop()
    result["load_after"] = os.getloadavg()

    result["rows"] = rows
    grpc_rows = {r["concurrency"]: r for r in rows if r["path"] == "serve (gRPC)"}
    offline_rows = {r["concurrency"]: r for r in rows if r["path"].startswith("offline")}
    for r in rows:
        g = grpc_rows.get(r["concurrency"])
        if g is not None and r is not g and r["path"].startswith("serve"):
            r["tok_s_vs_grpc"] = r["output_tok_s"] / g["output_tok_s"]
        if r["path"].startswith("serve") and r["concurrency"] in offline_rows:
            r["tok_s_vs_offline"] = (
                r["output_tok_s"] / offline_rows[r["concurrency"]]["output_tok_s"]
            )
    print(f"machine: {result['machine']}; max_tokens={args.max_tokens}, greedy, ignore_eos")
    before, after = (" ".join(f"{x:.2f}" for x in result[k]) for k in ("load_before", "load_after"))
    print(f"load average (1/5/15 min) before: {before}, after: {after}")
    for key in ("startup_cold_s", "startup_warm_s"):
        if key in result:
            print(f"{key}: {result[key]:.1f}")
    width = max(22, *(len(r["path"]) + 1 for r in rows))  # --serve-flags names are long
    print(
        f"{'path':<{width}}{'conc':>6}{'reqs':>6}{'tok/s':>10}{'req/s':>8}{'TTFT p50':>10}"
        f"{'vs gRPC':>9}{'vs offline':>11}{'load':>6}  same text  steps  device s  "
        f"cores  stack  CPU us/token: {' '.join(CPU_ROLES)}"
    )
    for r in sorted(rows, key=lambda r: r["concurrency"]):
        ttft = f"{r['ttft_p50_s']:.3f}" if r["ttft_p50_s"] is not None else "-"
        ratio = f"{r['tok_s_vs_grpc']:.2f}x" if "tok_s_vs_grpc" in r else ""
        vs_off = f"{r['tok_s_vs_offline']:.2f}x" if "tok_s_vs_offline" in r else ""
        print(
            f"{r['path']:<{width}}{r['concurrency']:>6}{r['requests']:>6}{r['output_tok_s']:>10.1f}"
            f"{r['req_s']:>8.2f}{ttft:>10}{ratio:>9}{vs_off:>11}{r['load']:>6.1f}  "
            f"{r.get('texts_equal_to_served', ''):>9}  {r['engine_steps']:5.0f}  "
            f"{r['engine_device_s']:8.2f}  {r['cores_used']:5.2f}  {r['stack_cores']:5.3f}  "
            + " ".join(f"{v:.0f}" for v in r.get("cpu_us_per_token", {}).values())
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

"""Soak test: a live `jaxserve serve` (loopback only) under a mix of normal, n > 1,
cancelled, aborted, hostile and oversize requests at several concurrencies, with the
engine paused (SIGSTOP) past the stall timeout and resumed once, bounded in time.

    .venv/bin/python scripts/soak.py [--duration-s 300] [--concurrency 8,32,96]
        [--out bench_results/soak.json]

The server runs the mock engine (tests/mock_engine.py: deterministic tokens, a paged
KV-block count, 2 ms steps), so the whole frontend, sidecar and process model is under
test without a model. Checks (any failure makes the exit code 1):
- every accepted stream ends exactly once: each sample has one final response and
  nothing after it, or the call ends with a status allowed for its kind
  (RESOURCE_EXHAUSTED from admission, UNAVAILABLE while the engine is paused, ...);
- greedy outputs equal those of the idle server (the same prompts, run first);
- the frontend's and children's RSS and open descriptors end near where they began,
  and every KV block is free again at the end.
Prints one table per concurrency and a resource table, with `uptime`.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import grpc

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

from mock_engine import write_mock_model_dir  # noqa: E402
from server_harness import ServerProcess  # noqa: E402

from jaxserve.frontend.proto import jaxserve_pb2 as pb  # noqa: E402
from jaxserve.frontend.proto import jaxserve_pb2_grpc as pb_grpc  # noqa: E402
from jaxserve.sampling_params import MAX_STOP_STRINGS, MAX_STOP_TOTAL_BYTES  # noqa: E402

STALL_TIMEOUT_S = 2.0
PAUSE_S = 4.0  # past the stall timeout: health drops, open streams end UNAVAILABLE
GREEDY_PROMPTS = [[10 + i, 20 + i, 30] for i in range(16)]
KINDS = ["normal", "normal", "normal", "n3", "cancel", "abort", "hostile", "oversize"]
# Statuses a call of each kind may end with besides a clean finish.
ALLOWED = {grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE}


def _req(prompt, max_tokens, **kw) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=list(prompt)), max_tokens=max_tokens, return_token_ids=True,
        sampling=kw.pop("sampling", pb.SamplingParams(temperature=0.0)), **kw,
    )  # fmt: skip


class Stats:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.outcomes: Counter = Counter()
        self.failures: list[str] = []
        self.ttft: list[float] = []
        self.itl: list[float] = []

    def add(self, outcome: str, failure: str | None = None) -> None:
        with self.lock:
            self.outcomes[outcome] += 1
            if failure:
                self.failures.append(failure)


def _consume(call, n: int, stats: Stats, start: float, cancel_after: int | None = None):
    """Read a stream; check each sample finishes exactly once. Returns tokens per sample
    or None when the call ended with a status (recorded)."""
    finals: Counter = Counter()
    tokens: dict[int, list[int]] = {i: [] for i in range(n)}
    last = None
    got = 0
    for resp in call:
        now = time.monotonic()
        if finals[resp.index]:
            stats.add("fail", f"response after the final of sample {resp.index}")
            return None
        if resp.token_ids:
            with stats.lock:
                if last is None:
                    stats.ttft.append(now - start)
                else:
                    stats.itl.append((now - last) / len(resp.token_ids))
            last = now
        tokens[resp.index].extend(resp.token_ids)
        if resp.finish_reason:
            finals[resp.index] += 1
        got += 1
        if cancel_after is not None and got >= cancel_after:
            call.cancel()
            return "cancelled"
    if any(finals[i] != 1 for i in range(n)):
        stats.add("fail", f"finals per sample {dict(finals)} for n={n}")
        return None
    return tokens


def _one(kind: str, stub, rng: random.Random, stats: Stats, reference, serial: int):
    start = time.monotonic()
    rid = f"soak-{serial}"
    try:
        if kind == "normal":
            i = rng.randrange(len(GREEDY_PROMPTS))
            toks = _consume(stub.Generate(_req(GREEDY_PROMPTS[i], 32), timeout=60), 1, stats,
                            start)  # fmt: skip
            if toks is not None:
                ok = toks[0] == reference[i]
                stats.add("ok" if ok else "fail", None if ok else f"greedy mismatch prompt {i}")
        elif kind == "n3":
            s = pb.SamplingParams(n=3, seed=serial, temperature=1.0)
            toks = _consume(stub.Generate(_req([7, serial % 400], 24, sampling=s), timeout=60),
                            3, stats, start)  # fmt: skip
            if toks is not None:
                stats.add("ok")
        elif kind == "cancel":
            call = stub.Generate(_req([8, serial % 400], 500, request_id=rid), timeout=60)
            if _consume(call, 1, stats, start, cancel_after=2) is not None:
                stats.add("cancelled")
        elif kind == "abort":
            call = stub.Generate(_req([9, serial % 400], 500, request_id=rid), timeout=60)
            first = next(call)
            stub.Abort(pb.AbortRequest(request_id=rid), timeout=10)
            finals = 1 if first.finish_reason else 0
            reason = first.finish_reason
            for resp in call:
                finals += bool(resp.finish_reason)
                reason = resp.finish_reason or reason
            ok = finals == 1 and reason in ("abort", "length")
            stats.add("aborted" if ok else "fail", None if ok else f"abort: {finals} finals")
        elif kind == "hostile":
            per = MAX_STOP_TOTAL_BYTES // MAX_STOP_STRINGS
            stops = [("a" * (per - 3)) + f"{i:03d}" for i in range(MAX_STOP_STRINGS)]
            toks = _consume(stub.Generate(_req([11, serial % 400], 200, stop=stops),
                                          timeout=60), 1, stats, start)  # fmt: skip
            if toks is not None:
                stats.add("ok")
        elif kind == "oversize":
            which = serial % 3
            if which == 0:
                req = _req([5], 4, stop=["s"] * (MAX_STOP_STRINGS + 1))
            elif which == 1:
                req = _req([5] * 5000, 4)  # longer than the mock's max_model_len
            else:
                req = _req([5], 4, stop_token_ids=[6] * 10_000)
            try:
                list(stub.Generate(req, timeout=30))
                stats.add("fail", f"oversize request {which} was accepted")
            except grpc.RpcError as e:
                if e.code() in ALLOWED:  # refused before it was read (paused engine)
                    stats.add(e.code().name.lower())
                    return
                ok = e.code() == grpc.StatusCode.INVALID_ARGUMENT
                stats.add("invalid" if ok else "fail", None if ok else f"oversize: {e.code()}")
    except grpc.RpcError as e:
        code = e.code()
        if code in ALLOWED:
            stats.add(code.name.lower())
            time.sleep(0.05)  # a client backs off before it retries
        else:
            stats.add("fail", f"{kind}: {code.name}: {e.details()}")


def _proc_usage(pids: list[int]) -> dict[int, tuple[float, int]]:
    out = {}
    for pid in pids:
        try:
            rss = next(
                int(line.split()[1]) / 1024
                for line in open(f"/proc/{pid}/status")
                if line.startswith("VmRSS:")
            )
            out[pid] = (rss, len(os.listdir(f"/proc/{pid}/fd")))
        except OSError:
            out[pid] = (0.0, 0)
    return out


def _server_info(stub) -> pb.ServerInfo:
    return stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10)


def _wait_idle(stub, timeout: float) -> pb.ServerInfo:
    deadline = time.monotonic() + timeout
    while True:
        try:
            info = _server_info(stub)
            if (info.num_running, info.num_waiting) == (0, 0) and (
                info.kv_blocks_free == info.kv_blocks_total
            ):
                return info
        except grpc.RpcError:
            pass
        if time.monotonic() > deadline:
            return _server_info(stub)
        time.sleep(0.1)


def run_phase(target: str, concurrency: int, seconds: float, reference, pause_engine=None):
    stats = Stats()
    stop = threading.Event()
    serial = iter(range(10**9))
    lock = threading.Lock()

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        with grpc.insecure_channel(target) as channel:
            stub = pb_grpc.JaxserveStub(channel)
            while not stop.is_set():
                with lock:
                    n = next(serial)
                _one(rng.choice(KINDS), stub, rng, stats, reference, concurrency * 10**7 + n)

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(concurrency)]
    for t in threads:
        t.start()
    if pause_engine is not None:
        time.sleep(seconds / 3)
        pause_engine()
        time.sleep(max(0.0, seconds * 2 / 3 - PAUSE_S))
    else:
        time.sleep(seconds)
    stop.set()
    for t in threads:
        t.join(120)
    return stats


def _pct(values, q):
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration-s", type=float, default=300.0)
    parser.add_argument("--concurrency", default="8,32,96")
    parser.add_argument("--out", default="bench_results/soak.json")
    args = parser.parse_args()
    levels = [int(x) for x in args.concurrency.split(",")]
    model_dir = write_mock_model_dir(Path(tempfile.mkdtemp(prefix="soak-")) / "mock")
    server = ServerProcess(
        model_dir,
        extra_args=("--num-blocks", "1024", "--block-size", "16", "--max-num-seqs", "64",
                    "--engine-class", "mock_engine:MockEngineCore",
                    "--stall-timeout-s", str(STALL_TIMEOUT_S),
                    "--max-pending-requests", "256"),
        env={"JAXSERVE_MOCK_STEP_DELAY_S": "0.002"},
    ).wait_ready()  # fmt: skip
    failures: list[str] = []
    try:
        target = server.target
        pids = [server.proc.pid, *server.children]
        names = {server.proc.pid: "frontend"}
        for pid in server.children:
            cmdline = ServerProcess._cmdline(pid)
            names[pid] = "engine" if "engine.process" in cmdline else "detokenizer"
        with grpc.insecure_channel(target) as channel:
            stub = pb_grpc.JaxserveStub(channel)
            reference = []
            for prompt in GREEDY_PROMPTS:  # the idle server's greedy outputs
                out = list(stub.Generate(_req(prompt, 32), timeout=60))
                reference.append([t for r in out for t in r.token_ids])
            # Warm-up, then the baseline of RSS and descriptors.
            run_phase(target, 8, 3.0, reference)
            _wait_idle(stub, 30)
            before = _proc_usage(pids)
            info_before = _server_info(stub)
            engine_pid = server.child("jaxserve.engine.process")

            def pause():
                os.kill(engine_pid, signal.SIGSTOP)
                time.sleep(PAUSE_S)
                os.kill(engine_pid, signal.SIGCONT)

            phases = []
            per_phase = args.duration_s / len(levels)
            for i, c in enumerate(levels):
                stats = run_phase(
                    target, c, per_phase, reference, pause if i == len(levels) // 2 else None
                )
                phases.append((c, stats))
                failures += [f"c={c}: {f}" for f in stats.failures]
            info_after = _wait_idle(stub, 30)
            time.sleep(2.0)  # the frontend's memory trim after the last burst
            after = _proc_usage(pids)
    finally:
        server.kill()

    uptime = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    print(f"uptime: {uptime}")
    print(f"duration {args.duration_s:.0f} s, engine paused {PAUSE_S:g} s once "
          f"(stall timeout {STALL_TIMEOUT_S:g} s) in the phase of concurrency "
          f"{levels[len(levels) // 2]}\n")  # fmt: skip
    cols = ["ok", "cancelled", "aborted", "invalid", "resource_exhausted", "unavailable", "fail"]
    print(
        "| concurrency | requests | " + " | ".join(cols) + " | TTFT p50/p99 ms | ITL p50/p99 ms |"
    )
    print("|---:|---:|" + "---:|" * len(cols) + "---:|---:|")
    result = {"uptime": uptime, "duration_s": args.duration_s, "phases": []}
    for c, st in phases:
        total = sum(st.outcomes.values())
        ttft = f"{_pct(st.ttft, 0.5) * 1e3:.1f}/{_pct(st.ttft, 0.99) * 1e3:.1f}"
        itl = f"{_pct(st.itl, 0.5) * 1e3:.2f}/{_pct(st.itl, 0.99) * 1e3:.2f}"
        print(f"| {c} | {total} | " + " | ".join(str(st.outcomes[k]) for k in cols)
              + f" | {ttft} | {itl} |")  # fmt: skip
        result["phases"].append(
            {
                "concurrency": c,
                "outcomes": dict(st.outcomes),
                "ttft_p50_s": _pct(st.ttft, 0.5),
                "itl_p50_s": _pct(st.itl, 0.5),
                "itl_mean_s": statistics.fmean(st.itl) if st.itl else None,
            }
        )
    print("\n| process | RSS before MiB | RSS after MiB | FDs before | FDs after |")
    print("|---|---:|---:|---:|---:|")
    resources = {}
    for pid in pids:
        (rb, fb), (ra, fa) = before[pid], after[pid]
        print(f"| {names.get(pid, pid)} | {rb:.0f} | {ra:.0f} | {fb} | {fa} |")
        resources[names.get(pid, str(pid))] = {"rss_before_mib": rb, "rss_after_mib": ra,
                                               "fds_before": fb, "fds_after": fa}  # fmt: skip
        if ra > rb * 1.5 + 50:
            failures.append(f"{names.get(pid)} RSS grew {rb:.0f} -> {ra:.0f} MiB")
        if fa > fb + 8:
            failures.append(f"{names.get(pid)} descriptors grew {fb} -> {fa}")
    print(f"\nKV blocks free: before {info_before.kv_blocks_free}/{info_before.kv_blocks_total}, "
          f"after {info_after.kv_blocks_free}/{info_after.kv_blocks_total}")  # fmt: skip
    if info_after.kv_blocks_free != info_after.kv_blocks_total or info_after.num_running:
        failures.append(f"not idle at the end: {info_after}")
    result["resources"] = resources
    result["failures"] = failures
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"\nfailures: {len(failures)}")
    for f in failures[:20]:
        print("  " + f)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

"""CPU use of an idle `jaxserve serve` (frontend, engine, sidecar) and the TTFT of a
request that arrives after the idle time, for one or more source trees, interleaved.

    flock /tmp/jaxserve_bench.lock python scripts/bench_idle_cpu.py \
        --tree /path/to/base --tree /path/to/change --rounds 3 --window 60

Each round starts the server of each tree in turn (`python -m jaxserve serve` with
PYTHONPATH=tree, free ports), waits until the background compilation of step shapes has
finished (the "all N step shapes compiled" log line) and `--settle` seconds more, then
reads each process's time on a CPU (/proc/PID/task/*/schedstat, to the nanosecond)
over `--window` seconds of idleness, and prints it as percent of one core (the
`*_ticks` columns: the same from utime + stime, what `ps` and `top` show, which charge
whole clock ticks). Then it sends
`--ttft-requests` gRPC requests (each after `--ttft-gap` seconds of idleness) and records
the time to the first streamed token. The table ends with each tree's medians and, with
two trees, the ratios of the second to the first; `uptime` is printed beside them.
`--cache-root DIR` runs with JAXSERVE_CACHE_ROOT=DIR (an empty one: a cold start) and
then also prints the CPU seconds each process spent from start until warm-up ended.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_process import ServeProcess, free_port  # noqa: E402

_HZ = os.sysconf("SC_CLK_TCK")
_ROLES = ("frontend", "engine", "sidecar")


def _cpu_s(pid: int) -> float:
    """CPU seconds (user + system, all threads, the exited ones too) of process `pid` so
    far, in clock ticks: a thread running at a tick is charged the whole tick."""
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _HZ


def _run_s(pid: int) -> float:
    """Seconds on a CPU of the live threads of process `pid` so far, to the nanosecond
    (/proc/PID/task/TID/schedstat). The idle windows use it: an idle process wakes on
    timers, which fire at clock ticks, so the tick accounting of `_cpu_s` charges it
    whole ticks for microseconds of work (see the two columns)."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            total += int(open(f"/proc/{pid}/task/{tid}/schedstat").read().split()[0])
        except (OSError, ValueError, IndexError):
            pass  # the thread ended
    return total / 1e9


def _roles(pid: int) -> dict[str, int]:
    """The pids of the serve process (frontend) and its engine and sidecar children."""
    out = {"frontend": pid}
    children = open(f"/proc/{pid}/task/{pid}/children").read().split()
    for child in map(int, children):
        cmdline = open(f"/proc/{child}/cmdline").read()
        if "jaxserve.engine.process" in cmdline:
            out["engine"] = child
        elif "detokenizer_process" in cmdline:
            out["sidecar"] = child
    return out


def _ttft_s(port: int, prompt: str) -> float:
    """Seconds from sending one greedy request to its first streamed token."""
    from jaxserve.frontend.client import JaxserveClient  # noqa: PLC0415

    with JaxserveClient(f"127.0.0.1:{port}") as client:
        client.wait_until_serving(60)
        start = time.perf_counter()
        for delta in client.generate(prompt, max_tokens=8, temperature=0.0, timeout=60):
            if delta.text or delta.token_ids:
                return time.perf_counter() - start
    raise RuntimeError("the stream ended without a token")


def run_one(tree: str, args: argparse.Namespace) -> dict[str, float]:
    """One server of `tree`: idle CPU % per process, warm-up CPU s, median TTFT (ms)."""
    env = dict(os.environ, PYTHONPATH=tree)
    if args.cache_root:
        env["JAXSERVE_CACHE_ROOT"] = args.cache_root
    port = free_port()
    cmd = [sys.executable, "-m", "jaxserve", "serve", "--port", str(port)]
    cmd += ["--http-port", str(free_port()), "--metrics-port", str(free_port())]
    cmd += args.serve_args
    warm = {"done": False}

    class _Serve(ServeProcess):
        def on_line(self, line: str) -> None:
            if "step shapes compiled" in line:
                warm["done"] = True

    started = time.monotonic()
    # cwd too: `python -m` puts the working folder ahead of PYTHONPATH on sys.path.
    server = _Serve(cmd, stdout=subprocess.DEVNULL, env=env, cwd=tree)
    try:
        if not server.ready.wait(args.ready_timeout):
            raise RuntimeError("not ready:\n" + "".join(server.log[-20:]))
        deadline = time.monotonic() + args.ready_timeout
        while not warm["done"] and time.monotonic() < deadline:
            time.sleep(0.5)
        pids = _roles(server.proc.pid)
        # The demo model's path comes from the jaxserve imported: this tree's, not another.
        if str(Path(tree).resolve()) not in open(f"/proc/{pids['engine']}/cmdline").read():
            raise RuntimeError(f"the engine did not import jaxserve from {tree}")
        row = {f"warmup_{r}_s": _cpu_s(p) for r, p in pids.items()}
        row["warmup_wall_s"] = time.monotonic() - started
        time.sleep(args.settle)
        before = {r: (_run_s(p), _cpu_s(p)) for r, p in pids.items()}
        time.sleep(args.window)
        for r, p in pids.items():
            row[r] = 100 * (_run_s(p) - before[r][0]) / args.window
            row[f"{r}_ticks"] = 100 * (_cpu_s(p) - before[r][1]) / args.window
        ttfts = []
        for _ in range(args.ttft_requests):
            time.sleep(args.ttft_gap)
            ttfts.append(_ttft_s(port, args.prompt))
        row["ttft_ms"] = 1000 * statistics.median(ttfts)
        return row
    finally:
        server.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tree", action="append", required=True, help="a source tree (repeat)")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--window", type=float, default=60.0, help="idle seconds measured")
    p.add_argument("--settle", type=float, default=10.0, help="seconds after warm-up")
    p.add_argument("--ttft-requests", type=int, default=3)
    p.add_argument("--ttft-gap", type=float, default=5.0, help="idle seconds before each")
    p.add_argument("--prompt", default="def open(")
    p.add_argument("--ready-timeout", type=float, default=900.0)
    p.add_argument("--cache-root", default=None, help="JAXSERVE_CACHE_ROOT for the servers")
    p.add_argument("serve_args", nargs="*", help="more `jaxserve serve` flags (after --)")
    args = p.parse_args()
    rows: dict[str, list[dict[str, float]]] = {t: [] for t in args.tree}
    cols = [*_ROLES, *(f"{r}_ticks" for r in _ROLES), "ttft_ms"]
    if args.cache_root:  # CPU seconds from start to the end of warm-up, and its wall time
        cols += [f"warmup_{r}_s" for r in _ROLES] + ["warmup_wall_s"]
    print(f"{'tree':40s} {'round':>5s} " + " ".join(f"{c:>17s}" for c in cols), flush=True)
    for rnd in range(args.rounds):
        for tree in args.tree:
            row = run_one(tree, args)
            rows[tree].append(row)
            vals = " ".join(f"{row.get(c, float('nan')):17.2f}" for c in cols)
            print(f"{tree[-40:]:40s} {rnd:5d} {vals}", flush=True)
    print("medians (CPU % of one core over the idle window; TTFT ms):")
    medians = {t: {c: statistics.median(r[c] for r in rs) for c in cols} for t, rs in rows.items()}
    for tree, med in medians.items():
        print(f"{tree[-40:]:40s} {'':5s} " + " ".join(f"{med[c]:17.2f}" for c in cols))
    if len(args.tree) == 2:
        a, b = (medians[t] for t in args.tree)
        ratios = " ".join(f"{(b[c] / a[c] if a[c] else float('nan')):17.2f}" for c in cols)
        print(f"{'ratio second/first':40s} {'':5s} {ratios}")
    print(subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())


if __name__ == "__main__":
    main()

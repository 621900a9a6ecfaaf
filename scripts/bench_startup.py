"""Start-up time of `jaxserve serve`: seconds from the command to the first streamed token,
cold (an empty JAX compilation cache) and warm (the same cache, filled by the cold run),
for the demo model on one device and on a dp=2,tp=2 mesh of emulated CPU devices.

    python scripts/bench_startup.py [--model DIR] [--meshes dp=1,tp=1 dp=2,tp=2]
                                    [--repeats 1] [--out bench_results/startup.json]

Each start also records when gRPC listened and when the engine was ready (from the
log), so the table splits the time into frontend start, engine start (weights and
compilation) and the first request. Each repeat uses a fresh temporary compilation
cache, removed afterwards; with --repeats > 1 the table shows medians. The machine load
(`os.getloadavg`) is printed beside the numbers, before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def start_to_first_token(model: str | None, mesh: str, cache_dir: str) -> dict[str, float]:
    """One `jaxserve serve` start: seconds to gRPC listening, engine ready, first token."""
    from jaxserve.frontend.client import JaxserveClient

    port = _free_port()
    cmd = [sys.executable, "-m", "jaxserve.cli", "serve", "--port", str(port), "--mesh", mesh]
    cmd += ["--compilation-cache-dir", cache_dir, "--disable-log-stats"]
    if model:
        cmd.append(model)
    dp, tp = (int(p.split("=")[1]) for p in mesh.split(","))
    env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
    if dp * tp > 1 and env["JAX_PLATFORMS"] == "cpu":
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={dp * tp}"
    marks: dict[str, float] = {}
    ready = threading.Event()
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                            env=env)  # fmt: skip
    log: list[str] = []

    def read() -> None:
        for line in proc.stderr:
            log.append(line)
            if "gRPC listening" in line:
                marks.setdefault("listening_s", time.perf_counter() - t0)
            if re.search(r"jaxserve ready", line):
                marks["ready_s"] = time.perf_counter() - t0
                ready.set()

    threading.Thread(target=read, daemon=True).start()
    try:
        if not ready.wait(1800):
            raise RuntimeError("server did not become ready:\n" + "".join(log[-30:]))
        with JaxserveClient(f"127.0.0.1:{port}") as client:
            for delta in client.generate("import ", max_tokens=1, temperature=0):
                if delta.token_ids or delta.text or delta.finish_reason:
                    marks["first_token_s"] = time.perf_counter() - t0
                    break
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
    return marks


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", help="model folder or id (default: the bundled demo model)")
    ap.add_argument("--meshes", nargs="+", default=["dp=1,tp=1", "dp=2,tp=2"])
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--out", default="bench_results/startup.json")
    args = ap.parse_args()
    machine = f"{platform.machine()} x{os.cpu_count()} cores, Python {platform.python_version()}"
    load_before = _load()
    runs: dict[tuple[str, str], list[dict[str, float]]] = {}
    for _ in range(args.repeats):
        for mesh in args.meshes:
            cache = tempfile.mkdtemp(prefix="jaxserve-bench-startup-")
            try:
                for kind in ("cold", "warm"):  # warm reuses the cache the cold run filled
                    runs.setdefault((mesh, kind), []).append(
                        start_to_first_token(args.model, mesh, cache)
                    )
            finally:
                shutil.rmtree(cache, ignore_errors=True)
    load_after = _load()

    rows = []
    for (mesh, kind), marks in runs.items():
        med = {k: statistics.median(m[k] for m in marks) for k in marks[0]}
        rows.append({"mesh": mesh, "cache": kind, "repeats": len(marks), **med})
    print(f"machine: {machine}; load average before {load_before}, after {load_after}")
    print(f"model: {args.model or 'demo'}; medians of {args.repeats} run(s), seconds from start")
    print(f"{'mesh':<12}{'cache':<7}{'gRPC up':>9}{'engine ready':>14}{'first token':>13}")
    for r in rows:
        print(
            f"{r['mesh']:<12}{r['cache']:<7}{r.get('listening_s', float('nan')):>9.1f}"
            f"{r['ready_s']:>14.1f}{r['first_token_s']:>13.1f}"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {
        "machine": machine, "load_before": load_before, "load_after": load_after,
        "model": args.model or "demo", "rows": rows,
    }  # fmt: skip
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

"""Start-up time of `jaxserve serve`: seconds from the command to the first streamed token,
cold (an empty JAX compilation cache) and warm (the same cache, filled by the cold run),
for the demo model on one device and on a dp=2,tp=2 mesh of emulated CPU devices.

    python scripts/bench_startup.py [--model DIR] [--meshes dp=1,tp=1 dp=2,tp=2]
                                    [--repeats 1] [--out bench_results/startup.json]
                                    [--baseline-src DIR] [--no-wait-background]

Each start also records (from the log) when gRPC listened, when the weights were
loaded, when the engine was ready and, with background compilation, when the last step
shape was compiled ("all compiled": the full step budget; the server is kept running
until then unless --no-wait-background), so the table splits the time into frontend
start, weight loading, compilation and the first request. Each repeat uses a fresh
temporary compilation cache, removed afterwards; with --repeats > 1 the table shows
medians. The machine load (`os.getloadavg`) is printed beside the numbers, before and
after.

--baseline-src DIR: also start the jaxserve source tree in DIR (e.g. `git archive main |
tar -x -C DIR`), on PYTHONPATH, interleaved with this one (for each mesh: baseline cold,
baseline warm, this tree cold, this tree warm), for an A/B on one machine state.
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


def start_to_first_token(
    model: str | None,
    mesh: str,
    cache_dir: str,
    src: str | None = None,
    wait_background: bool = True,
) -> dict[str, float]:
    """One `jaxserve serve` start: seconds to gRPC listening, weights loaded, engine
    ready, first token and (background compilation) every shape compiled. src: a
    jaxserve source tree to run instead of the installed one."""
    from jaxserve.frontend.client import JaxserveClient

    port = _free_port()
    cmd = [sys.executable, "-m", "jaxserve.cli", "serve", "--port", str(port), "--mesh", mesh]
    cmd += ["--compilation-cache-dir", cache_dir, "--disable-log-stats"]
    if model:
        cmd.append(model)
    dp, tp = (int(p.split("=")[1]) for p in mesh.split(","))
    # Lines as they come (serve holds a start's INFO lines back otherwise): the marks
    # below time their arrival.
    env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu"),
           "JAXSERVE_START_LOG_HOLD_S": "0"}  # fmt: skip
    if src:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [src, env.get("PYTHONPATH")]))
    if dp * tp > 1 and env["JAX_PLATFORMS"] == "cpu":
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={dp * tp}"
    marks: dict[str, float] = {}
    ready = threading.Event()
    all_compiled = threading.Event()
    t0 = time.perf_counter()
    # `python -m` puts the working directory first on sys.path: run a baseline tree from
    # its own folder, or this checkout's jaxserve/ would shadow it.
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                            env=env, cwd=src or None)  # fmt: skip
    log: list[str] = []

    def read() -> None:
        for line in proc.stderr:
            log.append(line)
            now = time.perf_counter() - t0
            if "gRPC listening" in line:
                marks.setdefault("listening_s", now)
            if re.search(r"loading weights.*\(100%", line):
                marks.setdefault("weights_s", now)
            if re.search(r"jaxserve ready", line):
                marks["ready_s"] = now
                ready.set()
            if re.search(r"all \d+ step shapes compiled", line):
                marks["all_compiled_s"] = now
                all_compiled.set()

    threading.Thread(target=read, daemon=True).start()
    try:
        if not ready.wait(1800):
            raise RuntimeError("server did not become ready:\n" + "".join(log[-30:]))
        with JaxserveClient(f"127.0.0.1:{port}") as client:
            for delta in client.generate("import ", max_tokens=1, temperature=0):
                if delta.token_ids or delta.text or delta.finish_reason:
                    marks["first_token_s"] = time.perf_counter() - t0
                    break
        background = any("compile in the" in line and "background" in line for line in log)
        if not background:
            marks["all_compiled_s"] = marks["ready_s"]
        elif wait_background and all_compiled.wait(1800):
            pass
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
    ap.add_argument("--baseline-src", help="a jaxserve source tree to compare with (A/B)")
    ap.add_argument(
        "--no-wait-background",
        action="store_true",
        help="stop each server at its first token (no 'all compiled' column)",
    )
    args = ap.parse_args()
    variants = (
        [("baseline", args.baseline_src), ("this", None)] if args.baseline_src else [("this", None)]
    )
    machine = f"{platform.machine()} x{os.cpu_count()} cores, Python {platform.python_version()}"
    load_before = _load()
    runs: dict[tuple[str, str, str], list[dict[str, float]]] = {}
    for _ in range(args.repeats):
        for mesh in args.meshes:
            for name, src in variants:
                cache = tempfile.mkdtemp(prefix="jaxserve-bench-startup-")
                try:
                    for kind in ("cold", "warm"):  # warm reuses the cache the cold run filled
                        marks = start_to_first_token(
                            args.model, mesh, cache, src, not args.no_wait_background
                        )
                        print(f"# {name} {mesh} {kind}: {marks} (load {_load()})", flush=True)
                        runs.setdefault((name, mesh, kind), []).append(marks)
                finally:
                    shutil.rmtree(cache, ignore_errors=True)
    load_after = _load()

    rows = []
    for (name, mesh, kind), marks in runs.items():
        keys = set.intersection(*(set(m) for m in marks))
        med = {k: statistics.median(m[k] for m in marks) for k in sorted(keys)}
        rows.append({"tree": name, "mesh": mesh, "cache": kind, "repeats": len(marks), **med})
    print(f"machine: {machine}; load average before {load_before}, after {load_after}")
    print(f"model: {args.model or 'demo'}; medians of {args.repeats} run(s), seconds from start")
    cols = [("gRPC up", "listening_s"), ("weights", "weights_s"), ("engine ready", "ready_s"),
            ("first token", "first_token_s"), ("all compiled", "all_compiled_s")]  # fmt: skip
    print(f"{'tree':<10}{'mesh':<12}{'cache':<7}" + "".join(f"{c:>14}" for c, _ in cols))
    for r in rows:
        print(
            f"{r['tree']:<10}{r['mesh']:<12}{r['cache']:<7}"
            + "".join(f"{r.get(k, float('nan')):>14.1f}" for _, k in cols)
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

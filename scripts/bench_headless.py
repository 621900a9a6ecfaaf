"""What a headless replica over TCP costs against a local one over ipc:// (same host).

    python scripts/bench_headless.py [--requests 200] [--max-tokens 64] [--demo]

A frontend (`serve --replicas 1 --replica-listen 127.0.0.1:P`, round-robin) with one
local replica and one `jaxserve engine` over loopback TCP, on the mock engine
(tests/mock_engine.py: no model time, so the transport is what differs) or with --demo
the demo model. Requests go one at a time (round-robin: every other one to each
replica), each streaming --max-tokens greedy tokens; per replica: TTFT, the time
between streamed chunks (ITL) and end-to-end latency, p50 and p99, plus the seconds
from starting `jaxserve engine` to its replica serving. Prints a table and `uptime`,
writes bench_results/bench_headless.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

from mock_engine import write_mock_model_dir  # noqa: E402
from server_harness import DEMO_ENGINE, ServerProcess, free_port, serve_flags  # noqa: E402

from jaxserve.config import DEMO_MODEL_DIR  # noqa: E402
from jaxserve.frontend.client import JaxserveClient  # noqa: E402


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def _replicas(client) -> list[dict]:
    return sorted(client.server_info().replicas, key=lambda r: r["replica"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--demo", action="store_true", help="the demo model, not the mock")
    parser.add_argument("--out", default="bench_results/bench_headless.json")
    args = parser.parse_args()
    if args.demo:
        model, flags, env = DEMO_MODEL_DIR, serve_flags(DEMO_ENGINE), {}
    else:
        model = write_mock_model_dir(Path(tempfile.mkdtemp(prefix="bench-headless-")) / "mock")
        flags, env = ("--engine-class", "mock_engine:MockEngineCore"), {}
    listen = free_port()
    server = ServerProcess(
        model,
        extra_args=(
            *flags, "--replicas", "1", "--router-policy", "round-robin",
            "--replica-listen", f"127.0.0.1:{listen}",
        ),
        env=env, start_timeout_s=900,
    ).wait_ready()  # fmt: skip
    cmd = [
        sys.executable, "-m", "jaxserve.cli", "engine", "--model", str(model),
        "--frontend", f"127.0.0.1:{listen}", *flags,
    ]  # fmt: skip
    penv = {**os.environ, **env, "PYTHONPATH": str(REPO / "tests")}
    started = time.monotonic()
    remote = subprocess.Popen(cmd, env=penv, stderr=subprocess.DEVNULL, cwd=REPO)
    try:
        with JaxserveClient(server.target) as client:
            while not (len(rs := _replicas(client)) == 2 and rs[1]["state"] == "serving"):
                time.sleep(0.02)
            join_s = time.monotonic() - started
            times: dict[int, dict[str, list[float]]] = {
                k: {"ttft": [], "itl": [], "e2e": []} for k in (0, 1)
            }
            for i in range(args.requests + 4):  # the first 4: warm-up
                before = [r["router_decisions"] for r in _replicas(client)]
                t0 = last = time.perf_counter()
                chunk_times = []
                for _ in client.generate(
                    f"def f{i % 7}(x):", max_tokens=args.max_tokens, temperature=0,
                    ignore_eos=True,
                ):  # fmt: skip
                    now = time.perf_counter()
                    chunk_times.append(now - last)
                    last = now
                after = [r["router_decisions"] for r in _replicas(client)]
                k = next(j for j in (0, 1) if after[j] != before[j])
                if i >= 4:
                    times[k]["ttft"].append(chunk_times[0])
                    times[k]["itl"] += chunk_times[1:]
                    times[k]["e2e"].append(last - t0)
    finally:
        remote.terminate()
        remote.wait(30)
        server.terminate(30)
    load = os.getloadavg()
    rows = []
    for k, name in ((0, "local (ipc)"), (1, "headless (tcp)")):
        t = times[k]
        row = {"replica": name, "requests": len(t["e2e"])}
        for key in ("ttft", "itl", "e2e"):
            row[f"{key}_p50_ms"] = 1e3 * statistics.median(t[key])
            row[f"{key}_p99_ms"] = 1e3 * _pct(t[key], 0.99)
        rows.append(row)
    print(f"model: {'demo' if args.demo else 'mock engine'}, {args.max_tokens} tokens per request")
    cols = ["replica", "requests"] + [
        f"{m}_{q}_ms" for m in ("ttft", "itl", "e2e") for q in ("p50", "p99")
    ]
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for row in rows:
        print("| " + " | ".join(
            f"{row[c]:.2f}" if isinstance(row[c], float) else str(row[c]) for c in cols
        ) + " |")  # fmt: skip
    print(f"headless replica: started to serving in {join_s:.2f} s")
    uptime = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    print(uptime)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(
        json.dumps(
            {"args": vars(args), "rows": rows, "join_s": join_s, "loadavg": load, "uptime": uptime},
            indent=1,
        )  # fmt: skip
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

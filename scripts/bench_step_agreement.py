"""The per-step agreement between processes (issue 16 item 4): process 0 publishes each
step's packed host inputs on the step channel (the same serialised bytes written to each
follower's TCP connection), the others receive them. Measured alone (no JAX) at 2, 4 and
8 processes on one machine:

    .venv/bin/python scripts/bench_step_agreement.py --steps 1000 [--processes 2 4 8]
        [--blocks-per-row 256]

Per step the agreement latency is the slowest follower's transit (the leader's send ->
that follower has the arrays unpacked; one machine, so one clock); printed as p50 / p90 /
p99 with a single follower's p50, the leader's publish time and the bytes per step, in a
table, and written to bench_results/step_agreement.json with `uptime` (the numbers
mean little on a loaded machine: every process needs a core to receive).
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

# A step's host inputs as the engine packs them: token/request buckets, block-table width.
STEP_TOKENS, STEP_ROWS, BLOCKS_PER_ROW = 64, 64, 256


def _step_host_inputs(step: int, blocks_per_row: int = BLOCKS_PER_ROW) -> list[np.ndarray]:
    """Arrays shaped like one engine step's packed inputs (~70 KB)."""
    rng = np.random.default_rng(step)
    return [
        rng.integers(0, 32000, STEP_TOKENS, dtype=np.int32),  # token ids
        np.arange(STEP_TOKENS, dtype=np.int32),  # positions
        np.arange(STEP_TOKENS, dtype=np.int32),  # slot mapping
        rng.integers(0, 4096, (STEP_ROWS, blocks_per_row), dtype=np.int32),  # block tables
        np.full(STEP_ROWS, 100, np.int32),  # seq lens
        np.arange(STEP_ROWS + 1, dtype=np.int32),  # query start loc
        np.arange(STEP_TOKENS, dtype=np.int32) % STEP_ROWS,  # token -> row
        rng.random((STEP_ROWS, 4)).astype(np.float32),  # sampling parameters
    ]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def agreement_worker(
    process_id: int, num_processes: int, port: int, steps: int, out: str, blocks: int
):
    """One process of the agreement benchmark: process 0 publishes `steps` steps of
    engine-shaped host inputs (plus 20 warm-up steps), 1 ms apart; the others receive
    them and write their per-step transit (leader's send -> arrays unpacked)."""
    from jaxserve.distributed.step_channel import STOP, StepPublisher, StepSubscriber

    if process_id == 0:
        channel = StepPublisher("127.0.0.1", port, num_processes - 1)
        for i in range(steps + 20):
            meta = {"shape": [STEP_TOKENS, STEP_ROWS]}
            channel.publish(_step_host_inputs(i % 8, blocks), meta=meta)
            time.sleep(0.001)
        result = {"publish_s": channel.stats.samples_s[20:], "bytes": channel.bytes_sent}
        channel.close()
    else:
        channel = StepSubscriber("127.0.0.1", port, process_id)
        while channel.receive(timeout_s=120).kind != STOP:
            pass
        result = {"transit_s": channel.stats.samples_s[20:]}
        channel.close()
    Path(f"{out}.{process_id}.json").write_text(json.dumps(result))


def bench_agreement(process_counts: list[int], steps: int, blocks: int) -> list[dict]:
    """p50 / p90 / p99 of the step agreement latency (per step, the slowest follower's
    transit) and of single follower transits, and the leader's publish time."""
    rows = []
    for num_processes in process_counts:
        with tempfile.TemporaryDirectory() as tmp:
            out = str(Path(tmp) / "agreement")
            port = _free_port()
            cmd = [sys.executable, __file__, "--agreement-worker", str(num_processes), str(port)]
            cmd += ["--steps", str(steps), "--out", out, "--blocks-per-row", str(blocks)]
            procs = [subprocess.Popen([*cmd, "--process-id", str(i)]) for i in range(num_processes)]
            for p in procs:
                if p.wait(timeout=600) != 0:
                    raise RuntimeError(f"agreement worker failed with {p.returncode}")
            results = [
                json.loads(Path(f"{out}.{i}.json").read_text()) for i in range(num_processes)
            ]
        transit = np.array([r["transit_s"] for r in results[1:]])  # [followers, steps]
        agreement = transit.max(axis=0)
        row = {
            "processes": num_processes,
            "agreement_p50_us": 1e6 * float(np.median(agreement)),
            "agreement_p90_us": 1e6 * float(np.percentile(agreement, 90)),
            "agreement_p99_us": 1e6 * float(np.percentile(agreement, 99)),
            "transit_p50_us": 1e6 * float(np.median(transit)),
            "publish_p50_us": 1e6 * float(np.median(results[0]["publish_s"])),
            "bytes_per_step": results[0]["bytes"] / (steps + 20),
        }
        rows.append(row)
        print(row, flush=True)
    return rows


def print_agreement(rows: list[dict]) -> None:
    print(
        "\n| processes | agreement p50 us | p90 us | p99 us | follower transit p50 us "
        "| leader publish p50 us | bytes/step |"
    )
    print("|---" * 7 + "|")
    for r in rows:
        print(
            f"| {r['processes']} | {r['agreement_p50_us']:.0f} | {r['agreement_p90_us']:.0f} "
            f"| {r['agreement_p99_us']:.0f} "
            f"| {r['transit_p50_us']:.0f} | {r['publish_p50_us']:.0f} "
            f"| {r['bytes_per_step']:.0f} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument(
        "--blocks-per-row", type=int, default=BLOCKS_PER_ROW,
        help="block-table width of the step's inputs (the bytes per step; 4: ~3.7 KB)",
    )  # fmt: skip
    parser.add_argument("--json", default="bench_results/step_agreement.json")
    parser.add_argument("--agreement-worker", type=int, nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--process-id", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.agreement_worker:
        num_processes, port = args.agreement_worker
        agreement_worker(
            args.process_id, num_processes, port, args.steps, args.out, args.blocks_per_row
        )
        return
    uptime = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    print(f"uptime: {uptime}")
    rows = bench_agreement(args.processes, args.steps, args.blocks_per_row)
    print_agreement(rows)
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"uptime": uptime, "rows": rows}, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

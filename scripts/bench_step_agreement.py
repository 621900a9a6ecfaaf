"""The per-step agreement between processes (issue 16 item 4): process 0 publishes each
step's packed host inputs on the step channel, the others receive them. Measured alone
(no JAX) at 2, 4 and 8 processes on one machine, over both transports of the channel:
`shm` (the followers on the leader's host read a shared-memory ring, the default) and
`tcp` (each follower's TCP connection, `JAXSERVE_STEP_TRANSPORT=tcp`), interleaved: the
steps of each configuration are split into `--rounds` runs, and the rounds alternate the
transports, so that a change in the machine's load touches both alike.

    .venv/bin/python scripts/bench_step_agreement.py --steps 1000 [--processes 2 4 8]
        [--transports shm tcp shm-spin50] [--rounds 4] [--blocks-per-row 256]

Per step the agreement latency is the slowest follower's transit (the leader's send ->
that follower has the arrays unpacked; one machine, so one clock); printed as p50 / p90 /
p99 with a single follower's p50, the leader's publish time and the bytes per step, in a
table, and written to bench_results/step_agreement.json with `uptime` (the numbers
mean little on a loaded machine: every process needs a core to receive).
"""

from __future__ import annotations

import argparse
import json
import os
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
    import jaxserve
    from jaxserve.distributed.step_channel import StepPublisher, StepSubscriber
    from jaxserve.distributed.step_message import STOP

    if process_id == 0:
        channel = StepPublisher("127.0.0.1", port, num_processes - 1)
        on_shm = channel.shm_followers
        for i in range(steps + 20):
            meta = {"shape": [STEP_TOKENS, STEP_ROWS]}
            channel.publish(_step_host_inputs(i % 8, blocks), meta=meta)
            time.sleep(0.001)
        result = {
            "publish_s": channel.stats.samples_s[20:],
            "bytes": channel.bytes_sent,
            "shm_followers": on_shm,
            "jaxserve": jaxserve.__file__,
        }
        channel.close()
    else:
        channel = StepSubscriber("127.0.0.1", port, process_id)
        while channel.receive(timeout_s=120).kind != STOP:
            pass
        result = {"transit_s": channel.stats.samples_s[20:]}
        channel.close()
    Path(f"{out}.{process_id}.json").write_text(json.dumps(result))


def _run_once(num_processes: int, transport: str, steps: int, blocks: int) -> list[dict]:
    """One run of the benchmark's processes; each one's result."""
    # The children import this checkout's jaxserve (not another editable install).
    root = str(Path(__file__).resolve().parents[1])
    # "shm-spinN": the ring, each reader polling N us before it sleeps on the futex.
    spin_us = transport.partition("-spin")[2] or "0"
    env = {**os.environ, "JAXSERVE_STEP_RING_SPIN_US": spin_us}
    env["JAXSERVE_STEP_TRANSPORT"] = "tcp" if transport == "tcp" else "auto"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "agreement")
        port = _free_port()
        cmd = [sys.executable, __file__, "--agreement-worker", str(num_processes), str(port)]
        cmd += ["--steps", str(steps), "--out", out, "--blocks-per-row", str(blocks)]
        procs = [
            subprocess.Popen([*cmd, "--process-id", str(i)], env=env) for i in range(num_processes)
        ]
        for p in procs:
            if p.wait(timeout=600) != 0:
                raise RuntimeError(f"agreement worker failed with {p.returncode}")
        return [json.loads(Path(f"{out}.{i}.json").read_text()) for i in range(num_processes)]


def bench_agreement(
    process_counts: list[int], transports: list[str], steps: int, blocks: int, rounds: int
) -> list[dict]:
    """p50 / p90 / p99 of the step agreement latency (per step, the slowest follower's
    transit) and of single follower transits, and the leader's publish time, per number
    of processes and transport; `rounds` interleaved runs of steps / rounds steps each."""
    runs: dict[tuple[int, str], list[list[dict]]] = {}
    per_round = max(1, steps // rounds)
    for r in range(rounds):
        for num_processes in process_counts:
            # Alternate which transport goes first, round after round.
            for transport in transports[:: 1 if r % 2 == 0 else -1]:
                results = _run_once(num_processes, transport, per_round, blocks)
                want_shm = 0 if transport == "tcp" else num_processes - 1
                if results[0]["shm_followers"] != want_shm:
                    raise RuntimeError(f"{transport}: {results[0]['shm_followers']} on shm")
                runs.setdefault((num_processes, transport), []).append(results)
    print(f"children imported {runs[next(iter(runs))][0][0]['jaxserve']}")
    rows = []
    for (num_processes, transport), results_list in runs.items():
        # [followers, steps] over the rounds, and the leader's publish times.
        transit = np.concatenate(
            [np.array([r["transit_s"] for r in results[1:]]) for results in results_list],
            axis=1,
        )
        publish = np.concatenate([results[0]["publish_s"] for results in results_list])
        sent = sum(results[0]["bytes"] for results in results_list)
        agreement = transit.max(axis=0)
        row = {
            "processes": num_processes,
            "transport": transport,
            "agreement_p50_us": 1e6 * float(np.median(agreement)),
            "agreement_p90_us": 1e6 * float(np.percentile(agreement, 90)),
            "agreement_p99_us": 1e6 * float(np.percentile(agreement, 99)),
            "transit_p50_us": 1e6 * float(np.median(transit)),
            "publish_p50_us": 1e6 * float(np.median(publish)),
            "publish_p99_us": 1e6 * float(np.percentile(publish, 99)),
            "bytes_per_step": sent / ((per_round + 20) * len(results_list)),
        }
        rows.append(row)
        print(row, flush=True)
    return rows


def print_agreement(rows: list[dict]) -> None:
    print(
        "\n| processes | transport | agreement p50 us | p90 us | p99 us "
        "| follower transit p50 us | leader publish p50 us | p99 us | bytes/step |"
    )
    print("|---" * 9 + "|")
    for r in sorted(rows, key=lambda r: (r["processes"], r["transport"])):
        print(
            f"| {r['processes']} | {r['transport']} | {r['agreement_p50_us']:.0f} "
            f"| {r['agreement_p90_us']:.0f} | {r['agreement_p99_us']:.0f} "
            f"| {r['transit_p50_us']:.0f} | {r['publish_p50_us']:.0f} "
            f"| {r['publish_p99_us']:.0f} | {r['bytes_per_step']:.0f} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--steps", type=int, default=1000, help="per configuration")
    parser.add_argument(
        "--transports", nargs="+", default=["shm", "tcp"],
        help="shm, tcp, or shm-spinN (ring readers poll N us before sleeping)",
    )  # fmt: skip
    parser.add_argument("--rounds", type=int, default=4, help="interleaved runs")
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
    rows = bench_agreement(
        args.processes, args.transports, args.steps, args.blocks_per_row, args.rounds
    )
    print_agreement(rows)
    after = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    print(f"uptime after: {after}")
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"uptime": uptime, "uptime_after": after, "rows": rows}, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

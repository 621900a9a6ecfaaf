"""How much a co-runner on the same host slows the offline engine, and through what.

`bench_serve.py` finds the served engine's steps slower than the offline engine's for the
same tokens. This script asks why, without a server: the offline `LLM.generate` (waves of
--concurrency greedy requests, --max-tokens each) runs alone and beside one synthetic
co-runner process, interleaved (--repeats rounds; medians and the ratio to alone):

- `alu`: a pure-Python loop (CPU time, hardly any memory: a scheduler effect only);
- `mem`: numpy copies between two 16 MiB buffers (CPU time and cache pollution: it
  evicts the engine's weights and KV from the shared L3 and its core's L2).

each at a duty cycle (busy for duty x 6 ms of every 6 ms) and a nice value, or "idle"
(SCHED_IDLE: it runs only on a CPU no other task wants, and a waking task preempts it at
once). A co-runner at nice 19 or idle gets a core only when the engine leaves one idle,
so what it still costs the
engine is not CPU time taken but caches polluted and wake-ups delayed; the serving stack
(frontend, sidecar, client) is such a co-runner.

    python scripts/bench_interference.py [--model DIR] [--concurrency 64] [--seconds 8]
        [--co-runners alu:0.3:0,mem:0.3:0,alu:1:19,mem:1:19] [--repeats 2] [--out F.json]

Prints one table (with the load average before and after); writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from jaxserve.flag_types import POSITIVE, positive_float

# The co-runner: kind, duty (fraction of each 6 ms period spent busy), nice or "idle".
CO_RUNNER = """
import os, sys, time
kind, duty, nice = sys.argv[1], float(sys.argv[2]), sys.argv[3]
if nice == "idle":
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
else:
    os.nice(int(nice))
if kind == "mem":
    import numpy as np
    a = np.ones(4 << 20, np.float32)  # 16 MiB
    b = np.empty_like(a)
period = 0.006
while True:
    t = time.perf_counter()
    while time.perf_counter() - t < duty * period:
        if kind == "mem":
            np.copyto(b, a)
        else:
            x = 0
            for i in range(2000):
                x += i
    if duty < 1:
        time.sleep(period * (1 - duty))
"""


def parse_co_runners(text: str) -> list[tuple[str, float, str]]:
    """ "alu:0.3:0,mem:1:idle" -> [("alu", 0.3, "0"), ("mem", 1.0, "idle")]. Raises
    ValueError naming the bad entry."""
    out = []
    for entry in text.split(","):
        try:
            kind, duty, nice = entry.split(":")
            duty_f = float(duty)
        except ValueError:
            raise ValueError(f"--co-runners: {entry!r} is not KIND:DUTY:NICE") from None
        nice_ok = nice == "idle" or (nice.isdigit() and int(nice) <= 19)
        if kind not in ("alu", "mem") or not 0 < duty_f <= 1 or not nice_ok:
            raise ValueError(
                f"--co-runners: {entry!r}: KIND alu|mem, DUTY in (0, 1], NICE 0-19 or idle"
            )
        out.append((kind, duty_f, nice))
    return out


def _seconds(text: str) -> float:
    """An argparse type: a finite number of seconds >= 0.1 (flag_types.positive_float)."""
    value = positive_float(text)
    if value < 0.1:
        raise argparse.ArgumentTypeError(f"must be >= 0.1, got {text}")
    return value


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", help="HF model folder (default: the bundled demo model)")
    ap.add_argument("--concurrency", type=POSITIVE, default=64, help="requests per wave")
    ap.add_argument("--max-tokens", type=POSITIVE, default=64, help="per request")
    ap.add_argument("--seconds", type=_seconds, default=8.0, help="length of each run")
    ap.add_argument(
        "--co-runners",
        default="alu:0.3:0,mem:0.3:0,alu:1:19,mem:1:19",
        help="KIND:DUTY:NICE,...: KIND alu or mem, DUTY in (0, 1], NICE 0-19 or idle (SCHED_IDLE)",
    )
    ap.add_argument("--repeats", type=POSITIVE, default=2, help="rounds (medians)")
    ap.add_argument("--out", default="bench_results/interference.json", help="JSON written")
    args = ap.parse_args()
    try:
        co_runners = parse_co_runners(args.co_runners)
    except ValueError as e:
        ap.error(str(e))

    from jaxserve import LLM, SamplingParams

    llm = (
        LLM(model=args.model, max_num_seqs=args.concurrency)
        if args.model
        else LLM(max_num_seqs=args.concurrency)
    )
    sp = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    wave = [f"def f{i}(" for i in range(args.concurrency)]
    llm.generate(wave, sp)  # warm-up: every step shape of the wave compiled

    def run() -> tuple[float, float]:
        """(output tokens/s, this process's cores) over --seconds of waves."""
        t0, cpu, tokens = time.perf_counter(), time.process_time(), 0
        while time.perf_counter() - t0 < args.seconds:
            tokens += sum(len(o.token_ids) for o in llm.generate(wave, sp))
        secs = time.perf_counter() - t0
        return tokens / secs, (time.process_time() - cpu) / secs

    labels = ["alone"] + [f"{k} duty {d:g} nice {n}" for k, d, n in co_runners]
    runs: dict[str, list[tuple[float, float]]] = {label: [] for label in labels}
    load_before = os.getloadavg()
    for _ in range(args.repeats):
        for label, co in zip(labels, [None, *co_runners], strict=True):
            proc = None
            if co is not None:
                argv = [sys.executable, "-c", CO_RUNNER, co[0], str(co[1]), str(co[2])]
                proc = subprocess.Popen(argv)
                time.sleep(0.5)  # numpy imported, buffers touched
            try:
                runs[label].append(run())
            finally:
                if proc is not None:
                    proc.kill()
                    proc.wait()
    alone = statistics.median(r[0] for r in runs["alone"])
    rows = []
    for label in labels:
        tok_s = statistics.median(r[0] for r in runs[label])
        cores = statistics.median(r[1] for r in runs[label])
        rows.append({"co_runner": label, "tok_s": tok_s, "engine_cores": cores,
                     "vs_alone": tok_s / alone, "runs": [r[0] for r in runs[label]]})  # fmt: skip
    result = {
        "machine": f"{platform.machine()} x{os.cpu_count()} cores",
        "model": args.model or "demo",
        "concurrency": args.concurrency,
        "load_before": load_before,
        "load_after": os.getloadavg(),
        "rows": rows,
    }
    print(f"{result['machine']}, model {result['model']}, waves of {args.concurrency}")
    print(f"load before {load_before[0]:.2f}, after {result['load_after'][0]:.2f}")
    print(f"{'co-runner':<24}{'tok/s':>9}{'vs alone':>10}{'engine cores':>14}")
    for r in rows:
        print(
            f"{r['co_runner']:<24}{r['tok_s']:>9.0f}{r['vs_alone']:>9.2f}x{r['engine_cores']:>14.2f}"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

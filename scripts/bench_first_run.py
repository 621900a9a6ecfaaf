"""An executable's first run against its later ones: ms per step shape, on padding.

Builds the offline engine (`LLM`, as compare_hf.py builds it: max_num_seqs 128,
max_model_len 256; the demo model or `--model DIR`) with the warm-up's first runs turned
off, then runs every compiled step shape on all-padding inputs (`ModelRunner.run_once`)
`--runs` times in a row and prints, per shape, the first run's ms and the median of the
others, with `uptime`. What `ModelRunner.run_once` at start-up saves the first request of
each shape (the difference), and what it adds to start-up (the first column's sum).

    python scripts/bench_first_run.py [--model DIR] [--runs 5] [--out bench_results/first_run.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="HF model folder (default: the bundled demo model)")
    ap.add_argument("--runs", type=int, default=5, help="runs per shape (>= 2)")
    ap.add_argument("--out", default="bench_results/first_run.json")
    args = ap.parse_args()
    if args.runs < 2:
        ap.error(f"--runs: must be >= 2 (the first run and at least one more), got {args.runs}")

    from jaxserve import LLM
    from jaxserve.engine.model_runner import ModelRunner

    run_once = ModelRunner.run_once
    ModelRunner.run_once = lambda self, shapes: 0.0  # the engine starts without first runs
    kwargs = dict(max_num_seqs=128, max_model_len=256)
    llm = LLM(model=args.model, **kwargs) if args.model else LLM(**kwargs)
    ModelRunner.run_once = run_once
    runner = llm.engine.runner
    uptime = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    rows = []
    print(f"# {uptime}")
    print(f"{'shape (T, R, L, P, steps)':<28} {'first ms':>9} {'later ms':>9} {'extra ms':>9}")
    for shape in runner.buckets():
        ms = [1e3 * runner.run_once([shape]) for _ in range(args.runs)]
        later = statistics.median(ms[1:])
        rows.append(dict(shape=list(shape), first_ms=ms[0], later_ms=later, runs_ms=ms))
        print(f"{str(tuple(shape)):<28} {ms[0]:>9.2f} {later:>9.2f} {ms[0] - later:>9.2f}")
    first, later = sum(r["first_ms"] for r in rows), sum(r["later_ms"] for r in rows)
    print(f"{'all shapes':<28} {first:>9.1f} {later:>9.1f} {first - later:>9.1f}")
    end = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    print(f"# {end}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(uptime=[uptime, end], args=vars(args), rows=rows), indent=1))
    print(f"# wrote {out}")


if __name__ == "__main__":
    main()

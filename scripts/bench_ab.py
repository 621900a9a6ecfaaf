"""A/B: one benchmark script of two source trees, interleaved in one run, medians.

    python scripts/bench_ab.py --old /tmp/old [--rounds 3] [--bench offline|serve] \
        [--new-args "ARGS for this tree's run only"] [-- ARGS for the benchmark script]
    python scripts/bench_ab.py --summarize DIR [--bench offline|serve]

Runs `scripts/bench_<bench>.py` of the old tree and of this one alternately (old, new,
old, new, ...), each in its own process with PYTHONPATH set to its tree and its own
`--out` JSON, so that machine load drifts over both alike. The old tree must import as a
whole package from its root: for a commit before the jaxserve/models symlinks, add them
there first (`ln -s ../models /tmp/old/jaxserve/models`, and sharding, eplb, frontend).

Prints, per row of the benchmark (offline: model/kind/batch/async/k/cache; serve:
path/concurrency), the median tokens/s of each tree over the rounds and new/old, with
the load average (`os.getloadavg`, 1 min) before each run; writes
bench_results/ab_<bench>.json with every round's value. `--summarize DIR` prints the
same table from the per-run JSONs (old0.json, new0.json, ...) a run left in its temporary
folder DIR (the folder is printed first): the rounds finished of a run cut short.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _rows(bench: str, result: dict) -> dict[str, float]:
    """Row key -> output tokens/s of one benchmark JSON."""
    if bench == "offline":
        return {
            f"{r['model']} {r['kind']} b={r['batch']} async={int(r['async_scheduling'])} "
            f"k={r['decode_steps']} cache={int(r['prefix_caching'])}": r["tokens_per_s"]
            for r in result["runs"]
        }
    return {f"{r['path']} c={r['concurrency']}": r["output_tok_s"] for r in result["rows"]}


def _run(tree: Path, bench: str, args: list[str], out: Path) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    cmd = [sys.executable, str(tree / "scripts" / f"bench_{bench}.py"), *args, "--out", str(out)]
    subprocess.run(cmd, cwd=tree, env=env, check=True, stdout=subprocess.DEVNULL)
    return _rows(bench, json.loads(out.read_text()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--old", help="root of the old tree (a git worktree)")
    ap.add_argument("--summarize", help="the table of a previous run's temporary folder")
    ap.add_argument("--bench", choices=["offline", "serve"], default="offline")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None, help="default bench_results/ab_<bench>.json")
    ap.add_argument(
        "--new-args", default="",
        help="more arguments for this tree's run only (options the old script lacks)",
    )  # fmt: skip
    ap.add_argument("bench_args", nargs="*", help="after --: arguments of the benchmark")
    args = ap.parse_args()
    values: dict[str, dict[str, list[float]]] = {"old": {}, "new": {}}
    loads: dict[str, list[float]] = {"old": [], "new": []}
    if args.summarize:
        for name in values:
            for path in sorted(Path(args.summarize).glob(f"{name}[0-9]*.json")):
                for key, value in _rows(args.bench, json.loads(path.read_text())).items():
                    values[name].setdefault(key, []).append(value)
        _report(args, values, loads)
        return
    if not args.old:
        ap.error("--old: required (or --summarize)")
    trees = {"old": Path(args.old).resolve(), "new": ROOT}
    tmp = Path(tempfile.mkdtemp(prefix="jaxserve_ab_"))
    print(f"# per-run JSON in {tmp}", flush=True)
    for i in range(args.rounds):
        for name, tree in trees.items():
            loads[name].append(os.getloadavg()[0])
            extra = shlex.split(args.new_args) if name == "new" else []
            rows = _run(tree, args.bench, [*args.bench_args, *extra], tmp / f"{name}{i}.json")
            for key, value in rows.items():
                values[name].setdefault(key, []).append(value)
            print(f"# round {i + 1}/{args.rounds} {name} done", flush=True)
    _report(args, values, loads)


def _report(args, values: dict[str, dict[str, list[float]]], loads: dict[str, list[float]]):
    """Print the table of medians (with uptime and the loads) and write its JSON."""
    uptime = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    print(f"# {uptime}")
    print(f"# load avg (1 min) before each run: old {loads['old']}, new {loads['new']}")
    print(f"{'row':<52}{'old tok/s':>11}{'new tok/s':>11}{'new/old':>9}{'runs':>6}")
    table = []
    for key, old in values["old"].items():
        new = values["new"].get(key)
        if not new:
            continue
        a, b = statistics.median(old), statistics.median(new)
        table.append({"row": key, "old": old, "new": new, "old_median": a, "new_median": b})
        print(f"{key:<52}{a:>11.1f}{b:>11.1f}{b / a:>9.3f}{len(old):>4}/{len(new)}")
    ratios = [t["new_median"] / t["old_median"] for t in table]
    if ratios:
        print(f"# median new/old over rows: {statistics.median(ratios):.3f}")
    out = Path(args.out or ROOT / "bench_results" / f"ab_{args.bench}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps({"uptime": uptime, "loads": loads, "args": vars(args), "rows": table}, indent=1)
    )
    print(f"# wrote {out}")


if __name__ == "__main__":
    main()

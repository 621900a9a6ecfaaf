"""Per-file wall time of a pytest run, from its JUnit XML report: where the suite's time goes.

    bash scripts/test.sh --junitxml=/tmp/report.xml      # or any pytest run
    python scripts/test_file_times.py /tmp/report.xml [OTHER.xml] [--json OUT.json]

One report: a row per test file (its tests, and seconds: setup + call + teardown of each,
pytest's default junit_duration_report=total, so a module fixture counts in the test
that first asks for it), slowest first, and the total. Two reports (before, after): both
columns and the change. The machine's `uptime` is printed beside the numbers (the test
machine is shared: relative costs are what compares). With --json the table is written
there too (e.g. under bench_results/).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _file_of(classname: str) -> str:
    """'tests.frontend_tests.test_x.TestY' -> 'tests/frontend_tests/test_x.py' (the
    longest dotted prefix that is a file of the repository)."""
    parts = classname.split(".")
    for n in range(len(parts), 0, -1):
        path = "/".join(parts[:n]) + ".py"
        if (REPO / path).is_file():
            return path
    return classname


def file_times(report: Path) -> dict[str, tuple[int, float]]:
    """{test file: (number of tests, seconds)} of one JUnit XML report."""
    out: dict[str, tuple[int, float]] = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        path = _file_of(case.get("classname", ""))
        n, s = out.get(path, (0, 0.0))
        out[path] = (n + 1, s + float(case.get("time", 0.0)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("reports", nargs="+", type=Path, help="one JUnit XML, or before and after")
    ap.add_argument("--json", type=Path, help="also write the table here")
    args = ap.parse_args()
    if len(args.reports) > 2:
        ap.error("reports: one, or two (before, after)")
    tables = [file_times(r) for r in args.reports]
    files = sorted(
        {f for t in tables for f in t}, key=lambda f: -max(t.get(f, (0, 0))[1] for t in tables)
    )
    print(subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())
    head = ["file", "tests"] + [f"s ({r.name})" for r in args.reports]
    head += ["change"] if len(tables) == 2 else []
    rows = []
    for f in files:
        cells = [f, str(max(t.get(f, (0, 0))[0] for t in tables))]
        cells += [f"{t[f][1]:.1f}" if f in t else "-" for t in tables]
        if len(tables) == 2 and all(f in t for t in tables):
            cells.append(f"{tables[1][f][1] - tables[0][f][1]:+.1f}")
        rows.append(cells + [""] * (len(head) - len(cells)))
    totals = ["total", str(max(sum(n for n, _ in t.values()) for t in tables))]
    totals += [f"{sum(s for _, s in t.values()):.1f}" for t in tables]
    if len(tables) == 2:
        totals.append(
            f"{sum(s for _, s in tables[1].values()) - sum(s for _, s in tables[0].values()):+.1f}"
        )
    widths = [
        max(len(r[i]) if i < len(r) else 0 for r in [head, *rows, totals]) for i in range(len(head))
    ]
    for r in [head, *rows, totals]:
        print(
            "  ".join(
                c.ljust(w) if i == 0 else c.rjust(w)
                for i, (c, w) in enumerate(zip(r, widths, strict=True))
            )
        )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        doc = {
            str(r): {f: {"tests": n, "seconds": s} for f, (n, s) in t.items()}
            for r, t in zip(args.reports, tables, strict=True)
        }
        args.json.write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()

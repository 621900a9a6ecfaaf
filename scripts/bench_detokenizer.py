"""Per-token cost of stop-string matching and of the detokenizer window (issue 12).

    .venv/bin/python scripts/bench_detokenizer.py [--out bench_results/detokenizer.json]

Table 1: microseconds per output token to find stop strings in a stream of 4-character
tokens, for a growing number of stop strings that all share a 60-character prefix with
the text (the worst case for a per-string scan): the per-string scan the detokenizer
used before (find each stop string in the unemitted text, then the longest held-back
prefix by trying every suffix length against every stop string) against the one
automaton (`frontend.stop_matcher.StopMatcher`).

Table 2: microseconds per token of `IncrementalDetokenizer.update` over the last 500
tokens of runs of invalid UTF-8 bytes (0xFF) and of skipped special tokens, with the
window cut at MAX_PENDING_TOKENS (now) and never cut (before: the window grows with the
run, so the cost per token does too).

Every value is the median of 5 interleaved repetitions; `uptime` is printed beside them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

from mock_engine import train_test_tokenizer  # noqa: E402

from jaxserve.frontend import detokenizer as detok_mod  # noqa: E402
from jaxserve.frontend.stop_matcher import StopMatcher  # noqa: E402

REPEATS = 5


def _scan_per_string(stops: list[str], chunks: list[str]) -> None:
    """The per-string scan the detokenizer did before the automaton."""
    max_len = max(map(len, stops))
    text, emitted = "", 0
    for chunk in chunks:
        text += chunk
        for s in stops:
            if text.find(s, emitted) != -1:
                return
        hold = 0
        for k in range(min(len(text) - emitted, max_len - 1), 0, -1):
            suffix = text[-k:]
            if any(len(s) > k and s.startswith(suffix) for s in stops):
                hold = k
                break
        emitted = len(text) - hold


def _automaton(stops: list[str], chunks: list[str]) -> None:
    m = StopMatcher(stops)
    for chunk in chunks:
        if m.feed(chunk) is not None:
            return


def _time_per_token(fn, *args, tokens: int) -> float:
    start = time.perf_counter()
    fn(*args)
    return (time.perf_counter() - start) / tokens * 1e6


def stop_table() -> list[dict]:
    text = ("x" * 60 + "y") * 40  # every 61 characters the prefix restarts
    chunks = [text[i : i + 4] for i in range(0, len(text), 4)]
    rows = []
    for count in (1, 4, 64, 1000):
        stops = ["x" * 60 + f"{i:04d}" for i in range(count)]
        scan, auto = [], []
        for _ in range(REPEATS):
            scan.append(_time_per_token(_scan_per_string, stops, chunks, tokens=len(chunks)))
            auto.append(_time_per_token(_automaton, stops, chunks, tokens=len(chunks)))
        rows.append(
            {"stop_strings": count, "per_string_scan_us": statistics.median(scan),
             "automaton_us": statistics.median(auto)}
        )  # fmt: skip
    return rows


def _detok_last_500(tok, ids: list[int], cut: bool) -> float:
    saved = detok_mod.MAX_PENDING_TOKENS
    detok_mod.MAX_PENDING_TOKENS = saved if cut else 10**9
    try:
        d = detok_mod.IncrementalDetokenizer(tok)
        for t in ids[:-500]:
            d.update([t])
        start = time.perf_counter()
        for t in ids[-500:]:
            d.update([t])
        return (time.perf_counter() - start) / 500 * 1e6
    finally:
        detok_mod.MAX_PENDING_TOKENS = saved


def window_table(tok) -> list[dict]:
    ff = tok.token_to_id("ÿ")  # GPT-2's character for the byte 0xFF
    rows = []
    for kind, token in (("invalid byte 0xFF", ff), ("skipped special token", 1)):
        for run in (1000, 4000):
            ids = [token] * run
            now, before = [], []
            for _ in range(REPEATS):
                now.append(_detok_last_500(tok, ids, cut=True))
                before.append(_detok_last_500(tok, ids, cut=False))
            rows.append(
                {"run": kind, "tokens": run, "window_cut_us": statistics.median(now),
                 "never_cut_us": statistics.median(before)}
            )  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench_results/detokenizer.json")
    args = parser.parse_args()
    uptime = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    print(f"uptime: {uptime}\n")
    stops = stop_table()
    print("| stop strings | per-string scan (us/token) | automaton (us/token) |")
    print("|---:|---:|---:|")
    for r in stops:
        print(f"| {r['stop_strings']} | {r['per_string_scan_us']:.1f} | {r['automaton_us']:.1f} |")
    windows = window_table(train_test_tokenizer())
    print("\n| run of | tokens | window cut (us/token) | never cut (us/token) |")
    print("|---|---:|---:|---:|")
    for r in windows:
        print(
            f"| {r['run']} | {r['tokens']} | {r['window_cut_us']:.1f} | {r['never_cut_us']:.1f} |"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"uptime": uptime, "pid": os.getpid(), "stop": stops,
                               "window": windows}, indent=1))  # fmt: skip
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()

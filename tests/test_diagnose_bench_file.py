"""`jaxserve diagnose --from FILE` on a file that is JSON but not a whole bench result
(hand-edited, truncated, another tool's) says which field is wrong in one line, exit
code 2; a trial got KeyError and TypeError tracebacks (metrics.ttft_ms a string, a
median missing, no itl_ms)."""

from __future__ import annotations

import json

import pytest

from jaxserve.cli import build_parser

GOOD = {
    "completed": 8, "failed": 0, "total_input_tokens": 256, "output_throughput": 120.0,
    "max_concurrency_observed": 4, "ttft_ms": {"median": 40.0, "p99": 60.0},
    "itl_ms": {"median": 10.0, "p99": 12.0},
}  # fmt: skip


def _diagnose(capsys, tmp_path, metrics) -> tuple[int, list[str], str]:
    path = tmp_path / "bench.json"
    path.write_text(json.dumps({"metrics": metrics}))
    args = build_parser().parse_args(["diagnose", "--from", str(path)])
    code = args.func(args)
    out = capsys.readouterr()
    return code, out.err.splitlines(), out.out


@pytest.mark.parametrize(
    ("change", "field", "got"),
    [
        ({"ttft_ms": "x"}, "ttft_ms", "'x'"),
        ({"ttft_ms": {"p99": 3.0}}, "ttft_ms.median", "None"),
        ({"itl_ms": None}, "itl_ms", "None"),
        ({"itl_ms": {"median": "fast"}}, "itl_ms.median", "'fast'"),
        ({"ttft_ms": {"median": 1.0, "p99": -2}}, "ttft_ms.p99", "-2"),
        ({"completed": "8"}, "completed", "'8'"),
        ({"output_throughput": float("nan")}, "output_throughput", "nan"),
    ],
)
def test_a_bad_field_is_named_in_one_line(capsys, tmp_path, change, field, got):
    code, err, out = _diagnose(capsys, tmp_path, {**GOOD, **change})
    assert (code, out) == (2, "")
    assert len(err) == 1
    assert err[0].startswith(
        "jaxserve diagnose: error: --from: not a jaxserve bench --out file "
        f"(metrics.{field}: expected "
    )
    assert err[0].endswith(f", got {got})")


def test_a_whole_file_is_diagnosed(capsys, tmp_path):
    code, err, out = _diagnose(capsys, tmp_path, GOOD)
    assert (code, err) == (0, [])
    assert "requests 8, failed 0" in out and "ttft_p50_ms 40, ttft_p99_ms 60" in out

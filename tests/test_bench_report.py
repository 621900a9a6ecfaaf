"""`jaxserve bench`'s statistics (jaxserve.benchmark.report) against numpy on hand-made
timings: latencies, throughputs, goodput, the timeline and the table. The datasets:
test_bench_datasets.py; the request driver: test_bench_driver.py; the command end to
end: test_bench_cli.py."""

from __future__ import annotations

import numpy as np
import pytest

from jaxserve.benchmark import report
from jaxserve.benchmark.backends import RequestResult


def _out(start, chunk_times, output_len, prompt_len=10, chunk_tokens=None, success=True):
    return RequestResult(
        success=success, start=start, ttft=chunk_times[0] if chunk_times else 0.0,
        latency=chunk_times[-1] if chunk_times else 0.0, chunk_times=list(chunk_times),
        chunk_tokens=chunk_tokens, prompt_len=prompt_len, output_len=output_len,
        error="" if success else "UNAVAILABLE: gone",
    )  # fmt: skip


# Hand-made timings (seconds from each request's send): chunk arrival times and tokens.
TIMINGS = [
    (0.00, [0.100, 0.150, 0.210, 0.300], 4),
    (0.05, [0.250, 0.260], 2),
    (0.10, [0.080], 1),  # one token: no TPOT, no ITL
    (0.20, [0.500, 0.520, 0.700, 0.710, 0.900], 6),  # 6 tokens in 5 chunks
]


def test_metrics_equal_numpy_on_hand_made_timings():
    outs = [_out(s, c, n, prompt_len=10 + i) for i, (s, c, n) in enumerate(TIMINGS)]
    outs.append(_out(0.3, [], 0, success=False))
    duration = 1.2
    pct = (50.0, 90.0, 99.0)
    m = report.compute_metrics(outs, duration, percentiles=pct)
    ttft = np.array([c[0] for _, c, _ in TIMINGS]) * 1000
    e2e = np.array([c[-1] for _, c, _ in TIMINGS]) * 1000
    tpot = np.array([(c[-1] - c[0]) / (n - 1) for _, c, n in TIMINGS if n > 1]) * 1000
    itl = np.concatenate([np.diff(c) for _, c, _ in TIMINGS]) * 1000
    assert itl.size == 3 + 1 + 0 + 4
    for key, want in (("ttft_ms", ttft), ("tpot_ms", tpot), ("itl_ms", itl), ("e2el_ms", e2e)):
        got = m[key]
        assert got["mean"] == pytest.approx(want.mean()), key
        assert got["std"] == pytest.approx(want.std()), key
        assert got["median"] == pytest.approx(np.median(want)), key
        for p in pct:
            assert got[f"p{p:g}"] == pytest.approx(np.percentile(want, p)), (key, p)
    assert m["completed"] == 4 and m["failed"] == 1
    n_out, n_in = 4 + 2 + 1 + 6, 10 + 11 + 12 + 13
    assert m["total_output_tokens"] == n_out and m["total_input_tokens"] == n_in
    assert m["request_throughput"] == pytest.approx(4 / duration)
    assert m["output_throughput"] == pytest.approx(n_out / duration)
    assert m["total_token_throughput"] == pytest.approx((n_in + n_out) / duration)
    # In flight: [0, .3], [.05, .3], [.1, .18], [.2, 1.1]: request 2 ends at 0.18, before
    # request 3 starts at 0.2, so the peak is 3.
    assert m["max_concurrency_observed"] == 3


def test_goodput_counts_requests_within_every_slo():
    outs = [_out(s, c, n) for s, c, n in TIMINGS]
    # TTFT ms: 100, 250, 80, 500; TPOT ms: 66.7, 10, (0), 80; E2E ms: 300, 260, 80, 900.
    cases = [
        ({"ttft": 200}, 2),  # 100, 80
        ({"ttft": 250}, 3),  # <= is within
        ({"tpot": 70}, 3),  # 66.7, 10, one-token request counts as 0
        ({"ttft": 300, "tpot": 50}, 2),  # request 1 (250, 10) and 2 (80, 0)
        ({"e2el": 280}, 2),
    ]
    for slo, want in cases:
        m = report.compute_metrics(outs, 2.0, slo=slo)
        assert m["good_requests"] == want, slo
        assert m["request_goodput"] == pytest.approx(want / 2.0), slo


def test_parse_slo_and_percentiles_name_the_bad_entry():
    assert report.parse_slo("ttft=200, tpot=50.5") == {"ttft": 200.0, "tpot": 50.5}
    for bad in ("ttft", "foo=1", "ttft=x", "ttft=-1", "ttft=1,ttft=2", "", "tpot=inf"):
        with pytest.raises(ValueError, match="slo"):
            report.parse_slo(bad)
    assert report.parse_percentiles("50,99.9") == (50.0, 99.9)
    for bad in ("0", "101", "a", ""):
        with pytest.raises(ValueError, match="percentiles"):
            report.parse_percentiles(bad)


def test_timeline_counts_every_token_once():
    outs = [_out(s, c, n) for s, c, n in TIMINGS]
    outs[3].chunk_tokens = [1, 2, 1, 1, 1]  # gRPC-style exact counts on one request
    tl = report.timeline(outs, t0=0.0, duration=1.2)
    assert sum(tl["output_tok_s"]) * tl["bin_s"] == pytest.approx(4 + 2 + 1 + 6)
    # The second chunk of request 3 arrives at 0.2 + 0.52 = 0.72 s and carries 2 tokens.
    k = int(0.72 / tl["bin_s"])
    assert tl["output_tok_s"][k] * tl["bin_s"] >= 2
    # Requests in flight, time-weighted per bin: the bins add up to the request-seconds,
    # and no bin's mean exceeds the peak of 3 at once.
    assert sum(tl["requests_in_flight"]) * tl["bin_s"] == pytest.approx(
        sum(c[-1] for _, c, _ in TIMINGS)
    )
    assert max(tl["requests_in_flight"]) <= 3 + 1e-9


def test_table_has_every_latency_row():
    m = report.compute_metrics([_out(s, c, n) for s, c, n in TIMINGS], 1.0, slo={"ttft": 200})
    table = report.format_table(m, (50.0, 90.0, 99.0), "demo")
    for label in ("TTFT", "TPOT", "ITL", "E2E", "goodput", "Output token throughput"):
        assert label in table
    row = next(ln for ln in table.splitlines() if ln.startswith("TTFT"))
    assert [float(x) for x in row.split()[1:]] == pytest.approx(
        [m["ttft_ms"][k] for k in ("mean", "median", "p90", "p99")], abs=0.01
    )

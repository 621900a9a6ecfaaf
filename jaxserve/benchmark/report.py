"""The statistics of a benchmark run, its results table and its JSON.

Metric definitions are vLLM's benchmark_serving (vllm/benchmarks/serve.py,
calculate_metrics), over the successful requests:

- TTFT: send to the first chunk that carries output.
- TPOT: (E2E - TTFT) / (output tokens - 1), per request with more than one output token
  (the first token is not counted: it is TTFT's).
- ITL: the gap between consecutive output chunks, every gap of every request pooled (a
  chunk of several tokens is one gap, as vLLM counts).
- E2E: send to the last chunk.
- Throughput: requests, output tokens, and input + output tokens, each over the run's
  duration (first send to last finish), in per second.
- Goodput: requests meeting every given SLO (ttft, tpot, e2el in ms; a request of one
  output token has TPOT 0 here, as in vLLM) over the duration.

Latencies are reported in milliseconds: mean, std, median and the requested percentiles
(numpy's default linear interpolation). Token counts are the server's.
"""

from __future__ import annotations

import math
from dataclasses import asdict

import numpy as np

from jaxserve.benchmark.backends import RequestResult

SLO_METRICS = ("ttft", "tpot", "e2el")
LATENCIES = (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2E"))
DEFAULT_PERCENTILES = (50.0, 90.0, 99.0)
TIMELINE_BINS = 60  # at most this many points of throughput over time


def parse_slo(text: str) -> dict[str, float]:
    """ "ttft=200,tpot=50" -> {"ttft": 200.0, "tpot": 50.0} (milliseconds).

    Raises ValueError naming slo and the bad entry: an unknown metric, a repeated one, a
    value that is not a positive number."""
    out: dict[str, float] = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        name, sep, value = item.partition("=")
        name = name.strip().lower()
        if not sep or name not in SLO_METRICS:
            raise ValueError(f"slo: want NAME=MS with NAME in {', '.join(SLO_METRICS)}: {item!r}")
        if name in out:
            raise ValueError(f"slo: {name} given twice")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"slo: {name}: not a number: {value!r}") from None
        if not ms > 0 or math.isinf(ms):
            raise ValueError(f"slo: {name}: must be a positive number of ms, got {value}")
        out[name] = ms
    if not out:
        raise ValueError("slo: empty (want e.g. ttft=200,tpot=50)")
    return out


def parse_percentiles(text: str) -> tuple[float, ...]:
    """ "50,90,99" -> (50.0, 90.0, 99.0). Raises ValueError naming percentiles for a value
    outside (0, 100] or not a number."""
    try:
        values = tuple(float(p) for p in text.split(",") if p.strip())
    except ValueError:
        raise ValueError(f"percentiles: not a list of numbers: {text!r}") from None
    if not values or any(not 0 < p <= 100 for p in values):
        raise ValueError(f"percentiles: each must be in (0, 100], got {text!r}")
    return values


def _pct_key(p: float) -> str:
    return f"p{p:g}".replace(".", "_")


def _summary(values_s: list[float], percentiles) -> dict[str, float]:
    """Mean, std, median and percentiles of seconds, in ms (zeros for no values)."""
    a = np.asarray(values_s, dtype=np.float64) * 1000.0
    if a.size == 0:
        a = np.zeros(1)
    out = {"mean": float(a.mean()), "std": float(a.std()), "median": float(np.median(a))}
    out.update({_pct_key(p): float(np.percentile(a, p)) for p in percentiles})
    return out


def per_request_tpot(o: RequestResult) -> float | None:
    """Seconds per output token after the first; None for a single-token output."""
    return (o.latency - o.ttft) / (o.output_len - 1) if o.output_len > 1 else None


def compute_metrics(
    outputs: list[RequestResult],
    duration: float,
    *,
    slo: dict[str, float] | None = None,
    percentiles=DEFAULT_PERCENTILES,
) -> dict:
    """The summary of a run (module docstring): counts, throughputs, and per latency a
    dict of mean/std/median/pNN in ms. duration: seconds (> 0)."""
    ok = [o for o in outputs if o.success]
    tpots = [t for o in ok if (t := per_request_tpot(o)) is not None]
    itls = [g for o in ok for g in np.diff(o.chunk_times).tolist()]
    n_in, n_out = sum(o.prompt_len for o in ok), sum(o.output_len for o in ok)
    metrics = {
        "duration_s": duration,
        "completed": len(ok),
        "failed": len(outputs) - len(ok),
        "total_input_tokens": n_in,
        "total_output_tokens": n_out,
        "request_throughput": len(ok) / duration,
        "output_throughput": n_out / duration,
        "total_token_throughput": (n_in + n_out) / duration,
        "max_concurrency_observed": max_in_flight(ok),
        "ttft_ms": _summary([o.ttft for o in ok], percentiles),
        "tpot_ms": _summary(tpots, percentiles),
        "itl_ms": _summary(itls, percentiles),
        "e2el_ms": _summary([o.latency for o in ok], percentiles),
    }
    if slo:
        good = sum(meets_slo(o, slo) for o in ok)
        metrics["slo_ms"] = dict(slo)
        metrics["good_requests"] = good
        metrics["request_goodput"] = good / duration
    return metrics


def meets_slo(o: RequestResult, slo: dict[str, float]) -> bool:
    """Whether a successful request is within every SLO (ms) given."""
    values_ms = {
        "ttft": o.ttft * 1000.0,
        "tpot": (per_request_tpot(o) or 0.0) * 1000.0,
        "e2el": o.latency * 1000.0,
    }
    return all(values_ms[k] <= v for k, v in slo.items())


def max_in_flight(outputs: list[RequestResult]) -> int:
    """The most requests in flight at once (send to last chunk)."""
    events = sorted(
        [(o.start, 1) for o in outputs] + [(o.start + o.latency, -1) for o in outputs],
        key=lambda e: (e[0], e[1]),  # an end before a start at the same instant
    )
    peak = cur = 0
    for _, d in events:
        cur += d
        peak = max(peak, cur)
    return peak


def timeline(outputs: list[RequestResult], t0: float, duration: float) -> dict:
    """Throughput over time: output tokens/s and the mean (time-weighted) requests in
    flight per bin of the run (TIMELINE_BINS bins, at least 0.1 s wide). A chunk's tokens
    count at its arrival; where the backend does not give tokens per chunk (HTTP) a
    request's output tokens are spread evenly over its chunks."""
    width = max(0.1, duration / TIMELINE_BINS)
    n = max(1, math.ceil(duration / width))
    tokens = np.zeros(n)
    running = np.zeros(n)
    for o in outputs:
        if not o.success:
            continue
        start = o.start - t0
        per = o.chunk_tokens or [o.output_len / len(o.chunk_times)] * len(o.chunk_times)
        for t, k in zip(o.chunk_times, per, strict=True):
            tokens[min(n - 1, int((start + t) / width))] += k
        # Mean requests in flight per bin: each request adds its overlap with the bin.
        a, b = start, start + o.latency
        edges = np.arange(n + 1) * width
        running += np.clip(np.minimum(edges[1:], b) - np.maximum(edges[:-1], a), 0, None) / width
    return {
        "bin_s": width,
        "time_s": (np.arange(n) * width + width / 2).tolist(),
        "output_tok_s": (tokens / width).tolist(),
        "requests_in_flight": running.tolist(),
    }


def format_table(metrics: dict, percentiles=DEFAULT_PERCENTILES, title: str = "") -> str:
    """The results table: the counts and throughputs, then one row per latency."""
    rule = "=" * 72
    lines = [rule, f" Serving benchmark result{f': {title}' if title else ''}", rule]
    rows = [
        ("Successful requests", f"{metrics['completed']}"),
        ("Failed requests", f"{metrics['failed']}"),
        ("Benchmark duration (s)", f"{metrics['duration_s']:.2f}"),
        ("Total input tokens", f"{metrics['total_input_tokens']}"),
        ("Total generated tokens", f"{metrics['total_output_tokens']}"),
        ("Request throughput (req/s)", f"{metrics['request_throughput']:.2f}"),
        ("Output token throughput (tok/s)", f"{metrics['output_throughput']:.2f}"),
        ("Total token throughput (tok/s)", f"{metrics['total_token_throughput']:.2f}"),
        ("Max requests in flight", f"{metrics['max_concurrency_observed']}"),
    ]
    if "request_goodput" in metrics:
        slo = ",".join(f"{k}<={v:g}ms" for k, v in metrics["slo_ms"].items())
        rows.append((f"Request goodput (req/s) [{slo}]", f"{metrics['request_goodput']:.2f}"))
        rows.append(("Requests within SLO", f"{metrics['good_requests']}"))
    width = max(len(k) for k, _ in rows) + 2
    lines += [f"{k + ':':<{width}}{v:>14}" for k, v in rows]
    cols = ["mean", "median", *(_pct_key(p) for p in percentiles if p != 50)]
    heads = ["mean", "p50", *(_pct_key(p).replace("_", ".") for p in percentiles if p != 50)]
    lines.append("-" * 72)
    lines.append(f"{'latency (ms)':<14}" + "".join(f"{h:>12}" for h in heads))
    for key, label in LATENCIES:
        s = metrics[f"{key}_ms"]
        lines.append(f"{label:<14}" + "".join(f"{s[c]:>12.2f}" for c in cols))
    lines.append(rule)
    return "\n".join(lines)


def per_request_records(outputs: list[RequestResult], t0: float) -> list[dict]:
    """One JSON-ready dict per request: its times in seconds (sent_s from the run's
    start), counts, ITLs and error; the output text is left out."""
    out = []
    for o in outputs:
        d = asdict(o)
        d.pop("text")
        d["sent_s"] = d.pop("start") - t0
        d["itl"] = np.diff(o.chunk_times).tolist() if o.success else []
        d["tpot"] = per_request_tpot(o) if o.success else None
        out.append(d)
    return out

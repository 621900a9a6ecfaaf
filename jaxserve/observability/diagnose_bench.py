"""`jaxserve diagnose --from bench.json`: the tree's client-visible branches over a
`jaxserve bench --out` file, for a load whose server's metrics were not sampled.

Client-side numbers only, so only these branches can be told, and the diagnosis says
so: failures; queueing (a median TTFT of more than `WAIT_STEPS` median inter-token gaps
per `PREFILL_TOKENS` prompt tokens, or a TTFT p99 over `TAIL_RATIO` times its median);
stalls (the same tail of ITL). The server-side tree: `observability.diagnose`.
No JAX here.
"""

from __future__ import annotations

import json
import math

from jaxserve.observability.diagnose import Diagnosis, Finding

TAIL_RATIO = 3.0  # p99 / median of TTFT (queueing) or ITL (stalls)
# A prompt of up to PREFILL_TOKENS tokens is prefilled in about one step: a median TTFT
# above WAIT_STEPS decode steps (ITL medians) per that many prompt tokens means waiting.
PREFILL_TOKENS = 256
WAIT_STEPS = 10.0


def diagnose_bench(doc: dict, source: str) -> Diagnosis:
    """The tree's client-visible branches over a `jaxserve bench --out` document.

    Raises ValueError("from: ...") when the document has no `metrics` of a bench run."""
    m = doc.get("metrics") if isinstance(doc, dict) else None
    if not isinstance(m, dict) or "ttft_ms" not in m:
        raise ValueError("from: not a jaxserve bench --out file (no metrics.ttft_ms)")
    ttft, itl = _latency(m, "ttft_ms"), _latency(m, "itl_ms")
    summary = {"requests": _count(m, "completed"), "failed": _count(m, "failed"),
               "output_tok_s": _count(m, "output_throughput"),
               "ttft_p50_ms": ttft["median"], "ttft_p99_ms": ttft.get("p99", ttft["median"]),
               "itl_p50_ms": itl["median"],
               "itl_p99_ms": itl.get("p99", itl["median"])}  # fmt: skip
    findings = []
    if m.get("failed"):
        findings.append(Finding(
            "application (errors)", "requests failed", {"failed": m["failed"]},
            "the failed requests' errors are in the bench JSON's requests; the server log",
        ))  # fmt: skip
    prompt = _count(m, "total_input_tokens") / max(summary["requests"], 1)
    prefill_steps = max(1.0, prompt / PREFILL_TOKENS)
    waited = summary["ttft_p50_ms"] > WAIT_STEPS * prefill_steps * summary["itl_p50_ms"]
    if waited or summary["ttft_p99_ms"] > TAIL_RATIO * max(summary["ttft_p50_ms"], 1e-9):
        findings.append(Finding(
            "scheduling (queue)", "requests wait before their prefill: TTFT is many decode "
            "steps long, or has a long tail",
            {"ttft_p50_ms": summary["ttft_p50_ms"], "ttft_p99_ms": summary["ttft_p99_ms"],
             "itl_p50_ms": summary["itl_p50_ms"], "prompt_tokens_mean": prompt,
             "max_concurrency_observed": _count(m, "max_concurrency_observed")},
            "jaxserve diagnose --server (queue time vs prefill); --max-num-seqs",
        ))  # fmt: skip
    if summary["itl_p99_ms"] > TAIL_RATIO * max(summary["itl_p50_ms"], 1e-9):
        findings.append(Finding(
            "memory or scheduling (stalls)", "inter-token gaps have a long tail: streams "
            "stall (preemption, long prefills between decodes, host gaps)",
            {"itl_p50_ms": summary["itl_p50_ms"], "itl_p99_ms": summary["itl_p99_ms"]},
            "jaxserve diagnose --server during the same load names which",
        ))  # fmt: skip
    note = ("client-side numbers only: run jaxserve diagnose --server HOST:METRICS_PORT "
            "during the load to see the layer")  # fmt: skip
    return Diagnosis(source, findings, summary, note)


def _bad(field: str, value, expected: str = "a number >= 0") -> ValueError:
    return ValueError(
        f"from: not a jaxserve bench --out file (metrics.{field}: expected {expected}, "
        f"got {value!r:.40})"
    )


def _number(value, field: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < math.inf:
        raise _bad(field, value)
    return value


def _count(m: dict, key: str) -> float:
    """metrics[key], 0 when absent (an older file); ValueError naming it when not a number."""
    return _number(m.get(key, 0), key)


def _latency(m: dict, key: str) -> dict:
    """metrics[key]'s median and, when there, p99, checked to be numbers (a hand-edited or
    truncated file ended in a KeyError or TypeError traceback)."""
    stats = m.get(key)
    if not isinstance(stats, dict):
        raise _bad(key, stats, "an object of percentiles")
    out = {"median": _number(stats.get("median"), f"{key}.median")}
    if "p99" in stats:
        out["p99"] = _number(stats["p99"], f"{key}.p99")
    return out


def load_bench(path: str) -> Diagnosis:
    """`diagnose_bench` of a file. Raises ValueError("from: ...") on a file that is not
    JSON or not a bench result, OSError when it cannot be read."""
    with open(path) as f:
        try:
            doc = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:  # text, or bytes
            raise ValueError(f"from: {path} is not JSON ({e})") from None
    return diagnose_bench(doc, f"{path} (jaxserve bench)")

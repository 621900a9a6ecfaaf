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
    ttft, itl = m["ttft_ms"], m["itl_ms"]
    summary = {"requests": m.get("completed", 0), "failed": m.get("failed", 0),
               "output_tok_s": m.get("output_throughput", 0.0),
               "ttft_p50_ms": ttft["median"], "ttft_p99_ms": ttft.get("p99", ttft["median"]),
               "itl_p50_ms": itl["median"],
               "itl_p99_ms": itl.get("p99", itl["median"])}  # fmt: skip
    findings = []
    if m.get("failed"):
        findings.append(Finding(
            "application (errors)", "requests failed", {"failed": m["failed"]},
            "the failed requests' errors are in the bench JSON's requests; the server log",
        ))  # fmt: skip
    prompt = m.get("total_input_tokens", 0) / max(m.get("completed", 0), 1)
    prefill_steps = max(1.0, prompt / PREFILL_TOKENS)
    waited = summary["ttft_p50_ms"] > WAIT_STEPS * prefill_steps * summary["itl_p50_ms"]
    if waited or summary["ttft_p99_ms"] > TAIL_RATIO * max(summary["ttft_p50_ms"], 1e-9):
        findings.append(Finding(
            "scheduling (queue)", "requests wait before their prefill: TTFT is many decode "
            "steps long, or has a long tail",
            {"ttft_p50_ms": summary["ttft_p50_ms"], "ttft_p99_ms": summary["ttft_p99_ms"],
             "itl_p50_ms": summary["itl_p50_ms"], "prompt_tokens_mean": prompt,
             "max_concurrency_observed": m.get("max_concurrency_observed", 0)},
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


def load_bench(path: str) -> Diagnosis:
    """`diagnose_bench` of a file. Raises ValueError("from: ...") on a file that is not
    JSON or not a bench result, OSError when it cannot be read."""
    with open(path) as f:
        try:
            doc = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:  # text, or bytes
            raise ValueError(f"from: {path} is not JSON ({e})") from None
    return diagnose_bench(doc, f"{path} (jaxserve bench)")

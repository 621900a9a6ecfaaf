"""The `--plot` PNG of `jaxserve bench`: the latency distributions (TTFT, TPOT, ITL, E2E
histograms in ms, mean and p99 marked) and the throughput over time (output tokens/s and
requests in flight per bin, `report.timeline`).

matplotlib is the `bench` extra (pip install 'jaxserve[bench]'); it is imported here only,
with the Agg backend (no display).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from jaxserve.benchmark.backends import RequestResult
from jaxserve.benchmark.report import per_request_tpot


def write_plot(path: str | Path, outputs: list[RequestResult], timeline: dict, title: str = ""):
    """Write the PNG to `path` (its folder is created).

    Raises RuntimeError if matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RuntimeError("plot: needs matplotlib (pip install 'jaxserve[bench]')") from None
    ok = [o for o in outputs if o.success]
    series = {
        "TTFT": [o.ttft for o in ok],
        "TPOT": [t for o in ok if (t := per_request_tpot(o)) is not None],
        "ITL": [g for o in ok for g in np.diff(o.chunk_times)],
        "E2E latency": [o.latency for o in ok],
    }
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    for ax, (name, values) in zip(axes.flat[[0, 1, 3, 4]], series.items(), strict=True):
        ms = np.asarray(values, dtype=np.float64) * 1000.0
        ax.set_title(f"{name} ({ms.size} values)")
        ax.set_xlabel("ms")
        ax.set_ylabel("count")
        if ms.size:
            ax.hist(ms, bins=min(50, max(5, ms.size // 2)), color="tab:blue", alpha=0.8)
            for value, style, label in (
                (ms.mean(), "-", "mean"),
                (np.percentile(ms, 99), "--", "p99"),
            ):
                ax.axvline(value, color="tab:red", linestyle=style, label=f"{label} {value:.1f}")
            ax.legend(fontsize=8)
    t = timeline["time_s"]
    ax = axes.flat[2]
    ax.plot(t, timeline["output_tok_s"], color="tab:green")
    ax.set_title("output token throughput")
    ax.set_xlabel("s since start")
    ax.set_ylabel("tokens/s")
    ax = axes.flat[5]
    ax.plot(t, timeline["requests_in_flight"], color="tab:orange")
    ax.set_title("requests in flight")
    ax.set_xlabel("s since start")
    ax.set_ylabel("requests")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path

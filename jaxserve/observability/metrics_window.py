"""A window of a server's metrics, as `jaxserve diagnose` samples it: scrapes of a
Prometheus text endpoint (`scrape`, `parse_exposition`) taken for some seconds
(`sample`) into a `Window`, the change of every counter and histogram between the first
and the last scrape and the highest value each gauge took. The tree that reads it:
`observability.diagnose`. No JAX here.
"""

from __future__ import annotations

import ssl
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families


def scrape(
    url: str, timeout: float = 10.0, context: ssl.SSLContext | None = None
) -> dict[str, float]:
    """One scrape of a Prometheus text endpoint: {series: value}, a series named as
    `name{label="v",...}` without the `model` label (sorted labels; just `name` when none).
    `context`: the TLS context of an https:// URL (`ClientAuth.ssl_context`).

    Raises OSError (urllib.error.URLError) when the endpoint cannot be read."""
    with urllib.request.urlopen(url, timeout=timeout, context=context) as resp:
        return parse_exposition(resp.read().decode())


def parse_exposition(text: str) -> dict[str, float]:
    """The series of a Prometheus text exposition, named as `scrape` names them."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = {k: v for k, v in s.labels.items() if k != "model"}
            key = s.name
            if labels:
                key += "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"
            out[key] = out.get(key, 0.0) + s.value
    return out


@dataclass
class Window:
    """Metrics over a sampling window: `first` and `last` scrape, `peak` of each series
    over all scrapes, and the window's length in seconds."""

    first: dict[str, float]
    last: dict[str, float]
    peak: dict[str, float]
    seconds: float

    def delta(self, name: str) -> float:
        """Change of a counter (or histogram _sum / _count) over the window."""
        return self.last.get(name, 0.0) - self.first.get(name, 0.0)

    def mean(self, histogram: str) -> float | None:
        """Mean of a histogram's observations in the window (None: none)."""
        n = self.delta(f"{histogram}_count")
        return self.delta(f"{histogram}_sum") / n if n > 0 else None

    def gauge(self, name: str) -> float:
        return self.last.get(name, 0.0)

    def max(self, name: str) -> float:
        return self.peak.get(name, 0.0)

    def labelled(self, name: str, label: str) -> dict[str, float]:
        """The last values of `name{label=...}` series: label value -> value."""
        prefix = f'{name}{{{label}="'
        return {k[len(prefix) : -2]: v for k, v in self.last.items() if k.startswith(prefix)}


def sample(
    url: str,
    seconds: float,
    interval_s: float = 0.5,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    context: ssl.SSLContext | None = None,
) -> Window:
    """Scrape `url` every `interval_s` for `seconds` (at least twice) into a Window
    (`context`: as `scrape`'s)."""
    start = clock()
    first = scrape(url, context=context)
    peak = dict(first)
    last = first
    while True:
        sleep(min(interval_s, max(0.0, start + seconds - clock())))
        last = scrape(url, context=context)
        for k, v in last.items():
            peak[k] = max(peak.get(k, v), v)
        if clock() - start >= seconds:
            break
    return Window(first, last, peak, clock() - start)

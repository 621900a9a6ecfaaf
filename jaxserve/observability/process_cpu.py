"""CPU time of the serving processes, for the metrics (`jaxserve_process_cpu_seconds_total`)
and the application branch of `observability.diagnose` (issue 17).

Each serving process measures its own CPU (user + system, all threads:
`time.process_time`): the frontend reads its own at each scrape; the engine loop and the
detokenizer sidecar put theirs on the engine's stats (`EngineCounters.process_cpu_s`,
`.detokenizer_cpu_s`), which reach the frontend in order with the outputs. With
`jaxserve_host_usable_cores` (the frontend's affinity mask), rate(cpu) / cores is each
process's share of the host's cores. No JAX here.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from prometheus_client.core import CounterMetricFamily

# `EngineCounters` fields that are another process's CPU seconds: field -> the `process`
# label of `jaxserve_process_cpu_seconds_total` (the frontend's own is read at scrape).
PROCESS_CPU = {"process_cpu_s": "engine", "detokenizer_cpu_s": "detokenizer"}
PROCESS_CPU_METRIC = "jaxserve_process_cpu_seconds"


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity mask; os.cpu_count() where
    the platform has no affinity)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


class ProcessCpu:
    """A prometheus_client collector of `PROCESS_CPU_METRIC`: the frontend's CPU from
    `clock` at each scrape, the other processes' from their cumulative values in the
    engine's stats. A value below the previous one is a restarted process counting from
    0 again: the whole value is the increment (`observability.metrics`' counter rule)."""

    def __init__(self, model: str, clock: Callable[[], float]) -> None:
        self._model, self._clock = model, clock
        self._totals = dict.fromkeys(PROCESS_CPU.values(), 0.0)
        self._last = dict.fromkeys(PROCESS_CPU.values(), 0.0)

    def update(self, counters) -> None:
        for key, process in PROCESS_CPU.items():
            value, last = float(getattr(counters, key)), self._last[process]
            self._totals[process] += value - last if value >= last else value
            self._last[process] = value

    def collect(self):
        family = CounterMetricFamily(
            PROCESS_CPU_METRIC, "CPU seconds (user + system, all threads) of each serving "
            "process: frontend, detokenizer sidecar(s), engine(s)", labels=["model", "process"],
        )  # fmt: skip
        family.add_metric([self._model, "frontend"], self._clock())
        for process, total in self._totals.items():
            family.add_metric([self._model, process], total)
        yield family

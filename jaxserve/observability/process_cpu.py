"""CPU time of the serving processes, for the metrics (`jaxserve_process_cpu_seconds_total`)
and the application branch of `observability.diagnose` (issue 17).

Each serving process measures its own CPU (user + system, all threads:
`time.process_time`): the frontend reads its own at each scrape; the engine loop and the
detokenizer sidecar put theirs on the engine's stats (`EngineCounters.process_cpu_s`,
`.detokenizer_cpu_s`), which reach the frontend in order with the outputs. With
`jaxserve_host_usable_cores` (the frontend's affinity mask), rate(cpu) / cores is each
process's share of the host's cores. What the host's usable cores did in all, every
process included (a load client on the same machine takes cores the engine needs too):
`jaxserve_host_busy_cpu_seconds_total`, from the kernel's per-CPU times (Linux
/proc/stat; absent elsewhere). No JAX here.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from prometheus_client.core import CounterMetricFamily

from jaxserve.observability.stats import cumulative_increment

# `EngineCounters` fields that are another process's CPU seconds: field -> the `process`
# label of `jaxserve_process_cpu_seconds_total` (the frontend's own is read at scrape).
PROCESS_CPU = {"process_cpu_s": "engine", "detokenizer_cpu_s": "detokenizer"}
PROCESS_CPU_METRIC = "jaxserve_process_cpu_seconds"
HOST_BUSY_METRIC = "jaxserve_host_busy_cpu_seconds"


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity mask; os.cpu_count() where
    the platform has no affinity)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def busy_seconds(stat: str, cpus: set[int], ticks_per_s: float) -> float:
    """CPU seconds the CPUs `cpus` spent busy since boot, from a /proc/stat text: user,
    nice, system, irq and softirq of their `cpuN` lines (not idle, iowait, or steal,
    the time another guest of the hypervisor had). Raises ValueError on a line that is
    not /proc/stat's."""
    busy = 0
    for line in stat.splitlines():
        name, _, rest = line.partition(" ")
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
            user, nice, system, _idle, _iowait, irq, softirq = map(int, rest.split()[:7])
            busy += user + nice + system + irq + softirq
    return busy / ticks_per_s


def host_busy_seconds() -> float | None:
    """`busy_seconds` of this process's usable cores now; None where /proc/stat is not."""
    try:
        with open("/proc/stat") as f:
            stat = f.read()
        return busy_seconds(stat, os.sched_getaffinity(0), os.sysconf("SC_CLK_TCK"))
    except (OSError, AttributeError, ValueError):
        return None


class ProcessCpu:
    """A prometheus_client collector of `PROCESS_CPU_METRIC` and `HOST_BUSY_METRIC`
    (from `host_clock`, none when it gives None): the frontend's CPU from `clock` at each
    scrape, the other processes' from their cumulative values in the
    engine's stats. A value below the previous one is a restarted process counting from
    0 again (`stats.cumulative_increment`, the engine counters' rule too)."""

    def __init__(
        self,
        model: str,
        clock: Callable[[], float],
        host_clock: Callable[[], float | None] = host_busy_seconds,
    ) -> None:
        self._model, self._clock, self._host_clock = model, clock, host_clock
        self._totals = dict.fromkeys(PROCESS_CPU.values(), 0.0)
        self._last = dict.fromkeys(PROCESS_CPU.values(), 0.0)

    def update(self, counters) -> None:
        for key, process in PROCESS_CPU.items():
            value = float(getattr(counters, key))
            self._totals[process] += cumulative_increment(value, self._last[process])
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
        if (host := self._host_clock()) is not None:
            family = CounterMetricFamily(
                HOST_BUSY_METRIC, "CPU seconds the host's usable cores spent busy, every "
                "process included (Linux /proc/stat)", labels=["model"],
            )  # fmt: skip
            family.add_metric([self._model], host)
            yield family

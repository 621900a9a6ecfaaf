"""The serving processes' CPU (issue 17 item 5): `jaxserve_process_cpu_seconds_total`
from each process's own clock, and `jaxserve diagnose`'s application (CPU) branch.

The branch is tested on windows of a real metric registry (`observability.metrics.
Metrics`, the frontend's clock replaced by a test's, the engine's stats as the engine
and the sidecar send them), read back from its text exposition as `diagnose` scrapes
it, as in tests/test_diagnose_rules.py; a host of `HOST_CORES` cores, so the shares do
not depend on the machine the tests run on. Oracles: the CPU seconds put in, over the
window's seconds, against the thresholds of `observability.diagnose`. The engine loop's
and the sidecar's clocks are checked against `time.process_time` read around them (they
run as threads here, so their process is the test's). The metric on a running server:
tests/frontend_tests/test_frontend_metrics.py.
"""

from __future__ import annotations

import bisect
import os
import threading
import time

import msgpack
import numpy as np
import pytest
import zmq
from engine_loop_sockets import loop_sockets
from prometheus_client import generate_latest

from jaxserve.ipc import EngineRequest, EngineStats, Shutdown, decode, encode
from jaxserve.observability.diagnose import (
    BUSY,
    PROCESS_CORE_FULL,
    STACK_SHARE,
    Window,
    diagnose_window,
    parse_exposition,
)
from jaxserve.observability.metrics import Metrics
from jaxserve.observability.process_cpu import busy_seconds
from jaxserve.observability.stats import LATENCY_BUCKETS_S, EngineCounters, EngineHistograms
from jaxserve.router.metrics import RouterMetrics

CPU_LAYER = "application (frontend / detokenizer CPU)"
WINDOW_S = 10.0
HOST_CORES = 4
STEPS = 1000
TOKENS = 8000
CPU = "jaxserve_process_cpu_seconds_total"


class _Clock:
    """The frontend's CPU clock, set by the test."""

    def __init__(self) -> None:
        self.value = 0.0

    def __call__(self) -> float:
        return self.value


def _window(
    frontend_s: float,
    detokenizer_s: float,
    engine_s: float = 5.0,
    busy: float = 0.5,
    host_s: float = 1.0,
    replicas: tuple[float, ...] = (),
    host_busy_s: float | None = None,
    queued: int = 0,
) -> Window:
    """A `WINDOW_S` window in which each process used the CPU seconds given, the engine
    loop worked `busy` of the time over `STEPS` steps of `TOKENS` tokens (`host_s` of
    its step time on the host, the rest on the device); `replicas`: each replica's
    sidecar's CPU seconds (router gauges), on the same registry; `host_busy_s`: the
    host's busy CPU seconds, every process included (None: not known, as off Linux);
    `queued`: requests that waited 0.5 s each in the queue, of a TTFT of 0.6 s."""
    clock, host = _Clock(), _Clock()
    metrics = Metrics(
        model="m", cpu_clock=clock, host_clock=lambda: None if host_busy_s is None else host()
    )
    router = RouterMetrics(metrics.registry, "m") if replicas else None
    base = dict(model="m", num_blocks_total=64, num_blocks_free=60)
    start = EngineCounters(process_cpu_s=100.0, detokenizer_cpu_s=20.0)  # before the window
    clock.value = 30.0
    metrics.update_from_engine(EngineStats(counters=start, **base))
    for i in range(len(replicas)):
        router.replica(i, detokenizer_cpu_seconds=10.0)
    first = parse_exposition(generate_latest(metrics.registry).decode())
    end = EngineCounters(
        process_cpu_s=100.0 + engine_s, detokenizer_cpu_s=20.0 + detokenizer_s,
        num_steps=STEPS, decode_steps=STEPS, decode_tokens=TOKENS,
        loop_work_s=busy * WINDOW_S, loop_wait_s=(1 - busy) * WINDOW_S,
        host_time_s=host_s, device_time_s=WINDOW_S * busy - host_s,
    )  # fmt: skip
    clock.value = 30.0 + frontend_s
    host.value = host_busy_s or 0.0
    counts = [0] * (len(LATENCY_BUCKETS_S) + 1)
    counts[bisect.bisect_left(LATENCY_BUCKETS_S, 0.5)] = queued
    queue = EngineHistograms(queue_time_counts=counts, queue_time_sum_s=0.5 * queued)
    metrics.update_from_engine(EngineStats(counters=end, histograms=queue, **base))
    for _ in range(queued):
        metrics.ttft.observe(0.6)
    metrics.generation_tokens.inc(TOKENS)
    for i, seconds in enumerate(replicas):
        router.replica(i, detokenizer_cpu_seconds=10.0 + seconds)
    last = parse_exposition(generate_latest(metrics.registry).decode())
    last["jaxserve_host_usable_cores"] = HOST_CORES  # the host the window was taken on
    peak = {k: max(first.get(k, v), v) for k, v in last.items()}
    return Window(first, last, peak, WINDOW_S)


def _cpu_findings(w: Window):
    return [f for f in diagnose_window(w, "test").findings if f.layer == CPU_LAYER]


# ------------------------------------------------------------------- the metric


def test_each_process_is_counted_from_its_own_clock_across_a_restart():
    clock, host = _Clock(), _Clock()
    metrics = Metrics(model="m", cpu_clock=clock, host_clock=host)
    clock.value = 1.5
    metrics.update_from_engine(
        EngineStats(counters=EngineCounters(process_cpu_s=3.0, detokenizer_cpu_s=1.0))
    )
    # The engine restarted (its clock counts from 0 again): its 0.5 s add to the 3 s.
    metrics.update_from_engine(
        EngineStats(counters=EngineCounters(process_cpu_s=0.5, detokenizer_cpu_s=1.25))
    )
    clock.value, host.value = 2.0, 123.0
    series = parse_exposition(generate_latest(metrics.registry).decode())
    assert series["jaxserve_host_busy_cpu_seconds_total"] == 123.0
    assert series[f'{CPU}{{process="frontend"}}'] == 2.0
    assert series[f'{CPU}{{process="engine"}}'] == 3.5
    assert series[f'{CPU}{{process="detokenizer"}}'] == 1.25
    assert series["jaxserve_host_usable_cores"] == len(os.sched_getaffinity(0))


def test_host_busy_seconds_sum_the_usable_cpus_busy_ticks():
    """user + nice + system + irq + softirq of the CPUs in the set, at 100 ticks/s; the
    all-CPU line, CPUs out of the set, idle, iowait, steal and guest left out."""
    stat = (
        "cpu  999 999 999 999 999 999 999 999 999 999\n"
        "cpu0 100 20 30 5000 70 1 2 300 40 0\n"
        "cpu1 7 0 3 9000 0 0 0 0 0 0\n"
        "cpu2 500 500 500 0 0 0 0 0 0 0\n"
        "intr 12345 0 0\n"
        "ctxt 6789\n"
    )
    assert busy_seconds(stat, {0, 1}, 100) == pytest.approx((153 + 10) / 100)
    assert busy_seconds(stat, set(), 100) == 0.0


def test_stats_of_an_older_peer_without_the_cpu_fields_decode_as_zero():
    """A protocol-1 sidecar's stats (no CPU fields) still apply: the CPU reads 0."""
    kind, fields = msgpack.unpackb(encode(EngineStats(num_running=3)))
    counters = fields["counters"][1]
    del counters["process_cpu_s"], counters["detokenizer_cpu_s"]
    stats = decode(msgpack.packb([kind, fields]))
    assert stats.num_running == 3
    assert (stats.counters.process_cpu_s, stats.counters.detokenizer_cpu_s) == (0.0, 0.0)


class _BurningCore:
    """A core whose steps each burn `STEP_CPU_S` of CPU (a spin on the process clock)."""

    STEP_CPU_S = 0.02

    def __init__(self, steps: int = 5) -> None:
        self.steps_left = 0
        self._steps = steps

    def add_request(self, request) -> None:
        self.steps_left = self._steps

    def abort_requests(self, ids) -> None:
        pass

    def has_work(self) -> bool:
        return self.steps_left > 0

    def step(self):
        end = time.process_time() + self.STEP_CPU_S
        while time.process_time() < end:
            pass
        self.steps_left -= 1
        return []

    def stats(self):
        return EngineStats(num_running=min(self.steps_left, 1))


def _frames(sock):
    while True:
        try:
            yield sock.recv(zmq.NOBLOCK)
        except zmq.Again:
            return


def test_engine_loop_reports_its_process_cpu_time():
    """Five steps of 20 ms of CPU each: the engine's stats carry the process clock, read
    between the clock before the loop started and after it ended, and the last minus
    the first is at least the steps' CPU."""
    from jaxserve.engine.process import EngineLoop

    with loop_sockets("process-cpu") as (to_loop, loop_in, loop_out, from_loop):
        before = time.process_time()
        thread = threading.Thread(target=EngineLoop(_BurningCore(), loop_in, loop_out).run)
        thread.start()
        to_loop.send(encode(EngineRequest("r", np.asarray([1], np.int32), {})))
        time.sleep(0.5)
        to_loop.send(encode(Shutdown("test")))
        thread.join(10)
        after = time.process_time()
        stats = [m for m in map(decode, _frames(from_loop)) if isinstance(m, EngineStats)]
    cpu = [s.counters.process_cpu_s for s in stats]
    assert all(before <= c <= after for c in cpu), (before, cpu, after)
    assert cpu[-1] - cpu[0] >= 5 * _BurningCore.STEP_CPU_S


def test_sidecar_writes_its_cpu_time_into_the_stats_it_forwards(tmp_path):
    from jaxserve.config import DEMO_MODEL_DIR
    from jaxserve.frontend.detokenizer_process import run_detokenizer
    from jaxserve.frontend.tokenizer import load_tokenizer

    detok_in, front_in = f"ipc://{tmp_path}/d", f"ipc://{tmp_path}/f"
    engine_in = f"ipc://{tmp_path}/e"
    ctx = zmq.Context()
    from_sidecar = ctx.socket(zmq.PULL)
    from_sidecar.bind(front_in)
    from_engine = ctx.socket(zmq.PULL)
    from_engine.bind(engine_in)
    to_sidecar = ctx.socket(zmq.PUSH)
    to_sidecar.connect(detok_in)
    before = time.process_time()
    thread = threading.Thread(
        target=run_detokenizer,
        args=(load_tokenizer(DEMO_MODEL_DIR), detok_in, front_in, engine_in),
    )
    thread.start()
    to_sidecar.send(encode(EngineStats(num_running=2, counters=EngineCounters(num_steps=7))))
    forwarded = None
    while forwarded is None:
        assert from_sidecar.poll(10_000), "the sidecar forwarded no stats"
        msg = decode(from_sidecar.recv())
        forwarded = msg if isinstance(msg, EngineStats) else None
    to_sidecar.send(encode(Shutdown("test")))
    thread.join(10)
    after = time.process_time()
    for s in (from_sidecar, from_engine, to_sidecar):
        s.close(linger=0)
    ctx.term()
    assert (forwarded.num_running, forwarded.counters.num_steps) == (2, 7)
    assert before <= forwarded.counters.detokenizer_cpu_s <= after


# ------------------------------------------------------------------- the branch


def test_a_frontend_at_the_core_threshold_is_the_suspect():
    """0.8 of a core (8 CPU s in 10 s) names the frontend even with an idle engine loop:
    a saturated frontend starves the engine of requests."""
    cores = PROCESS_CORE_FULL * WINDOW_S
    result = diagnose_window(_window(frontend_s=cores, detokenizer_s=1.0), "test")
    assert result.layer == CPU_LAYER
    finding = result.findings[0]
    assert "frontend process is near a whole core" in finding.symptom
    n = finding.numbers
    assert n["frontend_cores"] == pytest.approx(PROCESS_CORE_FULL)
    assert n["detokenizer_cores"] == pytest.approx(0.1)
    assert n["engine_cores"] == pytest.approx(0.5)
    assert n["host_cores"] == HOST_CORES
    assert n["non_engine_share_of_host"] == pytest.approx(0.9 / HOST_CORES)
    assert n["frontend_cpu_us_per_token"] == pytest.approx(cores * 1e6 / TOKENS)
    assert n["detokenizer_cpu_us_per_token"] == pytest.approx(1.0 * 1e6 / TOKENS)
    assert "--stream-interval" in finding.next and "off the server" in finding.next
    assert result.summary["frontend_cores"] == pytest.approx(PROCESS_CORE_FULL)


def test_a_sidecar_at_the_core_threshold_is_the_suspect():
    w = _window(frontend_s=1.0, detokenizer_s=PROCESS_CORE_FULL * WINDOW_S)
    (finding,) = _cpu_findings(w)
    assert "detokenizer sidecar process is near a whole core" in finding.symptom


def test_just_below_the_core_threshold_with_an_idle_engine_names_nothing():
    below = PROCESS_CORE_FULL * WINDOW_S - 0.1
    assert diagnose_window(_window(frontend_s=below, detokenizer_s=1.0), "test").findings == []
    assert diagnose_window(_window(frontend_s=1.0, detokenizer_s=below), "test").findings == []


def test_the_stack_share_with_a_saturated_engine_is_named():
    """Frontend 0.6 + sidecar 0.4 core = a quarter of 4 cores, neither near a core,
    with the engine loop at 95%: named; 0.01 core less is not."""
    at = STACK_SHARE * HOST_CORES * WINDOW_S  # CPU seconds of the two together
    busy = BUSY + 0.05
    (finding,) = _cpu_findings(_window(frontend_s=0.6 * at, detokenizer_s=0.4 * at, busy=busy))
    assert "large share of the host's cores (most: the frontend)" in finding.symptom
    assert finding.numbers["non_engine_share_of_host"] == pytest.approx(STACK_SHARE)
    assert finding.numbers["engine_busy"] == pytest.approx(busy)
    below = _window(frontend_s=0.6 * at, detokenizer_s=0.4 * at - 0.1, busy=busy)
    assert _cpu_findings(below) == []


def test_the_stack_share_with_an_engine_that_keeps_up_names_nothing():
    at = STACK_SHARE * HOST_CORES * WINDOW_S
    w = _window(frontend_s=0.6 * at, detokenizer_s=0.4 * at, busy=BUSY - 0.05)
    assert diagnose_window(w, "test").findings == []


def test_a_process_near_a_core_ranks_before_the_queue_and_host_gaps():
    """A saturated engine whose steps are host time (host gaps on its own), requests
    queued (the queue on its own), and a frontend near a core: the frontend is the
    suspect, the queue and host gaps come after."""
    w = _window(frontend_s=9.0, detokenizer_s=1.0, busy=0.95, host_s=8.0, queued=10)
    layers = [f.layer for f in diagnose_window(w, "test").findings]
    assert layers == [CPU_LAYER, "scheduling (queue)", "scheduling (host gaps)"]


def test_a_shared_host_ranks_after_the_queue_and_before_host_gaps():
    """The same with a quarter of the host beside the engine but no process near a
    core: requests beyond the engine's slots queue however fast it runs, so the queue
    is the suspect; the shared host comes before host gaps (an engine short of cores
    shows longer host time)."""
    at = STACK_SHARE * HOST_CORES * WINDOW_S
    w = _window(frontend_s=0.6 * at, detokenizer_s=0.4 * at, busy=0.95, host_s=8.0, queued=10)
    layers = [f.layer for f in diagnose_window(w, "test").findings]
    assert layers == ["scheduling (queue)", CPU_LAYER, "scheduling (host gaps)"]


def test_each_replicas_sidecar_is_judged_alone():
    """Two replicas' sidecars at 0.45 core each: 0.9 core in all, but neither near a
    whole core (and with the frontend's 0.1 a quarter of the host, but the engine keeps
    up): nothing. One at 0.85 and one at 0.05: named, with the busiest sidecar's cores."""
    w = _window(frontend_s=1.0, detokenizer_s=9.0, replicas=(4.5, 4.5))
    assert _cpu_findings(w) == []
    (finding,) = _cpu_findings(_window(frontend_s=1.0, detokenizer_s=9.0, replicas=(8.5, 0.5)))
    assert "detokenizer sidecar" in finding.symptom
    assert finding.numbers["detokenizer_max_cores"] == pytest.approx(0.85)


def test_a_server_without_the_metric_gets_no_cpu_numbers():
    """An older server (no process CPU series): no summary numbers, no finding."""
    w = _window(frontend_s=9.0, detokenizer_s=1.0)
    for scrape in (w.first, w.last, w.peak):
        for key in [k for k in scrape if k.startswith(CPU)]:
            del scrape[key]
    result = diagnose_window(w, "test")
    assert result.findings == [] and "frontend_cores" not in result.summary


def test_other_processes_on_the_host_count_in_the_share():
    """Frontend 0.3 + sidecar 0.1 core (a tenth of 4 cores) beside an engine of 2.0 and
    a host busy 3.0 cores: 0.6 core is another process's (a load client), and the three
    make a quarter of the host: named, the other processes the largest. Unknown host
    busy time (off Linux): the tenth alone, nothing."""
    parts = dict(frontend_s=3.0, detokenizer_s=1.0, engine_s=20.0, busy=BUSY + 0.05)
    at = STACK_SHARE * HOST_CORES * WINDOW_S + 20.0  # the host's busy CPU seconds
    (finding,) = _cpu_findings(_window(**parts, host_busy_s=at))
    assert "(most: other processes" in finding.symptom
    assert finding.numbers["other_processes_cores"] == pytest.approx(0.6)
    assert finding.numbers["non_engine_share_of_host"] == pytest.approx(STACK_SHARE)
    assert _cpu_findings(_window(**parts, host_busy_s=at - 0.1)) == []
    assert _cpu_findings(_window(**parts)) == []

"""The serving frontend's logs: the periodic stats line (vLLM's format) from the
engine's stats, the preemption warning, the start-up configuration block, and both in a
running server (mock engine)."""

from __future__ import annotations

import logging
import re
import time
import urllib.request

import pytest

from jaxserve.config import EngineConfig, MeshConfig, ServerConfig
from jaxserve.ipc import EngineStats
from jaxserve.observability.stats import EngineCounters
from jaxserve.serve_log import StatsLogger, config_block


def _stats(prefill=0, decode=0, queries=0, hits=0, preemptions=0, running=0, waiting=0, free=100):
    return EngineStats(
        model="m", max_model_len=64, block_size=16, num_blocks_total=100, num_blocks_free=free,
        num_running=running, num_waiting=waiting, ready=True,
        counters=EngineCounters(
            prefill_tokens=prefill, decode_tokens=decode, prefix_cache_queries=queries,
            prefix_cache_hits=hits, num_preemptions=preemptions,
        ),
    )  # fmt: skip


def test_stats_line_rates_over_the_interval():
    log = StatsLogger(clock=lambda: 0.0)
    log.update(_stats(prefill=10, decode=5, queries=10, hits=0))  # the ready handshake
    log.update(_stats(prefill=110, decode=45, queries=60, hits=20, running=3, waiting=1, free=75))
    line = log.line(now=2.0)
    assert line == (
        "Avg prompt throughput: 50.0 tokens/s, Avg generation throughput: 20.0 tokens/s, "
        "Running: 3 reqs, Waiting: 1 reqs, KV cache usage: 25.0%, "
        "Prefix cache hit rate: 40.0%, Preemptions: 0"
    )
    # Next interval: nothing computed, requests still held -> a line with zero rates.
    log.update(_stats(prefill=110, decode=45, queries=60, hits=20, running=3, free=75))
    assert "Avg generation throughput: 0.0 tokens/s" in log.line(now=4.0)
    # All done: one idle line (the server is idle again), then silence.
    log.update(_stats(prefill=110, decode=45, queries=60, hits=20))
    assert "Running: 0 reqs" in log.line(now=6.0)
    assert log.line(now=8.0) is None


def test_no_line_before_any_work_and_hit_rate_since_start_when_none_looked_up():
    log = StatsLogger(clock=lambda: 0.0)
    assert log.line(now=1.0) is None  # no stats yet
    log.update(_stats(queries=10, hits=5))
    assert log.line(now=2.0) is None  # idle
    log.update(_stats(queries=10, hits=5, decode=8, running=1))
    assert "Prefix cache hit rate: 50.0%" in log.line(now=3.0)


def test_preemptions_warn_saying_what_to_raise(caplog):
    log = StatsLogger(clock=lambda: 0.0)
    log.update(_stats(preemptions=2))
    log.update(_stats(preemptions=5, decode=10, running=2))
    with caplog.at_level(logging.WARNING, logger="jaxserve.stats"):
        line = log.line(now=10.0)
    assert line.endswith("Preemptions: 3")
    (record,) = caplog.records
    assert record.levelno == logging.WARNING and "3 request(s) preempted" in record.message
    assert "--num-blocks" in record.message and "--max-num-seqs" in record.message


def test_config_block_names_what_the_engine_settled_on():
    engine = EngineConfig(model="/m/demo", mesh=MeshConfig(dp=2, tp=1))
    server = ServerConfig(host="::1", port=0, metrics_port=9090)
    block = config_block(engine, server, _stats(), grpc_port=4321)
    assert "100 usable blocks x 16 tokens = 1600 tokens (50 per dp rank)" in block
    assert "dp=2, tp=1" in block and "[::1]:4321" in block
    assert "http://[::1]:9090/metrics" in block and "64 tokens" in block
    # With TLS the metrics port speaks HTTPS only: the URL says so.
    block = config_block(engine, server, _stats(), grpc_port=4321, tls=True)
    assert "https://[::1]:9090/metrics" in block


@pytest.mark.parametrize(
    "host,want",
    [("::1", "[::1]:80"), ("[::1]", "[::1]:80"), ("::", "[::]:80"),
     ("127.0.0.1", "127.0.0.1:80"), ("localhost", "localhost:80")],
)  # fmt: skip
def test_host_port_brackets_ipv6_literals_only(host, want):
    """The one HOST:PORT of the log lines and the config block (an IPv6 literal's colons
    would run into the port's: "::1:80")."""
    from jaxserve.frontend.server_address import join_host_port

    assert join_host_port(host, 80) == want


def test_config_block_names_the_stream_interval_and_the_http_api():
    """The block listed neither --stream-interval nor the --http-port API address."""
    from jaxserve.config import SchedulerConfig

    engine = EngineConfig(model="/m/demo", scheduler=SchedulerConfig(stream_interval=7))
    server = ServerConfig(host="::1", port=0, http_port=0)
    block = config_block(engine, server, _stats(), grpc_port=4321, http_port=8123)
    assert "stream interval 7 token(s)" in block
    lines = block.splitlines()
    after_grpc = lines[next(i for i, line in enumerate(lines) if "gRPC" in line) + 1]
    assert "HTTP API" in after_grpc and "http://[::1]:8123/v1" in after_grpc  # the bound port
    tls = config_block(engine, server, _stats(), grpc_port=4321, tls=True, http_port=8123)
    assert "https://[::1]:8123/v1" in tls
    assert "HTTP API" not in config_block(engine, ServerConfig(port=0), _stats(), 4321)


def test_config_block_says_eplb_is_off_on_one_device():
    # The engine turns EPLB and redundant experts off on one device (check_eplb): the
    # block says so, not what was asked for.
    from jaxserve.config import EplbConfig

    server = ServerConfig(port=0)
    for eplb in (EplbConfig(enabled=True), EplbConfig(num_redundant_experts=3)):
        block = config_block(EngineConfig(model="/m/demo", eplb=eplb), server, _stats(), 1)
        assert "EPLB" in block
        assert "off (needs an expert-parallel mesh, dp*tp > 1; 0 redundant experts)" in block
    eplb = EplbConfig(enabled=True, num_redundant_experts=2)
    on_mesh = EngineConfig(model="/m/demo", mesh=MeshConfig(dp=2), eplb=eplb)
    assert "on (window 1000 steps, every 3000 steps, 2 redundant experts)" in config_block(
        on_mesh, server, _stats(), 1
    )
    off = config_block(EngineConfig(model="/m/demo"), server, _stats(), 1)
    assert "off (0 redundant experts)" in off and "expert-parallel" not in off


def test_config_block_names_the_async_scheduling_the_engine_resolved():
    from jaxserve.config import SchedulerConfig

    server = ServerConfig(port=0)
    auto = EngineConfig(model="/m/demo")  # async_scheduling None: the backend's default
    stats = _stats()
    stats.async_scheduling = False  # what a CPU engine resolved
    assert "async scheduling off (the backend's default)" in config_block(auto, server, stats, 1)
    forced = EngineConfig(model="/m/demo", scheduler=SchedulerConfig(async_scheduling=True))
    stats.async_scheduling = True
    block = config_block(forced, server, stats, 1)
    assert "async scheduling on," in block and "default" not in block.split("async")[1][:20]
    # Stats that do not say (an older engine): the rule, not a guess.
    assert "async scheduling auto (on for an accelerator" in config_block(auto, server, _stats(), 1)


def test_a_running_server_logs_its_config_and_stats(mock_model_dir):
    from server_harness import ServerProcess

    from jaxserve.frontend.client import JaxserveClient

    model = mock_model_dir
    srv = ServerProcess(
        model,
        extra_args=(
            "--engine-class", "mock_engine:MockEngineCore", "--stats-log-interval", "0.2",
            "--metrics-port", "0",
        ),
        env={"JAXSERVE_MOCK_STEP_DELAY_S": "0.05"},
    ).wait_ready()  # fmt: skip
    try:
        with JaxserveClient(srv.target) as client:
            client.complete([5, 6], max_tokens=20)
        deadline = time.monotonic() + 10
        while "Running: 0 reqs" not in srv.log() and time.monotonic() < deadline:
            time.sleep(0.1)
        log = srv.log()
        assert "configuration:" in log and "KV cache" in log and "gRPC" in log
        assert "Running: 1 reqs" in log and "Running: 0 reqs" in log
        # --metrics-port 0: the block names the port bound, and /metrics answers there.
        url = re.search(r"metrics\s*:?\s*(http://\S+/metrics)", log).group(1)
        assert not url.endswith(":0/metrics")
        with urllib.request.urlopen(url, timeout=10) as resp:
            assert b"jaxserve_" in resp.read()
    finally:
        srv.terminate(15)


@pytest.mark.parametrize("flag", [("--disable-log-stats",), ("--stats-log-interval", "0")])
def test_stats_lines_can_be_turned_off(flag):
    from jaxserve.cli import build_parser

    args = build_parser().parse_args(["serve", *flag])
    assert (0.0 if args.disable_log_stats else args.stats_log_interval) == 0.0


def test_progress_log_reports_each_quarter(caplog):
    from jaxserve.logs import ProgressLog

    with caplog.at_level(logging.INFO, logger="jaxserve.test"):
        progress = ProgressLog(logging.getLogger("jaxserve.test"), "compiling", 8, "shapes")
        for _ in range(8):
            progress.advance()
    counts = [r.getMessage().split(": ")[1].split(" ")[0] for r in caplog.records]
    assert counts == ["0/8", "2/8", "4/8", "6/8", "8/8"]


# ---------------------------------------------------------------- held start lines


def _holder(stream, name: str, **kwargs):
    """A StartLogHold of process `name` writing "[name] message" lines to `stream` (the
    stderr that serve's processes share); a long hold: only the test ends it."""
    import io

    from jaxserve.start_log_hold import StartLogHold

    target = logging.StreamHandler(stream or io.StringIO())
    target.setFormatter(logging.Formatter(f"[{name}] %(message)s"))
    return StartLogHold(target, hold_s=600, **kwargs)


def _log(hold, created: float, message: str, level: int = logging.INFO) -> None:
    hold.handle(logging.makeLogRecord({"msg": message, "levelno": level, "created": created}))


def _wait_for(stream, lines: int) -> list[str]:
    deadline = time.monotonic() + 10
    while stream.getvalue().count("\n") < lines and time.monotonic() < deadline:
        time.sleep(0.01)
    return stream.getvalue().splitlines()


def test_a_held_warning_keeps_its_place_and_a_failed_start_prints_only_warnings():
    """A warning was printed at once, before the older INFO lines held with it; now it is
    held too and printed in its place. A failed start still shows its warnings (and then
    its cause), not its INFO lines."""
    import io

    for succeeded, expected in ((True, ["a", "warn", "b"]), (False, ["warn"])):
        stream = io.StringIO()
        hold = _holder(stream, "frontend")
        _log(hold, 1.0, "a")
        _log(hold, 2.0, "warn", logging.WARNING)
        _log(hold, 3.0, "b")
        assert stream.getvalue() == ""
        hold.let_go() if succeeded else hold.drop()
        _log(hold, 4.0, "after")  # the start is over: passed on at once
        assert stream.getvalue().splitlines() == [f"[frontend] {m}" for m in [*expected, "after"]]


def test_a_warning_about_the_running_server_is_forgotten_by_a_failed_start():
    """`jaxserve serve --http-port` of a model without a chat template whose engine failed
    printed "the model has no chat template" above the failure's cause, which read as its
    reason: such a warning (extra=IF_SERVING) keeps its place in a start that succeeds,
    and a failed one drops it with the INFO lines, keeping its other warnings."""
    import io

    from jaxserve.start_log_hold import IF_SERVING

    for succeeded, expected in ((True, ["a", "no template", "warn"]), (False, ["warn"])):
        stream = io.StringIO()
        hold = _holder(stream, "frontend")
        _log(hold, 1.0, "a")
        record = logging.makeLogRecord(
            {"msg": "no template", "levelno": logging.WARNING, "created": 2.0, **IF_SERVING}
        )
        hold.handle(record)
        _log(hold, 3.0, "warn", logging.WARNING)
        hold.let_go() if succeeded else hold.drop()
        assert stream.getvalue().splitlines() == [f"[frontend] {m}" for m in expected]


def test_the_frontend_prints_a_childs_held_lines_with_its_own_in_timestamp_order(tmp_path):
    """The engine, ready first, printed its held block before the frontend's older lines.
    Now it hands its lines over and the frontend prints all of them by timestamp; what
    the engine logs meanwhile waits until they are out. The expected order is the
    records' own `created` times."""
    import io

    stderr = io.StringIO()
    frontend = _holder(stderr, "frontend")
    frontend.collect(str(tmp_path))
    engine = _holder(stderr, "engine", handover_dir=str(tmp_path))
    _log(frontend, 1.0, "admission limits")
    _log(engine, 2.0, "loading weights")
    _log(frontend, 3.0, "gRPC listening")
    _log(engine, 4.0, "engine ready")
    engine.start_succeeded()  # handed over: nothing printed yet
    _log(engine, 6.0, "compiling in the background")  # after the handover: held
    _log(frontend, 5.0, "jaxserve ready")
    assert stderr.getvalue() == ""
    frontend.start_succeeded()
    assert _wait_for(stderr, 6) == [
        "[frontend] admission limits",
        "[engine] loading weights",
        "[frontend] gRPC listening",
        "[engine] engine ready",
        "[frontend] jaxserve ready",
        "[engine] compiling in the background",
    ]
    assert list(tmp_path.iterdir()) == [tmp_path / "start-logs.released"]  # files taken


def test_a_child_ready_after_the_frontend_or_not_collected_prints_its_own(tmp_path, monkeypatch):
    import io

    from jaxserve import start_log_hold

    monkeypatch.setattr(start_log_hold, "HANDOVER_WAIT_S", 0.2)
    nobody = io.StringIO()  # a frontend that never collects: printed after the wait
    child = _holder(nobody, "engine", handover_dir=str(tmp_path))
    _log(child, 1.0, "loading weights")
    child.start_succeeded()
    assert nobody.getvalue() == ""
    assert _wait_for(nobody, 1) == ["[engine] loading weights"]

    frontend = _holder(io.StringIO(), "frontend")
    frontend.collect(str(tmp_path))
    frontend.start_succeeded()  # released: a replica ready later prints its own at once
    late = io.StringIO()
    replica = _holder(late, "replica 1", handover_dir=str(tmp_path))
    _log(replica, 9.0, "engine ready")
    replica.start_succeeded()
    assert late.getvalue().splitlines() == ["[replica 1] engine ready"]

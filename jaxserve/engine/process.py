"""The engine process: a busy loop around `EngineCore`, between ZeroMQ sockets.

    python -m jaxserve.engine.process --config-json '{...}' --engine-input ipc://... \
        --detokenizer-input ipc://... --parent-pid N

Loop (README.md, Architecture): drain aborts (the control socket, first) and new
requests without blocking, abort requests whose deadline passed, run one step, publish
its outputs to the detokenizer sidecar; a Heartbeat goes out every
`control.HEARTBEAT_INTERVAL_S`, idle or not (`jaxserve.engine.control`). While there is
work, nothing waits on a socket; only an idle engine blocks, in `poll`. Stats (the ready
handshake at start, then changes, at most every `stats_interval_s` while busy and always
on going idle; idle, the loop's clocks every `IDLE_CLOCKS_S`) travel on the outputs socket
so they stay ordered with outputs.

KV events (`engine.kv_events`, for the router) go out after each step on their own
socket (`--kv-events`), and a `KvSnapshotRequest` on the control path is answered there
with a snapshot, after the pending events. A send the socket cannot take now is dropped:
the router sees the gap in the event numbers and asks for a snapshot.

Profiling (`jaxserve profile`): a `ProfileRequest` on the control socket starts an
`observability.profile.ProfileSession` (a JAX trace and the loop's host timeline), which
the loop ends once its seconds are over; the loop's own time blocked in poll versus
working is counted for the metrics (`EngineCounters.loop_wait_s` / `loop_work_s`), and
so is the process's CPU time (`EngineCounters.process_cpu_s`).

The engine class is pluggable (`--engine-class module:Class`) so that the whole server
runs on a mock engine in tests; only the default class imports JAX.

Several processes: this process leads (its core's executor is process 0's, from
`jaxserve.distributed.processes`, which also runs the others and says how every process of
the run ends when one is gone).
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import signal
import sys
import time
from typing import Any

import zmq

from jaxserve import distributed
from jaxserve.config import EngineConfig, resolve_burst_gather_ms
from jaxserve.distributed.processes import (
    EXIT_START_FAILED,
    EXIT_STEP_FAILED,
    PEER_LOSS_GRACE_S,
    exit_now,
    leader_executor,
)
from jaxserve.engine.control import EngineControl
from jaxserve.engine.stream_interval import OutputCoalescer
from jaxserve.ipc import (
    AbortRequest,
    EngineOutputs,
    EngineRequest,
    EngineStats,
    Heartbeat,
    KvSnapshot,
    KvSnapshotRequest,
    ProfileRequest,
    Shutdown,
    TokenOutput,
    decode,
    encode,
    make_socket,
)
from jaxserve.lifetime import die_with_parent, ignore_sigint
from jaxserve.logs import (
    START_ERROR_FILE_ENV,
    configure_logging,
    describe_error,
    release_start_logs,
    report_start_failure,
)
from jaxserve.observability.profile import TIMELINE, ProfileSession

logger = logging.getLogger("jaxserve.engine")

DEFAULT_ENGINE_CLASS = "jaxserve.engine.core:EngineCore"
# An idle engine wakes this often even without messages (ms); parent death is handled
# by jaxserve.lifetime, so this only bounds how stale nothing can be.
_IDLE_POLL_MS = 1000
IDLE_CLOCKS_S = 1.0  # an idle loop sends its clocks (wait, work, CPU) this often
# The longest an idle engine gathers a burst of requests before its first step
# (`SchedulerConfig.burst_gather_ms`), seconds.
BURST_GATHER_MAX_S = 0.1


def load_engine_class(path: str) -> type:
    """Import "package.module:ClassName". Raises ValueError on a malformed path."""
    module_name, sep, class_name = path.partition(":")
    if not sep or not module_name or not class_name:
        raise ValueError(f"engine_class: expected 'module:Class', got {path!r}")
    return getattr(importlib.import_module(module_name), class_name)


class EngineLoop:
    """Runs an engine core against its input and output sockets until Shutdown.

    core: an object with EngineCore's interface (add_request, abort_requests, has_work,
        step, stats; optionally request_counts, which lets a step whose stats are not
        due skip building them, and idle_work, called while it has no work, one short
        piece a call, returning whether more is pending).
    stream_interval: tokens a running request's output message carries at least
        (`engine.stream_interval`); 1 publishes every step's outputs as they are.
    burst_gather_ms: `SchedulerConfig.burst_gather_ms` (0: none).
    """

    def __init__(
        self,
        core: Any,
        input_socket: zmq.Socket,
        output_socket: zmq.Socket,
        *,
        stats_interval_s: float = 0.02,
        control_socket: zmq.Socket | None = None,
        control: EngineControl | None = None,
        kv_events_socket: zmq.Socket | None = None,
        stream_interval: int = 1,
        burst_gather_ms: float = 0.0,
    ) -> None:
        self._core = core
        self._burst_gather_ms = burst_gather_ms
        self._coalescer = OutputCoalescer(stream_interval)
        self._kv_socket = kv_events_socket
        self._kv_log = None
        if kv_events_socket is not None:
            from jaxserve.engine import kv_events  # noqa: PLC0415

            self._kv_log = kv_events.attach(core)
        self._control_socket = control_socket
        self._control = control or EngineControl()
        self._input = input_socket
        self._output = output_socket
        self._stats_interval_s = stats_interval_s
        self._poller = zmq.Poller()
        self._poller.register(input_socket, zmq.POLLIN)
        if control_socket is not None:
            self._poller.register(control_socket, zmq.POLLIN)
        self._last_stats: EngineStats | None = None
        self._last_stats_time = 0.0
        self._step = 0
        self._running = True
        # Loop wait (blocked in poll, idle) vs work, seconds since start (layer metrics).
        self._wait_s = 0.0
        self._started = time.perf_counter()
        self._profile: ProfileSession | None = None  # `jaxserve profile`, while it runs

    def run(self) -> None:
        """Send the ready handshake, then loop until a Shutdown message arrives."""
        self._send_stats(force=True)
        while self._running:
            idle = not self._core.has_work()
            if idle:
                self._flush_kv_events()
                self._send_stats()  # the idle gauges (e.g. all blocks free) always arrive
                idle_work = getattr(self._core, "idle_work", None)
                more = idle_work() if idle_work is not None else False
                waited = time.perf_counter()
                timeout = self._control.poll_timeout_ms(time.time(), time.monotonic())
                self._wait(0 if more else min(_IDLE_POLL_MS, timeout))
                TIMELINE.span("poll (idle)", waited)
            t = TIMELINE.now()
            self._drain_inputs()
            if idle and self._burst_gather_ms > 0 and self._core.has_work():
                self._gather_burst()
            TIMELINE.span("drain inputs", t)
            self._tick()
            if self._running and self._core.has_work():
                self._run_step()
        if self._profile is not None and self._profile.done is False:
            if TIMELINE.active:
                self._profile.finish()  # shutting down: write what was captured, now

    def _gather_burst(self) -> None:
        """Take the requests that keep arriving, each within burst_gather_ms of the last
        (BURST_GATHER_MAX_S at most in all), before the first step after idleness: a
        burst of requests (a client's batch, a wave of a load test) is prefilled in one
        step instead of a step per few arrivals, each of which would also run the
        earlier arrivals' decode one token at a time (no multi-step decode beside a
        prefill). The idea of TensorRT-LLM's batch_wait_timeout_ms, which waits for a
        full batch instead; this waits only while requests keep coming."""
        end = time.monotonic() + BURST_GATHER_MAX_S
        while self._running:
            left_ms = (end - time.monotonic()) * 1000
            if left_ms <= 0:
                return
            if not self._wait(min(self._burst_gather_ms, left_ms)):
                return
            self._drain_inputs()

    def _wait(self, timeout_ms: float) -> bool:
        """Block in poll for input up to timeout_ms, counted as the loop's wait (not its
        work); whether any input is ready."""
        waited = time.perf_counter()
        ready = self._poller.poll(timeout_ms)
        self._wait_s += time.perf_counter() - waited
        return bool(ready)

    def _drain_inputs(self) -> None:
        """Take every message queued: aborts (the control path) first, then requests."""
        if self._control_socket is not None:
            self._drain_input(self._control_socket)
        self._drain_input()

    def _tick(self) -> None:
        """Abort the requests whose deadline passed; send the heartbeat when due."""
        expired = self._control.expired(time.time())
        if expired:
            logger.info("aborting %d request(s) past their deadline", len(expired))
            self._core.abort_requests(expired)
        if self._control.heartbeat_due(time.monotonic()):
            self._output.send(encode(Heartbeat("engine", time.time())))
        profile = self._profile
        if profile is not None:
            if profile.done:
                self._profile = None
            elif TIMELINE.active and profile.due(time.monotonic()):
                profile.stop()  # the trace is written by a thread; the loop goes on

    def _drain_input(self, sock: zmq.Socket | None = None) -> None:
        sock = self._input if sock is None else sock
        while self._running:
            try:
                frame = sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                msg = decode(frame)
            except Exception:
                logger.exception("dropping an undecodable message")
                continue
            self._handle(msg)

    def _handle(self, msg: Any) -> None:
        if isinstance(msg, EngineRequest):
            self._add_request(msg)
        elif isinstance(msg, AbortRequest):
            self._control.aborted(msg.request_ids)
            self._core.abort_requests(msg.request_ids)
        elif isinstance(msg, KvSnapshotRequest):
            self._send_kv_snapshot()
        elif isinstance(msg, ProfileRequest):
            if self._profile is not None:  # one at a time: the newer one waits its turn
                logger.warning("profile: a capture is running; ignoring one into %s", msg.out_dir)
            else:
                self._profile = ProfileSession(
                    msg.out_dir, msg.seconds, jax_trace="jax" in sys.modules
                )
        elif isinstance(msg, Shutdown):
            logger.info("shutting down: %s", msg.reason or "requested")
            self._running = False
        else:
            logger.warning("ignoring unexpected %s", type(msg).__name__)

    def _add_request(self, request: EngineRequest) -> None:
        # EngineCore reports bad requests as error outputs; should it raise anyway, only
        # this request fails, never the engine and the other requests.
        if not self._control.admit(request.request_id, request.deadline):
            return  # aborted before it arrived (the abort overtook it)
        try:
            self._core.add_request(request)
        except Exception as e:
            logger.exception("add_request failed for %s", request.request_id)
            error = TokenOutput(request.request_id, [], finish_reason="error", error=f"engine: {e}")
            self._output.send(encode(EngineOutputs([error], self._step)))

    def _run_step(self) -> None:
        t = TIMELINE.now()
        outputs = self._coalescer.take(self._core.step())
        TIMELINE.span("step", t)
        self._step += 1
        if self._profile is not None and TIMELINE.active:
            self._profile.steps += 1
        t = TIMELINE.now()
        self._control.finished(o.request_id for o in outputs if o.finish_reason is not None)
        if outputs:
            self._output.send(encode(EngineOutputs(outputs, self._step, time.time())))
        self._flush_kv_events()
        self._send_stats(rate_limited=True)
        TIMELINE.span("send outputs", t)

    def _send_kv(self, msg: Any) -> None:
        try:
            self._kv_socket.send(encode(msg), zmq.NOBLOCK)
        except zmq.Again:
            pass  # dropped: the router sees the gap and asks for a snapshot

    def _flush_kv_events(self) -> None:
        if self._kv_log is not None:
            self._kv_log.flush(self._send_kv)

    def _send_kv_snapshot(self) -> None:
        if self._kv_socket is None:
            return
        if self._kv_log is None:  # no prefix cache to report: an empty one, for good
            self._send_kv(KvSnapshot(0, -1, []))
            return
        self._flush_kv_events()
        self._send_kv(self._kv_log.snapshot())

    def _send_stats(self, force: bool = False, rate_limited: bool = False) -> None:
        """Send the stats if they changed. Rate-limited sends skip gauge-only changes (KV
        blocks) within `stats_interval_s`; a change of the running/waiting counts goes out
        at once, so a client sees its request counted by the time its tokens arrive."""
        now = time.monotonic()
        last = self._last_stats
        due = last is None or now - self._last_stats_time >= self._stats_interval_s
        if rate_limited and not due:
            # Not due: only a change of the request counts goes out, and the core can say
            # that without building the stats (20-40 us a step at batch 1: the
            # counters, histograms and expert-load gauges).
            counts = getattr(self._core, "request_counts", None)
            if counts is not None and counts() == (last.num_running, last.num_waiting):
                return
        stats = self._core.stats()
        stats.ready = True
        counters = stats.counters
        counters.requests_expired = self._control.num_expired
        if last is not None:  # the loop's clocks alone are no change worth a message
            counters.loop_wait_s = last.counters.loop_wait_s
            counters.loop_work_s = last.counters.loop_work_s
            counters.process_cpu_s = last.counters.process_cpu_s
        # Idle, the stats do not change, but the loop's clocks do: they go out every
        # IDLE_CLOCKS_S, so that the wait and CPU counters advance while the engine
        # waits (a diagnose window after a load ended took it for saturated).
        clocks_due = not rate_limited and now - self._last_stats_time >= IDLE_CLOCKS_S
        if not force and stats == last and not clocks_due:
            return
        counters.loop_wait_s = self._wait_s
        counters.loop_work_s = time.perf_counter() - self._started - self._wait_s
        counters.process_cpu_s = time.process_time()  # all threads (XLA's too)
        if (
            rate_limited
            and not due
            and (stats.num_running, stats.num_waiting) == (last.num_running, last.num_waiting)
        ):
            return
        self._output.send(encode(stats))
        self._last_stats, self._last_stats_time = stats, now


def _platform() -> str:
    """JAX's platform of the engine's devices; "none" for an engine class without JAX
    (the mock engine of the tests)."""
    if "jax" not in sys.modules:
        return "none"
    import jax  # noqa: PLC0415

    return jax.devices()[0].platform


def run_engine_process(
    config: EngineConfig,
    engine_input: str,
    detokenizer_input: str,
    engine_class: str,
    dist: distributed.DistributedConfig | None = None,
    engine_control: str | None = None,
    kv_events: str | None = None,
    connect_input: bool = False,
    connect_control: tuple[str, ...] = (),
) -> int:
    """Build the engine core, then serve until Shutdown. Returns the exit code.

    engine_control: the control path's address (AbortRequests; bound here), or None.
    kv_events: the router's KV events address (connected to), or None: no events.
    connect_input / connect_control: a replica on another host (`router.headless`): its
        request queue connects to `engine_input`, bound by the frontend, and its control
        socket connects to these frontend-bound addresses too (aborts, snapshot
        requests), besides `engine_control` bound here for its sidecar.

    dist: the multi-process run this engine leads (process 0), or None. The leader
        publishes every step to the followers (`distributed.processes.run_follower`) and
        stops them on exit;
        should a follower be gone, this process exits at once with EXIT_PEER_LOST.

    A failure to start (bad model folder, out of memory) logs the error and returns 2; a
    failure inside a step logs it and returns 1 (the frontend then reports UNAVAILABLE),
    or, leading several processes, exits with 1 at once (`exit_now`, no STOP: the
    followers may be stuck in the failed step's collectives; they see the leader gone).
    """
    ctx = zmq.Context()
    input_socket = make_socket(ctx, zmq.PULL, engine_input, bind=not connect_input)
    output_socket = make_socket(ctx, zmq.PUSH, detokenizer_input, bind=False)
    control_socket = (
        make_socket(ctx, zmq.PULL, engine_control, bind=True) if engine_control else None
    )
    for address in connect_control:
        if control_socket is None:
            raise ValueError("connect-control: needs --engine-control (the local control path)")
        control_socket.connect(address)
    kv_socket = make_socket(ctx, zmq.PUSH, kv_events, bind=False) if kv_events else None
    core = None
    try:
        try:
            cls = load_engine_class(engine_class)
            if dist is not None and dist.num_processes > 1:
                core = cls(config, executor=leader_executor(dist))
            else:
                core = cls(config)
        except Exception as e:
            report_start_failure("engine", e, logger)  # one line; traceback at DEBUG
            if dist is not None and dist.num_processes > 1:
                # Tell the followers while this process (the coordinator) still lives:
                # once it exits, JAX aborts them with a C++ trace.
                from jaxserve.distributed.start_status import announce_failure  # noqa: PLC0415

                announce_failure(dist, describe_error(e))
            return EXIT_START_FAILED
        release_start_logs()
        gather_ms = resolve_burst_gather_ms(config.scheduler.burst_gather_ms, _platform())
        try:
            EngineLoop(
                core, input_socket, output_socket, control_socket=control_socket,
                kv_events_socket=kv_socket, stream_interval=config.scheduler.stream_interval,
                burst_gather_ms=gather_ms,
            ).run()  # fmt: skip
        except Exception:
            logger.exception("engine step failed; the engine process exits")
            if dist is not None and dist.num_processes > 1:
                time.sleep(PEER_LOSS_GRACE_S)  # a dead follower: let the watcher name it
                exit_now(EXIT_STEP_FAILED)  # no STOP: a follower may be stuck in the step
            return EXIT_STEP_FAILED
        return 0
    finally:
        if core is not None and hasattr(core, "close"):
            core.close()
        input_socket.close()
        output_socket.close()
        for sock in (control_socket, kv_socket):
            if sock is not None:
                sock.close()
        ctx.term()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="jaxserve engine process (started by serve)")
    parser.add_argument("--config-json", required=True, help="EngineConfig.to_dict() as JSON")
    parser.add_argument("--engine-input", required=True)
    parser.add_argument("--detokenizer-input", required=True)
    parser.add_argument("--engine-control", help="AbortRequest socket (the control path)")
    parser.add_argument("--kv-events", help="the router's KV events socket (jaxserve.router)")
    parser.add_argument(
        "--connect-engine-input", action="store_true",
        help="connect to --engine-input (bound by a remote frontend) instead of binding it",
    )  # fmt: skip
    parser.add_argument(
        "--connect-control", action="append", default=[], metavar="ADDRESS",
        help="also take control messages from this address, bound by a remote frontend",
    )  # fmt: skip
    parser.add_argument("--parent-pid", type=int, required=True)
    parser.add_argument("--engine-class", default=DEFAULT_ENGINE_CLASS)
    parser.add_argument("--log-level", default="INFO")
    parser.add_argument("--log-name", default="engine", help="the [tag] of its log lines")
    distributed.add_arguments(parser)
    args = parser.parse_args(argv)
    die_with_parent(args.parent_pid)
    ignore_sigint()
    # Started by `serve` (which prints a failed start's cause): INFO lines wait for the
    # engine to be built, so that a failed start is one line.
    configure_logging(args.log_level, args.log_name, hold_start=START_ERROR_FILE_ENV in os.environ)
    config = EngineConfig.from_dict(json.loads(args.config_json))
    dist = distributed.from_arguments(args)
    distributed.initialize(dist)  # before any other JAX call
    if dist is not None:
        # jax.distributed's preemption notifier takes SIGTERM over: take it back, so the
        # launcher's SIGTERM ends the loop and `run_engine_process` stops the followers.
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    code = run_engine_process(
        config, args.engine_input, args.detokenizer_input, args.engine_class, dist,
        engine_control=args.engine_control, kv_events=args.kv_events,
        connect_input=args.connect_engine_input, connect_control=tuple(args.connect_control),
    )  # fmt: skip
    if dist is not None and code != 0:
        exit_now(code)  # the followers are gone or stopping: no shutdown barrier
    sys.exit(code)


if __name__ == "__main__":
    main()

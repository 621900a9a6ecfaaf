"""`jaxserve engine --frontend HOST:PORT`: a headless engine replica that joins a running
frontend (`jaxserve serve --replica-listen HOST:PORT`) over TCP, as vLLM's headless
data-parallel engines join their API server.

This process does the handshake (`ipc.ReplicaHello` with `PROTOCOL_VERSION` and the
model identity of `router.identity`; the frontend's side is `router.remote`), then runs
one replica on this host's devices: an engine process and its detokenizer sidecar,
exactly the two children a local replica of `serve --replicas N` has
(`router.launch`), with the sockets toward the frontend on the TCP ports its
`ReplicaWelcome` names (the engine and the sidecar connect; this host binds nothing but
the two processes' private ipc:// sockets). The frontend tokenizes and routes; this
host's sidecar detokenizes, so it needs the same model folder (tokenizer included).

A replica is one process: serve's multi-process flags (--coordinator-address ...), or a
multi-process run set in the environment (JAX_NUM_PROCESSES ...), are refused at start
with one line naming them, exit 2 (a multi-process engine is `jaxserve serve` on each
host).

It supervises its children and the handshake connection:
- refused (another protocol version or model): one line naming the field, exit 2;
- no answer from the frontend within --handshake-timeout-s (default 60 s): one line,
  exit 1; it logs at once what it waits for, and a warning when nothing listens at the
  address (ZeroMQ retries the connection every 0.1 s until then);
- a child dies: the frontend is told why (`ReplicaLeft`), the other child is stopped,
  exit 1 (a supervisor restarts it; it rejoins with empty entries);
- the frontend goes away (its connection closes, or the frontend sends `ReplicaLeft`):
  the children are stopped, exit 1;
- SIGINT/SIGTERM: the frontend is told, the children stopped, exit 0.
No JAX in this process (the engine process has it).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import socket
import sys
import time

import zmq
from zmq.utils.monitor import parse_monitor_message

from jaxserve import distributed
from jaxserve.config import EngineConfig
from jaxserve.frontend.server_address import join_host_port, wait_until_resolves
from jaxserve.ipc import (
    PROTOCOL_VERSION,
    ReplicaHello,
    ReplicaLeft,
    ReplicaRefused,
    ReplicaWelcome,
    decode,
    encode,
    monitor_socket,
)
from jaxserve.launcher import CHILD_POLL_INTERVAL_S, _Child, _spawn, _stop_children
from jaxserve.logs import read_start_failure
from jaxserve.router.cli_args import ROUTER_GROUP
from jaxserve.router.identity import model_identity
from jaxserve.socket_dirs import make_socket_dir, remove_dead_socket_dirs

logger = logging.getLogger("jaxserve")

EXIT_REFUSED = 2
EXIT_LOST = 1
HANDSHAKE_HEARTBEAT_MS = 1000  # ZMTP heartbeats on the handshake connection
HANDSHAKE_HEARTBEAT_TIMEOUT_MS = 30_000  # a frontend host gone silent this long is gone
CHILD_EXIT_WAIT_S = 1.0  # dropped by the frontend: how long to look for a dying child


class HeadlessError(RuntimeError):
    """The replica could not join or went on no longer; `code` is the exit code."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


def run_headless(
    engine_config: EngineConfig,
    frontend: tuple[str, int],
    *,
    handshake_timeout_s: float = 60.0,
    engine_class: str | None = None,
    log_level: str = "INFO",
) -> int:
    """Join the frontend at `frontend` (host, port) and serve as one of its replicas until
    a signal or a loss (module docstring). Returns 0 after SIGINT/SIGTERM. Raises
    HeadlessError (one line, with its exit code) when refused, unanswered, or when a
    child or the frontend is gone."""
    host, port = frontend
    address = join_host_port(host, port)  # [::1]:P in every line, as serve prints it
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.setsockopt(zmq.HEARTBEAT_IVL, HANDSHAKE_HEARTBEAT_MS)
    dealer.setsockopt(zmq.HEARTBEAT_TIMEOUT, HANDSHAKE_HEARTBEAT_TIMEOUT_MS)
    monitor = monitor_socket(
        dealer, zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECTED | zmq.EVENT_CONNECT_RETRIED
    )
    dealer.connect(f"tcp://{host}:{port}")
    children: list[_Child] = []
    remove_dead_socket_dirs()
    folder = make_socket_dir()
    stop: list[str] = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda n, _f: stop.append(signal.Signals(n).name))
    try:
        name = f"{socket.gethostname()} pid {os.getpid()}"
        dealer.send(encode(ReplicaHello(PROTOCOL_VERSION, model_identity(engine_config), name)))
        logger.info(
            "joining the frontend at %s as %s: waiting up to %g s (--handshake-timeout-s) "
            "for its answer", address, name, handshake_timeout_s,
        )  # fmt: skip
        welcome = _await_welcome(dealer, monitor, address, handshake_timeout_s, stop)
        if welcome is None:
            return 0
        k = welcome.replica
        children += _spawn_replica(
            engine_config, host, welcome.ports, folder, k, engine_class, log_level
        )
        logger.info("joined the frontend at %s as replica %d", address, k)
        return _supervise(dealer, monitor, children, address, stop)
    finally:
        _stop_children(children)
        shutil.rmtree(folder, ignore_errors=True)
        monitor.close()
        dealer.close()
        ctx.term()


def _await_welcome(dealer, monitor, address, timeout_s, stop) -> ReplicaWelcome | None:
    """The frontend's answer to the hello; None after a signal. Logs a warning the first
    time the connection is refused (nothing listens there yet) and a line when it is
    made. Raises HeadlessError when refused, or with no answer within timeout_s (the
    line says whether anything listened at `address`, HOST:PORT)."""
    deadline = time.monotonic() + timeout_s
    connected = refused = False
    poller = zmq.Poller()
    poller.register(dealer, zmq.POLLIN)
    poller.register(monitor, zmq.POLLIN)
    while not stop:
        left = deadline - time.monotonic()
        if left <= 0:
            if connected:
                why = f"{address} accepted the connection but sent no answer"
            elif refused:
                why = f"nothing listens at {address} (every connection attempt failed)"
            else:
                why = f"no connection to {address} was made (is the address reachable?)"
            raise HeadlessError(
                f"frontend: no answer within {timeout_s:g} s (--handshake-timeout-s): {why}; "
                f"is `jaxserve serve --replica-listen {address}` running there?",
                EXIT_LOST,
            )
        ready = dict(poller.poll(int(min(left, 0.2) * 1000)))
        while monitor.poll(0):
            event = parse_monitor_message(monitor.recv_multipart())["event"]
            if event == zmq.EVENT_CONNECTED:
                connected = True
                logger.info("connected to %s; waiting for the frontend's answer", address)
            elif event == zmq.EVENT_DISCONNECTED:
                connected = False
            elif event == zmq.EVENT_CONNECT_RETRIED and not connected and not refused:
                refused = True
                logger.warning(
                    "nothing listens at %s yet (the connection failed): retrying until "
                    "`jaxserve serve --replica-listen %s` answers, for up to %g s",
                    address, address, timeout_s,
                )  # fmt: skip
        if dealer not in ready:
            continue
        msg = decode(dealer.recv())
        if isinstance(msg, ReplicaRefused):
            raise HeadlessError(
                f"the frontend at {address} refused this replica: {msg.reason}", EXIT_REFUSED
            )
        if isinstance(msg, ReplicaWelcome):
            return msg
    return None


def _spawn_replica(config, host, ports, folder, k, engine_class, log_level) -> list[_Child]:
    """The engine and the sidecar of replica k, their frontend sockets on `ports`."""
    tcp = {f: f"tcp://{host}:{int(p)}" for f, p in ports.items()}
    detok, control = f"ipc://{folder}/detokenizer", f"ipc://{folder}/control"
    engine_args = [
        "--config-json", json.dumps(config.to_dict()),
        "--engine-input", tcp["engine_input"], "--connect-engine-input",
        "--detokenizer-input", detok, "--engine-control", control,
        "--connect-control", tcp["engine_control"], "--connect-control", tcp["kv_control"],
        "--kv-events", tcp["kv_events"],
        "--log-level", log_level, "--log-name", f"engine {k}",
    ]  # fmt: skip
    if engine_class:
        engine_args += ["--engine-class", engine_class]
    sidecar_args = [
        "--model", config.model, "--detokenizer-input", detok,
        "--frontend-input", tcp["frontend_input"], "--engine-input", control,
        "--log-level", log_level, "--log-name", f"detokenizer {k}",
    ]  # fmt: skip
    return [
        _spawn("engine", "jaxserve.engine.process", engine_args, folder),
        _spawn("detokenizer", "jaxserve.frontend.detokenizer_process", sidecar_args, folder),
    ]


def _supervise(dealer, monitor, children, address, stop) -> int:
    while True:
        if stop:
            dealer.send(encode(ReplicaLeft(f"stopped ({stop[0]})")))
            logger.info("%s: leaving the frontend", stop[0])
            return 0
        if not stop:
            _check_children(dealer, children)
        if monitor.poll(0):
            event = parse_monitor_message(monitor.recv_multipart())
            if event["event"] == zmq.EVENT_DISCONNECTED:
                raise HeadlessError(f"the frontend at {address} went away", EXIT_LOST)
        if dealer.poll(int(CHILD_POLL_INTERVAL_S * 1000)) and not stop:
            msg = decode(dealer.recv())
            if isinstance(msg, ReplicaLeft):
                # A child that is dying is the cause the frontend saw: name it instead.
                deadline = time.monotonic() + CHILD_EXIT_WAIT_S
                while time.monotonic() < deadline:
                    _check_children(dealer, children)
                    time.sleep(CHILD_POLL_INTERVAL_S)
                raise HeadlessError(
                    f"the frontend at {address} dropped this replica: {msg.reason}",
                    EXIT_LOST,
                )


def _check_children(dealer, children) -> None:
    """Raise HeadlessError (after telling the frontend) if a child exited."""
    for child in children:
        if child.process.poll() is not None:
            reason = read_start_failure(child.error_file) or child.describe_exit()
            dealer.send(encode(ReplicaLeft(reason)))
            raise HeadlessError(f"{reason}; this replica leaves the frontend", EXIT_LOST)


def cmd_engine(args) -> int:
    """`jaxserve engine`: the serve flags' EngineConfig, then `run_headless`."""
    from jaxserve import preflight  # noqa: PLC0415
    from jaxserve.hub import resolve_model  # noqa: PLC0415
    from jaxserve.logs import configure_logging  # noqa: PLC0415
    from jaxserve.router.cli_args import host_port  # noqa: PLC0415
    from jaxserve.router.options import refuse_ipv6  # noqa: PLC0415
    from jaxserve.serve_config import engine_config, model_argument  # noqa: PLC0415

    configure_logging(args.log_level, "headless")
    if ignored := _frontend_flags_given(args):
        logger.warning("ignored by jaxserve engine (the frontend's): %s", ", ".join(ignored))
    try:
        _refuse_multi_process(args)
        frontend = host_port("frontend", args.frontend)
        refuse_ipv6("frontend", frontend[0])  # never answered: serve refuses to listen there
        if not args.handshake_timeout_s > 0:
            raise ValueError(f"handshake-timeout-s: must be > 0, got {args.handshake_timeout_s}")
        # A name that never resolves is said as such, not retried as "nothing listens";
        # one that resolves once its host starts (a pod's) is waited for, as a frontend
        # that does not listen yet is.
        wait_until_resolves("frontend", frontend[0], args.handshake_timeout_s, socket.AF_INET)
        config = engine_config(args, model=resolve_model(model_argument(args)))
        # Mistakes that need no device, before the engine process starts (exit code 2).
        preflight.check_engine_settings(config, check_model=args.engine_class is None)
    except (ValueError, OSError) as e:
        print(f"jaxserve engine: error: {in_flag_words(str(e))}", file=sys.stderr, flush=True)
        return 2
    try:
        return run_headless(
            config, frontend, handshake_timeout_s=args.handshake_timeout_s,
            engine_class=args.engine_class, log_level=args.log_level,
        )  # fmt: skip
    except HeadlessError as e:
        print(f"jaxserve engine: error: {in_flag_words(str(e))}", file=sys.stderr, flush=True)
        return e.code


def in_flag_words(line: str) -> str:
    """`cli.in_flag_words` for this command ("frontend: ..." -> "--frontend: ...")."""
    from jaxserve import cli  # noqa: PLC0415 (cli imports this module)

    return cli.in_flag_words(line, "engine")


def _refuse_multi_process(args) -> None:
    """Raise ValueError (one line naming them) when serve's multi-process flags are given,
    or the environment places this host in a multi-process run (`distributed.from_arguments`;
    a partial setting too). A headless replica is one process: the flags never reached
    its engine process (a single-process replica joined), and the variables did (its
    engine waited in jax.distributed.initialize for peers that never come)."""
    dests = ("coordinator_address", "num_processes", "process_id")
    named = ["--" + d.replace("_", "-") for d in dests if getattr(args, d) is not None]
    try:
        run = distributed.from_arguments(args) is not None
    except ValueError:
        run = True  # partial: the engine process would fail on it, or wait
    if not (named or run):
        return
    named += [v for v in distributed.settings.RUN_VARIABLES if os.environ.get(v)]
    raise ValueError(
        f"multi-process settings ({', '.join(named)}): a headless replica is one process; "
        "a multi-process engine runs as `jaxserve serve` on every host with these "
        "settings (README: Parallelism and multi-host)"
    )


# The serve flags outside the router's group that only the frontend reads (the
# router's group, `cli_args.ROUTER_GROUP`, is the frontend's whole); given to
# `jaxserve engine`, they are ignored.
FRONTEND_ONLY = (
    "host", "port", "metrics_port", "http_port", "chat_template", "stats_log_interval",
    "disable_log_stats",
)  # fmt: skip


def _frontend_flags_given(args) -> list[str]:
    """The frontend-only flags given other values than their defaults (as --flag-names)."""
    defaults = _PARSER_DEFAULTS
    return [
        "--" + d.replace("_", "-")
        for d in _FRONTEND_DESTS
        if d in defaults and getattr(args, d, None) != defaults[d]
    ]


_PARSER_DEFAULTS: dict = {}
_FRONTEND_DESTS: list[str] = []  # FRONTEND_ONLY and the router group's, in --help order


def _hide_frontend_flags(parser: argparse.ArgumentParser) -> list[str]:
    """Unlist the frontend's flags from `parser`'s help (still accepted, so that a serve
    command line runs as is; cmd_engine warns that they are ignored). Returns their dests."""
    hidden = []
    for group in parser._action_groups:
        for action in group._group_actions:
            if group.title == ROUTER_GROUP or action.dest in FRONTEND_ONLY:
                action.help = argparse.SUPPRESS
                hidden.append(action.dest)
    return hidden


def add_subparser(sub) -> None:
    """Register `jaxserve engine` (the serve flags that shape the engine, plus --frontend)."""
    from jaxserve.serve_args import add_serve_arguments  # noqa: PLC0415

    e = sub.add_parser(
        "engine",
        help="run a headless engine replica that joins a frontend (serve --replica-listen)",
        description="A headless engine replica: joins the frontend at --frontend over TCP "
        "and serves its requests on this host's devices. The serve flags that shape the "
        "engine (model, dtype, KV cache, scheduler, mesh, compilation) apply and must give "
        "the frontend's model identity. The frontend's and router's flags are accepted, so "
        "that a serve command line runs as is, but ignored (with a warning), and not "
        "listed here.",
    )  # fmt: skip
    add_serve_arguments(e)
    _FRONTEND_DESTS[:] = _hide_frontend_flags(e)
    e.add_argument(
        "--frontend", required=True, metavar="HOST:PORT",
        help="the frontend's --replica-listen address (an IPv4 address or a host name)",
    )  # fmt: skip
    e.add_argument(
        "--handshake-timeout-s", type=float, default=60.0, metavar="S",
        help="how long to wait for the frontend's answer, retrying while nothing listens "
        "at --frontend; then exit 1 (default: 60)",
    )  # fmt: skip
    e.set_defaults(func=cmd_engine)
    _PARSER_DEFAULTS.update({a.dest: a.default for a in e._actions})

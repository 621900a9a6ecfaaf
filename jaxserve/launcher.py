"""`jaxserve serve`: start the engine and the detokenizer sidecar, run the frontend, supervise.

This process is the frontend (grpc.aio on uvloop) and the parent of two children, started
with `python -m` so they begin clean (no inherited threads or event loop):

    frontend (this process) --ipc--> engine --ipc--> detokenizer sidecar --ipc--> frontend

The children die with this process (jaxserve.lifetime). SIGINT/SIGTERM here stops the
gRPC and HTTP servers (open calls get `GRPC_GRACE_S` to finish, then the streams still open
end with "the server is shutting down": gRPC UNAVAILABLE, HTTP an error event and
`data: [DONE]`; `FrontendServer.stop`), then terminates the children (SIGTERM, then
SIGKILL after a timeout) and removes the private socket folder; the whole shutdown takes a
few seconds at most, and the exit code is 0.

A child that dies (the engine or the detokenizer) makes the server exit, as vLLM's API
server does when its engine dies, so that the supervisor (Kubernetes, systemd) restarts
it: the cause (which child, exit code or signal) is logged, health turns NOT_SERVING,
every open stream ends with UNAVAILABLE (new calls get it too), and after a short grace
(`ENGINE_DEATH_GRACE_S`, so those statuses reach the clients and health checkers) the
gRPC server stops, the other child is terminated and `jaxserve serve` exits with code 1.
A child that dies during start-up also gives exit code 1. No JAX in this process.

With `--replicas N` (N > 1) there are N engine processes, each with its own sidecar
and devices, behind one `jaxserve.router.replicas.ReplicaSet`: a dead child takes only
its replica out of rotation (its streams end with UNAVAILABLE naming it; its other
child is stopped), and the server exits with code 1 only when every replica is dead.
`--replica-listen` (with any N) also takes replicas from other hosts
(`jaxserve.router.remote`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass

import prometheus_client
import uvloop

from jaxserve.config import EngineConfig, ServerConfig
from jaxserve.distributed.processes import EXIT_PEER_LOST
from jaxserve.frontend.auth import insecure_bind_warning
from jaxserve.frontend.engine_client import AsyncEngineClient
from jaxserve.frontend.liveness import watch_liveness
from jaxserve.frontend.options import FrontendOptions
from jaxserve.frontend.server import FrontendServer
from jaxserve.frontend.server_address import join_host_port
from jaxserve.frontend.tokenizer import load_tokenizer
from jaxserve.ipc import IpcAddresses
from jaxserve.lifetime import wait_any_exit
from jaxserve.logs import (
    EXIT_BAD_SETTING,
    EXIT_SYSTEM_REFUSED,
    START_ERROR_FILE_ENV,
    collect_start_logs,
    read_start_failure_code,
    release_start_logs,
)
from jaxserve.observability.metrics import Metrics
from jaxserve.serve_log import StatsLogger, config_block
from jaxserve.socket_dirs import make_socket_dir, remove_dead_socket_dirs
from jaxserve.start_log_hold import IF_SERVING

logger = logging.getLogger("jaxserve")

GRPC_GRACE_S = 2.0  # open calls get this long after SIGTERM before they are cancelled
# After SIGTERM, a child is SIGKILLed when it takes longer than this (the engine of a
# multi-process run takes ~3.5 s to leave the run cleanly).
CHILD_TERM_TIMEOUT_S = 6.0
# The same for the engine of a multi-process run stopped during its background
# compilation: the step shape under way cannot be cut short (measured 4.7 s on a loaded
# 2-core CPU host, demo model), then it leaves the run (above).
MULTI_PROCESS_ENGINE_TERM_TIMEOUT_S = 20.0
CHILD_POLL_INTERVAL_S = 0.1  # how often the supervisor checks that the children live
# After a child dies: how long open calls' UNAVAILABLE and health's NOT_SERVING are
# served before the server stops (SIGINT/SIGTERM cuts it short).
ENGINE_DEATH_GRACE_S = 2.0
EXIT_CHILD_DIED = 1  # `jaxserve serve`'s exit code when a child died (start-up or serving)


@dataclass(slots=True)
class _Child:
    name: str
    process: subprocess.Popen
    error_file: str = ""  # where it writes why it failed to start (jaxserve.logs)
    replica: int | None = None  # with several replicas: the one it belongs to
    respawn: Callable[[], _Child] | None = None  # starts it again (a replica's children)
    term_timeout_s: float = CHILD_TERM_TIMEOUT_S  # SIGKILL this long after SIGTERM

    def describe_exit(self) -> str:
        code = self.process.returncode
        how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
        if code == EXIT_PEER_LOST:  # only an engine of a multi-process run exits so
            how += ": another process of its multi-process run is gone"
        return f"the {self.name} process (pid {self.process.pid}) died ({how})"


class StartupError(RuntimeError):
    """A child failed to start and said why (one line, `jaxserve.logs.report_start_failure`).
    exit_code: the code `serve` exits with, as the child asked (2: a bad setting, 1: the
    system refused; `jaxserve.logs.start_failure_code`)."""

    def __init__(self, message: str, exit_code: int = EXIT_SYSTEM_REFUSED) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def _spawn(
    name: str, module: str, args: list[str], error_dir: str, env_extra: dict | None = None
) -> _Child:
    # From the main thread: PR_SET_PDEATHSIG fires when the spawning *thread* exits.
    cmd = [sys.executable, "-m", module, "--parent-pid", str(os.getpid()), *args]
    error_file = os.path.join(error_dir, f"{name.replace(' ', '-')}.start-error")
    env = {**os.environ, START_ERROR_FILE_ENV: error_file, **(env_extra or {})}
    return _Child(name, subprocess.Popen(cmd, stdin=subprocess.DEVNULL, env=env), error_file)


def _stop_children(children: list[_Child]) -> None:
    for child in children:
        if child.process.poll() is None:
            child.process.terminate()
    for child in children:
        try:
            child.process.wait(child.term_timeout_s)
        except subprocess.TimeoutExpired:
            logger.warning("the %s process did not stop; killing it", child.name)
            child.process.kill()
            child.process.wait()


def serve(
    engine_config: EngineConfig,
    server_config: ServerConfig,
    *,
    engine_class: str | None = None,
    log_level: str = "INFO",
    distributed_args: list[str] | None = None,
    frontend_options: FrontendOptions | None = None,
    router_options=None,
) -> int:
    """Run the server until SIGINT/SIGTERM or until a child dies. Returns the process exit
    code: 0 after a requested shutdown, 1 (`EXIT_CHILD_DIED`) when the engine or the
    detokenizer died, during start-up or while serving (see the module docstring).
    Raises RuntimeError naming the flag ("port: ...", "metrics-port: ...") when an address
    cannot be bound, and StartupError (a RuntimeError) with the child's one-line cause
    when a child failed to start and said why; no child is left running then.

    engine_class: "module:Class" to run instead of EngineCore (tests use a mock engine).
    distributed_args: --coordinator-address/--num-processes/--process-id for the engine
        process when it leads a multi-process run (process 0; see jaxserve.distributed).
    frontend_options: admission limits, stall timeout, TLS, API key (frontend.options).
    router_options: a `jaxserve.router.options.RouterOptions` (replicas, policy); None:
        one engine.
    """
    options = frontend_options or FrontendOptions()
    logger.info(
        "admission limits: %d requests, %d queued prompt tokens, %d request bytes; "
        "%d unread output bytes a stream; stall timeout %g s; TLS %s; API key %s",
        options.admission.max_requests, options.admission.max_queued_prompt_tokens,
        options.admission.max_request_bytes, options.max_stream_buffer_bytes,
        options.stall_timeout_s,
        "on" if options.tls else "off", "on" if options.api_key else "off",
    )  # fmt: skip
    if warning := insecure_bind_warning(
        server_config.host, options.tls is not None, options.api_key is not None
    ):
        logger.warning("%s", warning, extra=IF_SERVING)
    # Fail fast, before any child starts. A tokenizer.json or chat template that cannot
    # be loaded is a bad model file: exit code 2, as a bad config.json (the README).
    try:
        tokenizer = load_tokenizer(engine_config.model)
        chat_template = None
        if server_config.http_port is not None:
            from jaxserve.frontend.http.chat_template import load_chat_template

            chat_template = load_chat_template(engine_config.model, server_config.chat_template)
    except ValueError as e:
        raise StartupError(str(e), EXIT_BAD_SETTING) from None
    if server_config.http_port is not None and chat_template is None:
        logger.warning(
            "the model has no chat template: /v1/chat/completions answers 400 "
            "(--chat-template FILE gives one)",
            extra=IF_SERVING,
        )
    # This process owns its registry: no `_created` series (a sample per counter and
    # histogram that dashboards do not use), as vLLM's server does.
    prometheus_client.disable_created_metrics()
    # The metrics' model label: --served-model-name (or the id typed), as GetServerInfo's.
    name = engine_config.served_model_name or os.path.basename(
        os.path.normpath(engine_config.model)
    )
    metrics = Metrics(model=name)
    if server_config.metrics_port is not None:
        # Bound before any child starts: a busy port leaves nothing to clean up.
        tls_kwargs = options.tls.metrics_kwargs() if options.tls is not None else {}
        # The port bound replaces a 0 (a free one), so that the configuration logged
        # at ready names the real /metrics address.
        server_config.metrics_port = metrics.serve(
            server_config.metrics_port, server_config.host, **tls_kwargs
        )
    remove_dead_socket_dirs()
    socket_dir = make_socket_dir()
    collect_start_logs(socket_dir)  # the children's held start lines, printed in order
    addresses = IpcAddresses.in_dir(socket_dir)
    children: list[_Child] = []
    num_replicas = router_options.replicas if router_options is not None else 1
    remote = router_options is not None and router_options.replica_listen is not None
    try:
        if num_replicas > 1 or remote:  # behind the request router
            from jaxserve.router import launch as replica_launch  # noqa: PLC0415

            replica_addresses = replica_launch.spawn_replicas(
                engine_config, router_options, socket_dir, children, engine_class, log_level
            )
            return uvloop.run(
                _run_frontend(
                    replica_addresses, tokenizer, engine_config, server_config, children,
                    metrics, chat_template, options, router_options,
                )
            )  # fmt: skip
        engine_args = [
            "--config-json", json.dumps(engine_config.to_dict()),
            "--engine-input", addresses.engine_input,
            "--detokenizer-input", addresses.detokenizer_input,
            "--engine-control", addresses.engine_control,
            "--log-level", log_level,
        ]  # fmt: skip
        if engine_class:
            engine_args += ["--engine-class", engine_class]
        engine_args += distributed_args or []
        children.append(_spawn("engine", "jaxserve.engine.process", engine_args, socket_dir))
        if distributed_args:
            children[-1].term_timeout_s = MULTI_PROCESS_ENGINE_TERM_TIMEOUT_S
        sidecar_args = [
            "--model", engine_config.model,
            "--detokenizer-input", addresses.detokenizer_input,
            "--frontend-input", addresses.frontend_input,
            "--engine-input", addresses.engine_control,  # stop-string aborts: control path
            "--log-level", log_level,
        ]  # fmt: skip
        children.append(
            _spawn("detokenizer", "jaxserve.frontend.detokenizer_process", sidecar_args, socket_dir)
        )
        return uvloop.run(
            _run_frontend(
                addresses,
                tokenizer,
                engine_config,
                server_config,
                children,
                metrics,
                chat_template,
                options,
            )
        )
    finally:
        _stop_children(children)
        shutil.rmtree(socket_dir, ignore_errors=True)


async def _run_frontend(
    addresses,
    tokenizer,
    engine_config: EngineConfig,
    server_config: ServerConfig,
    children,
    metrics: Metrics,
    chat_template,
    options: FrontendOptions,
    router_options=None,
) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)

    replicas = None
    if isinstance(addresses, list):
        from jaxserve.router import launch as replica_launch  # noqa: PLC0415

        replicas = engine = replica_launch.make_replica_set(
            addresses, engine_config, metrics, options, router_options
        )
    else:
        engine = AsyncEngineClient(addresses)
    await engine.start()
    engine.add_stats_listener(metrics.update_from_engine)
    stats_log = StatsLogger()
    engine.add_stats_listener(stats_log.update)
    stats_task = None
    server = FrontendServer(engine, tokenizer, metrics, chat_template, options)
    ready = asyncio.create_task(engine.wait_ready())
    listener = None
    if replicas is not None:
        replicas.add_serving_listener(server.set_serving)
        restart = router_options.restart_dead_replicas
        watch = asyncio.create_task(
            replica_launch.watch_replica_children(children, replicas, restart)
        )
        listener = await replica_launch.start_listener(replicas, engine_config, router_options)
    else:
        watch = asyncio.create_task(_watch_children(children))
    stopping = asyncio.create_task(stop.wait())
    liveness = None
    http, http_port = "", None
    try:
        port = await server.start(server_config.host, server_config.port)
        if server_config.http_port is not None:
            http_port = await server.start_http(server_config.host, server_config.http_port)
            http_address = join_host_port(server_config.host, http_port)
            logger.info("HTTP (OpenAI API) listening on %s", http_address)
            # With --tls-cert the HTTP port speaks HTTPS only.
            scheme = "https" if options.tls is not None else "http"
            http = f", OpenAI HTTP API on {scheme}://{http_address}/v1"
        grpc_address = join_host_port(server_config.host, port)
        logger.info("gRPC listening on %s; waiting for the engine", grpc_address)
        await asyncio.wait({ready, watch, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if ready.done() and not watch.done():
            stats = ready.result()
            release_start_logs()  # the start's INFO lines, held back until now
            await server.set_serving(True)
            if replicas is None:  # a ReplicaSet watches its replicas' heartbeats itself
                liveness = asyncio.create_task(
                    watch_liveness(engine, server.set_serving, options.stall_timeout_s)
                )
            logger.info(
                # num_blocks_total is the usable count: the engine's null block is not in it.
                "jaxserve ready: serving %s on %s (gRPC)%s (max_model_len %d, %d usable "
                "KV blocks of %d tokens)",
                stats.model, grpc_address, http,
                stats.max_model_len, stats.num_blocks_total, stats.block_size,
            )  # fmt: skip
            about = "" if replicas is None else replica_launch.describe(replicas, router_options)
            logger.info(
                "configuration:\n%s",
                config_block(
                    engine_config,
                    server_config,
                    stats,
                    port,
                    about,
                    tls=options.tls is not None,
                    http_port=http_port,
                ),
            )
            if server_config.stats_log_interval_s > 0:
                stats_task = asyncio.create_task(stats_log.run(server_config.stats_log_interval_s))
            await asyncio.wait({watch, stopping}, return_when=asyncio.FIRST_COMPLETED)
            if watch.done():
                await _child_died(server, watch.result(), stopping)
                return EXIT_CHILD_DIED
        elif watch.done():
            # The child's own one-line cause, when it gave one, is the last line printed.
            causes = [read_start_failure_code(c.error_file) for c in children]
            causes = [(line, code) for line, code in causes if line]
            if causes:
                raise StartupError(*causes[0])
            logger.error("start-up failed: %s", watch.result())
            return EXIT_CHILD_DIED
        release_start_logs()  # stopped (SIGINT/SIGTERM) while starting: not a failure
        logger.info("shutting down")
        return 0
    finally:
        for task in (ready, watch, stopping, liveness, stats_task):
            if task is not None:
                task.cancel()
        await server.stop(GRPC_GRACE_S)
        if listener is not None:
            await listener.close()
        await engine.close()


async def _child_died(server: FrontendServer, reason: str, stopping: asyncio.Task) -> None:
    """Report a dead child to clients, then wait out the grace (or a SIGINT/SIGTERM)."""
    logger.error(
        "%s; the server exits with code %d in %.0f s so that its supervisor restarts it",
        reason, EXIT_CHILD_DIED, ENGINE_DEATH_GRACE_S,
    )  # fmt: skip
    await server.engine_died(reason)  # NOT_SERVING; open and new calls get UNAVAILABLE
    await asyncio.wait({stopping}, timeout=ENGINE_DEATH_GRACE_S)


async def _watch_children(children: list[_Child]) -> str:
    """Returns a description of the first child to exit."""
    first = await wait_any_exit([child.process for child in children], CHILD_POLL_INTERVAL_S)
    return children[first].describe_exit()

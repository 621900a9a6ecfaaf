"""`jaxserve serve` exits when a child dies, so that its supervisor restarts it (as vLLM's
API server exits when its engine dies).

The real three-process server with the mock engine (tests/mock_engine.py) in the engine
process: killing a child tests the launcher's supervision, which does not depend on the
engine's contents (tests/test_e2e.py checks SIGTERM on the demo model's engine).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import grpc
import pytest
from server_harness import ServerProcess, alive

from jaxserve.frontend.client import JaxserveClient

EXIT_DEADLINE_S = 10.0  # the launcher's grace plus stopping the other child take ~3 s
RPC_TIMEOUT_S = 30


def _mock_server(mock_model_dir: Path) -> ServerProcess:
    # 5 ms per mock step: a 2000-token stream lasts >= 10 s, longer than the test.
    args = ("--num-blocks", "256", "--block-size", "16")
    args += ("--engine-class", "mock_engine:MockEngineCore")
    env = {"JAXSERVE_MOCK_STEP_DELAY_S": "0.005"}
    return ServerProcess(mock_model_dir, extra_args=args, env=env).wait_ready()


def _open_stream(target: str) -> tuple[threading.Thread, threading.Event, dict]:
    """A long stream in a thread; `outcome["code"]` is its final status once it ends."""
    started, outcome = threading.Event(), {}

    def run() -> None:
        try:
            with JaxserveClient(target) as client:
                for _ in client.generate([7] * 4, max_tokens=2000, timeout=RPC_TIMEOUT_S):
                    started.set()
            outcome["code"] = "finished"
        except grpc.RpcError as e:
            outcome["code"] = e.code()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, started, outcome


@pytest.mark.parametrize(
    "name,module",
    [
        ("engine", "jaxserve.engine.process"),
        ("detokenizer", "jaxserve.frontend.detokenizer_process"),
    ],
)
def test_child_death_ends_streams_and_exits_with_code_1(mock_model_dir, name, module):
    srv = _mock_server(mock_model_dir)
    try:
        pids = list(srv.children)
        assert len(pids) == 2 and all(alive(p) for p in pids)
        thread, started, outcome = _open_stream(srv.target)
        assert started.wait(RPC_TIMEOUT_S)
        victim = srv.child(module)
        os.kill(victim, signal.SIGKILL)
        killed_at = time.monotonic()

        thread.join(EXIT_DEADLINE_S)
        assert not thread.is_alive(), "the open stream hung after the child died"
        assert outcome["code"] == grpc.StatusCode.UNAVAILABLE
        srv.proc.wait(EXIT_DEADLINE_S)  # raises TimeoutExpired if the server stays up
        assert time.monotonic() - killed_at < EXIT_DEADLINE_S
        assert srv.proc.returncode == 1, srv.log()
        assert not [p for p in pids if alive(p)], "a child outlived the server"
        assert not os.path.exists(srv.socket_dir)
        # The log names the dead child and how it died, in one ERROR line.
        errors = [line for line in srv.log().splitlines() if " ERROR " in line]
        assert len(errors) == 1, errors
        assert f"the {name} process (pid {victim}) died (signal SIGKILL)" in errors[0]
    finally:
        srv.kill()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_stop_logs_shutting_down_once(mock_model_dir, sig):
    """With --http-port, uvicorn's "Shutting down" followed the launcher's "shutting
    down": a stop (Ctrl-C or SIGTERM) logs one such line."""
    args = ("--engine-class", "mock_engine:MockEngineCore", "--http-port", "0")
    srv = ServerProcess(mock_model_dir, extra_args=args).wait_ready()
    try:
        srv.proc.send_signal(sig)
        assert srv.proc.wait(EXIT_DEADLINE_S) == 0, srv.log()
        srv.reader.join(EXIT_DEADLINE_S)  # every line read
        lines = [line for line in srv.log().splitlines() if "shutting down" in line.lower()]
        assert len(lines) == 1 and lines[0].endswith("[frontend] shutting down"), srv.log()
    finally:
        srv.kill()


def test_uvicorns_ctrl_c_hint_is_not_logged():
    """uvicorn's "Waiting for connections to close. (CTRL+C to force quit)" offered a key
    the launcher handles itself (its streams get their final event): dropped; its other
    lines pass (session 18's fresh-user trial)."""
    import logging

    from jaxserve.frontend.http.server import no_second_shutdown_line

    def record(message: str) -> logging.LogRecord:
        return logging.LogRecord("uvicorn.error", logging.INFO, __file__, 1, message, (), None)

    assert not no_second_shutdown_line(
        record("Waiting for connections to close. (CTRL+C to force quit)")
    )
    assert not no_second_shutdown_line(record("Shutting down"))
    assert no_second_shutdown_line(record("Waiting for application startup."))
    assert no_second_shutdown_line(record("Started server process [%d]"))

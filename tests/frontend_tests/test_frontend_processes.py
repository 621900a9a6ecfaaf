"""The server's process model: ports, logging, start-up, shutdown, children dying with
the frontend, no JAX in the frontend process.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
from server_harness import alive

from frontend_tests.helpers import (
    REPO_DIR,
    TESTS_DIR,
    MockServer,
)
from jaxserve.frontend.client import JaxserveClient

# ---------------------------------------------------------------- processes


def test_busy_port_is_an_error(server, model_dir):
    port = server.target.rsplit(":", 1)[1]
    out = subprocess.run(
        [sys.executable, "-m", "jaxserve.cli", "serve", "--model", str(model_dir),
         "--port", port, "--engine-class", "mock_engine:MockEngineCore"],
        capture_output=True, text=True, timeout=60, cwd=REPO_DIR,
        env={**os.environ, "PYTHONPATH": str(TESTS_DIR)},
    )  # fmt: skip
    assert out.returncode == 1, out.stderr
    # The metrics port's style: the flag, the address and the OS's reason.
    assert f"jaxserve serve: error: --port: cannot bind 127.0.0.1:{port} ([Errno " in out.stderr


def test_busy_metrics_port_is_an_error_naming_the_flag(model_dir):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = subprocess.Popen(
            [sys.executable, "-m", "jaxserve.cli", "serve", "--model", str(model_dir),
             "--port", "0", "--metrics-port", str(port),
             "--engine-class", "mock_engine:MockEngineCore"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=REPO_DIR,
            env={**os.environ, "PYTHONPATH": str(TESTS_DIR)},
        )  # fmt: skip
        _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 1, stderr
    assert f"jaxserve serve: error: --metrics-port: cannot bind 127.0.0.1:{port} (" in stderr
    # No child outlived it (children carry their parent's pid on their command line).
    marker = f"--parent-pid {proc.pid}"
    leftovers = [
        pid for pid in (int(p.name) for p in Path("/proc").glob("[0-9]*"))
        if alive(pid) and marker in _cmdline(pid)
    ]  # fmt: skip
    assert not leftovers


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode().replace("\0", " ")
    except OSError:
        return ""


def test_serve_logging_quiets_the_jax_backend_probe():
    """`configure_logging` (used by `serve`) hides xla_bridge's INFO lines at every start
    ("Unable to initialize backend 'tpu'"); at DEBUG they stay."""
    code = (
        "import sys; from jaxserve.logs import configure_logging; "
        "configure_logging(sys.argv[1], 'test'); import jax; jax.devices()"
    )
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}  # probe every platform
    logs = {}
    for level in ("INFO", "DEBUG"):
        out = subprocess.run(
            [sys.executable, "-c", code, level], capture_output=True, text=True, timeout=120,
            env=env,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr
        logs[level] = out.stderr
    assert "Unable to initialize backend" in logs["DEBUG"]  # the probe does log it
    assert "Unable to initialize backend" not in logs["INFO"]
    assert "xla_bridge" not in logs["INFO"]


def test_frontend_process_never_imports_jax():
    code = (
        "import sys, jaxserve.cli, jaxserve.launcher, jaxserve.frontend.server, "
        "jaxserve.frontend.client, jaxserve.frontend.detokenizer_process; "
        "print(sorted(m for m in sys.modules if m == 'jax' or m.startswith('jax.')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_sigterm_stops_all_processes(model_dir):
    srv = MockServer(model_dir).wait_ready()
    try:
        assert len(srv.children) == 2 and all(alive(p) for p in srv.children)
        ended = threading.Event()

        def stream():
            try:
                with JaxserveClient(srv.target) as c:
                    for _ in c.generate([9] * 3, max_tokens=3000, timeout=30):
                        pass
            except grpc.RpcError:
                pass
            ended.set()

        threading.Thread(target=stream, daemon=True).start()
        time.sleep(0.3)
        assert srv.terminate(timeout=10) < 10
        assert srv.proc.returncode == 0, srv.log()
        assert ended.wait(5), "an open stream was left hanging"
        deadline = time.monotonic() + 2
        while any(alive(p) for p in srv.children) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(alive(p) for p in srv.children)
    finally:
        srv.kill()


def test_not_serving_until_engine_ready(model_dir):
    srv = MockServer(model_dir, start_delay_s=3.0)
    try:
        with JaxserveClient(srv.target) as c:
            assert not srv.ready.is_set()
            assert not c.is_serving()
            with pytest.raises(grpc.RpcError) as info:
                list(c.generate("hi", timeout=10))
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "starting" in info.value.details()
            srv.wait_ready()
            assert c.is_serving()
            assert list(c.generate("hi", max_tokens=2, timeout=10))[-1].finish_reason == "length"
        srv.terminate(timeout=10)
    finally:
        srv.kill()


def test_children_die_with_the_frontend(model_dir):
    srv = MockServer(model_dir).wait_ready()
    try:
        srv.proc.send_signal(signal.SIGKILL)  # no chance to clean up: the children must notice
        srv.proc.wait(10)
        deadline = time.monotonic() + 5
        while any(alive(p) for p in srv.children) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(alive(p) for p in srv.children)
    finally:
        srv.kill()

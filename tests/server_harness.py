"""A `jaxserve serve` subprocess for tests: start, wait, find its children, stop or kill.

Shared by the mock-engine frontend tests and the end-to-end tests on the demo model.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

TESTS_DIR = Path(__file__).resolve().parent
REPO_DIR = TESTS_DIR.parent

# Engine settings of the demo-model tests: few compiled buckets, so start-up stays short on
# 2 cores. One set for all of them, so that every demo-model engine of the session (the
# `demo_llm` fixture, each module's server) runs the same executables, compiled once into
# the session's compilation cache (tests/conftest.py).
DEMO_ENGINE = {
    "max_num_seqs": 16,
    "max_num_batched_tokens": 128,
    "max_model_len": 512,
    "num_blocks": 256,
}


# XLA options of every process of the test session (tests/conftest.py sets XLA_FLAGS for
# pytest's process, and the processes it starts inherit them; a test that gives a process its
# own device count uses `cpu_xla_flags`): LLVM's cheap pipeline for the compiled code. The
# suite's models are tiny, so its time goes into compiling, not running, the executables
# (a mesh engine's step shapes compiled in about half the time); XLA's own passes (fusion,
# sharding, the same HLO) run as without them.
FAST_COMPILE_XLA_FLAGS = (
    "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
)


def cpu_xla_flags(num_devices: int) -> str:
    """XLA_FLAGS for a test process with `num_devices` emulated CPU devices."""
    return f"--xla_force_host_platform_device_count={num_devices} {FAST_COMPILE_XLA_FLAGS}"


def ep_test_threshold(dp: int, tokens_per_rank: int) -> int:
    """`--ep-replicated-max-tokens` (MeshConfig.ep_replicated_max_tokens) of a test engine
    on a dp x tp mesh: MoE steps of up to tokens_per_rank tokens on each rank take the
    replicated-token path, larger ones all_to_all. Start-up then skips timing both paths
    at each step size (`sharding.ep_calibration`: two compilations per size).

    With the engine's max_num_batched_tokens every step is replicated: what the
    calibration chose at every step size of every test engine on the 2-core test
    machine (dp x 4, dp x 16; 3 of 3 tries each), so these engines run as they did.
    With max_num_seqs (below the 16-token bucket) decode steps are replicated and
    token-bucket steps all_to_all: test_engine_mesh's `llm_2x2` runs both paths. The
    calibration's own tests (test_sharding, test_warmup) still measure."""
    return dp * tokens_per_rank


def serve_flags(settings: dict) -> tuple[str, ...]:
    """`jaxserve serve` flags for `LLM` keyword settings: {"max_num_seqs": 16} ->
    ("--max-num-seqs", "16")."""
    return tuple(f for k, v in settings.items() for f in (f"--{k.replace('_', '-')}", str(v)))


class ServerProcess:
    """`python -m jaxserve.cli serve` on port 0 (loopback), its stderr collected."""

    def __init__(
        self,
        model_dir: Path,
        *,
        extra_args: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
        start_timeout_s: float = 60.0,
    ) -> None:
        self.start_timeout_s = start_timeout_s
        # Log lines as they come (the listening line before the engine is ready), as
        # before serve held a start's INFO lines back (jaxserve.logs.START_LOG_HOLD_ENV).
        env = {**os.environ, "JAXSERVE_START_LOG_HOLD_S": "0", **(env or {})}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS_DIR), env.get("PYTHONPATH")]))
        cmd = [
            sys.executable, "-m", "jaxserve.cli", "serve", "--model", str(model_dir),
            "--host", "127.0.0.1", "--port", "0", *extra_args,
        ]  # fmt: skip
        self.proc = subprocess.Popen(
            cmd, env=env, cwd=REPO_DIR, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True
        )
        self.lines: list[str] = []
        self.listening = threading.Event()  # gRPC bound, engine maybe still starting
        self.ready = threading.Event()
        self.target = ""
        self.http_url = ""  # "http://127.0.0.1:PORT" when serving with --http-port
        self.reader = threading.Thread(target=self._read_logs, daemon=True)  # ends at EOF
        self.reader.start()
        if not self.listening.wait(self.start_timeout_s):
            self.kill()
            raise AssertionError("server did not start listening:\n" + self.log())
        self.children = child_pids(self.proc.pid)
        # The private socket folder, removed by kill() when the server had no chance to.
        cmdline = self._cmdline(self.child("jaxserve.engine.process"))
        self.socket_dir = re.search(r"ipc://(\S+)/engine", cmdline).group(1)

    def wait_ready(self) -> ServerProcess:
        if not self.ready.wait(self.start_timeout_s):
            self.kill()
            raise AssertionError("server did not log ready:\n" + self.log())
        return self

    def _read_logs(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line)
            if m := re.search(r"HTTP \(OpenAI API\) listening on (127\.0\.0\.1:\d+)", line):
                self.http_url = f"http://{m.group(1)}"
            if m := re.search(r"gRPC listening on (127\.0\.0\.1:\d+)", line):
                self.target = m.group(1)
                self.listening.set()
            if re.search(r"jaxserve ready: .* on 127\.0\.0\.1:\d+", line):
                self.ready.set()

    def log(self) -> str:
        return "".join(self.lines)

    def child(self, module: str) -> int:
        """The pid of the child running `python -m module`."""
        for pid in self.children:
            if module in self._cmdline(pid):
                return pid
        raise AssertionError(f"no child runs {module}: {self.children}")

    @staticmethod
    def _cmdline(pid: int) -> str:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode().replace("\0", " ")

    def terminate(self, timeout: float) -> float:
        """SIGTERM; returns the seconds until the server process exited."""
        start = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout)
        return time.monotonic() - start

    def kill_child(self, module: str) -> None:
        """SIGKILL the child running `python -m module` (e.g. the engine)."""
        os.kill(self.child(module), signal.SIGKILL)

    def kill(self) -> None:
        for pid in [*self.children, self.proc.pid]:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        self.proc.wait(10)
        shutil.rmtree(self.socket_dir, ignore_errors=True)


def _ephemeral_low() -> int:
    """The lowest port the kernel hands out as a connection's local port (Linux's
    ip_local_port_range; 32768 where it cannot be read)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _port_slice(low: int, high: int) -> tuple[int, int]:
    """[low, high) itself, or under pytest-xdist (`-n N`) this worker's N-th of it: a
    port one worker picked is free until its server binds it, seconds later, and the other
    worker must not pick it meanwhile (`_GIVEN` is one process's)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")  # "gw0", "gw1", ...
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if not worker.startswith("gw") or count < 2:
        return low, high
    width = (high - low) // count
    start = low + int(worker[2:]) * width
    return start, start + width


# Ports free_port_range has handed out in this run: never twice (a test may pick several
# before any is bound).
_GIVEN: set[int] = set()


def free_port_range(n: int = 3) -> int:
    """A port on 127.0.0.1 with the next n - 1 free too, a moment ago, that no earlier call
    gave (a multi-process run's coordinator port: its step channel binds port + 1 and + 2).

    Picked below the kernel's ephemeral range: a server binds its port seconds after the
    test picks it (a multi-process run's step channel, after compiling: ~40 s), and a port
    of that range can meanwhile become any connection's local port; a CI run lost
    test_multihost's server so ("Address already in use" on port + 1) while other
    processes on the machine made thousands of connections."""
    start, stop = _port_slice(10_000, _ephemeral_low())
    for _ in range(200):
        port = random.randrange(start, max(stop - n, start + 1))
        if any(p in _GIVEN for p in range(port, port + n)):
            continue
        try:
            for p in range(port, port + n):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
        except OSError:
            continue
        _GIVEN.update(range(port, port + n))
        return port
    raise RuntimeError(f"no {n} free ports in a row in [{start}, {stop})")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago, for a test that must know a
    port before the server starts (see free_port_range)."""
    return free_port_range(1)


def child_pids(pid: int) -> list[int]:
    """Children of `pid`, from /proc/*/stat (field 4 is the parent pid)."""
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            children.append(int(stat.parent.name))
    return children


def alive(pid: int) -> bool:
    """True if `pid` exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def wait_idle(client, timeout: float = 30.0, rpc_timeout: float = 120.0):
    """`client.server_info()` (a JaxserveClient) once no request runs or waits and every
    KV block is free; AssertionError after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        info = client.server_info(timeout=rpc_timeout)
        if (
            info.num_running == info.num_waiting == 0
            and info.kv_blocks_free == info.kv_blocks_total
        ):
            return info
        assert time.monotonic() < deadline, f"not idle after {timeout} s: {info}"
        time.sleep(0.05)

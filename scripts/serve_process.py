"""`jaxserve serve` as a subprocess of a benchmark script: a free loopback port, the
process with its stderr read into a log by a thread, the "jaxserve ready" line as an
event, and a stop that kills what does not exit. Shared by bench_serve.py and
bench_router.py (router_workload.py); imported by path (scripts/ on sys.path).
"""

from __future__ import annotations

import socket
import subprocess
import threading


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the OS's pick)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServeProcess:
    """Runs `cmd` (a `jaxserve serve` command line) until `stop()`.

    ready: set when the server logs "jaxserve ready"; log: its stderr lines so far.
    stdout: where its stdout goes (None: this process's). stop_timeout_s: seconds
    `stop()` waits after SIGTERM before SIGKILL. env, cwd: its environment and working
    folder (None: this process's). Subclasses see every stderr line in
    `on_line` (called from the reader thread; set what it uses before this __init__).
    """

    def __init__(
        self, cmd: list[str], stdout=None, stop_timeout_s: float = 30.0, env=None, cwd=None
    ) -> None:
        self.stop_timeout_s = stop_timeout_s
        self.proc = subprocess.Popen(
            cmd, stderr=subprocess.PIPE, stdout=stdout, text=True, env=env, cwd=cwd
        )
        self.ready = threading.Event()
        self.log: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.log.append(line)
            if "jaxserve ready" in line:
                self.ready.set()
            self.on_line(line)

    def on_line(self, line: str) -> None:
        """One stderr line of the server (after `log` and `ready` saw it)."""

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(self.stop_timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()

"""The client-side commands against an address where nothing listens end with one line
naming it and a non-zero exit, never a table of zeros or a silent wait:
`jaxserve bench` (both backends), `jaxserve generate`, and `jaxserve engine --frontend`
(which logs what it waits for at once and gives up after --handshake-timeout-s). Each
runs the real command as a subprocess, as a user would; no server is started."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from contextlib import contextmanager

import pytest
from server_harness import REPO_DIR, free_port

from jaxserve.config import DEMO_MODEL_DIR


def _jaxserve(*argv: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "jaxserve.cli", *argv],
        capture_output=True, text=True, timeout=timeout, cwd=REPO_DIR,
    )  # fmt: skip


@pytest.mark.parametrize("backend", ["grpc", "http"])
def test_bench_against_a_dead_server_is_one_line(backend):
    address = f"127.0.0.1:{free_port()}"
    r = _jaxserve(
        "bench", "--backend", backend, "--server", address, "--num-prompts", "3",
        "--no-progress",
    )  # fmt: skip
    assert r.returncode == 1, r
    assert r.stdout == ""  # no table
    lines = r.stderr.splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith(f"jaxserve bench: error: --server {address}: "), lines[0]
    assert "refused" in lines[0].lower(), lines[0]


def test_generate_against_a_dead_server_is_one_line_and_no_empty_one():
    """A failed `jaxserve generate` that printed no text says so in one stderr line; it
    used to print an empty line first (the newline that ends streamed text). The line
    asks whether the server runs at the address."""
    address = f"127.0.0.1:{free_port()}"
    r = _jaxserve("generate", "--server", address, "--timeout", "20", "hi")
    assert r.returncode == 1, r
    assert r.stdout == ""
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("jaxserve generate: UNAVAILABLE: "), r.stderr
    # gRPC's words alone did not say what to check
    assert lines[0].endswith(f"; is `jaxserve serve` running at {address}?"), lines[0]


def test_bench_http_against_a_port_that_does_not_speak_http_is_one_line():
    """--backend http given the gRPC port (a server that answers HTTP/2 frames, not an
    HTTP/1.1 status line) is one line naming --server, not a BadStatusLine traceback."""
    import socket

    listener = socket.create_server(("127.0.0.1", 0))
    address = f"127.0.0.1:{listener.getsockname()[1]}"

    # What a grpc server sends first: an HTTP/2 SETTINGS frame.
    settings = b"\x00\x00\x06\x04\x00\x00\x00\x00\x00\x00\x04\x00\x00\xff\xff"
    threading.Thread(target=_answer_with, args=(listener, settings), daemon=True).start()
    try:
        r = _jaxserve(
            "bench", "--backend", "http", "--server", address, "--num-prompts", "3",
            "--no-progress",
        )  # fmt: skip
    finally:
        listener.close()
    assert r.returncode == 1 and r.stdout == "", r
    lines = r.stderr.splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith(f"jaxserve bench: error: --server {address}: "), lines[0]
    assert "--http-port" in lines[0], lines[0]


# A host name is taken as an address is (an IPv6 one is refused: the test below).
@pytest.mark.parametrize("host", ["127.0.0.1", "localhost"])
def test_engine_to_an_address_where_nothing_listens_says_so_and_gives_up(host):
    address = f"{host}:{free_port()}"
    cmd = [
        sys.executable, "-m", "jaxserve.cli", "engine", str(DEMO_MODEL_DIR),
        "--frontend", address, "--handshake-timeout-s", "4",
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=REPO_DIR, stderr=subprocess.PIPE, text=True)
    lines: list[tuple[float, str]] = []

    def read():
        lines.extend((time.monotonic(), line.rstrip("\n")) for line in proc.stderr)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        code = proc.wait(60)
    finally:
        proc.kill() if proc.poll() is None else None
    reader.join(10)
    ended = time.monotonic()
    text = "\n".join(line for _, line in lines)
    assert code == 1, text
    waiting = [t for t, line in lines if "waiting up to 4 s (--handshake-timeout-s)" in line]
    refused = [t for t, line in lines if f"nothing listens at {address} yet" in line]
    assert waiting and refused, text
    # Both said at once, not only when giving up 4 s later.
    assert refused[0] < ended - 2.0, text
    last = lines[-1][1]
    assert last.startswith("jaxserve engine: error: --frontend: no answer within 4 s"), text
    assert f"nothing listens at {address}" in last and "Traceback" not in text


def test_engine_max_model_len_above_the_models_limit_is_one_line():
    r = _jaxserve(
        "engine", str(DEMO_MODEL_DIR), "--frontend", f"127.0.0.1:{free_port()}",
        "--max-model-len", str(10**9),
    )  # fmt: skip
    assert r.returncode == 2, r
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and "max-model-len: " in lines[0], r.stderr
    assert lines[0].startswith("jaxserve engine: error: "), lines[0]


# engine's short --handshake-timeout-s: without the refusal it ends in seconds, not 60.
@pytest.mark.parametrize(
    "command, flag, more",
    [("engine", "frontend", ["--handshake-timeout-s", "3"]), ("serve", "replica-listen", [])],
)
def test_an_ipv6_replica_address_is_refused_by_name_on_both_sides(command, flag, more):
    """The remote replicas' ZeroMQ sockets are IPv4 only. serve --replica-listen refused
    an IPv6 address; engine --frontend took one and retried until --handshake-timeout-s
    (exit 1), though nothing could ever answer there. Both now refuse it with the same
    line naming their flag, exit 2, before anything starts."""
    r = _jaxserve(command, str(DEMO_MODEL_DIR), f"--{flag}", f"[::1]:{free_port()}", *more)
    assert r.returncode == 2, r
    assert r.stderr.splitlines() == [
        f"jaxserve {command}: error: --{flag}: IPv6 addresses (::1) are not supported yet; "
        "give an IPv4 address or a host name"
    ], r.stderr


@pytest.mark.parametrize(
    "command, flag, more",
    [("engine", "frontend", ["--handshake-timeout-s", "3"]), ("serve", "replica-listen", [])],
)
@pytest.mark.parametrize("port", ["0", "70000"])
def test_a_port_outside_the_tcp_range_is_refused_by_name(command, flag, more, port):
    """engine --frontend 127.0.0.1:70000 (or :0) retried "nothing listens" until
    --handshake-timeout-s, though no TCP port is 0 or past 65535; both flags now refuse it
    in one line, exit 2."""
    r = _jaxserve(command, str(DEMO_MODEL_DIR), f"--{flag}", f"127.0.0.1:{port}", *more)
    assert r.returncode == 2, r
    assert r.stderr.splitlines() == [
        f"jaxserve {command}: error: --{flag}: port must be within [1, 65535], "
        f"got '127.0.0.1:{port}'"
    ], r.stderr


@pytest.mark.parametrize("more", [[], ["--allow-remote"]])
def test_a_listen_host_that_does_not_resolve_is_refused_by_name(more):
    """serve --replica-listen nosuchhost.invalid:5555 asked for --allow-remote, and with
    it blamed --host (exit 1). A name under .invalid never resolves (RFC 6761), and
    --replica-listen binds on this host, so it is refused at once in one line naming the
    flag, exit 2, before anything starts."""
    r = _jaxserve(
        "serve", str(DEMO_MODEL_DIR), "--replica-listen", "nosuchhost.invalid:5555", *more
    )
    assert r.returncode == 2, r
    lines = r.stderr.splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith(
        "jaxserve serve: error: --replica-listen: host nosuchhost.invalid does not resolve ("
    ), lines[0]
    assert lines[0].endswith("); give an IPv4 address or a host name that resolves to one")


def test_a_frontend_host_that_does_not_resolve_is_waited_for_then_named():
    """engine --frontend nosuchhost.invalid:5555 said "nothing listens" and retried until
    --handshake-timeout-s. A peer's name may resolve only once its host starts (a
    Kubernetes pod's), so it is waited for, within the same timeout, with a WARNING at
    once saying so; then the last line names the flag and says the host does not
    resolve, exit 2, and no engine was started (it ends within seconds of the timeout)."""
    start = time.monotonic()
    r = _jaxserve(
        "engine", str(DEMO_MODEL_DIR), "--frontend", "nosuchhost.invalid:5555",
        "--handshake-timeout-s", "2",
    )  # fmt: skip
    assert r.returncode == 2, r
    assert time.monotonic() - start < 30, "an engine was started"
    lines = r.stderr.splitlines()
    assert any(
        "frontend: host nosuchhost.invalid does not resolve yet" in line
        and "trying again for up to 2 s" in line
        for line in lines[:-1]
    ), r.stderr
    assert lines[-1].startswith(
        "jaxserve engine: error: --frontend: host nosuchhost.invalid does not resolve ("
    ), lines[-1]
    assert lines[-1].endswith(
        ") after 2 s; give an address or a host name that resolves to an IPv4 address"
    ), lines[-1]


def test_bench_plot_without_matplotlib_fails_before_the_run():
    """--plot needs the bench extra's matplotlib: without it the command stops at once
    with the flag named (exit 2), not after a whole run (the server here is dead, so a
    run would have failed differently)."""
    code = (
        "import sys; sys.modules['matplotlib'] = None; from jaxserve.cli import main; "
        f"main(['bench', '--server', '127.0.0.1:{free_port()}', '--plot', 'x.png', "
        "'--num-prompts', '2', '--no-progress'])"
    )
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO_DIR
    )
    assert r.returncode == 2, r
    assert r.stderr.strip().splitlines() == [
        "jaxserve bench: error: --plot: needs matplotlib (pip install 'jaxserve[bench]')"
    ], r.stderr


@pytest.mark.parametrize("flag", ["--out", "--plot"])
def test_bench_unwritable_output_fails_before_the_run(flag, tmp_path):
    """--out / --plot where nothing can be written (/proc/x) ended a whole run with a
    FileNotFoundError traceback, the results lost; now one line naming the flag, exit 2,
    before the server is asked anything (it is dead here: a run would fail otherwise)."""
    r = _jaxserve(
        "bench", "--server", f"127.0.0.1:{free_port()}", flag, "/proc/x.out",
        "--num-prompts", "2", "--no-progress",
    )  # fmt: skip
    assert r.returncode == 2, r
    assert r.stderr.splitlines() == [
        f"jaxserve bench: error: {flag}: cannot write /proc/x.out (No such file or directory)"
    ], r.stderr
    # A writable path in a folder still to be made is fine, and nothing is left behind.
    from jaxserve.flag_types import check_writable

    good = tmp_path / "new" / "b.json"
    check_writable("--out", str(good))
    assert good.parent.is_dir() and not good.exists()
    with pytest.raises(ValueError, match=r"--out: cannot write .* \(Is a directory\)"):
        check_writable("--out", str(tmp_path))


def test_convert_unwritable_out_names_the_flag():
    """It said only "[Errno 2] No such file or directory: '/proc/x'", after loading."""
    r = _jaxserve("convert", "--model", str(DEMO_MODEL_DIR), "--out", "/proc/x")
    assert r.returncode == 2, r
    assert r.stderr.splitlines() == [
        "jaxserve convert: error: --out: cannot write /proc/x (No such file or directory)"
    ], r.stderr


@pytest.mark.parametrize(
    "argv, line",
    [
        (["--model", "/missing"], "--model: /missing is not a folder"),
        (["--model", "/proc"], "--model: /proc has no config.json"),
        (["--model", str(DEMO_MODEL_DIR), "--mesh", "dp=x"],
         "--mesh: expected 'dp=D,tp=T' with positive integers, got 'dp=x'"),
    ],
)  # fmt: skip
def test_convert_bad_input_is_a_usage_error_naming_the_flag(argv, line, tmp_path):
    """A --model that is no HF folder ended with exit 1 and no flag named, a bad --mesh
    likewise (both after importing JAX); now exit 2, one line naming the flag, as the
    other client commands' usage errors, and nothing written."""
    out = tmp_path / "out"
    r = _jaxserve("convert", *argv, "--out", str(out))
    assert r.returncode == 2, r
    assert len(r.stderr.splitlines()) == 1, r.stderr
    assert r.stderr.startswith(f"jaxserve convert: error: {line}"), r.stderr
    assert not out.exists() or not any(out.iterdir())


def test_convert_into_a_checkpoint_names_the_flag(tmp_path):
    """An --out that holds a checkpoint already was refused after loading the model, as
    exit 1; now before it, exit 2 naming --out."""
    (tmp_path / "weights").mkdir()
    r = _jaxserve("convert", "--model", str(DEMO_MODEL_DIR), "--out", str(tmp_path))
    assert r.returncode == 2, r
    assert r.stderr.splitlines() == [
        f"jaxserve convert: error: --out: {tmp_path / 'weights'} already exists; "
        "choose an empty folder"
    ], r.stderr


def _answer_with(listener, reply: bytes) -> None:
    """Answer every connection to `listener` with `reply` after its first bytes, until
    the listener closes."""
    while True:
        try:
            conn, _ = listener.accept()
        except OSError:
            return
        with conn:
            conn.recv(65536)
            conn.sendall(reply)


# What uvicorn (serve's --http-port) answers gRPC's HTTP/2 preface with.
HTTP1_400 = b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n"


@contextmanager
def _http1_server(kind: str):
    """The address of an HTTP/1 server: serve's HTTP API port (uvicorn: "HTTP/1.1 400")
    or its metrics port (prometheus_client's http.server: an error page with no status
    line)."""
    import http.server
    import socket

    if kind == "http.server":
        server = http.server.ThreadingHTTPServer(
            ("127.0.0.1", 0), http.server.BaseHTTPRequestHandler
        )
        threading.Thread(target=server.serve_forever, daemon=True).start()
        port, stop = server.server_address[1], lambda: (server.shutdown(), server.server_close())
    else:
        listener = socket.create_server(("127.0.0.1", 0))
        threading.Thread(target=_answer_with, args=(listener, HTTP1_400), daemon=True).start()
        port, stop = listener.getsockname()[1], listener.close
    try:
        yield f"127.0.0.1:{port}"
    finally:
        stop()


@pytest.mark.parametrize("kind", ["status line", "http.server"])
def test_generate_against_an_http1_port_names_the_grpc_port(kind):
    """generate given the HTTP API port or the metrics port suggested TLS; it now says
    what the port looks like and which one generate needs."""
    with _http1_server(kind) as address:
        r = _jaxserve("generate", "--server", address, "--timeout", "20", "hi")
    lines = r.stderr.splitlines()
    assert r.returncode == 1 and len(lines) == 1, r
    assert lines[0].startswith("jaxserve generate: UNAVAILABLE: "), lines[0]
    assert "TLS" not in lines[0]
    assert lines[0].endswith(
        f" ({address} looks like an HTTP/1 server: the HTTP API or metrics port? "
        "generate speaks gRPC: give serve's --port)"
    ), lines[0]


@pytest.mark.parametrize("kind", ["status line", "http.server"])
def test_python_client_against_an_http1_port_names_the_grpc_port(kind):
    """JaxserveClient raised gRPC's raw RpcError ("... http1.x server"); it raises
    NotGrpcServerError, still an UNAVAILABLE RpcError, whose message names the address
    and the port to give, from each call."""
    import grpc

    from jaxserve.frontend.client import JaxserveClient, NotGrpcServerError

    with _http1_server(kind) as address, JaxserveClient(address) as client:
        calls = {
            "complete": lambda: client.complete("hi", timeout=20),
            "server_info": lambda: client.server_info(timeout=20),
            "abort": lambda: client.abort("x", timeout=20),
            "is_serving": lambda: client.is_serving(timeout=20),  # never will be: not False
        }
        for name, call in calls.items():
            with pytest.raises(NotGrpcServerError) as info:
                call()
            assert str(info.value) == (
                f"{address} looks like an HTTP/1 server: the HTTP API or metrics port? "
                "JaxserveClient speaks gRPC: give serve's --port"
            ), name
            assert isinstance(info.value, grpc.RpcError) and info.value.target == address
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE


def test_ctrl_c_in_a_client_command_is_exit_130_without_a_traceback():
    """SIGINT during `jaxserve bench` (here: waiting on a server that accepts and never
    answers) ends it with 130 and no traceback, as a shell expects."""
    import signal
    import socket

    listener = socket.create_server(("127.0.0.1", 0))  # accepts, never answers
    listener.settimeout(30)  # a bench that died before connecting fails the test, not hangs
    address = f"127.0.0.1:{listener.getsockname()[1]}"
    # Ctrl-C as a terminal delivers it: Python's handler installed even where this test
    # runs with SIGINT ignored (a job started with `&` by a non-interactive shell, whose
    # children inherit the ignore, and Python then installs no handler).
    argv = ["bench", "--backend", "http", "--server", address, "--num-prompts", "2",
            "--no-progress"]  # fmt: skip
    code = (
        "import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
        f"from jaxserve.cli import main; main({argv!r})"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO_DIR,
    )  # fmt: skip
    try:
        conn, _ = listener.accept()  # bench is now waiting for its probe's answer
        time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
        conn.close()
    finally:
        listener.close()
        proc.kill()
    assert proc.returncode == 130, err
    assert "Traceback" not in err and out == "", err


def test_wait_until_serving_on_a_closed_port_says_the_last_answer():
    # It said only "server not SERVING within 1 s": nothing told a refused connection
    # from an engine still starting.
    import socket

    from jaxserve.frontend.client import JaxserveClient

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with JaxserveClient(f"127.0.0.1:{port}") as client:
        with pytest.raises(TimeoutError) as info:
            client.wait_until_serving(1)
    assert str(info.value).startswith(
        "server not SERVING within 1 s (last answer: UNAVAILABLE: "
    ), str(info.value)


def test_bench_grpc_given_a_host_without_a_port_names_the_flag():
    """`bench --server nohost` (gRPC backend) said `target: nohost has no port`, naming the
    client's argument, not the flag (session 23's fresh-user trial): now --server, exit 2,
    before the server is asked anything."""
    r = _jaxserve("bench", "--server", "nohost", "--num-prompts", "1", "--no-progress")
    assert r.returncode == 2, r
    assert r.stderr.splitlines() == [
        "jaxserve bench: error: --server: nohost has no port; the gRPC API takes HOST:PORT "
        "with serve's --port (e.g. nohost:50051)"
    ], r.stderr

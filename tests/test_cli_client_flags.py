"""The client tools' flags (generate, bench, diagnose, profile), checked while parsing:
a time that is not a positive number, a request int the proto cannot hold, NaN where a
negative is refused, a --server port out of range, an HTTP URL given to a gRPC tool; each
a usage error naming the flag, exit 2 (and `JaxserveClient` refuses the same targets)."""

from __future__ import annotations

import re

import pytest

from jaxserve.cli import build_parser
from jaxserve.sampling_params import MAX_N

_GENERATE = ["generate", "hi"]
_PROFILE = ["profile", "--server", "h:1", "--out", "d"]


def _usage_line(capsys, argv: list[str]) -> str:
    """The one stderr line of `jaxserve ARGV` refused while parsing (exit code 2)."""
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(argv)
    assert e.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1, lines
    return lines[0]


@pytest.mark.parametrize(
    ("command", "flag", "value"),
    [(_PROFILE, "--seconds", "-5"), (_PROFILE, "--seconds", "nan")],
)  # fmt: skip
def test_a_client_time_that_is_not_positive_is_a_usage_error(command, flag, value, capsys):
    """A capture of -5 s: a bad setting, refused while parsing, naming the flag (as
    generate's --timeout, below)."""
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args([*command, flag, value])
    assert e.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and f"error: argument {flag}: must be a finite number > 0" in lines[0]
    assert getattr(build_parser().parse_args([*command, flag, "1.5"]), flag[2:]) == 1.5


@pytest.mark.parametrize(
    ("flag", "value", "bounds"),
    [("--seed", "99999999999999999999999", "[-9223372036854775808, 9223372036854775807]"),
     ("--seed", "-9223372036854775809", "[-9223372036854775808, 9223372036854775807]"),
     ("--max-tokens", "2147483648", "[1, 2147483647]"),
     ("--max-tokens", "0", "[1, 2147483647]"),
     ("--top-k", "-2147483649", "[-2147483648, 2147483647]"),
     ("-n", "99999999999", f"[1, {MAX_N}]"),
     ("-n", "-1", f"[1, {MAX_N}]"),
     ("-n", str(MAX_N + 1), f"[1, {MAX_N}]")],
)  # fmt: skip
def test_a_generate_int_the_request_cannot_hold_names_the_flag_and_range(
    flag, value, bounds, capsys
):
    """`generate --seed 99999999999999999999999` used to say protobuf's "Value out of
    range: ..." without the flag: a usage error naming the flag and the field's range
    (for -n the server's MAX_N: `-n 0` used to say [1, 2147483647])."""
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args([*_GENERATE, flag, value])
    assert e.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1, lines
    assert f"argument {flag}" in lines[0] and f"must be within {bounds}, got {value}" in lines[0]
    assert build_parser().parse_args([*_GENERATE, "--seed", "-5"]).seed == -5
    with pytest.raises(SystemExit):
        build_parser().parse_args([*_GENERATE, "--seed", "x"])
    assert "invalid int value: 'x'" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "cause"),
    [(["--temperature", "nan"], "--temperature: must be >= 0, got nan"),
     (["--warmup-timeout", "nan"], "--warmup-timeout: must be >= 0, got nan"),
     (["--timeout", "nan"], r"--timeout: must be in \(0, 1e\+06\], got nan"),
     (["--timeout", "1e10"], r"--timeout: must be in \(0, 1e\+06\], got 10000000000.0")],
)  # fmt: skip
def test_bench_refuses_nan_where_it_refuses_negatives(argv, cause):
    from jaxserve.benchmark.cli import _check_flags

    with pytest.raises(ValueError, match=f"^{cause}$"):
        _check_flags(build_parser().parse_args(["bench", *argv]))


_SERVER_COMMANDS = [["generate", "hi"], ["bench"], ["diagnose"], ["profile", "--out", "d"]]


@pytest.mark.parametrize("command", _SERVER_COMMANDS)
@pytest.mark.parametrize(
    ("server", "port"),
    [("127.0.0.1:99999", 99999), ("127.0.0.1:0", 0), ("[::1]:65536", 65536),
     ("http://h:70000/v1", 70000)],
)  # fmt: skip
def test_a_server_port_out_of_range_is_a_usage_error(command, server, port, capsys):
    """`generate --server 127.0.0.1:99999` used to reach gRPC, which takes the port modulo
    65536 (a server on 34463 would answer): refused while parsing, in every client tool."""
    line = _usage_line(capsys, [*command, "--server", server])
    assert f"error: argument --server: port must be in [1, 65535], got {port}" in line


@pytest.mark.parametrize("command", _SERVER_COMMANDS)
@pytest.mark.parametrize(
    ("server", "words"),
    [("127.0.0.1:abc", "port must be a number in [1, 65535], got 'abc' in 127.0.0.1:abc"),
     ("[::1]:x1", "port must be a number in [1, 65535], got 'x1' in [::1]:x1"),
     ("h:", "port must be a number in [1, 65535], got '' in h:"),
     (":50051", "host must not be empty, got :50051 (e.g. 127.0.0.1:50051)"),
     ("a b:1", "host must not contain spaces, got 'a b'"),
     ("http://h:8x/v1", "port must be a number in [1, 65535], got '8x' in http://h:8x/v1")],
)  # fmt: skip
def test_a_server_address_that_is_no_host_port_is_a_usage_error(command, server, words, capsys):
    """`generate --server 127.0.0.1:abc` reached gRPC, which failed with "errors resolving
    ..." and exit 1, as if the server were down (session 23's fresh-user trial)."""
    if command[0] in ("generate", "profile") and server.startswith("http://"):
        return  # a URL is no gRPC target: refused as such (below)
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args([*command, "--server", server])
    assert e.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and f"error: argument --server: {words}" in lines[0], lines


@pytest.mark.parametrize("command", [["generate", "hi"], ["profile", "--out", "d"]])
def test_a_grpc_client_given_bracketed_ipv6_without_a_port_is_told_to_give_one(command, capsys):
    # gRPC dialled ipv6:%5B::1%5D:443 (session 23's fresh-user trial).
    with pytest.raises(SystemExit):
        build_parser().parse_args([*command, "--server", "[::1]"])
    assert "error: argument --server: [::1] has no port" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("command", "server", "words"),
    [(["diagnose"], "127.0.0.1", "127.0.0.1 has no port; give serve's --metrics-port"),
     (["diagnose"], "", "must not be empty (e.g. 127.0.0.1:9090, serve's --metrics-port)"),
     (["generate", "hi"], "", "must not be empty (e.g. 127.0.0.1:50051)"),
     (["profile", "--out", "d"], " ", "must not be empty (e.g. 127.0.0.1:50051)")],
)  # fmt: skip
def test_a_server_without_a_port_or_empty_is_a_usage_error(command, server, words, capsys):
    """`diagnose --server 127.0.0.1` read http://127.0.0.1/metrics (port 80) and failed
    with "Connection refused", and `--server ''` with "no host given", both exit 1; an
    empty gRPC --server said "argument --server:  has no port" (two spaces, no host)."""
    line = _usage_line(capsys, [*command, "--server", server])
    assert f"error: argument --server: {words}" in line, line


@pytest.mark.parametrize("command", _SERVER_COMMANDS)
@pytest.mark.parametrize(
    "server", ["127.0.0.1:65535", "[::1]:1", "h:50051", "http://h/v1", "unix:/tmp/s"]
)
def test_a_server_address_in_range_or_without_a_port_is_taken(command, server):
    if command[0] in ("generate", "profile") and server.startswith("http://"):
        return  # a URL is no gRPC target: the next test
    assert build_parser().parse_args([*command, "--server", server]).server == server


@pytest.mark.parametrize("command", [["generate", "hi"], ["profile", "--out", "d"]])
@pytest.mark.parametrize("url", ["http://127.0.0.1:8000/v1", "https://h:50051"])
def test_a_grpc_client_given_an_http_url_says_to_give_host_port(command, url, capsys):
    # gRPC said only "Misformatted domain name" (and wait_until_serving timed out).
    from jaxserve.frontend.client import JaxserveClient

    words = f"{url} is an HTTP URL; the gRPC API takes HOST:PORT with serve's --port"
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args([*command, "--server", url])
    assert e.value.code == 2
    assert f"error: argument --server: {words}" in capsys.readouterr().err
    with pytest.raises(ValueError, match=f"^target: {re.escape(words)}"):
        JaxserveClient(url)


@pytest.mark.parametrize("command", [["generate", "hi"], ["profile", "--out", "d"]])
def test_a_grpc_client_given_a_host_without_a_port_says_to_give_one(command, capsys):
    # gRPC dialled localhost:443 and the error named 443 (session 20's fresh-user trial).
    from jaxserve.frontend.client import JaxserveClient

    words = "localhost has no port; the gRPC API takes HOST:PORT with serve's --port"
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args([*command, "--server", "localhost"])
    assert e.value.code == 2
    assert f"error: argument --server: {words} (e.g. localhost:50051)" in capsys.readouterr().err
    with pytest.raises(ValueError, match=f"^target: {re.escape(words)}"):
        JaxserveClient("localhost")


def test_the_client_refuses_a_target_port_out_of_range():
    from jaxserve.frontend.client import JaxserveClient

    with pytest.raises(ValueError, match=r"^target: port must be in \[1, 65535\], got 99999$"):
        JaxserveClient("127.0.0.1:99999")
    JaxserveClient("127.0.0.1:65535").close()


@pytest.mark.parametrize("command", [["generate", "hi"], ["profile", "--out", "d"]])
@pytest.mark.parametrize("server", ["::1:50941", "fe80::1:50051"])
def test_a_grpc_client_given_ipv6_without_brackets_is_told_to_bracket_it(command, server, capsys):
    # gRPC said only "Misformatted domain name" (session 18's fresh-user trial).
    words = f"an IPv6 host goes in brackets before the port ([::1]:50051), got {server}"
    with pytest.raises(SystemExit):
        build_parser().parse_args([*command, "--server", server])
    assert f"error: argument --server: {words}" in capsys.readouterr().err
    assert build_parser().parse_args([*command, "--server", f"[{server[:-6]}]:50051"])


@pytest.mark.parametrize("value", ["1e10", "1e308", "inf", "0", "-1", "nan"])
def test_generate_timeout_out_of_range_is_a_usage_error(value, capsys):
    """`generate --timeout 1e10` failed at once with "DEADLINE_EXCEEDED ...; --timeout
    1e+10 s passed (raise it ...)": gRPC's deadline clock overflows near 9.2e9 s. And
    `--timeout -1` was sent as a deadline already past."""
    line = _usage_line(capsys, [*_GENERATE, "--timeout", value])
    assert f"argument --timeout: must be in (0, 1e+06], got {value}" in line
    assert build_parser().parse_args([*_GENERATE, "--timeout", "1e6"]).timeout == 1e6

"""`jaxserve profile` against what is not a jaxserve gRPC server: one line, without the
"profile:" its error prefix already says ("jaxserve profile: error: profile: ..."), and
for an HTTP/1 server (serve's --metrics-port or --http-port) the port to give instead,
as `jaxserve generate` says."""

from __future__ import annotations

import http.server
import threading

from jaxserve.cli import build_parser


class _Quiet(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args) -> None:  # its request lines would go to stderr too
        pass


def _profile(capsys, server: str, tmp_path) -> tuple[int, list[str]]:
    argv = ["profile", "--server", server, "--seconds", "1", "--out", str(tmp_path / "p")]
    args = build_parser().parse_args(argv)
    code = args.func(args)
    return code, capsys.readouterr().err.splitlines()


def test_an_http1_port_says_which_port_to_give(capsys, tmp_path):
    httpd = http.server.HTTPServer(("127.0.0.1", 0), _Quiet)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        server = f"127.0.0.1:{httpd.server_address[1]}"
        code, err = _profile(capsys, server, tmp_path)
    finally:
        httpd.shutdown()
    assert code == 1 and len(err) == 1, err
    assert err[0].startswith("jaxserve profile: error: UNAVAILABLE: "), err[0]
    assert err[0].endswith(
        f"; {server} looks like an HTTP/1 server: the HTTP API or metrics port? "
        "profile speaks gRPC: give serve's --port"
    ), err[0]


def test_a_closed_port_is_one_line_without_a_second_prefix(capsys, tmp_path):
    code, err = _profile(capsys, "127.0.0.1:1", tmp_path)
    assert code == 1 and len(err) == 1, err
    assert err[0].startswith("jaxserve profile: error: UNAVAILABLE: "), err[0]
    assert "HTTP/1" not in err[0]

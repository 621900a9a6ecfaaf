"""`jaxserve bench --backend http` without aiohttp (the `bench` extra): one error line
naming the package and how to install it, before any output or request
(jaxserve/benchmark/cli.py: `_check_flags`; --plot without matplotlib, the same check,
is test_cli_unreachable's)."""

from __future__ import annotations

import sys

import pytest

from jaxserve.benchmark import cli
from jaxserve.cli import build_parser


def test_http_backend_without_aiohttp_is_one_line_before_anything_else(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "aiohttp", None)  # `import aiohttp` fails, find_spec: None
    # The server is never asked (the run drew its progress bar, then failed at the backend).
    monkeypatch.setattr(cli, "ask_server", lambda *a: pytest.fail("the server was asked"))
    args = build_parser().parse_args(["bench", "--server", "127.0.0.1:1", "--backend", "http"])
    assert args.func(args) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err == (
        "jaxserve bench: error: --backend http: needs aiohttp (pip install 'jaxserve[bench]')\n"
    )

"""An API key that cannot travel as a header value (gRPC metadata, the HTTP
Authorization header: printable ASCII) is refused where it is given, naming the flag
and not echoing the key; a client sent it and got "GetServerInfo failed (INTERNAL:
Invalid metadata)" after gRPC's own log lines, exit code 1."""

from __future__ import annotations

import pytest

from jaxserve.cli import build_parser
from jaxserve.frontend.auth import resolve_api_key


@pytest.mark.parametrize(("key", "position"), [("ключ", 1), ("ab\ncd", 3), ("a\x7fb", 2)])
def test_a_key_that_is_no_header_value_is_refused(key, position):
    with pytest.raises(ValueError) as e:
        resolve_api_key(key, None)
    assert str(e.value) == (
        "api-key: the API key must be printable ASCII (it is sent as a header); "
        f"character {position} is not"
    )


def test_the_variable_is_named_for_its_key(monkeypatch):
    monkeypatch.setenv("JAXSERVE_API_KEY", "sécret")
    with pytest.raises(ValueError, match="^JAXSERVE_API_KEY: .* character 2 is not$"):
        resolve_api_key(None, None)


def test_printable_keys_pass_stripped():
    assert resolve_api_key("  a-Z_0~9 !x  ", None) == "a-Z_0~9 !x"


def test_bench_refuses_it_in_one_line_before_any_request(capsys):
    args = build_parser().parse_args(
        ["bench", "--server", "127.0.0.1:1", "--num-prompts", "1", "--no-progress",
         "--api-key", "ключ"]
    )  # fmt: skip
    assert args.func(args) == 2
    assert capsys.readouterr().err.splitlines() == [
        "jaxserve bench: error: --api-key: the API key must be printable ASCII (it is sent "
        "as a header); character 1 is not"
    ]

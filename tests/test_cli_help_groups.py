"""`jaxserve serve --help` shows every flag under a topic: the admission, stream-buffer,
stall, TLS and API-key flags in groups of their own, not among the general options (where
only --help is left)."""

from __future__ import annotations

import argparse

from jaxserve.cli import build_parser


def _sections(help_text: str) -> dict[str, list[str]]:
    """Heading -> the flags listed under it (the first option string of each entry)."""
    sections: dict[str, list[str]] = {}
    current = None
    for line in help_text.splitlines():
        if line and not line.startswith(" ") and line.endswith(":"):
            current = sections.setdefault(line[:-1], [])
        elif current is not None and line.startswith("  -"):
            current.append(line.split()[0].rstrip(","))
    return sections


def _serve_help() -> str:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["serve"].format_help()


def test_frontend_flags_have_groups_of_their_own():
    sections = _sections(_serve_help())
    assert sections["options"] == ["-h"]
    assert sections["admission control and stall detection"] == [
        "--max-pending-requests", "--max-queued-prompt-tokens",
        "--max-inflight-request-bytes", "--max-stream-buffer-bytes", "--stall-timeout-s",
    ]  # fmt: skip
    assert sections["TLS"] == ["--tls-cert", "--tls-key", "--tls-client-ca"]
    assert sections["API key"] == ["--api-key", "--api-key-file"]


def _subparser(name: str) -> argparse.ArgumentParser:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


def test_engine_help_lists_only_the_flags_that_shape_the_engine():
    """`jaxserve engine --help` lists no frontend or router flag (serve lists them all);
    the engine still accepts them, so that a serve command line runs as is, and names
    the ones given as ignored."""
    from jaxserve.router import headless

    engine = _subparser("engine")
    listed = {flag for flags in _sections(engine.format_help()).values() for flag in flags}
    frontend = ["--port", "--http-port", "--stats-log-interval", "--replicas", "--router-policy"]
    frontend += ["--router-weight", "--replica-listen", "--allow-remote"]
    serve_listed = {f for fs in _sections(_serve_help()).values() for f in fs}
    assert set(frontend) <= serve_listed
    assert not listed & set(frontend), listed & set(frontend)
    assert {"--max-num-seqs", "--mesh", "--log-level", "--frontend"} <= listed
    args = engine.parse_args(["--frontend", "h:1", "--port", "7", "--router-weight", "2"])
    assert headless._frontend_flags_given(args) == ["--port", "--router-weight"]

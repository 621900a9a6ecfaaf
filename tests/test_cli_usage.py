"""The `jaxserve` command itself: --version and `python -m jaxserve`, help that says
every default in one wording, and usage errors as one line naming the subcommand and the
flag (a value out of range, an unknown flag, a --compilation-cache-dir that cannot be
one), exit 2, before any process starts."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys

import pytest

from jaxserve.cli import build_parser


def _serve_parser() -> argparse.ArgumentParser:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["serve"]


def test_version_is_printed(capsys):
    from importlib.metadata import version

    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"jaxserve {version('jaxserve')}"


def test_top_level_help_says_how_to_start_and_its_steps_connect():
    """`jaxserve --help` says what jaxserve is and the two first commands (it said only
    "The `jaxserve` command."); `generate`'s default server is where `serve` listens by
    default, so the two commands as written work together."""
    parser = build_parser()
    text = " ".join(parser.format_help().split())
    assert "Mixture-of-Experts" in text
    assert "`jaxserve serve [MODEL]`" in text and "`jaxserve generate 'a prompt'`" in text
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    serve = sub.choices["serve"].parse_args([])
    generate = sub.choices["generate"].parse_args(["a prompt"])
    assert generate.server.rsplit(":", 1)[1] == str(serve.port)


def test_python_dash_m_jaxserve_is_the_command():
    """`python -m jaxserve` (a venv whose bin/ is not on PATH) runs the CLI; it used to
    say "No module named jaxserve.__main__"."""
    out = subprocess.run(
        [sys.executable, "-m", "jaxserve", "--version"], capture_output=True, text=True,
        timeout=60,
    )  # fmt: skip
    assert out.returncode == 0 and out.stdout.startswith("jaxserve "), out.stderr


def test_every_serve_flag_says_its_default():
    """Each flag's help as `--help` prints it (%(default)s expanded) holds "(default:",
    boolean flags and aliases included (--no-prefix-caching said only "the same as
    --no-enable-prefix-caching"), as the README says."""
    parser = _serve_parser()
    formatter = parser._get_formatter()
    missing = [
        "/".join(a.option_strings) or a.dest
        for a in parser._actions
        if a.help != argparse.SUPPRESS
        and not isinstance(a, argparse._HelpAction)
        and "(default:" not in (formatter._expand_help(a) if a.help else "")
    ]
    assert not missing


def test_every_generate_flag_says_its_default():
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    missing = [
        "/".join(a.option_strings)
        for a in sub.choices["generate"]._actions
        if a.option_strings
        and not isinstance(a, argparse._HelpAction)
        and "default" not in (a.help or "")
    ]
    assert not missing


def test_serve_help_writes_defaults_one_way_and_in_user_words():
    """Every default reads "(default: X)" (the admission and EPLB groups wrote
    "(default X)"), no help names an internal constant (--num-decode-steps named
    step_shapes.CPU_DECODE_STEP_FACTORS), the counts of steps and tokens show as N,
    and --tls-cert says that the HTTP API is served over TLS too."""
    actions = {a.dest: a for a in _serve_parser()._actions}
    helps = {dest: a.help or "" for dest, a in actions.items()}
    assert [d for d, h in helps.items() if re.search(r"\(default [^:]", h)] == []
    assert [d for d, h in helps.items() if re.search(r"\b[a-z_]+\.[A-Z_]{4,}\b", h)] == []
    assert actions["num_decode_steps"].metavar == actions["stream_interval"].metavar == "N"
    assert "HTTP API" in helps["tls_cert"]


def test_usage_error_is_one_line():
    out = subprocess.run(
        [sys.executable, "-m", "jaxserve.cli", "serve", "--max-num-seqs", "0"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 2
    assert out.stderr.count("\n") == 1 and "--max-num-seqs: must be >= 1, got 0" in out.stderr


@pytest.mark.parametrize(
    "argv",
    [
        ["serve"],
        ["generate", "hi"],
        ["bench"],
        ["diagnose", "--from", "b.json"],
        ["profile", "--server", "h:1", "--out", "d"],
    ],
)
def test_an_unknown_flag_is_named_by_its_subcommand(argv, capsys):
    """`jaxserve serve --bogus-flag` is `jaxserve serve: error: ...`, pointing at that
    subcommand's --help (argparse hands a subcommand's unknown arguments back to the top
    parser, whose error said only `jaxserve: error:`)."""
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args([*argv, "--bogus-flag"])
    assert e.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines == [
        f"jaxserve {argv[0]}: error: unrecognized arguments: --bogus-flag "
        f"(see jaxserve {argv[0]} --help)"
    ]


def test_an_unknown_flag_before_the_subcommand_is_the_top_commands(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--bogus-flag", "generate", "hi"])
    assert capsys.readouterr().err.startswith("jaxserve: error: unrecognized arguments")


@pytest.mark.parametrize("where", ["/proc/nope", "a file"])
@pytest.mark.parametrize(
    "command",
    # `jaxserve engine` (a replica joining a remote frontend) used to start its engine
    # process and fail there; nothing listens at its --frontend, so only the check answers.
    [["serve"], ["engine", "--frontend", "127.0.0.1:9", "--handshake-timeout-s", "1"]],
)
def test_a_compilation_cache_dir_that_cannot_be_one_is_refused_at_start(command, where, tmp_path):
    """It used to fail in the engine as "engine failed to start: [Errno 2] ...", exit 1:
    a bad setting, one line naming the flag, exit 2, before any process starts."""
    if where == "a file":
        where = tmp_path / "file"
        where.write_text("")
    out = subprocess.run(
        [sys.executable, "-m", "jaxserve", *command, "--compilation-cache-dir", str(where)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    lines = out.stderr.splitlines()
    assert out.returncode == 2, out.stderr
    prefix = f"jaxserve {command[0]}: error: --compilation-cache-dir: "
    assert len(lines) == 1 and lines[0].startswith(prefix), out.stderr
    assert str(where) in lines[0]


_RUN = {"coordinator-address": "127.0.0.1:7000", "num-processes": "2", "process-id": "1"}
_RUN_FLAGS = [a for k, v in _RUN.items() for a in (f"--{k}", v)]
_RUN_ENV = {f"JAX_{k.upper().replace('-', '_')}": v for k, v in _RUN.items()}


@pytest.mark.parametrize(
    "flags, env, named",
    [
        (_RUN_FLAGS, {}, "--coordinator-address, --num-processes, --process-id"),
        ([], _RUN_ENV, "JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID"),
        ([], {"JAX_COORDINATOR_ADDRESS": "127.0.0.1:7000"}, "JAX_COORDINATOR_ADDRESS"),
    ],
)
def test_engine_refuses_a_multi_process_run(flags, env, named):
    """A headless replica is one process. The flags were accepted and never reached its
    engine process (a single-process replica joined); the variables did, and its engine
    hung in jax.distributed.initialize. Both are now one line naming them, exit 2,
    before the frontend is asked (nothing listens at --frontend: without the refusal
    this ends after --handshake-timeout-s, exit 1)."""
    out = subprocess.run(
        [sys.executable, "-m", "jaxserve", "engine", "--frontend", "127.0.0.1:9",
         "--handshake-timeout-s", "1", *flags],
        capture_output=True, text=True, timeout=120,
        env={k: v for k, v in os.environ.items() if k not in _RUN_ENV} | env,
    )  # fmt: skip
    assert out.returncode == 2, out.stderr
    assert out.stderr.splitlines() == [
        f"jaxserve engine: error: multi-process settings ({named}): a headless replica is "
        "one process; a multi-process engine runs as `jaxserve serve` on every host with "
        "these settings (README: Parallelism and multi-host)"
    ], out.stderr

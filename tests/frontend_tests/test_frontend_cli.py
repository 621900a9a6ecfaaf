"""`jaxserve generate` (the CLI client) against the mock-engine server."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from frontend_tests.helpers import (
    REPO_DIR,
    _expected_ids,
)

# ---------------------------------------------------------------- CLI


def test_cli_generate_streams_text_and_a_final_newline(server, tok, vocab):
    prompt = "import "
    expected = tok.decode(_expected_ids(tok, vocab, prompt, 12))
    out = subprocess.run(
        [sys.executable, "-m", "jaxserve.cli", "generate", "--server", server.target,
         "--max-tokens", "12", "--temperature", "0", "-v", prompt],
        capture_output=True, timeout=60, cwd=REPO_DIR,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    # The text, then one newline (a pipe too, as `llm` does); -v's summary goes to stderr.
    assert out.stdout.decode() == expected + "\n"
    prompt_tokens = len(tok.encode(prompt).ids)
    assert out.stderr.decode().splitlines() == [
        f"[finish_reason=length stop_reason=None prompt_tokens={prompt_tokens} "
        "completion_tokens=12]"
    ]


def test_cli_generate_prints_each_of_n_samples(server, tok, vocab):
    prompt = "import "
    texts = [tok.decode(_expected_ids(tok, vocab, prompt, 8, seed=5 + i)) for i in range(2)]
    out = subprocess.run(
        [sys.executable, "-m", "jaxserve.cli", "generate", "--server", server.target,
         "--max-tokens", "8", "--seed", "5", "-n", "2", "-v", prompt],
        capture_output=True, timeout=60, cwd=REPO_DIR,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.decode() == "".join(
        f"--- sample {i} (finish_reason=length) ---\n{text}\n" for i, text in enumerate(texts)
    )
    # -v: each sample's finish and token counts, as the help says.
    prompt_tokens = len(tok.encode(prompt).ids)
    assert out.stderr.decode().splitlines() == [
        f"[sample={i} finish_reason=length stop_reason=None prompt_tokens={prompt_tokens} "
        "completion_tokens=8]"
        for i in range(2)
    ]


@pytest.mark.parametrize(
    "flags, named",
    # An item of a list field ("stop[0]: ...") is its repeatable flag's (it said "stop[0]").
    [(["--top-p", "2"], "--top-p:"), (["--stop", "ok", "--stop", ""], "--stop: ")],
)
def test_cli_generate_reports_bad_input(server, flags, named):
    """A value the server refuses (INVALID_ARGUMENT naming its field) is a usage error:
    exit 2, one line naming the flag as typed, as the client commands' own checks."""
    out = subprocess.run(
        [sys.executable, "-m", "jaxserve.cli", "generate", "--server", server.target,
         *flags, "hi"],
        capture_output=True, timeout=60, cwd=REPO_DIR, text=True,
    )  # fmt: skip
    assert out.returncode == 2
    assert out.stdout == ""  # no text, so no newline to end it
    lines = out.stderr.splitlines()  # one line, no empty one before it
    assert len(lines) == 1 and lines[0].startswith(f"jaxserve generate: error: {named}"), lines


def test_cli_generate_timeout_names_the_flag(server):
    """A stream past --timeout ends with gRPC's DEADLINE_EXCEEDED and the flag that set
    it (it said only "Deadline Exceeded"): exit 1, one line on stderr."""
    out = subprocess.run(
        [sys.executable, "-m", "jaxserve.cli", "generate", "--server", server.target,
         "--max-tokens", "1000", "--timeout", "0.5", "hi"],
        capture_output=True, timeout=60, cwd=REPO_DIR, text=True,
    )  # fmt: skip
    assert out.returncode == 1, out.stderr
    lines = out.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("jaxserve generate: DEADLINE_EXCEEDED: "), lines
    assert lines[0].endswith("; --timeout 0.5 s passed (raise it, or leave it out: no limit)")


def test_cli_generate_from_a_closed_stdin_is_one_line():
    # Started with stdin closed (`<&-`): sys.stdin is None, which raised AttributeError.
    out = subprocess.run(
        [sys.executable, "-m", "jaxserve.cli", "generate", "--server", "127.0.0.1:1", "-"],
        capture_output=True, timeout=60, cwd=REPO_DIR, text=True, preexec_fn=lambda: os.close(0),
    )  # fmt: skip
    assert out.returncode == 2
    assert out.stderr.splitlines() == [
        "jaxserve generate: error: prompt: '-' reads stdin, which is closed"
    ]


def test_cli_generate_stdin_prompt_loses_one_trailing_newline(server, tok, vocab):
    """`echo "import " | jaxserve generate -` sends "import ", not "import \\n" (the
    newline echo adds); only that one goes: a second one is the prompt's."""
    cases = (("import \n", "import "), ("import \n\n", "import \n"), ("import \r\n", "import "))
    for stdin, prompt in cases:
        expected = tok.decode(_expected_ids(tok, vocab, prompt, 6))
        out = subprocess.run(
            [sys.executable, "-m", "jaxserve.cli", "generate", "--server", server.target,
             "--max-tokens", "6", "--temperature", "0", "-v", "-"],
            input=stdin, capture_output=True, timeout=60, cwd=REPO_DIR, text=True,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr
        assert out.stdout == expected + "\n"
        assert f"prompt_tokens={len(tok.encode(prompt).ids)} " in out.stderr

"""`jaxserve bench` picks the tokenizer of the model the server serves, never silently
another model's (jaxserve/benchmark/cli.py: `_tokenizer_dir`)."""

from __future__ import annotations

import argparse

import pytest

from jaxserve.benchmark import cli
from jaxserve.config import DEMO_MODEL_DIR


def _args(**kw) -> argparse.Namespace:
    base = dict(tokenizer=None, backend="grpc", server="127.0.0.1:1", api_key=None)
    return argparse.Namespace(**{**base, **kw})


def test_flag_wins_over_the_server(monkeypatch):
    monkeypatch.setattr(cli, "_served_model", lambda args: pytest.fail("server asked"))
    assert cli._tokenizer_dir(_args(tokenizer="/some/dir")) == "/some/dir"


def test_served_folder_is_used(monkeypatch):
    monkeypatch.setattr(cli, "_served_model", lambda args: str(DEMO_MODEL_DIR))
    assert cli._tokenizer_dir(_args()) == str(DEMO_MODEL_DIR)


def test_the_demo_by_its_served_name(monkeypatch):
    monkeypatch.setattr(cli, "_served_model", lambda args: DEMO_MODEL_DIR.name)
    assert cli._tokenizer_dir(_args()) == str(DEMO_MODEL_DIR)


def test_another_model_without_its_folder_needs_the_flag(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))  # an empty Hub cache
    monkeypatch.setattr(cli, "_served_model", lambda args: "fresh_ds")
    with pytest.raises(ValueError, match=r"^--tokenizer: the server serves 'fresh_ds'"):
        cli._tokenizer_dir(_args())


def test_unreachable_server_falls_back_to_the_demo():
    # Nothing listens on port 1: the run's own requests report the server as unreachable.
    assert cli._tokenizer_dir(_args(server="127.0.0.1:1")) == str(DEMO_MODEL_DIR)

"""Fixtures of the frontend tests: one mock-engine `jaxserve serve` for the session.

Most tests talk to one real `jaxserve serve` (three processes, loopback, a free port) whose
engine is tests/mock_engine.py; the expected tokens come from the mock's token function and
the expected text from `tokenizer.decode`. Shutdown and engine death get their own server.
"""

from __future__ import annotations

import json

import pytest

from frontend_tests.helpers import MockServer
from jaxserve.frontend.client import JaxserveClient
from jaxserve.frontend.tokenizer import load_tokenizer


@pytest.fixture(scope="session")
def model_dir(mock_model_dir):
    return mock_model_dir


@pytest.fixture(scope="session")
def tok(model_dir):
    return load_tokenizer(model_dir)


@pytest.fixture(scope="session")
def vocab(model_dir):
    meta = json.loads((model_dir / "config.json").read_text())
    return meta["vocab_size"], meta["first_text_token_id"]


@pytest.fixture(scope="session")
def server(model_dir):
    srv = MockServer(model_dir).wait_ready()
    yield srv
    srv.terminate(15)


@pytest.fixture(scope="session")
def client(server):
    with JaxserveClient(server.target) as c:
        yield c

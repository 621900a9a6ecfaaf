"""Fixtures of the HTTP API tests: one live `jaxserve serve --http-port 0` on the bundled
demo model for the package (a ChatML chat template given with --chat-template, a metrics
port), the official `openai` client and the gRPC client on it, and the offline `LLM`
reference on the same engine settings."""

from __future__ import annotations

import openai
import pytest
from server_harness import DEMO_ENGINE, ServerProcess, free_port, serve_flags

from http_api_tests.helpers import CHATML, TIMEOUT_S
from jaxserve.config import DEMO_MODEL_DIR
from jaxserve.frontend.client import JaxserveClient


@pytest.fixture(scope="package")
def llm(demo_llm):
    """The offline reference; built first so that the server starts on a warm cache."""
    return demo_llm


@pytest.fixture(scope="package")
def template_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("chat") / "chatml.jinja"
    path.write_text(CHATML)
    return path


@pytest.fixture(scope="package")
def server(llm, template_file):
    metrics_port = free_port()
    flags = serve_flags(DEMO_ENGINE)
    flags += ("--http-port", "0", "--chat-template", str(template_file))
    flags += ("--metrics-port", str(metrics_port))
    srv = ServerProcess(DEMO_MODEL_DIR, extra_args=flags, start_timeout_s=600).wait_ready()
    srv.metrics_port = metrics_port
    yield srv
    srv.terminate(15) if srv.proc.poll() is None else None


@pytest.fixture(scope="package")
def client(server):
    with openai.OpenAI(
        base_url=server.http_url + "/v1", api_key="unused", max_retries=0, timeout=TIMEOUT_S
    ) as c:
        yield c


@pytest.fixture(scope="package")
def grpc_client(server):
    with JaxserveClient(server.target) as c:
        yield c


@pytest.fixture(scope="package")
def model_name(client):
    (model,) = client.models.list().data
    return model.id

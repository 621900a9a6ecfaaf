"""TLS (and mutual TLS) on the gRPC and metrics ports, and the API key (issue 12), with
a CA and certificates made by the test with the openssl CLI."""

from __future__ import annotations

import shutil
import ssl
import subprocess
import urllib.error
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)
from hostile_helpers import generate_request, mock_server, status_of
from server_harness import free_port

from jaxserve.frontend.auth import insecure_bind_warning, resolve_api_key
from jaxserve.frontend.proto import jaxserve_pb2 as pb
from jaxserve.frontend.proto import jaxserve_pb2_grpc as pb_grpc

KEY = "s3cret-key"
pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl")


def _openssl(*args, cwd):
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """A CA, a server certificate for 127.0.0.1 and a client certificate, both signed
    by the CA."""
    d = tmp_path_factory.mktemp("pki")
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=ca",
             "-keyout", "ca.key", "-out", "ca.pem", cwd=d)  # fmt: skip
    (d / "server.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for name, ext in (("server", ["-extfile", "server.ext"]), ("client", [])):
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}",
                 "-keyout", f"{name}.key", "-out", f"{name}.csr", cwd=d)  # fmt: skip
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
                 "-CAcreateserial", "-days", "1", "-out", f"{name}.pem", *ext, cwd=d)  # fmt: skip
    return d


@pytest.fixture(scope="module")
def tls_server(mock_model_dir, pki):
    port = free_port()
    srv = mock_server(
        mock_model_dir,
        extra_args=(
            "--tls-cert", str(pki / "server.pem"), "--tls-key", str(pki / "server.key"),
            "--api-key", KEY, "--metrics-port", str(port),
        ),
    )  # fmt: skip
    srv.metrics_port = port
    yield srv
    srv.kill()


def _secure_channel(target, pki, client_cert=False):
    creds = grpc.ssl_channel_credentials(
        root_certificates=(pki / "ca.pem").read_bytes(),
        private_key=(pki / "client.key").read_bytes() if client_cert else None,
        certificate_chain=(pki / "client.pem").read_bytes() if client_cert else None,
    )
    return grpc.secure_channel(target, creds)


AUTH = (("authorization", f"Bearer {KEY}"),)


def test_tls_with_the_key_serves(tls_server, pki):
    with _secure_channel(tls_server.target, pki) as ch:
        stub = pb_grpc.JaxserveStub(ch)
        got = list(stub.Generate(generate_request([5, 6], 4), timeout=30, metadata=AUTH))
        assert got[-1].finish_reason == "length"
        info = stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10, metadata=AUTH)
        assert info.max_model_len > 0


@pytest.mark.parametrize("metadata", [None, (("authorization", "Bearer wrong"),),
                                      (("authorization", KEY),)])  # fmt: skip
def test_every_rpc_without_the_key_is_unauthenticated(tls_server, pki, metadata):
    with _secure_channel(tls_server.target, pki) as ch:
        stub = pb_grpc.JaxserveStub(ch)
        calls = [
            lambda: stub.Generate(generate_request([5], 2), timeout=10, metadata=metadata),
            lambda: [stub.Abort(pb.AbortRequest(request_id="x"), timeout=10, metadata=metadata)],
            lambda: [stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10, metadata=metadata)],
        ]
        for call in calls:
            code, details = status_of(call)
            assert code == grpc.StatusCode.UNAUTHENTICATED and "API key" in details
        with pytest.raises(Exception, match="UNAUTHENTICATED|Bearer"):
            ProtoReflectionDescriptorDatabase(ch).get_services()


def test_health_needs_no_key(tls_server, pki):
    with _secure_channel(tls_server.target, pki) as ch:
        resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert resp.status == health_pb2.HealthCheckResponse.SERVING


def test_plaintext_client_cannot_talk_to_the_tls_port(tls_server):
    with grpc.insecure_channel(tls_server.target) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        code, _ = status_of(lambda: [stub.Check(health_pb2.HealthCheckRequest(), timeout=5)])
        assert code == grpc.StatusCode.UNAVAILABLE


def test_metrics_port_serves_https(tls_server, pki):
    url = f"https://127.0.0.1:{tls_server.metrics_port}/metrics"
    ctx = ssl.create_default_context(cafile=str(pki / "ca.pem"))
    body = urllib.request.urlopen(url, context=ctx, timeout=10).read().decode()
    assert "jaxserve_requests_rejected" in body or "jaxserve_request_success" in body
    with pytest.raises(OSError):  # URLError or a reset: the port speaks only TLS
        urllib.request.urlopen(f"http://127.0.0.1:{tls_server.metrics_port}/metrics", timeout=5)


def test_mutual_tls_requires_a_client_certificate(mock_model_dir, pki):
    srv = mock_server(
        mock_model_dir,
        extra_args=(
            "--tls-cert", str(pki / "server.pem"), "--tls-key", str(pki / "server.key"),
            "--tls-client-ca", str(pki / "ca.pem"),
        ),
    )  # fmt: skip
    try:
        request = health_pb2.HealthCheckRequest()
        with _secure_channel(srv.target, pki, client_cert=True) as ch:
            resp = health_pb2_grpc.HealthStub(ch).Check(request, timeout=10)
            assert resp.status == health_pb2.HealthCheckResponse.SERVING
        with _secure_channel(srv.target, pki, client_cert=False) as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            code, _ = status_of(lambda: [stub.Check(request, timeout=5)])
            assert code == grpc.StatusCode.UNAVAILABLE
    finally:
        srv.kill()


def test_insecure_bind_warning():
    assert insecure_bind_warning("127.0.0.1", tls=False, api_key=False) is None
    assert insecure_bind_warning("::1", tls=False, api_key=False) is None
    assert insecure_bind_warning("0.0.0.0", tls=True, api_key=True) is None
    warning = insecure_bind_warning("0.0.0.0", tls=False, api_key=True)
    assert "TLS" in warning and "API key" not in warning
    assert "TLS" in insecure_bind_warning("10.1.2.3", tls=False, api_key=False)


def test_api_key_sources(tmp_path, monkeypatch):
    monkeypatch.delenv("JAXSERVE_API_KEY", raising=False)
    assert resolve_api_key(None, None) is None
    monkeypatch.setenv("JAXSERVE_API_KEY", "from-env")
    assert resolve_api_key(None, None) == "from-env"
    assert resolve_api_key("flag", None) == "flag"
    f = tmp_path / "key"
    f.write_text("from-file\nignored\n")
    assert resolve_api_key(None, str(f)) == "from-file"
    with pytest.raises(ValueError, match="^api-key-file: cannot read"):
        resolve_api_key(None, str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="^api-key: the API key is empty"):
        resolve_api_key("  ", None)


def test_serve_warns_for_a_public_address_without_tls(mock_model_dir):
    """The warning is logged at start-up, before anything binds; the server is stopped
    as soon as it appears."""
    import os
    import sys

    from server_harness import REPO_DIR, TESTS_DIR

    env = {**os.environ, "PYTHONPATH": str(TESTS_DIR)}
    cmd = [sys.executable, "-m", "jaxserve.cli", "serve", "--model", str(mock_model_dir),
           "--host", "0.0.0.0", "--port", "0",
           "--engine-class", "mock_engine:MockEngineCore"]  # fmt: skip
    proc = subprocess.Popen(cmd, env=env, cwd=REPO_DIR, stderr=subprocess.PIPE, text=True)
    try:
        lines = []
        for line in proc.stderr:
            lines.append(line)
            if "gRPC listening" in line or "error" in line:
                break
        assert any(
            "serving 0.0.0.0 without TLS (--tls-cert/--tls-key) and an API key" in x for x in lines
        ), lines
    finally:
        proc.terminate()
        proc.wait(30)


def test_http_port_speaks_tls_and_needs_the_key(mock_model_dir, pki):
    """The OpenAI HTTP port gets the same TLS and API key: /health and /version (and
    /metrics, as on vLLM's port, which keys only /v1) are open, every other path needs
    `Authorization: Bearer <key>` (401 otherwise)."""
    import json

    http_port = free_port()
    srv = mock_server(
        mock_model_dir,
        extra_args=(
            "--tls-cert", str(pki / "server.pem"), "--tls-key", str(pki / "server.key"),
            "--api-key", KEY, "--http-port", str(http_port),
        ),
    )  # fmt: skip
    try:
        # The ready line gives the HTTPS address (it used to say http://).
        assert f"OpenAI HTTP API on https://127.0.0.1:{http_port}/v1" in srv.log(), srv.log()
        ctx = ssl.create_default_context(cafile=str(pki / "ca.pem"))
        base = f"https://127.0.0.1:{http_port}"
        health = urllib.request.urlopen(f"{base}/health", context=ctx, timeout=10)
        assert health.status == 200
        version = urllib.request.urlopen(f"{base}/version", context=ctx, timeout=10)
        assert "version" in json.loads(version.read())
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            req = urllib.request.Request(f"{base}/v1/models", headers=headers)
            with pytest.raises(urllib.error.HTTPError) as e:
                urllib.request.urlopen(req, context=ctx, timeout=10)
            assert e.value.code == 401
            error = json.loads(e.value.read())["error"]
            assert error["code"] == "invalid_api_key"
            assert "header 'Authorization: Bearer" in error["message"], error
        req = urllib.request.Request(
            f"{base}/v1/models", headers={"Authorization": f"Bearer {KEY}"}
        )
        assert urllib.request.urlopen(req, context=ctx, timeout=10).status == 200
    finally:
        srv.kill()


def test_client_and_generate_speak_tls_with_the_key(tls_server, pki):
    import os
    import sys

    from server_harness import REPO_DIR, TESTS_DIR

    from jaxserve.frontend.client import JaxserveClient

    ca = str(pki / "ca.pem")
    with JaxserveClient(tls_server.target, tls_ca_cert=ca, api_key=KEY) as client:
        (c,) = client.complete([5, 6], max_tokens=3, timeout=30)
        assert c.completion_tokens == 3 and client.server_info(timeout=10).max_model_len > 0
    with JaxserveClient(tls_server.target, tls_ca_cert=ca) as client:
        with pytest.raises(grpc.RpcError) as err:
            client.complete([5, 6], max_tokens=3, timeout=30)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(ValueError, match="^tls_cert: give both"):
        JaxserveClient(tls_server.target, tls_cert=str(pki / "client.pem"))

    def generate(*flags, env=None):
        return subprocess.run(
            [sys.executable, "-m", "jaxserve.cli", "generate", "--server", tls_server.target,
             "--max-tokens", "3", "--tls-ca-cert", ca, *flags, "hello"],
            capture_output=True, text=True, timeout=60, cwd=REPO_DIR,
            env={**os.environ, "PYTHONPATH": str(TESTS_DIR), **(env or {})},
        )  # fmt: skip

    ok = generate("--api-key", KEY)
    assert ok.returncode == 0 and ok.stdout.endswith("\n"), ok.stderr
    from_env = generate(env={"JAXSERVE_API_KEY": KEY})
    assert from_env.returncode == 0 and from_env.stdout == ok.stdout, from_env.stderr
    denied = generate()
    assert denied.returncode == 1 and "UNAUTHENTICATED" in denied.stderr
    missing = generate("--api-key", KEY, "--tls-ca-cert", str(pki / "nope.pem"))
    assert missing.returncode == 2
    assert missing.stderr.startswith("jaxserve generate: error: --tls-ca-cert: cannot read")
    not_pem = generate("--api-key", KEY, "--tls-ca-cert", str(pki / "ca.key"))
    assert not_pem.returncode == 2 and len(not_pem.stderr.splitlines()) == 1, not_pem.stderr
    assert not_pem.stderr.startswith("jaxserve generate: error: --tls-ca-cert: ")
    assert "ca.key holds no PEM certificate" in not_pem.stderr


def test_bench_diagnose_and_profile_speak_tls(tls_server, pki, mock_model_dir, tmp_path):
    """The client tools reach a --tls-cert / --api-key server with the same flags as
    `jaxserve generate` (frontend/client_auth.py); without them they fail with a
    status that shows they spoke to it (UNAUTHENTICATED needs a TLS handshake first)."""
    import json
    import sys

    from server_harness import REPO_DIR

    ca = str(pki / "ca.pem")

    def jaxserve(*argv):
        return subprocess.run([sys.executable, "-m", "jaxserve.cli", *argv], cwd=REPO_DIR,
                              capture_output=True, text=True, timeout=120)  # fmt: skip

    out = tmp_path / "bench.json"
    bench = jaxserve("bench", "--server", tls_server.target, "--tls-ca-cert", ca,
                     "--api-key", KEY, "--tokenizer", str(mock_model_dir), "--num-prompts", "3",
                     "--input-len", "4", "--output-len", "3", "--no-progress",
                     "--out", str(out))  # fmt: skip
    assert bench.returncode == 0, bench.stderr
    assert json.loads(out.read_text())["metrics"]["completed"] == 3
    bad_ca = jaxserve("bench", "--server", tls_server.target, "--tls-ca-cert", str(tmp_path / "x"))
    assert bad_ca.returncode == 2 and "--tls-ca-cert: cannot read" in bad_ca.stderr

    metrics = f"127.0.0.1:{tls_server.metrics_port}"
    diag = jaxserve("diagnose", "--server", metrics, "--tls-ca-cert", ca, "--seconds", "1",
                    "--interval", "0.5", "--json")  # fmt: skip
    assert diag.returncode == 0, diag.stderr
    assert json.loads(diag.stdout)["source"].startswith(metrics)  # read the HTTPS port
    plain = jaxserve("diagnose", "--server", metrics, "--seconds", "1", "--interval", "0.5")
    assert plain.returncode == 1 and f"http://{metrics}/metrics" in plain.stderr
    # the port was right and only TLS was missing: the hint used to name only the gRPC port
    assert "if the server runs with --tls-cert, pass --tls-ca-cert" in plain.stderr, plain.stderr

    profile = jaxserve("profile", "--server", tls_server.target, "--tls-ca-cert", ca,
                       "--seconds", "1", "--out", str(tmp_path / "prof"))  # fmt: skip
    assert profile.returncode == 1 and "UNAUTHENTICATED" in profile.stderr, profile.stderr


@pytest.mark.parametrize("headers", [[], [(b"authorization", b"Bearer wrong")]])
def test_http_401_names_the_header_not_grpc_metadata(headers):
    """The HTTP port's 401 says what an HTTP client must send: the Authorization header
    (it used to say "metadata", gRPC's word). The ASGI middleware alone, no server."""
    import asyncio
    import json

    from jaxserve.frontend.auth import ApiKeyMiddleware

    async def app(scope, receive, send):  # what the key lets through
        raise AssertionError("reached the app without the key")

    sent = []

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "GET", "path": "/v1/models", "headers": headers}
    asyncio.run(ApiKeyMiddleware(app, KEY)(scope, None, send))
    start, body = sent
    assert start["status"] == 401
    message = json.loads(body["body"])["error"]["message"]
    assert "metadata" not in message, message
    assert "header 'Authorization: Bearer <key>'" in message, message


@pytest.mark.parametrize(
    ("flags", "cause"),
    [
        ({"--tls-cert": "nope.pem"}, "--tls-cert: cannot read {d}/nope.pem"),
        ({"--tls-cert": "server.csr"}, "--tls-cert: {d}/server.csr holds no PEM certificate"),
        ({"--tls-key": "."}, "--tls-key: cannot read {d} (Is a directory)"),
        ({"--tls-key": "client.key"}, "--tls-key: {d}/client.key is not the private key of the "
         "certificate in {d}/server.pem"),
        ({"--tls-key": "server.pem"}, "--tls-key: {d}/server.pem holds no PEM private key"),
        ({"--tls-client-ca": "ca.key"}, "--tls-client-ca: {d}/ca.key holds no PEM certificate"),
    ],
)  # fmt: skip
def test_serve_with_a_bad_tls_file_is_one_line_naming_the_flag(mock_model_dir, pki, flags, cause):
    """A missing, unreadable or non-PEM file, or a key that is not the certificate's, used
    to reach gRPC's bind: "port: cannot bind ... (refused by gRPC)", exit 1, with C-core
    log lines. It is a bad setting: one line naming the flag, exit 2, before any process
    starts."""
    import os
    import sys

    from server_harness import REPO_DIR, TESTS_DIR

    files = {"--tls-cert": "server.pem", "--tls-key": "server.key", **flags}
    cmd = [sys.executable, "-m", "jaxserve.cli", "serve", "--model", str(mock_model_dir),
           "--port", "0", "--engine-class", "mock_engine:MockEngineCore"]  # fmt: skip
    cmd += [x for flag, name in files.items() for x in (flag, str(pki / name))]
    out = subprocess.run(
        cmd, capture_output=True, text=True, timeout=60, cwd=REPO_DIR,
        env={**os.environ, "PYTHONPATH": str(TESTS_DIR)},
    )  # fmt: skip
    lines = out.stderr.splitlines()
    assert out.returncode == 2 and len(lines) == 1, out.stderr
    assert lines[0].startswith("jaxserve serve: error: " + cause.format(d=pki)), lines[0]


@pytest.mark.parametrize(
    ("fields", "cause"),
    [
        ({"tls_ca_cert": "server.key"}, "^tls_ca_cert: .*server.key holds no PEM certificate"),
        ({"tls_cert": "client.pem", "tls_key": "server.key"},
         "^tls_key: .*server.key is not the private key of the certificate in .*client.pem"),
    ],
)  # fmt: skip
def test_client_with_a_bad_tls_file_names_the_field(pki, fields, cause):
    """A CA or key gRPC cannot use is refused when the channel is made, naming the field
    (the CLI's flag: `flag_error`); it used to fail only at connect, as UNAVAILABLE with
    gRPC's C-core log lines."""
    from jaxserve.frontend.client_auth import ClientAuth

    auth = ClientAuth(**{k: str(pki / v) for k, v in fields.items()})
    with pytest.raises(ValueError, match=cause):
        auth.channel("127.0.0.1:1")
    with pytest.raises(ValueError, match=cause):
        auth.ssl_context()


@pytest.mark.parametrize("flag", ["--tls-cert", "--tls-key"])
def test_a_client_cert_without_its_key_names_both_flags(flag):
    """`generate --tls-cert X` without --tls-key said "give both tls_cert and tls_key",
    the Python fields' names; the CLI names the flags (the API keeps its field names)."""
    import sys

    from server_harness import REPO_DIR

    out = subprocess.run(
        [sys.executable, "-m", "jaxserve.cli", "generate", flag, "x.pem", "hi"],
        capture_output=True, text=True, timeout=60, cwd=REPO_DIR,
    )  # fmt: skip
    assert out.returncode == 2 and out.stdout == "", out
    assert out.stderr.splitlines() == [
        "jaxserve generate: error: --tls-cert: give both --tls-cert and --tls-key (mutual TLS), "
        "or neither"
    ]


def test_plaintext_generate_against_the_tls_port_asks_about_tls(tls_server):
    """A plaintext `generate` to a --tls-cert server said only gRPC's "UNAVAILABLE: ...
    Socket closed"; the one line now asks whether the server uses TLS."""
    import sys

    from server_harness import REPO_DIR

    out = subprocess.run(
        [sys.executable, "-m", "jaxserve.cli", "generate", "--server", tls_server.target,
         "--timeout", "20", "hi"],
        capture_output=True, text=True, timeout=60, cwd=REPO_DIR,
    )  # fmt: skip
    lines = out.stderr.splitlines()
    assert out.returncode == 1 and len(lines) == 1, out
    assert lines[0].startswith("jaxserve generate: UNAVAILABLE: "), lines[0]
    assert lines[0].endswith(" (is the server using TLS? pass --tls / --tls-ca-cert)"), lines[0]

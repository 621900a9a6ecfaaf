"""Health checking, reflection and GetServerInfo of the gRPC frontend."""

from __future__ import annotations

import json
import subprocess
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)
from mock_engine import MOCK_WARMUP_SHAPES

from frontend_tests.helpers import (
    REPO_DIR,
    MockServer,
    _wait_idle,
)
from jaxserve.frontend.client import JaxserveClient

# ---------------------------------------------------------------- health, reflection, info


def test_health_is_serving(server):
    with grpc.insecure_channel(server.target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in ("", "jaxserve.v1.Jaxserve"):
            resp = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert resp.status == health_pb2.HealthCheckResponse.SERVING


def test_reflection_lists_the_service(server):
    with grpc.insecure_channel(server.target) as channel:
        db = ProtoReflectionDescriptorDatabase(channel)
        assert "jaxserve.v1.Jaxserve" in db.get_services()
        assert "grpc.health.v1.Health" in db.get_services()
        methods = {
            m.name for m in db.FindFileContainingSymbol("jaxserve.v1.Jaxserve").service[0].method
        }
        assert methods == {"Generate", "Abort", "GetServerInfo"}


def test_server_info_reports_engine_facts(client, vocab):
    info = _wait_idle(client)
    assert info.max_model_len == 4096 and info.block_size == 16
    assert info.kv_blocks_total == 256 and info.vocab_size == vocab[0]


def test_server_info_and_bench_wait_for_the_background_compilation(model_dir, tmp_path):
    """While the engine compiles step shapes in the background, GetServerInfo says how
    many; `jaxserve bench` waits until none is left before its run (and records it), so
    it measures the server, not its warm-up."""
    srv = MockServer(model_dir, warmup_s=8).wait_ready()
    try:
        with JaxserveClient(srv.target) as c:
            assert c.server_info().warmup_pending_shapes == MOCK_WARMUP_SHAPES
            out = tmp_path / "b.json"
            r = subprocess.run(
                [sys.executable, "-m", "jaxserve.cli", "bench", "--server", srv.target,
                 "--tokenizer", str(model_dir), "--dataset", "random", "--num-prompts", "2",
                 "--input-len", "4", "--output-len", "2", "--no-progress", "--out", str(out)],
                cwd=REPO_DIR, capture_output=True, text=True, timeout=120,
            )  # fmt: skip
            assert r.returncode == 0, r.stderr
            assert f"{MOCK_WARMUP_SHAPES} step shapes still compiling" in r.stderr, r.stderr
            assert "every step shape compiled after" in r.stderr, r.stderr
            warmup = json.loads(out.read_text())["server_warmup"]
            assert warmup["pending_at_start"] == MOCK_WARMUP_SHAPES
            assert warmup["pending_at_run"] == 0 and warmup["waited_s"] > 0
            assert c.server_info().warmup_pending_shapes == 0
    finally:
        srv.terminate(15)

"""Health checking, reflection and GetServerInfo of the gRPC frontend."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from frontend_tests.helpers import (
    _wait_idle,
)

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

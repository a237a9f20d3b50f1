"""--health-port: plaintext health alone, for probes; a port another process holds is refused,
as the gRPC port is, not shared with it (a probe would then ask either of the two)."""

from __future__ import annotations

import socket

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from hetpipe import rpc


def test_a_taken_health_port_is_refused() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    first = rpc.Server("127.0.0.1", 0, health_port=port)
    first.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(RuntimeError):
            rpc.Server("127.0.0.1", 0, health_port=port)
    finally:
        first.stop()

"""hetpipe.rpc.channel: a new channel connects to whoever serves its address now."""

from __future__ import annotations

import socket

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from hetpipe import rpc

pytestmark = pytest.mark.timeout(60)


def check(channel: grpc.Channel) -> health_pb2.HealthCheckResponse:
    return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)


def test_a_new_channel_reaches_a_server_that_took_the_port_an_older_channel_still_retries() -> None:
    """gRPC shares connections among a process's channels to one address: a channel kept to a
    dead peer's port (backing off between attempts) made a new one to that port fail at once with
    its last "Connection refused", though a new server listened there. A local run's in-process
    coordinator failed to Assign its stage so (the port had been an earlier test's worker's)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    with rpc.channel(address) as stale:
        for _ in range(2):   # nothing serves there yet: the channel backs off before trying again
            with pytest.raises(grpc.RpcError) as refused:
                check(stale)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        server = rpc.Server("127.0.0.1", int(address.rsplit(":", 1)[1]))
        server.start()
        try:
            with rpc.channel(address) as fresh:
                assert check(fresh).status == health_pb2.HealthCheckResponse.SERVING
        finally:
            server.stop()

"""bench/transport.py's gRPC rows measure the production path: its receiver is the real Stage
servicer in front of a stand-in runtime, which must answer whatever the servicer asks of a
runtime (the bench failed every row once the servicer began to check headers first)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import transport  # noqa: E402

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("shared_memory", [False, True], ids=["grpc", "shm"])
def test_the_bench_sends_a_tensor_through_the_production_stage_servicer(shared_memory: bool) -> None:
    server = transport.sink_server("127.0.0.1")
    try:
        send = transport.grpc_sender(server.address, shared_memory=shared_memory)
        for nbytes in (4096, 3 << 20):   # one frame, then several (gRPC) or one slot (shm)
            send(transport._pattern(nbytes))
            send(transport._pattern(nbytes), 5)   # a burst (--burst), through the link's thread
        with pytest.raises(RuntimeError, match="could not send .* INTERNAL"):
            send(torch.zeros(1024))   # the receiver checks what arrives: a wrong tensor fails the send
    finally:
        server.stop(grace=0)

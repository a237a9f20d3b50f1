"""How long a channel takes to find a peer that comes back at its address (a restarted shard):
gRPC's default reconnect backoff against rpc.channel's, side by side, for outages of given lengths.

    python bench/reconnect.py                 # outages of 5 and 20 s
    python bench/reconnect.py --outages 2 40

Each run keeps calling (health checks, fail-fast, every 50 ms, as rpc.retrying would) through the
outage; the figure is the time from the server's start to the first call that succeeds.
"""

from __future__ import annotations

import argparse
import socket
import sys
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hetpipe import rpc  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def found_after(outage_s: float, channel_options: list[tuple[str, object]]) -> float:
    """Seconds from the server's start to the first call that reaches it, its port refused for outage_s."""
    port = free_port()
    server: rpc.Server | None = None
    with grpc.insecure_channel(f"127.0.0.1:{port}", options=channel_options) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        began, up = time.monotonic(), 0.0
        try:
            while True:
                if server is None and time.monotonic() - began >= outage_s:
                    server = rpc.Server("127.0.0.1", port)
                    server.start()
                    up = time.monotonic()
                try:
                    stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
                    if server is not None:
                        return time.monotonic() - up
                except grpc.RpcError:
                    pass
                time.sleep(0.05)
        finally:
            if server is not None:
                server.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--outages", type=float, nargs="+", default=[5.0, 20.0], help="seconds the peer is down")
    args = parser.parse_args(argv)
    ours = rpc.options() + rpc.CHANNEL_OPTIONS
    print(f"{'outage s':>9} {'gRPC default s':>15} {'rpc.channel s':>14} {'ratio':>7}")
    for outage in args.outages:
        default = found_after(outage, rpc.options())
        tuned = found_after(outage, ours)
        print(f"{outage:9.1f} {default:15.2f} {tuned:14.2f} {default / tuned:7.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Entry point: flags -> CoordinatorConfig -> serve(cfg)."""

from __future__ import annotations

import logging
import sys

from hetpipe import rpc
from hetpipe.service import exit_now, run_server
from hetpipe.v1 import coordinator_pb2_grpc
from coordinator.config import CoordinatorConfig, parse_args
from coordinator.job import JobRunner
from coordinator.registry import Registry
from coordinator.servicer import CoordinatorServicer


def build(host: str, port: int, *, heartbeat_interval_s: float = 1.0,
          claim_timeout_s: float = 120.0) -> tuple[rpc.Server, CoordinatorServicer]:
    """The coordinator's gRPC server and servicer, not yet started (`hetpipe run` embeds it)."""
    registry = Registry(heartbeat_interval_s)
    servicer = CoordinatorServicer(registry, JobRunner(registry, claim_timeout_s=claim_timeout_s))
    server = rpc.Server(host, port)
    coordinator_pb2_grpc.add_CoordinatorServicer_to_server(servicer, server.grpc)
    return server, servicer


def serve(cfg: CoordinatorConfig) -> None:
    server, servicer = build(cfg.service.host, cfg.service.port, heartbeat_interval_s=cfg.heartbeat_interval_s,
                             claim_timeout_s=cfg.claim_timeout_s)

    def shutdown() -> None:
        servicer.runner.stop("coordinator shutting down")
        server.stop()

    run_server(cfg.service, server, shutdown, role=None)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    serve(parse_args(argv))
    exit_now()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Entry point: flags -> ServiceFlags -> serve(cfg)."""

from __future__ import annotations

import logging
import sys

from hetpipe import devices, rpc
from hetpipe.service import ServiceFlags, exit_now, run_server
from hetpipe.v1 import coordinator_pb2
from stage_worker.config import parse_args
from stage_worker.runtime import StageRuntime
from stage_worker.servicer import StageServicer


def serve(cfg: ServiceFlags) -> None:
    devices.set_threads()
    runtime = StageRuntime()
    server = rpc.Server(cfg.host, cfg.port, role="stage_worker", workers=rpc.server_threads("Stage"))

    def shutdown() -> None:
        runtime.stop()
        server.stop()

    rpc.add_service(server.grpc, "Stage", StageServicer(runtime, shutdown))
    device = devices.pick("")
    run_server(cfg, server, shutdown, role=coordinator_pb2.WorkerInfo.STAGE_WORKER,
               device=device.name, memory_bytes=device.memory_bytes if device.kind == "cuda" else 0)
    runtime.stop()


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    serve(parse_args(argv))
    exit_now()
    return 0


if __name__ == "__main__":
    sys.exit(main())

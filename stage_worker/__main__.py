"""Entry point: flags -> ServiceFlags -> serve(cfg)."""

from __future__ import annotations

import logging
import os
import sys

import torch
import torch._dynamo  # noqa: F401  torch imports it lazily on first use: seconds, better paid before serving

from hetpipe import rpc
from hetpipe.service import ServiceFlags, exit_now, run_server
from hetpipe.v1 import coordinator_pb2
from stage_worker.config import parse_args
from stage_worker.runtime import StageRuntime
from stage_worker.servicer import StageServicer, add_to_server
from stage_worker.wsp_sync import WspSync


def serve(cfg: ServiceFlags) -> None:
    # One process per stage: oversubscribing the cores with intra-op threads only slows them all.
    torch.set_num_threads(max(1, int(os.environ.get("HETPIPE_THREADS", "1"))))
    runtime = StageRuntime(make_sync=WspSync)
    server = rpc.Server(cfg.host, cfg.port, role="stage_worker")

    def shutdown() -> None:
        runtime.stop()
        server.stop()

    add_to_server(StageServicer(runtime, shutdown), server.grpc)
    cuda = torch.cuda.is_available()
    run_server(cfg, server, shutdown, role=coordinator_pb2.WorkerInfo.STAGE_WORKER,
               device="cuda:0" if cuda else "cpu",
               memory_bytes=torch.cuda.get_device_properties(0).total_memory if cuda else 0)
    runtime.stop()


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    serve(parse_args(argv))
    exit_now()
    return 0


if __name__ == "__main__":
    sys.exit(main())

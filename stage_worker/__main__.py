"""Entry point: flags -> StageWorkerConfig -> serve(cfg)."""

from __future__ import annotations

import logging
import os
import sys

import torch
import torch._dynamo  # noqa: F401  torch imports it lazily on first use: seconds, better paid before serving

from hetpipe import metrics, rpc
from hetpipe.v1 import stage_pb2_grpc
from stage_worker.config import StageWorkerConfig, parse_args
from stage_worker.runtime import StageRuntime
from stage_worker.servicer import StageServicer
from stage_worker.wsp_sync import WspSync


def serve(cfg: StageWorkerConfig) -> None:
    # One process per stage: oversubscribing the cores with intra-op threads only slows them all.
    torch.set_num_threads(max(1, int(os.environ.get("HETPIPE_THREADS", "1"))))
    runtime = StageRuntime(make_sync=WspSync)
    server = rpc.Server(cfg.host, cfg.port)

    def shutdown() -> None:
        runtime.stop()
        server.stop()

    stage_pb2_grpc.add_StageServicer_to_server(StageServicer(runtime, shutdown), server.grpc)
    metrics_port = metrics.serve(cfg.metrics_port)
    server.start()
    server.stop_on_signals(shutdown)
    if cfg.exit_with_parent:
        rpc.exit_with_parent(os.getppid(), shutdown)
    logging.info("stage worker serving on %s (metrics :%d)", server.address, metrics_port)
    if cfg.ready_file:
        rpc.write_ready_file(cfg.ready_file, f"{server.address} {metrics_port}")
    server.wait()
    runtime.stop()


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    serve(parse_args(argv))
    logging.shutdown()
    # Everything is flushed and closed; interpreter teardown of torch and gRPC only adds seconds.
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())

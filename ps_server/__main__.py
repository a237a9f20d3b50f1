"""Entry point: flags -> ShardConfig -> serve(cfg)."""

from __future__ import annotations

import logging
import os
import sys

import torch

from hetpipe import metrics, rpc
from hetpipe.v1 import ps_pb2_grpc
from ps_server import metrics as shard_metrics
from ps_server.config import ShardConfig, parse_args
from ps_server.durability import Durability
from ps_server.servicer import ShardServicer
from ps_server.shard import Shard


def serve(cfg: ShardConfig) -> None:
    torch.set_num_threads(1)
    durability = Durability(cfg.checkpoint_dir, cfg.checkpoint_every) if cfg.checkpoint_dir else None
    servicer = ShardServicer(Shard(), durability, max_pull_wait_s=cfg.max_pull_wait_s)
    servicer.restore()
    if servicer.restored_pushes or servicer.shard.ready:
        logging.info("restored %d keys (+%d logged pushes) from %s", len(servicer.shard.values),
                     servicer.restored_pushes, cfg.checkpoint_dir)
    # Pulls block a thread each while they wait for slower VWs: size the pool for that.
    server = rpc.Server(cfg.host, cfg.port, workers=128)

    def shutdown() -> None:
        servicer.checkpoint()
        server.stop()

    ps_pb2_grpc.add_ParameterServerServicer_to_server(servicer, server.grpc)
    shard_metrics.bind(servicer)
    metrics_port = metrics.serve(cfg.metrics_port)
    server.start()
    server.stop_on_signals(shutdown)
    if cfg.exit_with_parent:
        rpc.exit_with_parent(os.getppid(), shutdown)
    logging.info("ps shard serving on %s (metrics :%d)", server.address, metrics_port)
    if cfg.ready_file:
        rpc.write_ready_file(cfg.ready_file, f"{server.address} {metrics_port}")
    server.wait()


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    serve(parse_args(argv))
    logging.shutdown()
    os._exit(0)  # state is checkpointed; skip the slow interpreter teardown


if __name__ == "__main__":
    sys.exit(main())

"""Entry point: flags -> ShardConfig -> serve(cfg)."""

from __future__ import annotations

import logging
import sys
import threading

from hetpipe import devices, rpc, security, threads
from hetpipe.service import exit_now, run_server, secure
from hetpipe.v1 import coordinator_pb2
from ps_server import metrics as shard_metrics
from ps_server.config import ShardConfig, parse_args
from ps_server.durability import Durability
from ps_server.servicer import ShardServicer
from ps_server.shard import Shard


def serve(cfg: ShardConfig) -> int:
    devices.set_threads(threads.PS_THREADS_ENV)
    secure(cfg.service, security.SHARD)
    durability = Durability(cfg.checkpoint_dir, cfg.checkpoint_every) if cfg.checkpoint_dir else None
    servicer = ShardServicer(Shard(), durability, max_pull_wait_s=cfg.max_pull_wait_s, trace_dir=cfg.trace_dir)
    servicer.restore()
    if servicer.shard.ready:
        logging.info("restored %d keys (+%d logged pushes) from %s", len(servicer.shard.values),
                     servicer.restored_pushes, cfg.checkpoint_dir)
    # Pulls block a thread each while they wait for slower VWs: size the pool for that.
    server = rpc.Server(cfg.service.host, cfg.service.port, role="ps_shard",
                        workers=rpc.server_threads("ParameterServer"), health_port=cfg.service.health_port)

    job_ended = threading.Event()   # the coordinator said it runs no job of this shard's

    def shutdown() -> None:
        try:
            servicer.flush_trace()  # before the checkpoint, which may outlast the launcher's grace
            if not job_ended.is_set():
                servicer.checkpoint()
        except OSError as exc:   # a full disk, a folder gone
            logging.error("the shard's last checkpoint failed: %s", exc)
        finally:
            server.stop()   # whatever the checkpoint did: a shard left serving holds a job for nobody

    def orphaned(ended: bool) -> None:
        if ended:
            job_ended.set()

    server.add("ParameterServer", servicer)
    shard_metrics.bind(servicer.metrics_snapshot)
    code = run_server(cfg.service, server, shutdown, role=coordinator_pb2.WorkerInfo.PS_SHARD,
                      holds_job=lambda: servicer.shard.ready, on_orphaned=orphaned)
    if job_ended.is_set():
        # Whatever restarts this process in its folder (compose, a StatefulSet, `hetpipe worker`)
        # must start it fresh, not restore that job's clocks, which the next job's Init would meet
        # as a conflict. A coordinator merely unreachable may still run the job: the state stays,
        # and the restarted shard's registration tells which (RegisterReply.job_unknown).
        servicer.discard()
        logging.info("discarded the state of the job that ended with its coordinator (%s)", cfg.checkpoint_dir)
    return code


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        code = serve(parse_args(argv))
    except security.SecurityError as exc:
        print(f"ps_server: error: {exc}", file=sys.stderr)
        return 2
    exit_now(code)  # state is checkpointed
    return code


if __name__ == "__main__":
    sys.exit(main())

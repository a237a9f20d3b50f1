"""Entry point: flags -> CoordinatorConfig -> serve(cfg)."""

from __future__ import annotations

import logging
import os
import sys

from hetpipe import outputs, rpc, security
from hetpipe.config import ConfigError, JobConfig, check_coordinated, load_job, with_overrides
from hetpipe.service import exit_now, return_large_buffers, run_server, secure
from coordinator import metrics as coordinator_metrics
from coordinator.config import CoordinatorConfig, parse_args
from coordinator.job import JobRunner
from coordinator.registry import Registry
from coordinator.servicer import CoordinatorServicer


def build(host: str, port: int, *, heartbeat_interval_s: float = 1.0, claim_timeout_s: float = 120.0,
          health_port: int = 0, output_root: str | None = None,
          data_root: str | None = None) -> tuple[rpc.Server, CoordinatorServicer]:
    """The coordinator's gRPC server and servicer, not yet started (`hetpipe run` embeds it).
    output_root: where jobs submitted from other hosts write (None: their own output.dir);
    data_root: where the files they name must lie (None: anywhere; default output_root)."""
    registry = Registry(heartbeat_interval_s)
    servicer = CoordinatorServicer(registry, JobRunner(registry, claim_timeout_s=claim_timeout_s,
                                                       output_root=output_root),
                                   data_root=data_root or output_root)
    coordinator_metrics.bind(servicer.metrics_snapshot)
    server = rpc.Server(host, port, role="coordinator", health_port=health_port)
    server.add("Coordinator", servicer)
    return server, servicer


def startup_job(cfg: CoordinatorConfig) -> JobConfig:
    """The --job file, with --output-dir applied, as a fresh job: like `hetpipe run`, it clears the
    output's ps/ folder, where the shards of compose.yaml keep their checkpoints (they start after
    the coordinator and would otherwise restore an earlier run's state). Raises ConfigError."""
    job = load_job(cfg.job)
    check_coordinated(job, "a coordinator")
    if cfg.output_dir:
        job = with_overrides(job, output={"dir": os.path.abspath(cfg.output_dir)})
    out_dir = job.resolve(job.output.dir)
    outputs.check_reads(out_dir, job.read_paths, keep_checkpoints=True)
    outputs.start_fresh(out_dir, keep_checkpoints=True)
    return job


def serve(cfg: CoordinatorConfig) -> None:
    secure(cfg.service, security.COORDINATOR)
    job = startup_job(cfg) if cfg.job else None
    server, servicer = build(cfg.service.host, cfg.service.port, heartbeat_interval_s=cfg.heartbeat_interval_s,
                             claim_timeout_s=cfg.claim_timeout_s, health_port=cfg.service.health_port,
                             output_root=cfg.service.output_root, data_root=cfg.data_root)
    if job is not None:
        servicer.runner.submit(job)  # plans, then waits up to --claim-timeout for the workers

    def shutdown() -> None:
        servicer.runner.stop("coordinator shutting down")
        server.stop()

    run_server(cfg.service, server, shutdown, role=None)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    return_large_buffers()  # the coordinator serves control messages and computes no tensors
    try:
        serve(parse_args(argv))
    except (ConfigError, security.SecurityError) as exc:  # a bad --job file or security: refuse to start
        print(f"coordinator: error: {exc}", file=sys.stderr)
        return 2
    exit_now()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Entry point: flags -> CoordinatorConfig -> serve(cfg)."""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass
from typing import Any

from hetpipe import outputs, rpc, security
from hetpipe.config import ConfigError, JobConfig, check_coordinated, load_job, with_overrides
from hetpipe.service import exit_now, return_large_buffers, run_server, secure
from coordinator import checkpoints
from coordinator import metrics as coordinator_metrics
from coordinator.config import CoordinatorConfig, parse_args
from coordinator.job import JobRunner
from coordinator.planner import Plan, PlanError, make_plan
from coordinator.registry import Registry
from coordinator.servicer import CoordinatorServicer

log = logging.getLogger("coordinator")


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


@dataclass(frozen=True)
class StartupJob:
    """The --job to submit at start: planned already, and resume_wave > 0, where it goes on from a cut."""

    job: JobConfig
    plan: Plan | None = None
    resume_wave: int = 0


def startup_job(cfg: CoordinatorConfig) -> StartupJob:
    """The --job file, with --output-dir applied. Where output.dir holds an unfinished run's
    checkpoints (train.checkpoint_every; no summary.json), the job goes on from the latest, as
    `hetpipe run --resume` would: a coordinator restarted mid-job (compose's restart policy, a
    Deployment's) loses only the waves since: cuts of this very job only (the same settings; a
    compose volume outlives the job that wrote it). Else (or with --fresh, or HETPIPE_FRESH of a
    value that did not start this run for the job as it is: checkpoints.fresh_marked) it starts over, like
    `hetpipe run`. Either way it clears the output's ps/ folder, where the shards of compose.yaml keep their
    state (they start after the coordinator and would otherwise restore an earlier run's).
    Raises ConfigError, for a cut of another job or a damaged one too."""
    job = load_job(cfg.job)
    check_coordinated(job, "a coordinator", cuts=True)
    if cfg.output_dir:
        job = with_overrides(job, output={"dir": os.path.abspath(cfg.output_dir)})
    out_dir = job.resolve(job.output.dir)
    folder = out_dir / outputs.CHECKPOINTS
    wave = None if outputs.read_summary(out_dir) is not None else checkpoints.latest(folder)
    marked = wave is not None and bool(cfg.fresh) and checkpoints.fresh_marked(folder, cfg.fresh)
    fresh = ("the coordinator's --fresh deletes them (compose: `HETPIPE_FRESH=$(date +%s) docker compose up`: "
             "HETPIPE_FRESH starts over once per value)")
    m: dict[str, Any] = {}
    changed: list[str] = []
    if wave is not None and (marked or not cfg.fresh):   # cuts it may go on from: read once
        try:
            m = checkpoints.manifest(folder, wave)
            changed = checkpoints.changes(m, job)
        except ConfigError as exc:
            raise ConfigError(f"--job {cfg.job}: {exc} ({fresh})") from None
    # A start-over request is honoured unless it started these cuts' run, for the job as it is now.
    if wave is None or (cfg.fresh and (not marked or changed)):
        outputs.check_reads(out_dir, job.read_paths)
        outputs.start_fresh(out_dir, keep_checkpoints=False)
        checkpoints.mark_fresh(folder, cfg.fresh if job.train.checkpoint_every else "")   # only where cuts will be
        return StartupJob(job)
    if marked:
        log.info("--job %s: HETPIPE_FRESH=%s started this run over already, and this start, with the same "
                 "value, is its restart: it goes on from the checkpoints taken since (another value starts "
                 "over again)", cfg.job, cfg.fresh)
    else:
        checkpoints.mark_fresh(folder, "")
    try:
        plan = make_plan(job)
        if not changed:
            checkpoints.check_cut(folder, wave, m, checkpoints.job_shape(job, plan, job.parallel.started_shards))
    except ConfigError as exc:
        raise ConfigError(f"--job {cfg.job}: {exc} ({fresh})") from None
    if changed:
        raise ConfigError(f"--job {cfg.job}: {folder} holds the checkpoints of an unfinished run of another job: "
                          f"{'; '.join(changed[:5])}{'; ...' if len(changed) > 5 else ''}. The coordinator goes on from "
                          f"its own job's only: set the job back to go on from them, or start over ({fresh})")
    outputs.check_reads(out_dir, job.read_paths, keep_checkpoints=True)
    # The evaluations up to the cut, as `hetpipe run --resume` keeps them.
    outputs.start_fresh(out_dir, keep_checkpoints=True, evals=outputs.evals_through(out_dir, wave * plan.nm))
    log.info("--job %s: resuming from the checkpoint of wave %d (after each VW's minibatch %d of %d) in %s",
             cfg.job, wave, wave * plan.nm, job.train.steps, folder)
    return StartupJob(job, plan, wave)


def serve(cfg: CoordinatorConfig) -> None:
    secure(cfg.service, security.COORDINATOR)
    start = startup_job(cfg) if cfg.job else None
    server, servicer = build(cfg.service.host, cfg.service.port, heartbeat_interval_s=cfg.heartbeat_interval_s,
                             claim_timeout_s=cfg.claim_timeout_s, health_port=cfg.service.health_port,
                             output_root=cfg.service.output_root, data_root=cfg.data_root)
    if start is not None:   # plans unless planned, then waits up to --claim-timeout for the workers
        servicer.runner.submit(start.job, start.plan, resume_wave=start.resume_wave)

    def shutdown() -> None:
        servicer.runner.stop("coordinator shutting down")
        server.stop()

    run_server(cfg.service, server, shutdown, role=None)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    return_large_buffers()  # the coordinator serves control messages and computes no tensors
    try:
        serve(parse_args(argv))
    except (ConfigError, PlanError, security.SecurityError) as exc:  # a bad --job file or security: refuse to start
        print(f"coordinator: error: {exc}", file=sys.stderr)
        return 2
    exit_now()
    return 0


if __name__ == "__main__":
    sys.exit(main())

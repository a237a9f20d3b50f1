"""Coordinator process configuration (flags and environment)."""

from __future__ import annotations

import argparse
import math
import os
import uuid
from dataclasses import dataclass

from hetpipe.registration import HEARTBEAT_BOUNDS_S
from hetpipe.service import ServiceFlags, add_service_flags, env_number, service_flags

DEFAULT_PORT = 50050
NOT_FRESH = ("", "0", "false", "no", "off")   # HETPIPE_FRESH values that request nothing


@dataclass(frozen=True, slots=True, kw_only=True)
class CoordinatorConfig:
    service: ServiceFlags
    heartbeat_interval_s: float = 1.0
    claim_timeout_s: float = 120.0
    job: str = ""           # a job file to submit at start (compose); empty = wait for `Submit`
    output_dir: str = ""    # with job: its outputs go here instead of the file's output.dir
    data_root: str = ""     # files a submitted job names must lie here; empty = the output root
    # With job: start over, deleting an unfinished run's checkpoints, rather than go on from them.
    # The request's value, honoured once (checkpoints.fresh_marked): HETPIPE_FRESH's, so that a
    # restart with the same environment (compose's restart policy, a Deployment's) goes on from
    # the checkpoints the run it started took; --fresh's own, new at every start. "" = none.
    fresh: str = ""


def parse_args(argv: list[str] | None = None) -> CoordinatorConfig:
    env = os.environ.get
    ap = argparse.ArgumentParser(prog="python -m coordinator", description="HetPipe coordinator")
    add_service_flags(ap, default_port=DEFAULT_PORT, worker=False)
    ap.add_argument("--heartbeat-interval", type=float, default=env_number(ap, "HETPIPE_HEARTBEAT_INTERVAL", "1.0", float),
                    help="seconds between worker heartbeats; 5 missed = dead (default 1)")
    ap.add_argument("--claim-timeout", type=float, default=120.0,
                    help="seconds to wait for enough workers to register (default 120)")
    ap.add_argument("--job", default=env("HETPIPE_JOB", ""),
                    help="job YAML file to submit at start, as `hetpipe run` would (compose.yaml uses it)")
    ap.add_argument("--data-root", default=env("HETPIPE_DATA_ROOT", ""),
                    help="the files a job submitted over gRPC names (data.path, model.init) and, for a job with a "
                         "factory, its base_dir must lie inside this folder (default: --output-root)")
    ap.add_argument("--output-dir", default=env("HETPIPE_OUTPUT_DIR", ""),
                    help="with --job: write the job's outputs here instead of its output.dir")
    ap.add_argument("--fresh", action="store_true",
                    help="with --job: delete an unfinished run's checkpoints in its output dir and start over, "
                         "instead of going on from the latest. HETPIPE_FRESH=VALUE does so once per value: a "
                         "restart with the same environment goes on from the checkpoints taken since")
    ns = ap.parse_args(argv)
    if not (math.isfinite(ns.claim_timeout) and ns.claim_timeout > 0):   # nan: a claim that never ends
        ap.error(f"--claim-timeout must be a number of seconds > 0, got {ns.claim_timeout}")
    low, high = HEARTBEAT_BOUNDS_S   # nan: no worker alive; outside them, not the interval workers keep
    if not low <= ns.heartbeat_interval <= high:
        ap.error(f"--heartbeat-interval must be a number of seconds in [{low:g}, {high:g}], got {ns.heartbeat_interval}")
    from_env = env("HETPIPE_FRESH", "").strip()
    # Words that read as "no" are none: HETPIPE_FRESH=false in an .env file must not delete checkpoints.
    fresh = f"--fresh {uuid.uuid4().hex}" if ns.fresh else "" if from_env.lower() in NOT_FRESH else from_env
    for flag, given in (("--output-dir", ns.output_dir), ("--fresh", ns.fresh)):
        if given and not ns.job:
            ap.error(f"{flag} needs --job")
    return CoordinatorConfig(service=service_flags(ns), heartbeat_interval_s=ns.heartbeat_interval,
                             claim_timeout_s=ns.claim_timeout, job=ns.job, output_dir=ns.output_dir,
                             data_root=ns.data_root, fresh=fresh)

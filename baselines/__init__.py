"""Baselines on the same job file, data, model and devices as HetPipe (DESIGN §7):

- `parallel.mode: ddp`: Horovod-style synchronous allreduce data parallelism (baselines/ddp.py);
- `parallel.mode: torch-pipeline`: one pipeline run by torch.distributed.pipelining's GPipe or
  1F1B schedule (baselines/pipeline.py).

Both start one worker process per device (`python -m baselines`), write model.safetensors and
summary.json with HetPipe's fields, and stop every process they started.
"""

from __future__ import annotations

from typing import Any

from hetpipe.config import ConfigError, JobConfig


def run_baseline(job: JobConfig, *, quiet: bool = False) -> dict[str, Any]:
    """Trains job with its baseline mode; returns the summary (also written to summary.json)."""
    mode = job.parallel.mode
    if mode == "ddp":
        from baselines.ddp import run_ddp

        return run_ddp(job, quiet=quiet)
    if mode == "torch-pipeline":
        from baselines.pipeline import run_pipeline

        return run_pipeline(job, quiet=quiet)
    raise ConfigError(f"parallel.mode: {mode!r} is not a baseline mode (ddp, torch-pipeline)")

"""Parameter-server shard process configuration (flags and environment)."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from hetpipe.service import ServiceFlags, add_service_flags, env_number, service_flags


@dataclass(frozen=True, slots=True, kw_only=True)
class ShardConfig:
    service: ServiceFlags
    checkpoint_dir: str = ""        # empty: no durability (benchmarks)
    checkpoint_every: int = 10      # clocks of c_global between checkpoints (the push log covers the rest)
    max_pull_wait_s: float = 600.0  # a pull with no deadline of its own waits at most this long
    trace_dir: str = ""             # the job's trace/ (output.trace): each push and pull to trace/ps/shard{j}.jsonl


def parse_args(argv: list[str] | None = None) -> ShardConfig:
    env = os.environ.get
    ap = argparse.ArgumentParser(prog="python -m ps_server", description="HetPipe parameter-server shard")
    add_service_flags(ap)
    ap.add_argument("--checkpoint-dir", default=env("HETPIPE_CHECKPOINT_DIR", ""),
                    help="checkpoint + push log directory; restored from at start")
    ap.add_argument("--checkpoint-every", type=int, default=env_number(ap, "HETPIPE_CHECKPOINT_EVERY", "10", int),
                    help="checkpoint every M clocks")
    ap.add_argument("--trace-dir", default=env("HETPIPE_TRACE_DIR", ""),
                    help="the job's trace directory: one line per push applied and pull answered (default: none)")
    ns = ap.parse_args(argv)
    if ns.checkpoint_every < 1:
        ap.error(f"--checkpoint-every must be >= 1, got {ns.checkpoint_every}")
    return ShardConfig(service=service_flags(ns), checkpoint_dir=ns.checkpoint_dir,
                       checkpoint_every=ns.checkpoint_every, trace_dir=ns.trace_dir)

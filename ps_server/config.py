"""Parameter-server shard process configuration (flags and environment)."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass


@dataclass(frozen=True, slots=True, kw_only=True)
class ShardConfig:
    host: str = "127.0.0.1"
    port: int = 0
    metrics_port: int = 0
    ready_file: str = ""
    exit_with_parent: bool = False
    checkpoint_dir: str = ""        # empty: no durability (benchmarks)
    checkpoint_every: int = 1       # clocks of c_global between checkpoints
    max_pull_wait_s: float = 600.0  # a pull with no deadline of its own waits at most this long


def parse_args(argv: list[str] | None = None) -> ShardConfig:
    env = os.environ.get
    ap = argparse.ArgumentParser(prog="python -m ps_server", description="HetPipe parameter-server shard")
    ap.add_argument("--host", default=env("HETPIPE_HOST", "127.0.0.1"), help="address to bind")
    ap.add_argument("--port", type=int, default=int(env("HETPIPE_PORT", "0")), help="gRPC port (0 = any)")
    ap.add_argument("--metrics-port", type=int, default=int(env("HETPIPE_METRICS_PORT", "0")),
                    help="Prometheus port (0 = any)")
    ap.add_argument("--ready-file", default=env("HETPIPE_READY_FILE", ""), help="write host:port here when serving")
    ap.add_argument("--exit-with-parent", action="store_true", help="exit when the launching process dies")
    ap.add_argument("--checkpoint-dir", default=env("HETPIPE_CHECKPOINT_DIR", ""),
                    help="checkpoint + push log directory; restored from at start")
    ap.add_argument("--checkpoint-every", type=int, default=int(env("HETPIPE_CHECKPOINT_EVERY", "1")),
                    help="checkpoint every M clocks")
    ns = ap.parse_args(argv)
    if ns.checkpoint_every < 1:
        ap.error(f"--checkpoint-every must be >= 1, got {ns.checkpoint_every}")
    return ShardConfig(host=ns.host, port=ns.port, metrics_port=ns.metrics_port, ready_file=ns.ready_file,
                       exit_with_parent=ns.exit_with_parent, checkpoint_dir=ns.checkpoint_dir,
                       checkpoint_every=ns.checkpoint_every)

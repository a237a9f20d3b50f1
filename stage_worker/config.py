"""Stage worker process configuration (flags and environment)."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass


@dataclass(frozen=True, slots=True, kw_only=True)
class StageWorkerConfig:
    host: str = "127.0.0.1"
    port: int = 0
    metrics_port: int = 0
    ready_file: str = ""       # written with host:port once serving (for launchers using port 0)
    exit_with_parent: bool = False
    ps_timeout_s: float = 60.0


def parse_args(argv: list[str] | None = None) -> StageWorkerConfig:
    env = os.environ.get
    ap = argparse.ArgumentParser(prog="python -m stage_worker", description="HetPipe stage worker")
    ap.add_argument("--host", default=env("HETPIPE_HOST", "127.0.0.1"), help="address to bind")
    ap.add_argument("--port", type=int, default=int(env("HETPIPE_PORT", "0")), help="gRPC port (0 = any)")
    ap.add_argument("--metrics-port", type=int, default=int(env("HETPIPE_METRICS_PORT", "0")),
                    help="Prometheus port (0 = any)")
    ap.add_argument("--ready-file", default=env("HETPIPE_READY_FILE", ""), help="write host:port here when serving")
    ap.add_argument("--exit-with-parent", action="store_true", help="exit when the launching process dies")
    ns = ap.parse_args(argv)
    return StageWorkerConfig(host=ns.host, port=ns.port, metrics_port=ns.metrics_port,
                             ready_file=ns.ready_file, exit_with_parent=ns.exit_with_parent)

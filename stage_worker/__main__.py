"""Entry point: flags -> ServiceFlags -> serve(cfg)."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from hetpipe import devices, rpc, security
from hetpipe.service import ServiceFlags, exit_now, run_server, secure
from hetpipe.v1 import coordinator_pb2
from stage_worker.config import parse_args
from stage_worker.runtime import StageRuntime
from stage_worker.servicer import StageServicer


def serve(cfg: ServiceFlags) -> int:
    devices.set_threads()
    secure(cfg, security.STAGE)
    runtime = StageRuntime(Path(cfg.output_root))
    server = rpc.Server(cfg.host, cfg.port, role="stage_worker", workers=rpc.server_threads("Stage"),
                        health_port=cfg.health_port)

    def shutdown() -> None:
        try:
            runtime.stop()
        finally:
            server.stop()   # whatever stopping the runtime raised: a worker left serving holds a job for nobody

    server.add("Stage", StageServicer(runtime, shutdown))
    device = devices.pick("")
    code = run_server(cfg, server, shutdown, role=coordinator_pb2.WorkerInfo.STAGE_WORKER,
                      device=device.name, memory_bytes=device.memory_bytes if device.kind == "cuda" else 0,
                      holds_job=lambda: runtime.state.assigned)
    runtime.stop()
    return code


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        code = serve(parse_args(argv))
    except security.SecurityError as exc:
        print(f"stage_worker: error: {exc}", file=sys.stderr)
        return 2
    exit_now(code)
    return code


if __name__ == "__main__":
    sys.exit(main())

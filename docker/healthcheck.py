#!/usr/bin/env python3
"""Container health check: asks the process's gRPC health service (grpc.health.v1) for its status.

    hetpipe-healthcheck [ADDRESS [SERVICE]]

ADDRESS defaults to $HETPIPE_HEALTH_ADDRESS, else 127.0.0.1:$HETPIPE_PORT (the port every service
of the image listens on unless its command says otherwise), else 127.0.0.1:50051. SERVICE is the
health service name to check; "" (the default) is the whole server. Exits 0 only when the answer is
SERVING, and 1 otherwise: NOT_SERVING (a server that is shutting down says so), UNKNOWN, no answer
within $HETPIPE_HEALTH_TIMEOUT seconds (default 3), or nothing listening. Docker reads exit 1 as
unhealthy; it reserves every other non-zero code, so none is used.

The image installs this file as /usr/local/bin/hetpipe-healthcheck; the Dockerfile's HEALTHCHECK
and compose.yaml's healthchecks call it. It needs only grpcio and grpcio-health-checking.
"""

from __future__ import annotations

import os
import sys

HEALTHY, UNHEALTHY = 0, 1


def default_address() -> str:
    explicit = os.environ.get("HETPIPE_HEALTH_ADDRESS", "")
    return explicit or f"127.0.0.1:{os.environ.get('HETPIPE_PORT') or '50051'}"


def check(address: str, service: str = "", timeout: float = 3.0) -> tuple[int, str]:
    """(exit code, what was seen)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError as exc:
            return UNHEALTHY, f"{address}: {exc.code().name}: {exc.details()}"
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    code = HEALTHY if reply.status == health_pb2.HealthCheckResponse.SERVING else UNHEALTHY
    return code, f"{address}: {status}"


def main(argv: list[str]) -> int:
    if len(argv) > 2 or any(a.startswith("-") for a in argv):  # usage (even --help): never 0 unless SERVING
        print("usage: " + __doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return UNHEALTHY
    address = argv[0] if argv else default_address()
    service = argv[1] if len(argv) > 1 else ""
    try:
        timeout = float(os.environ.get("HETPIPE_HEALTH_TIMEOUT", "3"))
        code, seen = check(address, service, timeout)
    except Exception as exc:  # any failure to get SERVING is unhealthy, never a traceback's exit code
        code, seen = UNHEALTHY, f"{address}: {type(exc).__name__}: {exc}"
    print(seen)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

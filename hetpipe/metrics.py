"""Prometheus helpers: one registry per service process, served on its own HTTP port."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, start_http_server

REGISTRY = CollectorRegistry(auto_describe=True)


def serve(port: int, host: str = "0.0.0.0") -> int:
    """Serves REGISTRY on host:port (0 = any free port); returns the bound port."""
    server, _ = start_http_server(port, addr=host, registry=REGISTRY)
    return int(server.server_address[1])

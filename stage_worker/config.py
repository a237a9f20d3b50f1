"""Stage worker process configuration (flags and environment)."""

from __future__ import annotations

import argparse

from hetpipe.service import ServiceFlags, add_service_flags, service_flags


def parse_args(argv: list[str] | None = None) -> ServiceFlags:
    ap = argparse.ArgumentParser(prog="python -m stage_worker", description="HetPipe stage worker: one "
                                 "pipeline stage of one virtual worker on one device")
    add_service_flags(ap)
    return service_flags(ap.parse_args(argv))

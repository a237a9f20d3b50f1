"""Real service processes for the fuzz and amplification tests: `python -m MODULE` on a free port,
as a launcher starts them, with a raw-bytes channel to call them by method name."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import psutil

from hetpipe import rpc, shm

REPO = Path(__file__).resolve().parents[1]


@dataclass
class Service:
    name: str          # its gRPC service
    proc: subprocess.Popen[bytes]
    channel: grpc.Channel
    log: Path
    address: str = ""

    def call(self, method: str, kind: str = "unary_unary") -> Callable[..., Any]:
        """This service's `method`, raw bytes both ways; kind: the channel's unary_unary,
        stream_unary or unary_stream."""
        return getattr(self.channel, kind)(f"/hetpipe.v1.{self.name}/{method}", request_serializer=None,
                                           response_deserializer=None)

    def rss(self) -> int:
        return psutil.Process(self.proc.pid).memory_info().rss


def start(module: str, service: str, tmp: Path, extra: tuple[str, ...] = ()) -> Iterator[Service]:
    ready, log = tmp / f"{module}.ready", tmp / f"{module}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", module, "--host", "127.0.0.1", "--port", "0",
                                 "--metrics-port", "0", "--ready-file", str(ready), "--exit-with-parent", *extra],
                                cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while not (ready.exists() and ready.read_text().strip()):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-2000:]
            time.sleep(0.05)
        address = ready.read_text().split()[0]
        channel = rpc.channel(address)
        yield Service(service, proc, channel, log, address)
        channel.close()
    finally:
        proc.kill()
        proc.wait(10)
        shm.sweep()  # a launcher's duty: kill -9 left its shared-memory segments behind



"""How fast the amplification cases of issue 14 are refused, next to a well-formed call of the
same service in the same run (median of --repeat), with the server's RSS before and after.

    python bench/amplification.py [--repeat 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from service_process import Service, start  # noqa: E402

from hetpipe import wire  # noqa: E402
from hetpipe.v1 import coordinator_pb2, wire_pb2  # noqa: E402


def _ms(call: Callable[[], object], repeat: int) -> tuple[float, str]:
    times, code = [], "OK"
    for _ in range(repeat):
        started = time.perf_counter()
        try:
            call()
        except grpc.RpcError as exc:
            code = exc.code().name
        times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times), code



def _shard_cases(shard: Service) -> Iterator[tuple[str, Callable[[], object]]]:
    shard.call("Init", "stream_unary")(iter(wire.encode([("w", torch.ones(2))], init=wire_pb2.InitTag(virtual_workers=2))),
                           timeout=10)
    yield "PS.Status (well-formed, for scale)", lambda: shard.call("Status")(b"", timeout=10)
    yield "PS.Init, virtual_workers 20000000", lambda: shard.call("Init", "stream_unary")(
        iter(wire.encode([("w", torch.ones(2))], init=wire_pb2.InitTag(virtual_workers=20_000_000))), timeout=10)
    yield "PS.Push, 256 MiB under a foreign key", lambda: shard.call("Push", "stream_unary")(
        wire.encode([("foreign", torch.zeros(64, 1 << 20))], push=wire_pb2.PushTag(vw=0, clock=0)), timeout=30)


def _coordinator_cases(coordinator: Service) -> Iterator[tuple[str, Callable[[], object]]]:
    yield "Coordinator.GetJob (well-formed, for scale)", lambda: coordinator.call("GetJob")(b"", timeout=10)
    info = coordinator_pb2.WorkerInfo(role=coordinator_pb2.WorkerInfo.STAGE_WORKER, address="127.0.0.1:1000",
                                      node="n0", device="cpu", name="x" * (1 << 20)).SerializeToString()
    yield "Coordinator.Register, 1 MiB name", lambda: coordinator.call("Register")(info, timeout=10)
    for label, text in [("virtual_workers 1e18", json.dumps({"model": {"name": "mlp"}, "data": {"name": "digits"},
                                                                "parallel": {"virtual_workers": 10**18}})),
                        ("100k-deep JSON", "[" * 100_000 + "]" * 100_000)]:
        request = coordinator_pb2.SubmitRequest(job_json=text).SerializeToString()
        yield f"Coordinator.Submit, {label}", lambda request=request: coordinator.call("Submit")(request, timeout=10)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    print(f"{'case':44} {'median ms':>9}  {'code':18} {'RSS before -> after (MB)':>24}")
    with tempfile.TemporaryDirectory() as tmp:
        for module, service, cases in [("ps_server", "ParameterServer", _shard_cases),
                                       ("coordinator", "Coordinator", _coordinator_cases)]:
            folder = Path(tmp) / module
            folder.mkdir()
            for server in start(module, service, folder):
                for label, call in cases(server):
                    before = server.rss()
                    ms, code = _ms(call, args.repeat)
                    print(f"{label:44} {ms:9.1f}  {code:18} {before / 1e6:10.1f} -> {server.rss() / 1e6:.1f}")


if __name__ == "__main__":
    main()

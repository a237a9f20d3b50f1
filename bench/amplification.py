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
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from service_process import Service, start  # noqa: E402
from stage_rig import Recorder, serve  # noqa: E402

from coordinator.driver import JobDriver  # noqa: E402
from coordinator.planner import make_plan  # noqa: E402
from hetpipe.config import parse_job  # noqa: E402

from hetpipe import wire  # noqa: E402
from hetpipe.v1 import coordinator_pb2, ps_pb2, stage_pb2, wire_pb2  # noqa: E402


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
    payload = torch.zeros(64, 1 << 20)  # allocated once: the client's cost is not the server's
    yield "PS.Push, 256 MiB under a foreign key", lambda: shard.call("Push", "stream_unary")(
        wire.encode([("foreign", payload)], push=wire_pb2.PushTag(vw=0, clock=0)), timeout=30)
    yield from _exhaustion_cases(shard)


def _exhaustion_cases(shard: Service) -> Iterator[tuple[str, Callable[[], object]]]:
    """Status while 130 pulls without a deadline wait (their lane holds 56; the rest are refused)."""
    pull = ps_pb2.PullRequest(vw=0, keys=["w"], min_clock=1000).SerializeToString()
    waiting = [shard.call("Pull", "unary_stream")(pull) for _ in range(130)]
    try:
        yield "PS.Status, 130 deadline-less Pulls waiting", lambda: shard.call("Status")(b"", timeout=10)
        yield "PS.Pull, the 131st", lambda: list(shard.call("Pull", "unary_stream")(pull, timeout=10))
    finally:
        for call in waiting:
            call.cancel()


def _assignment() -> stage_pb2.StageAssignment:
    """What the driver assigns the middle stage of a 3-stage MLP job (to recording fakes)."""
    job = parse_job({"model": {"name": "mlp", "args": {"in_features": 64, "hidden": [32, 32, 32], "num_classes": 10}},
                     "data": {"name": "digits", "batch_size": 16}, "train": {"steps": 6},
                     "parallel": {"stages_per_vw": 3, "nm": 2}, "output": {"dir": tempfile.mkdtemp()}})
    fakes = [Recorder() for _ in range(3)]
    servers = [serve(f) for f in fakes]
    driver = JobDriver(job, make_plan(job), [s.address for s in servers])
    try:
        driver.setup()
    finally:
        driver.close()
        for server in servers:
            server.stop(grace=0)
    assert fakes[1].assignment is not None
    return fakes[1].assignment


def _stage_cases(stage: Service) -> Iterator[tuple[str, Callable[[], object]]]:
    good = _assignment()
    yield "Stage.Status (well-formed, for scale)", lambda: stage.call("Status")(b"", timeout=10)
    huge = stage_pb2.StageAssignment()
    huge.CopyFrom(good)
    del huge.input_shape[:]
    huge.input_shape.extend([4194304, 64])
    yield "Stage.Assign, input_shape [4194304, 64]", lambda: stage.call("Assign")(huge.SerializeToString(), timeout=10)
    big = 1 << 20
    job = json.loads(good.job_json)
    job["data"]["batch_size"] = big
    over = stage_pb2.StageAssignment()
    over.CopyFrom(good)
    over.job_json, over.capacity_bytes = json.dumps(job), 64 << 20
    for field, shape in [("input_shape", [big, 64]), ("activation_shape", [big, 32]), ("output_shape", [big, 32]),
                         ("target_shape", [big])]:
        del getattr(over, field)[:]
        getattr(over, field).extend(shape)
    yield "Stage.Assign, 520 MiB minibatch, 64 MiB GPU", lambda: stage.call("Assign")(over.SerializeToString(),
                                                                                     timeout=10)
    never = threading.Event()

    def silent() -> Iterator[bytes]:
        never.wait(60)
        yield b""

    streams = [stage.call("Forward", "stream_unary").future(silent()) for _ in range(16)]
    try:
        yield "Stage.Status, 16 silent Forward streams open", lambda: stage.call("Status")(b"", timeout=10)
    finally:
        never.set()
        for s in streams:
            s.cancel()


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
        for module, service, cases in [("stage_worker", "Stage", _stage_cases),
                                       ("ps_server", "ParameterServer", _shard_cases),
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

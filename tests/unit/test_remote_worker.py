"""`hetpipe worker`'s flags and devices (launch/worker.py): which stage workers a host starts, the
GPU each is pinned to and the type it registers with; what it refuses before starting anything."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from hetpipe.config import ConfigError
from launch import worker

GiB = 1 << 30


def _config(*flags: str) -> worker.WorkerConfig:
    ap = argparse.ArgumentParser()
    worker.add_flags(ap)
    return worker.config(ap.parse_args(["--coordinator", "hosta:50050", *flags]))


@pytest.fixture
def two_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process sees two CUDA devices, the system's 3 and 5: an H100 and a card not in the catalog."""
    props = [SimpleNamespace(name="NVIDIA H100 80GB HBM3", total_memory=80 * GiB),
             SimpleNamespace(name="Some Future GPU", total_memory=8 * GiB)]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props[i])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")


def test_each_gpu_gets_a_worker_pinned_to_it_and_registered_as_its_catalog_type(two_gpus: None) -> None:
    devices = worker.stage_devices(_config())
    assert [(d.gpu_type, d.env) for d in devices] == [("h100-80gb", {"CUDA_VISIBLE_DEVICES": "3"}),
                                                      ("", {"CUDA_VISIBLE_DEVICES": "5"})]
    assert "not in the catalog" in devices[1].label
    assert [d.env for d in worker.stage_devices(_config("--gpus", "1"))] == [{"CUDA_VISIBLE_DEVICES": "5"}]
    with pytest.raises(ConfigError, match="this host has 2 visible CUDA devices"):
        worker.stage_devices(_config("--gpus", "0,2"))


def test_emulated_workers_see_no_gpu(two_gpus: None) -> None:
    devices = worker.stage_devices(_config("--emulate", "titan-v", "--count", "3"))
    assert [(d.gpu_type, d.env) for d in devices] == [("titan-v", {"CUDA_VISIBLE_DEVICES": ""})] * 3


def test_without_a_gpu_one_generic_cpu_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    (d,) = worker.stage_devices(_config())
    assert d.gpu_type == "" and d.label.startswith("cpu")


@pytest.mark.parametrize(("flags", "message"), [
    (("--gpus", "0,x"), "--gpus 0,x: expected device indices"),
    (("--gpus", "1,1"), "distinct device indices"),
    (("--emulate", "gtx-9999"), "--emulate gtx-9999: expected one of"),
    (("--count", "2"), "--count: only with --emulate"),
    (("--shards", "-1"), "expected numbers >= 0"),
    # A node the coordinator refuses to register (it retried forever), or that names no folder.
    (("--node", ""), "--node '': expected a host name"),
    (("--node", "a" * 254), "--node 'aaaa"),
    (("--node", "../up"), "--node '../up': expected a host name"),
    (("--node", "a/b"), "--node 'a/b': expected a host name"),
])
def test_bad_flags_are_refused_naming_them(flags: tuple[str, ...], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        _config(*flags)


@pytest.mark.parametrize(("flags", "message"), [
    ((), "reachable from this host only"),                          # loopback, the coordinator elsewhere
    (("--host", "0.0.0.0"), "without --token-file"),                # open to anyone
])
def test_what_cannot_work_or_would_be_open_is_refused_before_starting(flags: tuple[str, ...], message: str) -> None:
    cfg = _config(*flags)
    with pytest.raises(ConfigError, match=message):
        worker.check_reachable(cfg, worker.Launcher(cfg, root=Path(".")).advertise_host)


def test_an_output_root_that_cannot_be_made_is_refused_naming_it(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    for root in (tmp_path / "file", tmp_path / "file" / "below"):
        with pytest.raises(ConfigError, match=f"--output-root {root}: cannot make its folders: Not a directory"):
            worker.serve(_config("--emulate", "t4", "--output-root", str(root)))


def test_a_second_worker_of_a_node_and_output_root_is_refused_before_clearing_the_first_ones_shards(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Started beside a live one, it cleared that one's shard checkpoints (runs/ps/NODE/shardN) and
    wrote into its log files."""
    import os

    def start(self: worker.Launcher, stages: list[worker.StageDevice]) -> None:
        raise AssertionError("started beside the live worker of the same node and output root")

    monkeypatch.setattr(worker.Launcher, "start", start)
    cut = tmp_path / "ps" / "hosta" / "shard0" / "cut"
    cut.parent.mkdir(parents=True)
    cut.write_text("the live shard's")
    (tmp_path / "logs" / "hosta").mkdir(parents=True)
    first = worker.hold_node(tmp_path, "hosta")
    try:
        with pytest.raises(ConfigError, match=rf"--node hosta: another hetpipe worker \(pid {os.getpid()}\)"):
            worker.serve(_config("--coordinator", "127.0.0.1:9", "--gpus", "none", "--shards", "1", "--node", "hosta",
                                 "--output-root", str(tmp_path)))
    finally:
        first.close()
    assert cut.read_text() == "the live shard's"
    worker.hold_node(tmp_path, "hosta").close()   # free again once the first is gone


@pytest.mark.timeout(120)
def test_a_shard_replaced_after_each_job_keeps_its_restarts_for_a_crash(tmp_path: Path) -> None:
    """A real shard process: the fresh one started after each of several jobs (stopped as asked)
    does not use up the restarts a shard that crashes mid-job gets (MAX_SHARD_RESTARTS a job)."""
    import signal

    from hetpipe.errors import JobFailed

    launcher = worker.Launcher(worker.WorkerConfig(coordinator="127.0.0.1:9", shards=1, node="hosta",
                                                   insecure=True), tmp_path)
    launcher.start([])
    try:
        [(_, shard)] = launcher.processes()
        for _ in range(worker.MAX_SHARD_RESTARTS + 1):   # jobs served, each ended by stop_spent
            launcher.stopping[shard.popen.pid] = time.monotonic()
            shard.popen.terminate()
            shard.popen.wait(30)
            launcher.check()
        for _ in range(worker.MAX_SHARD_RESTARTS):       # then crashes within one job: restarted
            shard.popen.send_signal(signal.SIGKILL)
            shard.popen.wait(30)
            launcher.check()
            assert shard.popen.poll() is None
        shard.popen.send_signal(signal.SIGKILL)
        shard.popen.wait(30)
        with pytest.raises(JobFailed, match=f"ps shard 0 at .* was killed by SIGKILL {worker.MAX_SHARD_RESTARTS + 1} times"):
            launcher.check()
    finally:
        launcher.stop_all()


@pytest.mark.timeout(120)
def test_a_spent_process_that_does_not_take_its_sigterm_is_killed(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """It keeps its port, so no fresh process could take its place: killed once SPENT_KILL_S has
    passed since its SIGTERM, then replaced."""
    import signal
    import types

    monkeypatch.setattr(worker, "SPENT_KILL_S", 0.5)
    launcher = worker.Launcher(worker.WorkerConfig(coordinator="127.0.0.1:9", shards=1, node="hosta",
                                                   insecure=True), tmp_path)
    launcher.start([])
    try:
        [(_, shard)] = launcher.processes()
        pid = shard.popen.pid
        shard.popen.send_signal(signal.SIGSTOP)   # its SIGTERM stays pending
        spent = types.SimpleNamespace(spent=True, info=types.SimpleNamespace(address=shard.address, name=f"pid {pid}"))
        stub: Any = types.SimpleNamespace(ListWorkers=lambda request, timeout: types.SimpleNamespace(workers=[spent]))
        launcher.stop_spent(stub)
        time.sleep(0.2)
        assert shard.popen.poll() is None and pid in launcher.stopping
        time.sleep(0.5)
        launcher.stop_spent(stub)
        assert shard.popen.wait(10) == -signal.SIGKILL
        launcher.check()   # asked to stop: a fresh one takes its place
        assert shard.popen.pid != pid and shard.popen.poll() is None and not launcher.stopping
    finally:
        launcher.stop_all()


@pytest.mark.timeout(120)
def test_a_process_its_coordinator_refuses_ends_the_launch_naming_the_refusal(tmp_path: Path) -> None:
    """A real shard registering with a coordinator that refuses its fields exits EXIT_REFUSED, and
    the launcher fails naming the coordinator's words rather than restarting it into the same
    refusal (a crashed shard is restarted from its checkpoint)."""
    import time

    import grpc

    from hetpipe import rpc
    from hetpipe.errors import JobFailed
    from hetpipe.service import EXIT_REFUSED

    class Refusing:
        def Register(self, request: object, context: grpc.ServicerContext) -> None:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "gpu_type 'z80': expected one of the catalog's")

    server = rpc.Server("127.0.0.1", 0)
    server.add("Coordinator", Refusing())
    server.start()
    launcher = worker.Launcher(worker.WorkerConfig(coordinator=server.address, shards=1, node="hosta",
                                                   insecure=True), tmp_path)
    try:
        launcher.start([])
        [(_, shard)] = launcher.processes()
        assert shard.popen.wait(60) == EXIT_REFUSED, shard.log_tail()
        with pytest.raises(JobFailed, match=f"ps shard 0 at .*: coordinator {server.address} refused this "
                           "process: INVALID_ARGUMENT: gpu_type 'z80': expected one of the catalog's; log "):
            launcher.check()
        time.sleep(0.5)
        assert launcher.processes()[0][1].popen.poll() == EXIT_REFUSED, "not started again"
    finally:
        launcher.stop_all()
        server.stop()


@pytest.mark.timeout(120)
def test_a_worker_pointed_at_a_port_that_serves_no_coordinator_ends_saying_so(tmp_path: Path) -> None:
    """A gRPC server without the Coordinator service (a shard's port, say) answers UNIMPLEMENTED,
    which asking again cannot change: `hetpipe worker` exits 1 saying so, instead of reporting
    it unreachable and retrying for ever."""
    import subprocess
    import sys

    from hetpipe import rpc

    server = rpc.Server("127.0.0.1", 0)   # health and reflection only
    server.start()
    try:
        done = subprocess.run([sys.executable, "-m", "launch.cli", "worker", "--coordinator", server.address,
                               "--emulate", "t4", "--node", "hosta", "--output-root", str(tmp_path)],
                              cwd=tmp_path, capture_output=True, text=True, timeout=90)
    finally:
        server.stop()
    assert done.returncode == 1, done.stderr
    # The launcher's own call, or its worker's refused registration, whichever comes first.
    assert f"coordinator {server.address}" in done.stderr and "UNIMPLEMENTED" in done.stderr, done.stderr
    assert "no coordinator serves there: another service's port?" in done.stderr, done.stderr

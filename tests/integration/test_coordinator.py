"""Coordinator service: registration checks, dead-worker detection by heartbeat, stop, CLI status."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from coordinator.__main__ import build
from hetpipe.outputs import write_status
from launch.processes import LocalProcesses
from coordinator.servicer import CoordinatorServicer
from hetpipe import rpc, security
from hetpipe.config import ConfigError
from hetpipe.v1 import coordinator_pb2, coordinator_pb2_grpc, wire_pb2

pytestmark = pytest.mark.timeout(120)
Info = coordinator_pb2.WorkerInfo
State = coordinator_pb2.JobStatus.State
INTERVAL = 0.3


@pytest.fixture
def coordinator() -> Iterator[tuple[coordinator_pb2_grpc.CoordinatorStub, CoordinatorServicer, str]]:
    server, servicer = build("127.0.0.1", 0, heartbeat_interval_s=INTERVAL, claim_timeout_s=30)
    server.start()
    channel = rpc.channel(server.address)
    try:
        yield coordinator_pb2_grpc.CoordinatorStub(channel), servicer, server.address
    finally:
        servicer.runner.stop()
        channel.close()
        server.stop()


def _worker(address: str = "127.0.0.1:6001", node: str = "n0", **kw: object) -> Info:
    return Info(role=kw.pop("role", Info.STAGE_WORKER), address=address, node=node,  # type: ignore[arg-type]
                device=kw.pop("device", "cpu"), **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(("info", "needle"), [
    (_worker(device="gpu0"), "device 'gpu0'"),
    (_worker(device="cuda:x"), "device 'cuda:x'"),
    (_worker(gpu_type="gtx-9999"), "gpu_type 'gtx-9999'"),
    (_worker(address="nohostport"), "address 'nohostport'"),
    (_worker(address="h:70000"), "address 'h:70000'"),
    (_worker(address="h:7000\n"), "address 'h:7000\\n'"),
    (_worker(device="cpu\n"), "device 'cpu\\n'"),
    (_worker(node=""), "node"),
    # A NUL in a node's name went into the cluster section of the jobs planned on it, which every
    # stage then refused ("cluster.nodes[0].name: expected ... without NUL bytes"); a line break forges log lines.
    (_worker(node="n\x000", gpu_type="t4"), "node 'n\\x000': control characters"),
    (_worker(name="pid 1\nERROR forged"), "name 'pid 1\\nERROR forged': control characters"),
    (Info(address="127.0.0.1:1", node="n0", device="cpu"), "role"),
])
def test_bad_registration_is_refused_and_changes_nothing(coordinator, info: Info, needle: str) -> None:
    stub, _, _ = coordinator
    before = stub.ListWorkers(wire_pb2.Empty(), timeout=5)
    with pytest.raises(grpc.RpcError) as err:
        stub.Register(info, timeout=5)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert needle in err.value.details()
    assert stub.ListWorkers(wire_pb2.Empty(), timeout=5) == before


def test_duplicate_address_from_another_node_is_refused_but_a_restart_takes_over(coordinator) -> None:
    stub, _, _ = coordinator
    first = stub.Register(_worker(gpu_type="titan-v"), timeout=5).worker_id
    with pytest.raises(grpc.RpcError) as err:
        stub.Register(_worker(node="n1"), timeout=5)
    assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
    assert "127.0.0.1:6001" in err.value.details() and "n0" in err.value.details()
    # The same node and port can only be the same process restarted: it replaces the old entry.
    second = stub.Register(_worker(gpu_type="titan-v"), timeout=5).worker_id
    listed = stub.ListWorkers(wire_pb2.Empty(), timeout=5).workers
    assert [w.worker_id for w in listed] == [second] and second != first
    assert not stub.Heartbeat(coordinator_pb2.HeartbeatRequest(worker_id=first), timeout=5).known
    assert stub.Heartbeat(coordinator_pb2.HeartbeatRequest(worker_id=second), timeout=5).known


@pytest.mark.parametrize("flags", [["--heartbeat-interval", "nan"], ["--heartbeat-interval", "inf"],
                                   ["--heartbeat-interval", "0"], ["--heartbeat-interval", "0.005"],
                                   ["--claim-timeout", "nan"], ["--claim-timeout", "-1"]])
def test_a_coordinator_refuses_seconds_that_are_no_positive_number(flags: list[str],
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """nan passed `<= 0`: no worker was ever alive, or a claim waited for ever. An interval below
    the least that workers keep (0.05 s) found every worker silent."""
    from coordinator.config import parse_args

    with pytest.raises(SystemExit) as exit_:
        parse_args(flags)
    assert exit_.value.code == 2 and f"{flags[0]} must be a number of seconds" in capsys.readouterr().err


@pytest.mark.parametrize("module, variable, value", [("coordinator.config", "HETPIPE_HEARTBEAT_INTERVAL", "1s"),
                                                     ("coordinator.config", "HETPIPE_PORT", "ten"),
                                                     ("ps_server.config", "HETPIPE_CHECKPOINT_EVERY", "ten"),
                                                     ("stage_worker.config", "HETPIPE_HEALTH_PORT", "80.5")])
def test_a_service_names_an_environment_variable_that_does_not_parse(module: str, variable: str, value: str,
                                                                       monkeypatch: pytest.MonkeyPatch,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """int() of the variable ended the process in a ValueError traceback naming neither it nor its flag."""
    import importlib

    monkeypatch.setenv(variable, value)
    with pytest.raises(SystemExit) as exit_:
        importlib.import_module(module).parse_args([])
    assert exit_.value.code == 2 and f"${variable} is {value!r}" in capsys.readouterr().err


def test_submit_refuses_bad_job_json(coordinator) -> None:
    stub, _, _ = coordinator
    for text, needle in (("{", "not valid JSON"), ('{"model": {"name": "mlp"}, "parallel": {"nm": -1}}', "parallel.nm"),
                         # a baseline the coordinator would otherwise have run as HetPipe, shards and all
                         ('{"model": {"name": "mlp"}, "parallel": {"mode": "ddp", "virtual_workers": 2}}',
                          "parallel.mode: ddp is a baseline"),
                         # refused as it arrives, not as a job that fails once planned
                         ('{"model": {"name": "mlp"}, "train": {"checkpoint_every": 2}}',
                          "train.checkpoint_every: 2, but a job run by a coordinator it is submitted to cannot checkpoint")):
        with pytest.raises(grpc.RpcError) as err:
            stub.Submit(coordinator_pb2.SubmitRequest(job_json=text), timeout=5)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and needle in err.value.details()
    assert stub.GetJob(coordinator_pb2.JobRef(), timeout=5).state == State.NONE


def _start_job(make_job, tmp_path: Path, address: str, stub) -> LocalProcesses:
    job = make_job({
        "train": {"steps": 2000},
        "parallel": {"stages_per_vw": 2, "nm": 2},
        "cluster": {"nodes": [{"name": "n0", "gpus": [{"type": "t4", "count": 2}]}],
                    "emulate": {"forward_seconds": 0.01, "backward_seconds": 0.01}},
        "output": {"trace": False},
    })
    procs = LocalProcesses(tmp_path / "logs")
    for q in range(2):
        procs.spawn("stage_worker", f"stage {q} of vw 0", ["--coordinator", address, "--node", "n0"])
    procs.wait_ready()
    stub.Submit(coordinator_pb2.SubmitRequest(job_json=job.to_json()), timeout=5)
    deadline = time.monotonic() + 60
    while stub.GetJob(coordinator_pb2.JobRef(), timeout=5).state != State.RUNNING:
        assert time.monotonic() < deadline, "job never started"
        time.sleep(0.05)
    return procs


def test_frozen_worker_fails_the_job_after_its_missed_heartbeats(coordinator, make_job, tmp_path: Path) -> None:
    stub, _, address = coordinator
    procs = _start_job(make_job, tmp_path, address, stub)
    try:
        workers = stub.ListWorkers(wire_pb2.Empty(), timeout=5).workers
        address_of = {w.assigned: w.info.address for w in workers}
        victim = next(p for p in procs.processes if p.address == address_of["stage 1 of vw 0"])
        os.kill(victim.popen.pid, signal.SIGSTOP)  # alive but silent: only heartbeats can tell
        deadline = time.monotonic() + 60   # a hang's guard, not a speed bound: the reason shows the heartbeats
        while (job := stub.GetJob(coordinator_pb2.JobRef(), timeout=5)).state == State.RUNNING:
            assert time.monotonic() < deadline, "the job ran on with a frozen stage"
            time.sleep(0.05)
        os.kill(victim.popen.pid, signal.SIGCONT)
    finally:
        procs.stop_all()
    assert job.state == State.FAILED
    assert "stage 1 of vw 0" in job.reason and victim.address in job.reason, job.reason
    assert "not responding: no heartbeat for" in job.reason, job.reason
    cli = subprocess.run([sys.executable, "-m", "launch.cli", "status", "--coordinator", address],
                         capture_output=True, text=True, timeout=60)
    assert cli.returncode == 1 and "FAILED" in cli.stdout and "stage 1 of vw 0" in cli.stdout


def test_stop_ends_a_running_job_and_its_stages(coordinator, make_job, tmp_path: Path) -> None:
    stub, servicer, address = coordinator
    procs = _start_job(make_job, tmp_path, address, stub)
    try:
        # A launcher's own stop comes first: its reason, not the later request's, ends the job.
        servicer.runner.stop("the launcher failed")
        cli = subprocess.run([sys.executable, "-m", "launch.cli", "stop", "--coordinator", address],
                             capture_output=True, text=True, timeout=60)
        assert cli.returncode == 0, cli.stderr
        deadline = time.monotonic() + 15
        while (job := stub.GetJob(coordinator_pb2.JobRef(), timeout=5)).state == State.RUNNING:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert job.state == State.STOPPED and job.reason == "the launcher failed", job.reason
        for p in procs.processes:  # the coordinator told every stage to stop: they exit by themselves
            p.popen.wait(timeout=15)
    finally:
        procs.stop_all()


SLOW_NET = """
import os, time
import torch


def build(**kwargs):
    if os.environ.get("SLOW_BUILD"):   # a stage's build only, not the planner's
        time.sleep(3600)
    return torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))
"""


def test_stop_while_the_stages_load_ends_the_job_and_stops_them(coordinator, make_job, tmp_path: Path) -> None:
    """A stop while the stages load (a large model's build) ends the job thread within a poll and
    tells the stages to stop: it waited out train.setup_timeout_s (an hour here), the job shown
    STOPPED meanwhile, every next Submit refused and the stages holding their GPUs."""
    stub, servicer, address = coordinator
    (tmp_path / "slow_net.py").write_text(SLOW_NET)
    job = make_job({"model": {"name": None, "args": None, "factory": "slow_net:build"},
                    "train": {"setup_timeout_s": 3600}, "parallel": {"stages_per_vw": 1}, "output": {"trace": False}})
    procs = LocalProcesses(tmp_path / "logs", env={"SLOW_BUILD": "1"})
    try:
        procs.spawn("stage_worker", "stage 0 of vw 0", ["--coordinator", address, "--node", "n0"])
        procs.wait_ready()
        stub.Submit(coordinator_pb2.SubmitRequest(job_json=job.to_json()), timeout=5)
        (stage,) = procs.processes
        deadline = time.monotonic() + 60
        while "assigned layers" not in stage.log_path.read_text():
            assert time.monotonic() < deadline and stage.popen.poll() is None, stage.log_path.read_text()
            time.sleep(0.05)
        stub.StopJob(coordinator_pb2.JobRef(), timeout=5)
        servicer.runner.join(3600)   # the test's timeout, not this, bounds the wait
        assert stub.GetJob(coordinator_pb2.JobRef(), timeout=5).state == State.STOPPED
        stage.popen.wait(timeout=30)   # told to stop, it exits by itself
    finally:
        procs.stop_all()


def test_stop_of_a_job_that_has_ended_says_so_and_exits_0(coordinator, make_job) -> None:
    """Not a status table, as if the stop had done something: one line, how the job ended."""
    stub, servicer, address = coordinator
    job = make_job({"parallel": {"stages_per_vw": 1}, "output": {"trace": False}})
    job_id = stub.Submit(coordinator_pb2.SubmitRequest(job_json=job.to_json()), timeout=5).job_id
    stub.StopJob(coordinator_pb2.JobRef(job_id=job_id), timeout=5)  # waiting for workers: it ends STOPPED
    servicer.runner.join(10)
    with pytest.raises(grpc.RpcError) as err:   # not "handed out once it has ended": it has
        list(stub.Results(coordinator_pb2.JobRef(job_id=job_id), timeout=5))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert err.value.details() == "the job ended STOPPED before it was planned: it has no outputs", err.value.details()
    cli = subprocess.run([sys.executable, "-m", "launch.cli", "stop", "--coordinator", address],
                         capture_output=True, text=True, timeout=60)
    assert cli.returncode == 0, cli.stderr
    assert cli.stdout == f"job {job_id} already ended: stopped (stopped by request); nothing to stop\n", cli.stdout


def test_stop_of_a_coordinator_that_has_had_no_job_stops_nothing(coordinator) -> None:
    """`hetpipe stop --coordinator` before any job: it said `job: STOPPED (stopped by request)`, as if
    it had stopped one, and the coordinator's status said so from then on."""
    stub, servicer, address = coordinator
    cli = subprocess.run([sys.executable, "-m", "launch.cli", "stop", "--coordinator", address],
                         capture_output=True, text=True, timeout=60)
    assert cli.returncode == 0, cli.stderr
    assert cli.stdout == f"coordinator {address} has had no job; nothing to stop\n", cli.stdout
    assert stub.GetJob(coordinator_pb2.JobRef(), timeout=5).state == State.NONE


def test_stop_of_a_local_run_that_has_ended_says_so_and_exits_0(make_job, tmp_path: Path) -> None:
    """What a `hetpipe run` leaves once it has ended (status.json, no coordinator address): even a
    failed run's stop succeeds, as there is nothing to stop."""
    job = make_job({"output": {"trace": False}})
    out = Path(job.resolve(job.output.dir))
    out.mkdir()
    write_status(out, "FAILED", "stage 1 of vw 0 died")
    cli = subprocess.run([sys.executable, "-m", "launch.cli", "stop", "--job", str(tmp_path / "job.yaml")],
                         capture_output=True, text=True, timeout=60)
    assert cli.returncode == 0, cli.stderr
    assert cli.stdout == (f"job {tmp_path / 'job.yaml'} already ended: failed (stage 1 of vw 0 died); "
                          "nothing to stop\n"), cli.stdout


@pytest.mark.parametrize("text", ['{}', '{"state": "BOGUS"}', '{"state": "FAILED", "reason": 5}'])
def test_a_status_json_not_as_a_run_writes_it_is_no_ending(make_job, tmp_path: Path, text: str,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """status.json that write_status did not write (a state that is none, a reason that is no
    text): `hetpipe status/stop --job` read no ending from it, instead of a KeyError's traceback."""
    from launch import cli

    job = make_job({"output": {"trace": False}})
    out = Path(job.resolve(job.output.dir))
    out.mkdir()
    (out / "status.json").write_text(text)
    for argv in (["status", "--job", str(tmp_path / "job.yaml")], ["status", "--json", "--job", str(tmp_path / "job.yaml")],
                 ["stop", "--job", str(tmp_path / "job.yaml")]):
        assert cli.main(argv) == cli.EXIT_USAGE
        err = capsys.readouterr().err
        assert "no coordinator address" in err and "Traceback" not in err, err


def test_status_shows_no_loss_before_a_minibatch_of_the_run_has_finished(coordinator,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """The wire's loss 0.0 stands for none yet: `hetpipe status` says nothing of a loss then, not
    "loss 0.0000", and shows the loss once the job has trained."""
    from coordinator.driver import Progress
    from coordinator.state import JobState
    from launch import cli

    _, servicer, address = coordinator
    for state in (JobState.PENDING, JobState.PLANNED, JobState.RUNNING):
        servicer.runner.machine.to(state)
    servicer.runner._progress = Progress(0, 6400, None, 0.0)
    assert cli.main(["status", "--coordinator", address]) == 0
    assert "progress: 0/6400 samples, 0 samples/s\n" in capsys.readouterr().out
    servicer.runner._progress = Progress(640, 6400, 2.5, 100.0)
    assert cli.main(["status", "--coordinator", address]) == 0
    assert "progress: 640/6400 samples, loss 2.5000, 100 samples/s\n" in capsys.readouterr().out


def test_stop_before_any_job_then_a_new_job_starts(coordinator, make_job) -> None:
    stub, servicer, _ = coordinator
    assert stub.StopJob(coordinator_pb2.JobRef(), timeout=5).state == State.STOPPED
    job = make_job({"parallel": {"stages_per_vw": 1}, "output": {"trace": False}})
    assert stub.Submit(coordinator_pb2.SubmitRequest(job_json=job.to_json()), timeout=5).state in (
        State.PENDING, State.PLANNED)


def test_a_full_disk_on_the_coordinator_host_fails_the_job_naming_the_file(coordinator, make_job,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """An OSError out of the job thread (eval.jsonl appended to a full disk, a cut's manifest) read
    as a coordinator bug: a 'job crashed' traceback and 'coordinator error: OSError: ...'."""
    import errno

    def full(*args: object, **kwargs: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device", "/runs/out/eval.jsonl")

    stub, servicer, _ = coordinator
    stub.Register(_worker(), timeout=5)   # what the job waits for before it plans
    monkeypatch.setattr(servicer.runner.registry, "claim", full)   # the job thread's first step past its plan
    job = make_job({"parallel": {"stages_per_vw": 1}, "output": {"trace": False}})
    stub.Submit(coordinator_pb2.SubmitRequest(job_json=job.to_json()), timeout=5)
    deadline = time.monotonic() + 10
    while (status := stub.GetJob(coordinator_pb2.JobRef(), timeout=5)).state != State.FAILED:
        assert time.monotonic() < deadline, status
        time.sleep(0.05)
    host = socket.gethostname()   # a submitted job's files are this host's, not its client's
    assert status.reason == f"I/O error on the coordinator host {host}: /runs/out/eval.jsonl: No space left on device"


def test_stop_while_waiting_for_workers_stops_at_once(coordinator, make_job) -> None:
    """The job thread, waiting for workers that never come, ends within a poll, not at the claim
    timeout: an hour here, so only the stop can end it before the test's timeout (the next
    Submit is refused while it runs)."""
    stub, servicer, _ = coordinator
    servicer.runner.claim_timeout_s = 3600.0
    job = make_job({"parallel": {"stages_per_vw": 2}, "output": {"trace": False}})
    stub.Submit(coordinator_pb2.SubmitRequest(job_json=job.to_json()), timeout=5)
    deadline = time.monotonic() + 60   # a hang's guard, not a speed bound
    while "waiting up to 3600s" not in (view := stub.GetJob(coordinator_pb2.JobRef(), timeout=5)).waiting:
        assert time.monotonic() < deadline and view.state in (State.PENDING, State.PLANNED), view
        time.sleep(0.05)
    assert stub.StopJob(coordinator_pb2.JobRef(), timeout=5).state == State.STOPPED
    assert servicer.runner.machine.wait_terminal(5)
    deadline = time.monotonic() + 60   # a hang's guard, not a speed bound
    while True:
        try:
            stub.Submit(coordinator_pb2.SubmitRequest(job_json=job.to_json()), timeout=5)
            break
        except grpc.RpcError as exc:  # FAILED_PRECONDITION while the stopped job's thread winds down
            assert exc.code() == grpc.StatusCode.FAILED_PRECONDITION and time.monotonic() < deadline, exc.details()
            time.sleep(0.05)
    assert stub.GetJob(coordinator_pb2.JobRef(), timeout=5).state in (State.PENDING, State.PLANNED)


def test_a_job_id_names_the_job_a_call_is_about(coordinator, make_job, tmp_path: Path) -> None:
    """Stop, status and results name the job by the id Submit gave: a client whose job has
    ended never stops or fetches the job the coordinator runs next (`hetpipe stop --job` with a
    coordinator.address left by a run that was killed, or a slow Results after another Submit)."""
    stub, servicer, address = coordinator
    job = make_job({"parallel": {"stages_per_vw": 2}, "output": {"trace": False, "dir": str(tmp_path / "out")}})
    first = stub.Submit(coordinator_pb2.SubmitRequest(job_json=job.to_json()), timeout=5).job_id
    assert len(first) == 32 and stub.GetJob(coordinator_pb2.JobRef(job_id=first), timeout=5).job_id == first
    for method in (stub.GetJob, stub.StopJob, lambda ref, timeout: list(stub.Results(ref, timeout=timeout))):
        with pytest.raises(grpc.RpcError) as err:
            method(coordinator_pb2.JobRef(job_id="../" + "x" * 100), timeout=5)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "job_id '../xxx" in err.value.details()
    assert stub.GetJob(coordinator_pb2.JobRef(), timeout=5).state in (State.PENDING, State.PLANNED)
    assert stub.StopJob(coordinator_pb2.JobRef(job_id=first), timeout=5).state == State.STOPPED
    assert servicer.runner.machine.wait_terminal(5)
    deadline = time.monotonic() + 10
    while True:
        try:
            second = stub.Submit(coordinator_pb2.SubmitRequest(job_json=job.to_json()), timeout=5).job_id
            break
        except grpc.RpcError as exc:  # FAILED_PRECONDITION while the stopped job's thread winds down
            assert exc.code() == grpc.StatusCode.FAILED_PRECONDITION and time.monotonic() < deadline, exc.details()
            time.sleep(0.05)
    assert second != first
    stale = coordinator_pb2.JobRef(job_id=first)
    for method in (stub.GetJob, stub.StopJob, lambda ref, timeout: list(stub.Results(ref, timeout=timeout))):
        with pytest.raises(grpc.RpcError) as err:
            method(stale, timeout=5)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND, err.value.details()
        assert first in err.value.details() and second in err.value.details()
    # The files a killed `hetpipe run` would have left: the CLI names the ended job and stops
    # nothing, which is what a stop asks for (exit 0); status cannot say how it ended (exit 1).
    (tmp_path / "out").mkdir(exist_ok=True)
    (tmp_path / "out" / "coordinator.address").write_text(address + "\n")
    (tmp_path / "out" / "coordinator.job").write_text(first + "\n")
    ran = {command: subprocess.run([sys.executable, "-m", "launch.cli", command, "--job", str(tmp_path / "job.yaml")],
                                   capture_output=True, text=True, timeout=60) for command in ("stop", "status")}
    assert ran["stop"].returncode == 0, ran["stop"].stderr
    assert ran["stop"].stdout.startswith(f"job {first} of {tmp_path / 'job.yaml'} already ended; nothing to stop")
    assert second in ran["stop"].stdout, ran["stop"].stdout
    assert ran["status"].returncode == 1 and "has ended" in ran["status"].stderr, ran["status"].stderr
    assert second in ran["status"].stderr
    now = stub.GetJob(coordinator_pb2.JobRef(job_id=second), timeout=5)
    assert now.job_id == second and now.state in (State.PENDING, State.PLANNED)
    with pytest.raises(grpc.RpcError) as err:  # its own id: refused only until it has ended
        list(stub.Results(coordinator_pb2.JobRef(job_id=second), timeout=5))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION


def test_results_cut_by_their_deadline_resume_where_they_got_to(coordinator, make_job, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A model larger than one call's deadline can carry (a slow link) arrives byte for byte in
    several Results calls, each resuming at the point the last one reached; a resume point past
    the files is OUT_OF_RANGE, and a call that brings nothing fails without a partial file."""
    from launch import remote as client

    stub, servicer, _ = coordinator
    job = make_job({"parallel": {"stages_per_vw": 2}, "output": {"trace": False, "dir": str(tmp_path / "out")},
                    "cluster": {"nodes": [{"name": "n0", "gpus": [{"type": "t4", "count": 2}]}]}})
    job_id = stub.Submit(coordinator_pb2.SubmitRequest(job_json=job.to_json()), timeout=5).job_id
    stub.StopJob(coordinator_pb2.JobRef(job_id=job_id), timeout=5)  # waiting for workers: it ends STOPPED
    servicer.runner.join(10)
    assert servicer.runner.out_dir == tmp_path / "out"
    served = {"model.safetensors": os.urandom(6 << 20), "summary.json": b'{"steps": 3}'}
    (tmp_path / "out").mkdir()
    for name, data in served.items():
        (tmp_path / "out" / name).write_bytes(data)
    for skip_files, offset, why in ((3, 0, "there are 2 result files"), (2, 1, "there are 2 result files"),
                                    (0, (6 << 20) + 1, "model.safetensors has 6291456 bytes")):
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Results(coordinator_pb2.ResultsRequest(job_id=job_id, skip_files=skip_files, offset=offset),
                              timeout=5))
        assert err.value.code() == grpc.StatusCode.OUT_OF_RANGE and why in err.value.details(), err.value.details()
    tail = list(stub.Results(coordinator_pb2.ResultsRequest(job_id=job_id, skip_files=0, offset=(6 << 20) - 5),
                             timeout=5))
    assert [(c.path, c.offset, c.data, c.last) for c in tail][0] == (
        "model.safetensors", (6 << 20) - 5, served["model.safetensors"][-5:], True)

    calls = []

    def results(request: coordinator_pb2.ResultsRequest):
        calls.append((request.skip_files, request.offset))
        return stub.Results(request, timeout=2.0)

    add = client.ResultWriter.add
    monkeypatch.setattr(client.ResultWriter, "add", lambda self, chunk: (time.sleep(0.5), add(self, chunk)))
    got = client.receive(results, job_id, tmp_path / "client")
    assert sorted(got) == sorted(served) and len(calls) >= 2, calls
    assert calls[0] == (0, 0) and all(offset % (1 << 20) == 0 for _, offset in calls), calls
    assert {p.name: p.read_bytes() for p in (tmp_path / "client").iterdir()} == served
    # A retryable error that brought nothing: the error, not a loop. (Not a tiny deadline: the
    # first chunk may come within it, and then every call brings one.)
    with rpc.channel("127.0.0.1:1") as nowhere, pytest.raises(grpc.RpcError) as err:
        client.receive(lambda request: coordinator_pb2_grpc.CoordinatorStub(nowhere).Results(request, timeout=5),
                       job_id, tmp_path / "none")
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE and err.value.code() in rpc.RETRYABLE
    assert not (tmp_path / "none").exists() or not list((tmp_path / "none").iterdir())


def test_a_data_root_also_bounds_where_factories_import_from(make_job, tmp_path: Path) -> None:
    """With --data-root, a submitted job whose factories would be imported from a base_dir
    outside it (code from any folder of this host) is refused, and changes nothing."""
    root = tmp_path / "root"
    (root / "jobs").mkdir(parents=True)
    server, servicer = build("127.0.0.1", 0, heartbeat_interval_s=INTERVAL, data_root=str(root))
    server.start()
    try:
        with rpc.channel(server.address) as channel:
            stub = coordinator_pb2_grpc.CoordinatorStub(channel)
            job = make_job({"model": {"name": None, "args": {}, "factory": "evil:build"}, "parallel": {"stages_per_vw": 2},
                            "cluster": {"nodes": [{"name": "n0", "gpus": [{"type": "t4", "count": 2}]}]}})
            for base_dir in (str(tmp_path), str(root / "jobs" / ".." / "..")):
                text = job.to_json().replace(json.dumps(job.base_dir), json.dumps(base_dir))
                with pytest.raises(grpc.RpcError) as err:
                    stub.Submit(coordinator_pb2.SubmitRequest(job_json=text), timeout=5)
                assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED, err.value.details()
                assert "base_dir" in err.value.details() and "model.factory" in err.value.details()
                assert stub.GetJob(coordinator_pb2.JobRef(), timeout=5).state == State.NONE
            inside = job.to_json().replace(json.dumps(job.base_dir), json.dumps(str(root / "jobs")))
            # Inside the root, only a module of the job's own folder: not the standard library's,
            # an installed one, or a file of the folder named like one every process has already.
            (root / "jobs" / "os.py").write_text("def system(command):\n    return 0\n")
            for spec in ("os:system", "torch:load", "torch.hub:load_state_dict_from_url", "evil:build"):
                text = inside.replace('"evil:build"', json.dumps(spec))
                with pytest.raises(grpc.RpcError) as err:
                    stub.Submit(coordinator_pb2.SubmitRequest(job_json=text), timeout=5)
                assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED, err.value.details()
                assert "must be a module of the job's own folder" in err.value.details(), err.value.details()
                assert stub.GetJob(coordinator_pb2.JobRef(), timeout=5).state == State.NONE
            (root / "jobs" / "loop").symlink_to(root / "jobs" / "loop")   # its resolve() raises on 3.11
            looped = json.loads(inside)
            looped["model"]["init"] = "loop"
            with pytest.raises(grpc.RpcError) as err:
                stub.Submit(coordinator_pb2.SubmitRequest(job_json=json.dumps(looped)), timeout=5)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "model.init 'loop'" in err.value.details()
            (root / "jobs" / "evil.py").write_text("def build():\n    raise RuntimeError('not run here')\n")
            assert stub.Submit(coordinator_pb2.SubmitRequest(job_json=inside), timeout=5).job_id
    finally:
        servicer.runner.stop()
        server.stop()


def test_run_on_a_coordinator_blames_the_token_only_for_a_token_refusal(make_job, tmp_path: Path) -> None:
    """`hetpipe run --coordinator`: a refusal of the job's files (outside --data-root) comes as the
    coordinator said it, without advice to set a token, which would not help; a refused token
    still gets that advice."""
    from launch.remote import run_remote

    root, secret, other = tmp_path / "root", tmp_path / "token", tmp_path / "other"
    root.mkdir()
    security.write_secret(secret, security.new_secret())
    security.write_secret(other, security.new_secret())
    with security.using(security.Security(token_file=str(secret)), security.COORDINATOR, "test"):
        server, servicer = build("127.0.0.1", 0, heartbeat_interval_s=INTERVAL, data_root=str(root))
    server.start()
    try:  # its factory would be imported from tmp_path, outside the data root
        job = make_job({"model": {"name": None, "args": {}, "factory": "evil:build"}, "parallel": {"stages_per_vw": 2},
                        "cluster": {"nodes": [{"name": "n0", "gpus": [{"type": "t4", "count": 2}]}]}})
        with pytest.raises(ConfigError) as err:
            run_remote(job, server.address, quiet=True, flags=security.Security(token_file=str(secret)))
        assert "--data-root" in str(err.value) and "HETPIPE_TOKEN_FILE" not in str(err.value), err.value
        with pytest.raises(ConfigError) as err:
            run_remote(job, server.address, quiet=True, flags=security.Security(token_file=str(other)))
        assert "an invalid token" in str(err.value) and "HETPIPE_TOKEN_FILE" in str(err.value), err.value
    finally:
        servicer.runner.stop()
        server.stop()

"""Workers that join from any host, on loopback: `hetpipe coordinator`, two `hetpipe worker` hosts
and `hetpipe run JOB --coordinator`, each a real process started as a user types it. The outputs
land in the client's output.dir and equal the reference (O2); a file missing where the workers
run, and a worker host that dies, fail the job naming the host."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
import yaml

from conftest import BASE_JOB, deep_update, with_signals
from hetpipe import outputs, rpc, security, weight_files
from hetpipe.config import load_job
from hetpipe.reference import initial_model, train_reference
from hetpipe.v1 import coordinator_pb2, wire_pb2
from coordinator.checkpoints import latest
from launch import certs

pytestmark = pytest.mark.timeout(150)
HETPIPE = [sys.executable, "-m", "launch.cli"]
REPO = Path(__file__).resolve().parents[2]
State = coordinator_pb2.JobStatus.State


@dataclass
class Cluster:
    """A coordinator and worker hosts, each `hetpipe ...` in a session of its own."""

    tmp: Path
    address: str
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def start(self, name: str, *args: str, sigint: Any = signal.SIG_DFL, wrap: tuple[str, ...] = ()) -> None:
        """`hetpipe ARGS` as host `name`; sigint: its SIGINT disposition, as a terminal's command
        has it (a test runner started in the background hands its children SIGINT ignored);
        wrap: a command in front of it."""
        (self.tmp / name).mkdir(exist_ok=True)
        with open(self.tmp / f"{name}.log", "wb") as log:
            signals = with_signals(default=("HUP",), ignore=("INT",)) if sigint == signal.SIG_IGN else with_signals()
            self.procs[name] = subprocess.Popen([*signals, *wrap, *HETPIPE, *args], cwd=self.tmp / name,
                                                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                                start_new_session=True, env={**os.environ, "PYTHONPATH": str(REPO)})

    def start_coordinator(self) -> None:
        self.start("coordinator", "coordinator", "--port", self.address.rsplit(":", 1)[1], "--heartbeat-interval",
                   "0.5", "--output-root", str(self.tmp / "coordinator" / "runs"), "--data-root", str(self.tmp))

    def log(self, name: str) -> str:
        return (self.tmp / f"{name}.log").read_text(errors="replace")

    def workers(self) -> list[coordinator_pb2.WorkerList.Entry]:
        with rpc.channel(self.address) as channel:
            return list(rpc.Stub(channel, "Coordinator").ListWorkers(wire_pb2.Empty(), timeout=5).workers)

    def registered(self) -> list[coordinator_pb2.WorkerList.Entry]:
        """workers(), or none while the coordinator is still starting."""
        try:
            return self.workers()
        except grpc.RpcError:
            return []

    def job(self) -> coordinator_pb2.JobStatus:
        with rpc.channel(self.address) as channel:
            status: coordinator_pb2.JobStatus = rpc.Stub(channel, "Coordinator").GetJob(coordinator_pb2.JobRef(), timeout=5)
            return status

    def kill(self, name: str) -> None:
        """The host's processes, all of them at once (its session), as a host that dies."""
        proc = self.procs[name]
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        for proc in self.procs.values():
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for proc in self.procs.values():  # whatever is left of each session, the workers included
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(10)


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    """hosta: an emulated T4 and the parameter-server shard; hostb: an emulated T4."""
    with socket.socket() as s:  # a port known up front: the three start at once
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    c = Cluster(tmp_path, f"127.0.0.1:{port}")
    try:
        c.start_coordinator()
        c.start("hosta", "worker", "--coordinator", c.address, "--emulate", "t4", "--shards", "1", "--node", "hosta")
        c.start("hostb", "worker", "--coordinator", c.address, "--emulate", "t4", "--node", "hostb")
        deadline = time.monotonic() + 60
        while len([w for w in c.registered() if w.alive]) < 3:
            for name, proc in c.procs.items():
                assert proc.poll() is None, c.log(name)
            assert time.monotonic() < deadline, f"workers did not register: {c.registered()}"
            time.sleep(0.1)
        yield c
    finally:
        c.stop()


def _job_file(tmp_path: Path, name: str, overrides: dict[str, Any]) -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(deep_update(BASE_JOB, overrides)))
    return path


def _run(job: Path, address: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*HETPIPE, "run", "-q", str(job), "--coordinator", address], cwd=job.parent,
                          capture_output=True, text=True, timeout=90)


def test_a_job_runs_on_the_registered_hosts_and_its_outputs_come_back(cluster: Cluster, tmp_path: Path) -> None:
    job_file = _job_file(tmp_path, "job.yaml", {
        "data": {"eval_fraction": 0.2}, "eval": {"every": 0},
        "train": {"dtype": "float64", "optimizer": {"name": "sgd", "lr": 0.02}, "steps": 20},
        "parallel": {"virtual_workers": 2, "stages_per_vw": 1, "nm": 1, "D": 0},  # no cluster: the registered one
    })
    run = _run(job_file, cluster.address)
    assert run.returncode == 0, run.stderr + cluster.log("coordinator")
    assert "cluster.emulate time_scale 1" in run.stderr, run.stderr

    out = tmp_path / "out"  # the client's output.dir
    # No coordinator.address: the coordinator may run someone else's job next, which
    # `hetpipe stop --job` with this file must not stop.
    assert sorted(p.name for p in out.iterdir()) == ["eval.jsonl", "model.safetensors", "status.json", "summary.json"]
    assert json.loads((out / "status.json").read_text())["state"] == "COMPLETED"
    summary = json.loads((out / "summary.json").read_text())
    printed = json.loads(run.stdout.splitlines()[0])
    assert printed["steps"] == 20 and all(summary[k] == v for k, v in printed.items())
    assert summary["virtual_workers"] == 2 and summary["ps_shards"] == 1 and summary["emulated"]
    assert sorted(s["node"] for s in summary["plan"]) == ["hosta", "hostb"]
    assert [json.loads(line)["final"] for line in (out / "eval.jsonl").read_text().splitlines()] == [True]
    # O2 across the hosts: the final w_global equals synchronous DP with the 2 updates summed.
    job = load_job(job_file)
    got, want, w0 = weight_files.read_weights(out), train_reference(job).state_dict(), initial_model(job).state_dict()
    assert list(got) == list(want)
    for key in want:
        # On a failure, how far and every process's log: a run that differs is the evidence.
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=1e-9, msg=lambda found, key=key: (
            f"{key} differs: {found}\n" + "\n".join(f"--- {name}\n{cluster.log(name)[-4000:]}"
                                                      for name in sorted(cluster.procs))))
    assert max(float((want[k] - w0[k]).abs().max()) for k in want) > 1e-3
    # Written where it ran too; the traces stay on the hosts that wrote them.
    assert (tmp_path / "coordinator" / "runs" / "out" / "model.safetensors").exists()
    lines = {host: [len(p.read_text().splitlines()) for p in (tmp_path / host / "runs" / "trace").glob("vw*.jsonl")]
             for host in ("hosta", "hostb")}
    assert lines == {"hosta": [20], "hostb": [20]}, lines

    # The same hosts take the next job (fresh processes); a file the workers lack is named with the host.
    missing = _job_file(tmp_path, "missing.yaml", {"model": {"init": "no-such-init.pt"}, "output": {"dir": "out2"},
                                                   "parallel": {"virtual_workers": 2, "stages_per_vw": 1}})
    run = _run(missing, cluster.address)
    assert run.returncode == 1, run.stderr
    assert f"model.init: {tmp_path / 'no-such-init.pt'} does not exist" in run.stderr, run.stderr
    assert re.search(r"stage 0 of vw \d: .*model\.init: .* does not exist \(at 127\.0\.0\.1:\d+ on node host[ab]\)",
                     run.stderr), run.stderr
    assert "model.init" in run.stderr.splitlines()[0], "the client says first where the files are read"
    assert json.loads((tmp_path / "out2" / "status.json").read_text())["state"] == "FAILED"

    # A file outside the coordinator's --data-root is refused at Submit, before anything reads it.
    outside = load_job(_job_file(tmp_path, "outside.yaml", {"model": {"init": "/etc/hostname"}}))
    with rpc.channel(cluster.address) as ch:
        before = rpc.Stub(ch, "Coordinator").GetJob(coordinator_pb2.JobRef(), timeout=10)
        with pytest.raises(grpc.RpcError) as err:
            rpc.Stub(ch, "Coordinator").Submit(coordinator_pb2.SubmitRequest(job_json=outside.to_json()), timeout=10)
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED and "--data-root" in err.value.details()
        assert rpc.Stub(ch, "Coordinator").GetJob(coordinator_pb2.JobRef(), timeout=10) == before


@contextlib.contextmanager
def _long_job(cluster: Cluster, tmp_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    """`hetpipe run --coordinator` of a job far too long to end by itself, once it has trained a
    few minibatches on both hosts; its stderr goes to tmp_path/client.err. Killed if left running."""
    job_file = _job_file(tmp_path, "long.yaml", {
        "cluster": {"nodes": [{"name": "hosta", "gpus": [{"type": "t4"}]}, {"name": "hostb", "gpus": [{"type": "t4"}]}],
                    "emulate": {"forward_seconds": 0.01, "backward_seconds": 0.02}},
        "train": {"steps": 20000}, "parallel": {"virtual_workers": 2, "stages_per_vw": 1, "nm": 1},
        "output": {"trace": False},
    })
    with open(tmp_path / "client.err", "wb") as err_file:
        client = subprocess.Popen([*HETPIPE, "run", "-q", str(job_file), "--coordinator", cluster.address],
                                  cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=err_file, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while (status := cluster.job()).state != State.RUNNING or status.samples < 5 * 16:
            assert client.poll() is None and time.monotonic() < deadline, (tmp_path / "client.err").read_text()
            time.sleep(0.1)
        yield client
    finally:
        if client.poll() is None:
            os.killpg(client.pid, signal.SIGKILL)
            client.wait()


def test_a_worker_host_that_dies_fails_the_job_fast_naming_it(cluster: Cluster, tmp_path: Path) -> None:
    with _long_job(cluster, tmp_path) as client:
        (victim,) = [w.info.address for w in cluster.workers()
                     if w.info.node == "hostb" and w.info.role == coordinator_pb2.WorkerInfo.STAGE_WORKER]
        cluster.kill("hostb")
        code = client.wait(60)   # a hang's guard, not a speed bound
    err = (tmp_path / "client.err").read_text()
    assert code == 1, (code, err)
    # Fast is which check saw it: the coordinator's next Status poll, refused by the dead host,
    # not the heartbeats that stopped ("not responding", after several intervals).
    assert re.search(rf"stage 0 of vw \d at {re.escape(victim)} on node hostb: Status failed", err), err
    assert "forwards and" in err and "Traceback" not in err, err
    assert cluster.procs["hosta"].poll() is None, "the other host serves on"


def test_a_worker_host_stopped_by_its_operator_fails_the_job_saying_so(cluster: Cluster, tmp_path: Path) -> None:
    """Ctrl-C at hostb's `hetpipe worker` (SIGINT to its terminal's process group): its stage tells
    the coordinator before it stops serving, and the job fails naming that, not the calls that
    then failed to reach it (a bare CANCELLED or UNAVAILABLE)."""
    with _long_job(cluster, tmp_path) as client:
        os.killpg(cluster.procs["hostb"].pid, signal.SIGINT)
        code = client.wait(30)
    err = (tmp_path / "client.err").read_text()
    assert code == 1, err
    assert re.search(r"hetpipe: job failed: stage 0 of vw \d \(pid \d+ at [\d.:]+ on hostb\) stopped by SIGINT on its "
                     r"host; it had finished \d+ forwards and", err), err
    assert cluster.procs["hostb"].wait(10) == 130, cluster.log("hostb")
    assert "hetpipe worker: interrupted; stopped every process" in cluster.log("hostb")


def test_a_worker_host_that_ignores_ctrl_c_keeps_its_stages_serving(cluster: Cluster, tmp_path: Path) -> None:
    """A `hetpipe worker` that a script started in the background ignores SIGINT, and so do the
    processes it starts (they come from a fork server that ignores it whatever the launcher does:
    the launcher tells them). A Ctrl-C at that terminal stops nothing: the job trains on."""
    gone = {w.info.address for w in cluster.registered() if w.info.node == "hostb"}
    cluster.kill("hostb")
    cluster.start("hostb", "worker", "--coordinator", cluster.address, "--emulate", "t4", "--node", "hostb",
                  sigint=signal.SIG_IGN)
    deadline = time.monotonic() + 60
    while len(alive := [w for w in cluster.registered() if w.alive]) < 3 or gone & {w.info.address for w in alive}:
        assert time.monotonic() < deadline, cluster.log("hostb")
        time.sleep(0.1)
    with _long_job(cluster, tmp_path) as client:
        os.killpg(cluster.procs["hostb"].pid, signal.SIGINT)
        # Trained on after it: more waves than hosta's VW can train alone (with D 0 it gets no
        # more than two minibatches ahead of hostb's), so hostb's stage served them. A deadline
        # against a hang only, not a speed bound.
        want = cluster.job().samples + 8 * 2 * 16   # eight waves of both VWs, 16 samples a minibatch
        deadline = time.monotonic() + 60
        while (status := cluster.job()).samples < want:
            assert status.state == State.RUNNING and time.monotonic() < deadline, (
                status, (tmp_path / "client.err").read_text())
            time.sleep(0.1)
        assert cluster.job().state == State.RUNNING, (tmp_path / "client.err").read_text()
        assert client.poll() is None and cluster.procs["hostb"].poll() is None, cluster.log("hostb")
    (stage_log,) = (tmp_path / "hostb" / "runs" / "logs" / "hostb").glob("stage_worker_*.log")
    assert "signal 2" not in stage_log.read_text()


def test_a_restarted_coordinator_gets_fresh_workers_for_its_next_job(cluster: Cluster, tmp_path: Path) -> None:
    # The coordinator dies mid-job, and with it the job: its driver, its state. The stages and
    # the shard that served it must not train on for nobody, nor be claimed again holding it
    # (a stage refused Assign "already assigned"; a shard took Init over its old clocks).
    with _long_job(cluster, tmp_path) as client:
        served = {(w.info.address, w.info.name) for w in cluster.workers()}
        cluster.kill("coordinator")
        cluster.start_coordinator()
        assert client.wait(60) == 1, "the client of a job that the coordinator lost fails"
    deadline = time.monotonic() + 60
    while len([w for w in cluster.registered() if w.alive and (w.info.address, w.info.name) not in served]) < 3:
        for name in ("hosta", "hostb"):
            assert cluster.procs[name].poll() is None, cluster.log(name)
        assert time.monotonic() < deadline, f"no fresh workers: {cluster.registered()}"
        time.sleep(0.1)
    assert all((w.info.address, w.info.name) not in served for w in cluster.registered()), cluster.registered()
    job_file = _job_file(tmp_path, "job.yaml", {
        "train": {"dtype": "float64", "optimizer": {"name": "sgd", "lr": 0.02}, "steps": 20},
        "parallel": {"virtual_workers": 2, "stages_per_vw": 1, "nm": 1, "D": 0},
    })
    run = _run(job_file, cluster.address)
    assert run.returncode == 0, run.stderr + cluster.log("coordinator")
    job = load_job(job_file)   # O2: the shard started from this job's w0 at clock 0
    got, want = weight_files.read_weights(tmp_path / "out"), train_reference(job).state_dict()
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=1e-9)


def test_a_restarted_coordinator_goes_on_with_its_job_from_the_last_checkpoint(tmp_path: Path) -> None:
    """compose's and k8s's coordinator runs its --job; restarted mid-job (their restart policy),
    it goes on from the job's latest checkpoint, as `hetpipe run --resume` does. The workers that
    served the lost job leave and come back fresh; the shard takes the cut's values, each stage its
    own state (SGD's momentum too); the final model is the reference's (O1: 1 VW, float64)."""
    shared = tmp_path / "runs"   # where every process writes, as compose's volume `runs`
    steps = 96
    job_file = _job_file(tmp_path, "job.yaml", {
        "cluster": {"nodes": [{"name": "hosta", "gpus": [{"type": "t4"}]}, {"name": "hostb", "gpus": [{"type": "t4"}]}],
                    "emulate": {"forward_seconds": 0.005, "backward_seconds": 0.005}},
        "train": {"dtype": "float64", "optimizer": {"name": "sgd", "lr": 0.02, "momentum": 0.5}, "steps": steps,
                  "checkpoint_every": 8},
        "parallel": {"virtual_workers": 1, "stages_per_vw": 2, "nm": 1, "D": 0},
        "output": {"trace": False},
    })
    out = shared / "job"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    c = Cluster(tmp_path, f"127.0.0.1:{port}")
    coordinator = ["coordinator", "--port", str(port), "--heartbeat-interval", "0.5", "--job", str(job_file),
                   "--output-dir", str(out)]
    try:
        c.start("coordinator", *coordinator)
        for host, shards in (("hosta", "1"), ("hostb", "0")):
            c.start(host, "worker", "--coordinator", c.address, "--emulate", "t4", "--node", host, "--shards", shards,
                    "--output-root", str(shared))
        deadline = time.monotonic() + 90
        while (cut := latest(out / outputs.CHECKPOINTS)) is None:
            assert c.procs["coordinator"].poll() is None and time.monotonic() < deadline, c.log("coordinator")
            time.sleep(0.05)
        c.kill("coordinator")
        assert outputs.read_summary(out) is None, "the job ended before the coordinator was killed"
        c.start("restarted", *coordinator)
        deadline = time.monotonic() + 90
        while (summary := outputs.read_summary(out)) is None:
            assert c.procs["restarted"].poll() is None and time.monotonic() < deadline, c.log("restarted")
            time.sleep(0.1)
        wave = int(re.search(r"resuming from the checkpoint of wave (\d+)", c.log("restarted"))[1])  # type: ignore[index]
        assert cut <= wave < steps and summary["resumed_from_wave"] == wave, (cut, summary)
        assert not list((out / outputs.CHECKPOINTS).glob("shared_*")), "the stages' marks outlived the start's check"
        got, want = weight_files.read_weights(out), train_reference(load_job(job_file)).state_dict()
        for key in want:
            torch.testing.assert_close(got[key], want[key], rtol=0, atol=1e-9)
    finally:
        c.stop()


def _own_mounts() -> str:
    """Why a process cannot be given a folder of its own here (a mount namespace), or ''."""
    if os.geteuid() != 0:
        return "needs root for a mount namespace"
    probe = subprocess.run(["unshare", "--mount", "--propagation", "private", "true"], capture_output=True)
    return "" if probe.returncode == 0 else f"unshare --mount: {probe.stderr.decode(errors='replace').strip()}"


def test_a_stage_whose_host_does_not_share_the_checkpoints_folder_fails_the_job_at_its_start(tmp_path: Path) -> None:
    """hostb's worker sees a folder of its own where the others see the shared one (a tmpfs in its
    own mount namespace, as a host without compose's volume): its stage would save its part of each
    cut where the coordinator never sees it. The job fails as it starts, naming that stage and
    host, not at the first cut."""
    if why := _own_mounts():
        pytest.skip(why)
    shared = tmp_path / "runs"
    shared.mkdir()
    job_file = _job_file(tmp_path, "job.yaml", {
        "cluster": {"nodes": [{"name": "hosta", "gpus": [{"type": "t4"}]}, {"name": "hostb", "gpus": [{"type": "t4"}]}],
                    "emulate": {}},
        "train": {"steps": 400, "checkpoint_every": 100},
        "parallel": {"virtual_workers": 1, "stages_per_vw": 2, "nm": 1, "D": 0},
    })
    out = shared / "job"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    c = Cluster(tmp_path, f"127.0.0.1:{port}")
    own_folder = ("unshare", "--mount", "--propagation", "private", "sh", "-c",
                  'mount -t tmpfs hostb "$0" && exec "$@"', str(shared))
    try:
        c.start("coordinator", "coordinator", "--port", str(port), "--heartbeat-interval", "0.5", "--job",
                str(job_file), "--output-dir", str(out))
        c.start("hosta", "worker", "--coordinator", c.address, "--emulate", "t4", "--node", "hosta", "--shards", "1",
                "--output-root", str(shared))
        c.start("hostb", "worker", "--coordinator", c.address, "--emulate", "t4", "--node", "hostb",
                "--output-root", str(shared), wrap=own_folder)
        deadline = time.monotonic() + 90
        while True:
            with contextlib.suppress(grpc.RpcError):   # the coordinator still starting
                if (job := c.job()).state in (State.FAILED, State.COMPLETED):
                    break
            for name, proc in c.procs.items():
                assert proc.poll() is None, c.log(name)
            assert time.monotonic() < deadline, c.log("coordinator")
            time.sleep(0.1)
        assert job.state == State.FAILED and job.samples == 0, job
        assert re.fullmatch(rf"train.checkpoint_every 100: the checkpoints folder {re.escape(str(out))}/checkpoints on "
                            r"this coordinator's host is not shared with stage 1 of vw 0 at 127.0.0.1:\d+ on node "
                            r"hostb, whose part of each cut .*", job.reason), job.reason
        assert f"job FAILED: {job.reason}" in c.log("coordinator"), "a --job coordinator's log says how it ended"
        assert latest(out / outputs.CHECKPOINTS) is None
    finally:
        c.stop()


@contextlib.contextmanager
def _coordinator(tmp_path: Path, *flags: str) -> Iterator[Cluster]:
    """A cluster of a coordinator alone, with these security flags."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    c = Cluster(tmp_path, f"127.0.0.1:{port}")
    try:
        c.start("coordinator", "coordinator", "--port", str(port), *flags,
                "--output-root", str(tmp_path / "coordinator" / "runs"))
        deadline = time.monotonic() + 60
        while True:   # listening (TLS or not: a TCP connection is enough to know)
            assert c.procs["coordinator"].poll() is None and time.monotonic() < deadline, c.log("coordinator")
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
                break
            time.sleep(0.1)
        yield c
    finally:
        c.stop()


def test_a_worker_with_another_token_than_the_coordinators_exits_naming_it(tmp_path: Path) -> None:
    """A refused token is no outage: `hetpipe worker` ends (exit 1) saying so, instead of waiting
    for the coordinator to answer forever."""
    for name in ("good", "bad"):
        security.write_secret(tmp_path / name, security.new_secret())
    with _coordinator(tmp_path, "--token-file", str(tmp_path / "good")) as c:
        c.start("hostb", "worker", "--coordinator", c.address, "--emulate", "t4", "--node", "hostb",
                "--token-file", str(tmp_path / "bad"))
        assert c.procs["hostb"].wait(60) == 1, c.log("hostb")
        # Said by the launcher's own call to the coordinator, or by its stage's refused
        # registration, whichever comes first: each names the refusal and the way out.
        assert re.search(rf"hetpipe worker: error: .*coordinator {re.escape(c.address)} refused this (worker's "
                         r"credentials \(|process: )UNAUTHENTICATED: .*an invalid token.*give every worker the "
                         "coordinator's --token-file", c.log("hostb")), c.log("hostb")


def test_a_worker_whose_tls_the_coordinator_does_not_share_exits_naming_it(tmp_path: Path) -> None:
    """A TLS handshake that fails is no outage either, though gRPC reports it as one (UNAVAILABLE):
    a worker with certificates from another CA exits 1 naming the TLS flags. One without TLS at
    all is told that the coordinator may use it."""
    certs.make(tmp_path / "ours", ["localhost"])
    certs.make(tmp_path / "other", ["localhost"])

    def tls(d: str) -> list[str]:
        return security.child_args(security.Security(
            cert=str(tmp_path / d / "localhost.pem"), key=str(tmp_path / d / "localhost.key"),
            ca=str(tmp_path / d / "ca.pem"), token_file=str(tmp_path / "ours" / "token")))

    with _coordinator(tmp_path, *tls("ours")) as c:
        c.start("hostb", "worker", "--coordinator", c.address, "--emulate", "t4", "--node", "hostb", *tls("other"))
        c.start("hostc", "worker", "--coordinator", c.address, "--emulate", "t4", "--node", "hostc",
                "--token-file", str(tmp_path / "ours" / "token"))
        assert c.procs["hostb"].wait(60) == 1, c.log("hostb")
        assert re.search(rf"hetpipe worker: error: coordinator {re.escape(c.address)} unreachable: UNAVAILABLE: the "
                         r"TLS handshake failed: both ends need certificates from the same CA "
                         r"\(--tls-cert/--tls-key/--tls-ca\), or neither uses TLS \(.*Tls handshake failed",
                         c.log("hostb")), c.log("hostb")
        deadline = time.monotonic() + 60
        while "does it use TLS" not in c.log("hostc") and time.monotonic() < deadline:
            time.sleep(0.5)
        assert f"hetpipe worker: coordinator {c.address} unreachable: UNAVAILABLE: it closed the connection at " \
               "once: does it use TLS (--tls-cert/--tls-key/--tls-ca), which this process does not?; the workers " \
               "keep trying to register" in c.log("hostc"), c.log("hostc")
        assert c.procs["hostc"].poll() is None   # it may be the coordinator that is wrong: it keeps trying


def test_a_job_short_of_workers_says_which_it_waits_for_then_fails_naming_them(tmp_path: Path) -> None:
    """The plan names hostb, whose worker never came: `hetpipe run --coordinator` says what the job
    waits for while it waits (not only its plan), and the claim timeout's failure names it too."""
    with _coordinator(tmp_path, "--claim-timeout", "6", "--heartbeat-interval", "0.5",
                      "--data-root", str(tmp_path)) as c:
        c.start("hosta", "worker", "--coordinator", c.address, "--emulate", "t4", "--shards", "1", "--node", "hosta")
        job_file = _job_file(tmp_path, "job.yaml", {
            "cluster": {"nodes": [{"name": "hosta", "gpus": [{"type": "t4"}]},
                                  {"name": "hostb", "gpus": [{"type": "t4"}]}]},
            "parallel": {"virtual_workers": 2, "stages_per_vw": 1, "nm": 1}, "output": {"trace": False},
        })
        run = subprocess.run([*HETPIPE, "run", str(job_file), "--coordinator", c.address], cwd=tmp_path,
                             capture_output=True, text=True, timeout=90)
    lacking = "stage_workers needed: 1 x t4 on hosta, 1 x t4 on hostb; free and alive: "
    assert run.returncode == 1, run.stderr
    assert re.search(rf"hetpipe: waiting for workers: {lacking}(1 x t4 on hosta|none) \(waiting up to 6s\)",
                     run.stderr), run.stderr
    assert f"hetpipe: job failed: after 6s, {lacking}1 x t4 on hosta" in run.stderr, run.stderr

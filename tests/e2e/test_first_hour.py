"""What a new user meets in the first hour: stopping a job that has not started (its coordinator up,
or not yet), asking for the status of a run that has ended, the version, and output piped into a
command that stops reading."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path

import pytest
import yaml

from conftest import BASE_JOB, deep_update, with_signals
from launch import cli, run_marker
from launch.processes import RunDir

pytestmark = pytest.mark.timeout(120)
HETPIPE = [sys.executable, "-m", "launch.cli"]


def _job_file(tmp_path: Path, **overrides: object) -> Path:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(deep_update(BASE_JOB, {"output": {"trace": False}, **overrides})))
    return path


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*HETPIPE, *args], capture_output=True, text=True, timeout=60)


def _until_published(tmp_path: Path, run: subprocess.Popen[str]) -> None:
    """Waits until the run has written its coordinator's address into tmp_path/out."""
    deadline = time.monotonic() + 30
    while not (tmp_path / "out" / "coordinator.address").exists():
        assert time.monotonic() < deadline and run.poll() is None, "hetpipe run never wrote its address"
        time.sleep(0.01)


def test_stop_during_the_first_seconds_stops_the_job(tmp_path: Path) -> None:
    job = _job_file(tmp_path, train={"steps": 5000})
    run = subprocess.Popen([*HETPIPE, "run", "-q", str(job)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True)
    try:
        _until_published(tmp_path, run)   # the job exists from here on, before any worker has started
        stop = _cli("stop", "--job", str(job))
        assert stop.returncode == 0, stop.stderr
        assert stop.stdout == "job: STOPPED (stopped by request)\n", "it says what it did, once it is done"
        out, err = run.communicate(timeout=60)
    finally:
        if run.poll() is None:
            run.kill()
    assert run.returncode == 1, (out, err)
    # What it trained is lost, and it says so: the next run starts over.
    assert "hetpipe: job stopped: stopped by request\nhetpipe: it left no checkpoint to go on from " \
           "(train.checkpoint_every is 0)\n" in err, err
    assert not (tmp_path / "out" / "summary.json").exists()
    status = _cli("status", "--job", str(job))
    assert status.returncode == 0 and status.stdout.startswith("job: STOPPED"), status


HELD_NET = """
import time
from pathlib import Path

import torch


def build(width):
    here = Path(__file__).parent
    if not (here / "planned").exists():   # the first build, the launcher's: it plans with it first
        (here / "planned").touch()
        deadline = time.monotonic() + 60
        while not (here / "go").exists() and time.monotonic() < deadline:   # until the test lets it go on
            time.sleep(0.01)
    return torch.nn.Sequential(torch.nn.Linear(64, width), torch.nn.ReLU(), torch.nn.Linear(width, 10))
"""


def test_stop_before_the_coordinator_is_up_waits_for_it_and_stops_the_job(tmp_path: Path) -> None:
    """The run plans (here held in the model's factory until the test says go) before it starts
    its coordinator and publishes its address: `hetpipe stop --job` then finds the run starting,
    waits, and stops it. The address and status a killed earlier run left there do not count."""
    (tmp_path / "held_net.py").write_text(HELD_NET)
    job = _job_file(tmp_path, train={"steps": 5000}, parallel={"stages_per_vw": 1})
    raw = yaml.safe_load(job.read_text())
    job.write_text(yaml.safe_dump({**raw, "model": {"factory": "held_net:build", "args": {"width": 16}}}))
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    for name, text in (("coordinator.address", "127.0.0.1:1\n"),   # an earlier run's, killed with -9
                       ("status.json", json.dumps({"state": "COMPLETED", "reason": "", "finished": 1.0}))):
        (out_dir / name).write_text(text)
        os.utime(out_dir / name, (1.0, 1.0))
    run = subprocess.Popen([*HETPIPE, "run", "-q", str(job)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True)
    stop = None
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "planned").exists():
            assert time.monotonic() < deadline and run.poll() is None, "hetpipe run never planned"
            time.sleep(0.01)
        marked = run_marker.live_run(out_dir)
        assert marked is not None and marked.pid == run.pid
        status = _cli("status", "--job", str(job))
        assert status.returncode == 0 and status.stdout.startswith(f"job: STARTING (`hetpipe run` pid {run.pid}"), status
        stop = subprocess.Popen([*HETPIPE, "stop", "--job", str(job)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
        assert stop.stderr is not None
        said = stop.stderr.readline()   # once stop has found the run starting
        assert said == f"hetpipe: the run of {job} (pid {run.pid}) is starting; stopping it once its coordinator is up\n"
        (tmp_path / "go").touch()
        stopped, err = stop.communicate(timeout=60)
        assert stop.returncode == 0, err
        assert stopped.startswith("job: STOPPED (stopped by request)"), stopped
        out, err = run.communicate(timeout=60)
    finally:
        (tmp_path / "go").touch()
        for process in (run, stop):
            if process is not None and process.poll() is None:
                process.kill()
    assert run.returncode == 1 and "hetpipe: job stopped: stopped by request" in err, (out, err)
    assert run_marker.live_run(out_dir) is None


def test_a_run_killed_while_it_plans_leaves_nothing_the_next_launcher_does_not_sweep(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The fork server starts before the run plans, and its folder (/tmp/pymp-*) outlives a run
    killed with -9: it is recorded before the server starts, so the next launcher removes it."""
    (tmp_path / "held_net.py").write_text(HELD_NET)
    job = _job_file(tmp_path, parallel={"stages_per_vw": 1})
    job.write_text(yaml.safe_dump({**yaml.safe_load(job.read_text()), "model": {"factory": "held_net:build",
                                                                                 "args": {"width": 16}}}))
    # A temporary folder of the run's own, where no other test's launcher makes its folders; short,
    # as the fork server's socket lies in it.
    temp = Path(tempfile.mkdtemp(prefix="hp-"))
    run = subprocess.Popen([*HETPIPE, "run", "-q", str(job)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           env={**os.environ, "TMPDIR": str(temp)})
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "planned").exists():
            assert time.monotonic() < deadline and run.poll() is None, "hetpipe run never planned"
            time.sleep(0.01)
        left = set(temp.glob("pymp-*"))
        assert left, "no fork server folder: the test proves nothing"
        run.kill()
        run.wait(timeout=30)
        assert all(p.exists() for p in left), "removed by the killed run itself"
        monkeypatch.setattr(tempfile, "tempdir", str(temp))
        RunDir.sweep()   # what the next launcher does first
        assert not [p for p in left if p.exists()]
    finally:
        if run.poll() is None:
            run.kill()
            run.wait(timeout=30)
        shutil.rmtree(temp, ignore_errors=True)


def test_status_of_a_run_killed_with_its_coordinator_says_it_was_killed(tmp_path: Path) -> None:
    """A kill -9 leaves coordinator.address and no summary: status says the run is dead (not that a
    coordinator is unreachable, as if one might come back), and stop has nothing to stop."""
    job = _job_file(tmp_path, train={"steps": 5000})
    run = subprocess.Popen([*HETPIPE, "run", "-q", str(job)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           start_new_session=True)
    try:
        _until_published(tmp_path, run)
    finally:
        os.killpg(run.pid, signal.SIGKILL)   # the launcher and every process it started
        run.wait(timeout=30)
    status = _cli("status", "--job", str(job))
    assert status.returncode == 1 and "is not alive, and it left no summary of how it ended: it was killed" in (
        status.stderr), status
    stop = _cli("stop", "--job", str(job))
    assert stop.returncode == 0 and "already ended: killed" in stop.stdout, stop


def test_status_after_the_run_ends_reports_how_it_ended(tmp_path: Path) -> None:
    job = _job_file(tmp_path, train={"steps": 20})
    never = _cli("status", "--job", str(job))
    assert never.returncode == 2 and f"{job} has not run here: its output.dir {tmp_path / 'out'} does not exist" in (
        never.stderr), never
    run = _cli("run", "-q", str(job), "--set", "train.steps=12")   # the run's steps, not the file's
    assert run.returncode == 0, run.stderr
    status = _cli("status", "--job", str(job))
    assert status.returncode == 0, status.stderr
    assert re.match(r"job: COMPLETED \(ended \d{4}-\d\d-\d\d \d\d:\d\d:\d\d; no coordinator is running\)",
                    status.stdout), status.stdout
    assert "samples/s" in status.stdout and "unreachable" not in status.stdout + status.stderr
    as_json = json.loads(_cli("status", "--job", str(job), "--json").stdout)
    assert as_json["job"]["state"] == "COMPLETED" and as_json["job"]["summary"]["steps"] == 12


def test_version() -> None:
    out = _cli("--version")
    assert out.returncode == 0 and out.stdout.strip() == f"hetpipe {version('hetpipe')}"


def test_a_reader_that_stops_early_gets_no_traceback(tmp_path: Path) -> None:
    job = _job_file(tmp_path, parallel={"stages_per_vw": 4})
    read, write = os.pipe()
    os.close(read)  # the reader (think `| head -1`) has gone before hetpipe writes
    proc = subprocess.run([*HETPIPE, "plan", "--json", str(job)], stdout=write, stderr=subprocess.PIPE, text=True,
                          timeout=60)
    os.close(write)
    assert "Traceback" not in proc.stderr and "BrokenPipe" not in proc.stderr, proc.stderr
    assert proc.returncode == 141


@pytest.mark.parametrize("after_s", [0.3, 0.9])
def test_ctrl_c_while_the_command_starts_ends_it_in_one_line(tmp_path: Path, after_s: float) -> None:
    """Ctrl-C during the imports (about a second: torch) or during the planning: exit 130 and one
    line, as later in a run, never a traceback."""
    hetpipe = Path(sys.executable).parent / "hetpipe"   # the console script a user runs
    # As from a terminal: a suite started in the background (`cmd &`) has SIGINT ignored, and an
    # ignored signal stays ignored across exec.
    plan = subprocess.Popen([*with_signals(default=("INT",)), str(hetpipe), "plan", str(_job_file(tmp_path))],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(after_s)
    plan.send_signal(signal.SIGINT)
    out, err = plan.communicate(timeout=60)
    assert (plan.returncode, err) == (130, "hetpipe: interrupted\n"), (plan.returncode, err, out)


def test_ctrl_c_at_a_terminal_while_the_fork_server_starts_ends_the_run_in_one_line(tmp_path: Path) -> None:
    """A terminal's Ctrl-C goes to the whole process group: the fork server too, which imports torch
    first and printed its traceback under our one line when the signal came during that import."""
    import psutil

    hetpipe = Path(sys.executable).parent / "hetpipe"
    run = subprocess.Popen([*with_signals(default=("INT",)), str(hetpipe), "run", "-q", str(_job_file(tmp_path))],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           start_new_session=True)   # a group of its own
    try:
        def importing_torch() -> bool:   # the fork server's preload: torch's library mapped, its modules to come
            for child in psutil.Process(run.pid).children():
                try:
                    if "forkserver" in " ".join(child.cmdline()) and any(
                            "libtorch" in m.path for m in child.memory_maps(grouped=True)):
                        return True
                except psutil.Error:
                    pass
            return False

        deadline = time.monotonic() + 60
        while not importing_torch():
            assert time.monotonic() < deadline and run.poll() is None, "no fork server started"
            time.sleep(0.01)
        os.killpg(run.pid, signal.SIGINT)
        out, err = run.communicate(timeout=60)
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
    assert run.returncode == 130 and err.startswith("hetpipe: interrupted") and err.count("\n") == 1, (
        run.returncode, err, out)


def test_commands_that_neither_plan_nor_run_start_without_torch() -> None:
    """status, stop, trace, certs and --help import no torch (a second of the command's start):
    the planner and the launchers are imported by the commands that use them."""
    code = ("import sys; from launch import cli; cli.parser().parse_args(['status']); "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith(('coordinator.planner', 'launch.local'))))")
    found = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert found.returncode == 0 and found.stdout.strip() == "[]", (found.stdout, found.stderr)


def test_a_local_run_starts_its_fork_server_before_it_imports_torch(tmp_path: Path) -> None:
    """The fork server imports torch for the workers (seconds on a small host) while the launcher
    imports it to plan, not after: one after the other, a run's start took the sum. The run stops
    where the fork server would start."""
    code = ("import sys; from launch import cli, processes\n"
            "def started(): print('torch' in sys.modules); raise SystemExit(0)\n"
            f"processes.warm_up = started; cli.main(['run', '-q', {str(_job_file(tmp_path))!r}])")
    found = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert found.returncode == 0 and found.stdout == "False\n", (found.stdout, found.stderr)


def test_a_bare_status_with_no_coordinator_says_how_to_find_a_local_run(monkeypatch: pytest.MonkeyPatch,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("HETPIPE_COORDINATOR", raising=False)
    monkeypatch.setattr("launch.status.DEFAULT_PORT", 1)   # nothing listens there, whatever this host runs
    assert cli.main(["status"]) == 69
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("hetpipe: coordinator 127.0.0.1:1 unreachable: UNAVAILABLE")
    assert err[1] == "hetpipe: a local `hetpipe run JOB.yaml` is found with `hetpipe status --job JOB.yaml`"


def test_ctrl_c_after_the_job_completed_keeps_its_results_and_ends_as_it_did(make_job, tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A Ctrl-C that lands after the job's end, before the run's: the weights and status.json say
    COMPLETED, and so does the run (its summary, exit 0), not "interrupted" (130)."""
    from launch import local

    real = local.follow

    def then_ctrl_c(*args: object, **kwargs: object) -> object:
        real(*args, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(local, "follow", then_ctrl_c)
    try:
        summary = local.run_local(make_job({"train": {"steps": 4}, "output": {"trace": False}}), quiet=True)
    except KeyboardInterrupt:   # not let through: it would end the whole suite
        pytest.fail("the run was reported interrupted after its job had completed")
    assert summary["steps"] == 4
    assert json.loads((tmp_path / "out" / "status.json").read_text())["state"] == "COMPLETED"

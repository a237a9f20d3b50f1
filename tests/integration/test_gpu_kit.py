"""bench/gpu_kit.sh: the one command a CUDA machine runs. Without a GPU its `tests` step runs the
`cuda` tests, which skip; what is checked here is the kit's own plumbing."""

from __future__ import annotations

import gzip
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
KIT = ROOT / "bench" / "gpu_kit.sh"

pytestmark = pytest.mark.timeout(120)


def kit(*args: str | Path, site: Path | None = None, python: Path | None = None,
        **env_vars: str) -> subprocess.CompletedProcess[str]:
    # The kit runs `python3`: this interpreter's (or the one in folder `python`), as on a CUDA
    # machine the one that holds torch. Its plumbing is checked without wheels: a checkout that
    # fetched them for a GPU machine holds another Python's in .whl/, which this one refuses
    # (KIT_WHEELS: an empty folder instead).
    env = {**os.environ, "PATH": f"{python or Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}", **env_vars}
    if site is not None:
        env["KIT_SITE"] = str(site)
        env["KIT_WHEELS"] = str(site.parent / "no-wheels")
    return subprocess.run(["bash", str(KIT), *map(str, args)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=100)


def test_the_tests_step_runs_every_cuda_test_file_and_keeps_its_output(tmp_path: Path) -> None:
    done = kit("run", tmp_path / "out", "tests", site=tmp_path / "site")
    assert done.returncode == 0, done.stdout + done.stderr
    out = (tmp_path / "out" / "tests.txt").read_text()
    # The files pytest itself finds cuda tests in, however they are marked (a parametrize's marks too).
    collected = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                                "-m", "cuda", "tests"], cwd=ROOT, capture_output=True, text=True, timeout=90)
    marked = {Path(line.split("::")[0]).name for line in collected.stdout.splitlines() if "::" in line}
    assert {"test_data.py", "test_devices.py", "test_cuda_ipc.py", "test_links.py", "test_cuda.py",
            "test_wsp_pulls.py"} <= marked, collected.stdout[-2000:]
    for name in marked:
        assert name in out, f"{name} has cuda tests the kit did not run"
    assert re.search(r"\d+ (skipped|passed)", out) and "=== tests: exit 0" in out
    assert "every step passed" in done.stdout


def test_a_python_without_the_projects_packages_stops_the_kit_before_any_step(tmp_path: Path) -> None:
    """An image with torch alone (no wheels carried): every service would fail at its start, each
    step only after its own start-up, and the device call would be spent."""
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "python3").write_text(f'#!/bin/sh\nexec "{sys.executable}" -S "$@"\n')   # -S: no site-packages
    (bare / "python3").chmod(0o755)
    done = kit("run", tmp_path / "out", "env", "tests", site=tmp_path / "site", python=bare)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "No module named" in done.stderr and "bench/gpu_kit.sh wheels" in done.stderr, done.stderr
    assert not list((tmp_path / "out").iterdir()), "a step ran"


def test_the_steps_share_one_budget_and_one_with_too_little_left_is_skipped(tmp_path: Path) -> None:
    """KIT_BUDGET bounds the steps together: each gets at most what is left, and one that finds
    under 30 s is skipped (a hung step would otherwise take the next ones' time past the call's
    limit, and their results with it)."""
    done = kit("run", tmp_path / "out", "env", "tests", site=tmp_path / "site", KIT_BUDGET="25")
    assert done.returncode == 1 and "failed: env tests" in done.stdout, done.stdout + done.stderr
    for name in ("env", "tests"):
        assert "skipped: " in (tmp_path / "out" / f"{name}.txt").read_text()
    done = kit("run", tmp_path / "out", "env", site=tmp_path / "site", KIT_BUDGET="100", STEP_TIMEOUT="500")
    limit = re.search(r"=== env \(up to (\d+) s\)", done.stdout)   # what is left of 100 s, less 10: the
    assert limit is not None and 80 <= int(limit[1]) <= 90, done.stdout   # package check took some of it


def test_an_unknown_step_is_named_and_fails(tmp_path: Path) -> None:
    done = kit("run", tmp_path, "bogus", site=tmp_path / "site")
    assert done.returncode == 2
    assert "no step 'bogus'" in done.stderr and "env tests transport copies gpu profile peers trace waves spy" in done.stderr


def test_without_a_command_it_prints_its_usage() -> None:
    done = kit()
    assert done.returncode == 2
    assert "bench/gpu_kit.sh run OUT" in done.stdout and "set -uo" not in done.stdout


def test_every_wheel_the_kit_carries_is_pinned() -> None:
    """`wheels` downloads exactly constraints.txt's versions: an unpinned name would fail there,
    on the machine with the registry, not later on the one without."""
    names = re.search(r'^KIT="([^"]*)"', KIT.read_text(), re.M)
    assert names is not None
    pinned = {line.split("==")[0].lower() for line in (ROOT / "constraints.txt").read_text().splitlines()
              if "==" in line}
    assert {"grpcio", "safetensors", "protobuf"} <= set(names.group(1).lower().split())
    assert set(names.group(1).lower().split()) <= pinned


def test_the_host_copies_bench_runs_without_a_gpu(tmp_path: Path) -> None:
    """The `copies` step's script, on a machine without CUDA: the host's rows, each against the
    memcpy measured in the same run."""
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "host_copies.py"), "--elements", "100000",
                           "--repeats", "2", "--dir", str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                          timeout=100)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = {line[:52].strip(): line[52:].split() for line in done.stdout.splitlines()[2:]}
    assert rows["host memcpy (the reference)"][2] == "1.0"
    assert {"log entry written (page cache)", "log entry written, then fsynced"} <= set(rows)
    # Each row measured something. At two decimals the ms column reads 0.00 for the reference's
    # 0.4 MB on a fast host, and the GB/s column 0.00 when a loaded host stalls it for 40 ms: one
    # of them is not 0.
    assert all(float(ms) > 0 or float(rate) > 0 for ms, rate, _ in rows.values()), rows
    assert list(tmp_path.iterdir()) == [], "the entry it wrote is removed"


def test_the_spy_step_without_py_spy_says_what_to_carry(tmp_path: Path) -> None:
    # The kit takes a py-spy on PATH first: one this machine has is left out of the kit's PATH.
    folders = [str(Path(sys.executable).parent), *os.environ["PATH"].split(os.pathsep)]
    done = kit("run", tmp_path / "out", "spy", site=tmp_path / "site",
               PATH=os.pathsep.join(f for f in folders if not (Path(f) / "py-spy").exists()))
    assert done.returncode == 1 and "failed: spy" in done.stdout
    assert "no py-spy: carry its wheel" in (tmp_path / "out" / "spy.txt").read_text() + done.stderr


RAW = """\
process 10:"python bench/gpu.py";process 11:"python -m ps_server --port 0";thread (21): ThreadPoolExecutor-0_3;Thread._bootstrap (/usr/lib/python3.12/threading.py:1030);ShardServicer.Pull (/x/ps_server/servicer.py:359);Condition.wait (/usr/lib/python3.12/threading.py:331) 30
process 10:"python bench/gpu.py";process 11:"python -m ps_server --port 0";thread (22): ThreadPoolExecutor-0_4;ShardServicer._update (/x/ps_server/servicer.py:241);Shard.add (/x/ps_server/shard.py:286) 10
process 10:"python bench/gpu.py";process 12:"python -m stage_worker --port 0";thread (31): compute;StageRuntime._loop (/x/stage_worker/runtime.py:296);_engine_run_backward (/site/torch/autograd/graph.py:979) 45
process 10:"python bench/gpu.py";process 13:"python -m stage_worker --port 0";thread (41): compute;StageRuntime._loop (/x/stage_worker/runtime.py:296);_engine_run_backward (/site/torch/autograd/graph.py:979) 5
process 10:"python bench/gpu.py";process 12:"python -m stage_worker --port 0";thread (32): Thread-7 (_run);_run_channel_spin_thread.<locals>.channel_spin (/site/grpc/_channel.py:1725) 10
process 10:"python bench/gpu.py";process 14:"python -B -c from multiprocessing.forkserver import main";thread (51): compute;StageRuntime._loop (/x/stage_worker/runtime.py:296);_engine_run_backward (/site/torch/autograd/graph.py:979) 5
process 10:"python bench/gpu.py";process 15:"python -B -c from multiprocessing.forkserver import main";thread (61): MainThread;main (/usr/lib/python3.12/multiprocessing/forkserver.py:270) 2
not a sample line
"""


def test_the_spy_summary_charges_each_sample_to_its_process_thread_and_line(tmp_path: Path) -> None:
    """bench/spy_summary.py over a raw py-spy profile (the spy step's): samples summed per kind
    of process and thread (numbered threads as one), each at the deepest line of the project's
    code, beside the frame it ended in; gzipped alike. A child still titled as the fork server
    when py-spy found it is of the kind its frames show."""
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import spy_summary
    finally:
        sys.path.remove(str(ROOT / "bench"))
    kinds = spy_summary.summarize(RAW.splitlines(keepends=True))
    assert set(kinds) == {"ps shard", "stage worker", "fork server"}
    shard, stage = kinds["ps shard"], kinds["stage worker"]
    assert shard.samples == 40 and stage.samples == 65 and len(stage.processes) == 3
    assert kinds["fork server"].samples == 2
    assert shard.threads == {"ThreadPoolExecutor": 40}
    assert shard.lines["ThreadPoolExecutor"] == {
        "ShardServicer.Pull (ps_server/servicer.py:359) -> Condition.wait (threading.py:331)": 30,
        "Shard.add (ps_server/shard.py:286)": 10}
    assert stage.threads == {"compute": 55, "Thread (_run)": 10}
    assert stage.lines["Thread (_run)"] == {"(outside the project) _run_channel_spin_thread.<locals>.channel_spin "
                                            "(_channel.py:1725)": 10}
    gz = tmp_path / "spy.raw.gz"
    gz.write_bytes(gzip.compress(RAW.encode()))
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "spy_summary.py"), str(gz), "--top", "1"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[:3] == [
        "== stage worker: 65 samples in 3 process(es)", "  compute: 55 samples (85%)",
        "         55 100.0%  StageRuntime._loop (stage_worker/runtime.py:296) -> _engine_run_backward (graph.py:979)"]

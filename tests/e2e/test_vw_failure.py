"""parallel.on_vw_failure continue (issue 14): kill -9 of one VW's stage, and the job completes
with the VWs left; the summary says which VW left and when; the final model is w0 plus every
acknowledged push exactly once, the one that left included (O3)."""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import psutil
import pytest

from coordinator import checkpoints
from coordinator.checkpoints import latest
from hetpipe import outputs, rpc
from hetpipe.metrics import REGISTRY
from hetpipe.v1 import stage_pb2
from conftest import run_beside
from tests.trace_rules import check_conservation

pytestmark = pytest.mark.timeout(300)


def _serves(proc: psutil.Process, vw: int, stage: int) -> bool:
    cmd = " ".join(proc.cmdline()).split()
    if "stage_worker" not in cmd or "--ready-file" not in cmd:
        return False
    try:
        address = Path(cmd[cmd.index("--ready-file") + 1]).read_text().split()[0]
        with rpc.channel(address) as ch:
            s = rpc.Stub(ch, "Stage").Status(stage_pb2.StatusRequest(), timeout=5)
    except (OSError, IndexError, Exception):  # noqa: BLE001  (not ready, or gone: not it)
        return False
    return bool(s.vw == vw and s.stage == stage)


def _kill_when_busy(out: Path, done: threading.Event, killed: list[int]) -> None:
    """kill -9 the worker of stage 1 of vw 1 once it has trained some minibatches."""
    trace = out / "trace" / "vw1_stage1.jsonl"
    deadline = time.monotonic() + 240
    while not done.is_set() and time.monotonic() < deadline:
        if trace.exists() and len(trace.read_text().splitlines()) > 12:
            for proc in psutil.Process().children(recursive=True):
                if _serves(proc, 1, 1):
                    proc.send_signal(signal.SIGKILL)
                    killed.append(proc.pid)
                    return
        time.sleep(0.05)


def test_a_killed_vw_leaves_and_the_others_finish(make_job, tmp_path: Path) -> None:
    job = make_job({
        "output": {"ledger": True},   # O3 reads it (check_conservation)
        "train": {"dtype": "float64", "optimizer": {"name": "sgd", "lr": 0.02}, "steps": 80, "checkpoint_every": 3},
        "parallel": {"virtual_workers": 3, "stages_per_vw": 2, "nm": 2, "D": 1, "ps_shards": 2,
                     "on_vw_failure": "continue"},
        "cluster": {"nodes": [{"name": "n0", "gpus": [{"type": "titan-v", "count": 6}]}],
                    "emulate": {"forward_seconds": 0.01, "backward_seconds": 0.01}},
    })
    out = tmp_path / "out"
    summary, killed = run_beside(job, _kill_when_busy)
    assert killed, "no stage was killed: the test proved nothing"
    [left] = summary["evicted"]
    assert left["vw"] == 1 and "stage 1 of vw 1" in left["reason"], left
    assert 6 <= left["minibatches"] < 80 and left["seconds"] > 0, left
    # The plan as it ran: every VW's stages, the one that left included.
    assert [(r["vw"], r["stage"]) for r in summary["plan"]] == [(vw, q) for vw in range(3) for q in range(2)]
    # The two VWs left trained every step; the summary counts what each VW trained.
    assert summary["samples_per_second"] * summary["wall_seconds"] == pytest.approx(
        (2 * 80 + left["minibatches"]) * job.data.batch_size)
    for vw in (0, 2):
        rows = (out / "trace" / f"vw{vw}_stage1.jsonl").read_text().splitlines()
        assert len(rows) == 80, f"vw {vw} trained {len(rows)} of 80 minibatches"
    check_conservation(job, out, ledgers=3 * 2, left=[1])
    # No cut is taken without the VW (none could be resumed), and the last one before it left,
    # which can, stays the latest.
    wave = latest(out / outputs.CHECKPOINTS)
    assert wave is not None and wave * job.parallel.nm <= left["minibatches"], (wave, left)
    assert checkpoints.manifest(out / outputs.CHECKPOINTS, wave)["evicted"] == []
    assert [p.name for p in (out / outputs.CHECKPOINTS).glob("cut*")] == [outputs.cut_dir(".", wave).name]
    # The embedded coordinator's metrics say so too.
    assert REGISTRY.get_sample_value("hetpipe_job_evicted", {"vw": "1"}) == 1.0
    assert REGISTRY.get_sample_value("hetpipe_job_evicted", {"vw": "0"}) == 0.0

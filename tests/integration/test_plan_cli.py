"""`hetpipe plan`: the table a person reads (units, layer names, the memory bound on Nm), and a
prediction that follows the emulated task times it is given."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from conftest import BASE_JOB, deep_update
from coordinator.planner import PlanError, make_plan
from hetpipe.config import parse_job
from launch import cli

EMULATED = {"cluster": {"nodes": [{"name": "n0", "gpus": [{"type": "t4", "count": 2}]}],
                        "emulate": {"forward_seconds": 0.02, "backward_seconds": 0.04}},
            "parallel": {"stages_per_vw": 2, "nm": 2}}


def _plan(capsys: pytest.CaptureFixture[str], tmp_path: Path, overrides: dict[str, Any]) -> tuple[int, str, str]:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(deep_update(BASE_JOB, overrides)))
    code = cli.main(["plan", str(path)])
    out, err = capsys.readouterr()
    return code, out, err


def test_the_table_names_units_layers_and_the_memory_bound(capsys: pytest.CaptureFixture[str],
                                                           tmp_path: Path) -> None:
    code, out, _ = _plan(capsys, tmp_path, EMULATED)
    assert code == 0
    assert "1 virtual worker x 2 stages, nm 2 (memory allows up to 1024+)" in out
    assert "memory (need / have)" in out and "(times per minibatch)" in out
    # A small MLP: KiB of memory against the T4's 16 GiB, times in ms, layers by name.
    rows = [line for line in out.splitlines() if re.match(r"\s+0\s+[01]\s", line)]
    assert len(rows) == 2, out
    assert re.search(r"\[0,\d\) 0\.Linear-\d\.\w+", rows[0]) and re.search(r"\d\.\w+-6\.Linear", rows[1]), rows
    assert all(re.search(r"\d+(\.\d)? KiB / 16\.00 GiB", r) for r in rows), rows
    assert all("20 ms" in r and "40 ms" in r for r in rows), rows


def test_the_prediction_follows_overridden_task_times() -> None:
    def predicted(forward: float, backward: float) -> float:
        job = parse_job(deep_update(BASE_JOB, deep_update(EMULATED, {"cluster": {"emulate": {
            "forward_seconds": forward, "backward_seconds": backward}}})))
        return make_plan(job).predicted_samples_per_second

    slow, fast = predicted(0.02, 0.04), predicted(0.002, 0.004)
    # Two stages of 60 ms each, 2 in flight: the pipeline moves a minibatch of 16 about every 60 ms.
    assert 16 / 0.06 * 0.7 < slow < 16 / 0.06 * 1.05, slow
    assert fast > 5 * slow, (fast, slow)


def test_nm_beyond_memory_is_refused_naming_the_bound() -> None:
    # ResNet-152 at 224 x 224 over two 16 GiB T4s: stage 0 keeps nm minibatches' activations.
    raw = {"model": {"name": "resnet152", "args": {"in_shape": [3, 224, 224]}}, "data": {"batch_size": 32},
           "cluster": {"nodes": [{"name": "n0", "gpus": [{"type": "t4", "count": 2}]}], "emulate": {}},
           "parallel": {"stages_per_vw": 2, "nm": 2}}
    bound = make_plan(parse_job(raw)).max_m[0]
    assert 2 <= bound < 1024
    make_plan(parse_job(deep_update(raw, {"parallel": {"nm": bound}})))
    with pytest.raises(PlanError, match=rf"parallel\.nm {bound + 1} does not fit: memory allows vw 0 at most {bound} "
                                        r"minibatches in flight \(no pipeline of 2 GPU\(s\) fits hetpipe\.zoo:resnet152 .*needs"):
        make_plan(parse_job(deep_update(raw, {"parallel": {"nm": bound + 1}})))


def test_nm_beyond_the_steps_is_a_warning(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, _, err = _plan(capsys, tmp_path, deep_update(EMULATED, {"parallel": {"nm": 40}}))
    assert code == 0
    assert "warning: parallel.nm 40 > train.steps 30: at most 30 minibatches are ever in flight" in err

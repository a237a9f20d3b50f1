"""output.profile on a real run: each stage writes torch.profiler's Chrome trace of the window's
minibatches and a table headed by what one of them cost; a later run without it clears both."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from launch.local import run_local

pytestmark = pytest.mark.timeout(180)


def test_each_stage_profiles_its_window_and_a_later_run_clears_it(make_job, tmp_path: Path) -> None:
    window = {"after": 4, "steps": 3}
    run_local(make_job({"train": {"steps": 12}, "parallel": {"stages_per_vw": 2, "nm": 2},
                        "output": {"trace": False, "profile": window}}), quiet=True)
    trace = tmp_path / "out" / "trace"
    names = [f"profile_vw0_stage{q}" for q in range(2)]
    assert sorted(p.name for p in trace.iterdir()) == sorted(f"{n}.{ext}" for n in names for ext in ("json", "txt"))
    for q, name in enumerate(names):
        head, *table = (trace / f"{name}.txt").read_text().splitlines()
        m = re.fullmatch(rf"stage {q} of vw 0: 3 minibatches, per minibatch ([\d.]+) ms wall, ([\d.]+) ms of "
                         r"kernels, (\d+) kernel launches, ([\d.]+) ms in operators on the host", head)
        assert m is not None, head
        wall, kernels, launches, host = (float(g) for g in m.groups())
        assert wall > 0 and host > 0 and (kernels, launches) == (0, 0), head   # the CPU: no kernels to launch
        # The stage's own work is in it: its layers' products, and (both stages) their backward.
        assert any("aten::addmm" in row for row in table) and any("Backward" in row for row in table), table
        events = json.loads((trace / f"{name}.json").read_text())["traceEvents"]
        assert any(e.get("name") == "aten::addmm" for e in events)
    run_local(make_job({"train": {"steps": 12}, "parallel": {"stages_per_vw": 2, "nm": 2},
                        "output": {"trace": False}}), quiet=True)
    assert not trace.exists() or not list(trace.iterdir()), "an earlier run's profile was left"

"""StopJob while a job is planned: planning ends at the next Nm it would weigh, not after all of
them (it used to go on, pinning a core for seconds on a large cluster, with the job already
STOPPED and the next Submit refused meanwhile)."""

from __future__ import annotations

import threading

import pytest

from coordinator.planner import make_plan
from coordinator.planner.costs import StageCosts
from hetpipe.errors import JobStopped


def test_planning_stops_soon_after_cancel(make_job, monkeypatch: pytest.MonkeyPatch) -> None:
    job = make_job({"parallel": {"virtual_workers": 2, "stages_per_vw": 2, "nm": "auto"},
                    "cluster": {"nodes": [{"name": "n0", "gpus": [{"type": "titan-v", "count": 4}]}]}})
    cancel = threading.Event()
    weighed: list[object] = []
    predict = StageCosts.predict

    def weigh(self: StageCosts, *args: object) -> tuple[float, float]:
        weighed.append(args)
        return predict(self, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(StageCosts, "predict", weigh)
    make_plan(job, cancel=cancel)
    assert len(weighed) > 2, "uncancelled, it weighs several Nm"

    weighed.clear()

    def weigh_then_stop(self: StageCosts, *args: object) -> tuple[float, float]:
        cancel.set()  # a StopJob arriving while the first Nm is weighed
        return weigh(self, *args)

    monkeypatch.setattr(StageCosts, "predict", weigh_then_stop)
    with pytest.raises(JobStopped, match="while planning"):
        make_plan(job, cancel=cancel)
    assert len(weighed) == 1

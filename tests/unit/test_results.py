"""summary.json's samples_per_second, and the progress rate while a run is under way, count the
minibatches this run trained, so a run resumed from a checkpoint does not claim the earlier run's
over its own wall; its steady_samples_per_second counts those after each stage's first wave."""

from __future__ import annotations

import time

import pytest

from coordinator import results
from coordinator.driver import JobDriver, trained_here
from coordinator.planner import make_plan
from hetpipe.v1 import stage_pb2
from stage_worker.progress import SteadyWindow


def test_a_fresh_run_counts_every_minibatch() -> None:
    assert trained_here([40, 40], before=0) == 80
    assert trained_here([40, 40, 13], before=0) == 93  # a VW that left after 13


def test_a_resumed_run_counts_only_those_after_the_checkpoint() -> None:
    # 2 VWs, nm 2, resumed from the checkpoint of wave 8: each started at minibatch 17.
    assert trained_here([40, 40], before=8 * 2) == 2 * 24
    # A VW that left this run after minibatch 20 trained 4 of them here; one that left before it
    # reported (0) trained none here, rather than a negative count.
    assert trained_here([40, 40, 20, 0], before=16) == 2 * 24 + 4


def test_a_resumed_runs_progress_rate_counts_only_its_own_minibatches(make_job) -> None:
    """The progress bar, `hetpipe status` and the samples/s gauge: after --resume from wave 8 (nm 2),
    each VW's 40 minibatches include the checkpoint's 16, which this run's seconds did not train."""
    job = make_job({"train": {"steps": 40}, "parallel": {"virtual_workers": 2, "stages_per_vw": 1, "nm": 2}})
    driver = JobDriver(job, make_plan(job), ["127.0.0.1:9", "127.0.0.1:9"], resume_wave=8)
    try:
        for h in driver.stages:
            h.last = stage_pb2.StageStatus(backwards_done=40)
        progress = driver._progress(time.monotonic() - 2.0)
    finally:
        driver.close()
    batch = job.data.batch_size
    assert progress.samples == 80 * batch, "the bar shows the whole run's progress"
    assert progress.samples_per_second == pytest.approx(2 * 24 * batch / 2.0, rel=0.05)


def test_the_steady_window_opens_after_this_runs_first_wave_and_closes_at_done() -> None:
    # Resumed after minibatch 16, nm 4: the window opens when minibatch 20 is stepped here.
    w = SteadyWindow(4, completed=16)
    for done, now in ((17, 1.0), (19, 2.0)):
        w.stepped(done, now)
    assert w.read(19, 2.5) == (0, 0.0), "no window inside the first wave"
    w.stepped(20, 3.0)
    w.stepped(24, 5.0)
    assert w.read(24, 6.0) == (4, 3.0), "open: up to now"
    w.done(7.0)
    w.done(9.0)   # DONE is entered once; a second call moves nothing
    assert w.read(24, 30.0) == (4, 4.0), "closed at DONE: polls after it read the same"


def _stage(vw: int, minibatches: int, seconds: float) -> stage_pb2.StageStatus:
    return stage_pb2.StageStatus(vw=vw, steady_minibatches=minibatches, steady_seconds=seconds)


def test_the_steady_rate_counts_every_vws_minibatches_over_the_longest_window() -> None:
    stages = [_stage(0, 36, 2.0), _stage(0, 36, 3.0), _stage(1, 36, 4.0), _stage(1, 36, 1.0)]
    assert results.steady_samples_per_second(stages, batch_size=8) == pytest.approx(72 / 4.0 * 8)
    # A VW twice as fast ends halfway through the slow one's window: the job trained 2 x 99
    # minibatches in 19.8 s, not 10 + 5 a second.
    unequal = [_stage(0, 99, 9.9), _stage(1, 99, 19.8)]
    assert results.steady_samples_per_second(unequal, batch_size=1) == pytest.approx(10.0)
    assert results.steady_samples_per_second([_stage(0, 36, 2.0), _stage(1, 0, 0.0)], 8) is None, \
        "a VW with no steady window (steps <= nm) leaves the job without a steady rate"
    assert results.steady_samples_per_second([], 8) is None

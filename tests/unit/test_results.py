"""coordinator/results.py: summary.json's samples_per_second counts the minibatches this run
trained, so a run resumed from a checkpoint does not claim the earlier run's over its own wall."""

from __future__ import annotations

from coordinator.results import trained_here


def test_a_fresh_run_counts_every_minibatch() -> None:
    assert trained_here([40, 40], before=0) == 80
    assert trained_here([40, 40, 13], before=0) == 93  # a VW that left after 13


def test_a_resumed_run_counts_only_those_after_the_checkpoint() -> None:
    # 2 VWs, nm 2, resumed from the checkpoint of wave 8: each started at minibatch 17.
    assert trained_here([40, 40], before=8 * 2) == 2 * 24
    # A VW that left this run after minibatch 20 trained 4 of them here; one that left before it
    # reported (0) trained none here, rather than a negative count.
    assert trained_here([40, 40, 20, 0], before=16) == 2 * 24 + 4

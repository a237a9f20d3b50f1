"""When a stage saves its part of a checkpoint and waits (stage_worker/checkpoint.Cuts)."""

from __future__ import annotations

from stage_worker.checkpoint import Cuts


def test_cuts_fall_every_few_waves_and_never_at_the_end() -> None:
    cuts = Cuts(every=2, nm=3, steps=20)  # 7 waves, the last one partial
    assert [w for w in range(10) if cuts.is_cut(w)] == [2, 4, 6]
    # 8 whole waves, the last a multiple of every: the job ends there, so no cut waits at it.
    cuts = Cuts(every=2, nm=3, steps=24)
    assert [w for w in range(12) if cuts.is_cut(w)] == [2, 4, 6]
    assert not Cuts(every=0, nm=3, steps=20).is_cut(2)


def test_only_the_first_forward_after_a_cut_waits_until_continued() -> None:
    cuts = Cuts(every=2, nm=3, steps=20)
    assert [p for p in range(1, 21) if cuts.blocks(p)] == [7, 13, 19]
    cuts.saved = cuts.continued = 2
    assert [p for p in range(1, 21) if cuts.blocks(p)] == [13, 19]


def test_saved_once_every_backward_and_push_of_the_cut_is_done() -> None:
    cuts = Cuts(every=2, nm=3, steps=20)
    assert cuts.due(completed=5, acked_waves=2) is None   # wave 2 not finished here
    assert cuts.due(completed=6, acked_waves=1) is None   # its push not acknowledged yet
    assert cuts.due(completed=6, acked_waves=2) == 2
    cuts.saved = 2
    assert cuts.due(completed=6, acked_waves=2) is None   # once
    assert cuts.due(completed=3, acked_waves=1) is None   # wave 1 is no cut
    resumed = Cuts(every=2, nm=3, steps=20, saved=4, continued=4)
    assert resumed.due(completed=12, acked_waves=4) is None and not resumed.blocks(13)

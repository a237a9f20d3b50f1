"""stage_worker.sync.in_parallel: a wave's pushes and a pull go to every shard at once; the first
refusal is raised as it comes, not once every other shard's call has ended."""

from __future__ import annotations

import threading
import time

import pytest

from stage_worker.sync import in_parallel


def test_results_come_in_the_order_of_the_items() -> None:
    assert in_parallel(lambda x: x * x, [3, 1, 2]) == [9, 1, 4]
    assert in_parallel(lambda x: x + 1, [7]) == [8]


def test_the_first_error_is_raised_while_another_call_still_waits() -> None:
    released = threading.Event()

    def call(shard: int) -> int:
        if shard == 0:
            raise RuntimeError("pull for min_clock 3 to ps shard 0 failed: FAILED_PRECONDITION")
        released.wait(30)   # a pull that shard 1 holds back for c_global
        return shard

    started = time.monotonic()
    try:
        with pytest.raises(RuntimeError, match="ps shard 0 failed"):
            in_parallel(call, [0, 1])
        assert time.monotonic() - started < 5
    finally:
        released.set()

"""A GPU stage's copies to and from the host (stage_worker/host_copies.py): off the compute
stream, through pinned memory, after exactly the kernels that made the tensors."""

from __future__ import annotations

import pytest
import torch

from hetpipe import shm, wire
from stage_worker import host_copies


def test_on_the_cpu_tensors_are_only_cast() -> None:
    x = torch.arange(6, dtype=torch.float32)
    host, ready = host_copies.to_host([x], "push", cast=lambda t: t.to(torch.bfloat16))
    assert ready is None and host[0].dtype == torch.bfloat16 and torch.equal(host[0].float(), x)
    assert host_copies.marker([x]) is None
    same, ready = host_copies.to_host([x], "push")
    assert ready is None and same[0] is x


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_push_is_copied_after_the_kernels_that_made_it_and_a_pull_lands_whole() -> None:
    device = torch.device("cuda", 0)
    total = torch.zeros(1 << 24, device=device)
    for _ in range(20):   # a wave's sum, still being added on the compute stream when the copy is queued
        total.add_(torch.ones_like(total))
    made = host_copies.marker([total])
    host, ready = host_copies.to_host([total], "push", after=made, cast=lambda t: t.to(torch.bfloat16))
    ready.synchronize()
    assert host[0].device.type == "cpu" and host[0].is_pinned() and host[0].dtype == torch.bfloat16
    assert torch.equal(host[0].float(), torch.full((1 << 24,), 20.0)), "the copy waited for the adds"

    values = [torch.randn(1000, dtype=torch.float64).pin_memory(), torch.randn(3, 5)]
    moved = host_copies.to_device(values, device, "pull")
    assert all(m.device == device for m in moved)
    assert all(torch.equal(m.cpu(), v) for m, v in zip(moved, values))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("pinned", [True, False], ids=["slot pinned", "driver refuses"])
def test_a_pull_in_the_shards_slot_reaches_the_gpu_whole(pinned: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Copied by DMA from the slot, pinned once and reused wave after wave; or, where the driver
    will not pin it (here: a flag it does not take), through pinned memory, never tried again,
    and with no CUDA error left behind on the thread that asked."""
    device = torch.device("cuda", 0)
    ring, reader = shm.Ring(slots=1), shm.Reader()   # one slot: every reply in the same segment
    pins = host_copies.PinnedSlots(reader, device)
    if not pinned:
        monkeypatch.setattr(pins, "FLAGS", 0x40)
    try:
        for _ in range(3):
            values = [("a", torch.randn(1 << 20)), ("b", torch.randn(3, 5, dtype=torch.float64)),
                      ("c", torch.zeros(0))]
            got = pins.receive(wire.read(list(wire.encode(values, ring=ring)), reader))
            assert len(got) == 3 and all(g.device == device for g in got)
            assert all(torch.equal(g.cpu(), v) for g, (_, v) in zip(got, values))
        assert (pins.pins, pins.refused is None) == ((1, True) if pinned else (0, False))
        torch.cuda.synchronize(device)
        assert torch.equal((got[0] * 2).cpu(), values[0][1] * 2)   # a kernel, and torch's check after it, here
    finally:
        pins.close()
        ring.close()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_slot_the_shard_replaced_is_unpinned_and_a_closed_stage_pins_nothing(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shm.Reader, "PRUNE_S", 0.0)   # the reader notices a gone segment at once
    device = torch.device("cuda", 0)
    ring, reader = shm.Ring(slots=1), shm.Reader()
    pins = host_copies.PinnedSlots(reader, device)
    try:
        for n in (1000, 1 << 20, 1 << 20):   # the slot grows: a new segment, the old one unlinked
            values = [("a", torch.randn(n))]
            (got,) = pins.receive(wire.read(list(wire.encode(values, ring=ring)), reader))
            assert torch.equal(got.cpu(), values[0][1])
        assert pins.pins == 2 and len(pins._pinned) == 1, "the replaced slot stays pinned"
        pins.close()
        (got,) = pins.receive(wire.read(list(wire.encode(values, ring=ring)), reader))
        assert torch.equal(got.cpu(), values[0][1]) and not pins._pinned and pins.pins == 2
    finally:
        pins.close()
        ring.close()

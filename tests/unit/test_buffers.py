"""The receive pool: a mapping comes back only once no tensor (nor any view of one) holds it."""

from __future__ import annotations

import threading

import pytest
import torch

from hetpipe import buffers, wire
from hetpipe.v1 import wire_pb2

MIB = 1 << 20


def _tensor(pool: buffers.Pool, nbytes: int) -> torch.Tensor:
    return torch.frombuffer(pool.take(nbytes), dtype=torch.uint8, count=nbytes)


def test_a_mapping_comes_back_once_its_tensor_is_gone() -> None:
    pool = buffers.Pool()
    first = _tensor(pool, 3 * MIB)
    address = first.data_ptr()
    second = _tensor(pool, 3 * MIB)   # the first is in use: another mapping
    assert second.data_ptr() != address
    del first
    assert _tensor(pool, 3 * MIB).data_ptr() == address
    assert pool.kept_bytes == 2 * 4 * MIB   # whole huge pages


def test_a_view_keeps_its_mapping_in_use() -> None:
    pool = buffers.Pool()
    whole = _tensor(pool, 2 * MIB)
    whole.fill_(7)
    view = whole[MIB:].view(torch.int32)
    address = whole.data_ptr()
    del whole
    other = _tensor(pool, 2 * MIB)
    assert other.data_ptr() != address
    other.fill_(1)
    assert view.eq(0x07070707).all()   # untouched by the other tensor
    del view, other
    assert _tensor(pool, 2 * MIB).data_ptr() == address   # free again


def test_sizes_are_kept_apart_and_small_ones_take_whole_pages() -> None:
    pool = buffers.Pool()
    a = _tensor(pool, MIB)
    address = a.data_ptr()
    del a
    assert _tensor(pool, 3 * MIB).data_ptr() != address   # another size: another mapping
    assert _tensor(pool, MIB - 100).data_ptr() == address  # the same whole pages
    assert pool.kept_bytes == MIB + 4 * MIB


def test_the_pool_keeps_at_most_keep_bytes_and_evicts_only_free_mappings() -> None:
    pool = buffers.Pool(keep_bytes=8 * MIB)
    held = [_tensor(pool, 4 * MIB), _tensor(pool, 4 * MIB)]
    extra = _tensor(pool, 4 * MIB)   # over the limit, all kept ones in use: made, not kept
    assert pool.kept_bytes == 8 * MIB
    held[0].fill_(3)
    del extra
    freed = held.pop(1).data_ptr()
    # A new size needs room: the free mapping goes, the one in use stays and keeps its bytes.
    assert _tensor(pool, 2 * MIB).data_ptr() != freed
    assert pool.kept_bytes == 4 * MIB + 2 * MIB
    assert held[0].eq(3).all()


def test_threads_never_share_a_mapping() -> None:
    pool = buffers.Pool(keep_bytes=64 * MIB)
    errors: list[str] = []

    def work(mark: int) -> None:
        for _ in range(200):
            t = _tensor(pool, 2 * MIB)
            t.fill_(mark)
            torch.ops.aten.add(t, 0)   # give the other threads a turn
            if not t.eq(mark).all():
                errors.append(f"thread {mark} found another's bytes")
                return

    threads = [threading.Thread(target=work, args=(m,)) for m in range(1, 5)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors


def test_decode_reuses_a_dropped_tensor_and_never_a_live_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(buffers, "RECEIVE", buffers.Pool())   # no mappings left over by other tests
    tag = wire_pb2.MinibatchTag(vw=0, minibatch=1)
    sent = [("x", torch.arange(MIB // 2, dtype=torch.float32))]   # 2 MiB: pooled
    first = wire.decode(wire.encode(sent, minibatch=tag)).tensors[0][1]
    address = first.data_ptr()
    kept = wire.decode(wire.encode([("x", -sent[0][1])], minibatch=tag)).tensors[0][1]
    assert kept.data_ptr() != address
    assert torch.equal(first, sent[0][1])   # the second decode did not write into the first
    del first
    again = wire.decode(wire.encode(sent, minibatch=tag)).tensors[0][1]
    assert again.data_ptr() == address and torch.equal(again, sent[0][1])
    assert torch.equal(kept, -sent[0][1])


def test_a_refused_bundle_leaves_the_pool_as_it_found_it(monkeypatch: pytest.MonkeyPatch) -> None:
    pool = buffers.Pool()
    monkeypatch.setattr(buffers, "RECEIVE", pool)
    header = wire_pb2.TensorFrame(minibatch=wire_pb2.MinibatchTag(vw=0, minibatch=1), data=b"x" * 100)
    header.tensors.add(name="x", dtype=wire_pb2.UINT8, shape=[4 * MIB])   # declares 4 MiB, sends 100 bytes
    for _ in range(3):
        with pytest.raises(wire.WireError, match="byte length 100 does not match"):
            wire.decode([header.SerializeToString()])
        assert pool.kept_bytes == 0
    sent = [("x", torch.ones(4 * MIB, dtype=torch.uint8))]
    wire.decode(wire.encode(sent, minibatch=wire_pb2.MinibatchTag(vw=0, minibatch=2)))
    assert pool.kept_bytes == 4 * MIB   # a whole bundle's mapping is kept

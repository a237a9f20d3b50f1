"""CUDA IPC between GPU stages on one host (hetpipe/cuda_ipc.py): handles are checked before
anything is mapped, and, on a GPU, a bundle crosses to another process intact, a stale or forged
handle is refused there, and a sender whose slots are all in flight falls back to host memory.

The receiving side runs in a spawned process: CUDA refuses to open a handle in the process that
exported it. Handles travel to it as serialized protobuf, as on the wire."""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Iterator
from multiprocessing.connection import Connection

import grpc
import pytest
import torch

from hetpipe import cuda_ipc, shm
from hetpipe.v1 import wire_pb2

Code = grpc.StatusCode
GOOD = wire_pb2.CudaRef(handle=b"\x02c" + b"\x01" * 64, storage_bytes=4096, ref_counter_handle=b"/torch_12_345_6",
                        ref_counter_offset=9999)


def _ref(**fields: object) -> wire_pb2.CudaRef:
    ref = wire_pb2.CudaRef()
    ref.CopyFrom(GOOD)
    for key, value in fields.items():
        setattr(ref, key, value)
    return ref


@pytest.mark.parametrize(("ref", "nbytes", "match"), [
    (_ref(handle=b""), 16, "CUDA IPC handle of 0 bytes, not a plain allocation's"),
    (_ref(handle=b"\x01" * 64), 16, "CUDA IPC handle of 64 bytes"),
    # An expandable segment's handle names file descriptors in the process its pid field names.
    (_ref(handle=b"\x02e" + b"\x00" * 64), 16, "not a plain allocation's"),
    (GOOD, 4097, "claims 4097 bytes of a 4096-byte slot"),
    (_ref(ref_counter_handle=b"/dev/shm/../../etc/passwd"), 16, "reference counter .* is not torch's"),
    (_ref(ref_counter_handle=b"/torch_1_2"), 16, "is not torch's"),
    # The receiver decrements an int64 at this offset of an 80,000-byte file when it drops the slot.
    (_ref(ref_counter_offset=10_000), 16, "reference counter offset 10000, at most 9999"),
])
def test_a_malformed_cuda_handle_is_refused_before_anything_is_opened(ref: wire_pb2.CudaRef, nbytes: int,
                                                                      match: str) -> None:
    with pytest.raises(cuda_ipc.HandleError, match=match) as info:
        cuda_ipc.check_ref(ref, nbytes)
    assert info.value.code == Code.INVALID_ARGUMENT
    cuda_ipc.check_ref(GOOD, 4096)   # the well-formed one passes


def test_the_slot_header_is_checked_before_the_gpu_memory_is_mapped() -> None:
    """An Opener reads the slot's seqlock header first: a stale or unwritten version is refused
    without a CUDA call (none is made here, on a machine without a GPU)."""
    header = shm.Segment(0)
    try:
        header.begin()
        version = header.end()
        opener = cuda_ipc.Opener(shm.Reader(), torch.device("cuda:0"))
        ref = wire_pb2.ShmRef(name=header.name, version=version, nbytes=16)
        header.begin()   # the sender is writing the slot again: the handle we hold is stale
        with pytest.raises(cuda_ipc.HandleError, match="stale shared-memory handle") as info:
            opener.open(GOOD, ref, 16)
        assert info.value.code == Code.FAILED_PRECONDITION
        with pytest.raises(cuda_ipc.HandleError, match="holds 16 bytes, the shapes in the header 8"):
            opener.open(GOOD, ref, 8)
        with pytest.raises(cuda_ipc.HandleError, match="is not a written one"):
            opener.open(GOOD, wire_pb2.ShmRef(name=header.name, version=version + 1, nbytes=16), 16)
    finally:
        header.close()


class _Mapped:
    """Stands in for a mapped slot: counts the releases of torch's counter, as its deleter would."""

    drops = 0

    def __del__(self) -> None:
        _Mapped.drops += 1


def test_each_share_is_mapped_once_and_dropped_once_its_slot_is_gone(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch decrements a share's counter when the receiver drops its mapping: mapping one share
    twice (a retry beside its original), or again after dropping it, would decrement it twice and
    leave the sender's block allocated for good. Without a GPU, the CUDA calls are stood in for."""
    opened: list[bytes] = []

    def new_shared_cuda(device: int, handle: bytes, *rest: object) -> _Mapped:
        assert device == 0 and rest[-2:] == (b"", False), "the share's event is not waited on"
        opened.append(handle)
        return _Mapped()

    monkeypatch.setattr(torch.UntypedStorage, "_new_shared_cuda", staticmethod(new_shared_cuda), raising=False)
    monkeypatch.setattr(torch.cuda, "_lazy_init", lambda: None)
    opener = cuda_ipc.Opener(shm.Reader(), torch.device("cuda"), limit=2)
    headers = [shm.Segment(0) for _ in range(3)]
    try:
        refs = []
        for i, header in enumerate(headers):
            header.begin()
            refs.append((_ref(handle=b"\x02c" + bytes([i]) * 64), wire_pb2.ShmRef(name=header.name, version=header.end(),
                                                                                 nbytes=16)))
        _Mapped.drops = 0
        for cuda, header_ref in refs[:2] * 3:
            opener.open(cuda, header_ref, 16)
        assert len(opened) == 2 and _Mapped.drops == 0, "each share mapped once, and kept"
        with pytest.raises(cuda_ipc.HandleError, match="2 CUDA IPC slots mapped already, at most 2") as info:
            opener.open(*refs[2], 16)
        assert info.value.code == Code.RESOURCE_EXHAUSTED and len(opened) == 2
        headers[0].close()   # its sender closed the slot: the mapping goes, and no handle can name it again
        opener.open(*refs[2], 16)
        assert len(opened) == 3 and _Mapped.drops == 1
        # Refused by the header's reader (its segment is gone) or, were it still mapped, by the opener.
        with pytest.raises(cuda_ipc.HandleError, match="its slot was closed by its sender|segment .* does not exist") as info:
            opener.open(*refs[0], 16)
        assert info.value.code == Code.FAILED_PRECONDITION and len(opened) == 3
    finally:
        for header in headers[1:]:
            header.close()


# --- on a GPU: a receiving process --------------------------------------------------------------

SPECS = [(torch.float32, [1000, 3]), (torch.bfloat16, [7]), (torch.int64, [5, 2]), (torch.bool, [9]),
         (torch.float64, [])]


def _receiver(conn: Connection) -> None:
    """Opens each (CudaRef, ShmRef) it is sent and answers the tensors' values, or the refusal."""
    torch.cuda.init()
    opener = cuda_ipc.Opener(shm.Reader(), torch.device("cuda:0"))
    specs = [(dtype, shape, _numel(shape) * dtype.itemsize) for dtype, shape in SPECS]
    while (msg := conn.recv()) is not None:
        cuda, header = wire_pb2.CudaRef.FromString(msg[0]), wire_pb2.ShmRef.FromString(msg[1])
        try:
            tensors = opener.open(cuda, header, sum(n for _, _, n in specs)).copy_out(specs)
        except cuda_ipc.HandleError as exc:
            conn.send(("refused", exc.code.name, str(exc)))
        else:
            assert all(t.device == torch.device("cuda:0") for t in tensors)
            conn.send(("ok", [t.cpu().double().tolist() for t in tensors]))


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _bundle(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for dtype, shape in SPECS:
        if dtype == torch.bool:
            out.append(torch.rand(shape, generator=g) > 0.5)
        elif dtype.is_floating_point:
            out.append(torch.randn(shape, generator=g).to(dtype))
        else:
            out.append(torch.randint(-100, 100, shape, generator=g, dtype=dtype))
    return [t.cuda() for t in out]


@pytest.fixture()
def receiver() -> Iterator[Connection]:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_receiver, args=(child,), daemon=True)
    proc.start()
    try:
        yield parent
    finally:
        parent.send(None)
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()


def _send(conn: Connection, refs: tuple[wire_pb2.ShmRef, wire_pb2.CudaRef]) -> tuple:
    conn.send((refs[1].SerializeToString(), refs[0].SerializeToString()))
    assert conn.poll(60), "the receiver did not answer"
    return conn.recv()


@pytest.mark.cuda
@pytest.mark.timeout(120)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_bundle_crosses_to_another_process_and_a_stale_or_forged_handle_does_not(receiver: Connection) -> None:
    ring = cuda_ipc.Ring(torch.device("cuda:0"), slots=1)
    try:
        first = _bundle(1)
        staged = ring.stage(first)
        assert staged is not None
        assert ring.stage(_bundle(9)) is None, "with its one slot in flight, the sender goes through the host"
        refs = ring.refs(staged)
        assert refs == ring.refs(staged), "a retried call names the same version"
        got = _send(receiver, refs)
        assert got[0] == "ok", got
        assert got[1] == [t.cpu().double().tolist() for t in first]
        ring.release(staged)

        again = ring.stage(_bundle(2))   # the same slot, rewritten: the first handle is stale now
        assert again is not None
        stale = _send(receiver, refs)
        assert stale[0] == "refused" and stale[1] == "FAILED_PRECONDITION" and "stale" in stale[2], stale
        fresh = ring.refs(again)
        assert _send(receiver, fresh)[1] == [t.cpu().double().tolist() for t in _bundle(2)]

        forged = wire_pb2.CudaRef()
        forged.CopyFrom(fresh[1])
        forged.handle = forged.handle[:2] + bytes(len(forged.handle) - 2)   # well formed, names no allocation
        refused = _send(receiver, (fresh[0], forged))
        assert refused[0] == "refused" and refused[1] == "FAILED_PRECONDITION", refused
        ring.release(again)
    finally:
        ring.close()


def _share_and_exit(conn: Connection) -> None:
    """A GPU sender's life in short: shares a slot, then ends as a service does (exit_now's clean-up,
    then os._exit), reporting its counter file before and after the clean-up."""
    import os

    ring = cuda_ipc.Ring(torch.device("cuda:0"), slots=1)
    staged = ring.stage(_bundle(1))
    assert staged is not None
    counter = ring.refs(staged)[1].ref_counter_handle.decode().lstrip("/")
    before = (shm.SHM_DIR / counter).exists()
    cuda_ipc.unlink_counters()
    conn.send((counter, before, (shm.SHM_DIR / counter).exists()))
    conn.close()
    os._exit(0)


@pytest.mark.cuda
@pytest.mark.timeout(120)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_sender_removes_torchs_counter_files_before_it_exits() -> None:
    """A service ends with os._exit, which skips torch's own clean-up of the reference-counter
    file its shares use: exit_now removes them (cuda_ipc.unlink_counters), or each GPU sender
    would leave one in /dev/shm. In a child process: torch's clean-up at this process's exit
    aborts it when the file it would remove is gone."""
    parent, child = mp.get_context("spawn").Pipe()
    proc = mp.get_context("spawn").Process(target=_share_and_exit, args=(child,))
    proc.start()
    try:
        assert parent.poll(90), "the sharing process reported nothing"
        counter, before, after = parent.recv()
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    assert before, f"sharing a slot made no counter file {counter}"
    assert not after, f"{counter} is still in /dev/shm"
    assert not (shm.SHM_DIR / counter).exists()
    assert proc.exitcode == 0

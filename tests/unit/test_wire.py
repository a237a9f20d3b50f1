"""The tensor wire codec: round trips, wire compatibility of the raw-bytes path, and rejections."""

from __future__ import annotations

import mmap
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import grpc
import pytest
import torch

from hetpipe import buffers, rpc, wire
from hetpipe.v1 import stage_pb2_grpc, wire_pb2
from stage_worker.servicer import StageServicer

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.uint8, torch.bool]
SHAPES = [(3, 5), (), (0,), (2, 0, 3), (1, 1, 1, 1, 1, 1, 1, 7)]


def _sample(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g, dtype=torch.float64) * 1e3).to(dtype)
    return torch.randint(0, 250, shape, generator=g).to(dtype)


def _messages(frames: Iterable[bytes]) -> list[wire_pb2.TensorFrame]:
    return [wire_pb2.TensorFrame.FromString(f) for f in frames]


def _reference_frames(tensors: list[tuple[str, torch.Tensor]], chunk_bytes: int = rpc.CHUNK_BYTES,
                      **tags: Any) -> list[bytes]:
    """The frames as the protobuf library itself writes them, built from the .proto's description
    (header and metas in the first frame; each tensor's bytes cut every chunk_bytes, and
    consecutive pieces sharing a frame while they fit in chunk_bytes)."""
    first = wire_pb2.TensorFrame(tensors=[wire_pb2.TensorMeta(name=n, dtype=wire.wire_dtype(t.dtype),
                                                              shape=list(t.shape)) for n, t in tensors], **tags)
    pieces = [raw[start:start + chunk_bytes] for _, t in tensors
              for raw in [t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()]
              for start in range(0, len(raw), chunk_bytes)]
    chunks: list[bytes] = []
    for piece in pieces:
        if chunks and len(chunks[-1]) + len(piece) <= chunk_bytes:
            chunks[-1] += piece
        else:
            chunks.append(piece)
    if chunks:
        first.data = chunks[0]
    frames = [first] + [wire_pb2.TensorFrame(data=c) for c in chunks[1:]]
    return [f.SerializeToString() for f in frames]


# The ways frames reach decode: protobuf objects (a generated client or registration), and
# encode's bytes (this project's clients and servers: rpc.Stub and rpc.add_service).
PATHS: dict[str, Callable[..., list[Any]]] = {
    "messages": lambda tensors, **kw: _messages(wire.encode(tensors, **kw)),
    "raw": lambda tensors, **kw: list(wire.encode(tensors, **kw)),
}


def _assert_same(got: list[tuple[str, torch.Tensor]], want: list[tuple[str, torch.Tensor]]) -> None:
    assert [n for n, _ in got] == [n for n, _ in want]
    for (name, g), (_, w) in zip(got, want):
        assert g.dtype == w.dtype, name
        assert g.shape == w.shape, name
        # Bitwise, so that NaN payloads and -0.0 would be caught too.
        assert torch.equal(g.reshape(-1).view(torch.uint8), w.contiguous().reshape(-1).view(torch.uint8)), name


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_round_trip_every_dtype_and_shape(path: str, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    tensors = [("t", _sample(dtype, shape))]
    bundle = wire.decode(PATHS[path](tensors))
    _assert_same(bundle.tensors, tensors)
    assert bundle.tensors[0][1].is_contiguous()


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("chunk_bytes", [1, 7, 64, 1000])
def test_tensors_spanning_many_chunks(path: str, chunk_bytes: int) -> None:
    tensors = [
        ("a", _sample(torch.float64, (13, 11), seed=1)),
        ("empty", torch.zeros(0, 4)),
        ("b", _sample(torch.bfloat16, (37,), seed=2)),
        ("scalar", torch.tensor(3.5)),
        ("mask", _sample(torch.bool, (5, 3), seed=3)),
    ]
    frames = PATHS[path](tensors, chunk_bytes=chunk_bytes)
    nbytes = sum(t.numel() * t.element_size() for _, t in tensors)
    # Chunks never span two tensors, so there are at least this many frames.
    assert len(frames) >= -(-nbytes // chunk_bytes)
    _assert_same(wire.decode(frames).tensors, tensors)


def test_frames_respect_chunk_bytes_and_only_the_first_has_a_header() -> None:
    tensors = [("x", _sample(torch.float32, (1000,)))]
    frames = _messages(wire.encode(tensors, chunk_bytes=1024, minibatch=wire_pb2.MinibatchTag(vw=1, minibatch=2)))
    assert [len(f.data) for f in frames] == [1024, 1024, 1024, 928]
    assert frames[0].HasField("minibatch") and list(frames[0].tensors)
    assert all(f.WhichOneof("header") is None and not f.tensors for f in frames[1:])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_large_tensors_decode_into_the_receive_pool(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype) -> None:
    """A tensor of POOLED_FROM_BYTES or more lands in a mapping of the receive pool, which the
    pool hands out again once the tensor is gone; a smaller one never touches the pool."""
    monkeypatch.setattr(wire, "POOLED_FROM_BYTES", 64)  # the real bound is 1 MiB
    pool = buffers.Pool()  # a fresh pool: RECEIVE's mappings are the whole process's
    monkeypatch.setattr(buffers, "RECEIVE", pool)
    tensors = [("big", _sample(dtype, (40, 9))), ("small", _sample(dtype, (3,)))]
    got = wire.decode(wire.encode(tensors, chunk_bytes=100)).tensors
    _assert_same(got, tensors)
    big = got[0][1]
    big.zero_()  # writable, and no longer tied to anything of the sender's
    assert not big.any()
    # One page (the big tensor's 360 to 2880 bytes) kept; the small one would have taken a second
    # page, as the big one still holds the first.
    assert pool.kept_bytes == mmap.PAGESIZE
    address, nbytes = big.data_ptr(), big.numel() * big.element_size()
    del got, big
    # The big tensor's mapping, free again, is the one the pool hands out next.
    assert torch.frombuffer(pool.take(nbytes), dtype=torch.uint8).data_ptr() == address
    assert pool.kept_bytes == mmap.PAGESIZE


def test_non_contiguous_tensors_travel_by_value() -> None:
    base = _sample(torch.float32, (6, 4))
    tensors = [("t", base.t()), ("s", base[:, 1])]
    _assert_same(wire.decode(wire.encode(tensors, chunk_bytes=5)).tensors, tensors)


@pytest.mark.parametrize("path", PATHS)
def test_header_tags_survive_and_data_is_cleared(path: str) -> None:
    tag = wire_pb2.MinibatchTag(vw=3, minibatch=17, weight_version=9, stage=2)
    tensors = [("activation", _sample(torch.float32, (4, 4))), ("target", torch.arange(4))]
    bundle = wire.decode(PATHS[path](tensors, minibatch=tag, chunk_bytes=16))
    assert bundle.header.WhichOneof("header") == "minibatch"
    assert bundle.header.minibatch == tag
    assert bundle.header.data == b""
    assert [m.name for m in bundle.header.tensors] == ["activation", "target"]
    assert list(bundle.named()) == ["activation", "target"]

    push = wire_pb2.PushTag(vw=1, clock=5)
    bundle = wire.decode(PATHS[path](tensors, push=push))
    assert bundle.header.WhichOneof("header") == "push"
    assert bundle.header.push == push


@pytest.mark.parametrize("path", PATHS)
def test_bundle_without_bytes(path: str) -> None:
    tag = wire_pb2.MinibatchTag(vw=0, minibatch=1)
    for tensors in ([], [("e", torch.zeros(0, 3))]):
        frames = PATHS[path](tensors, minibatch=tag)
        assert len(frames) == 1
        bundle = wire.decode(frames)
        assert bundle.header.minibatch == tag
        _assert_same(bundle.tensors, tensors)


def test_frames_are_byte_identical_to_protobuf_serialization() -> None:
    tensors = [("a", _sample(torch.float32, (300,))), ("b", _sample(torch.int64, (3, 100)))]
    tag = wire_pb2.MinibatchTag(vw=1, minibatch=2)
    for chunk_bytes in (1, 100, 127, 128, 16384, 1 << 20):
        want = _reference_frames(tensors, chunk_bytes, minibatch=tag)
        assert list(wire.encode(tensors, minibatch=tag, chunk_bytes=chunk_bytes)) == want


@pytest.mark.parametrize("chunk_bytes", [100, 1000, 70000])  # 1-, 2- and 3-byte length varints
def test_raw_data_frames_skip_the_protobuf_parser(monkeypatch: pytest.MonkeyPatch, chunk_bytes: int) -> None:
    parsed: list[object] = []
    real = wire_pb2.TensorFrame.FromString

    def counting(frame: bytes) -> wire_pb2.TensorFrame:
        parsed.append(frame)
        return real(frame)

    monkeypatch.setattr(wire_pb2.TensorFrame, "FromString", counting)
    tensors = [("x", _sample(torch.float32, (50000,)))]
    frames = list(wire.encode(tensors, chunk_bytes=chunk_bytes))
    _assert_same(wire.decode(frames).tensors, tensors)
    assert len(frames) > 2
    assert parsed == [frames[0]]  # the header frame only


def test_data_frames_written_by_protobuf_in_other_field_layouts_still_decode() -> None:
    # A data frame that is not the canonical tag+length+payload (here the payload is given twice,
    # which protobuf resolves as last-one-wins) must fall back to the protobuf parser, not be misread.
    header = wire_pb2.TensorFrame(tensors=[wire_pb2.TensorMeta(name="x", dtype=wire_pb2.UINT8, shape=[4])])
    twice = wire_pb2.TensorFrame(data=b"zz").SerializeToString() + wire_pb2.TensorFrame(data=b"ab").SerializeToString()
    last = wire_pb2.TensorFrame(data=b"cd").SerializeToString()
    bundle = wire.decode([header.SerializeToString(), twice, last])
    assert bytes(bundle.tensors[0][1].numpy()) == b"abcd"


def test_decoded_tensors_are_writable_and_independent_of_the_frames() -> None:
    frames = list(wire.encode([("x", torch.zeros(8))], chunk_bytes=8))
    x = wire.decode(frames).tensors[0][1]
    x += 1
    assert torch.equal(wire.decode(frames).tensors[0][1], torch.zeros(8))


def test_unsupported_dtype_is_refused_on_encode() -> None:
    with pytest.raises(ValueError, match="complex64"):
        list(wire.encode([("c", torch.zeros(2, dtype=torch.complex64))]))


# --- rejections ----------------------------------------------------------------------------


def _header(*metas: wire_pb2.TensorMeta, data: bytes = b"") -> wire_pb2.TensorFrame:
    return wire_pb2.TensorFrame(minibatch=wire_pb2.MinibatchTag(vw=0, minibatch=1), tensors=list(metas), data=data)


def _meta(dtype: Any = wire_pb2.FLOAT32, shape: tuple[int, ...] = (2,), name: str = "x") -> wire_pb2.TensorMeta:
    return wire_pb2.TensorMeta(name=name, dtype=dtype, shape=list(shape))


def _reject(frames: list[wire_pb2.TensorFrame], match: str) -> None:
    """Each bad stream must be refused the same way as messages and as serialized bytes."""
    for form in (frames, [f.SerializeToString() for f in frames]):
        with pytest.raises(wire.WireError, match=match) as info:
            wire.decode(form)
        assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_empty_stream_is_rejected() -> None:
    forms: list[Iterable[wire_pb2.TensorFrame]] = [[], iter(())]
    for form in forms:
        with pytest.raises(wire.WireError, match="empty tensor stream") as info:
            wire.decode(form)
        assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.parametrize("code", [wire_pb2.DTYPE_UNSPECIFIED, 99])
def test_unknown_dtype_is_rejected(code: int) -> None:
    _reject([_header(_meta(dtype=code), data=b"\0" * 8)], f"unknown dtype code {code}")


def test_negative_dimension_is_rejected() -> None:
    _reject([_header(_meta(shape=(2, -1), name="act"))], r"tensor 0 \(act\): negative dimension in shape \[2, -1\]")


@pytest.mark.parametrize("shape", [(1 << 40, 1 << 40), (1 << 62, 1 << 62, 1 << 62), (1 << 33,)])
def test_absurd_shape_is_rejected_before_allocating(shape: tuple[int, ...]) -> None:
    _reject([_header(_meta(shape=shape))], "bytes, more than the .* allowed")


def test_too_many_dimensions_are_rejected() -> None:
    _reject([_header(_meta(shape=(1,) * (wire.MAX_NDIM + 1)))], f"{wire.MAX_NDIM + 1} dims, at most {wire.MAX_NDIM}")


def test_bundle_over_the_total_limit_is_rejected() -> None:
    half = wire.MAX_BUNDLE_BYTES // 2 // 4 + 1
    _reject([_header(_meta(shape=(half,), name="a"), _meta(shape=(half,), name="b"))], "bundle of .* bytes exceeds")


def test_too_few_bytes_are_rejected() -> None:
    _reject([_header(_meta(shape=(4,)), data=b"\0" * 12)], r"byte length 12 does not match .* \(16 bytes\)")
    _reject([_header(_meta(shape=(4,)), data=b"\0" * 8), wire_pb2.TensorFrame(data=b"\0" * 4)], "byte length 12 does not match")


def test_too_many_bytes_are_rejected() -> None:
    _reject([_header(_meta(shape=(2,)), data=b"\0" * 12)], r"byte length 12\+ does not match .* \(8 bytes\)")
    _reject([_header(_meta(shape=(2,)), data=b"\0" * 8), wire_pb2.TensorFrame(data=b"\0")], r"byte length 9\+ does not match")
    _reject([_header(), wire_pb2.TensorFrame(data=b"\0")], r"byte length 1\+ does not match .* \(0 bytes\)")


@pytest.mark.parametrize(
    "late",
    [
        wire_pb2.TensorFrame(minibatch=wire_pb2.MinibatchTag(vw=0, minibatch=2), data=b"\0" * 4),
        wire_pb2.TensorFrame(push=wire_pb2.PushTag(vw=0, clock=1)),
        wire_pb2.TensorFrame(tensors=[_meta()], data=b"\0" * 4),
    ],
    ids=["minibatch", "push", "metas"],
)
def test_header_repeated_after_the_first_frame_is_rejected(late: wire_pb2.TensorFrame) -> None:
    _reject([_header(_meta(shape=(2,)), data=b"\0" * 4), late], "header fields repeated after the first frame")


def test_malformed_bytes_are_rejected() -> None:
    good = _header(_meta(shape=(2,))).SerializeToString()
    # A data field whose length runs past the end of the frame, and a lone field tag.
    for bad in (b"\x4a\x10abc", b"\x4a", b"\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff"):
        for frames in ([bad], [good, bad]):
            with pytest.raises(wire.WireError, match="malformed TensorFrame") as info:
                wire.decode(frames)
            assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT


# --- over gRPC: the Stage service's registration and the links' raw call -------------------


class _Recorder:
    """Stands in for StageRuntime: keeps what arrives."""

    gpu = None

    def __init__(self) -> None:
        self.bundles: list[wire.Bundle] = []

    def check_forward(self, stream: wire.Stream) -> None:
        """Takes any header: what the codec itself refuses is what these tests look at."""

    def offer_forward(self, bundle: wire.Bundle) -> None:
        self.bundles.append(bundle)


@pytest.fixture()
def stage_server() -> Iterator[tuple[str, _Recorder]]:
    recorder = _Recorder()
    server = rpc.Server("127.0.0.1", 0, workers=2)
    server.add("Stage", StageServicer(recorder, lambda: None))  # type: ignore[arg-type]
    server.start()
    try:
        yield server.address, recorder
    finally:
        server.stop(grace=0)


def test_raw_and_generated_clients_both_reach_the_stage(stage_server: tuple[str, _Recorder]) -> None:
    address, recorder = stage_server
    tag = wire_pb2.MinibatchTag(vw=0, minibatch=4, stage=0)
    tensors = [("activation", _sample(torch.float32, (3, 1000))), ("target", torch.arange(3))]
    with rpc.channel(address) as channel:
        rpc.Stub(channel, "Stage").Forward(wire.encode(tensors, minibatch=tag, chunk_bytes=4096),
                                           timeout=rpc.CONTROL_DEADLINE_S)
        stub = stage_pb2_grpc.StageStub(channel)  # any gRPC client, written from the .proto
        stub.Forward(iter(_messages(wire.encode(tensors, minibatch=tag, chunk_bytes=4096))),
                     timeout=rpc.CONTROL_DEADLINE_S)
    assert len(recorder.bundles) == 2
    for bundle in recorder.bundles:
        _assert_same(bundle.tensors, tensors)
    assert recorder.bundles[0].header.minibatch == tag


def test_bad_stream_is_answered_with_invalid_argument(stage_server: tuple[str, _Recorder]) -> None:
    address, recorder = stage_server
    bad = [_header(_meta(shape=(2, -1)))]
    with rpc.channel(address) as channel:
        stub = stage_pb2_grpc.StageStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            stub.Forward(iter(bad), timeout=rpc.CONTROL_DEADLINE_S)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "negative dimension" in (info.value.details() or "")
        with pytest.raises(grpc.RpcError) as info:
            rpc.Stub(channel, "Stage").Forward(iter([b"\x4a\x10abc"]), timeout=rpc.CONTROL_DEADLINE_S)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "malformed TensorFrame" in (info.value.details() or "")
    assert recorder.bundles == []


class _Stub:
    """Stands in for a generated stub: records which call a bundle took, and what the sender's
    ring had written when the call began (before gRPC asks for the frames after the first)."""

    def __init__(self, ring: Any = None) -> None:
        self.ring, self.calls = ring, []

    def Push(self, frames: Iterator[bytes], **kwargs: Any) -> list[bytes]:
        self.calls.append(("stream", None if self.ring is None else self.ring.bytes_written))
        return list(frames)

    def PushFrame(self, frame: bytes, **kwargs: Any) -> list[bytes]:
        self.calls.append(("unary", None))
        return [frame]


@pytest.mark.parametrize("nbytes, chunk_bytes, call", [(4096, 1 << 20, "unary"), (0, 1 << 20, "unary"),
                                                        (1024, 1024, "unary"), (1028, 1024, "stream"),
                                                        (4096, 1024, "stream")])
def test_send_bundle_takes_the_unary_call_for_one_frame_without_asking_for_a_second(
        nbytes: int, chunk_bytes: int, call: str) -> None:
    tensors = [("x", torch.arange(nbytes // 4, dtype=torch.float32))]
    frames = wire.encode(tensors, chunk_bytes=chunk_bytes)
    stub = _Stub()
    sent = rpc.send_bundle(stub, "Push", frames)   # type: ignore[arg-type]
    assert [c for c, _ in stub.calls] == [call]
    (_, got), = wire.decode(sent).tensors
    assert torch.equal(got, tensors[0][1])
    # Any other iterator is asked for a second frame.
    stub = _Stub()
    rpc.send_bundle(stub, "Push", iter(list(wire.encode(tensors, chunk_bytes=chunk_bytes))))   # type: ignore[arg-type]
    assert [c for c, _ in stub.calls] == [call]


def test_a_bundle_in_shared_memory_chunks_starts_its_call_before_the_second_chunk_is_written() -> None:
    """The receiver copies a chunk out while the sender writes the next: the call must begin
    once the first chunk is written, not after the second (rpc.send_bundle used to peek at it)."""
    from hetpipe import shm

    ring = shm.Ring(slots=1, chunk_bytes=4096, whole_up_to=4096)
    try:
        tensors = [("x", torch.arange(3000, dtype=torch.float32))]   # 12000 bytes: 3 chunks
        stub = _Stub(ring)
        sent = rpc.send_bundle(stub, "Push", wire.encode(tensors, ring=ring))   # type: ignore[arg-type]
        assert stub.calls == [("stream", 4096)] and len(sent) == 3
        (_, got), = wire.decode(sent, reader=shm.Reader()).tensors
        assert torch.equal(got, tensors[0][1])
        stub = _Stub(ring)
        small = [("x", torch.ones(10))]
        assert rpc.send_bundle(stub, "Push", wire.encode(small, ring=ring)) and stub.calls == [("unary", None)]   # type: ignore[arg-type]
    finally:
        ring.close()


def test_a_cuda_handle_in_a_later_data_frame_is_refused() -> None:
    """Header fields after the first frame are INVALID_ARGUMENT (wire.read); a CUDA IPC handle
    there is one too, not silently dropped."""
    frames = [wire_pb2.TensorFrame.FromString(f) for f in wire.encode([("a", torch.arange(4, dtype=torch.float32))])]
    late = wire_pb2.TensorFrame()
    late.cuda.CopyFrom(wire_pb2.CudaRef(handle=b"\x02c" + b"\x01" * 64))
    with pytest.raises(wire.WireError) as info:
        wire.decode([f.SerializeToString() for f in [*frames, late]])
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT

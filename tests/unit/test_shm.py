"""The same-host fast path's segments (hetpipe/shm.py): bundles round-trip through a ring, a slot
overwritten while read is caught, segments never outlive their owner, and the transport rule."""

from __future__ import annotations

import ast
import mmap
import os
import secrets
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
import torch

from hetpipe import memcpy, shm, wire
from hetpipe.v1 import wire_pb2

pytestmark = pytest.mark.skipif(not shm.available(), reason="no writable /dev/shm")
REPO = Path(__file__).resolve().parents[2]


def _bundle() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [("w", torch.randn(3, 5, generator=g, dtype=torch.float64)), ("empty", torch.zeros(0, 4)),
            ("bf16", torch.randn(7, generator=g).to(torch.bfloat16)), ("mask", torch.tensor([True, False])),
            ("ids", torch.arange(6, dtype=torch.int64).view(2, 3)),
            ("large", torch.randn(20_000, generator=g))]  # copied without the GIL (memcpy.copy_bytes)


def _mine() -> set[str]:
    return {s for s in shm.segments() if s.startswith(f"{shm.PREFIX}{os.getpid()}-")}


@pytest.mark.parametrize("threads", [1, 3, 4])
def test_a_large_copy_split_over_threads_copies_every_byte_and_no_more(threads: int) -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        n = memcpy._SPLIT_FROM + 5   # parts of unequal sizes
        src = bytearray(os.urandom(n))
        dst = bytearray(n + 3)
        memcpy.copy_bytes(memoryview(dst)[:n], memoryview(src))
        assert dst[:n] == src and dst[n:] == b"\0\0\0"
    finally:
        torch.set_num_threads(before)


def test_bundles_round_trip_and_slots_are_reused() -> None:
    ring, reader = shm.Ring(slots=2), shm.Reader()
    before = _mine()   # in-process servers of earlier tests may own some
    try:
        names = []
        for _ in range(4):
            frames = list(wire.encode(_bundle(), ring=ring))
            assert len(frames) == 1, "the bytes travel in shared memory, the call carries one frame"
            got = wire.decode(frames, reader=reader).tensors
            assert [n for n, _ in got] == [n for n, _ in _bundle()]
            for (_, a), (_, b) in zip(got, _bundle()):
                assert a.dtype == b.dtype and torch.equal(a, b)
            names.append(wire.decode(frames, reader=reader).header)  # the header carries no handle
            assert not names[-1].HasField("shm")
        ours = _mine() - before
        assert len(ours) == 2, "two slots, each written twice: two segments"
        list(wire.encode([("big", torch.zeros(1 << 16))], ring=ring))  # larger than the slot: a new segment
        assert len(_mine() - before - ours) == 1 and len(_mine() & ours) == 1
    finally:
        ring.close()
    assert _mine() == before


def test_a_slot_overwritten_while_it_is_read_is_refused() -> None:
    ring, reader = shm.Ring(slots=1), shm.Reader()
    try:
        frames = list(wire.encode(_bundle(), ring=ring))
        stream = wire.read(frames, reader)              # the handle is current when opened ...
        list(wire.encode(_bundle(), ring=ring))         # ... and the sender reuses the slot meanwhile
        with pytest.raises(wire.WireError, match="stale shared-memory handle") as info:
            for _ in stream.pieces:
                pass
        assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION
    finally:
        ring.close()


def test_a_large_bundle_goes_in_chunks_each_written_as_its_frame_is_asked_for() -> None:
    """Over whole_up_to bytes a bundle travels a chunk a frame (tensors split where a chunk ends);
    a chunk is written only when its frame is asked for, so the receiver copies one out while the
    sender writes the next; the slot's segments are reused by the next bundle of the slot."""
    bundle = _bundle()
    nbytes = sum(t.numel() * t.element_size() for _, t in bundle)
    chunk = 10_000   # not a multiple of any tensor's size: tensors are split across chunks
    ring, reader = shm.Ring(slots=1, chunk_bytes=chunk, whole_up_to=chunk), shm.Reader()
    before = _mine()
    try:
        for round_ in range(2):
            frames = wire.encode(bundle, ring=ring)
            sent = [next(frames)]
            assert ring.bytes_written == (round_ * nbytes) + chunk, "only the first chunk is written yet"
            sent += list(frames)
            assert len(sent) == -(-nbytes // chunk) and ring.bytes_written == (round_ + 1) * nbytes
            assert not wire.read(sent, reader).whole, "in chunks: each chunk's version checked in turn"
            got = wire.decode(sent, reader=reader).tensors
            assert [n for n, _ in got] == [n for n, _ in bundle]
            assert all(a.dtype == b.dtype and torch.equal(a, b) for (_, a), (_, b) in zip(got, bundle))
            assert len(_mine() - before) == len(sent), "one segment a chunk, the same ones each round"
        small = list(wire.encode([("x", torch.ones(10))], ring=ring))   # whole again: the slot's first segment
        assert len(small) == 1 and torch.equal(wire.decode(small, reader=reader).tensors[0][1], torch.ones(10))
    finally:
        ring.close()
    assert _mine() == before


def test_a_ring_with_max_chunks_makes_larger_chunks_rather_than_more() -> None:
    """A link's ring (links.MAX_CHUNKS): a bundle of more than max_chunks chunks takes larger ones,
    so that the receiver's mappings (256) hold both its links' slots."""
    bundle = _bundle()
    nbytes = sum(t.numel() * t.element_size() for _, t in bundle)
    ring, reader = shm.Ring(slots=1, chunk_bytes=1_000, whole_up_to=1_000, max_chunks=3), shm.Reader()
    try:
        sent = list(wire.encode(bundle, ring=ring))
        sizes = [wire_pb2.TensorFrame.FromString(f).shm.nbytes for f in sent]
        assert len(sizes) == 3 and sum(sizes) == nbytes and max(sizes) == -(-nbytes // 3), sizes
        got = wire.decode(sent, reader=reader).tensors
        assert all(torch.equal(a, b) for (_, a), (_, b) in zip(got, bundle))
        small = list(wire.encode([("x", torch.ones(600))], ring=ring))   # 2400 bytes: chunks of 1000 again
        assert len(small) == 3
    finally:
        ring.close()


@pytest.mark.parametrize("chunk", [0, 1])
def test_a_chunk_overwritten_while_it_is_read_is_refused(chunk: int) -> None:
    """Each chunk is checked against its own version once it is copied out: here one chunk alone
    is written over while it is read (those before it checked already, those after still the
    bundle's)."""
    ring, reader = shm.Ring(slots=1, chunk_bytes=4096, whole_up_to=4096), shm.Reader()
    try:
        frames = list(wire.encode([("x", torch.zeros(3000))], ring=ring))   # 12000 bytes: 3 chunks
        assert len(frames) == 3
        stream = wire.read(frames, reader)
        pieces = iter(stream.pieces)
        for _ in range(chunk + 1):
            next(pieces)                                              # chunk `chunk` is being read ...
        again = wire.encode([("x", torch.ones(3000))], ring=ring)
        for _ in range(chunk + 1):
            next(again)                                               # ... when the sender writes it again
        with pytest.raises(wire.WireError, match="stale shared-memory handle") as info:
            for _ in pieces:
                pass
        assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION
    finally:
        ring.close()


def test_a_bundle_whose_call_ended_writes_no_chunk_once_a_later_one_has_its_slot() -> None:
    """gRPC's thread may ask an ended call's frames for one more after a retry took the slot:
    that late chunk is not written, so the retry's chunks stay as it sent them."""
    ring, reader = shm.Ring(slots=1, chunk_bytes=4096, whole_up_to=4096), shm.Reader()
    try:
        ended = wire.encode([("x", torch.zeros(3000))], ring=ring)
        next(ended)                                                   # the call that ended
        retry = list(wire.encode([("x", torch.ones(3000))], ring=ring))
        assert list(ended) == [], "the ended call's generator wrote on"
        (_, got), = wire.decode(retry, reader=reader).tensors
        assert torch.equal(got, torch.ones(3000))
    finally:
        ring.close()


def test_an_empty_bundle_takes_no_further_chunks() -> None:
    ring, reader = shm.Ring(slots=1), shm.Reader()
    try:
        (frame,) = messages = list(wire.encode([("none", torch.zeros(0))], ring=ring))
        assert wire.decode(messages, reader=reader).tensors[0][1].numel() == 0
        ref = wire_pb2.TensorFrame.FromString(frame).shm
        more = wire_pb2.TensorFrame(shm=ref).SerializeToString()   # an empty chunk after it
        with pytest.raises(wire.WireError, match="holds 0 bytes") as info:
            wire.decode([frame, more], reader=reader)
        assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        ring.close()


def test_a_reader_keeps_every_chunk_of_several_large_senders_mapped() -> None:
    """A shard reads every VW's large pushes, a segment a chunk: its reader keeps them all mapped
    (a mapping made anew faults its pages in again on every read)."""
    rings = [shm.Ring(slots=1, chunk_bytes=4096, whole_up_to=4096) for _ in range(4)]
    reader = shm.Reader()
    bundle = [("x", torch.arange(40_000.0))]   # 40 chunks a sender
    try:
        for ring in rings:
            wire.decode(list(wire.encode(bundle, ring=ring)), reader=reader)
        mapped = dict(reader._maps)
        for ring in rings:
            (_, got), = wire.decode(list(wire.encode(bundle, ring=ring)), reader=reader).tensors
            assert torch.equal(got, bundle[0][1])
        assert len(mapped) == 160 and all(reader._maps[name][0] is m for name, (m, _) in mapped.items()), \
            "a chunk's segment was mapped anew"
    finally:
        for ring in rings:
            ring.close()


def test_sweep_removes_a_killed_owners_segments_and_no_live_ones() -> None:
    """The launcher's part: a process killed with -9 cannot unlink its segments."""
    code = ("import sys, torch; from hetpipe import shm, wire; r = shm.Ring();"
            "list(wire.encode([('x', torch.ones(100))], ring=r)); print(shm.segments(), flush=True);"
            "sys.stdin.read()")
    mine = shm.Ring()
    procs = [subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True) for _ in range(2)]
    try:
        list(wire.encode([("x", torch.ones(10))], ring=mine))
        for proc in procs:
            assert proc.stdout is not None
            proc.stdout.readline()
        theirs = [[s for s in shm.segments() if s.startswith(f"{shm.PREFIX}{p.pid}-")] for p in procs]
        assert [len(t) for t in theirs] == [1, 1]
        procs[0].send_signal(signal.SIGKILL)
        procs[0].wait(10)
        assert theirs[0][0] in shm.segments(), "kill -9 leaves the segment behind"
        removed = shm.sweep()
        assert theirs[0][0] in removed and theirs[0][0] not in shm.segments()
        # The live owners' segments stay, this process's included: their owners hold the lock.
        assert theirs[1][0] in shm.segments() and _mine() and not set(removed) & _mine()
    finally:
        mine.close()
        for proc in procs:
            proc.kill()
            proc.wait(10)
        shm.sweep()


def test_an_owner_that_exits_unlinks_its_segments() -> None:
    code = ("import os, torch; from hetpipe import shm, service, wire; r = shm.Ring();"
            "list(wire.encode([('x', torch.ones(100))], ring=r));"
            "print([s for s in shm.segments() if s.startswith(f'hetpipe-{os.getpid()}-')], flush=True);"
            "service.exit_now()")   # os._exit: atexit does not run, exit_now must unlink them itself
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60, check=True)
    theirs = ast.literal_eval(out.stdout)
    assert len(theirs) == 1
    assert theirs[0] not in shm.segments()


@pytest.mark.parametrize(("transport", "a", "b", "want"), [
    ("auto", "h1", "h1", True), ("auto", "h1", "h2", False), ("auto", "", "", False), ("auto", "h1", "", False),
    ("grpc", "h1", "h1", False), ("grpc", "h1", "h2", False),
    ("shm", "h1", "h1", True), ("shm", "h1", "h2", "do not share"), ("shm", "", "h1", "unknown"),
])
def test_transport_rule(transport: str, a: str, b: str, want: bool | str) -> None:
    if isinstance(want, str):
        with pytest.raises(ValueError, match=want):
            shm.shared(transport, a, b)
    else:
        assert shm.shared(transport, a, b) is want


def test_host_identity_is_shared_by_processes_on_this_host() -> None:
    here = shm.host_id()
    there = subprocess.run([sys.executable, "-c", "from hetpipe import shm; print(shm.host_id())"], cwd=REPO,
                           capture_output=True, text=True, timeout=60, check=True).stdout.strip()
    assert here and here == there


def test_another_users_processes_are_another_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """Segments (0600) and link sockets take only their own user's peers: two users' stages on
    one machine go through gRPC, as on two machines, rather than fail."""
    here = shm.host_id()
    monkeypatch.setattr(os, "getuid", lambda: os.geteuid() + 1)
    assert shm.host_id() not in ("", here)


def test_sweep_leaves_a_segment_being_made_by_a_live_process() -> None:
    """Made, then locked: a sweep from another process in between must not take it (the owner's
    rename would then fail); one left half-made by a dead process goes."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(10)
    made = {pid: shm.SHM_DIR / f"{shm.PREFIX}{pid}-{os.urandom(8).hex()}.new" for pid in (os.getpid(), dead.pid)}
    try:
        for path in made.values():
            path.touch()
        removed = shm.sweep()
        assert made[os.getpid()].exists() and made[os.getpid()].name not in removed
        assert not made[dead.pid].exists() and made[dead.pid].name in removed
    finally:
        for path in made.values():
            path.unlink(missing_ok=True)


def test_a_full_dev_shm_sends_in_frames(monkeypatch: pytest.MonkeyPatch) -> None:
    """A container's /dev/shm is small (64 MiB by default): where it has no room the segment is
    refused at once (ENOSPC from fallocate, not SIGBUS on a later write) and the bundle travels
    in gRPC frames instead."""
    import errno

    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", full)
    # Whole, and in chunks: every chunk's segment is made before the first handle goes out.
    for ring in shm.Ring(), shm.Ring(chunk_bytes=4096, whole_up_to=4096):
        before = set(_mine())
        try:
            frames = list(wire.encode(_bundle(), ring=ring))
            assert not wire_pb2.TensorFrame.FromString(frames[0]).HasField("shm")
            got = wire.decode(frames, reader=shm.Reader()).tensors
            assert all(torch.equal(a, b) for (_, a), (_, b) in zip(got, _bundle()))
            assert set(_mine()) <= before and not list(shm.SHM_DIR.glob(f"{shm.PREFIX}{os.getpid()}-*.new"))
        finally:
            ring.close()


def test_a_dev_shm_that_fills_up_midway_through_a_bundles_chunks_sends_it_in_frames(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Every segment a bundle needs is made before its first handle goes out: where the third
    finds no room, the bundle goes in gRPC frames (a handle already sent could not be taken back)."""
    import errno

    real, made = os.posix_fallocate, [0]

    def third_full(fd: int, offset: int, length: int) -> None:
        made[0] += 1
        if made[0] == 3:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(fd, offset, length)

    monkeypatch.setattr(os, "posix_fallocate", third_full)
    ring, before = shm.Ring(chunk_bytes=4096, whole_up_to=4096), _mine()
    try:
        frames = list(wire.encode([("x", torch.arange(5000.0))], ring=ring))
        assert not any(wire_pb2.TensorFrame.FromString(f).HasField("shm") for f in frames)
        (_, got), = wire.decode(frames).tensors
        assert torch.equal(got, torch.arange(5000.0))
    finally:
        ring.close()
    assert _mine() == before


def _mapped_here(name: str) -> list[str]:
    """This process's mappings of segment `name` (an unlinked one's line ends in '(deleted)')."""
    return [line for line in Path("/proc/self/maps").read_text().splitlines() if line.endswith(name)
            or line.endswith(f"{name} (deleted)")]


def test_a_segment_its_owner_unlinked_is_refused_and_its_mapping_let_go() -> None:
    """A receiver's cached mapping outlives the segment's name: it must not answer a handle whose
    segment its owner closed (regrew, or ended with), and must not pin the segment's pages."""
    ring, reader = shm.Ring(slots=1), shm.Reader()
    frames = list(wire.encode(_bundle(), ring=ring))
    name = wire_pb2.TensorFrame.FromString(frames[0]).shm.name
    assert wire.decode(frames, reader=reader).tensors      # mapped, and kept
    ring.close()                                            # the owner unlinks it
    assert _mapped_here(name), "the reader keeps its mapping of the unlinked segment"
    with pytest.raises(wire.WireError, match=f"segment {name} does not exist") as info:
        wire.decode(frames, reader=reader)
    assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION
    del info
    assert not _mapped_here(name), "the mapping of an unlinked segment was kept"


def test_mappings_of_segments_that_are_gone_are_let_go_without_being_named_again(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A peer that ends or regrows its ring never names the old segments again: the reader lets go
    of them when it maps another segment or reads, once Reader.PRUNE_S has passed since it last
    looked (not at every new mapping: a cycle of more segments than it keeps would stat them all
    each time)."""
    monkeypatch.setattr(shm.Reader, "PRUNE_S", 3600.0)
    reader, rings = shm.Reader(), [shm.Ring(slots=1) for _ in range(4)]
    try:
        names = []
        for ring in rings[:3]:
            frames = list(wire.encode(_bundle(), ring=ring))
            names.append(wire_pb2.TensorFrame.FromString(frames[0]).shm.name)
            wire.decode(frames, reader=reader)
        kept = list(wire.encode(_bundle(), ring=rings[1]))
        rings[0].close()
        wire.decode(list(wire.encode(_bundle(), ring=rings[3])), reader=reader)   # a new mapping, too soon
        assert _mapped_here(names[0])
        monkeypatch.setattr(shm.Reader, "PRUNE_S", 0.0)
        wire.decode(list(wire.encode(_bundle(), ring=rings[3])), reader=reader)   # a cached one, due
        assert not _mapped_here(names[0]) and _mapped_here(names[1]) and _mapped_here(names[2])
        rings[2].close()
        wire.decode(list(wire.encode(_bundle(), ring=rings[3])), reader=reader)
        assert not _mapped_here(names[2]) and _mapped_here(names[1])
        wire.decode(kept, reader=reader)
    finally:
        for ring in rings:
            ring.close()


def test_a_streams_pieces_are_views_of_the_segment_as_the_reader_keeps_it_mapped() -> None:
    """What a GPU stage pins for a pull (host_copies.PinnedSlots): each piece's buffer is the
    reader's mapping of the segment, which the reader holds until the segment is gone."""
    ring, reader = shm.Ring(slots=1), shm.Reader()
    try:
        frames = list(wire.encode(_bundle(), ring=ring))
        stream = wire.read(frames, reader)
        assert stream.shared_memory and stream.whole   # one chunk: checked once, after its last piece
        mappings = {id(piece.obj): piece.obj for _, _, piece in stream.pieces}
        (mapping,) = mappings.values()
        assert isinstance(mapping, mmap.mmap) and reader.holds(mapping)
        ring.close()
        with pytest.raises(wire.WireError, match="does not exist"):
            wire.decode(frames, reader=reader)
        assert not reader.holds(mapping)
    finally:
        ring.close()


def test_a_segment_made_anew_under_a_name_is_mapped_anew() -> None:
    """The name's file is compared with the one mapped (inode), not only the name."""
    reader = shm.Reader()
    first, second = shm.Segment(shm.PAGE), shm.Segment(shm.PAGE)
    try:
        version = first.write([memoryview(b"old!" * 4)])
        ref = wire_pb2.ShmRef(name=first.name, version=version, nbytes=16)
        assert bytes(reader.open(ref, 16)[0]) == b"old!" * 4
        assert second.write([memoryview(b"new!" * 4)]) == version
        os.replace(second.path, first.path)                 # the name is another file now
        view, mapping = reader.open(ref, 16)
        assert bytes(view) == b"new!" * 4, "answered from the mapping of the file the name no longer is"
        view.release()
    finally:
        second.close()
        first.close()


def _encoded(tag: wire_pb2.MinibatchTag, ring: shm.Ring) -> list[bytes]:
    return list(wire.encode(_bundle(), ring=ring, minibatch=tag))


def test_a_segment_carries_one_senders_bundles() -> None:
    """A peer may not have a receiver take what another link's segment holds: a segment is bound
    to the sender of its first bundle that was taken, and a handle to it from another sender is
    refused and changes nothing. A refused handle binds nothing."""
    reader, ring = shm.Reader(), shm.Ring(slots=1)
    try:
        ours = _encoded(wire_pb2.MinibatchTag(vw=1, stage=0, minibatch=1), ring)
        stale = wire_pb2.TensorFrame.FromString(ours[0])
        stale.minibatch.vw, stale.shm.version = 0, stale.shm.version + 2
        with pytest.raises(wire.WireError, match="stale shared-memory handle"):
            wire.decode([stale.SerializeToString(), *ours[1:]], reader=reader)
        ref = wire_pb2.TensorFrame.FromString(ours[0]).shm
        too_many = wire_pb2.ShmRef(name=ref.name, version=ref.version, nbytes=1 << 30)
        with pytest.raises(shm.HandleError, match="claims 1073741824 bytes"):
            reader.open(too_many, too_many.nbytes, "vw 0 stage 0")
        assert wire.decode(ours, reader=reader).tensors, "a refused handle bound its claim"
        forged = wire_pb2.TensorFrame.FromString(ours[0])
        forged.minibatch.vw = 0
        with pytest.raises(wire.WireError, match=r"carries vw 1 stage 0's bundles, not vw 0 stage 0's") as info:
            wire.decode([forged.SerializeToString(), *ours[1:]], reader=reader)
        assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert wire.decode(ours, reader=reader).tensors, "the segment's own sender goes on"
    finally:
        ring.close()


def test_a_fifo_named_like_a_segment_blocks_no_one(tmp_path: Path) -> None:
    """Opening a FIFO for reading waits for a writer: the sweep must pass it by, and a handle
    naming it must be refused at once, not hang a server thread."""
    import threading

    fifo = shm.SHM_DIR / f"{shm.PREFIX}999999-00112233445566ff"
    os.mkfifo(fifo, 0o600)
    outcome: list[object] = []

    def both() -> None:
        outcome.append(shm.sweep())
        try:
            shm.Reader().open(wire_pb2.ShmRef(name=fifo.name, version=2, nbytes=4), 4)
        except shm.HandleError as exc:
            outcome.append(exc.code)

    try:
        worker = threading.Thread(target=both, daemon=True)
        worker.start()
        worker.join(10)
        assert not worker.is_alive(), "blocked opening the FIFO"
        assert fifo.name not in outcome[0] and outcome[1] == grpc.StatusCode.FAILED_PRECONDITION   # type: ignore[operator]
    finally:
        if worker.is_alive():   # let the blocked open go
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        fifo.unlink()


def test_a_segment_cut_short_after_it_was_mapped_is_refused_not_read() -> None:
    """Read through the old mapping, the cut pages would kill the receiver with SIGBUS: in a
    child, so that a regression kills it and not the suite."""
    code = """
import os
from hetpipe import shm
from hetpipe.v1 import wire_pb2
reader, segment = shm.Reader(), shm.Segment(shm.PAGE)
version = segment.write([memoryview(b"data" * 4)])
ref = wire_pb2.ShmRef(name=segment.name, version=version, nbytes=16)
view, _ = reader.open(ref, 16)
view.release()
os.truncate(segment.path, 0)
try:
    reader.open(ref, 16)
except shm.HandleError as exc:
    print(exc.code.name, exc)
segment.close()
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert done.returncode == 0, (done.returncode, done.stderr)
    assert done.stdout.startswith("INVALID_ARGUMENT") and "has no header" in done.stdout, done.stdout


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None, reason="needs root to play two users")
def test_sweep_survives_another_users_file_named_like_a_segment() -> None:
    """/dev/shm is world-writable and sticky: any user may leave a readable file named like a
    segment there, which no other user can unlink. A launcher's sweep (hetpipe run, a shard's
    restart, stop_all) must pass it by, not die of PermissionError."""
    foreign = shm.SHM_DIR / f"{shm.PREFIX}1-{secrets.token_hex(8)}"
    foreign.touch(mode=0o644)
    os.chmod(foreign, 0o644)
    os.chown(foreign, 65533, 65533)   # a third user's: this suite's own sweeps (root's) pass it by too
    try:
        code = "from hetpipe import shm; print(shm.sweep())"
        done = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                               sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                              env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=120)
        assert done.returncode == 0, done.stderr[-600:]
        assert foreign.exists()
    finally:
        foreign.unlink(missing_ok=True)


def test_a_handle_whose_name_has_non_ascii_digits_is_malformed() -> None:
    """A name that is no segment's (`hetpipe-<pid>-<16 hex>`, ASCII) is INVALID_ARGUMENT, not
    looked up in /dev/shm and answered FAILED_PRECONDITION as a segment that is gone."""
    ref = wire_pb2.ShmRef(name="hetpipe-\u0661\u0662-0123456789abcdef", version=2, nbytes=16)
    with pytest.raises(shm.HandleError) as info:
        shm.Reader().open(ref, 16)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT

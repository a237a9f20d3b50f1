"""The shard's push log (ps_server/durability.py; its entries' format, ps_server/log_entry.py):
what restore replays after a kill -9 and after a restart of the machine, files written over once
a checkpoint covers them, and the safetensors entries it writes itself."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from hetpipe import shm, wire
from hetpipe.buffers import raw_bytes
from hetpipe.v1 import wire_pb2
from hetpipe.weight_files import DTYPES
from ps_server import log_entry
from ps_server.durability import Durability
from ps_server.shard import Shard
from ps_server.sync_rule import SyncRule
from shard_reference import Kind, assert_refused, log_push, record_fsyncs, two_key_shard

pytestmark = pytest.mark.timeout(120)


def delta(key: str, shard: Shard, value: float = 1.0) -> tuple[str, torch.Tensor]:
    return key, torch.full_like(shard.values[key], value)


def push(shard: Shard, dur: Durability, vw: int, clock: int, deltas: list[tuple[str, torch.Tensor]]) -> None:
    """The servicer's WSP path: logged, applied from its entry, settled, then on disk before the
    acknowledgement."""
    seq, logged = log_push(dur, vw, clock, deltas)
    dur.place(seq)
    assert shard.push(vw, clock, logged)
    dur.settle(seq, applied=True)
    dur.sync(seq)


def files(dur: Durability) -> dict[str, int]:
    return {p.name: p.stat().st_ino for p in dur.log_dir.iterdir()}


def test_an_entry_not_yet_on_disk_is_replayed_after_a_kill_but_not_after_a_machine_restart(tmp_path: Path) -> None:
    """A kill -9 leaves a written entry whole in the page cache: restore replays it and puts it on
    disk, so that its push's retry (a duplicate) is acknowledged safely. A power cut may leave it
    torn (a spare's old pages mixed with new ones), so after a restart of the machine restore
    skips it: its push was never acknowledged, and its retry brings it back. A write cut short is
    never replayed, and an entry damaged on the disk is skipped, not fatal."""
    shard, dur = two_key_shard(2), Durability(str(tmp_path), every_clocks=100)
    dur.checkpoint(shard)
    unsynced, _ = log_push(dur, 0, 0, [delta("a", shard)])
    dur.place(unsynced)
    assert shard.push(0, 0, [delta("a", shard)])
    dur.settle(unsynced, applied=True)                         # applied; killed before sync()
    push(shard, dur, 1, 0, [delta("b", shard)])
    dur.pending_path(99).write_bytes(b"a write cut short")

    killed, after_kill = Shard(), Durability(str(tmp_path))
    assert after_kill.restore(killed) == 2
    assert killed.digest() == shard.digest()
    assert not dur.pending_path(99).exists()
    assert dur.entry_path(unsynced).exists() and not dur.written_path(unsynced).exists(), "not put on disk"

    unsynced, _ = log_push(after_kill, 0, 1, [delta("a", killed)])
    after_kill.place(unsynced)
    assert killed.push(0, 1, [delta("a", killed)])
    after_kill.settle(unsynced, applied=True)                  # applied; the machine lost power before sync()
    after_kill.boot_path.write_text("a boot before this one\n")
    rebooted = Shard()
    assert Durability(str(tmp_path)).restore(rebooted) == 2
    assert rebooted.clocks == {"a": [1, 0], "b": [0, 1]}, "vw 0's unacknowledged push was replayed after a power cut"
    assert not dur.written_path(unsynced).exists()
    assert rebooted.push(0, 1, [delta("a", killed)]), "its retry is applied"
    assert rebooted.digest() == killed.digest()

    entry = dur.entry_path(1)
    entry.write_bytes(entry.read_bytes()[:40])
    damaged = Shard()
    assert Durability(str(tmp_path)).restore(damaged) == 1
    assert damaged.clocks == {"a": [0, 0], "b": [0, 1]}


def test_a_start_after_a_machine_restart_that_dies_before_restore_leaves_the_old_entries_suspect(
        tmp_path: Path) -> None:
    """The folder's boot id vouches for its written entries: the first start after a power cut must
    not record its own until it has dropped those, or the next start replays what may be torn."""
    shard, dur = two_key_shard(2), Durability(str(tmp_path), every_clocks=100)
    dur.checkpoint(shard)
    unsynced, _ = log_push(dur, 0, 0, [delta("a", shard)])
    dur.place(unsynced)
    assert shard.push(0, 0, [delta("a", shard)])
    dur.settle(unsynced, applied=True)                 # applied; the machine lost power before sync()
    dur.boot_path.write_text("a boot before this one\n")
    Durability(str(tmp_path))                          # a start that dies before its restore
    again = Shard()
    assert Durability(str(tmp_path)).restore(again) == 0
    assert again.clocks["a"] == [0, 0], "an entry written before the machine restarted was replayed"
    assert dur.boot_path.read_text() != "a boot before this one\n", "restore records this boot once it is safe"


@pytest.mark.parametrize("rule", [SyncRule("wsp", exact=True), SyncRule("wsp", D=1)], ids=["D0-exact", "D1"])
def test_a_power_cut_keeps_the_acknowledged_pushes_of_a_vw_ahead_of_the_wave_it_took(
        tmp_path: Path, rule: SyncRule) -> None:
    """VW 0 shares the shard's machine and pushes through shared memory (acknowledged before its
    entry is on disk); VW 1, on another machine, pushes in frames (on disk first) and runs D + 1
    waves ahead, as G4 allows once VW 0's wave 0 is in. A power cut takes VW 0's entry, and
    VW 0 with it: replay keeps every push of VW 1, though G4 would refuse its last one now
    (c_global is back at 0). Exact pulls hold its waves, which go in, in wave then VW order, as
    soon as VW 0's pushes come again (or VW 0 is evicted): the state a shard that never lost
    power reaches, bit for bit. A live push past G4 is still refused. (Before, replay refused
    VW 1's last push, and its next one was then refused as skipping ahead.)"""
    lead = rule.lead
    assert lead is not None
    u = {(vw, wave): [("a", torch.randn(2, 3, dtype=torch.float64) * 1e-2)] for vw in range(2) for wave in range(lead + 3)}
    init = torch.randn(2, 3, dtype=torch.float64)
    shard, kept_power = Shard(), Shard()
    for s in (shard, kept_power):
        assert s.init(2, [("a", init.clone())], (), rule)
    dur = Durability(str(tmp_path), every_clocks=100)
    dur.checkpoint(shard)
    unsynced, logged = log_push(dur, 0, 0, u[(0, 0)])
    dur.place(unsynced)
    assert shard.push(0, 0, logged)
    dur.settle(unsynced, applied=True)                   # acknowledged through shared memory, not on disk
    for wave in range(lead + 2):                         # VW 1 as far ahead as G4 lets it
        push(shard, dur, 1, wave, u[(1, wave)])
    dur.boot_path.write_text("a boot before this one\n")  # the power cut

    rebooted = Shard()
    assert Durability(str(tmp_path)).restore(rebooted) == lead + 2, "an acknowledged push of vw 1 was dropped"
    assert rebooted.clocks["a"] == [0, lead + 2]
    assert rebooted.max_clock_distance == shard.max_clock_distance == lead + 1, "G4 reported broken"
    assert_refused(Kind.CLOCK, rebooted.push, 1, lead + 2, u[(1, lead + 2)])   # live, G4 holds
    evicted = Shard()
    evicted.restore(rebooted.snapshot())                 # the held waves' checkpoint, restored
    assert evicted.digest() == rebooted.digest()

    for wave in range(lead + 2):                         # VW 0 comes again (its retry, then more)
        assert rebooted.push(0, wave, u[(0, wave)])
        assert kept_power.push(0, wave, u[(0, wave)]) and kept_power.push(1, wave, u[(1, wave)])
    assert not rebooted.hold
    assert rebooted.clocks == kept_power.clocks
    if rule.exact:   # without exact pulls, pushes go in as they come: the same sums, in another order
        assert rebooted.digest() == kept_power.digest(), "not the state of a shard that kept its power"
    assert torch.allclose(rebooted.values["a"], kept_power.values["a"], rtol=0, atol=1e-15)

    assert evicted.evict(0)                              # or VW 0 leaves the job: VW 1's waves, in order
    want = init
    for wave in range(lead + 2):
        want = want + u[(1, wave)][0][1]
    assert not evicted.hold and torch.equal(evicted.values["a"], want)


def test_a_vw_catching_up_after_a_power_cut_does_not_count_as_past_g4(tmp_path: Path) -> None:
    """The cut took two of VW 0's unsynced pushes, and VW 1 had gone as far as G4 let it: the
    spread after replay is the lost pushes', and VW 0's pushes as it catches up (each leaves it
    behind VW 1) do not report a clock distance past D + 1."""
    shard = Shard()
    assert shard.init(2, [("a", torch.zeros(2, dtype=torch.float64))], (), SyncRule("wsp", exact=True))
    dur = Durability(str(tmp_path), every_clocks=100)
    dur.checkpoint(shard)
    u = [("a", torch.full((2,), 0.01, dtype=torch.float64))]
    for wave in range(2):
        seq, logged = log_push(dur, 0, wave, u)   # through shared memory: not on disk when acknowledged
        dur.place(seq)
        assert shard.push(0, wave, logged)
        dur.settle(seq, applied=True)
        push(shard, dur, 1, wave, u)
    push(shard, dur, 1, 2, u)
    assert shard.max_clock_distance == 1
    dur.boot_path.write_text("a boot before this one\n")   # the power cut
    rebooted = Shard()
    Durability(str(tmp_path)).restore(rebooted)
    assert rebooted.clocks["a"] == [0, 3]
    for wave in range(3):
        assert rebooted.push(0, wave, u)
        assert rebooted.max_clock_distance == 1, f"vw 0's wave {wave} reported past G4"
    assert not rebooted.hold


@pytest.mark.parametrize("order", ["ab", "ba"])
def test_replay_counts_no_distance_that_a_lost_push_of_another_key_made(tmp_path: Path, order: str) -> None:
    """Keys a (stage 0) and b (stage 1) on one shard, D 0. VW 0's stage 0 shares the shard's
    machine, and the cut takes its push of a; VW 1's wave 1 of b meets G4 on b, but with VW 0's
    a back at 0 the VWs' clocks (min over keys) are 2 apart. Replay reports the spread its
    pushes had live (1), in whichever order they were applied."""
    shard = Shard()
    assert shard.init(2, [(k, torch.zeros(2, dtype=torch.float64)) for k in "ab"], (), SyncRule("wsp", exact=True))
    dur = Durability(str(tmp_path), every_clocks=100)
    dur.checkpoint(shard)

    def u(key: str) -> list[tuple[str, torch.Tensor]]:
        return [(key, torch.full((2,), 0.01, dtype=torch.float64))]

    seq, logged = log_push(dur, 0, 0, u("a"))   # through shared memory: not on disk when acknowledged
    dur.place(seq)
    assert shard.push(0, 0, logged)
    dur.settle(seq, applied=True)
    push(shard, dur, 0, 0, u("b"))
    for wave in range(2):
        for key in order:
            push(shard, dur, 1, wave, u(key))
    assert shard.max_clock_distance == 1
    dur.boot_path.write_text("a boot before this one\n")   # the power cut
    rebooted = Shard()
    Durability(str(tmp_path)).restore(rebooted)
    assert rebooted.clocks == {"a": [0, 2], "b": [1, 2]}
    assert rebooted.max_clock_distance == 1, "replay reported past G4"
    assert rebooted.push(0, 0, u("a"))   # VW 0 comes again
    assert rebooted.max_clock_distance == 1


def test_entries_a_checkpoint_covered_are_written_over_then_deleted_at_close(tmp_path: Path) -> None:
    """Once covered, an entry's file is a spare that a later entry is written into (same inode, no
    new file), shorter or longer than before; restore reads them right; close() deletes spares."""
    shard, dur = two_key_shard(2), Durability(str(tmp_path), every_clocks=100)
    dur.checkpoint(shard)
    for vw in range(2):
        push(shard, dur, vw, 0, [delta("a", shard), delta("b", shard)])
    first = {name: ino for name, ino in files(dur).items() if name != "boot_id"}
    assert len(first) == 2
    dur.checkpoint(shard)
    assert not dur.entries()
    for vw in range(2):   # shorter entries (key b alone) into the longer files
        push(shard, dur, vw, 1, [delta("b", shard, 2.0 + vw)])
    second = files(dur)
    assert sorted(second.values()) == sorted(first.values()), "new files were made instead of spares written over"
    assert len(second) == 2
    restored = Shard()
    Durability(str(tmp_path)).restore(restored)
    assert restored.digest() == shard.digest() and restored.pushes_applied == 4

    dur.checkpoint(shard)
    push(shard, dur, 0, 1, [delta("a", shard, 3.0)])   # longer than key b's entry, whose file it takes
    again = Shard()
    Durability(str(tmp_path)).restore(again)
    assert again.digest() == shard.digest()

    dur.checkpoint(shard)
    dur.close()
    assert not list(dur.log_dir.iterdir()), "a finished shard leaves log files behind"


def test_a_checkpoint_captured_before_a_discard_is_not_written_after_it(tmp_path: Path) -> None:
    """A shard told its job ended discards its state; a checkpoint that a push captured before,
    whose hand-off to the writer thread came late, must not put the ended job back on disk."""
    shard, dur = two_key_shard(2), Durability(str(tmp_path), every_clocks=100)
    push(shard, dur, 0, 0, [delta("a", shard)])
    late = dur.capture(shard)
    assert late is not None
    dur.discard()
    dur.write(late)
    assert not dur.checkpoint_path.exists()
    restored = Shard()
    assert Durability(str(tmp_path)).restore(restored) == 0 and not restored.ready


def test_restore_replays_in_the_order_the_pushes_were_applied_not_the_order_they_were_logged(tmp_path: Path) -> None:
    """WSP logs a push before the shard's lock, so a push logged first may be applied second.
    Sums in floating point depend on their order: restore must replay the order of the applies
    (each entry's place, written right before its apply), or the restored w_global differs from the
    one the VWs pulled. Here it would differ by 1.0, not in a last bit."""
    shard, dur = Shard(), Durability(str(tmp_path), every_clocks=100)
    assert shard.init(2, [("a", torch.full((4,), -1e16, dtype=torch.float64))])
    dur.checkpoint(shard)
    big, one = [("a", torch.full((4,), 1e16, dtype=torch.float64))], [("a", torch.ones(4, dtype=torch.float64))]
    first, logged_big = log_push(dur, 0, 0, big)   # logged first ...
    second, logged_one = log_push(dur, 1, 0, one)
    dur.sync()   # a duplicate's acknowledgement leaves entries not yet placed to their own sync()
    assert dur.written_path(first).exists() and dur.written_path(second).exists()
    dur.place(second)
    assert shard.push(1, 0, logged_one)            # ... applied second: (-1e16 + 1) + 1e16 = 0
    dur.settle(second, applied=True)
    dur.place(first)
    assert shard.push(0, 0, logged_big)
    dur.settle(first, applied=True)
    assert torch.equal(shard.values["a"], torch.zeros(4, dtype=torch.float64))
    push(shard, dur, 0, 1, one)                    # then one more, synced
    dur.sync()
    assert not list(dur.log_dir.glob("*.written")), "every entry applied is on disk, with its place"

    killed = Shard()   # kill -9
    assert Durability(str(tmp_path)).restore(killed) == 3
    assert torch.equal(killed.values["a"], shard.values["a"]), "replayed in the log's order: -1e16 + 1e16 + 1"
    assert killed.digest() == shard.digest()

    again = Shard()   # and a second restore, after the first put the entries on disk
    Durability(str(tmp_path)).restore(again)
    assert again.digest() == shard.digest()


def test_a_checkpoint_frees_the_entries_it_covers_that_are_not_on_disk_yet(tmp_path: Path) -> None:
    """Under WSP a push is applied, settled and captured under the lock, and its entry fsynced
    after it (sync()): a checkpoint, even one another push's thread writes meanwhile, covers
    entries still 'written'. It frees them too, not only at the next checkpoint, and their sync()
    then has nothing left to do: the checkpoint on disk holds their pushes."""
    shard, dur = two_key_shard(2), Durability(str(tmp_path), every_clocks=100)
    dur.checkpoint(shard)
    seqs = []
    for vw in range(2):
        seqs.append(log_push(dur, vw, 0, [delta("a", shard), delta("b", shard)])[0])
        dur.place(seqs[-1])
        assert shard.push(vw, 0, [delta("a", shard), delta("b", shard)])
        dur.settle(seqs[-1], applied=True)                      # applied; its sync() not yet run
    inodes = sorted(ino for name, ino in files(dur).items() if name.endswith(".written"))
    assert len(inodes) == 2
    dur.checkpoint(shard)
    assert not dur.entries() and not list(dur.log_dir.glob("*.written")), "covered entries were kept"
    for seq in seqs:
        dur.sync(seq)                                           # the pushes' acknowledgements
    assert not dur.entries(), "a covered entry came back as a numbered one"
    push(shard, dur, 0, 1, [delta("a", shard)])
    assert [p.stat().st_ino for p in dur.entries()][0] in inodes, "a freed file is written over"
    restored = Shard()
    assert Durability(str(tmp_path)).restore(restored) == 1
    assert restored.digest() == shard.digest() and restored.pushes_applied == 3


def test_an_entry_logged_under_the_lock_is_on_disk_before_it_is_applied(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Quorum rounds and elastic exchanges journal under the shard's lock: on disk, numbered, and
    the folder fsynced by the time journal_push or journal_exchange returns."""
    shard, dur = two_key_shard(2), Durability(str(tmp_path), every_clocks=100)
    synced = record_fsyncs(monkeypatch)
    dur.journal_push(0, 0, [delta("a", shard)])
    dur.journal_exchange(1, 0, [delta("b", shard)])
    assert [p.name for p in dur.entries()] == [dur.entry_path(1).name, dur.entry_path(2).name]
    assert synced == [dur.written_path(1).name, "log", dur.written_path(2).name, "log"]


def test_a_refused_push_frees_its_entry_for_the_next(tmp_path: Path) -> None:
    shard, dur = two_key_shard(2), Durability(str(tmp_path), every_clocks=100)
    dur.checkpoint(shard)
    refused, _ = log_push(dur, 0, 5, [delta("a", shard)])          # a clock the shard refuses
    dur.settle(refused, applied=False)
    (spare,) = dur.log_dir.glob("spare-*")
    inode = spare.stat().st_ino
    push(shard, dur, 0, 0, [delta("a", shard)])
    assert [p.stat().st_ino for p in dur.entries()] == [inode]
    restored = Shard()
    assert Durability(str(tmp_path)).restore(restored) == 1
    assert restored.digest() == shard.digest()


def test_an_entry_that_replay_refuses_is_gone_for_good(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On disk, and its shard killed before the push was checked: never acknowledged, and refused
    at replay (it skips ahead). Its name goes, and the folder is fsynced after, or a power cut
    could bring it back for a later restore to apply once it is in order."""
    shard, dur = two_key_shard(2), Durability(str(tmp_path), every_clocks=100)
    dur.checkpoint(shard)
    seq, _ = log_push(dur, 0, 5, [delta("a", shard)])
    dur.sync(seq)
    events = record_fsyncs(monkeypatch)
    real_replace = os.replace

    def replace(src: Path, dst: Path) -> None:
        real_replace(src, dst)
        events.append(f"{Path(src).name} -> {Path(dst).name}")

    monkeypatch.setattr(os, "replace", replace)
    assert Durability(str(tmp_path)).restore(Shard()) == 0
    assert not dur.entries()
    freed = events.index(f"{dur.entry_path(seq).name} -> spare-{seq:012d}")
    assert "log" in events[freed + 1:], events


def _from_stream(path: Path, tensors: list[tuple[str, torch.Tensor]], metadata: dict[str, str]) -> None:
    logged = log_entry.write_stream(path, wire.read(wire.encode(tensors, push=wire_pb2.PushTag())), metadata)
    for (name, tensor), (got_name, got) in zip(tensors, logged, strict=True):
        assert got_name == name and got.dtype == tensor.dtype and torch.equal(got, tensor), name


def _travels(dtype: torch.dtype) -> bool:
    try:
        wire.wire_dtype(dtype)
    except ValueError:
        return False
    return True


@pytest.mark.parametrize(("dtype", "writer"), [
    pytest.param(dtype, writer, id=f"{dtype}-{name}")
    for dtype in sorted(DTYPES, key=str)
    for name, writer in (("tensors", log_entry.write), ("stream", _from_stream))
    if writer is log_entry.write or _travels(dtype)])
def test_an_entry_is_a_safetensors_file_even_over_a_longer_one(tmp_path: Path, dtype: torch.dtype,
                                                               writer: Callable[..., None]) -> None:
    """Written from tensors (a journal) or from a push's stream (then also mapped back, each
    tensor where the format puts it: after an odd-length one, at an unaligned address)."""
    path = tmp_path / "entry"
    path.write_bytes(os.urandom(4096))
    source = torch.arange(-12, 12, dtype=torch.float64).reshape(2, 3, 4)
    tensors = [("odd", source[0, 0, :3].to(dtype)), ("w", source.to(dtype)), ("scalar", torch.tensor(3).to(dtype)),
               ("empty", torch.zeros(0, 5, dtype=dtype)), ("strided", source.to(dtype)[:, 1])]
    writer(path, tensors, {"kind": "push", "vw": "1"})
    with safe_open(path, framework="pt") as f:
        assert f.metadata() == {"kind": "push", "vw": "1"}
    loaded = load_file(path)
    assert sorted(loaded) == sorted(name for name, _ in tensors)
    for name, tensor in tensors:
        assert loaded[name].dtype == dtype and torch.equal(loaded[name], tensor), name


@pytest.mark.parametrize("chunk_bytes", [None, 8], ids=["whole", "in-chunks"])
def test_a_push_logged_from_shared_memory_is_the_shards_own_copy(tmp_path: Path, chunk_bytes: int | None) -> None:
    """The entry is the copy the shard applies: the stage writing its slot again afterwards
    changes neither; a slot rewritten while it was being logged is refused as stale, and its
    entry becomes a spare that no restore replays. The same for a push a chunk a frame."""
    shard, dur = two_key_shard(2), Durability(str(tmp_path), every_clocks=100)
    dur.checkpoint(shard)
    ring = shm.Ring(slots=1) if chunk_bytes is None else shm.Ring(slots=1, chunk_bytes=chunk_bytes, whole_up_to=chunk_bytes)
    reader = shm.Reader()
    try:
        pushed = [delta("a", shard, 2.0)]
        frames = list(wire.encode(pushed, push=wire_pb2.PushTag(), ring=ring))
        assert (len(frames) > 1) == (chunk_bytes is not None)
        seq, logged = dur.log_stream(0, 0, wire.read(wire.encode(pushed, push=wire_pb2.PushTag(), ring=ring), reader))
        next(ring.refs([raw_bytes(torch.full_like(shard.values["a"], 7.0))]))   # the stage's next use of the slot
        assert torch.equal(logged[0][1], pushed[0][1])
        dur.place(seq)
        assert shard.push(0, 0, logged)
        dur.settle(seq, applied=True)
        dur.sync(seq)

        torn = wire.read(wire.encode([delta("a", shard, 3.0)], push=wire_pb2.PushTag(), ring=ring), reader)
        next(ring.refs([raw_bytes(torch.full_like(shard.values["a"], 9.0))]))   # while the shard reads it
        with pytest.raises(wire.WireError, match="stale shared-memory handle") as info:
            dur.log_stream(0, 1, torn)
        assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION
    finally:
        ring.close()
    assert [p.name for p in dur.entries()] == [dur.entry_path(seq).name] and len(list(dur.log_dir.glob("spare-*"))) == 1
    restored = Shard()
    assert Durability(str(tmp_path)).restore(restored) == 1
    assert restored.digest() == shard.digest()


def test_an_entry_refuses_what_safetensors_cannot_hold(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="'w' appears twice"):
        log_entry.write(tmp_path / "e", [("w", torch.ones(2)), ("w", torch.ones(2))], {})
    with pytest.raises(ValueError, match="complex64"):
        log_entry.write(tmp_path / "e", [("z", torch.ones(2, dtype=torch.complex64))], {})

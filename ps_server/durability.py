"""Shard durability: a checkpoint every M clocks plus a log of every push (and elastic exchange)
acknowledged since."""

from __future__ import annotations

import logging
import os
import shutil
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch

from hetpipe import wire
from hetpipe.outputs import fsync, write_text_atomically
from hetpipe.weight_files import save_atomically
from ps_server import log_entry
from ps_server.shard import Shard
from ps_server.sync_rule import ShardError

log = logging.getLogger(__name__)
T = TypeVar("T")
LOG_SUFFIX = ".safetensors"
# An entry's file goes from pending (being written: never replayed) to written (whole in the page
# cache: replayed unless the machine restarted since) to its bare number (on disk).
PENDING_SUFFIX = ".pending"
WRITTEN_SUFFIX = ".written"
BOOT_ID = Path("/proc/sys/kernel/random/boot_id")   # Linux: new at every boot
SPARE_PREFIX = "spare-"       # a file a checkpoint freed, to be written over by a later entry


@dataclass(frozen=True, slots=True)
class Snapshot:
    """A checkpoint captured under the shard's lock, to be written outside it."""
    state: dict[str, Any]
    covered: int   # the log entries it holds: every one numbered up to this
    number: int    # captures before it, so that an older one never overwrites a newer one


def _seq_of(entry: Path) -> int:
    return int(entry.name.split(".")[0])


class Durability:
    """Writes each push to the log before it is acknowledged, so that no acknowledged push is lost.

    A checkpoint (every `every_clocks` of c_global, on Init and on SIGTERM) captures the whole
    shard and frees the log entries it covers. Restore = checkpoint + log replay; replaying a push
    the checkpoint already holds is a duplicate and a no-op by the clock rule. The checkpoint is
    loaded with torch.load(weights_only=True); log entries are safetensors files.

    An entry is written under a pending name, renamed "written" once whole, and renamed to its
    bare number once fsynced (the folder fsynced too): restore replays numbered entries, and
    written ones while the machine has not restarted since they were written (the page cache
    still holds them whole); a pending one never. Under WSP a push is logged before the shard's
    lock and applied before its entry is on disk (sync(), before the acknowledgement), so the disk
    is off the path from a push to the pulls it releases: a kill -9 loses nothing, and a power
    cut loses only entries whose push was never acknowledged, which their retries bring back.
    A push that came through shared memory is acknowledged without sync(): its pusher shares the
    machine, so a cut that loses its written entry ends the pusher too (ShardServicer._update).
    Such an entry is unsettled until settle() says whether it was applied, and a checkpoint
    covers only the entries below the first unsettled one. Under the lock, right before its push
    is applied, place() writes the entry's place in the order of applies into its header, and
    restore replays in that order: the restored values are the ones the shard held, bit for bit.

    Entries a checkpoint covered are written over, not deleted and made anew: on a disk, a file
    made for every push (its blocks allocated, its pages new) and deleted after cost a shard
    1.3-1.5 times the CPU a push (bench/push_log.py). The log's files never outnumber its entries
    at their most; restore and close() delete the spares.
    """

    def __init__(self, directory: str, every_clocks: int = 1) -> None:
        self.dir = Path(directory)
        self.log_dir = self.dir / "log"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.every_clocks = max(1, every_clocks)
        self._seq = 0
        self._checkpointed_clock = 0
        self._lock = threading.Lock()      # _seq, _unsettled, _unsynced and _spares, which pushes logging outside the shard lock share
        self._unsettled: set[int] = set()
        self._unsynced: set[int] = set()   # entries not yet on disk (before sync)
        self._spares: list[Path] = []      # files a checkpoint freed, for _entry to write over
        self._unplaced: set[int] = set()   # logged before the lock: place() writes their place
        self._last_place = 0
        self._captured = 0                 # checkpoints captured; the number of the last one written:
        self._written = 0
        self._write_lock = threading.Lock()
        # Written entries outlive a process, not a machine. The recorded boot id vouches for every
        # written entry in the folder, so this start's replaces it only once none from before a
        # restart is left (here, or in restore once it has dropped them): a start that dies in
        # between leaves them suspect for the next. No boot id recorded: a first start.
        self._boot = _boot_id()
        self._recorded = self.boot_path.read_text() if self.boot_path.exists() else ""
        self._machine_restarted = not self._boot or self._recorded != self._boot
        if not any(self.log_dir.glob(f"*{WRITTEN_SUFFIX}")):
            self._record_boot()

    @property
    def checkpoint_path(self) -> Path:
        return self.dir / "checkpoint.pt"

    def entry_path(self, seq: int) -> Path:
        return self.log_dir / f"{seq:012d}{LOG_SUFFIX}"

    def pending_path(self, seq: int) -> Path:
        return self.log_dir / f"{seq:012d}{LOG_SUFFIX}{PENDING_SUFFIX}"

    def written_path(self, seq: int) -> Path:
        return self.log_dir / f"{seq:012d}{LOG_SUFFIX}{WRITTEN_SUFFIX}"

    @property
    def boot_path(self) -> Path:
        return self.dir / "boot_id"

    def _record_boot(self) -> None:
        if self._recorded != self._boot:
            write_text_atomically(self.boot_path, self._boot, durable=True)
            self._recorded = self._boot

    def entries(self) -> list[Path]:
        """The log's entries, oldest first."""
        return sorted(self.log_dir.glob(f"*{LOG_SUFFIX}"))

    def restore(self, shard: Shard) -> int:
        """Loads the checkpoint and replays the log into shard; returns pushes replayed. Pending
        entries, spares, and written entries a restart of the machine may have torn are deleted
        (none was acknowledged)."""
        for left in self.log_dir.iterdir():
            if left.name.endswith(PENDING_SUFFIX) or left.name.startswith(SPARE_PREFIX):
                left.unlink()
            elif left.name.endswith(WRITTEN_SUFFIX) and self._machine_restarted:
                log.warning("push log entry %s not replayed: the machine restarted before it was on disk", left.name)
                left.unlink()
            elif left.name.endswith(WRITTEN_SUFFIX):
                # Whole in the page cache: on disk now, as a numbered entry, so that the retry of
                # its push, a duplicate, is acknowledged only once its entry is safe.
                fsync(left)
                os.replace(left, self.entry_path(_seq_of(left)))
        fsync(self.log_dir)
        self._record_boot()
        covered = 0
        if self.checkpoint_path.exists():
            snap = torch.load(self.checkpoint_path, map_location="cpu", weights_only=True)
            shard.restore(snap)
            covered = int(snap["log_seq"])
            self._checkpointed_clock = shard.c_global() if shard.ready else 0
        entries: list[log_entry.Entry] = []
        for path in self.entries():
            seq = _seq_of(path)
            self._seq = max(self._seq, seq)
            if seq > covered and (entry := log_entry.read(path)) is not None:
                entries.append(entry)
        self._last_place = max((entry.place for entry in entries), default=0)
        # In the order they were applied: WSP numbers its entries before the shard's lock, and a
        # sum taken in another order may differ in its last bits (or, near the limit, overflow).
        # Entries never applied (the shard was killed first) come last, in the log's order.
        entries.sort(key=lambda entry: (entry.place == 0, entry.place, _seq_of(entry.path)))
        replayed = 0
        # An entry without a place (never applied, or written before places were) may still
        # overflow in this order where it did not in another: it waits, with every later one of
        # its VW, and is tried again after the rest.
        waiting: list[log_entry.Entry] = []
        for entry in entries:
            if any(w.vw == entry.vw for w in waiting):
                waiting.append(entry)
                continue
            try:
                replayed += self._replay(entry, shard)
            except ShardError as exc:
                if exc.kind is ShardError.Kind.OVERFLOW:
                    waiting.append(entry)
                else:
                    self._not_replayed(entry, exc)
        while waiting:
            refused: list[tuple[log_entry.Entry, ShardError]] = []
            for entry in waiting:
                try:
                    replayed += self._replay(entry, shard)
                except ShardError as exc:
                    refused.append((entry, exc))
            if len(refused) == len(waiting):   # no order left to try
                for entry, error in refused:
                    self._not_replayed(entry, error)
                break
            waiting = [entry for entry, _ in refused]
        self._seq = max(self._seq, covered)
        return replayed

    def _not_replayed(self, entry: log_entry.Entry, exc: ShardError) -> None:
        log.warning("push log entry %s not replayed: %s", entry.path.name, exc)
        if not entry.place:
            # Logged before it was checked (WSP, outside the lock), and the process died before it
            # was applied or refused: never acknowledged, and refused now. It goes, or a later
            # restore, replaying it after more pushes, could find it in order and apply it; for
            # good (the folder fsynced), or a power cut could bring its name back.
            with self._lock:
                self._spare(entry.path)
            fsync(self.log_dir)

    def _replay(self, entry: log_entry.Entry, shard: Shard) -> int:
        """entry.apply(shard); an entry applied now for the first time is placed after the rest."""
        applied = entry.apply(shard)
        if applied and not entry.place:   # on disk, numbered: restore put it there first
            self._last_place += 1
            log_entry.set_place(entry.path, self._last_place, durable=True)
        return applied

    def _entry(self, kind: str, vw: int, clock: int, write: Callable[[Path, dict[str, str]], T], *,
               journal: bool) -> tuple[int, T]:
        """A new entry, written by write(path, metadata) (which answers what the caller gets back
        with the entry's number), renamed written. journal: logged under the shard's lock, right
        before its update is applied, so placed now and synced before this returns; else logged
        before the lock (log_stream), placed by place() and synced by sync()."""
        with self._lock:
            self._seq += 1
            seq = self._seq
            self._unsettled.add(seq)
            self._unsynced.add(seq)
            if journal:
                self._last_place += 1
                place = self._last_place
            else:
                place = 0
                self._unplaced.add(seq)
            spare = self._spares.pop() if self._spares else None
        pending = self.pending_path(seq)
        try:
            if spare is not None:
                try:
                    os.replace(spare, pending)
                except FileNotFoundError:   # deleted by another restore of this folder: a new file
                    pass
            result = write(pending, log_entry.metadata(kind, vw, clock, place))
            os.replace(pending, self.written_path(seq))
            if journal:
                self.sync(seq)
        except BaseException:
            self.settle(seq, applied=False)
            raise
        return seq, result

    def log_stream(self, vw: int, clock: int, stream: wire.Stream) -> tuple[int, list[tuple[str, torch.Tensor]]]:
        """Logs a push before it is applied, not yet on disk; returns its entry's number, for
        settle() and then, before the push is acknowledged, sync(), and its tensors to apply.

        Its bytes go from the stream (the stage's shared memory, or gRPC's frames) straight into
        the entry, and the tensors lie on a mapping of it: one copy, where receiving the push and
        then logging it took two, and the entry is the shard's own copy, which the stage can no
        longer change. WireError (the entry a spare) where the stream turns out bad."""
        return self._entry("push", vw, clock, lambda path, meta: log_entry.write_stream(path, stream, meta), journal=False)

    def sync(self, seq: int | None = None) -> None:
        """Puts entry seq on disk under its number; None: every entry not yet there (a duplicate's
        acknowledgement must not overtake its original's). Not an entry logged before the lock
        and not yet applied: its place is still to be written, and the sync() after its apply
        puts both on disk (a duplicate's original was applied, and placed, before the duplicate
        came under the lock). An fsync that fails raises and leaves the entry written, so the
        push's retry tries again."""
        with self._lock:
            pending = sorted((self._unsynced if seq is None else {seq} & self._unsynced) - self._unplaced)
        for entry in pending:
            try:
                fsync(self.written_path(entry))
            except FileNotFoundError:   # refused meanwhile (settle), or still being written (no duplicate waits on it)
                continue
            with self._lock:   # settle() may have refused it meanwhile: then it is a spare
                if entry in self._unsynced:
                    os.replace(self.written_path(entry), self.entry_path(entry))
                    self._unsynced.discard(entry)
        # Even with nothing of its own: another call's rename may not be on disk yet.
        fsync(self.log_dir)

    def journal_push(self, vw: int, clock: int, deltas: list[tuple[str, torch.Tensor]]) -> None:
        """Logs a push, on disk, that the caller, holding the shard's lock, applies right after
        (Shard.push's journal)."""
        seq, _ = self._entry("push", vw, clock, lambda path, meta: log_entry.write(path, deltas, meta),
                             journal=True)
        self.settle(seq, applied=True)

    def journal_exchange(self, vw: int, clock: int, replica: list[tuple[str, torch.Tensor]]) -> None:
        """Logs an elastic exchange, as journal_push."""
        seq, _ = self._entry("exchange", vw, clock, lambda path, meta: log_entry.write(path, replica, meta),
                             journal=True)
        self.settle(seq, applied=True)

    def place(self, seq: int) -> None:
        """Entry seq, logged before the shard's lock (log_stream), is about to be applied: its
        place in the order of applies goes into its header now, under that lock, so that restore
        replays the applies' order. OSError where it cannot be written: the push is then refused
        whole, as one whose log write failed (settle it as not applied)."""
        with self._lock:
            self._last_place += 1
            # Still `written`: sync() leaves unplaced entries alone, and the push's own sync(),
            # after its apply, puts the place on disk with the rest.
            log_entry.set_place(self.written_path(seq), self._last_place)
            self._unplaced.discard(seq)

    def settle(self, seq: int, *, applied: bool) -> None:
        """Entry seq's update was applied, or not (refused, or a duplicate): then its file is a
        spare, so that no restore applies it."""
        with self._lock:
            self._unsettled.discard(seq)
            self._unplaced.discard(seq)
            if not applied:
                self._unsynced.discard(seq)
                for path in (self.pending_path(seq), self.written_path(seq), self.entry_path(seq)):
                    if path.exists():
                        self._spare(path)

    def close(self) -> None:
        """Deletes the spares (after the last checkpoint: a finished job's folder keeps no log)."""
        with self._lock:
            spares, self._spares = self._spares, []
        for path in spares:
            path.unlink(missing_ok=True)

    def discard(self) -> None:
        """Deletes the checkpoint, the log and the boot id: a restore after it finds nothing. A
        checkpoint captured before and written after (its push's hand-off to the writer thread
        was late) is one captured earlier than the last written: write() drops it."""
        with self._write_lock, self._lock:
            self._written = sys.maxsize
            shutil.rmtree(self.log_dir, ignore_errors=True)
            self._spares = []
            for path in (self.checkpoint_path, self.boot_path):
                path.unlink(missing_ok=True)

    def _spare(self, path: Path) -> None:
        """path's entry is no longer needed: its file waits to be written over (caller holds _lock)."""
        spare = self.log_dir / f"{SPARE_PREFIX}{_seq_of(path):012d}"   # matches no entry's glob
        os.replace(path, spare)
        self._spares.append(spare)

    def capture(self, shard: Shard) -> Snapshot | None:
        """The checkpoint of shard as it is now (the caller holds the shard's lock), for write()."""
        if not shard.ready:
            return None
        with self._lock:  # entries logged but not yet applied are not in the snapshot: keep them
            covered = min(self._unsettled) - 1 if self._unsettled else self._seq
            self._captured += 1
            number = self._captured
        self._checkpointed_clock = shard.c_global()
        return Snapshot({**shard.snapshot(), "log_seq": covered}, covered, number)

    def write(self, snapshot: Snapshot) -> None:
        """Puts a captured checkpoint on disk and frees the log entries it covers; the shard's
        lock need not be held, so pushes go on meanwhile (the servicer writes it on a thread of
        its own, after the push that captured it is answered). One captured later wins."""
        with self._write_lock:
            if snapshot.number < self._written:
                return
            save_atomically(snapshot.state, self.checkpoint_path, durable=True)
            self._written = snapshot.number
            with self._lock:
                # Written entries too (a push applied whose sync() has not run yet): the checkpoint,
                # on disk, holds them, so their sync() has nothing left to do.
                written = self.log_dir.glob(f"*{LOG_SUFFIX}{WRITTEN_SUFFIX}")
                for entry in [*self.entries(), *written]:
                    if _seq_of(entry) <= snapshot.covered:
                        self._unsynced.discard(_seq_of(entry))
                        self._spare(entry)

    def checkpoint(self, shard: Shard) -> None:
        """capture() and write() at once."""
        snapshot = self.capture(shard)
        if snapshot is not None:
            self.write(snapshot)

    def capture_due(self, shard: Shard) -> bool:
        """c_global has advanced every_clocks past the last checkpoint's."""
        return shard.c_global() - self._checkpointed_clock >= self.every_clocks

    def maybe_capture(self, shard: Shard) -> Snapshot | None:
        """A checkpoint to write() when one is due (capture_due)."""
        return self.capture(shard) if self.capture_due(shard) else None


def _boot_id() -> str:
    try:
        return BOOT_ID.read_text().strip()
    except OSError:   # not Linux: every start counts as a restart of the machine
        return ""

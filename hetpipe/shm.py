"""Same-host fast path: tensor bytes in shared-memory segments, named by a small handle over gRPC.

A sender owns a Ring of segments per peer (files under /dev/shm, `hetpipe-<pid>-<random>`), writes
a bundle's bytes into the next slot and sends only the handle (name, version, size). The receiver
maps the segment read-only, copies the bytes out and checks the version again afterwards: the
slot's version is a seqlock (odd while written), so a handle that is stale, or a slot overwritten
while it was read, is refused instead of read torn. Nothing the receiver does depends on the
sender's goodwill: names, owners, sizes and versions are all checked.

Segments are unlinked by their owner when it closes them or exits. An owner holds a shared
flock on each of its segments for as long as it lives, and the kernel drops it when the process
dies however it dies: sweep() removes exactly the segments nobody holds (a killed process's),
whatever pid namespace their owner ran in. Launchers sweep when they start and stop processes.
"""

from __future__ import annotations

import atexit
import errno
import fcntl
import hashlib
import mmap
import os
import re
import secrets
import stat
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Protocol

import grpc

from hetpipe import children
from hetpipe.errors import Rejected
from hetpipe.memcpy import copy_bytes
from hetpipe.v1 import wire_pb2

SHM_DIR = Path("/dev/shm")
PREFIX = "hetpipe-"
_NAME = re.compile(r"hetpipe-([0-9]+)-[0-9a-f]{16}")
_CREATING = ".new"   # a segment being made: locked, then renamed to its name
_MAGIC = b"HPSHM\x01\x00\x00"
_HEADER = struct.Struct("<8sQQ")       # magic, version (seqlock: odd while being written), capacity
HEADER_BYTES = 64                      # data starts on its own cache line
PAGE = mmap.PAGESIZE


class HandleError(Rejected):
    """A shared-memory handle refused: INVALID_ARGUMENT (malformed) or FAILED_PRECONDITION (stale, gone)."""


def capacity(nbytes: int, unit: int) -> int:
    """A slot's size for nbytes: whole units, with an eighth to grow into, so that a slightly
    larger bundle reuses it."""
    return -(-max(nbytes + nbytes // 8, unit) // unit) * unit


def available() -> bool:
    return SHM_DIR.is_dir() and os.access(SHM_DIR, os.W_OK)


def host_id() -> str:
    """Equal for two processes exactly when they may share tensors through /dev/shm: same boot of
    the same kernel, same /dev/shm mount (a container's private one differs), same network
    namespace (processes behind different addresses are treated as different hosts) and same user
    (segments and link sockets take only their own user's peers). Empty where there is no
    /dev/shm."""
    if not available():
        return ""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        net = os.stat("/proc/self/ns/net").st_ino
    except OSError:
        return ""
    raw = f"{boot}/{os.stat(SHM_DIR).st_dev}/{net}/{os.getuid()}"
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


def shared(transport: str, a: str, b: str) -> bool:
    """Whether two processes with host ids a and b exchange tensors through shared memory under
    parallel.transport; ValueError where `shm` is required and they cannot."""
    same = bool(a) and a == b
    if transport == "shm" and not same:
        raise ValueError("they do not share a host's memory" if a and b else "a host identity is unknown")
    return transport != "grpc" and same


# Every segment this process created and has not unlinked: removed at exit, however the process
# leaves through Python (a kill -9 is the launcher's to sweep).
_OWNED: set[Path] = set()
_OWNED_LOCK = threading.Lock()


def _unlink(path: Path) -> None:
    path.unlink(missing_ok=True)
    with _OWNED_LOCK:
        _OWNED.discard(path)


@atexit.register
def unlink_owned() -> None:
    """Removes every segment this process still owns (exit_now skips atexit, so it calls this)."""
    with _OWNED_LOCK:
        owned = list(_OWNED)
    for path in owned:
        _unlink(path)


def _files(*, creating: bool) -> list[Path]:
    """Every hetpipe segment in /dev/shm; creating: those still being made too."""
    if not SHM_DIR.is_dir():
        return []
    return [p for p in SHM_DIR.glob(f"{PREFIX}*")
            if _NAME.fullmatch(p.name.removesuffix(_CREATING) if creating else p.name)]


def sweep() -> list[str]:
    """Removes every hetpipe segment whose owner has ended (no process holds its lock); returns
    their names. Safe beside live owners: theirs are locked."""
    removed = []
    for path in _files(creating=True):
        owner = _NAME.match(path.name)
        if path.name.endswith(_CREATING) and owner is not None and children.running(int(owner[1])):
            continue  # made this instant: its owner may not have locked it yet
        try:
            # O_NONBLOCK: a FIFO named like a segment would block the open until someone wrote to it.
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            continue
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
                continue   # no segment of ours (/dev/shm is everyone's: another user's file is not)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            path.unlink(missing_ok=True)
        except OSError:
            continue  # its owner lives (BlockingIOError), or it is not ours to remove
        else:
            removed.append(path.name)
        finally:
            os.close(fd)
    return removed


def segments() -> list[str]:
    """The names of every hetpipe segment on this host now."""
    return sorted(p.name for p in _files(creating=False))


class Segment:
    """One writable segment, owned by this process. With capacity 0 it is only a header: the
    seqlock version of bytes that lie elsewhere (a CUDA IPC slot, hetpipe/cuda_ipc.py)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.name = f"{PREFIX}{os.getpid()}-{secrets.token_hex(8)}"
        self.path = SHM_DIR / self.name
        # Made under a name no reader accepts, locked, then renamed: sweep() never sees it unlocked.
        creating = self.path.with_name(self.name + _CREATING)
        self._fd = os.open(creating, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_SH)   # held until this process ends
            # Reserve the pages now: on a tmpfs that is full (a container's /dev/shm is 64 MiB by
            # default) this fails with ENOSPC, where writing through the mapping would be SIGBUS.
            os.posix_fallocate(self._fd, 0, HEADER_BYTES + capacity)
            self.map = mmap.mmap(self._fd, HEADER_BYTES + capacity)
            with _OWNED_LOCK:
                _OWNED.add(self.path)
            os.rename(creating, self.path)
        except OSError:
            creating.unlink(missing_ok=True)
            os.close(self._fd)
            raise
        self.version = 0
        self._set_version(0)

    def _set_version(self, version: int) -> None:
        self.map[: _HEADER.size] = _HEADER.pack(_MAGIC, version, self.capacity)

    def begin(self) -> None:
        """The content is about to change: odd, so a reader that overlaps the write sees it changed."""
        self._set_version(self.version + 1)

    def end(self) -> int:
        """The content is written; returns the (even) version that names it."""
        self.version += 2
        self._set_version(self.version)
        return self.version

    def write(self, pieces: Sequence[memoryview]) -> int:
        """Copies the pieces in order; returns the (even) version that names this content."""
        self.begin()
        pos = HEADER_BYTES
        whole = memoryview(self.map)
        try:
            for piece in pieces:
                copy_bytes(whole[pos : pos + len(piece)], piece)
                pos += len(piece)
        finally:
            whole.release()  # an exported buffer would keep the mapping from closing
        return self.end()

    def close(self) -> None:
        _unlink(self.path)
        self.map.close()
        os.close(self._fd)


class Writer(Protocol):
    """Where a sender puts a bundle's bytes for a peer on this host: a Ring, or a shard's pull slots."""

    def refs(self, pieces: Sequence[memoryview]) -> Iterator[wire_pb2.ShmRef]:
        """The handles of the pieces' bytes, in order, each slot written as its handle is asked for."""
        ...


# A bundle larger than WHOLE_UP_TO goes through a Ring in slots of CHUNK_BYTES, each handed on as
# it is written: the receiver copies one out while the sender writes the next, where a whole slot
# would be written, then copied, one after the other (two passes over the bundle in a row).
CHUNK_BYTES = 8 << 20
WHOLE_UP_TO = 16 << 20


def chunks(pieces: Sequence[memoryview], chunk_bytes: int) -> Iterator[list[memoryview]]:
    """The pieces' bytes in order, in groups of chunk_bytes (the last one shorter); a piece is
    split where a group ends."""
    group: list[memoryview] = []
    size, first = 0, True
    for piece in pieces:
        while len(piece):
            n = min(len(piece), chunk_bytes - size)
            group.append(piece[:n])
            size += n
            piece = piece[n:]
            if size == chunk_bytes:
                yield group
                group, size, first = [], 0, False
    if group or first:
        yield group   # an empty bundle still has its (empty) slot


class Ring:
    """A sender's segments for one peer, used in turn: with `slots` of them a slot is rewritten
    only after that many later bundles, by which time the peer has long copied it out (a sender
    that waits for each ack needs one; the receiver's version check catches any other case). A
    slot holds one segment per chunk of its bundle (CHUNK_BYTES, for bundles over WHOLE_UP_TO).
    Writing raises OSError where /dev/shm has no room; the caller sends in gRPC frames instead."""

    def __init__(self, slots: int = 2, chunk_bytes: int = CHUNK_BYTES, whole_up_to: int = WHOLE_UP_TO,
                 max_chunks: int = 0) -> None:
        if slots < 1:
            raise ValueError(f"a ring needs at least one slot, got {slots}")
        if chunk_bytes < 1:
            raise ValueError(f"a ring's chunks need at least one byte, got {chunk_bytes}")
        self._slots: list[list[Segment | None]] = [[] for _ in range(slots)]
        self._writers = [0] * slots   # per slot, the number of the last refs() that took it
        self._chunk_bytes, self._whole_up_to = chunk_bytes, whole_up_to
        # > 0: a bundle goes in at most this many chunks, larger ones where it must (a receiver
        # keeps Reader's 256 mappings: more segments a slot than that would be mapped anew each time).
        self._max_chunks = max_chunks
        self._turn = 0
        self._taken = 0
        self._lock = threading.Lock()
        self._closed = False
        self.bytes_written = 0

    def chunking(self, chunk_bytes: int, whole_up_to: int, max_chunks: int = 0) -> None:
        """Bundles written from now on go whole up to whole_up_to bytes, else in chunks as above."""
        with self._lock:
            self._chunk_bytes, self._whole_up_to, self._max_chunks = chunk_bytes, whole_up_to, max_chunks

    def refs(self, pieces: Sequence[memoryview]) -> Iterator[wire_pb2.ShmRef]:
        """The pieces in the next slot, in chunks if they are large, each written when its handle
        is asked for: the handles go out while the rest is written. Every segment the bundle
        needs is made first, so a /dev/shm without room fails before the first handle."""
        total = sum(len(p) for p in pieces)
        with self._lock:
            if self._closed:   # a segment made now would be nobody's to close
                raise OSError(errno.ESHUTDOWN, "the ring is closed")
            chunk = max(self._chunk_bytes, -(-total // self._max_chunks)) if self._max_chunks else self._chunk_bytes
            groups = [list(pieces)] if total <= self._whole_up_to else list(chunks(pieces, chunk))
            sizes = [sum(len(p) for p in g) for g in groups]
            i = self._turn
            self._turn = (i + 1) % len(self._slots)
            segments = self._reserve(self._slots[i], sizes)
            self._taken += 1
            self._writers[i] = mine = self._taken
        for segment, group, nbytes in zip(segments, groups, sizes):
            with self._lock:   # not while close() runs
                if self._writers[i] != mine:
                    # A later bundle has the slot: this one's call ended (a retry took its place)
                    # and gRPC's thread asked for its next frame late. Writing now would spoil
                    # that bundle's chunk.
                    return
                version = segment.write(group)
                self.bytes_written += nbytes
            yield wire_pb2.ShmRef(name=segment.name, version=version, nbytes=nbytes)

    @staticmethod
    def _reserve(slot: list[Segment | None], sizes: list[int]) -> list[Segment]:
        """A segment of the slot for each size, made or regrown where it is missing or too small."""
        while len(slot) < len(sizes):
            slot.append(None)
        for j, nbytes in enumerate(sizes):
            segment = slot[j]
            if segment is None or segment.capacity < nbytes:
                if segment is not None:
                    slot[j] = None  # closed: a new one that fails for room must not leave it here
                    segment.close()
                slot[j] = Segment(capacity(nbytes, PAGE))
        return [s for s in slot[: len(sizes)] if s is not None]   # all of them, made above

    def close(self) -> None:
        with self._lock:
            self._closed = True
            for slot in self._slots:
                for segment in slot:
                    if segment is not None:
                        segment.close()
                slot.clear()


class Reader:
    """A receiver's read-only mappings of its peers' segments, the most recently used kept open
    (enough for every chunk of several peers' large bundles: a mapping made anew costs its page
    faults on every read, 60% more for a 100 MiB push).

    A mapping outlives its segment's name: the pages stay while it is held, and a handle naming
    their last version would still check. So each use first compares the name's file with the
    one mapped (one lstat): a segment its owner unlinked (closed, regrown, or ended) is refused
    as gone, one made anew under the name is mapped anew. The mappings of every segment that is
    gone are let go at a new mapping or a read once PRUNE_S seconds have passed since the last time, so
    that a peer that ended or regrew its segments does not pin their memory here."""

    PRUNE_S = 1.0

    def __init__(self, keep: int = 256) -> None:
        self._maps: OrderedDict[str, tuple[mmap.mmap, tuple[int, int, int]]] = OrderedDict()  # with _identity
        self._owners: dict[str, str] = {}   # segment -> the sender whose bundles it carries
        self._keep = keep
        self._lock = threading.Lock()
        self._pruned = time.monotonic()
        self.bytes_read = 0

    @staticmethod
    def _identity(name: str) -> tuple[int, int, int] | None:
        """The file the name is now: (device, inode, size), None where there is none. A segment
        never changes size: one cut short since it was mapped is mapped anew (reading the old
        mapping past the file's end would kill this process with SIGBUS)."""
        try:
            st = os.lstat(os.path.join(SHM_DIR, name))   # a Path would cost as much as the call
        except OSError:
            return None
        return st.st_dev, st.st_ino, st.st_size

    def _prune_if_due(self) -> None:
        """_prune once PRUNE_S have passed since the last (caller holds _lock): not at every new
        mapping or read, or a cycle of more segments than it keeps would stat them all each time."""
        if time.monotonic() - self._pruned >= self.PRUNE_S:
            self._prune()

    def _prune(self) -> None:
        """Lets go of the mappings whose segment is gone or replaced (caller holds _lock); views
        still in use keep theirs alive. And of the senders of segments gone."""
        self._pruned = time.monotonic()
        for name, (_, identity) in list(self._maps.items()):
            if self._identity(name) != identity:
                del self._maps[name]
        for name in [n for n in self._owners if n not in self._maps and self._identity(n) is None]:
            del self._owners[name]

    def _check_sender(self, name: str, sender: str | None, *, bind: bool) -> None:
        """A segment carries one sender's bundles: refused where another's are bound to it, so that
        a peer cannot have this process take what another link's segment holds. bind: in the same
        step, bind it to this sender where none is (once every check of the handle has passed: a
        refused handle binds nothing, and nothing is ever unbound while the segment lives). A peer
        that names a segment before its own sender does binds it first: that sender is then
        refused, a denial of its link, not a read of its bytes. (An authenticated peer can send any
        bytes of its own anyway.)"""
        if sender is None:
            return
        with self._lock:
            first = self._owners.setdefault(name, sender) if bind else self._owners.get(name, sender)
        if first != sender:
            raise HandleError(grpc.StatusCode.FAILED_PRECONDITION,
                              f"shared-memory segment {name} carries {first}'s bundles, not {sender}'s")

    def _map(self, name: str) -> mmap.mmap:
        with self._lock:
            found = self._maps.get(name)
            if found is not None and self._identity(name) == found[1]:
                self._maps.move_to_end(name)
                self._prune_if_due()
                return found[0]
            self._maps.pop(name, None)   # gone (refused below) or made anew (mapped anew)
            del found   # let go of it now, not with a traceback that holds this frame
        try:
            # O_NONBLOCK: a FIFO named like a segment would block the open until someone wrote to it.
            fd = os.open(SHM_DIR / name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except FileNotFoundError:
            raise HandleError(grpc.StatusCode.FAILED_PRECONDITION,
                              f"shared-memory segment {name} does not exist (its owner ended or replaced it)") from None
        except OSError as exc:
            raise HandleError(grpc.StatusCode.FAILED_PRECONDITION,
                              f"shared-memory segment {name} cannot be opened: {exc.strerror}") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
                raise HandleError(grpc.StatusCode.FAILED_PRECONDITION,
                                  f"shared-memory segment {name} is not a file of this user")
            if st.st_size < HEADER_BYTES:
                raise HandleError(grpc.StatusCode.INVALID_ARGUMENT, f"shared-memory segment {name} has no header")
            mapped = mmap.mmap(fd, st.st_size, prot=mmap.PROT_READ)
        except (ValueError, OSError) as exc:   # cut short since the fstat, or no memory to map it
            raise HandleError(grpc.StatusCode.FAILED_PRECONDITION,
                              f"shared-memory segment {name} cannot be mapped: {exc}") from None
        finally:
            os.close(fd)
        with self._lock:
            self._prune_if_due()
            self._maps[name] = (mapped, (st.st_dev, st.st_ino, st.st_size))
            while len(self._maps) > self._keep:
                self._maps.popitem(last=False)  # views still in use keep their mapping alive
        return mapped

    def header(self, ref: wire_pb2.ShmRef, nbytes: int, sender: str | None = None, *,
               holds: bool = False) -> tuple[mmap.mmap, int]:
        """The mapping of the segment the handle names, checked against it, and its capacity: pass
        the mapping to verify(ref, mapping) once the bytes it versions are copied. sender: who the
        bundle says it is from ("vw 0 stage 1"); a segment another sender used is refused. holds:
        the segment holds the nbytes itself (not a CUDA IPC slot's header)."""
        if not _NAME.fullmatch(ref.name):
            raise HandleError(grpc.StatusCode.INVALID_ARGUMENT,
                              f"shared-memory handle names no hetpipe segment: {ref.name[:80]!r}")
        if ref.version == 0 or ref.version % 2:
            raise HandleError(grpc.StatusCode.INVALID_ARGUMENT,
                              f"shared-memory handle of {ref.name}: version {ref.version} is not a written one")
        if ref.nbytes != nbytes:
            raise HandleError(grpc.StatusCode.INVALID_ARGUMENT,
                              f"shared-memory handle of {ref.name} holds {ref.nbytes} bytes, "
                              f"the shapes in the header {nbytes}")
        self._check_sender(ref.name, sender, bind=False)
        mapped = self._map(ref.name)
        magic, _, capacity = _HEADER.unpack_from(mapped, 0)
        if magic != _MAGIC or HEADER_BYTES + capacity > len(mapped):
            raise HandleError(grpc.StatusCode.INVALID_ARGUMENT,
                              f"shared-memory segment {ref.name} is not a hetpipe segment")
        _check_version(ref, mapped)
        if holds and nbytes > capacity:
            raise HandleError(grpc.StatusCode.INVALID_ARGUMENT,
                              f"shared-memory handle of {ref.name} claims {nbytes} bytes of a {capacity}-byte segment")
        self._check_sender(ref.name, sender, bind=True)
        return mapped, capacity

    def open(self, ref: wire_pb2.ShmRef, nbytes: int, sender: str | None = None) -> tuple[memoryview, mmap.mmap]:
        """The bundle's bytes, checked against the handle, and their mapping: pass it to
        verify(ref, mapping) once they are copied."""
        mapped, _ = self.header(ref, nbytes, sender, holds=True)
        return memoryview(mapped)[HEADER_BYTES : HEADER_BYTES + nbytes], mapped

    def holds(self, mapped: mmap.mmap) -> bool:
        """Whether mapped is one this reader keeps (not let go of: its segment gone, replaced, or
        the least recently used past `keep`)."""
        with self._lock:
            return any(kept is mapped for kept, _ in self._maps.values())

    def verify(self, ref: wire_pb2.ShmRef, mapped: mmap.mmap) -> None:
        """FAILED_PRECONDITION if the bytes were overwritten while they were copied out."""
        _check_version(ref, mapped)
        self.bytes_read += ref.nbytes


def _check_version(ref: wire_pb2.ShmRef, mapped: mmap.mmap) -> None:
    version = _HEADER.unpack_from(mapped, 0)[1]
    if version != ref.version:
        raise HandleError(grpc.StatusCode.FAILED_PRECONDITION,
                          f"stale shared-memory handle: segment {ref.name} holds version {version}, "
                          f"the handle names {ref.version}")

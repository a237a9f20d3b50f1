"""A ps shard's durability: a push is logged before it is applied and acknowledged once its entry
is safe (on disk, or whole in the page cache for a pusher on this machine); a failed log or
checkpoint write loses nothing; checkpoints are written after the push that captured them is
answered; and a shard killed with kill -9 comes back from its checkpoint + push log with every
acknowledged push exactly once (issue 3, DESIGN §3 G1, O3). The crash test runs `python -m
ps_server` as a real process and kills it; the rest use an in-process shard (tests/ps_rig.py).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from hetpipe import rpc, shm
from hetpipe.v1 import ps_pb2, ps_pb2_grpc, wire_pb2
from hetpipe.v1.coordinator_pb2 import WorkerInfo as Info
from ps_rig import CALL_S, KEYS, Client, Code, InProcess, _frames, delta, in_process_shard, refused, state, w0
from shard_reference import record_fsyncs
from ps_server.durability import Durability
from ps_server.servicer import ShardServicer
from ps_server.shard import Shard

pytestmark = pytest.mark.timeout(90)
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def ps(tmp_path: Path) -> Iterator[InProcess]:
    with in_process_shard(tmp_path) as shard:
        yield shard


@pytest.mark.parametrize("write", ["log_stream", "place"])
def test_push_whose_log_write_fails_is_not_applied(ps: InProcess, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   write: str) -> None:
    """An I/O error writing the push log, or its entry's place in the order of applies (under the
    lock, right before the apply), refuses the push whole, so the client's retry is applied (and
    logged) instead of being acknowledged as a 'duplicate' that a kill -9 would then lose."""
    c, durability = ps.client, ps.servicer.durability
    assert durability is not None
    real = getattr(durability, write)

    def full_disk(*args: Any) -> None:
        monkeypatch.setattr(durability, write, real)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(durability, write, full_disk)
    before = state(c.status())
    refused(lambda: c.push(1, 1, delta(1, 1)), Code.UNAVAILABLE, r"I/O error on the server: No space left on device")
    assert state(c.status()) == before, "a push that could not be logged must not be applied"
    assert not list(durability.log_dir.glob("*.written")), "its entry is freed: no restore replays it"
    assert not c.push(1, 1, delta(1, 1)).duplicate, "the retry is the first time it is applied"
    ps.servicer.checkpoints_written()
    restored = Shard()
    Durability(str(tmp_path / "ckpt")).restore(restored)  # what a restart after kill -9 would see
    assert restored.digest() == ps.servicer.shard.digest()
    assert restored.c_global() == 2


def test_an_init_or_evict_whose_checkpoint_fails_is_checkpointed_by_its_retry(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Init and Evict change the shard, then checkpoint it. When that write fails the client gets
    UNAVAILABLE and retries; the retry changes nothing, so it must write the checkpoint: without
    one a restart would come back without keys (every logged push refused) or wait for the
    evicted VW again."""
    durability = Durability(str(tmp_path / "ckpt"))
    servicer = ShardServicer(Shard(), durability, max_pull_wait_s=5.0)
    server = rpc.Server("127.0.0.1", 0, workers=4)
    server.add("ParameterServer", servicer)
    server.start()
    real = durability.checkpoint

    def full_disk(*args: Any) -> None:
        monkeypatch.setattr(durability, "checkpoint", real)
        raise OSError(28, "No space left on device")

    def restored() -> Shard:   # what a restart after kill -9 would see
        servicer.checkpoints_written()
        shard = Shard()
        Durability(str(tmp_path / "ckpt")).restore(shard)
        return shard

    try:
        with rpc.channel(server.address) as ch:
            c = Client(ps_pb2_grpc.ParameterServerStub(ch))
            monkeypatch.setattr(durability, "checkpoint", full_disk)
            refused(lambda: c.init(w0()), Code.UNAVAILABLE, r"Init: I/O error on the server: No space left")
            assert c.init(w0()).message == "already initialised"
            assert not c.push(0, 0, delta(0, 0)).duplicate
            assert restored().digest() == servicer.shard.digest()
            monkeypatch.setattr(durability, "checkpoint", full_disk)
            refused(lambda: c.stub.Evict(ps_pb2.EvictRequest(vw=1), timeout=CALL_S), Code.UNAVAILABLE,
                    r"Evict: I/O error on the server")
            assert c.stub.Evict(ps_pb2.EvictRequest(vw=1), timeout=CALL_S).message == "vw 1 was evicted already"
            assert restored().evicted == {1} and restored().c_global() == 1
    finally:
        server.stop(0)


def test_a_slow_disk_holds_one_checkpoint_at_a_time(ps: InProcess, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Each capture copies every value: while one waits for the disk no push captures another
    (else a disk slower than the clocks queues copies until memory runs out). The log keeps the
    entries meanwhile, and the first clock after the write captures again."""
    c, durability = ps.client, ps.servicer.durability
    assert durability is not None
    write, capture = durability.write, durability.capture
    captures: list[int] = []

    def slow_write(snapshot: Any) -> None:
        time.sleep(0.5)
        write(snapshot)

    def counted(shard: Shard) -> Any:
        captures.append(shard.c_global())
        return capture(shard)

    monkeypatch.setattr(durability, "write", slow_write)
    monkeypatch.setattr(durability, "capture", counted)
    for clock in range(1, 6):   # c_global 2..5, each due for a checkpoint (every clock)
        if clock > 1:
            c.push(0, clock, delta(0, clock))
        c.push(1, clock, delta(1, clock))
    assert captures == [2], "a capture while the last one waits for the disk"
    ps.servicer.checkpoints_written()
    c.push(0, 6, delta(0, 6))
    c.push(1, 6, delta(1, 6))
    assert captures == [2, 6]
    ps.servicer.checkpoints_written()
    restored = Shard()
    Durability(str(tmp_path / "ckpt")).restore(restored)
    assert restored.digest() == ps.servicer.shard.digest()


def test_a_checkpoint_that_torch_cannot_write_is_an_io_error(tmp_path: Path) -> None:
    """torch.save reports a failed write (here: past the process's file size limit) as a
    RuntimeError, which a server answers as its own bug (INTERNAL, never retried): it is an
    OSError, so Init and Evict answer UNAVAILABLE and their retry writes it."""
    script = ("import resource, signal, sys, torch\n"
              "from hetpipe.weight_files import save_atomically\n"
              "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
              "resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))\n"
              "try:\n"
              "    save_atomically({'w': torch.zeros(1 << 16)}, sys.argv[1], durable=True)\n"
              "except OSError as exc:\n"
              "    print('OSError', exc.errno, exc)\n")
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path / "checkpoint.pt")], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.startswith("OSError 5 "), (done.stdout, done.stderr)
    assert "checkpoint.pt" in done.stdout and not (tmp_path / "checkpoint.pt").exists()


def test_push_is_acknowledged_once_its_log_entry_is_on_disk(ps: InProcess, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Under WSP a push's log entry is fsynced after the push is applied (off the path to the pulls
    it releases) and before it is acknowledged, then renamed to its number and its folder fsynced.
    An fsync that fails leaves it applied but not acknowledged; its retry, a duplicate, is
    acknowledged once the original's entry is on disk."""
    c, durability = ps.client, ps.servicer.durability
    assert durability is not None
    durability.every_clocks = 10**6  # no checkpoint: it would cover the entry (and fsync itself)
    synced = record_fsyncs(monkeypatch, [OSError(5, "Input/output error")])
    refused(lambda: c.push(1, 1, delta(1, 1)), Code.UNAVAILABLE, r"Input/output error")
    (written,) = durability.log_dir.glob("*.written")
    number = written.name.removesuffix(".written")
    assert c.status().c_global == 2, "applied before its fsync, so pulls need not wait for the disk"
    assert not synced
    assert c.push(1, 1, delta(1, 1)).duplicate
    assert synced == [written.name, "log"], "a duplicate was acknowledged before its original's entry was on disk"
    assert durability.entries()[-1].name == number and not written.exists()
    assert not c.push(0, 2, delta(0, 2)).duplicate
    assert synced[2:] == [durability.entries()[-1].name + ".written", "log"]
    restored = Shard()
    Durability(str(tmp_path / "ckpt")).restore(restored)
    assert restored.digest() == ps.servicer.shard.digest()


@pytest.mark.parametrize("chunk_bytes", [None, 12], ids=["whole", "in-chunks"])
def test_a_push_through_shared_memory_is_acknowledged_once_its_entry_is_written(ps: InProcess, tmp_path: Path,
                                                                                  monkeypatch: pytest.MonkeyPatch,
                                                                                  chunk_bytes: int | None) -> None:
    """A pusher that shares the shard's machine (its push came through shared memory) is answered
    once the entry is whole in the page cache, without an fsync: a kill -9 of the shard keeps the
    entry (a restart replays it), and a restart of the machine would end the pusher as well. A
    push in gRPC frames, from a pusher that may be elsewhere, still waits for the disk. A large
    push comes a chunk a frame, and is logged and applied the same."""
    c, durability = ps.client, ps.servicer.durability
    assert durability is not None
    durability.every_clocks = 10**6   # no checkpoint: it would cover the entries
    synced = record_fsyncs(monkeypatch)
    ring = shm.Ring(slots=1) if chunk_bytes is None else shm.Ring(slots=1, chunk_bytes=chunk_bytes, whole_up_to=chunk_bytes)
    try:
        tag = wire_pb2.PushTag(vw=1, clock=1)
        frames = _frames(delta(1, 1), push=tag, ring=ring)
        assert (len(frames) > 2) == (chunk_bytes is not None)
        expected = {k: v.clone() for k, v in ps.servicer.shard.values.items()}
        for key, value in delta(1, 1):
            expected[key] += value
        assert not c.stub.Push(iter(frames), timeout=CALL_S).duplicate
        assert all(torch.equal(ps.servicer.shard.values[k], v) for k, v in expected.items())
        assert ps.servicer.shard.c_global() == 2 and not synced, "acknowledged without waiting for the disk"
        (written,) = durability.log_dir.glob("*.written")
        assert c.stub.Push(iter(_frames(delta(1, 1), push=tag, ring=ring)), timeout=CALL_S).duplicate
        assert not synced and written.exists()
    finally:
        ring.close()
    restored = Shard()   # what a restart after kill -9 sees: the entry, replayed
    assert Durability(str(tmp_path / "ckpt")).restore(restored) >= 1
    assert restored.digest() == ps.servicer.shard.digest()
    synced.clear()
    assert not c.push(0, 2, delta(0, 2)).duplicate
    assert synced[-1] == "log" and durability.entries()[-1].name + ".written" in synced, "gRPC frames wait for the disk"


def test_a_push_is_answered_before_the_checkpoint_it_captured_is_written(ps: InProcess, tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A push that moves c_global captures a checkpoint (every clock here), which the checkpoint
    thread writes after the push is answered: the pusher does not wait for a snapshot of every
    key to reach the disk. Until it is written the log keeps the push; one that fails to be
    written changes nothing that a restart needs, and the next one covers the log."""
    c, durability = ps.client, ps.servicer.durability
    assert durability is not None
    real_write, release, failed = durability.write, threading.Event(), [False]

    def slow_write(snapshot: Any) -> None:
        assert release.wait(CALL_S), "the push was not answered while its checkpoint was being written"
        if not failed[0]:
            failed[0] = True
            raise OSError(28, "No space left on device")
        real_write(snapshot)

    monkeypatch.setattr(durability, "write", slow_write)
    assert not c.push(1, 1, delta(1, 1)).duplicate   # c_global 1 -> 2: a checkpoint captured, not yet written
    assert not c.push(0, 2, delta(0, 2)).duplicate   # answered too, the first write still held
    assert ps.servicer.shard.c_global() == 2
    release.set()
    ps.servicer.checkpoints_written()
    assert failed[0], "the first write failed: logged, and the push was answered all the same"
    restored = Shard()
    Durability(str(tmp_path / "ckpt")).restore(restored)
    assert restored.digest() == ps.servicer.shard.digest()


# ---- a real shard process, killed with kill -9 ------------------------------------------------------


@dataclass
class ShardProcess:
    args: list[str]
    ready: Path
    log: Path
    proc: subprocess.Popen[bytes] | None = None
    address: str = ""

    def start(self, port: int = 0) -> None:
        self.ready.unlink(missing_ok=True)
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen([*self.args, "--port", str(port)], cwd=REPO, env=env, stdout=log,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while not self.ready.exists():
            assert self.proc.poll() is None, f"shard exited {self.proc.returncode}: {self.log.read_text()[-2000:]}"
            assert time.monotonic() < deadline, "shard did not get ready"
            time.sleep(0.05)
        address, metrics_port = self.ready.read_text().split()
        assert int(metrics_port) > 0
        self.address = address

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def test_kill_9_loses_no_acknowledged_push(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    shard = ShardProcess(
        [sys.executable, "-m", "ps_server", "--ready-file", str(tmp_path / "shard.ready"), "--checkpoint-dir",
         str(ckpt), "--checkpoint-every", "2", "--exit-with-parent"],
        tmp_path / "shard.ready", tmp_path / "shard.log")
    ch = None
    try:
        shard.start()
        ch = rpc.channel(shard.address)
        c = Client(ps_pb2_grpc.ParameterServerStub(ch))
        assert c.init(w0()).message == "initialised"
        expected = dict(w0())
        acked: list[tuple[int, int, list[str]]] = []

        def push(vw: int, clock: int, keys: list[str] = KEYS) -> None:
            reply = c.push(vw, clock, delta(vw, clock, keys))
            assert not reply.duplicate
            acked.append((vw, clock, keys))
            for k, d in delta(vw, clock, keys):
                expected[k] = expected[k] + d

        # Checkpoints at c_global 2 and 4 (every 2 clocks); what follows lives only in the push log.
        for clock in range(4):
            push(1, clock)
            push(0, clock)
        push(0, 4)
        push(1, 4, ["l0.bias"])   # half of vw 1's wave 4: keys of one VW at different clocks
        before = c.status()
        assert before.c_global == 4 and before.pushes_applied == len(acked) == 10
        # The checkpoint at c_global 4 is written on a thread of its own once its push is answered.
        deadline = time.monotonic() + 30
        while len(logged := list((ckpt / "log").glob("*.safetensors"))) != 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(logged) == 2, "the last two pushes are only in the log"

        assert shard.proc is not None
        shard.proc.send_signal(signal.SIGKILL)
        assert shard.proc.wait(10) == -signal.SIGKILL
        port = int(shard.address.rsplit(":", 1)[1])
        shard.start(port)  # same port: clients reconnect on their old channel

        after = c.status(wait_for_ready=True)
        assert after.values_digest == before.values_digest
        assert after.pushes_applied == len(acked), "every acknowledged push exactly once"
        assert after.restored_pushes >= 2, "the pushes after the last checkpoint came back from the log"
        assert [(x.vw, x.min_clock, x.max_clock) for x in after.clocks] == [(0, 5, 5), (1, 4, 5)]
        assert after.c_global == 4
        pulled = c.pull(1, KEYS, min_clock=4)
        assert list(pulled.header.pull.own_clock) == [4, 5]
        for k, v in pulled.tensors:
            assert torch.equal(v, expected[k]), f"{k}: w_global != w0 + the acknowledged pushes (O3)"

        # A client that never saw the last acknowledgements retries: duplicates, changing nothing.
        assert c.push(1, 4, delta(1, 4, ["l0.bias"])).duplicate
        assert c.push(0, 4, delta(0, 4)).duplicate
        assert c.status().values_digest == before.values_digest
        # ... and the job goes on.
        push(1, 4, ["l0.weight"])
        assert c.status().c_global == 5

        # SIGTERM: a graceful stop that checkpoints everything.
        shard.proc.send_signal(signal.SIGTERM)
        assert shard.proc.wait(30) == 0, shard.log.read_text()[-2000:]
        final = Shard()
        Durability(str(ckpt)).restore(final)
        assert final.pushes_applied == len(acked) and final.c_global() == 5
        for k in KEYS:
            assert torch.equal(final.values[k], expected[k]), k
    finally:
        if ch is not None:
            ch.close()
        shard.stop()


def test_a_push_refused_under_g4_gets_no_place_in_the_log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An entry's place is given once the shard has checked the push, right before its apply:
    log replay asks G4 again only of entries without one, so a kill -9 between a refusal and the
    freeing of its entry must not leave it placed, or replay would apply a push never taken."""
    with in_process_shard(tmp_path, rule={"exact": True, "distance_bound": 0}) as ps:
        durability = ps.servicer.durability
        assert durability is not None
        placed: list[int] = []
        real = durability.place

        def place(seq: int) -> None:
            placed.append(seq)
            real(seq)

        monkeypatch.setattr(durability, "place", place)
        push = iter(_frames(delta(0, 2), push=wire_pb2.PushTag(vw=0, clock=2)))
        refused(lambda: ps.client.stub.Push(push, timeout=2.0), Code.FAILED_PRECONDITION, r"G4 with D = 0")
        assert placed == [], "a push the shard refused was placed"
        assert not ps.client.push(1, 1, delta(1, 1)).duplicate
        assert len(placed) == 1


class _OrphanRig:
    """A real shard process in a checkpoint folder, registering with an in-process coordinator
    that the test takes down and brings back on the same port: restarted (a fresh registry), or
    the same one reachable again."""

    def __init__(self, tmp_path: Path, interval_s: float) -> None:
        from coordinator.__main__ import build

        self.interval_s = interval_s
        self.server, self.servicer = build("127.0.0.1", 0, heartbeat_interval_s=interval_s)
        self.server.start()
        self.coordinator = self.server.address
        self.ckpt = tmp_path / "ckpt"
        self.shard = ShardProcess(
            [sys.executable, "-m", "ps_server", "--ready-file", str(tmp_path / "shard.ready"), "--checkpoint-dir",
             str(self.ckpt), "--coordinator", self.coordinator, "--exit-with-parent"],
            tmp_path / "shard.ready", tmp_path / "shard.log")

    def coordinator_down(self) -> None:
        self.server.stop()

    def coordinator_up(self, *, restarted: bool) -> None:
        """On the same port: a restarted coordinator (its registry knows nobody), or the same one."""
        from coordinator.__main__ import build

        port = int(self.coordinator.rsplit(":", 1)[1])
        if restarted:
            self.server, self.servicer = build("127.0.0.1", port, heartbeat_interval_s=self.interval_s)
        else:
            self.server = rpc.Server("127.0.0.1", port)
            self.server.add("Coordinator", self.servicer)
        self.server.start()

    def close(self) -> None:
        self.shard.stop()
        self.server.stop()

    def left(self) -> list[str]:
        return sorted(str(p.relative_to(self.ckpt)) for p in self.ckpt.rglob("*") if p.is_file())

    def registered(self) -> list[Any]:
        from hetpipe.v1 import coordinator_pb2_grpc

        with rpc.channel(self.coordinator) as ch:
            stub = coordinator_pb2_grpc.CoordinatorStub(ch)
            return list(stub.ListWorkers(wire_pb2.Empty(), timeout=5).workers)

    def wait_registered(self) -> None:
        """Until this process registered: its ready file comes before its registration, and an
        earlier process's entry may stand at its address."""
        assert self.shard.proc is not None
        me = (self.shard.address, f"pid {self.shard.proc.pid}")
        deadline = time.monotonic() + 30
        while me not in [(w.info.address, w.info.name) for w in self.registered()]:
            assert time.monotonic() < deadline, f"the shard never registered: {self.log()}"
            time.sleep(0.05)

    def serve_a_job(self) -> None:
        """Starts the shard, registered, and gives it a job: Init, and a push."""
        self.shard.start()
        self.wait_registered()
        with rpc.channel(self.shard.address) as ch:
            c = Client(ps_pb2_grpc.ParameterServerStub(ch))
            assert c.init(w0(), rule={"shard": 0}).message == "initialised"
            c.push(0, 0, delta(0, 0))
        assert {"checkpoint.pt", "shard_index"} <= set(self.left())

    def exited_orphaned(self) -> None:
        from hetpipe.service import EXIT_ORPHANED

        assert self.shard.proc is not None and self.shard.proc.wait(30) == EXIT_ORPHANED, self.log()

    def status(self) -> Any:
        with rpc.channel(self.shard.address) as ch:
            return Client(ps_pb2_grpc.ParameterServerStub(ch)).status(wait_for_ready=True)

    def log(self) -> str:
        return self.shard.log.read_text()[-3000:]


@contextmanager
def _orphan_rig(tmp_path: Path, interval_s: float = 0.1) -> Iterator[_OrphanRig]:
    rig = _OrphanRig(tmp_path, interval_s)
    try:
        yield rig
    finally:
        rig.close()


def test_a_shard_whose_coordinator_restarted_discards_that_jobs_state(tmp_path: Path) -> None:
    """The job ended with the coordinator that ran it: the shard exits EXIT_ORPHANED having
    deleted its checkpoint, log and index, so that what restarts it in its folder (compose, a
    StatefulSet, `hetpipe worker`) starts it fresh; restored, that job's values met the next
    job's Init as a conflict. Both ways the coordinator says so: a heartbeat answered "unknown"
    (its restart took under the 10 intervals that would make it unreachable), and job_unknown
    to a shard that registers holding a job restored after a kill."""
    with _orphan_rig(tmp_path, interval_s=0.5) as rig:
        rig.serve_a_job()
        rig.coordinator_down()
        rig.coordinator_up(restarted=True)
        rig.exited_orphaned()
        assert "no longer knows this process" in rig.log()
        assert rig.left() == [], "the ended job's state outlived it"

        rig.serve_a_job()   # fresh: it registers, and serves the next job
        assert rig.shard.proc is not None
        rig.shard.proc.kill()
        rig.shard.proc.wait(10)
        rig.shard.start()   # restored from its folder, holding a job this coordinator never gave it
        rig.exited_orphaned()
        assert "runs no job of the state this process holds" in rig.log()
        assert rig.left() == [], "the restored job's state outlived it"
        assert f"pid {rig.shard.proc.pid}" not in [w.info.name for w in rig.registered()], "registered holding it"

        rig.shard.start()
        rig.wait_registered()
        status = rig.status()
        assert status.keys == 0 and status.pushes_applied == 0, status


def test_a_shard_that_lost_its_coordinator_for_a_while_keeps_its_job(tmp_path: Path) -> None:
    """Unreachable for 10 heartbeat intervals, the coordinator may still run the job (a network
    fault): the shard exits EXIT_ORPHANED with its state kept, and restarted at its address it
    takes over its assignment with its keys and pushes, as after any restart mid-job."""
    with _orphan_rig(tmp_path) as rig:
        rig.serve_a_job()
        (claimed,) = rig.servicer.registry.claim(Info.PS_SHARD, [("ps shard 0", "", "")], 30)
        rig.coordinator_down()   # unreachable, its registry and the assignment in it alive
        rig.exited_orphaned()
        assert "unreachable" in rig.log() and {"checkpoint.pt", "shard_index"} <= set(rig.left())
        rig.coordinator_up(restarted=False)
        rig.shard.start(int(rig.shard.address.rsplit(":", 1)[1]))   # restarted at its address
        rig.wait_registered()
        (again,) = [w for w in rig.registered() if w.info.address == rig.shard.address]
        assert again.assigned == "ps shard 0" and again.worker_id != claimed.worker_id
        status = rig.status()
        assert status.keys == 2 and status.pushes_applied == 1, status


def test_a_shard_whose_last_checkpoint_fails_still_leaves(tmp_path: Path) -> None:
    """A restarted compose coordinator clears the shards' folders while the orphaned shards
    still run: a shard that left by the unreachable path, which checkpoints, fails its last
    checkpoint and stops anyway, instead of serving on holding a job for nobody."""
    import shutil

    with _orphan_rig(tmp_path) as rig:
        rig.serve_a_job()
        shutil.rmtree(rig.ckpt)
        rig.coordinator_down()
        rig.exited_orphaned()
        assert "the shard's last checkpoint failed" in rig.log()

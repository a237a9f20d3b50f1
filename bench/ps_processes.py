"""The processes of bench/ps_throughput.py: VW clients pushing and pulling through the production
stub and codec, ps_server shards started through their real entry point, and a raw TCP pair."""

from __future__ import annotations

import os
import shutil
import socket
import struct
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import psutil

from children import stop_children
from netns import enter

# Generous: on a loaded 2-core box even a forked process can take many seconds to come up.
@dataclass(frozen=True)
class Far:
    """Another "host": a network namespace, and the address the processes there bind."""

    namespace: str
    host: str


START_TIMEOUT_S = 180.0
STEP_TIMEOUT_S = 300.0


# --- a VW: one client process pushing and pulling through the production stub and codec --------


# Untimed rounds first: a push ring's second slot is made at the second push, and with N > 1 VWs
# the shard makes a second pull slot at the second pull (the first is still held by the VW that has
# not pulled again): with one warm-up round, the first timed round made 100 MiB segments.
WARM_ROUNDS = 2


def _client_main(conn: Connection) -> None:
    import torch

    torch.set_num_threads(1)  # as in a stage worker: the bench measures communication, not BLAS
    conn.send(("ready", os.getpid()))
    while (msg := conn.recv())[0] != "exit":
        try:
            _client_run(conn, msg[1])
        except Exception:  # the parent must hear about it, not wait for a dead child
            conn.send(("error", traceback.format_exc()))


def _client_run(conn: Connection, cfg: dict[str, Any]) -> None:
    import torch

    from hetpipe import rpc, shm, wire
    from hetpipe.buffers import raw_bytes
    from hetpipe.v1 import ps_pb2, wire_pb2
    from stage_worker.wsp_sync import PULL_CALL_S

    vw: int = cfg["vw"]
    channels = [rpc.channel(address) for address in cfg["addresses"]]
    stubs = [rpc.Stub(ch, "ParameterServer") for ch in channels]
    # parallel.transport shm: pushes through a ring per shard, pull replies through the shard's.
    rings = [shm.Ring() if cfg["shm"] else None for _ in channels]
    reader = shm.Reader()
    groups: dict[int, list[str]] = {}
    for key, shard in cfg["placement"].items():
        groups.setdefault(shard, []).append(key)
    # Each VW adds vw+1 per wave, so every pulled value is an exact, checkable sum of the clocks.
    update = {key: torch.full((cfg["elems"],), float(vw + 1)) for key in cfg["placement"]}
    weights = {key: torch.empty(cfg["elems"]) for key in cfg["placement"]}   # what pulls land in
    # One thread per shard: a VW's k stages push and pull their own shards' keys concurrently.
    pool = ThreadPoolExecutor(max_workers=len(stubs))

    def push(shard: int, wave: int) -> None:
        # Exactly WspSync._push's call.
        tag = wire_pb2.PushTag(vw=vw, clock=wave)
        tensors = [(key, update[key]) for key in groups[shard]]
        reply = rpc.send_bundle(stubs[shard], "Push", wire.encode(tensors, push=tag, ring=rings[shard]),
                                timeout=rpc.DATA_DEADLINE_S)
        if reply.duplicate:
            raise RuntimeError(f"vw {vw}: push of wave {wave} to shard {shard} was taken for a duplicate")

    def pull(shard: int, min_clock: int) -> float:
        """WspSync._pull's call for one shard; returns the seconds until the first frame arrived."""
        request = ps_pb2.PullRequest(vw=vw, keys=groups[shard], min_clock=min_clock, shm=cfg["shm"])
        start = time.perf_counter()
        first: list[float] = []

        def timed(frames: Any) -> Any:
            for frame in frames:
                if not first:
                    first.append(time.perf_counter() - start)
                yield frame

        # As WspSync: a reply in the shard's slot is copied from there into the weights (_merge_into),
        # one in gRPC frames is received into new tensors, then set.
        if request.shm:
            stream = wire.read(list(timed(stubs[shard].Pull(request, timeout=PULL_CALL_S))), reader)
            header, names = stream.header, stream.names
            wire.fill(stream, [raw_bytes(weights[key]) for key in names])
        else:
            bundle = wire.decode(timed(stubs[shard].Pull(request, timeout=PULL_CALL_S)))
            header, names = bundle.header, [key for key, _ in bundle.tensors]
            for key, value in bundle.tensors:
                weights[key].copy_(value)
        tag = header.pull
        if tag.c_global < min_clock:
            raise RuntimeError(f"vw {vw}: pull for min_clock {min_clock} answered at c_global {tag.c_global}")
        want = float(sum((v + 1) * c for v, c in enumerate(tag.vw_clocks)))
        for key in names:
            value = weights[key]
            if float(value[0]) != want or float(value[-1]) != want:
                raise RuntimeError(f"vw {vw}: {key} is {float(value[0])}, expected {want} from {list(tag.vw_clocks)}")
        return first[0]

    def one_round(wave: int) -> tuple[float, float, float]:
        shards = sorted(groups)
        start = time.perf_counter()
        list(pool.map(lambda s: push(s, wave), shards))
        pushed = time.perf_counter()
        # min_clock = wave + 1: answered only once every VW's push of this wave is in.
        waits = list(pool.map(lambda s: pull(s, wave + 1), shards))
        return pushed - start, time.perf_counter() - pushed, max(waits)

    try:
        for wave in range(WARM_ROUNDS):  # connections, every buffer made and touched; lines the VWs up
            one_round(wave)
        conn.send(("warm", None))
        if conn.recv()[0] != "go":
            return
        conn.send(("done", [one_round(wave) for wave in range(WARM_ROUNDS, WARM_ROUNDS + cfg["rounds"])]))
    finally:
        pool.shutdown()
        for ch in channels:
            ch.close()
        for ring in rings:
            if ring is not None:
                ring.close()


class Clients:
    """A pool of VW processes, reused across configurations (fresh channels for each)."""

    def __init__(self, ctx: Any, count: int) -> None:
        self.conns: list[Connection] = []
        self.procs: list[Any] = []
        for _ in range(count):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_client_main, args=(child,), daemon=True)
            proc.start()
            self.conns.append(parent)
            self.procs.append(proc)

    def wait_started(self) -> None:
        for conn in self.conns:
            expect(conn, "ready", START_TIMEOUT_S)

    def close(self) -> None:
        stop_children(self.conns, ("exit", None), self.procs)


def expect(conn: Connection, kind: str, timeout: float) -> Any:
    if not conn.poll(timeout):
        raise TimeoutError(f"no '{kind}' from a child within {timeout:.0f}s")
    got, payload = conn.recv()
    if got == "error":
        raise RuntimeError(f"child failed:\n{payload}")
    if got != kind:
        raise RuntimeError(f"expected '{kind}' from a child, got '{got}'")
    return payload


# --- shards: the production entry point, one process each ----------------------------------------


def _shard_main(argv: list[str], log_path: str, namespace: str | None) -> None:
    """Runs the shard's real entry point, `python -m ps_server ARGV`, in a process forked from the
    forkserver: only the interpreter start and imports are shared, not any gRPC state. namespace:
    the network namespace it runs in (another "host"; None: this one)."""
    from ps_server.__main__ import main

    if namespace is not None:
        enter(namespace)
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    try:
        main(argv)  # serves until SIGTERM, then leaves with os._exit(0)
    finally:
        os._exit(1)


class ShardProcs:
    """S ps_server processes; the address comes from the ready file, as the launcher does."""

    def __init__(self, ctx: Any, count: int, workdir: Path, durable: bool, far: Far | None = None) -> None:
        self.workdir = workdir
        self.ready_files = [workdir / f"shard{i}.ready" for i in range(count)]
        self.logs = [workdir / f"shard{i}.log" for i in range(count)]
        self.checkpoint_dirs = [workdir / f"ckpt{i}" if durable else None for i in range(count)]
        self.procs: list[Any] = []
        for i, ready in enumerate(self.ready_files):
            argv = ["--port", "0", "--metrics-port", "0", "--ready-file", str(ready), "--exit-with-parent"]
            if self.checkpoint_dirs[i] is not None:
                argv += ["--checkpoint-dir", str(self.checkpoint_dirs[i])]
            if far is not None:  # a namespace of its own, with nothing else in it
                argv += ["--host", far.host, "--insecure"]
            proc = ctx.Process(target=_shard_main, args=(argv, str(self.logs[i]), far and far.namespace), daemon=True)
            proc.start()
            self.procs.append(proc)
        self.addresses: list[str] = []

    def wait_started(self) -> list[str]:
        from hetpipe import rpc

        deadline = time.monotonic() + START_TIMEOUT_S
        for proc, ready, log in zip(self.procs, self.ready_files, self.logs):
            while not ready.exists():
                if not proc.is_alive():
                    tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
                    raise RuntimeError(f"ps shard exited with {proc.exitcode}:\n{tail}")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"ps shard did not write {ready} within {START_TIMEOUT_S:.0f}s")
                time.sleep(0.02)
            address = ready.read_text().split()[0]  # "host:port metrics_port"
            rpc.wait_ready(address)
            self.addresses.append(address)
        return self.addresses

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def close(self) -> None:
        for proc in self.procs:
            if proc.is_alive():
                proc.terminate()  # SIGTERM: the shard's own graceful shutdown (and checkpoint)
        for proc in self.procs:
            proc.join(timeout=15)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for d in self.checkpoint_dirs:
            if d is not None:
                shutil.rmtree(d, ignore_errors=True)


# --- raw TCP: one sender/receiver process pair, receiver recv_into one preallocated buffer ---------


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("raw TCP peer closed mid-message")
        got += n


def _tcp_receiver(conn: Connection, buffer_bytes: int, far: Far | None) -> None:
    host = "127.0.0.1" if far is None else far.host
    if far is not None:
        enter(far.namespace)
    buffer = memoryview(bytearray(buffer_bytes))
    with socket.create_server((host, 0)) as listener:
        conn.send(("ready", f"{host}:{listener.getsockname()[1]}"))
        sock, _ = listener.accept()
    with sock:
        prefix = bytearray(8)
        while True:
            _recv_exact(sock, memoryview(prefix))
            (total,) = struct.unpack("<Q", prefix)
            if total == 0:
                return
            # The whole transfer lands in one buffer, overwritten: no allocation in the timed path.
            while total:
                n = min(total, buffer_bytes)
                _recv_exact(sock, buffer[:n])
                total -= n
            sock.sendall(b"\x01")


def _tcp_sender(conn: Connection, address: str, buffer_bytes: int) -> None:
    buffer = memoryview(bytearray(os.urandom(1 << 16)) * (buffer_bytes >> 16))
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port))) as sock:
        conn.send(("ready", None))
        ack = bytearray(1)
        while (total := conn.recv()) is not None:
            start = time.perf_counter()
            sock.sendall(struct.pack("<Q", total))
            left = total
            while left:
                n = min(left, len(buffer))
                sock.sendall(buffer[:n])
                left -= n
            _recv_exact(sock, memoryview(ack))
            conn.send(("moved", time.perf_counter() - start))
        sock.sendall(struct.pack("<Q", 0))


class TcpPair:
    def __init__(self, ctx: Any, buffer_bytes: int, far: Far | None = None) -> None:
        self._recv_conn, child = ctx.Pipe()
        receiver = ctx.Process(target=_tcp_receiver, args=(child, buffer_bytes, far), daemon=True)
        receiver.start()
        address = expect(self._recv_conn, "ready", START_TIMEOUT_S)
        self._send_conn, child = ctx.Pipe()
        sender = ctx.Process(target=_tcp_sender, args=(child, address, buffer_bytes), daemon=True)
        sender.start()
        expect(self._send_conn, "ready", START_TIMEOUT_S)
        self.procs = [sender, receiver]

    def move(self, total: int) -> tuple[float, float]:
        """Wall seconds to move total bytes, and the CPU seconds both processes spent on it."""
        before = cpu_seconds([p.pid for p in self.procs])
        self._send_conn.send(total)
        seconds = float(expect(self._send_conn, "moved", STEP_TIMEOUT_S))
        return seconds, cpu_seconds([p.pid for p in self.procs]) - before

    def close(self) -> None:
        stop_children([self._send_conn], None, self.procs)


def cpu_seconds(pids: list[int]) -> float:
    """User + system seconds of these processes, every thread included."""
    total = 0.0
    for pid in pids:
        t = psutil.Process(pid).cpu_times()
        total += t.user + t.system
    return total


"""Throughput of the stage-to-stage paths, gRPC frames and shared memory (parallel.transport grpc
and shm), against raw TCP and torch.distributed gloo: on one host over loopback, or (--netns)
across two network namespaces joined by a veth pair, where shared memory does not apply.

--cuda (a CUDA machine): GPU tensors on both sides, CUDA IPC (`cuda_ipc`) and shared memory
through pinned host buffers (`shm`) against a device-to-device copy in one process (`d2d`)."""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket
import statistics
import struct
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import psutil

# Run as `python bench/transport.py`: the repository root is not on sys.path then.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from children import stop_children  # noqa: E402
from netns import Veth, enter, veth_pair  # noqa: E402

MIB = 1 << 20
SIZES_MIB = (1, 16, 64)
TRANSPORTS = ("grpc", "shm", "raw_tcp", "gloo")
CUDA_TRANSPORTS = ("cuda_ipc", "shm", "d2d")
OURS = ("grpc", "shm", "cuda_ipc")
BASELINES = ("raw_tcp", "gloo", "d2d")
# Every receiver allocates a fresh tensor per message with wire.empty, as wire.decode must (the
# stage keeps what it receives), and every sender sends from one tensor made once: the same
# policy for all three transports.
BUFFER_POLICY = "sender reuses one tensor; receiver allocates a fresh one per message with wire.empty"


@dataclass(frozen=True)
class Site:
    """Where a receiver runs: its network namespace (None: this one), the address it binds, and
    the interface gloo should use."""

    namespace: str | None = None
    host: str = "127.0.0.1"
    gloo_ifname: str = "lo"


def _arrive(site: Site) -> None:
    if site.namespace is not None:
        enter(site.namespace)
    os.environ["GLOO_SOCKET_IFNAME"] = site.gloo_ifname


def _pattern(nbytes: int) -> Any:
    import torch

    # Exact in float32 up to 2**24 elements (64 MiB), so the receiver can check both ends.
    return torch.arange(nbytes // 4, dtype=torch.float32)


def _check(tensor: Any, nbytes: int) -> None:
    n = nbytes // 4
    # Both ends in one read: on a GPU each read waits for the device (py-spy: 7% of a receiver's time).
    if tensor.numel() != n or tensor[[0, -1]].tolist() != [0.0, float(n - 1)]:
        raise RuntimeError(f"received a corrupt tensor of {tensor.numel()} elements (expected {n})")


# --- gRPC: the production Stage service on one side, the production Link on the other ---------


class _SinkRuntime:
    """Stands in for StageRuntime behind the real StageServicer: checks and drops each activation."""

    def __init__(self, gpu: Any = None) -> None:
        self.gpu = gpu   # a torch.device: a GPU stage, which receives onto it

    def check_forward(self, stream: Any) -> None:
        """The servicer asks before it allocates: one float32 tensor, as every bench message is."""
        if len(stream.specs) != 1:
            raise RuntimeError(f"bench receiver: {len(stream.specs)} tensors, expected one")

    def offer_forward(self, bundle: Any) -> None:
        (_, x), = bundle.tensors
        if self.gpu is not None and not x.is_cuda:   # shm: pinned host memory, to the GPU as the inbox takes it
            import torch

            x = x.to(self.gpu, non_blocking=True)
            torch.cuda.synchronize(self.gpu)   # on the GPU before the answer, as a CUDA IPC bundle is
        _check(x, x.numel() * 4)


def sink_server(host: str, cuda: bool = False) -> Any:
    """The production Stage servicer, started, in front of _SinkRuntime."""
    import torch

    from hetpipe import rpc
    from stage_worker.servicer import StageServicer

    server = rpc.Server(host, 0)
    runtime = _SinkRuntime(torch.device("cuda:0") if cuda else None)
    server.add("Stage", StageServicer(runtime, lambda: None))  # type: ignore[arg-type]
    server.start()
    return server


def _grpc_receiver(conn: Connection, site: Site, cuda: bool = False) -> None:
    _arrive(site)
    import torch

    torch.set_num_threads(1)
    server = sink_server(site.host, cuda)
    conn.send(server.address)
    conn.recv()  # until told to stop
    server.stop()


def grpc_sender(address: str, shared_memory: bool = False, cuda_ipc: bool = False) -> Callable[..., None]:
    from hetpipe import rpc
    from hetpipe.v1 import wire_pb2
    from stage_worker.links import Link, Outgoing

    def fail(message: str) -> None:
        raise RuntimeError(message)

    link = Link(address=address, method="Forward", peer="bench receiver", on_failure=fail,
                shared_memory=shared_memory, cuda_ipc=cuda_ipc)
    tag = wire_pb2.MinibatchTag(vw=0, minibatch=1, weight_version=0, stage=0)

    def send(tensor: Any, burst: int = 1) -> None:
        if burst == 1:
            # Link.send's staging (a CUDA IPC slot, else pinned host memory for a GPU tensor), then
            # Link._deliver, the exact production send: wire encoding, deadline, retry policy.
            item = link.prepare(Outgoing(tag, [("activation", tensor)]))
            if item.ready is not None:
                item.ready.synchronize()
            if not link._deliver(item):
                raise RuntimeError("gRPC send failed")
            return
        # A burst goes as a stage's does: queued, and sent by the link's thread, links.WINDOW at once.
        for _ in range(burst):
            link.send(Outgoing(tag, [("activation", tensor)]))
        if not link.flush(rpc.DATA_DEADLINE_S):
            raise RuntimeError("gRPC send failed")

    return send


# --- raw TCP: length prefix + sendall on one side, recv_into a fresh tensor on the other -------

_ACK_BIT = 1 << 63   # in the length prefix: acknowledge this message (a burst's last)


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("raw TCP sender closed mid-message")
        got += n


def _tcp_receiver(conn: Connection, site: Site) -> None:
    _arrive(site)
    import torch

    from hetpipe import wire

    torch.set_num_threads(1)
    with socket.create_server((site.host, 0)) as listener:
        conn.send(f"{site.host}:{listener.getsockname()[1]}")
        sock, _ = listener.accept()
    with sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        prefix = bytearray(8)
        while True:
            _recv_exact(sock, memoryview(prefix))
            (word,) = struct.unpack("<Q", prefix)
            nbytes, ack = word & ~_ACK_BIT, bool(word & _ACK_BIT)
            if nbytes == 0:
                return
            tensor = wire.empty((nbytes // 4,), torch.float32)
            _recv_exact(sock, tensor.numpy().data.cast("B"))
            _check(tensor, nbytes)
            if ack:
                sock.sendall(b"\x01")


def _tcp_sender(address: str) -> Callable[[Any], None]:
    host, port = address.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    ack = bytearray(1)

    def send(tensor: Any, burst: int = 1) -> None:
        raw = tensor.numpy().data.cast("B")
        if not raw:  # the zero length that tells the receiver to finish: no acknowledgement
            sock.sendall(struct.pack("<Q", 0))
            sock.close()
            return
        for i in range(burst):   # the last one of a burst is acknowledged
            sock.sendall(struct.pack("<Q", len(raw) | (_ACK_BIT if i == burst - 1 else 0)))
            sock.sendall(raw)
        _recv_exact(sock, memoryview(ack))

    return send


# --- gloo: torch.distributed send/recv, world size 2 --------------------------------------------


def _gloo_init(address: str, rank: int) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{address}", rank=rank, world_size=2)


def _gloo_receiver(conn: Connection, site: Site, address: str) -> None:
    _arrive(site)
    import torch
    import torch.distributed as dist

    from hetpipe import wire

    _gloo_init(address, rank=1)
    conn.send(address)
    ack = torch.ones(1)
    # The receiver learns each batch's size from the parent, so no size message rides on gloo.
    while (command := conn.recv()) is not None:
        nbytes, count, burst = command
        for _ in range(count // burst):
            for _ in range(burst):
                tensor = wire.empty((nbytes // 4,), torch.float32)
                dist.recv(tensor, src=0)
                _check(tensor, nbytes)
            dist.send(ack, dst=0)   # for the burst's last
    dist.destroy_process_group()


def _gloo_sender(address: str) -> Callable[[Any], None]:
    import torch
    import torch.distributed as dist

    _gloo_init(address, rank=0)
    ack = torch.empty(1)

    def send(tensor: Any, burst: int = 1) -> None:
        for _ in range(burst):
            dist.send(tensor, dst=1)
        dist.recv(ack, src=1)

    return send


# --- process plumbing ---------------------------------------------------------------------------


def _d2d_sender(address: str) -> Callable[[Any], None]:
    """No peer: a device-to-device copy into a fresh tensor, in this process."""
    import torch

    def send(tensor: Any, burst: int = 1) -> None:
        for _ in range(burst):
            torch.empty_like(tensor).copy_(tensor)
        torch.cuda.synchronize()

    return send


def _idle_receiver(conn: Connection, site: Site, cuda: bool = False) -> None:
    conn.send("")   # d2d has no peer
    conn.recv()


def _sender_main(conn: Connection, transport: str, address: str, cuda: bool = False) -> None:
    import torch

    torch.set_num_threads(1)
    factory = {"grpc": grpc_sender, "shm": lambda address: grpc_sender(address, shared_memory=True),
               "cuda_ipc": lambda address: grpc_sender(address, shared_memory=True, cuda_ipc=True),
               "raw_tcp": _tcp_sender, "gloo": _gloo_sender, "d2d": _d2d_sender}[transport]
    send = factory(address)
    tensors: dict[int, Any] = {}
    conn.send("ready")
    while (command := conn.recv()) is not None:
        nbytes, count, burst = command
        if nbytes not in tensors:
            tensors[nbytes] = _pattern(nbytes).cuda() if cuda else _pattern(nbytes)
        tensor = tensors[nbytes]
        seconds = []
        for _ in range(count // burst):
            start = time.perf_counter()
            send(tensor, burst)  # returns once the receiver has acknowledged the (last) whole tensor
            seconds.append((time.perf_counter() - start) / burst)
        conn.send(seconds)
    if transport == "raw_tcp":
        send(torch.empty(0))
    elif transport == "gloo":
        import torch.distributed as dist

        dist.destroy_process_group()


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class Pair:
    """One transport's receiver and sender processes, driven over pipes."""

    def __init__(self, ctx: Any, transport: str, far: Site = Site(), near: Site = Site(), cuda: bool = False) -> None:
        """far: where the receiver runs; near: the sender's side (this namespace); cuda: GPU tensors."""
        self.transport = transport
        self._recv_conn, child_recv = ctx.Pipe()
        self._send_conn, child_send = ctx.Pipe()
        if transport == "gloo":
            # Rank 0 (the sender) hosts the store, so both must start before either one returns.
            address = f"{near.host}:{_free_port(near.host)}"
            receiver = ctx.Process(target=_gloo_receiver, args=(child_recv, far, address), daemon=True)
        else:
            if transport == "raw_tcp":
                receiver = ctx.Process(target=_tcp_receiver, args=(child_recv, far), daemon=True)
            else:   # ours, or d2d's stand-in: either takes GPU tensors
                target = _idle_receiver if transport == "d2d" else _grpc_receiver
                receiver = ctx.Process(target=target, args=(child_recv, far, cuda), daemon=True)
        self.procs = [receiver]
        receiver.start()
        if transport != "gloo":
            address = self._recv_conn.recv()
        sender = ctx.Process(target=_sender_main, args=(child_send, transport, address, cuda), daemon=True)
        self.procs.append(sender)
        sender.start()
        if transport == "gloo":
            self._recv_conn.recv()
        if self._send_conn.recv() != "ready":
            raise RuntimeError(f"{transport} sender did not start")

    def cpu_seconds(self) -> tuple[float, float]:
        """User + system seconds of the sender and of the receiver, every thread included."""
        receiver, sender = (psutil.Process(proc.pid).cpu_times() for proc in self.procs)
        return sender.user + sender.system, receiver.user + receiver.system

    def run(self, nbytes: int, count: int, burst: int = 1) -> tuple[list[float], tuple[float, float]]:
        """Wall seconds a send of count sends (of each burst's, over its sends), and the CPU
        seconds the batch cost each side. burst: sends back to back, the last acknowledged."""
        before = self.cpu_seconds()
        if self.transport == "gloo":
            self._recv_conn.send((nbytes, count, burst))
        self._send_conn.send((nbytes, count, burst))
        seconds: list[float] = self._send_conn.recv()
        after = self.cpu_seconds()
        return seconds, (after[0] - before[0], after[1] - before[1])

    def close(self) -> None:
        stop_children((self._send_conn, self._recv_conn), None, self.procs)


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (a few seconds per transport)")
    parser.add_argument("--sizes", type=int, nargs="+", default=list(SIZES_MIB), help="tensor sizes in MiB")
    parser.add_argument("--reps", type=_positive, metavar="N",
                        help="messages per round and size (default: about 64 MiB's worth, at least 2; "
                             "more for a sampling profiler)")
    parser.add_argument("--transports", nargs="+", choices=sorted({*TRANSPORTS, *CUDA_TRANSPORTS}),
                        help=f"default: {' '.join(TRANSPORTS)} (--netns: no shm, which needs one host); "
                             f"--cuda: {' '.join(CUDA_TRANSPORTS)}")
    parser.add_argument("--burst", type=_positive, default=1, metavar="N",
                        help="sends back to back, the last acknowledged (OSU's bandwidth test; ours through "
                             "the Link's thread, which keeps links.WINDOW on their way); default 1: each "
                             "acknowledged before the next (a ping-pong)")
    parser.add_argument("--netns", action="store_true",
                        help="receivers in another network namespace, across a veth pair (needs root and ip)")
    parser.add_argument("--cuda", action="store_true", help="GPU tensors on cuda:0 at both ends (a CUDA machine)")
    args = parser.parse_args(argv)
    if args.cuda and args.netns:
        parser.error("--cuda measures one host's paths: it does not go with --netns")
    if args.cuda:
        import torch

        if not torch.cuda.is_available():
            parser.error("--cuda needs a CUDA device")
    default = CUDA_TRANSPORTS if args.cuda else TRANSPORTS
    transports = args.transports or [t for t in default if not (args.netns and t == "shm")]
    if args.netns:
        with veth_pair() as veth:
            return _measure(args, transports, veth)
    return _measure(args, transports, None)


def _measure(args: argparse.Namespace, transports: list[str], veth: Veth | None) -> int:
    far = near = Site()
    if veth is not None:
        far = Site(veth.namespace, veth.far, veth.far_dev)
        near = Site(None, veth.near, veth.near_dev)
    # gloo otherwise resolves the hostname and may pick another interface.
    os.environ["GLOO_SOCKET_IFNAME"] = near.gloo_ifname
    rounds = 3 if args.quick else 6
    # Repetitions per round: about 64 MiB per round and size, at least 2.
    reps = {mib: args.reps or max(2, (16 if args.quick else 64) // mib) for mib in args.sizes}
    reps = {mib: -(-n // args.burst) * args.burst for mib, n in reps.items()}   # whole bursts

    ctx = mp.get_context("spawn")  # gRPC does not survive fork
    pairs: list[Pair] = []
    try:
        for transport in transports:
            pairs.append(Pair(ctx, transport, far, near, cuda=args.cuda))
        for pair in pairs:  # warm-up: connections, first-touch of the sender's tensors
            for mib in args.sizes:
                pair.run(mib * MIB, 2)
        samples: dict[tuple[str, int], list[float]] = {(p.transport, mib): [] for p in pairs for mib in args.sizes}
        cpu: dict[tuple[str, int], list[float]] = {key: [0.0, 0.0] for key in samples}
        # Interleave transports round by round, so a burst of load from elsewhere hits them alike.
        for _ in range(rounds):
            for mib in args.sizes:
                for pair in pairs:
                    seconds, (send_cpu, recv_cpu) = pair.run(mib * MIB, reps[mib], args.burst)
                    samples[(pair.transport, mib)] += seconds
                    cpu[(pair.transport, mib)][0] += send_cpu
                    cpu[(pair.transport, mib)][1] += recv_cpu
    finally:
        for pair in pairs:
            pair.close()

    gibs = {key: (key[1] / 1024) / statistics.median(secs) for key, secs in samples.items()}
    path = "loopback" if veth is None else f"across a veth pair into namespace {veth.namespace}"
    tensors = "GPU tensors on cuda:0" if args.cuda else "CPU tensors"
    how = "each acknowledged" if args.burst == 1 else f"in bursts of {args.burst}, the last acknowledged"
    print(f"one-directional throughput {path}, {tensors}, {how}, median GiB/s ({BUFFER_POLICY})")
    names = [p.transport for p in pairs]
    ratios = [(o, r) for o in OURS for r in BASELINES if o in names and r in names]
    header = f"{'size':>8}" + "".join(f"{n:>10}" for n in names) + "".join(f"{o + '/' + r:>14}" for o, r in ratios)
    print(header)
    for mib in args.sizes:
        row = f"{str(mib) + ' MiB':>8}" + "".join(f"{gibs[(n, mib)]:>10.2f}" for n in names)
        row += "".join(f"{gibs[(o, mib)] / gibs[(r, mib)]:>14.2f}" for o, r in ratios)
        print(row)
    # Wall-clock figures swing with whatever else runs on the machine; CPU time per GiB much less.
    print("CPU seconds per GiB moved, sender + receiver (every thread)")
    print(f"{'size':>8}" + "".join(f"{n:>14}" for n in names))
    for mib in args.sizes:
        cells = []
        for n in names:
            gib = len(samples[(n, mib)]) * args.burst * mib / 1024
            send_cpu, recv_cpu = cpu[(n, mib)]
            cells.append(f"{send_cpu / gib:.2f}+{recv_cpu / gib:.2f}")
        print(f"{str(mib) + ' MiB':>8}" + "".join(f"{c:>14}" for c in cells))
    counts = {mib: len(samples[(names[0], mib)]) for mib in args.sizes}
    print("samples per cell: " + ", ".join(f"{mib} MiB: {n}" for mib, n in counts.items()))
    load = os.getloadavg()
    print(f"load average while measuring: {load[0]:.1f} {load[1]:.1f} on {os.cpu_count()} CPUs")
    return 0


if __name__ == "__main__":
    sys.exit(main())

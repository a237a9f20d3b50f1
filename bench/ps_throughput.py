"""Push+pull throughput of the parameter-server shards (production codec and RPCs), in gRPC frames
and through shared memory (parallel.transport shm), against raw TCP loopback."""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Run as `python bench/ps_throughput.py`: the repository root is not on sys.path then.
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# The VW, shard and raw TCP processes; bench/ (this script's directory) is on sys.path.
from hetpipe.threads import PS_THREADS_ENV  # noqa: E402
from netns import veth_pair  # noqa: E402
from ps_processes import STEP_TIMEOUT_S, WARM_ROUNDS, Clients, Far, ShardProcs, TcpPair, cpu_seconds, expect  # noqa: E402

MIB = 1 << 20
GIB = 1 << 30
KEY_MIB = 5
VWS = (1, 2, 4)
SHARDS = (1, 2, 4)


def key_names(model_mib: int) -> list[str]:
    return [f"layer{i:02d}.weight" for i in range(model_mib // KEY_MIB)]


def placement(keys: list[str], shards: int) -> dict[str, int]:
    """Round-robin over the shards, as plan.place_keys' `default` does for one key per layer."""
    return {key: i % shards for i, key in enumerate(keys)}


# --- one configuration ------------------------------------------------------------------------------


@dataclass
class Row:
    n: int
    k: int                     # stages per VW: client processes, each with its block of the keys
    s: int
    durable: bool
    shm: bool
    moved: int                 # push + pull payload bytes in the timed rounds
    wall: float
    tcp_wall: float
    client_cpu: float
    shard_cpu: float
    tcp_cpu: float
    push_s: list[float] = field(default_factory=list)
    pull_s: list[float] = field(default_factory=list)
    first_frame_s: list[float] = field(default_factory=list)

    @property
    def label(self) -> str:
        stages = f" K={self.k}" if self.k > 1 else ""
        return f"N={self.n}{stages} S={self.s}" + (" shm" if self.shm else "") + (" durable" if self.durable else "")

    @property
    def rate(self) -> float:
        return self.moved / self.wall

    @property
    def tcp_rate(self) -> float:
        return self.moved / self.tcp_wall


def stage_keys(keys: list[str], stages: int) -> list[list[str]]:
    """Each stage's keys: a contiguous block, as a stage holds a run of layers."""
    return [keys[j * len(keys) // stages:(j + 1) * len(keys) // stages] for j in range(stages)]


def run_config(clients: Clients, tcp: TcpPair, shards: ShardProcs, n: int, s: int, durable: bool, shm: bool,
               keys: list[str], rounds: int, stages: int = 1) -> Row:
    import torch

    from hetpipe import rpc, wire
    from hetpipe.v1 import wire_pb2

    elems = KEY_MIB * MIB // 4
    place = placement(keys, s)
    addresses = shards.addresses
    # Init as JobDriver.setup does: each shard gets its keys' initial values and the VW count.
    for i, address in enumerate(addresses):
        tensors = [(key, torch.zeros(elems)) for key in keys if place[key] == i]
        with rpc.channel(address) as ch:
            rpc.Stub(ch, "ParameterServer").Init(
                wire.encode(tensors, init=wire_pb2.InitTag(virtual_workers=n)), timeout=rpc.DATA_DEADLINE_S)
    # A VW is `stages` client processes, each pushing and pulling its own keys (disjoint), as a
    # VW's stages do; client i is stage i % stages of VW i // stages.
    blocks = stage_keys(keys, stages)
    conns = clients.conns[:n * stages]
    cfg = {"addresses": addresses, "elems": elems, "rounds": rounds, "shm": shm}
    for i, conn in enumerate(conns):
        own = {key: place[key] for key in blocks[i % stages]}
        conn.send(("config", {**cfg, "vw": i // stages, "placement": own}))
    for conn in conns:
        expect(conn, "warm", STEP_TIMEOUT_S)
    moved = 2 * n * rounds * len(keys) * elems * 4
    # Raw TCP moves half the bytes just before and half just after, so that load from other
    # processes drifting during the run hits both transports alike.
    tcp_before = tcp.move(moved // 2)
    client_pids = [p.pid for p in clients.procs[:n * stages]]
    cpu_before = cpu_seconds(client_pids), cpu_seconds(shards.pids())
    start = time.perf_counter()
    for conn in conns:
        conn.send(("go", None))
    per_vw = [expect(conn, "done", STEP_TIMEOUT_S) for conn in conns]
    wall = time.perf_counter() - start
    client_cpu = cpu_seconds(client_pids) - cpu_before[0]
    shard_cpu = cpu_seconds(shards.pids()) - cpu_before[1]
    # Every push applied exactly once, every wave complete: the bytes counted really went in.
    waves = WARM_ROUNDS + rounds
    for i, address in enumerate(addresses):
        with rpc.channel(address) as ch:
            status = rpc.Stub(ch, "ParameterServer").Status(wire_pb2.Empty(), timeout=rpc.CONTROL_DEADLINE_S)
        pushers = n * sum(any(place[key] == i for key in block) for block in blocks)   # its stages' clients
        if (status.pushes_applied, status.pushes_duplicate, status.c_global) != (pushers * waves, 0, waves):
            raise RuntimeError(f"shard {address}: unexpected state after the run:\n{status}")
    tcp_after = tcp.move(moved - moved // 2)
    row = Row(n, stages, s, durable, shm, moved, wall, tcp_before[0] + tcp_after[0], client_cpu, shard_cpu,
              tcp_before[1] + tcp_after[1])
    for rounds_of_vw in per_vw:
        for push_s, pull_s, first_s in rounds_of_vw:
            row.push_s.append(push_s)
            row.pull_s.append(pull_s)
            row.first_frame_s.append(first_s)
    return row


# --- where the CPU goes: each codec / shard step alone, in this process, on one model's bytes -----


def codec_costs(keys: list[str]) -> dict[str, float]:
    """CPU seconds per GiB of each step a pushed or pulled byte goes through outside gRPC's core."""
    import torch

    from hetpipe import wire
    from hetpipe.v1 import wire_pb2
    from ps_server.shard import Shard

    torch.set_num_threads(1)  # as the shard and the stage worker run
    elems = KEY_MIB * MIB // 4
    tensors = [(key, torch.ones(elems)) for key in keys]
    nbytes = len(keys) * elems * 4
    shard = Shard()
    shard.init(1, [(key, torch.zeros(elems)) for key in keys])
    wave = 0
    state: dict[str, Any] = {}

    def encode_push() -> None:  # wire.encode writes the serialized frames (what gRPC sends)
        state["frames"] = list(wire.encode(tensors, push=wire_pb2.PushTag(vw=0, clock=wave)))

    def decode() -> None:  # data frames are copied into the tensors without a protobuf parse
        state["bundle"] = wire.decode(state["frames"])

    def add() -> None:
        nonlocal wave
        shard.push(0, wave, state["bundle"].tensors)
        wave += 1

    def clone() -> None:
        state["pulled"] = shard.pull(0, keys)

    def encode_pull() -> None:
        result = state["pulled"]
        tag = wire_pb2.PullTag(c_global=result.c_global, own_clock=result.own_clock, vw_clocks=result.vw_clocks)
        state["frames"] = list(wire.encode(result.values, pull=tag))

    dst = torch.empty(len(keys) * elems)
    src = torch.ones(len(keys) * elems)

    def memcpy() -> None:
        dst.copy_(src)

    # The order is the byte's path: client push, shard push, shard pull, client pull.
    steps = [
        ("memcpy of the same bytes (reference)", memcpy),
        ("client push: wire.encode", encode_push),
        ("shard push: wire.decode", decode),
        ("shard push: Shard.push (add_)", add),
        ("shard pull: Shard.pull (clone)", clone),
        ("shard pull: wire.encode", encode_pull),
        ("client pull: wire.decode", decode),
    ]
    best: dict[str, float] = {name: float("inf") for name, _ in steps}
    for _ in range(3):
        for name, fn in steps:
            t = time.process_time()
            fn()
            # The least disturbed of the repetitions: other processes share these 2 cores.
            best[name] = min(best[name], time.process_time() - t)
    return {name: seconds * GIB / nbytes for name, seconds in best.items()}


# --- report ------------------------------------------------------------------------------------------


def print_report(rows: list[Row], costs: dict[str, float], model_mib: int, rounds: int) -> None:
    print(f"\nPS push+pull throughput: {model_mib} MiB float32 model, {model_mib // KEY_MIB} keys of {KEY_MIB} MiB "
          f"round-robin over S shard processes; N VW processes; {rounds} timed round(s) after {WARM_ROUNDS} warm-up rounds.")
    print("A round per VW: push its wave to every shard (one thread per shard), then pull all keys with "
          "min_clock = wave+1.")
    print("moved = push + pull payload bytes of all VWs; rates in MiB/s; raw TCP = one process pair moving the "
          "same bytes, half just before and half just after.")
    head = (f"{'config':<17}{'moved':>9}{'wall s':>8}{'aggregate':>10}{'per shard':>10}{'raw TCP':>9}"
            f"{'agg/TCP':>8}{'shard/TCP':>10}{'push s':>8}{'pull s':>8}{'1st fr s':>9}"
            f"{'cli cpu/GiB':>12}{'shd cpu/GiB':>12}{'cpu x TCP':>10}{'cpu util':>9}")
    print(head)
    print("-" * len(head))
    ncpu = os.cpu_count() or 1
    for r in rows:
        gib = r.moved / GIB
        util = (r.client_cpu + r.shard_cpu) / r.wall / ncpu
        print(f"{r.label:<17}{f'{gib:.2f} GiB':>9}{r.wall:>8.2f}{r.rate / MIB:>10.0f}{r.rate / r.s / MIB:>10.0f}"
              f"{r.tcp_rate / MIB:>9.0f}{r.rate / r.tcp_rate:>8.3f}{r.rate / r.s / r.tcp_rate:>10.3f}"
              f"{statistics.median(r.push_s):>8.2f}{statistics.median(r.pull_s):>8.2f}"
              f"{statistics.median(r.first_frame_s):>9.2f}"
              f"{r.client_cpu / gib:>12.2f}{r.shard_cpu / gib:>12.2f}"
              f"{(r.client_cpu + r.shard_cpu) / r.tcp_cpu:>10.1f}{util:>9.0%}")
    tcp_cpu = statistics.median(r.tcp_cpu / (r.moved / GIB) for r in rows)
    print("push s / pull s: median per VW and round (pull includes waiting for the other VWs); 1st fr s: "
          "pull call to first frame (WSP wait + shard clone + first encode).")
    print(f"cpu/GiB: CPU seconds (user+sys, all threads) per GiB moved; cpu x TCP: client+shard CPU over the raw "
          f"TCP pair's CPU for the same bytes ({tcp_cpu:.2f} s/GiB), the ratio that load from other processes "
          f"does not skew; cpu util: client+shard CPU over wall x {ncpu} CPUs (below 100%: other processes had "
          f"the rest, or the path waited).")
    print("\nCPU seconds per GiB of each step outside gRPC's core, alone in one process (best of 3):")
    client = shard = 0.0
    for name, per_gib in costs.items():
        print(f"  {name:<46}{per_gib:>7.3f}")
        if name.startswith("client"):
            client += per_gib
        elif name.startswith("shard"):
            shard += per_gib
    # Every moved GiB is half push, half pull: a client or shard pays its push steps on half the bytes.
    print(f"  per moved GiB (half pushed, half pulled): client codec {client / 2:.2f}, shard codec+state "
          f"{shard / 2:.2f} CPU s; the rest of the measured CPU above is gRPC (core, HTTP/2, sockets, threads)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="a 40 MiB model and one timed round")
    parser.add_argument("--model-mib", type=int, help=f"model size, a multiple of {KEY_MIB} (default 100)")
    parser.add_argument("--rounds", type=int, help="timed rounds per configuration (default 2)")
    parser.add_argument("--vws", type=int, nargs="+", default=list(VWS))
    parser.add_argument("--shards", type=int, nargs="+", default=list(SHARDS))
    parser.add_argument("--stages", type=int, default=1, metavar="K",
                        help="stages per VW: K client processes per VW, each pushing and pulling its own block "
                             "of the keys at once (default 1)")
    parser.add_argument("--no-durable", action="store_true", help="skip the N=1 S=1 row with durability on")
    parser.add_argument("--repeat", type=int, default=1, metavar="R",
                        help="every configuration R times, the configurations in turn, each run with fresh "
                             "shards: each run's agg/TCP and their median (this box's load swings from one "
                             "minute to the next)")
    parser.add_argument("--transports", nargs="+", choices=["grpc", "shm"],
                        help="gRPC frames, or shared memory (the shards and VWs share this host); default both, "
                             "--netns grpc")
    parser.add_argument("--netns", action="store_true",
                        help="shards and the raw TCP receiver in another network namespace, across a veth pair")
    parser.add_argument("--shard-threads", type=int, default=1,
                        help="each shard's intra-op threads (default 1, as beside CPU stages; the launchers "
                             "give shards beside GPU stages the cores those leave: threads.thread_split)")
    args = parser.parse_args(argv)
    if args.repeat < 1:
        parser.error(f"--repeat must be 1 or more, got {args.repeat}")
    # Before the forkserver starts: its children take its environment.
    os.environ[PS_THREADS_ENV] = str(max(1, args.shard_threads))
    args.transports = args.transports or (["grpc"] if args.netns else ["grpc", "shm"])
    if args.netns and "shm" in args.transports:
        parser.error("--netns: shared memory needs one host")
    if args.netns:
        with veth_pair() as veth:
            return _measure(args, Far(veth.namespace, veth.far))
    return _measure(args, None)


def _measure(args: argparse.Namespace, far: Far | None) -> int:
    model_mib = args.model_mib or (40 if args.quick else 100)
    rounds = args.rounds or (1 if args.quick else 2)
    keys = key_names(model_mib)
    if not keys or model_mib % KEY_MIB or len(keys) < max(args.shards):
        raise SystemExit(f"--model-mib must be a multiple of {KEY_MIB} with at least one key per shard")
    if not 1 <= args.stages <= len(keys):
        raise SystemExit(f"--stages must be between 1 and the model's {len(keys)} keys")
    configs = [(n, s, False, t == "shm") for t in args.transports for s in args.shards for n in args.vws]
    if not args.no_durable:
        configs += [(1, 1, True, t == "shm") for t in args.transports]
    configs *= args.repeat

    began = time.perf_counter()
    load_start = os.getloadavg()
    workdir = Path(tempfile.mkdtemp(prefix="hetpipe-psbench-"))
    # gRPC does not survive fork, but a forkserver child is forked from a process that has only
    # imported modules (gRPC's core starts with the first channel or server): every process then
    # starts in milliseconds instead of importing torch anew, which takes seconds per process here.
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "grpc", "psutil", "hetpipe.wire", "hetpipe.rpc", "ps_server.__main__",
                                "ps_server.servicer", "stage_worker.wsp_sync"])
    rows: list[Row] = []
    shard_sets: list[ShardProcs] = []
    clients: Clients | None = None
    tcp: TcpPair | None = None
    try:
        # Each configuration needs fresh shards: Init fixes the VW count and the keys for good.
        for i, (n, s, durable, _) in enumerate(configs):
            sub = workdir / f"config{i}"
            sub.mkdir()
            shard_sets.append(ShardProcs(ctx, s, sub, durable, far))
        clients = Clients(ctx, max(n for n, _, _, _ in configs) * args.stages)
        tcp = TcpPair(ctx, len(keys) * KEY_MIB * MIB, far)
        clients.wait_started()
        for shards in shard_sets:
            shards.wait_started()
        started = time.perf_counter() - began
        print(f"started {sum(len(p.procs) for p in shard_sets)} shard, {len(clients.procs)} VW and 2 TCP "
              f"processes in {started:.1f}s ({os.environ[PS_THREADS_ENV]} intra-op threads a shard); "
              f"load average {load_start[0]:.1f} on {os.cpu_count()} CPUs",
              flush=True)
        for (n, s, durable, shm), shards in zip(configs, shard_sets):
            row = run_config(clients, tcp, shards, n, s, durable, shm, keys, rounds, args.stages)
            shards.close()  # frees its memory before the next configuration
            rows.append(row)
            print(f"  {row.label}: {row.rate / MIB:.0f} MiB/s aggregate, raw TCP {row.tcp_rate / MIB:.0f} MiB/s",
                  flush=True)
        costs = codec_costs(keys)
    finally:
        if clients is not None:
            clients.close()
        if tcp is not None:
            tcp.close()
        for shards in shard_sets:
            shards.close()
        shutil.rmtree(workdir, ignore_errors=True)
    print_report(rows, costs, model_mib, rounds)
    if args.repeat > 1:
        print(f"\nagg/TCP of each configuration's {args.repeat} runs, and their median:")
        for label in dict.fromkeys(r.label for r in rows):
            ratios = [r.rate / r.tcp_rate for r in rows if r.label == label]
            print(f"  {label:<20} median {statistics.median(ratios):.3f}: " + " ".join(f"{x:.3f}" for x in ratios))
    load = os.getloadavg()
    print(f"\nload average at start {load_start[0]:.1f}, at end {load[0]:.1f} {load[1]:.1f} {load[2]:.1f} on "
          f"{os.cpu_count()} CPUs; total {time.perf_counter() - began:.0f}s (of which process start {started:.0f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

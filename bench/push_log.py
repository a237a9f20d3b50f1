"""What a shard's push log costs per push: the production log (ps_server/durability.py: entries
written over the files a checkpoint freed) against the same log making a new file for every entry
and deleting the files a checkpoint frees (as it did before), in one run, on the disk of the folder
given. Each push goes the servicer's WSP way: logged, applied, fsynced, and a checkpoint every
--every pushes. Wall and CPU (this process, the fsync's writeback included) per push.

    python bench/push_log.py [--mib 12.3] [--entries 100] [--every 10] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

# Run as `python bench/push_log.py`: the repository root is not on sys.path then.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hetpipe import wire  # noqa: E402
from hetpipe.v1 import wire_pb2  # noqa: E402
from ps_server.durability import Durability  # noqa: E402
from ps_server.shard import Shard  # noqa: E402


def _deltas(mib: float) -> list[tuple[str, torch.Tensor]]:
    """An MLP's layers, the last one sized to make the total: a push of a stage's keys."""
    rows = max(1, int(mib * (1 << 20) / 4 / 1024) // 4)
    return [(f"{i}.weight", torch.randn(rows, 1024)) for i in range(4)] + [(f"{i}.bias", torch.randn(1024))
                                                                             for i in range(4)]


class NewFiles(Durability):
    """The baseline: the same log, but a file a checkpoint frees is deleted, so every entry is a
    new file (as before the log kept spares)."""

    def _spare(self, path: Path) -> None:
        path.unlink()


def log(kind: type[Durability], folder: Path, deltas: list[tuple[str, torch.Tensor]],
        every: int) -> Callable[[int], None]:
    """One push per call through the servicer's WSP path: logged from its frames, placed, applied
    from its entry, settled, synced, and checkpointed when due."""
    shard = Shard()
    shard.init(1, [(k, torch.zeros_like(t)) for k, t in deltas])
    durability = kind(str(folder), every_clocks=every)
    durability.checkpoint(shard)
    # The push as the shard receives it, encoded once: the entry's clock comes from log_stream's
    # arguments, not from the frames' tag, and the sender's encoding is not the log's cost.
    frames = list(wire.encode(deltas, push=wire_pb2.PushTag(vw=0, clock=0)))

    def entry(i: int) -> None:
        seq, logged = durability.log_stream(0, i, wire.read(frames))
        durability.place(seq)
        shard.push(0, i, logged)
        durability.settle(seq, applied=True)
        durability.sync(seq)
        if (snapshot := durability.maybe_capture(shard)) is not None:
            durability.write(snapshot)

    return entry


def measure(kind: type[Durability], base: Path, deltas: list[tuple[str, torch.Tensor]],
            n: int, every: int) -> tuple[float, float]:
    """Median wall ms and mean CPU ms per entry, after one checkpoint interval of warm-up."""
    folder = Path(tempfile.mkdtemp(prefix="push-log-", dir=base))
    entry = log(kind, folder, deltas, every)
    for i in range(every):
        entry(i)
    walls = []
    cpu = time.process_time()
    for i in range(every, every + n):
        start = time.perf_counter()
        entry(i)
        walls.append(time.perf_counter() - start)
    cpu = time.process_time() - cpu
    for path in sorted(folder.rglob("*"), reverse=True):
        path.rmdir() if path.is_dir() else path.unlink()
    folder.rmdir()
    return statistics.median(walls) * 1e3, cpu / n * 1e3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=float, default=12.3, help="MiB per entry (default: peers' MLP, 12.3)")
    parser.add_argument("--entries", type=int, default=100)
    parser.add_argument("--every", type=int, default=10, help="entries between checkpoints (a shard's default)")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds of both")
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()), help="a folder on the disk to test")
    parser.add_argument("--quick", action="store_true", help="30 entries, 2 rounds")
    args = parser.parse_args(argv)
    if args.quick:
        args.entries, args.rounds = 30, 2
    torch.set_num_threads(1)
    deltas = _deltas(args.mib)
    mib = sum(t.numel() * 4 for _, t in deltas) / (1 << 20)
    print(f"push log: {args.entries} entries of {mib:.1f} MiB, each fsynced, a checkpoint every {args.every}, "
          f"in {args.dir}")
    print(f"{'round':>5} {'written over ms':>16} {'cpu':>6} {'new files ms':>13} {'cpu':>6} {'wall x':>7} {'cpu x':>6}")
    for r in range(args.rounds):
        ours = measure(Durability, args.dir, deltas, args.entries, args.every)
        base = measure(NewFiles, args.dir, deltas, args.entries, args.every)
        print(f"{r + 1:>5} {ours[0]:>16.2f} {ours[1]:>6.2f} {base[0]:>13.2f} {base[1]:>6.2f} "
              f"{ours[0] / base[0]:>7.2f} {ours[1] / base[1]:>6.2f}")
    print("ms: median wall per entry; cpu: this process's CPU ms per entry; x: written over / new files")
    return 0


if __name__ == "__main__":
    sys.exit(main())

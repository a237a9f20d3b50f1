"""Where the processes of a sampling profile spent their time: `py-spy record --subprocesses
--idle --threads -f raw` of a run (plain or gzipped), summed per kind of process (ps shard, stage
worker, launcher), per thread, and within each thread per line of this project's code where the
samples end (with --idle a wait is a sample too: a lock's wait shows as long as the work behind it).

    .venv/bin/python bench/spy_summary.py PROFILE [--top N]

A line of a raw profile is one stack and its sample count: the processes from the root down, the
thread, then the frames from the outermost, `function (file:line)`, separated by ';'. A sample is
charged to the deepest frame in this project's code, shown with the frame it was in at the end
(a wait, a copy in torch): that is what to change, and what it was doing."""

from __future__ import annotations

import argparse
import gzip
import re
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

OURS = ("hetpipe/", "ps_server/", "stage_worker/", "coordinator/", "launch/", "baselines/", "bench/")
KINDS = (("-m ps_server", "ps shard"), ("-m stage_worker", "stage worker"), ("launch.cli", "launcher"),
         ("-m coordinator", "coordinator"), ("forkserver", "fork server"))
# py-spy reads a child's command line once, when it finds it: one forked from the fork server may
# still show the fork server's then (its setproctitle comes after the fork). Its frames tell.
SHOWN = (("stage_worker/", "stage worker"), ("ps_server/", "ps shard"), ("coordinator/", "coordinator"))
_FRAME = re.compile(r"^(?P<function>.*) \((?P<file>[^()]*?):(?P<line>\d+)\)$")


@dataclass
class Kind:
    samples: int = 0
    processes: set[str] = field(default_factory=set)
    threads: Counter[str] = field(default_factory=Counter)
    lines: dict[str, Counter[str]] = field(default_factory=lambda: defaultdict(Counter))   # per thread


def lines_of(path: Path) -> Iterator[str]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8", errors="replace") as f:
        yield from f


def kind_of(process: str) -> str:
    return next((name for marker, name in KINDS if marker in process), "other")


def thread_name(frame: str) -> str:
    """`thread (1234): compute` -> compute; numbered threads as one (ThreadPoolExecutor-0_3 ->
    ThreadPoolExecutor, Thread-4 (_run) -> Thread (_run))."""
    name = frame.split(": ", 1)[1] if ": " in frame else "(unnamed)"
    return re.sub(r"[-_]?\d+(_\d+)?$", "", re.sub(r"^Thread-\d+", "Thread", name)) or name


def where(frames: list[str]) -> str:
    """The deepest frame in this project's code, and the frame the sample ended in."""
    ours = next((f for f in reversed(frames) if any(p in f for p in OURS)), None)
    leaf = frames[-1] if frames else "(no frame)"
    if ours is None:
        return f"(outside the project) {short(leaf)}"
    return short(ours) if ours == leaf else f"{short(ours)} -> {short(leaf)}"


def short(frame: str) -> str:
    m = _FRAME.match(frame)
    if m is None:
        return frame
    file = m["file"]
    for package in OURS:
        if package in file:
            file = package + file.split(package, 1)[1]
            break
    else:
        file = Path(file).name
    return f"{m['function']} ({file}:{m['line']})"


def summarize(raw: Iterable[str]) -> dict[str, Kind]:
    rows: list[tuple[str, str, str, int]] = []   # process, thread, where, samples
    shown: dict[str, str] = {}                   # a process titled as the fork server: what its frames show
    for line in raw:
        stack, _, count = line.rstrip("\n").rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        processes = [f for f in frames if f.startswith("process ")]
        threads = [i for i, f in enumerate(frames) if f.startswith("thread (")]
        if not processes or not threads:
            continue
        process, body = processes[-1], frames[threads[-1] + 1:]
        rows.append((process, thread_name(frames[threads[-1]]), where(body), int(count)))
        if process not in shown and kind_of(process) == "fork server":
            shown.update((process, name) for marker, name in SHOWN if any(marker in f for f in body))
    kinds: dict[str, Kind] = defaultdict(Kind)
    for process, thread, at, n in rows:
        k = kinds[shown.get(process) or kind_of(process)]
        k.samples += n
        k.processes.add(process.split(":", 1)[0])
        k.threads[thread] += n
        k.lines[thread][at] += n
    return dict(kinds)


def report(kinds: dict[str, Kind], top: int) -> str:
    """Per kind, its threads by samples (those with 1% of them at least), each with its lines (at
    most top, each at least 1% of the thread's)."""
    out = []
    for name, k in sorted(kinds.items(), key=lambda item: -item[1].samples):
        out.append(f"== {name}: {k.samples} samples in {len(k.processes)} process(es)")
        for thread, total in k.threads.most_common():
            if total < 0.01 * k.samples:
                break
            out.append(f"  {thread}: {total} samples ({total / k.samples:.0%})")
            for line, n in k.lines[thread].most_common(top):
                if n >= 0.01 * total:
                    out.append(f"    {n:>7} {n / total:>5.1%}  {line}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("profile", type=Path, help="py-spy's raw output (-f raw), or it gzipped (.gz)")
    ap.add_argument("--top", type=int, default=8, help="lines shown per thread")
    args = ap.parse_args(argv)
    kinds = summarize(lines_of(args.profile))
    if not kinds:
        print(f"{args.profile}: no samples of processes and threads (record with --subprocesses --threads -f raw)")
        return 1
    print(report(kinds, args.top))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

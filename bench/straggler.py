"""Two virtual workers, one emulated 2x slower: throughput, WSP pull wait and idle-in-wait for D = 0, 1, 4, 32."""

from __future__ import annotations

import argparse
import tempfile
from dataclasses import dataclass
from pathlib import Path

from emulated import Run, covered, faults, job_dict, load_average, run_job, stage_tasks

K = 2
SLOW_VW, SLOW_FACTOR = 1, 2.0
PAPER_IDLE_OF_WAIT = 0.18      # hetpipe.txt §8.4: "the actual idle time is only 18% of the waiting time"
PAPER_WAIT_D4_OF_D0 = 0.62     # "the average waiting time with D=4 is found to be 62% of that with D=0"
# A task this far past its emulated time was starved of CPU by other processes: a sign of noise.
LATE_S = 0.005


def required_min_clock(p: int, nm: int, D: int) -> int:
    """G2 (DESIGN §3), restated here so the trace check does not lean on the code it checks."""
    return max(0, p // nm - 1 - D)


@dataclass(frozen=True, slots=True)
class Result:
    D: int
    samples_per_second: float
    wall: float
    wait: float            # summary: pull wait summed over every stage
    wait_idle: float       # summary: the part of it with no other runnable task
    trace_wait: list[float]       # per VW, reconstructed from the trace (see gated_waits)
    trace_idle: list[float]
    vw_seconds: list[float]       # per VW: first forward -> last backward at stage 0
    max_clock_distance: int
    late: float                   # fraction of tasks > LATE_S past their emulated time (CPU starvation)


def gated_waits(run: Run, vw: int, stage: int, nm: int, D: int, steps: int) -> tuple[float, float]:
    """(wait, idle) of one stage, rebuilt from the trace, independently of the runtime's counters.

    A forward p is gated when G2 asks for more than the stage held after its previous forward
    (min_clock in the trace is the c_global the weights included). The wait runs from the moment
    p could otherwise start (its input there and forward p-1 done) to its fwd_start; the idle part
    is what of that interval no other task of the stage covered. For stages after the first the
    input's arrival is taken as the sender's fwd_end, so each gated wait includes one hop (a few ms).
    A task that started during the wait and outlasted the pull is in the wait too (not in the idle).
    """
    rows = run.rows
    last = stage == K - 1
    tasks = stage_tasks(rows, vw, stage, last)
    first_start = min(t.start for t in tasks)
    wait = idle = 0.0
    have = 0
    for p in range(1, steps + 1):
        row = rows[(vw, stage, p)]
        if required_min_clock(p, nm, D) > have:
            prev_done = (rows[(vw, stage, p - 1)]["bwd_end" if last else "fwd_end"] if p > 1 else first_start)
            if stage == 0:
                arrived = rows[(vw, 0, p - nm)]["bwd_end"] if p > nm else first_start
            else:
                arrived = rows[(vw, stage - 1, p)]["fwd_end"]
            ready = max(prev_done, arrived)
            start = row["fwd_start"]
            if start > ready:
                wait += start - ready
                idle += (start - ready) - covered(tasks, ready, start)
        have = max(have, row["min_clock"])
    return wait, idle


def analyse(run: Run, D: int, nm: int, steps: int, f: float, b: float) -> Result:
    s = run.summary
    trace_wait, trace_idle, spans = [], [], []
    late = total = 0
    for vw in range(2):
        slow = SLOW_FACTOR if vw == SLOW_VW else 1.0
        target = {"F": f * slow, "B": b * slow, "FB": (f + b) * slow}
        for q in range(K):
            tasks = stage_tasks(run.rows, vw, q, q == K - 1)
            late += sum(t.end - t.start > target[t.kind] + LATE_S for t in tasks)
            total += len(tasks)
        waits = [gated_waits(run, vw, q, nm, D, steps) for q in range(K)]
        trace_wait.append(sum(w for w, _ in waits))
        trace_idle.append(sum(i for _, i in waits))
        spans.append(run.rows[(vw, 0, steps)]["bwd_end"] - run.rows[(vw, 0, 1)]["fwd_start"])
    return Result(
        D=D, samples_per_second=s["samples_per_second"], wall=s["wall_seconds"], wait=s["wait_seconds"],
        wait_idle=s["wait_idle_seconds"], trace_wait=trace_wait, trace_idle=trace_idle, vw_seconds=spans,
        max_clock_distance=int(s.get("max_clock_distance", -1)), late=late / total,
    )


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else float("nan")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="D = 0 and 4 only, fewer steps")
    parser.add_argument("--forward-ms", type=float, default=10.0, help="emulated forward time per stage (fast VW)")
    parser.add_argument("--backward-ms", type=float, default=20.0, help="emulated backward time per stage (fast VW)")
    parser.add_argument("--nm", type=int, default=4)
    parser.add_argument("--steps", type=int, default=None, help="minibatches per VW (default 96, quick 48)")
    parser.add_argument("--D", type=int, nargs="+", default=None, help="clock bounds (default 0 1 4 32)")
    parser.add_argument("--out", type=Path, default=None, help="keep run outputs here (default: a temp dir)")
    args = parser.parse_args(argv)
    ds = args.D or ([0, 4] if args.quick else [0, 1, 4, 32])
    steps = args.steps or (48 if args.quick else 96)
    f, b = args.forward_ms / 1e3, args.backward_ms / 1e3
    waves = -(-steps // args.nm)

    print(f"straggler: 2 VWs x k={K} stages, Nm={args.nm}, VW {SLOW_VW} {SLOW_FACTOR:g}x slower, emulated "
          f"F={args.forward_ms:g} ms B={args.backward_ms:g} ms, {steps} minibatches ({waves} waves) per VW, 1 shard")
    print(f"start: {load_average()}")
    results: list[Result] = []
    with tempfile.TemporaryDirectory(prefix="hetpipe-bench-straggler-") as tmp:
        root = args.out or Path(tmp)
        for D in ds:
            raw = job_dict(out_dir=root / f"D{D}", forward_s=f, backward_s=b, steps=steps, nm=args.nm,
                           virtual_workers=2, stages=K, D=D)
            straggler = faults.Faults(slow_vw=SLOW_VW, slow_factor=SLOW_FACTOR)
            results.append(analyse(run_job(raw, straggler), D, args.nm, steps, f, b))
            r = results[-1]
            print(f"  D={D}: wait {r.wait:.2f} s, idle {r.wait_idle:.2f} s ({load_average()})", flush=True)
    print(f"end: {load_average()}")

    base = next((r for r in results if r.D == 0), None)
    print()
    print("wait, idle: the summary's counters summed over all 4 stages (WspSync.wait_seconds, "
          "StageRuntime.wait_idle_seconds)")
    print("trace: rebuilt from the trace per VW (fast, slow); idle = no other task of the stage running")
    print(f"{'D':>3} {'samples/s':>10} {'wall s':>7} {'wait s':>7} {'idle s':>7} {'idle/wait':>10} {'wait/wait0':>11} "
          f"{'trace wait':>12} {'trace idle':>12} {'idle/wait':>10} {'VW seconds':>12} {'dist':>5} {'late':>5}")
    for r in results:
        tw, ti = sum(r.trace_wait), sum(r.trace_idle)
        w0 = _ratio(r.wait, base.wait) if base else float("nan")
        print(f"{r.D:>3} {r.samples_per_second:>10.1f} {r.wall:>7.2f} {r.wait:>7.2f} {r.wait_idle:>7.2f} "
              f"{_ratio(r.wait_idle, r.wait):>10.2f} {w0:>11.2f} "
              f"{r.trace_wait[0]:>6.2f},{r.trace_wait[1]:<5.2f} {r.trace_idle[0]:>6.2f},{r.trace_idle[1]:<5.2f} "
              f"{_ratio(ti, tw):>10.2f} {r.vw_seconds[0]:>6.2f},{r.vw_seconds[1]:<5.2f} "
              f"{r.max_clock_distance:>5} {r.late:>5.0%}")
    print(f"VW seconds: first forward to last backward at stage 0 (slow VW alone: {steps * (f + b) * SLOW_FACTOR:.2f} "
          f"s of tasks); dist: the shards' max clock distance (<= D+1); late: tasks > {LATE_S * 1e3:g} ms past their "
          "emulated time (CPU starvation by other processes: rows with many are noise)")
    print(f"paper (VGG-19, 4 VWs, ED-local, no injected straggler): idle/wait = {PAPER_IDLE_OF_WAIT:.2f}, "
          f"wait(D=4)/wait(D=0) = {PAPER_WAIT_D4_OF_D0:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

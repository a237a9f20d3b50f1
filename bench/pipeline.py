"""One virtual worker, k=4 equal emulated stages: steady-state throughput / ideal for Nm = 1..6 (Figure 3's shape)."""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from emulated import Run, covered, job_dict, load_average, median_ms, run_job, stage_tasks
from hetpipe.config import with_setting

K = 4
TARGET_NM, TARGET_RATIO = 4, 0.95  # issue 12 (0.9 before)
# A task this far past its emulated time was starved of CPU by other processes: a sign of noise.
LATE_S = 0.005


@dataclass(frozen=True, slots=True)
class Result:
    nm: int
    window: int            # minibatches in the steady-state window
    rate: float            # minibatches/s completed at stage 0 in steady state
    ratio: float           # rate / ideal
    cycle_ms: float        # median fwd_start(0, p) -> fwd_start(0, p+Nm): one slot's round trip
    path_compute_ms: float  # median task time along that round trip (ideal: k*(F+B))
    hop_gap_ms: float      # median of all 2(k-1) hop gaps (sender end -> receiver start), queueing included
    idle_hop_ms: float     # the same, only where the receiver was idle: transport + wake-up alone
    inject_gap_ms: float   # stage 0: bwd_end(p) -> fwd_start(p+Nm), the L1 re-injection
    busy: list[float]      # per-stage busy fraction in the window
    late: float            # fraction of the window's tasks that ran > LATE_S past their emulated time
    summary_rate: float    # the summary's samples/s / batch: whole run incl. fill and drain


def perfect_ratio(nm: int, k: int) -> float:
    """A runtime with zero communication and zero overhead reaches min(Nm/k, 1) of 1/(F+B).

    Derivation: one minibatch's round trip through k stages is (k-1)F + (F+B) + (k-1)B = k(F+B)
    with no queueing, so Nm slots complete Nm minibatches per k(F+B) (Little's law), capped by the
    stage bound 1/(F+B). At Nm >= k the cap is reached: each stage q's forwards fill the phase
    [qF, (q+1)F) and its backwards [(q+1)F, qF + F+B) mod (F+B), which tile the period exactly.
    """
    return min(nm / k, 1.0)


def hop_model_ratio(nm: int, k: int, period: float, hop: float) -> float:
    """The same with a fixed latency `hop` on each of the 2(k-1) sends of a round trip."""
    return min(nm * period / (k * period + 2 * (k - 1) * hop), 1.0)


def probe_latency(nbytes: int, count: int) -> dict[str, float]:
    """Median send+acknowledge round trip of one small tensor, production gRPC Link vs raw TCP, now.

    The pipeline's hop adds to this one-way half two thread hand-offs (the sender's Link queue,
    the receiver's compute-thread wake-up), which the probe's synchronous sender does not have.
    """
    from transport import Pair  # bench/transport.py: the production Link and Stage servicer

    ctx = mp.get_context("spawn")  # gRPC does not survive fork
    out: dict[str, float] = {}
    for transport in ("grpc", "raw_tcp"):
        pair = Pair(ctx, transport)
        try:
            pair.run(nbytes, 20)  # connection set-up and first-call costs stay out of the median
            seconds, _ = pair.run(nbytes, count)
        finally:
            pair.close()
        out[transport] = statistics.median(seconds)
    return out


def analyse(run: Run, nm: int, steps: int, f: float, b: float) -> Result:
    period = f + b
    rows = run.rows
    n = steps
    fs = {(q, p): rows[(0, q, p)]["fwd_start"] for q in range(K) for p in range(1, n + 1)}
    fe = {(q, p): rows[(0, q, p)]["fwd_end"] for q in range(K) for p in range(1, n + 1)}
    bs = {(q, p): rows[(0, q, p)]["bwd_start"] for q in range(K) for p in range(1, n + 1)}
    be = {(q, p): rows[(0, q, p)]["bwd_end"] for q in range(K) for p in range(1, n + 1)}
    # Warm-up: the first Nm minibatches enter at once and stagger; two rounds plus the pipeline
    # depth is past any fill transient. Start-up of the processes is not in the trace at all.
    warm = 2 * nm + K
    # ...and the drain: once stage 0 has injected minibatch n it runs backwards only, so the last
    # nm completions come faster than a steady stage can (above 1/(F+B) at Nm > k).
    last = n - nm
    lo, hi = be[(0, warm)], be[(0, last)]
    rate = (last - warm) / (hi - lo)
    steady = range(warm + 1, last + 1)

    def path_compute(p: int) -> float:
        f = sum(fe[(q, p)] - fs[(q, p)] for q in range(K - 1))
        b = sum(be[(q, p)] - bs[(q, p)] for q in range(K - 1))
        return f + b + (be[(K - 1, p)] - fs[(K - 1, p)])

    def out_end(q: int, p: int) -> float:
        return be[(q, p)] if q == K - 1 else fe[(q, p)]

    tasks = [stage_tasks(rows, 0, q, q == K - 1) for q in range(K)]

    def receiver_idle(q: int, sent: float, started: float) -> bool:
        # The receiver ran nothing from the send until the task the message started: no queueing.
        return all(t.end <= sent or t.start >= started for t in tasks[q])

    gaps: list[float] = []
    idle_gaps: list[float] = []
    for p in steady:
        for q in range(K - 1):
            fwd = (fe[(q, p)], fs[(q + 1, p)], q + 1)           # activation q -> q+1
            bwd = (out_end(q + 1, p), bs[(q, p)], q)            # gradient q+1 -> q
            for sent, started, receiver in (fwd, bwd):
                gaps.append(started - sent)
                if receiver_idle(receiver, sent, started):
                    idle_gaps.append(started - sent)
    cycles = [fs[(0, p + nm)] - fs[(0, p)] for p in steady if p + nm <= n]
    inject = [fs[(0, p + nm)] - be[(0, p)] for p in steady if p + nm <= n]
    busy = [covered(tasks[q], lo, hi) / (hi - lo) for q in range(K)]
    target = {"F": f, "B": b, "FB": f + b}
    window = [t for ts in tasks for t in ts if lo <= t.start <= hi]
    late = sum(t.end - t.start > target[t.kind] + LATE_S for t in window) / len(window)
    samples = run.summary["steps"] * run.summary["virtual_workers"]
    return Result(
        nm=nm, window=last - warm, rate=rate, ratio=rate * period,
        cycle_ms=median_ms(cycles), path_compute_ms=median_ms([path_compute(p) for p in steady]),
        hop_gap_ms=median_ms(gaps), idle_hop_ms=median_ms(idle_gaps), inject_gap_ms=median_ms(inject),
        busy=busy, late=late, summary_rate=samples / run.summary["wall_seconds"],
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="Nm = 1 and 4 only, fewer steps, no latency probe")
    parser.add_argument("--forward-ms", type=float, default=20.0, help="emulated forward time per stage")
    parser.add_argument("--backward-ms", type=float, default=40.0, help="emulated backward time per stage")
    parser.add_argument("--steps", type=int, default=None, help="minibatches per run (default 40, quick 28)")
    parser.add_argument("--nm", type=int, nargs="+", default=None, help="Nm values (default 1..6)")
    parser.add_argument("--probe", action=argparse.BooleanOptionalAction, default=None,
                        help="also time a 2 KiB send over gRPC and raw TCP (default: on unless --quick)")
    parser.add_argument("--out", type=Path, default=None, help="keep run outputs here (default: a temp dir)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="change one setting of the job, as `hetpipe run --set` (e.g. train.max_grad_norm=1.0)")
    args = parser.parse_args(argv)
    nms = args.nm or ([1, TARGET_NM] if args.quick else list(range(1, 7)))
    steps = args.steps or (28 if args.quick else 40)
    probe = (not args.quick) if args.probe is None else args.probe
    if steps < 3 * max(nms) + K + 8:
        parser.error(f"--steps {steps} leaves too short a steady window for Nm={max(nms)}")
    f, b = args.forward_ms / 1e3, args.backward_ms / 1e3
    period = f + b  # every stage does F+B per minibatch (the last as one task): the slowest stage's time

    print(f"pipeline: 1 VW, k={K} stages, emulated F={args.forward_ms:g} ms B={args.backward_ms:g} ms per stage, "
          f"{steps} minibatches per run; ideal = 1/(F+B) = {1 / period:.2f} minibatches/s"
          + "".join(f"; --set {s}" for s in args.set))
    print(f"start: {load_average()}")
    results: list[Result] = []
    with tempfile.TemporaryDirectory(prefix="hetpipe-bench-pipeline-") as tmp:
        root = args.out or Path(tmp)
        for nm in nms:
            raw = job_dict(out_dir=root / f"nm{nm}", forward_s=f, backward_s=b, steps=steps, nm=nm, stages=K)
            for setting in args.set:
                raw = with_setting(raw, setting)
            began = time.monotonic()
            run = run_job(raw)
            results.append(analyse(run, nm, steps, f, b))
            r = results[-1]
            print(f"  Nm={nm}: {r.ratio:.3f} of ideal over {r.window} steady minibatches; run took "
                  f"{time.monotonic() - began:.0f} s, {run.summary['wall_seconds']:.1f} s of it training "
                  f"({load_average()})", flush=True)
    latency = probe_latency(16 * 32 * 4, 200) if probe else {}  # one activation of this job: 16 x 32 float32
    print(f"end: {load_average()}")

    print()
    print("measured = steady-state minibatches/s completed at stage 0 (from the trace) / ideal 1/(F+B)")
    print("by cycle = Nm(F+B) / median cycle: the same, robust to bursts of load from other processes")
    print("perfect  = min(Nm/k, 1), a zero-latency runtime; +hops = the same with the idle-receiver hop latency")
    print("x Nm=1   = mb/s / mb/s at Nm=1, Figure 3's axis (perfect: min(Nm, k))")
    one = next((r.rate for r in results if r.nm == 1), float("nan"))
    print(f"{'Nm':>3} {'measured':>9} {'by cycle':>9} {'perfect':>8} {'+hops':>6} {'x Nm=1':>7} {'mb/s':>7} {'run mb/s':>9} "
          f"{'cycle ms':>9} {'path ms':>8} {'hop ms':>7} {'idle hop':>9} {'inject':>7} {'late':>5}  busy per stage")
    for r in results:
        busy = " ".join(f"{x:4.0%}" for x in r.busy)
        print(f"{r.nm:>3} {r.ratio:>9.3f} {r.nm * period * 1e3 / r.cycle_ms:>9.3f} {perfect_ratio(r.nm, K):>8.3f} "
              f"{hop_model_ratio(r.nm, K, period, r.idle_hop_ms / 1e3):>6.3f} {r.rate / one:>7.2f} {r.rate:>7.2f} "
              f"{r.summary_rate:>9.2f} {r.cycle_ms:>9.1f} {r.path_compute_ms:>8.1f} {r.hop_gap_ms:>7.2f} "
              f"{r.idle_hop_ms:>9.2f} {r.inject_gap_ms:>7.2f} {r.late:>5.0%}  {busy}")
    print(f"cycle: fwd_start(0,p) -> fwd_start(0,p+Nm), ideal max(k, Nm)(F+B); path: task time along one "
          f"round trip, ideal k(F+B) = {K * period * 1e3:.0f} ms;")
    print("hop: sender's task end -> receiver's task start, median over the 2(k-1) hops; idle hop: only where the "
          "receiver had nothing running; inject: stage 0 bwd_end(p) -> fwd_start(p+Nm); run mb/s: the summary's "
          f"(fill and drain included); late: tasks > {LATE_S * 1e3:g} ms past their emulated time (CPU starvation: "
          "rows with many are noise)")
    if latency:
        print(f"2 KiB send+ack round trip now: gRPC Link {latency['grpc'] * 1e3:.2f} ms, "
              f"raw TCP {latency['raw_tcp'] * 1e3:.2f} ms (median of 200)")

    at = next((r for r in results if r.nm == TARGET_NM), None)
    if at is not None:
        lost_ms = at.cycle_ms - K * period * 1e3
        print()
        print(f"target >= {TARGET_RATIO} at Nm={TARGET_NM}: {'MET' if at.ratio >= TARGET_RATIO else 'MISSED'} "
              f"(measured {at.ratio:.3f}, by cycle {TARGET_NM * period * 1e3 / at.cycle_ms:.3f})")
        # At Nm = k there is no slack: every millisecond the round trip adds beyond k(F+B) is lost.
        print(f"  the median cycle exceeds k(F+B) by {lost_ms:.1f} ms: {at.path_compute_ms - K * period * 1e3:.1f} ms "
              f"of task overrun, {2 * (K - 1)} hops x {at.hop_gap_ms:.2f} ms, "
              f"{at.inject_gap_ms:.2f} ms stage-0 re-injection")
        need = (TARGET_NM * period / TARGET_RATIO - K * period) / (2 * (K - 1))
        print(f"  the target allows at most {need * 1e3:.1f} ms per hop at F+B = {period * 1e3:g} ms "
              f"(Nm(F+B) / (k(F+B) + 2(k-1) hop) >= {TARGET_RATIO})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The paper's Table 4 on its emulated cluster: Horovod-style allreduce vs HetPipe ED-local with
4, 8, 12 and 16 GPUs (V, VR, VRQ, VRQG), VGG-19 and ResNet-152 at batch 32.

Everything runs for real on this machine: one process per GPU (and per parameter-server shard),
gRPC between them, gloo allreduce for the baseline. What is emulated (DESIGN §5):
- the GPUs: each task is padded to the Table 1 type's time for the full-size layer
  (224x224 images, full width), times --time-scale;
- the network: PCIe inside a node, 56 Gb/s InfiniBand between nodes, with the full-size
  model's activations, parameters and gradients (`cluster.emulate.network`);
- memory: the full-size model's, by accounting (so ResNet-152 does not fit an RTX 2060).
What really computes is a stand-in with the same layers at 1/16 of the channels and 32x32
images (`cluster.emulate.model_args` carries the full-size args), so that 16 stages fit on
2 CPU cores. The comparison is the ratios, not the absolute images/s.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from launch.local import run_local  # noqa: E402
from coordinator.planner import make_plan  # noqa: E402
from hetpipe.config import parse_job  # noqa: E402
from hetpipe.network import Network  # noqa: E402
from emulated import load_average  # noqa: E402

NODES = {"V": "titan-v", "R": "titan-rtx", "Q": "quadro-p4000", "G": "rtx-2060"}
COLUMNS = ["V", "VR", "VRQ", "VRQG"]
FULL = {"in_shape": [3, 224, 224], "width": 1.0, "num_classes": 1000}
STAND_IN = {"in_shape": [3, 32, 32], "width": 0.0625, "num_classes": 1000}
# hetpipe.txt Table 4: images/s, and HetPipe's total concurrent minibatches (4 VWs x Nm; 1 VW on V).
PAPER = {
    "vgg19": {"horovod": [164, 205, 265, 339], "hetpipe": [300, 530, 572, 606], "in_flight": [5, 16, 20, 20]},
    "resnet152": {"horovod": [233, 353, 415, None], "hetpipe": [256, 516, 538, 580], "in_flight": [5, 20, 24, 28]},
}


def job(model: str, column: str, mode: str, *, nm: int | str, steps: int, time_scale: float,
        out: Path) -> dict[str, Any]:
    gpus = len(column) * 4
    vws = 1 if column == "V" else 4
    return {
        "cluster": {
            "nodes": [{"name": f"n{i}", "gpus": [{"type": NODES[c], "count": 4}]} for i, c in enumerate(column)],
            "emulate": {"time_scale": time_scale, "network": {}, "model_args": FULL},
        },
        "model": {"name": model, "args": STAND_IN},
        "data": {"name": "synthetic", "batch_size": 32, "args": {"rows": 256}},
        "train": {"steps": steps, "optimizer": {"name": "sgd", "lr": 0.001}},
        "parallel": {"mode": mode, "virtual_workers": vws, "stages_per_vw": gpus // vws, "policy": "ED",
                     "placement": "local", "nm": nm, "D": 0, "ps_shards": len(column)},
        "output": {"dir": str(out), "trace": False},
    }


def fmt(x: float | None, width: int = 7) -> str:
    return f"{x:>{width}.0f}" if x is not None else f"{'X':>{width}}"


def ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:>6.2f}" if a and b else f"{'-':>6}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["vgg19", "resnet152"], choices=list(PAPER))
    ap.add_argument("--columns", nargs="+", default=COLUMNS, choices=COLUMNS)
    ap.add_argument("--time-scale", type=float, default=10.0,
                    help="emulated seconds stretched by this (default 10): long enough that this CPU's "
                         "own per-task cost stays small next to the emulated GPU's")
    ap.add_argument("--waves", type=int, default=4, help="waves per VW for HetPipe (steps = waves x Nm)")
    ap.add_argument("--ddp-steps", type=int, default=8)
    ap.add_argument("--quick", action="store_true", help="VGG-19 only, V and VRQG, 3 waves, 4 ddp steps")
    args = ap.parse_args()
    if args.quick:
        args.models, args.columns, args.waves, args.ddp_steps = ["vgg19"], ["V", "VRQG"], 3, 4
    scale = args.time_scale
    print(f"{load_average()}; time_scale {scale}; network {Network()} (the paper's); images/s below are "
          f"emulated-GPU images/s (measured x time_scale)")
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models:
            paper = PAPER[model]
            rows: dict[str, list[Any]] = {k: [] for k in ("horovod", "hetpipe", "predicted", "nm", "ranks")}
            for column in args.columns:
                i = COLUMNS.index(column)
                vws = 1 if column == "V" else 4
                nm = paper["in_flight"][i] // vws
                raw = job(model, column, "hetpipe", nm=nm, steps=args.waves * nm, time_scale=scale,
                          out=Path(tmp) / f"{model}-{column}-hetpipe")
                hetpipe_job = parse_job(raw)
                plan = make_plan(hetpipe_job)
                summary = run_local(hetpipe_job, quiet=True)
                rows["hetpipe"].append(summary["samples_per_second"] * scale)
                rows["predicted"].append(plan.predicted_samples_per_second * scale)
                rows["nm"].append(plan.nm)
                ddp = parse_job(job(model, column, "ddp", nm=1, steps=args.ddp_steps, time_scale=scale,
                                    out=Path(tmp) / f"{model}-{column}-ddp"))
                result = run_local(ddp, quiet=True)
                rows["horovod"].append(result["samples_per_second"] * scale)
                rows["ranks"].append(result["virtual_workers"])
                print(f"  {model} {column}: hetpipe {rows['hetpipe'][-1]:.0f} (predicted {rows['predicted'][-1]:.0f}, "
                      f"Nm {plan.nm}), horovod {rows['horovod'][-1]:.0f} on {result['virtual_workers']} ranks"
                      + (f"; left out: {'; '.join(result['left_out'])}" if result.get("left_out") else ""),
                      flush=True)
                # Where the time went, in emulated seconds (measured / time_scale).
                ranks, stages = result["virtual_workers"], len(plan.stages)
                step = result["wall_seconds"] / args.ddp_steps / scale
                in_allreduce = result["wait_seconds"] / ranks / args.ddp_steps / scale
                print(f"    horovod: {step:.3f} s per step, of which {in_allreduce:.3f} in allreduce (the ring "
                      f"alone: {result['allreduce_seconds'] / scale:.3f}; the rest waits for the slowest rank)")
                print(f"    hetpipe: {summary['wall_seconds'] / scale:.2f} s for {args.waves} waves; per stage "
                      f"{summary['idle_seconds'] / stages / scale:.2f} s idle, of which "
                      f"{summary['wait_idle_seconds'] / stages / scale:.2f} s blocked on WSP (pull wait "
                      f"{summary['wait_seconds'] / stages / scale:.2f} s)", flush=True)
            idx = [COLUMNS.index(c) for c in args.columns]
            print(f"\n{model}, batch 32: images/s (ours | paper)")
            print(f"{'':<22}" + "".join(f"{f'{len(c) * 4} GPUs {c}':>18}" for c in args.columns))
            print(f"{'Horovod-style':<22}" + "".join(
                f"{fmt(h)}{'' if r == len(c) * 4 else f'({r})':>4} |{fmt(paper['horovod'][i], 5)}"
                for h, r, c, i in zip(rows["horovod"], rows["ranks"], args.columns, idx)))
            in_flight = [f"({n * (1 if c == 'V' else 4)})" for n, c in zip(rows["nm"], args.columns)]
            print(f"{'HetPipe ED-local':<22}" + "".join(
                f"{fmt(h)}{f:>4} |{fmt(paper['hetpipe'][i], 5)}" for h, f, i in zip(rows["hetpipe"], in_flight, idx)))
            print(f"{'  predicted by plan':<22}" + "".join(f"{fmt(p)}{'':>4}  {'':>5}" for p in rows["predicted"]))
            # Where the paper's Horovod cannot run (X: a GPU type cannot hold the model), it compares
            # with Horovod on the GPUs that can, as ours does by leaving that type out.
            paper_horovod = [paper["horovod"][i] or paper["horovod"][i - 1] for i in idx]
            print(f"{'HetPipe / Horovod':<22}" + "".join(
                f"{ratio(h, d):>7}{'':>4} |{ratio(paper['hetpipe'][i], ph):>5}"
                for h, d, i, ph in zip(rows["hetpipe"], rows["horovod"], idx, paper_horovod)))
            if "V" in args.columns:
                v = args.columns.index("V")
                print(f"{'HetPipe / HetPipe(V)':<22}" + "".join(
                    f"{ratio(h, rows['hetpipe'][v]):>7}{'':>4} |{ratio(paper['hetpipe'][i], paper['hetpipe'][0]):>5}"
                    for h, i in zip(rows["hetpipe"], idx)))
            print("(n) after Horovod: ranks, when some GPUs cannot hold the model; after HetPipe: minibatches "
                  "in flight (VWs x Nm)\n", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`hetpipe run`: the embedded default, every process on this machine over loopback."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Any

from tqdm import tqdm

from hetpipe.config import JobConfig
from coordinator.driver import JobDriver, JobFailed, Progress
from coordinator.launcher import LocalProcesses, Process
from coordinator.plan import make_plan


MAX_SHARD_RESTARTS = 3


def _dead_check(procs: LocalProcesses, drivers: list[JobDriver]) -> None:
    """A dead stage fails the job; a dead shard is restarted from its checkpoint and push log."""
    dead = procs.dead()
    for p in [d for d in dead if d.name.startswith("ps shard") and d.restarts < MAX_SHARD_RESTARTS]:
        print(f"hetpipe: {p.name} {p.exit_description()}; restarting it from its checkpoint", file=sys.stderr)
        procs.restart(p)
        dead.remove(p)
    if not dead:
        return
    p: Process = dead[0]
    detail = ""
    for d in drivers:
        for h in d.stages:
            if h.address == p.address:
                detail = f"; {h.progress()}"
    raise JobFailed(f"{p.name} (pid {p.popen.pid}, {p.address}) {p.exit_description()}{detail}")


def run_local(job: JobConfig, *, quiet: bool = False) -> dict[str, Any]:
    """Plans the job, starts its processes, trains, writes outputs; stops every process it started."""
    out_dir = Path(job.resolve(job.output.dir))
    out_dir.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(out_dir / "ps", ignore_errors=True)  # a fresh job must not restore an old one's shards
    with LocalProcesses(out_dir / "logs") as procs:
        par = job.parallel
        names = [f"stage {q} of vw {v}" for v in range(par.virtual_workers) for q in range(par.stages_per_vw)]
        stage_procs = [procs.spawn("stage_worker", name) for name in names]
        # A lone VW needs no parameter server: its local weights are w_global.
        shards = par.ps_shards if par.virtual_workers > 1 else 0
        shard_procs = [
            procs.spawn("ps_server", f"ps shard {i}", ["--checkpoint-dir", str(out_dir / "ps" / f"shard{i}")])
            for i in range(shards)
        ]
        plan = make_plan(job)  # while the processes start
        drivers: list[JobDriver] = []
        procs.wait_ready()
        driver = JobDriver(job, plan, [p.address for p in stage_procs],
                           ps_addresses=[p.address for p in shard_procs],
                           check_processes=lambda: _dead_check(procs, drivers))
        drivers.append(driver)
        bar = tqdm(total=job.train.steps * plan.virtual_workers * job.data.batch_size, unit="sample",
                   disable=quiet, file=sys.stderr, dynamic_ncols=True,
                   desc="emulated" if plan.emulated else "train")

        def show(p: Progress) -> None:
            bar.n = p.samples
            bar.set_postfix(loss=f"{p.loss:.4f}", samples_s=f"{p.samples_per_second:.0f}", refresh=False)
            bar.refresh()

        try:
            driver.setup()
            bar.reset()
            wall = driver.run(show)
            bar.close()
            weights = driver.fetch_weights()
            return driver.write_outputs(weights, wall)
        except JobFailed:
            bar.close()
            raise
        finally:
            driver.close()

"""What a finished job leaves in output.dir (DESIGN §8): the final model, streamed from the shards
and the lead VW's stages into safetensors one frame at a time (the driver never holds the
model), and summary.json."""

from __future__ import annotations

import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from hetpipe import devices, models, outputs, rpc, weight_files
from hetpipe.errors import JobFailed
from hetpipe.v1 import ps_pb2, stage_pb2
from hetpipe.wsp import total_waves
from coordinator.checkpoints import shard_status
from coordinator.driver import JobDriver, StageHandle, trained_here

WATCH_S = 0.5   # how often a stage's weights read asks whether a process died or went silent


def write_weights(d: JobDriver) -> list[Path]:
    """The final model into safetensors in output.dir: w_global from the shards after every VW's
    last push (the lead VW's stages give what the shards do not hold, such as buffers), or the
    lone VW's weights. Keys as in the model's state_dict. Through a shard's restart: it holds
    every acknowledged push again (O3), so the files are written anew from the start."""
    try:
        return weight_files.through_restarts(lambda: _write_weights(d), "the final weights", closing=d.stopping)
    except OSError as exc:   # a full disk, a folder removed: the job's to name, not a coordinator error
        raise JobFailed(f"writing the final weights into output.dir {d.out_dir}: {exc.strerror or exc}") from None


def _write_weights(d: JobDriver) -> list[Path]:
    entries = list(weight_files.entries(d.model, getattr(torch, d.job.train.dtype)).values())
    with weight_files.WeightsWriter(d.out_dir, entries, d.job.output.max_shard_bytes) as writer:
        owned: set[str] = set()
        final_clock = total_waves(d.job.train.steps, d.plan.nm)
        # A parameter tied within a layer is one shard key; its other state_dict keys are w_global
        # too, not the lead VW's local copy (which lags it where no final evaluation merged it).
        tied = models.tied_keys(d.model)
        for i, stub in enumerate(d.shards):
            keys = [k for k, s in d.plan.key_shard.items() if s == i]
            if not keys:
                continue
            request = ps_pb2.PullRequest(vw=d.lead_vw, keys=keys, min_clock=final_clock)
            try:
                weight_files.stream_into(writer, lambda: stub.Pull(request, timeout=rpc.DATA_DEADLINE_S),
                                         f"ps shard {i}", tied)
            except weight_files.ReadFailed as exc:   # one gone for good is named now, not read again for a minute
                d.check_dead(exc.code)
                raise
            owned.update(keys)
            owned.update(alias for k in keys for alias in tied.get(k, ()))
        for h in d.stages:
            if h.plan.vw != d.lead_vw:
                continue
            keys = [k for k in models.layer_keys(d.model, h.plan.layer_begin, h.plan.layer_end) if k not in owned]
            if keys:
                _read_stage(d, writer, h, keys)
        try:
            return writer.close()
        except ValueError as exc:
            raise JobFailed(f"writing the final weights: {exc}") from None


def _read_stage(d: JobDriver, writer: weight_files.WeightsWriter, h: StageHandle, keys: list[str]) -> None:
    """h's weights of keys into writer. The driver's loop polls no one meanwhile: a stage that dies
    or stops answering its heartbeats (check_processes) cancels the read within WATCH_S and is
    named, where a frozen one held it for the whole data deadline (two minutes)."""
    call = h.stub.GetWeights(stage_pb2.WeightsRequest(keys=keys), timeout=rpc.DATA_DEADLINE_S)
    done = threading.Event()

    def watch() -> None:
        while not done.wait(WATCH_S):
            try:
                d.check_processes()
            except Exception:   # JobFailed, JobStopped: check_dead raises it again once the read ends
                call.cancel()
                return

    watcher = threading.Thread(target=watch, name="weights-watch", daemon=True)
    watcher.start()
    try:
        weight_files.stream_into(writer, lambda: call, h.name)
    except weight_files.ReadFailed as exc:   # a stage is not restarted: no reading again
        d.check_dead(exc.code)
        raise JobFailed(f"{exc} (at {h.at})") from None
    finally:
        done.set()
        watcher.join()


def steady_samples_per_second(stages: Iterable[stage_pb2.StageStatus], batch_size: int) -> float | None:
    """Samples/s after each VW's first wave (the stages' SteadyWindow): every VW's minibatches in
    its window over the longest window, a VW's being its slowest stage's. A fast VW that ends
    early (elastic, quorum, D > 0 on mixed GPUs) does not count as training on at its own rate
    while the slow one finishes. None where a window is empty (no more than nm minibatches)."""
    by_vw: dict[int, tuple[int, float]] = {}
    for s in stages:
        if s.steady_minibatches == 0 or s.steady_seconds <= 0:
            return None
        n, seconds = by_vw.get(s.vw, (s.steady_minibatches, 0.0))
        by_vw[s.vw] = (min(n, s.steady_minibatches), max(seconds, s.steady_seconds))
    if not by_vw:
        return None
    return sum(n for n, _ in by_vw.values()) * batch_size / max(seconds for _, seconds in by_vw.values())


def write_outputs(d: JobDriver, wall: float) -> dict[str, Any]:
    """The weights (safetensors), the final evaluation, and summary.json per DESIGN §8."""
    # The weights first: an evaluation that fails (out of memory on a large held-out set, a stage
    # lost) must not take a whole run's training with it. It scores the same w_global.
    written = write_weights(d)
    try:
        final = d.final_evaluation()
    except JobFailed as exc:
        raise JobFailed(f"{exc} (the trained weights are in {written[0].parent})") from None
    job, plan = d.job, d.plan
    # samples_per_second: this run's minibatches over this run's wall (after --resume, not the checkpoint's).
    per_vw = [job.train.steps] * len(d.last_stages()) + [e["minibatches"] for e in d.evicted]
    samples = trained_here(per_vw, d.resume_wave * plan.nm) * job.data.batch_size
    losses = [h.last.recent_loss for h in d.last_stages()]
    node = {(h.plan.vw, h.plan.stage): h.node for h in d.stages}
    fields: dict[str, Any] = {
        "steps": job.train.steps,
        "samples_per_second": samples / wall if wall > 0 else 0.0,
        # Without the first wave's one-time costs; over a constant set of VWs only.
        "steady_samples_per_second": (None if d.evicted else
                                      steady_samples_per_second((h.last for h in d.stages), job.data.batch_size)),
        "wall_seconds": wall,
        "resumed_from_wave": d.resume_wave,   # --resume: the checkpoint's wave this run went on from; 0: none
        "final_loss": sum(losses) / len(losses),
        "virtual_workers": plan.virtual_workers,
        "stages_per_vw": plan.stages_per_vw,
        "nm": plan.nm,
        "D": plan.D,
        "emulated": plan.emulated,
        **outputs.work_fields(job),
        "wait_seconds": sum(h.last.wait_seconds for h in d.stages),
        "wait_idle_seconds": sum(h.last.wait_idle_seconds for h in d.stages),
        "idle_seconds": sum(h.last.idle_seconds for h in d.stages),
        "transport": job.parallel.transport,
        "shm_bytes": sum(h.last.shm_bytes for h in d.stages),
        "cuda_ipc_bytes": sum(h.last.cuda_ipc_bytes for h in d.stages),
        "link_socket_bundles": sum(h.last.link_socket_bundles for h in d.stages),
        # The node each stage ran on, where it registered one (a remote worker's; the plan's own
        # placement names nodes of its cluster section, or "local").
        # Every VW's rows, one that left included: d.stages holds the live ones only.
        "plan": [{**row, "node": node.get((row["vw"], row["stage"])) or row["node"]} for row in plan.describe()],
        "sync": job.parallel.sync,
        "sync_args": dict(job.parallel.sync_args),
        "ps_shards": len(d.shards),
        "evicted": d.evicted,
    }
    if final is not None:
        fields["eval_loss"] = final.loss
        fields["eval_accuracy"] = final.accuracy if job.train.loss == "cross_entropy" else None
        fields["eval_rows"] = final.rows
    statuses = [shard_status(stub, i, d.stopping) for i, stub in enumerate(d.shards)]
    if statuses:
        fields["max_clock_distance"] = max(st.max_clock_distance for st in statuses)
        fields["pushes_applied"] = sum(st.pushes_applied for st in statuses)
    fields["processes"] = _memory(d, statuses)
    try:
        return outputs.write_summary(d.out_dir, fields)
    except OSError as exc:
        raise JobFailed(f"writing {outputs.SUMMARY_FILE} into output.dir {d.out_dir}: {exc.strerror or exc}") from None


def _memory(d: JobDriver, shards: list[ps_pb2.ShardStatus]) -> list[dict[str, Any]]:
    """Each process's peak memory, read after the weights were written (the last peak)."""
    out: list[dict[str, Any]] = [{"process": "coordinator", "peak_rss_bytes": devices.peak_rss_bytes()}]
    for h in d.stages:
        st = d.call(h, "Status", stage_pb2.StatusRequest(), deadline=rpc.STATUS_DEADLINE_S)
        out.append({"process": h.name, "device": st.device, "layers": [h.plan.layer_begin, h.plan.layer_end],
                    "peak_rss_bytes": st.peak_rss_bytes, "device_peak_bytes": st.device_peak_bytes})
    out += [{"process": f"ps shard {i}", "peak_rss_bytes": st.peak_rss_bytes} for i, st in enumerate(shards)]
    return out

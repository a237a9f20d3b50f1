"""Checkpoints of the whole job (train.checkpoint_every), the driver's side. At each cut every
stage saves its own state and waits (stage_worker/checkpoint.py); once all of them wait at the
same cut, nothing is in flight and every shard holds exactly the waves before it, so the driver
streams each shard's values into the cut's folder, writes the manifest last (a cut without one
is incomplete), puts the cut on disk, removes older cuts, and lets the stages go on. `hetpipe run
--resume` starts from the latest complete cut: the shards get its values and clocks, each stage
its own state."""

from __future__ import annotations

import hashlib
import json
import secrets
import shutil
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc

from coordinator.planner import Plan
from hetpipe import outputs, rpc, weight_files, wire
from hetpipe.config import ConfigError, JobConfig
from hetpipe.errors import JobFailed
from hetpipe.v1 import ps_pb2, wire_pb2

MANIFEST = "manifest.json"


def latest(folder: Path) -> int | None:
    """The wave of the latest complete cut in folder, or None."""
    waves = [int(p.parent.name.removeprefix("cut")) for p in folder.glob(f"cut*/{MANIFEST}")
             if outputs.CUT.fullmatch(p.parent.name)]
    return max(waves, default=None)


def damaged(wave: int, why: str) -> ConfigError:
    return ConfigError(f"the checkpoint of wave {wave} is damaged: {why}. Start again with --fresh, or put "
                       "back a whole copy of its folder")


def manifest(folder: Path, wave: int) -> dict[str, Any]:
    """The cut's manifest, its fields checked; ConfigError naming what is wrong with it."""
    path = outputs.cut_dir(folder, wave) / MANIFEST
    try:
        m = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise damaged(wave, f"{path} cannot be read ({exc})") from None
    if not isinstance(m, dict):
        raise damaged(wave, f"{path} holds no JSON object")

    def ints(value: object) -> bool:
        return isinstance(value, list) and all(type(v) is int and v >= 0 for v in value)

    files = m.get("files", {})
    for field, ok in (("clocks", ints(m.get("clocks"))), ("evicted", ints(m.get("evicted"))),
                      ("files", isinstance(files, dict) and all(type(n) is int and n >= 0 for n in files.values()))):
        if not ok:
            raise damaged(wave, f"{path}: {field} is missing or not what a cut writes")
    return dict(m)


def cut_files(where: Path) -> dict[str, int]:
    """Every file of a cut but its manifest, by path inside it, with its size in bytes. Not a
    write's temporary (write_atomically's .tmp, WeightsWriter's .partial): one a kill left behind
    is gone once the write it belonged to is done again, and a manifest listing it was damaged."""
    return {str(p.relative_to(where)): p.stat().st_size for p in sorted(where.rglob("*"))
            if p.is_file() and p.name != MANIFEST and not p.name.endswith((".tmp", ".partial"))}


def drop_incomplete(folder: Path) -> None:
    """Removes the cuts without a manifest (a run killed while it took one), before a run's stages
    save into the folder: a cut taken again starts from an empty folder, not among a killed
    attempt's files."""
    for where in folder.glob("cut*"):
        if outputs.CUT.fullmatch(where.name) and where.is_dir() and not (where / MANIFEST).exists():
            shutil.rmtree(where, ignore_errors=True)


def check_files(folder: Path, wave: int, m: dict[str, Any]) -> None:
    """ConfigError where a file the cut recorded is missing or of another size (a copy cut short):
    found before a run clears anything, not as a stage fails to load it. Cuts from before they
    recorded their files pass."""
    where = outputs.cut_dir(folder, wave)
    for name, size in m.get("files", {}).items():
        path = where / name
        if not path.resolve().is_relative_to(where.resolve()):
            raise damaged(wave, f"its manifest names {name!r}, outside the cut")
        if not path.is_file():
            raise damaged(wave, f"{path} is missing")
        if path.stat().st_size != size:
            raise damaged(wave, f"{path} holds {path.stat().st_size} bytes, where the cut wrote {size}")


# Recorded since cuts began to record them: a cut without one matches any (it was taken before).
# The same for a field of a section that a cut records without it (data.sha256).
LATER_KEYS = ("optimizer", "model", "batch_size", "shuffle", "seed", "data", "placement")
# ... or, for these, the value every cut had before they were recorded.
BEFORE = {"sync": "wsp"}


def data_digest(job: JobConfig) -> str | None:
    """The first 16 hex digits of the SHA-256 of data.path's file (None without one): a file
    rewritten in place under the same name would otherwise resume on other rows unnoticed. The
    file is an npz that every run loads whole, so reading it once more costs little."""
    if job.data.name != "npz" or job.data.path is None:   # the only data that reads data.path
        return None
    path = job.resolve(job.data.path)
    try:
        with open(path, "rb") as f:
            return hashlib.file_digest(f, "sha256").hexdigest()[:16]
    except OSError as exc:
        raise ConfigError(f"data.path: {path} cannot be read: {exc.strerror}") from None


def job_shape(job: JobConfig, plan: Plan, shards: int) -> dict[str, Any]:
    """What a cut records of its job, and a job resumed from it must match: the optimizer (its
    state in the stages' checkpoints is that optimizer's, sgd's momentum or adam's moments), the
    model (its layers' shapes), and what decides each minibatch's rows (the data's source and
    held-out share, batch size, shuffle, seed, and data.path's content), so that a resumed run goes
    on as the uninterrupted one would have."""
    d = job.data
    return {"virtual_workers": plan.virtual_workers, "stages_per_vw": plan.stages_per_vw, "nm": plan.nm,
            "steps": job.train.steps, "ps_shards": shards, "sync": job.parallel.sync,
            "placement": job.parallel.placement, "dtype": job.train.dtype,
            "layers": [[s.layer_begin, s.layer_end] for s in plan.stages], "optimizer": job.train.optimizer.name,
            "model": job.model.identity(),
            "batch_size": job.data.batch_size, "shuffle": job.data.shuffle, "seed": job.train.seed,
            "data": {"name": d.name, "factory": d.factory, "path": d.path, "args": dict(d.args),
                     "eval_fraction": d.eval_fraction, "eval_factory": d.eval_factory, "sha256": data_digest(job)}}


def refusal(m: dict[str, Any], wave: int, shape: dict[str, Any]) -> str | None:
    """Why a job of this shape cannot resume from the cut of wave, whose manifest is m, or None."""
    mismatch: dict[str, tuple[Any, Any]] = {}
    for k, v in shape.items():
        old = m.get(k, BEFORE.get(k))
        if old == v or (k in LATER_KEYS and k not in m):
            continue
        if isinstance(old, dict) and isinstance(v, dict):   # name the fields that differ: data.eval_fraction
            mismatch.update({f"{k}.{f}": (old.get(f), v.get(f)) for f in {**old, **v}
                             if old.get(f) != v.get(f) and f in old})
        else:
            mismatch[k] = (old, v)
    if mismatch:
        return (f"the checkpoint of wave {wave} was taken for another job: "
                + ", ".join(f"{k} {old} there, {new} now" for k, (old, new) in mismatch.items())
                + ". A resumed run goes on with that job: set them back, or start again with --fresh (model.init "
                  "can start it from a finished run's model.safetensors)")
    if m["evicted"]:
        return (f"vw {m['evicted']} had left the job before the checkpoint of wave {wave}; resuming without "
                "them is not supported yet: start again with --fresh")
    return None


def job_record(job: JobConfig) -> dict[str, Any]:
    """The whole job as a cut records it, so that a coordinator's --job goes on from its own cuts
    only: its settings, without where it writes (output) and where its file was (base_dir)."""
    raw: dict[str, Any] = json.loads(job.to_json())
    for key in ("output", "base_dir"):
        raw.pop(key, None)
    return raw


def fresh_marked(folder: Path, fresh: str) -> bool:
    """Whether the start-over request `fresh` (CoordinatorConfig.fresh) started the run whose cuts
    folder holds (mark_fresh): a start with the same environment is its restart."""
    try:
        mark = json.loads((folder / outputs.FRESH_MARK).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(mark, dict) and mark.get("fresh") == fresh


def mark_fresh(folder: Path, fresh: str) -> None:
    """Records the start-over request this start honoured (fresh_marked), or, for a start
    without one, removes an earlier one's: a later request with that value is honoured again."""
    path = folder / outputs.FRESH_MARK
    if not fresh:
        path.unlink(missing_ok=True)
        return
    folder.mkdir(parents=True, exist_ok=True)
    outputs.write_text_atomically(path, json.dumps({"fresh": fresh}) + "\n", durable=True)


def changes(m: dict[str, Any], job: JobConfig) -> list[str]:
    """How job differs from the one whose cut's manifest is m ("train.optimizer.lr 0.05 there,
    0.5 now"); a cut that records no job (written before cuts did) differs."""
    if not isinstance(m.get("job"), dict):
        return ["the cut records no job to compare"]

    def flat(value: Any, prefix: str = "") -> dict[str, Any]:
        if not isinstance(value, dict):
            return {prefix: value}
        return {k: v for key, item in value.items() for k, v in flat(item, f"{prefix}.{key}" if prefix else key).items()}

    there, now = flat(m["job"]), flat(job_record(job))
    if now.get("parallel.nm") == "auto":   # the cut records the planner's choice, which its shape checks
        there.pop("parallel.nm", None)
        now.pop("parallel.nm", None)
    return [f"{k} {there.get(k)} there, {now.get(k)} now" for k in sorted({*there, *now}) if there.get(k) != now.get(k)]


def check_cut(folder: Path, wave: int, m: dict[str, Any], shape: dict[str, Any]) -> None:
    """ConfigError unless a job of this shape (job_shape) can go on from the cut of wave in folder,
    whose manifest is m (manifest()): taken for a job of the shape, its files all there."""
    refused = refusal(m, wave, shape)
    if refused is not None:
        raise ConfigError(refused)
    check_files(folder, wave, m)


def shard_status(stub: rpc.Stub, i: int, closing: threading.Event | None = None) -> ps_pb2.ShardStatus:
    """Shard i's Status, through its restart (unless the job is closing); JobFailed naming it."""
    try:
        return rpc.retrying(lambda: stub.Status(wire_pb2.Empty(), timeout=rpc.CONTROL_DEADLINE_S),
                            give_up_s=weight_files.SHARD_RETURN_S, closing=closing)
    except grpc.RpcError as exc:
        raise JobFailed(f"ps shard {i}: Status failed: {exc.code().name}: {exc.details()}") from None


class Checkpoints:
    """Takes the cuts of one job and gives the shards a cut's values back."""

    def __init__(self, folder: Path, shards: Sequence[rpc.Stub], key_shard: dict[str, int],
                 entries: dict[str, weight_files.Entry], job_shape: dict[str, Any], *, bound: dict[str, Any] | None = None,
                 closing: threading.Event | None = None, job_record: dict[str, Any] | None = None) -> None:
        self.folder, self.shards, self.key_shard = folder, shards, key_shard
        self.entries, self.job_shape = entries, job_shape  # job_shape: what a resumed job must match
        self.job_record = job_record or {}   # the whole job: what a coordinator's --job goes on from
        self.bound = bound or {}   # the shards' WSP bound, which every Init names (wsp.shard_bound)
        self.taken = 0
        self.closing = closing   # the job's stop: no more waiting for a shard to come back
        self.mark = ""   # this start's nonce, which its stages write into their marks (prepare)

    def _keys(self, shard: int) -> list[str]:
        return [k for k, s in self.key_shard.items() if s == shard]

    def prepare(self) -> None:
        """Before a run's stages are assigned: the folder made, without an earlier start's marks
        (clear_marks) or a killed run's cuts without a manifest (drop_incomplete), and this start's
        nonce for its stages' marks drawn."""
        self.folder.mkdir(parents=True, exist_ok=True)
        self.mark = secrets.token_hex(8)
        self.clear_marks()
        drop_incomplete(self.folder)

    def clear_marks(self) -> None:
        """Removes the stages' marks (outputs.shared_mark_path), an earlier start's among them,
        before this start's stages write theirs."""
        for mark in self.folder.glob("shared_vw*_stage*"):
            mark.unlink(missing_ok=True)

    def unshared(self) -> list[tuple[int, int]]:
        """The (vw, stage) whose mark of this start (with its nonce) this host does not see: their
        hosts do not share the folder they will save their part of each cut into. Then clears the
        marks."""
        shape = self.job_shape
        missing = [(v, q) for v in range(shape["virtual_workers"]) for q in range(shape["stages_per_vw"])
                   if not outputs.shared_mark_path(self.folder, v, q, self.mark).is_file()]
        self.clear_marks()
        return missing

    def skip(self, wave: int) -> None:
        """Drops the stages' parts of the cut after `wave`, which is not taken: the older cuts stay
        the latest (a VW has left, and a cut without it could not be resumed)."""
        shutil.rmtree(outputs.cut_dir(self.folder, wave), ignore_errors=True)
        self.taken = wave

    def take(self, wave: int, lead_vw: int, evicted: list[int], seconds: float) -> None:
        """Writes the shards' part of the cut after `wave` and its manifest, and drops older cuts.
        seconds: training time up to the cut, this run's and the runs' it resumed from (what a
        --resume's eval.jsonl rows count on from)."""
        where = outputs.cut_dir(self.folder, wave)
        # Each stage saved its part before it waited at the cut, into the folder it was given:
        # this one only where its host shares it (one machine, compose's volume, k8s's claim).
        missing = [path.name for v in range(self.job_shape["virtual_workers"]) if v not in evicted
                   for q in range(self.job_shape["stages_per_vw"])
                   if not (path := outputs.stage_state_path(self.folder, wave, v, q)).is_file()]
        if missing:
            raise JobFailed(f"checkpoint of wave {wave}: {', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''} "
                            f"not in {where} on the coordinator's host: each stage writes its part of a cut into the "
                            "coordinator's output folder, which the stages' hosts must share (compose's volume runs, "
                            "k8s's claim), or train.checkpoint_every 0")
        clocks: list[int] = []
        for i, stub in enumerate(self.shards):
            if self._keys(i):
                try:   # through the shard's restart: it comes back with the same values (O3)
                    clocks = weight_files.through_restarts(lambda: self._take_shard(where, i, stub, lead_vw, wave),
                                                           f"ps shard {i}'s part of the checkpoint of wave {wave}",
                                                           closing=self.closing)
                except JobFailed as exc:
                    raise JobFailed(f"checkpoint of wave {wave}: {exc}") from None
        text = json.dumps({"wave": wave, "clocks": clocks, "evicted": evicted, "seconds": round(seconds, 3),
                           **self.job_shape, "job": self.job_record, "files": cut_files(where)}, indent=2)
        # On disk before the older cuts go, so that a power cut leaves one whole cut: the stages'
        # files (they fsync their own) and the shards' (WeightsWriter.close) are, the manifest's
        # rename fsyncs the cut's folder, and the cut's own entry is in the checkpoints folder.
        outputs.write_text_atomically(where / MANIFEST, text + "\n", durable=True)
        outputs.fsync(self.folder)
        for old in self.folder.glob("cut*"):
            if old != where and outputs.CUT.fullmatch(old.name):
                shutil.rmtree(old, ignore_errors=True)
        self.taken = wave

    def _take_shard(self, where: Path, i: int, stub: rpc.Stub, lead_vw: int, wave: int) -> list[int]:
        """Shard i's values at the cut into where/shard{i}; returns each VW's clock there."""
        keys = self._keys(i)
        (where / f"shard{i}").mkdir(parents=True, exist_ok=True)
        with weight_files.WeightsWriter(where / f"shard{i}", [self.entries[k] for k in keys], 1 << 62) as writer:
            request = ps_pb2.PullRequest(vw=lead_vw, keys=keys, min_clock=wave)
            weight_files.stream_into(writer, lambda: stub.Pull(request, timeout=rpc.DATA_DEADLINE_S), f"ps shard {i}")
            writer.close()
        status = shard_status(stub, i, self.closing)
        clocks = [c.min_clock for c in status.clocks]
        if any(c.min_clock != c.max_clock for c in status.clocks):
            raise JobFailed(f"ps shard {i}'s clocks differ between keys ({clocks})")
        return clocks

    def restore_shards(self, wave: int) -> float:
        """Gives every shard the cut's values and each VW's clock (instead of VW 0's w0); returns
        the training seconds up to the cut (0 for a cut from before they were recorded)."""
        try:
            m = manifest(self.folder, wave)
            check_cut(self.folder, wave, m, self.job_shape)
        except ConfigError as exc:
            raise JobFailed(str(exc)) from None
        for i, stub in enumerate(self.shards):
            keys = self._keys(i)
            if not keys:
                continue
            part = outputs.cut_dir(self.folder, wave) / f"shard{i}"
            try:
                values = weight_files.read_weights(part)
            except Exception as exc:   # safetensors' own errors too: what is wrong is the file
                raise JobFailed(f"--resume: ps shard {i}'s part of the checkpoint of wave {wave} ({part}) cannot be "
                                f"read: {type(exc).__name__}: {exc}") from None
            missing = [k for k in keys if k not in values]
            if missing:
                raise JobFailed(f"--resume: ps shard {i}'s part of the checkpoint of wave {wave} ({part}) holds no "
                                f"{', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}")
            # The shard takes whatever it is given: a value of another shape or dtype would fail
            # a stage mid-run in torch's words (or, pulled through shared memory, fill it as bytes).
            wrong = [f"{k} as {values[k].dtype} {list(values[k].shape)}, expected {e.dtype} {list(e.shape)}"
                     for k in keys if (values[k].dtype, tuple(values[k].shape)) != ((e := self.entries[k]).dtype, e.shape)]
            if wrong:
                raise JobFailed(f"--resume: ps shard {i}'s part of the checkpoint of wave {wave} ({part}) holds "
                                f"{'; '.join(wrong[:3])}{'; ...' if len(wrong) > 3 else ''}: not this job's")
            tensors = [(k, values[k]) for k in keys]
            tag = wire_pb2.InitTag(virtual_workers=self.job_shape["virtual_workers"], shard=i, clocks=m["clocks"],
                                   sync="wsp", **self.bound)
            try:
                rpc.retrying(lambda: stub.Init(wire.encode(tensors, init=tag), timeout=rpc.DATA_DEADLINE_S),
                             give_up_s=60.0)
            except grpc.RpcError as exc:
                raise JobFailed(f"--resume: ps shard {i} refused the checkpoint's values: "
                                f"{exc.code().name}: {exc.details()}") from None
        seconds = m.get("seconds", 0.0)
        return float(seconds) if isinstance(seconds, (int, float)) and 0 <= seconds < float("inf") else 0.0


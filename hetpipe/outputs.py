"""What a run leaves in output.dir (DESIGN §8), but the weights (hetpipe/weight_files.py): file
names, atomic and durable writes, the folder's lock, summary.json and eval.jsonl, the checkpoint
cuts' paths, and the files by which `hetpipe status` finds a run or learns how it ended. No torch:
the command line reads these."""

from __future__ import annotations

import errno
import fcntl
import json
import math
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any


from hetpipe.validate import ConfigError

if TYPE_CHECKING:
    from hetpipe.config import JobConfig

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
INDEX_SUFFIX = ".safetensors.index.json"   # a sharded model's index: ours (INDEX_FILE) and transformers' too
SUMMARY_FILE = "summary.json"
LOCK_FILE = ".hetpipe.lock"  # held by the run writing into the folder; holds its pid
TRACE_FILE = "trace.json"   # `hetpipe trace` writes it into the output directory unless told otherwise
STALE = (SINGLE_FILE, INDEX_FILE, SUMMARY_FILE, "eval.jsonl", TRACE_FILE)
ADDRESS_FILE = "coordinator.address"  # where `hetpipe status/stop --job` find the coordinator
JOB_ID_FILE = "coordinator.job"       # ... and the job_id they name there, so as never to reach another job
TOKEN_FILE = "coordinator.token"      # ... and the per-run token they need (owner-only, gone after the run)
STATUS_FILE = "status.json"           # how the last run ended, for `hetpipe status --job` afterwards
TARGETS_FILE = "prometheus_targets.json"  # Prometheus file_sd: every process's metrics endpoint


def read_weight_map(index: Path) -> dict[str, str]:
    """A safetensors index's weight_map: each key to the file beside the index that holds it.
    ValueError for one that is not such a map."""
    weight_map = json.loads(index.read_text()).get("weight_map")
    if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) and v == Path(v).name for k, v in weight_map.items()):
        raise ValueError("its weight_map is not a map of keys to file names beside it")
    return weight_map


def write_atomically(path: str | Path, write: Callable[[Path], object], *, durable: bool = False) -> None:
    """write(tmp) then rename it onto path, so that a kill during the write leaves the old file or
    none, never half of one; durable: also on disk before this returns (the file's fsync, then its
    folder's, which holds the rename), to outlive a power cut. A write that fails leaves no
    temporary file."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        write(tmp)
        if durable:
            fsync(tmp)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, path)
    if durable:
        fsync(path.parent)


def write_text_atomically(path: str | Path, text: str, *, durable: bool = False) -> None:
    """path's text, all or nothing (write_atomically)."""
    write_atomically(path, lambda tmp: tmp.write_text(text), durable=durable)


def write_named(path: str | Path, text: str) -> None:
    """A file a command was told to write (-o): all or nothing where it is a file or none
    (write_atomically: a failed write leaves the old one whole, and no temporary); through it
    where it is something else the user named (a link, a FIFO, /dev/stdout), never replacing it.
    OSError naming the path for a folder."""
    path = Path(path)
    if path.is_symlink() or (path.exists() and not path.is_file()):
        with open(path, "w") as f:
            f.write(text)
        return
    make_folder(path.parent)
    write_text_atomically(path, text)


def make_folder(folder: Path) -> None:
    """folder, made with its parents; NotADirectoryError naming the file in the way (mkdir says
    only "File exists")."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except FileExistsError as exc:
        raise NotADirectoryError(errno.ENOTDIR, "a file is in the way of that folder", exc.filename) from None


def fsync(path: str | Path) -> None:
    """Puts a file's bytes on disk; of a folder, its entries (a file created, renamed or removed)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


CHECKPOINTS = "checkpoints"  # train.checkpoint_every: the cuts a run can --resume from


def cut_dir(checkpoint_dir: str | Path, wave: int) -> Path:
    """The folder of the checkpoint after `wave` waves: each stage's state, each shard's values."""
    return Path(checkpoint_dir) / f"cut{wave:06d}"


def stage_state_path(checkpoint_dir: str | Path, wave: int, vw: int, stage: int) -> Path:
    return cut_dir(checkpoint_dir, wave) / f"vw{vw}_stage{stage}.pt"


# In a coordinator's checkpoints folder: the start-over request (HETPIPE_FRESH) that started the
# run whose cuts it holds (coordinator.checkpoints.fresh_marked).
FRESH_MARK = "fresh_start.json"


def shared_mark_path(checkpoint_dir: str | Path, vw: int, stage: int, mark: str) -> Path:
    """What a stage writes into the checkpoints folder as it loads: the coordinator, finding it
    there, knows its host shares the folder the stage will save its part of each cut into. mark:
    the coordinator's start's nonce (StageAssignment.checkpoint_mark), in the name, so that a
    stage of an earlier start that writes its own late neither passes for this start's stage
    nor overwrites its mark."""
    return Path(checkpoint_dir) / f"shared_vw{vw}_stage{stage}{'.' + mark if mark else ''}"


def check_dir(out_dir: Path) -> None:
    """ConfigError unless out_dir is a folder this process can write in, or can be made one: found
    before any process starts, not when the first of them writes there."""
    existing = out_dir
    while not existing.exists() and not existing.is_symlink():  # a missing path under a file: not there
        existing = existing.parent
    if not existing.is_dir():
        what = "a file" if existing.is_file() else "not a folder"
        raise ConfigError(f"output.dir: {out_dir}: {existing} is {what}")
    try:  # a probe rather than os.access, which says yes to root on a read-only or virtual file system
        fd, probe = tempfile.mkstemp(prefix=".hetpipe-probe-", dir=existing)
    except OSError as exc:
        raise ConfigError(f"output.dir: {out_dir}: cannot write in {existing}: {exc.strerror}") from None
    os.close(fd)
    os.unlink(probe)


def pid_lock(path: Path) -> tuple[IO[str] | None, str]:
    """path opened and locked (flock, exclusive) by this process, its pid written in once the lock
    is held (hold_pid): (the file, ""); or (None, the pid its holder wrote there). The kernel drops
    the lock with its process, even a killed one."""
    lock = open(path, "a+")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        holder = lock.read().strip() or "unknown"
        lock.close()
        return None, holder
    return lock, ""


def hold_pid(lock: IO[str]) -> None:
    """Writes this process's pid into a lock it holds, for the next one that is refused to name."""
    lock.truncate(0)
    lock.write(f"{os.getpid()}\n")
    lock.flush()


@contextmanager
def locked(out_dir: Path) -> Iterator[None]:
    """Holds out_dir (made if missing) for one run: a second run into it is refused, naming the
    first's pid, instead of clearing the results of a run still writing them. The kernel's lock
    (flock) goes with its process, even a killed one: no stale lock to remove by hand."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / LOCK_FILE
    while True:
        lock, holder = pid_lock(path)
        if lock is None:
            raise ConfigError(f"output.dir {out_dir} is in use by another hetpipe run (pid {holder}): wait for it "
                              "to end, or give this job another output.dir") from None
        try:  # still the file at path: its holder did not remove it while we opened it
            if os.path.samestat(os.fstat(lock.fileno()), os.stat(path)):
                break
        except FileNotFoundError:
            pass
        lock.close()
    try:
        hold_pid(lock)
        yield
    finally:
        path.unlink(missing_ok=True)  # before the lock goes: no one takes a file that is about to go
        lock.close()


# What a run writes in output.dir's folders, by name: exactly what a new run clears there. Anything
# else in them (a user's notes in logs/, their own checkpoints) is left alone: output.dir may be a
# folder of the user's, even ".".
CUT = re.compile(r"cut[0-9]{6,}")   # cut_dir pads to 6 digits: wave 1,000,000 has 7
SHARD_FILE = re.compile(r"model-[0-9]{5}-of-[0-9]{5}\.safetensors")   # weight_files.file_names, transformers' names
# A weights file being written (weight_files.WeightsWriter): a run killed then leaves it, hidden, as large as the model.
PARTIAL = re.compile(rf"\.(?:model\.safetensors|{SHARD_FILE.pattern})\.partial")
WRITTEN = {
    "ps": re.compile(r"shard\d+"),                       # each shard's durable state
    CHECKPOINTS: re.compile(rf"{CUT.pattern}|shared_vw\d+_stage\d+(\.[0-9a-f]+)?|fresh_start\.json"),
    "logs": re.compile(r"(stage_worker|ps_server)_\d+\.log|(ddp|torch-pipeline)_rank\d+\.log"),
    "trace": re.compile(r"vw\d+_stage\d+\.jsonl|acked_vw\d+_stage\d+\.pt|profile_vw\d+_stage\d+\.(json|txt)"),
    "trace/sync": re.compile(r"vw\d+_stage\d+\.jsonl"),
    "trace/ps": re.compile(r"shard\d+\.jsonl"),
}


def written(out_dir: Path, *, keep_checkpoints: bool = False, folders: Iterable[str] = WRITTEN) -> list[Path]:
    """An earlier run's files and folders in out_dir, which a new one removes: its results, and
    its entries in `folders` (its checkpoints too unless kept)."""
    found = [out_dir / name for name in STALE] + sorted(p for p in out_dir.glob("model-*-of-*.safetensors")
                                                        if SHARD_FILE.fullmatch(p.name))
    found += sorted(p for p in out_dir.glob(".model*.partial") if PARTIAL.fullmatch(p.name))
    for folder in folders:
        where = out_dir / folder
        if (folder == CHECKPOINTS and keep_checkpoints) or where.is_symlink() or not where.is_dir():
            continue
        found += sorted(p for p in where.iterdir() if WRITTEN[folder].fullmatch(p.name))
    return [p for p in found if p.exists() or p.is_symlink()]


def check_reads(out_dir: Path, reads: Mapping[str, Path], *, keep_checkpoints: bool = False,
                folders: Iterable[str] = WRITTEN) -> None:
    """ConfigError where a file the job reads (model.init, data.path) is one that start_fresh or
    clear, given the same arguments, removes before the job reads it: fine-tuning from an earlier
    run's model.safetensors in place."""
    doomed = [gone.resolve() for gone in written(out_dir, keep_checkpoints=keep_checkpoints, folders=folders)]
    for key, path in reads.items():
        resolved = path.resolve()
        for gone in doomed:
            if resolved == gone or gone in resolved.parents:
                raise ConfigError(f"{key}: {path} is an earlier run's output in output.dir {out_dir}, which this run "
                                  "clears before it starts: copy it out of output.dir first, or choose another output.dir")


def start_fresh(out_dir: Path, *, keep_checkpoints: bool, folders: Iterable[str] = ("ps", CHECKPOINTS),
                evals: list[dict[str, Any]] | None = None) -> None:
    """Readies out_dir for a new job: made if missing, without an earlier job's shard state (ps/,
    which a shard would restore) or results, and without its checkpoints unless kept (--resume
    goes on from them); a local run's launcher clears its logs/ and trace/ too (folders). Removes
    only what a run writes (WRITTEN), and then each of the folders that is left empty. evals: a
    resume's eval.jsonl (evals_through its cut), put in place of the old in one step: a kill
    cannot lose the rows before the cut, which the resumed run does not evaluate again."""
    out_dir.mkdir(parents=True, exist_ok=True)
    doomed = written(out_dir, keep_checkpoints=keep_checkpoints, folders=folders)
    if evals is not None:
        keep_evals(out_dir, evals)
        doomed = [p for p in doomed if p != out_dir / "eval.jsonl"]
    _remove(doomed)
    for folder in sorted(folders, reverse=True):   # trace/ps and trace/sync before trace
        try:
            (out_dir / folder).rmdir()
        except OSError:
            pass   # missing, or it holds what no run wrote


def start_local(out_dir: Path, *, keep_checkpoints: bool, evals: list[dict[str, Any]] | None = None) -> None:
    """start_fresh for a run launched on this machine, HetPipe's or a baseline's: with its logs/ and
    trace/, and an earlier job's endpoints and ending (status.json), which would otherwise pass for
    this run's (`hetpipe trace`, `hetpipe status --job`)."""
    start_fresh(out_dir, keep_checkpoints=keep_checkpoints, folders=WRITTEN, evals=evals)
    for stale in (TARGETS_FILE, STATUS_FILE, ADDRESS_FILE, JOB_ID_FILE):
        (out_dir / stale).unlink(missing_ok=True)


def clear(out_dir: Path) -> None:
    """Removes an earlier run's results, so that a failed run never leaves them beside its own."""
    _remove(written(out_dir, folders=()))


def _remove(paths: Iterable[Path]) -> None:
    for path in paths:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


def json_line(row: Mapping[str, Any]) -> str:
    """One line of a .jsonl file, strict JSON (NaN and infinities null): the traces' too."""
    return json.dumps(_strict(row), allow_nan=False) + "\n"


def _strict(value: Any) -> Any:
    """NaN and infinities are not JSON: they become null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {k: _strict(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_strict(v) for v in value]
    return value


def work_fields(job: JobConfig) -> dict[str, Any]:
    """What decides a step's work, as every mode's summary.json records it (and `hetpipe plan`
    compares a run's with the job's): the model, batch size, precision, dtype, an emulated
    cluster's task times, the mode and its schedule."""
    return {"model": job.model.identity(), "batch_size": job.data.batch_size, "precision": job.train.precision,
            "dtype": job.train.dtype, "emulate": job.emulate.work() if job.emulate else None,
            "mode": job.parallel.mode, "schedule": job.parallel.schedule, "microbatches": job.parallel.microbatches}


def write_summary(out_dir: Path, fields: Mapping[str, Any]) -> dict[str, Any]:
    summary = _strict(dict(fields))
    write_text_atomically(out_dir / SUMMARY_FILE, json.dumps(summary, indent=2, allow_nan=False) + "\n")
    return summary  # type: ignore[no-any-return]


def read_summary(out_dir: Path) -> dict[str, Any] | None:
    """The last run's summary.json, or None where there is none or it is not a JSON object (a
    file from elsewhere, or one an older version wrote in place and a kill cut short)."""
    try:
        summary = json.loads((out_dir / SUMMARY_FILE).read_text())
    except (OSError, ValueError):
        return None
    return summary if isinstance(summary, dict) else None


def evals_through(out_dir: Path, cut: int) -> list[dict[str, Any]]:
    """The evaluations in out_dir's eval.jsonl made after at most `cut` minibatches: what a
    --resume from the cut after minibatch `cut` keeps of the interrupted run's (one right at the
    cut, if the first run wrote it, as it wrote it: run again, it would score the restored
    weights, not those it scored). A line a kill cut short, or one not of this format, is left out."""
    kept = []
    try:
        lines = (out_dir / "eval.jsonl").read_text().splitlines()
    except (OSError, UnicodeDecodeError):
        return []
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if (isinstance(row, dict) and not row.get("final") and isinstance(row.get("minibatches"), int)
                and row["minibatches"] <= cut and isinstance(row.get("id"), int)):
            kept.append(row)
    return kept


def _eval_lines(rows: Iterable[Mapping[str, Any]]) -> str:
    return "".join(json_line(row) for row in rows)


def append_evals(out_dir: Path, rows: Iterable[Mapping[str, Any]]) -> None:
    with open(out_dir / "eval.jsonl", "a") as f:
        f.write(_eval_lines(rows))


def keep_evals(out_dir: Path, rows: list[dict[str, Any]]) -> None:
    """eval.jsonl holding exactly rows, in one atomic step (start_fresh's evals); none: no file."""
    path = out_dir / "eval.jsonl"
    if rows:
        write_text_atomically(path, _eval_lines(rows))
    else:
        path.unlink(missing_ok=True)


# ---- a run's own files: how `hetpipe status/stop --job` find it, or learn how it ended ----------


def publish_address(out_dir: Path, address: str, job_id: str) -> None:
    """Where `hetpipe status/stop --job` find the job: the coordinator's address and the job_id."""
    write_text_atomically(out_dir / JOB_ID_FILE, job_id + "\n")
    write_text_atomically(out_dir / ADDRESS_FILE, address + "\n")


def unpublish_address(out_dir: Path) -> None:
    for name in (ADDRESS_FILE, JOB_ID_FILE):
        (out_dir / name).unlink(missing_ok=True)


def published_job_id(out_dir: Path) -> str:
    """The job_id publish_address left, or "" (the coordinator's current job)."""
    try:
        return (out_dir / JOB_ID_FILE).read_text().strip()
    except FileNotFoundError:
        return ""


def write_status(out_dir: Path, state: str, reason: str) -> None:
    """status.json: how the run ended, for `hetpipe status --job` once its coordinator is gone."""
    write_text_atomically(out_dir / STATUS_FILE, json.dumps({"state": state, "reason": reason, "finished": time.time()}) + "\n")


def read_status(out_dir: Path) -> dict[str, Any] | None:
    """How the last run into out_dir ended ({state, reason, finished}), or None where there is no
    status.json or it is not what write_status writes (a job state's name, a reason); a
    `finished` that is no time is left out, and the state stands without it."""
    from hetpipe.v1 import coordinator_pb2

    try:
        status = json.loads((out_dir / STATUS_FILE).read_text())
    except (OSError, ValueError):
        return None
    if (not isinstance(status, dict) or status.get("state") not in coordinator_pb2.JobStatus.State.keys()
            or not isinstance(status.get("reason", ""), str)):
        return None
    finished = status.get("finished")
    if isinstance(finished, bool) or not isinstance(finished, (int, float)) or not math.isfinite(finished):
        status.pop("finished", None)
    return status

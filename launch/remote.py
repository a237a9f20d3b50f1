"""`hetpipe run JOB --coordinator HOST:PORT`: the job submitted to a coordinator that runs on its
own (`hetpipe coordinator`), planned over the workers registered there (`hetpipe worker`),
followed with the same progress bar as a local run, and its outputs written here, in output.dir."""

from __future__ import annotations

import json
import os
import re
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, NoReturn

import grpc

from hetpipe import outputs, reach, rpc, security
from hetpipe.config import ConfigError, JobConfig, check_coordinated
from hetpipe.errors import JobFailed, JobStopped, interrupt_reason
from hetpipe.v1 import coordinator_pb2
from hetpipe.outputs import STATUS_FILE, fsync, publish_address, unpublish_address, write_status
from coordinator.remote import RESULT_FILES
from launch.local import follow

# What a client accepts from a coordinator's Results stream: names, count and sizes bounded, so
# that a coordinator (or whoever answers at its address) cannot write outside output.dir or fill
# the disk without limit.
MAX_RESULT_FILES = 100_000
MAX_RESULT_BYTES = 1 << 40        # 1 TiB: the weights of the largest models, in safetensors shards
MAX_NAME_CHARS = 255
_COMPONENT = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]*\Z")  # no ".", "..", hidden names or odd characters
GIVE_UP_S = 30.0                  # a coordinator silent this long while the job runs is gone
SUBMIT_RETRY_S = 1.0              # between tries of a Submit that found nothing listening


class CoordinatorUnreachable(Exception):
    """The coordinator did not answer (exit 69, as `hetpipe status`)."""


def output_path(out_dir: Path, name: str) -> Path:
    """Where a result file the coordinator names goes: one of the files a run hands back
    (coordinator.remote's RESULT_FILES, or a weight shard), directly in out_dir. ValueError for
    any other name (output.dir may be the job's own folder: a coordinator, or whoever answers at
    its address, must not write the user's modules there), or one that a symbolic link would take
    outside out_dir."""
    parts = name.split("/")
    if not name or len(name) > MAX_NAME_CHARS or name.startswith("/") or not all(_COMPONENT.match(p) for p in parts):
        raise ValueError(f"file name {name[:MAX_NAME_CHARS]!r}: expected a plain relative path of at most "
                         f"{MAX_NAME_CHARS} characters (letters, digits, '.', '_', '-'; no '..')")
    if name not in RESULT_FILES and not outputs.SHARD_FILE.fullmatch(name):
        raise ValueError(f"file name {name!r}: not one of the files a run hands back ({', '.join(RESULT_FILES)}, "
                         "model-NNNNN-of-NNNNN.safetensors)")
    path = out_dir.joinpath(*parts)
    if not path.resolve().is_relative_to(out_dir.resolve()):
        raise ValueError(f"file name {name!r}: leads outside {out_dir} (a symbolic link)")
    return path


class ResultWriter:
    """Writes the chunks of a Results stream into out_dir: each file to NAME.part in order, then
    renamed once its last chunk came. ValueError for a chunk out of order, a name refused by
    output_path, or more files or bytes than the bounds."""

    def __init__(self, out_dir: Path) -> None:
        self.out_dir = out_dir
        self.written: list[str] = []
        self.total = 0
        self._name = ""
        self._path = Path()
        self._fd = -1
        self._offset = 0

    def add(self, chunk: coordinator_pb2.OutputChunk) -> None:
        if chunk.path != self._name:
            if self._fd >= 0:
                raise ValueError(f"{self._name}: ended at byte {self._offset} without its last chunk")
            if chunk.path in self.written:
                raise ValueError(f"{chunk.path}: sent twice")
            if len(self.written) >= MAX_RESULT_FILES:
                raise ValueError(f"more than {MAX_RESULT_FILES} files")
            self._path = output_path(self.out_dir, chunk.path)
            self._path.parent.mkdir(parents=True, exist_ok=True)
            part = self._path.with_name(self._path.name + ".part")
            self._fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
            self._name, self._offset = chunk.path, 0
        if chunk.offset != self._offset:
            raise ValueError(f"{chunk.path}: a chunk at byte {chunk.offset}, expected {self._offset}")
        self.total += len(chunk.data)
        if self.total > MAX_RESULT_BYTES:
            raise ValueError(f"more than {MAX_RESULT_BYTES} bytes in all")
        os.write(self._fd, chunk.data)
        self._offset += len(chunk.data)
        if chunk.last:
            os.fsync(self._fd)   # on disk before its name: a power cut must not leave a short model.safetensors
            os.close(self._fd)
            self._fd = -1
            os.replace(self._path.with_name(self._path.name + ".part"), self._path)
            self.written.append(chunk.path)
            self._name = ""

    def resume_point(self) -> tuple[int, int]:
        """(files complete, bytes into the next): where a Results call that was cut resumes."""
        return len(self.written), self._offset if self._fd >= 0 else 0

    def close(self) -> list[str]:
        """The files written; ValueError if the stream stopped inside one."""
        if self._fd >= 0:
            self.abort()
            raise ValueError(f"{self._name}: the stream ended at byte {self._offset}, before its last chunk")
        if self.written:
            fsync(self.out_dir)   # the renames too
        return self.written

    def abort(self) -> None:
        """Leaves no half-written file behind."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
            self._path.with_name(self._path.name + ".part").unlink(missing_ok=True)


Results = Callable[[coordinator_pb2.ResultsRequest], Iterable[coordinator_pb2.OutputChunk]]


def receive(results: Results, job_id: str, out_dir: Path) -> list[str]:
    """The job's Results streams into out_dir; returns the names written (ValueError: see
    ResultWriter). A stream cut by its call's deadline, or by a coordinator restarting its
    server, resumes where it got to, as long as it brought something: a large model crosses a
    slow link in as many calls as it takes. grpc.RpcError for a call that brought nothing."""
    writer = ResultWriter(out_dir)
    try:
        while True:
            skip_files, offset = point = writer.resume_point()
            try:
                for chunk in results(coordinator_pb2.ResultsRequest(job_id=job_id, skip_files=skip_files,
                                                                    offset=offset)):
                    writer.add(chunk)
                return writer.close()
            except grpc.RpcError as exc:
                if exc.code() not in rpc.RETRYABLE or writer.resume_point() == point:
                    raise
    except BaseException:
        writer.abort()
        raise


def credentials(job: JobConfig, flags: security.Security) -> security.Security:
    """The job's security section (paths relative to the job file), else the flags (--token-file,
    --tls-*; their defaults are $HETPIPE_TOKEN_FILE and $HETPIPE_TLS_CERT/KEY/CA)."""
    return job.security_files() or flags


def remote_files(job: JobConfig) -> str:
    """The files a remote run reads on the coordinator's and the workers' hosts, in one line ('' if none)."""
    named = [f"{key} {path}" for key, path in job.read_paths.items()]
    if job.factories:
        named.append(f"the modules of {', '.join(job.factories.values())} (from {job.base_dir} or installed)")
    if not named:
        return ""
    return (f"the coordinator and the workers read {'; '.join(named)} on their own hosts: the same paths must "
            "hold the same files there")


def _get_job(stub: rpc.Stub, job_id: str, address: str) -> coordinator_pb2.JobStatus:
    ref = coordinator_pb2.JobRef(job_id=job_id)
    try:
        status: coordinator_pb2.JobStatus = rpc.retrying(
            lambda: stub.GetJob(ref, timeout=rpc.CONTROL_DEADLINE_S), give_up_s=GIVE_UP_S)
    except grpc.RpcError as exc:
        if exc.code() == grpc.StatusCode.NOT_FOUND:   # it answers, but restarted: its jobs ended with it
            raise JobFailed(f"coordinator {address} no longer knows job {job_id} (it restarted, and a job does not "
                            f"outlive its coordinator): {exc.details()}") from None
        raise CoordinatorUnreachable(f"coordinator {address} unreachable for {GIVE_UP_S:.0f}s while job {job_id} ran: "
                                     f"{reach.failure(exc)}; the job is lost with it (a job does not outlive its "
                                     "coordinator, and its workers leave it)") from None
    return status


def _submit(stub: rpc.Stub, job: JobConfig, address: str) -> str:
    """The job_id the coordinator gave the job; ConfigError, CoordinatorUnreachable or JobFailed.
    A coordinator that nothing listens for yet (started a moment ago) is tried again for GIVE_UP_S:
    such a call never reached it, so the job cannot be submitted twice."""
    request = coordinator_pb2.SubmitRequest(job_json=job.to_json())
    deadline = time.monotonic() + GIVE_UP_S
    told = False
    while True:
        try:
            status = stub.Submit(request, timeout=rpc.CONTROL_DEADLINE_S)
            job_id: str = status.job_id
            return job_id
        except grpc.RpcError as exc:
            if not (reach.refused(exc) and time.monotonic() < deadline):
                _refused(exc, address)
            if not told:
                print(f"hetpipe: coordinator {reach.unreachable(address, exc)}; trying again for "
                      f"{GIVE_UP_S:.0f}s", file=sys.stderr)
                told = True
            time.sleep(SUBMIT_RETRY_S)


def _refused(exc: grpc.RpcError, address: str) -> NoReturn:
    """What a failed Submit means, raised: ConfigError, CoordinatorUnreachable or JobFailed."""
    code, details = exc.code(), exc.details()
    if reach.handshake_failed(exc):   # not an outage: the same call fails again
        raise ConfigError(f"coordinator {reach.unreachable(address, exc)} ({details})") from None
    if code in rpc.RETRYABLE:
        raise CoordinatorUnreachable(f"coordinator {reach.unreachable(address, exc)}") from None
    if code == grpc.StatusCode.UNAUTHENTICATED or (code == grpc.StatusCode.PERMISSION_DENIED
                                                   and (details or "").endswith(security.ROLE_REFUSAL)):
        raise ConfigError(f"coordinator {address} refused the job: {details} (give the job a security section, "
                          "or set HETPIPE_TOKEN_FILE)") from None
    if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.PERMISSION_DENIED):  # details say why
        raise ConfigError(f"coordinator {address} refused the job: {details}") from None
    raise JobFailed(f"coordinator {address} did not take the job: {code.name}: {details}") from None


class _Announcer:
    """Says once where the job was planned, and that emulated workers run at time_scale 1 when the
    job left cluster.emulate to the coordinator."""

    def __init__(self, job: JobConfig, quiet: bool) -> None:
        self.job, self.quiet, self.done = job, quiet, False

    def __call__(self, status: coordinator_pb2.JobStatus) -> None:
        if self.done or not status.plan_json:
            return
        self.done = True
        if self.job.cluster is None and status.emulated:
            print("hetpipe: the registered workers are emulated GPUs and the job has no cluster section: "
                  "cluster.emulate time_scale 1 (give a cluster section naming their nodes to choose)", file=sys.stderr)
        if not self.quiet:
            stages = json.loads(status.plan_json)
            print("hetpipe: planned " + "; ".join(f"vw {s['vw']} stage {s['stage']}: {s['gpu']} on {s['node']}"
                                                  for s in stages), file=sys.stderr)


def fetch_results(stub: rpc.Stub, job_id: str, out_dir: Path, address: str) -> list[str]:
    """The ended job's outputs from the coordinator into out_dir; JobFailed naming what went wrong."""
    try:
        return receive(lambda request: stub.Results(request, timeout=rpc.DATA_DEADLINE_S), job_id, out_dir)
    except grpc.RpcError as exc:
        raise JobFailed(f"fetching the outputs from coordinator {address}: {exc.code().name}: {exc.details()}") from None
    except (ValueError, OSError) as exc:
        raise JobFailed(f"fetching the outputs from coordinator {address}: {exc}") from None


def run_remote(job: JobConfig, address: str, *, quiet: bool = False,
               flags: security.Security = security.Security()) -> dict[str, Any]:
    """Runs job on the cluster of the coordinator at address; returns the summary, with the final
    weights, summary.json, eval.jsonl and status.json in this host's output.dir. Raises ConfigError,
    JobFailed, JobStopped or CoordinatorUnreachable; Ctrl-C stops the job there too."""
    check_coordinated(job, "`hetpipe run --coordinator`")   # refused before submitting
    out_dir = Path(job.resolve(job.output.dir))
    outputs.check_dir(out_dir)
    outputs.check_reads(out_dir, job.read_paths, folders=())   # what clear() removes below
    files = remote_files(job)
    if files:
        print(f"hetpipe: {files}", file=sys.stderr)
    try:
        with outputs.locked(out_dir), security.using(credentials(job, flags), security.COORDINATOR, "hetpipe run"):
            return _run_submitted(job, address, out_dir, quiet)
    except security.SecurityError as exc:
        raise ConfigError(f"security: {exc}") from None


def _run_submitted(job: JobConfig, address: str, out_dir: Path, quiet: bool) -> dict[str, Any]:
    with rpc.channel(address) as channel:
        stub = rpc.Stub(channel, "Coordinator")
        job_id = _submit(stub, job, address)
        # Cleared once the job is accepted: a refused run leaves an earlier run's results alone, and
        # a failed one never leaves them beside its own.
        out_dir.mkdir(parents=True, exist_ok=True)
        outputs.clear(out_dir)
        (out_dir / STATUS_FILE).unlink(missing_ok=True)
        publish_address(out_dir, address, job_id)
        try:
            final = _follow_and_fetch(stub, job, job_id, address, out_dir, quiet)
        finally:
            unpublish_address(out_dir)  # the coordinator may run someone else's job next
    State = coordinator_pb2.JobStatus.State
    if final.state == State.COMPLETED:
        summary: dict[str, Any] = json.loads(final.summary_json)
        return summary
    if final.state == State.STOPPED:
        raise JobStopped(final.reason)
    raise JobFailed(final.reason)


def _follow_and_fetch(stub: rpc.Stub, job: JobConfig, job_id: str, address: str, out_dir: Path,
                      quiet: bool) -> coordinator_pb2.JobStatus:
    """Follows the submitted job to its end, fetches its results and writes how it ended."""
    try:
        final = follow(lambda: _get_job(stub, job_id, address), quiet=quiet, on_status=_Announcer(job, quiet))
    except KeyboardInterrupt as exc:
        try:
            stub.StopJob(coordinator_pb2.JobRef(job_id=job_id), timeout=rpc.CONTROL_DEADLINE_S)
        except grpc.RpcError:
            pass
        write_status(out_dir, "STOPPED", interrupt_reason(exc))
        raise
    except (JobFailed, CoordinatorUnreachable) as exc:   # its coordinator restarted, or went away
        write_status(out_dir, "FAILED", str(exc))   # for `hetpipe status --job`, as a local run's failure
        raise
    State = coordinator_pb2.JobStatus.State
    try:
        fetch_results(stub, job_id, out_dir, address)
    except JobFailed as exc:
        if final.state == State.COMPLETED:
            write_status(out_dir, "FAILED", str(exc))
            raise
        # A failed job may have left nothing to fetch; its own reason is what matters.
    write_status(out_dir, State.Name(final.state), final.reason)
    return final

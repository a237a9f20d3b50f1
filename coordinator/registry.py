"""Registry of stage workers and shards: registration checks, heartbeats, liveness, claiming."""

from __future__ import annotations

import re
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from hetpipe.catalog import CATALOG
from hetpipe.errors import JobStopped, Rejected
from hetpipe.v1 import coordinator_pb2

Role = coordinator_pb2.WorkerInfo.Role
# A worker silent this many intervals is dead. Three (3 s) blamed live stages on a loaded 2-core
# box, where loading torch can keep a stage's heartbeat thread from the GIL for seconds; a process
# that dies is seen at once anyway (by its launcher, or by its refused connection).
MISSED_HEARTBEATS = 5
FORGET_AFTER_MISSED = 30  # an unassigned worker silent this many intervals is forgotten
MAX_WORKERS = 4096
MAX_FIELD_CHARS = 256  # address, node, device, gpu_type, name, host_id; a heartbeat's leaving
_ADDRESS = re.compile(r"[A-Za-z0-9_.\-\[\]:]+:([0-9]{1,5})")   # fullmatch: "$" would take a final newline
_DEVICE = re.compile(r"cpu|cuda:[0-9]{1,3}")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


class Awake:
    """When this process last came back from a pause (SIGSTOP, a starved host). A daemon thread
    ticks every TICK_S; a gap of more than pause_s between ticks, or no tick for that long when
    asked, is a pause. The heartbeats sent meanwhile may still wait in the server's queue, so no
    worker's silence counts from before it."""

    TICK_S = 0.1

    def __init__(self, pause_s: float = 1.0) -> None:
        self.pause_s = pause_s
        self._last = time.monotonic()
        self._resumed = 0.0
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def start(self) -> Awake:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="awake", daemon=True)
                self._thread.start()
        return self

    def _run(self) -> None:
        while True:
            time.sleep(self.TICK_S)
            self.resumed_at()

    def resumed_at(self) -> float:
        """The monotonic time of the last pause's end (0.0: none yet); a tick itself."""
        now = time.monotonic()
        with self._lock:
            if now - self._last > self.pause_s:
                self._resumed = now
            self._last = now
            return self._resumed


PROCESS_AWAKE = Awake()   # one per process, its thread started by the first Registry


@dataclass
class Worker:
    worker_id: str
    info: coordinator_pb2.WorkerInfo
    last_heartbeat: float
    assigned: str = ""
    leaving: str = ""   # the process said it is stopping, and why (HeartbeatRequest.leaving)

    @property
    def label(self) -> str:
        who = self.assigned or Role.Name(self.info.role).lower()
        return f"{who} ({self.info.name or 'worker'} at {self.info.address} on {self.info.node})"


def validate(info: coordinator_pb2.WorkerInfo) -> None:
    """Refuses a registration that names no role, a bad address, device or GPU type."""
    for field in ("address", "node", "device", "gpu_type", "name", "host_id"):
        if len(getattr(info, field)) > MAX_FIELD_CHARS:
            raise Rejected(grpc.StatusCode.INVALID_ARGUMENT,
                           f"{field}: {len(getattr(info, field))} characters, at most {MAX_FIELD_CHARS}")
        # A node goes into the cluster section of the jobs planned on it, which every stage
        # refuses with a NUL in a node's name; and a line break in a name forges log lines.
        if _CONTROL.search(getattr(info, field)):
            raise Rejected(grpc.StatusCode.INVALID_ARGUMENT,
                           f"{field} {getattr(info, field)!r}: control characters (a NUL, a line break)")
    if info.role not in (Role.STAGE_WORKER, Role.PS_SHARD):
        raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, f"role {info.role}: expected STAGE_WORKER or PS_SHARD")
    m = _ADDRESS.fullmatch(info.address)
    if not m or not 0 < int(m.group(1)) < 65536:
        raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, f"address {info.address!r}: expected host:port")
    if not _DEVICE.fullmatch(info.device):
        raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, f"device {info.device!r}: expected 'cpu' or 'cuda:N'")
    if info.gpu_type and info.gpu_type not in CATALOG:
        raise Rejected(grpc.StatusCode.INVALID_ARGUMENT,
                       f"gpu_type {info.gpu_type!r}: expected one of {', '.join(CATALOG)} or empty")
    if not info.node:
        raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, "node: expected the host name the worker runs on")


def _tally(workers: list[tuple[str, str, str]]) -> str:
    """'2 x titan-v on n0, 1 x any': how many of each (node, GPU type) in a list of (_, node, type)."""
    counts: dict[str, int] = {}
    for _, node, gpu in workers:
        key = f"{gpu} on {node}" if gpu else "any"
        counts[key] = counts.get(key, 0) + 1
    return ", ".join(f"{n} x {key}" for key, n in counts.items())


class Registry:
    def __init__(self, heartbeat_interval_s: float = 1.0, awake: Awake | None = None) -> None:
        self.interval = heartbeat_interval_s
        self._awake = awake or PROCESS_AWAKE.start()
        self._workers: dict[str, Worker] = {}
        # (address, name) of processes that served a job (its stages were stopped, its shard holds
        # that job's clocks): never claimed again. A restarted process registers with a new name
        # (pid) and is fresh.
        self._spent: set[tuple[str, str]] = set()
        self._lock = threading.Condition()

    def register(self, info: coordinator_pb2.WorkerInfo) -> str:
        """The new worker's id; "" for one that holds a job (info.holds_job) and takes over no
        assignment here: not registered, as that job ended with the coordinator that ran it."""
        validate(info)
        with self._lock:
            self._forget_silent()
            previous = next((w for w in self._workers.values() if w.info.address == info.address), None)
            if previous is not None and previous.info.node != info.node and self._alive(previous):
                raise Rejected(grpc.StatusCode.ALREADY_EXISTS,
                               f"address {info.address} is already registered by {previous.label}")
            # A process of another role at the address (its port taken after the old one died)
            # takes over nothing: a stage worker was left "ps shard 0", never claimed, then spent.
            assigned = previous.assigned if previous is not None and previous.info.role == info.role else ""
            if info.holds_job and not assigned:
                return ""
            if len(self._workers) >= MAX_WORKERS and previous is None:
                raise Rejected(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"{len(self._workers)} workers registered, at most {MAX_WORKERS}")
            # The same address, its holder gone or on the same node: the process restarted there
            # (one port, one process), so the new registration takes over the old one's assignment.
            if previous is not None:
                del self._workers[previous.worker_id]
            worker = Worker(uuid.uuid4().hex[:12], info, time.monotonic(), assigned)
            # The same process registering again (this registry forgot it) is still spent.
            self._spent = {(a, n) for a, n in self._spent if a != info.address or n == info.name}
            self._workers[worker.worker_id] = worker
            self._lock.notify_all()
            return worker.worker_id

    def heartbeat(self, worker_id: str, leaving: str = "") -> bool:
        """A worker's heartbeat; False: unknown (register again). leaving: it is stopping, and why."""
        if len(leaving) > MAX_FIELD_CHARS:
            raise Rejected(grpc.StatusCode.INVALID_ARGUMENT,
                           f"leaving: {len(leaving)} characters, at most {MAX_FIELD_CHARS}")
        if _CONTROL.search(leaving):   # it becomes the failed job's reason, shown by `hetpipe status`
            raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, f"leaving {leaving!r}: control characters (a line break)")
        with self._lock:
            w = self._workers.get(worker_id)
            if w is None:
                return False
            w.last_heartbeat = time.monotonic()
            w.leaving = w.leaving or leaving
            return True

    def leaving(self, role: int) -> list[Worker]:
        """Assigned workers of role that said they are stopping (a signal on their host)."""
        with self._lock:
            return [w for w in self._workers.values() if w.assigned and w.info.role == role and w.leaving]

    def _alive(self, w: Worker) -> bool:
        """Heartbeating, and not stopping: one that said it is (leaving) is gone within moments."""
        return not w.leaving and time.monotonic() - w.last_heartbeat <= MISSED_HEARTBEATS * self.interval

    def _forget_silent(self) -> None:
        """Unassigned workers silent for FORGET_AFTER_MISSED intervals are gone (a crashed or
        moved worker registers again); assigned ones stay, for the job's failure report."""
        limit = time.monotonic() - FORGET_AFTER_MISSED * self.interval
        for worker_id in [i for i, w in self._workers.items() if not w.assigned and w.last_heartbeat < limit]:
            del self._workers[worker_id]

    def workers(self) -> list[tuple[Worker, float, bool]]:
        with self._lock:
            self._forget_silent()
            now = time.monotonic()
            return [(w, now - w.last_heartbeat, self._alive(w)) for w in self._workers.values()]

    def silent(self, role: int, grace_s: float = 0.0) -> list[tuple[Worker, float]]:
        """Assigned workers of role that missed MISSED_HEARTBEATS (plus grace_s), with silence;
        none for the time this process itself was paused (Awake)."""
        with self._lock:
            resumed = self._awake.resumed_at()
            now = time.monotonic()
            limit = MISSED_HEARTBEATS * self.interval + grace_s
            return [(w, now - w.last_heartbeat) for w in self._workers.values()
                    if w.assigned and w.info.role == role and now - max(w.last_heartbeat, resumed) > limit]

    def claim(self, role: int, wanted: list[tuple[str, str, str]], timeout: float, *,
              cancel: threading.Event | None = None, waiting: Callable[[str], None] = lambda shortfall: None,
              ) -> list[Worker]:
        """Claims one live worker per (label, node, gpu_type) wanted, waiting up to timeout
        (TimeoutError), or until cancel is set (JobStopped). waiting(shortfall) is told what the
        claim lacks whenever that changes while it waits ('' once it is over); it runs under the
        registry's lock, so it only records it.

        A worker that registered with a node and GPU type serves only that (node, type); one
        that registered without a type is generic (emulation, or this machine's own devices).
        """
        deadline = time.monotonic() + timeout
        told = ""
        try:
            with self._lock:
                while True:
                    chosen = self._match(role, wanted)
                    if chosen is not None:
                        for w, (label, _, _) in zip(chosen, wanted):
                            w.assigned = label
                        return chosen
                    if cancel is not None and cancel.is_set():
                        raise JobStopped("stopped by request while waiting for workers")
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise TimeoutError(f"after {timeout:.0f}s, {self._shortfall(role, wanted)}")
                    shortfall = self._shortfall(role, wanted)
                    if shortfall != told:
                        waiting(told := shortfall)
                    self._lock.wait(min(left, 0.2))
        finally:
            if told:
                waiting("")

    def _shortfall(self, role: int, wanted: list[tuple[str, str, str]]) -> str:
        """'stage_workers needed: ...; free and alive: ...', and the registered ones that stopped
        heartbeating (a host that died: its `hetpipe worker` may start fresh ones)."""
        silent = [(w.info.address, w.info.node, w.info.gpu_type) for w in self._workers.values()
                  if w.info.role == role and not w.assigned and not self._is_spent(w) and not self._alive(w)]
        return (f"{Role.Name(role).lower()}s needed: {_tally(wanted)}; free and alive: "
                f"{_tally(self._free(role)) or 'none'}" + (f"; silent or stopped: {_tally(silent)}" if silent else ""))

    def listing(self) -> coordinator_pb2.WorkerList:
        """Every worker as ListWorkers gives it."""
        out = coordinator_pb2.WorkerList()
        for w, silence, alive in self.workers():
            out.workers.add(worker_id=w.worker_id, info=w.info, seconds_since_heartbeat=silence, alive=alive,
                            assigned=w.assigned, spent=self._is_spent(w))
        return out

    def _claimable(self, w: Worker, role: int) -> bool:
        return w.info.role == role and not w.assigned and not self._is_spent(w) and self._alive(w)

    def _is_spent(self, w: Worker) -> bool:
        return (w.info.address, w.info.name) in self._spent

    def _free(self, role: int) -> list[tuple[str, str, str]]:
        return [(w.info.address, w.info.node, w.info.gpu_type) for w in self._workers.values()
                if self._claimable(w, role)]

    def _match(self, role: int, wanted: list[tuple[str, str, str]]) -> list[Worker] | None:
        free = sorted((w for w in self._workers.values() if self._claimable(w, role)), key=lambda w: w.info.address)
        chosen: list[Worker] = []
        for _, node, gpu in wanted:
            exact = [w for w in free if w.info.gpu_type and w.info.node == node and w.info.gpu_type == gpu]
            generic = [w for w in free if not w.info.gpu_type]
            if not (exact or generic):
                return None
            pick = (exact or generic)[0]
            free.remove(pick)
            chosen.append(pick)
        return chosen

    def release(self) -> None:
        """The job ended: its workers are free again, and spent (a process serves one job)."""
        with self._lock:
            for w in self._workers.values():
                if w.assigned:
                    self._spent.add((w.info.address, w.info.name))
                w.assigned = ""

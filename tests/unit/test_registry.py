"""coordinator/registry.py: registration checks, liveness by heartbeat, claiming workers for a plan."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable

import grpc
import pytest

from coordinator import registry
from coordinator.registry import MISSED_HEARTBEATS, Awake, Registry
from hetpipe.errors import JobStopped, Rejected
from hetpipe.v1 import coordinator_pb2

Info = coordinator_pb2.WorkerInfo


def info(address: str, *, node: str = "n0", gpu: str = "", role: int = Info.STAGE_WORKER) -> Info:
    return Info(role=role, address=address, node=node, device="cpu", gpu_type=gpu)  # type: ignore[arg-type]


class StillClock:
    """coordinator.registry's clock, still until a test moves it: a silence is what the test
    says, not what a loaded machine makes of the time between two lines. The process's own
    Awake thread, where one runs, keeps the real clock: what it records outlives the test."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        if threading.current_thread() is registry.PROCESS_AWAKE._thread:
            return time.monotonic()
        return self.now

    sleep = staticmethod(time.sleep)


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> StillClock:
    still = StillClock()
    monkeypatch.setattr(registry, "time", still)
    return still


def never_paused() -> Awake:
    """An Awake of the still clock's that takes no move of it for a pause of the coordinator's."""
    return Awake(pause_s=math.inf)


def once_waiting(then: Callable[[], None]) -> Callable[[str], None]:
    """A claim's `waiting` that calls then() on a thread of its own once the claim says it waits
    (the report comes under the registry's lock): what comes after, comes while it waits."""
    def waiting(shortfall: str) -> None:
        if shortfall:
            threading.Thread(target=then, daemon=True).start()
    return waiting


def test_a_worker_is_alive_while_it_heartbeats(clock: StillClock) -> None:
    r = Registry(heartbeat_interval_s=1.0, awake=never_paused())
    wid = r.register(info("127.0.0.1:7001"))
    assert [alive for _, _, alive in r.workers()] == [True]
    clock.now += MISSED_HEARTBEATS * 1.0
    assert [alive for _, _, alive in r.workers()] == [True], "alive through its last missed interval"
    clock.now += 1.0
    assert [alive for _, _, alive in r.workers()] == [False]
    assert r.heartbeat(wid) and [alive for _, _, alive in r.workers()] == [True]
    assert not r.heartbeat("nobody"), "an unknown id is told to register again"


def test_claim_prefers_the_planned_node_and_type_and_falls_back_to_generic_workers() -> None:
    r = Registry()
    r.register(info("127.0.0.1:7001", node="n1", gpu="titan-v"))
    r.register(info("127.0.0.1:7002", node="n0", gpu="titan-v"))
    r.register(info("127.0.0.1:7003"))  # generic: emulation, or this machine's own devices
    chosen = r.claim(Info.STAGE_WORKER, [("stage 0 of vw 0", "n0", "titan-v"), ("stage 1 of vw 0", "n2", "t4")], 1)
    assert [w.info.address for w in chosen] == ["127.0.0.1:7002", "127.0.0.1:7003"]
    assert [w.assigned for w in chosen] == ["stage 0 of vw 0", "stage 1 of vw 0"]
    with pytest.raises(TimeoutError, match="after 0s, stage_workers needed: 1 x titan-v on n0; free and alive: "
                                           "1 x titan-v on n1$"):
        r.claim(Info.STAGE_WORKER, [("stage 0 of vw 1", "n0", "titan-v")], 0.1)
    r.release()
    assert all(not w.assigned for w, _, _ in r.workers())


def test_claim_waits_for_workers_and_stops_when_asked(clock: StillClock) -> None:
    # Claims with an hour's timeout, on a still clock: only the worker, or the stop, can end them.
    r = Registry(awake=never_paused())
    (w,) = r.claim(Info.STAGE_WORKER, [("stage 0 of vw 0", "", "")], 3600,
                   waiting=once_waiting(lambda: r.register(info("127.0.0.1:7001"))))
    assert w.info.address == "127.0.0.1:7001"
    cancel = threading.Event()
    with pytest.raises(JobStopped):   # a stop must not wait out the claim timeout
        r.claim(Info.STAGE_WORKER, [("stage 1 of vw 0", "", "")], 3600, cancel=cancel, waiting=once_waiting(cancel.set))


def test_a_waiting_claim_says_what_it_lacks_and_which_workers_fell_silent(clock: StillClock) -> None:
    """What `hetpipe run` and `status` show while a job waits for workers (JobStatus.waiting)."""
    r = Registry(heartbeat_interval_s=1.0, awake=never_paused())
    r.register(info("127.0.0.1:7001", node="n0", gpu="t4"))
    clock.now += MISSED_HEARTBEATS + 1.0   # its host died
    r.register(info("127.0.0.1:7002", node="n1", gpu="t4"))
    reports: list[str] = []
    arrives = once_waiting(lambda: r.register(info("127.0.0.1:7003", node="n0", gpu="t4")))

    def waiting(shortfall: str) -> None:
        reports.append(shortfall)
        if len(reports) == 1:
            arrives(shortfall)

    (chosen,) = r.claim(Info.STAGE_WORKER, [("stage 0 of vw 0", "n0", "t4")], 3600, waiting=waiting)
    assert chosen.info.address == "127.0.0.1:7003"
    # What it lacked while it waited, and then that it is over; the still clock let nobody else fall silent.
    assert reports == ["stage_workers needed: 1 x t4 on n0; free and alive: 1 x t4 on n1; silent or stopped: "
                       "1 x t4 on n0", ""]
    told = len(reports)
    r.heartbeat(r.register(info("127.0.0.1:7004", node="n1", gpu="t4")))
    assert r.claim(Info.STAGE_WORKER, [("stage 1 of vw 0", "n1", "t4")], 3600, waiting=reports.append)
    assert len(reports) == told, "a claim that need not wait reports nothing"


def test_a_worker_that_says_it_is_leaving_is_named_once_assigned_and_a_long_reason_changes_nothing() -> None:
    r = Registry()
    wid = r.register(info("127.0.0.1:7001"))
    with pytest.raises(Rejected, match="leaving: 300 characters, at most 256") as err:
        r.heartbeat(wid, "x" * 300)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    # It becomes the job's failure reason: a line break in it forged a line of `hetpipe status`.
    with pytest.raises(Rejected, match=r"leaving 'stopped\\nJOB COMPLETED': control characters"):
        r.heartbeat(wid, "stopped\nJOB COMPLETED")
    r.claim(Info.STAGE_WORKER, [("stage 0 of vw 0", "", "")], 1)
    assert r.leaving(Info.STAGE_WORKER) == [], "the refused heartbeat recorded nothing"
    assert r.heartbeat(wid, "stopped by SIGINT") and r.heartbeat(wid, "stopped by SIGTERM")
    (w,) = r.leaving(Info.STAGE_WORKER)
    assert w.leaving == "stopped by SIGINT", "the first reason stands"
    assert r.leaving(Info.PS_SHARD) == []
    assert [alive for _, _, alive in r.workers()] == [False], "`hetpipe status` shows it gone at once"
    r.release()
    assert r.leaving(Info.STAGE_WORKER) == [], "only a job's workers fail it"


def test_a_restarted_process_takes_over_its_assignment_but_another_node_cannot() -> None:
    r = Registry()
    r.register(info("127.0.0.1:7001", node="n0"))
    (w,) = r.claim(Info.STAGE_WORKER, [("stage 0 of vw 0", "", "")], 1)
    with pytest.raises(Rejected, match="already registered"):
        r.register(info("127.0.0.1:7001", node="n9"))
    r.register(info("127.0.0.1:7001", node="n0"))  # the same process, restarted
    (again, _, _), = r.workers()
    assert again.worker_id != w.worker_id and again.assigned == "stage 0 of vw 0"


def test_a_process_of_another_role_at_a_dead_workers_address_takes_over_nothing() -> None:
    """A port is one process's, so a new one there means the old one died; but one of another role
    (a stage worker given the dead shard's port) is not its restart: it is free, not "ps shard 0"."""
    r = Registry()
    r.register(info("127.0.0.1:7001", role=Info.PS_SHARD))
    r.claim(Info.PS_SHARD, [("ps shard 0", "", "")], 1)
    holding = info("127.0.0.1:7001", role=Info.STAGE_WORKER)
    holding.holds_job = True
    assert r.register(holding) == "", "a stage holding a job takes over no shard's assignment"
    r.register(info("127.0.0.1:7001", role=Info.STAGE_WORKER))
    (w, _, _), = r.workers()
    assert w.info.role == Info.STAGE_WORKER and w.assigned == ""
    assert r.claim(Info.STAGE_WORKER, [("stage 0 of vw 0", "", "")], 1) == [w]


def test_a_process_holding_a_job_registers_only_to_take_over_its_assignment() -> None:
    """A shard restored from its checkpoint holds a job: the coordinator that gave it that job
    takes it back (its restart mid-job); any other registry refuses it (job_unknown), so that no
    next job is given a shard holding an ended job's clocks."""
    def restored(address: str, node: str = "n0") -> Info:
        holding = info(address, node=node, role=Info.PS_SHARD)
        holding.holds_job = True
        return holding

    r = Registry()
    assert r.register(restored("127.0.0.1:7001")) == "", "a fresh registry: that job ended with another"
    assert r.workers() == []
    r.register(info("127.0.0.1:7001", role=Info.PS_SHARD))
    assert r.register(restored("127.0.0.1:7001")) == "", "its address is known, but holds no assignment"
    (w,) = r.claim(Info.PS_SHARD, [("ps shard 0", "", "")], 1)
    assert r.register(restored("127.0.0.1:7002")) == "", "another address's assignment is not its own"
    again = r.register(restored("127.0.0.1:7001"))   # restarted from its checkpoint mid-job
    assert again and again != w.worker_id
    assert [(x.worker_id, x.assigned) for x, _, _ in r.workers()] == [(again, "ps shard 0")]


def test_silent_names_only_assigned_workers_past_their_heartbeats_and_grace(clock: StillClock) -> None:
    r = Registry(heartbeat_interval_s=1.0, awake=never_paused())
    r.register(info("127.0.0.1:7001"))
    r.register(info("127.0.0.1:7002", role=Info.PS_SHARD))
    r.register(info("127.0.0.1:7003"))   # not assigned
    r.claim(Info.STAGE_WORKER, [("stage 0 of vw 0", "", "")], 1)
    r.claim(Info.PS_SHARD, [("ps shard 0", "", "")], 1)
    clock.now += MISSED_HEARTBEATS * 1.0
    assert r.silent(Info.STAGE_WORKER) == [], "not before it missed them all"
    clock.now += 2.0
    assert [(w.assigned, silence) for w, silence in r.silent(Info.STAGE_WORKER)] == [("stage 0 of vw 0", 7.0)]
    assert r.silent(Info.PS_SHARD, grace_s=60) == [], "a shard gets time to be restarted"


def test_a_pause_of_the_coordinator_itself_blames_no_worker(clock: StillClock) -> None:
    # It stops running (SIGSTOP of `hetpipe run`, a starved host) while the heartbeats sent
    # meanwhile wait in its queue: silences count again from when it runs again.
    awake = Awake(pause_s=2.0)   # not started: each check is its only tick
    r = Registry(heartbeat_interval_s=1.0, awake=awake)
    r.register(info("127.0.0.1:7001"))
    r.claim(Info.STAGE_WORKER, [("stage 0 of vw 0", "", "")], 1)
    assert r.silent(Info.STAGE_WORKER) == []
    clock.now += MISSED_HEARTBEATS + 3.0   # no tick: the process was paused
    assert r.silent(Info.STAGE_WORKER) == [], "a worker blamed for the coordinator's own pause"
    for _ in range(MISSED_HEARTBEATS):   # running again, ticking each interval, and still no heartbeat
        clock.now += 1.0
        assert r.silent(Info.STAGE_WORKER) == [], "its silence counts from the end of the pause"
    clock.now += 1.0
    assert [w.assigned for w, _ in r.silent(Info.STAGE_WORKER)] == ["stage 0 of vw 0"], "a silent worker is still found"

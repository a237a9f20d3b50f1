"""coordinator/registry.py: registration checks, liveness by heartbeat, claiming workers for a plan."""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from coordinator.registry import MISSED_HEARTBEATS, Awake, Registry
from hetpipe.errors import JobStopped, Rejected
from hetpipe.v1 import coordinator_pb2

Info = coordinator_pb2.WorkerInfo


def info(address: str, *, node: str = "n0", gpu: str = "", role: int = Info.STAGE_WORKER) -> Info:
    return Info(role=role, address=address, node=node, device="cpu", gpu_type=gpu)  # type: ignore[arg-type]


def test_a_worker_is_alive_while_it_heartbeats() -> None:
    r = Registry(heartbeat_interval_s=0.05)
    wid = r.register(info("127.0.0.1:7001"))
    assert [alive for _, _, alive in r.workers()] == [True]
    time.sleep(0.05 * (MISSED_HEARTBEATS + 1))
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


def test_claim_waits_for_workers_and_stops_when_asked() -> None:
    r = Registry()
    threading.Timer(0.2, lambda: r.register(info("127.0.0.1:7001"))).start()
    assert len(r.claim(Info.STAGE_WORKER, [("stage 0 of vw 0", "", "")], 5)) == 1
    cancel = threading.Event()
    threading.Timer(0.2, cancel.set).start()
    started = time.monotonic()
    with pytest.raises(JobStopped):
        r.claim(Info.STAGE_WORKER, [("stage 1 of vw 0", "", "")], 30, cancel=cancel)
    assert time.monotonic() - started < 5, "a stop must not wait out the claim timeout"


def test_a_waiting_claim_says_what_it_lacks_and_which_workers_fell_silent() -> None:
    """What `hetpipe run` and `status` show while a job waits for workers (JobStatus.waiting)."""
    r = Registry(heartbeat_interval_s=0.1)
    r.register(info("127.0.0.1:7001", node="n0", gpu="t4"))
    time.sleep(0.1 * (MISSED_HEARTBEATS + 1))   # its host died
    r.register(info("127.0.0.1:7002", node="n1", gpu="t4"))
    reports: list[str] = []
    threading.Timer(0.2, lambda: r.register(info("127.0.0.1:7003", node="n0", gpu="t4"))).start()
    (chosen,) = r.claim(Info.STAGE_WORKER, [("stage 0 of vw 0", "n0", "t4")], 5, waiting=reports.append)
    assert chosen.info.address == "127.0.0.1:7003"
    # First (a slow timer may let 7002 fall silent too, a report more) and last: over.
    assert reports[0] == "stage_workers needed: 1 x t4 on n0; free and alive: 1 x t4 on n1; silent or stopped: 1 x t4 on n0"
    assert reports[-1] == ""
    told = len(reports)
    r.heartbeat(r.register(info("127.0.0.1:7004", node="n1", gpu="t4")))
    assert r.claim(Info.STAGE_WORKER, [("stage 1 of vw 0", "n1", "t4")], 5, waiting=reports.append)
    assert len(reports) == told, "a claim that need not wait reports nothing"


def test_a_worker_that_says_it_is_leaving_is_named_once_assigned_and_a_long_reason_changes_nothing() -> None:
    r = Registry()
    wid = r.register(info("127.0.0.1:7001"))
    with pytest.raises(Rejected, match="leaving: 300 characters, at most 256") as err:
        r.heartbeat(wid, "x" * 300)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
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


def test_silent_names_only_assigned_workers_past_their_heartbeats_and_grace() -> None:
    r = Registry(heartbeat_interval_s=0.02)
    r.register(info("127.0.0.1:7001"))
    r.register(info("127.0.0.1:7002", role=Info.PS_SHARD))
    r.claim(Info.STAGE_WORKER, [("stage 0 of vw 0", "", "")], 1)
    r.claim(Info.PS_SHARD, [("ps shard 0", "", "")], 1)
    time.sleep(0.02 * (MISSED_HEARTBEATS + 2))
    assert [w.assigned for w, _ in r.silent(Info.STAGE_WORKER)] == ["stage 0 of vw 0"]
    assert r.silent(Info.PS_SHARD, grace_s=60) == [], "a shard gets time to be restarted"


def test_a_pause_of_the_coordinator_itself_blames_no_worker() -> None:
    # It stops running (SIGSTOP of `hetpipe run`, a starved host) while the heartbeats sent
    # meanwhile wait in its queue: silences count again from when it runs again.
    awake = Awake(pause_s=0.05)   # not started: each check is its only tick
    r = Registry(heartbeat_interval_s=0.02, awake=awake)
    r.register(info("127.0.0.1:7001"))
    r.claim(Info.STAGE_WORKER, [("stage 0 of vw 0", "", "")], 1)
    assert r.silent(Info.STAGE_WORKER) == []
    time.sleep(0.02 * (MISSED_HEARTBEATS + 3))   # no tick: the process was paused
    resumed = time.monotonic()   # before the check whose tick the silences count from again
    assert r.silent(Info.STAGE_WORKER) == [], "a worker blamed for the coordinator's own pause"
    while not (silent := r.silent(Info.STAGE_WORKER)) and time.monotonic() - resumed < 5:
        time.sleep(0.005)                          # running again, and still no heartbeat
    assert [w.assigned for w, _ in silent] == ["stage 0 of vw 0"], "a silent worker is still found"
    assert time.monotonic() - resumed >= 0.02 * MISSED_HEARTBEATS

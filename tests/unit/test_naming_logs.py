"""A local run's failure names the log of each worker it is about (launch.local.naming_logs): the
logs are named in the order the workers started, which says nothing of the stage each served."""

from __future__ import annotations

from pathlib import Path

from launch.local import naming_logs

LOGS = {"127.0.0.1:4604": Path("out/logs/stage_worker_0.log"), "127.0.0.1:46043": Path("out/logs/stage_worker_1.log"),
        "127.0.0.1:51000": Path("out/logs/ps_server_0.log")}


def test_the_logs_of_the_workers_a_failure_names_by_address() -> None:
    reason = "stage 1 of vw 0: boom (at 127.0.0.1:46043 on node local); ps shard 0 at 127.0.0.1:51000 is gone"
    assert naming_logs(reason, LOGS) == reason + "; log out/logs/stage_worker_1.log, out/logs/ps_server_0.log"


def test_an_address_is_not_found_inside_a_longer_one_and_none_adds_nothing() -> None:
    assert naming_logs("at 127.0.0.1:46043", {"127.0.0.1:4604": LOGS["127.0.0.1:4604"]}) == "at 127.0.0.1:46043"
    assert naming_logs("the launcher failed", LOGS) == "the launcher failed"

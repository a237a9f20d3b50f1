"""Jobs from another host: the cluster of the registered workers (coordinator/remote.py), the
registry's rule that a process serves one job, and the client's checks on the outputs it is
handed (launch/remote.py)."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest

from coordinator import remote
from coordinator.planner import make_plan
from coordinator.registry import Registry
from hetpipe.cluster import EmulateConfig, GpuGroup, NodeConfig
from hetpipe.config import ConfigError
from hetpipe.v1 import coordinator_pb2
from launch.remote import MAX_NAME_CHARS, output_path, receive

Info = coordinator_pb2.WorkerInfo
Entry = coordinator_pb2.WorkerList.Entry


def entry(address: str, node: str, gpu: str = "", device: str = "cpu", *, role: int = Info.STAGE_WORKER,
          alive: bool = True, assigned: str = "", spent: bool = False) -> Entry:
    info = Info(role=role, address=address, node=node, device=device, gpu_type=gpu)  # type: ignore[arg-type]
    return Entry(info=info, alive=alive, assigned=assigned, spent=spent)


# ---- cluster_from_workers ------------------------------------------------------------------------


def test_emulated_workers_become_nodes_of_counted_types_run_at_time_scale_1() -> None:
    cluster = remote.cluster_from_workers([
        entry("b:1", "hostb", "t4"), entry("a:1", "hosta", "titan-v"), entry("a:2", "hosta", "t4"),
        entry("a:3", "hosta", "titan-v"),
    ])
    assert cluster is not None
    assert cluster.nodes == (NodeConfig("hosta", (GpuGroup("t4", 1), GpuGroup("titan-v", 2))),
                             NodeConfig("hostb", (GpuGroup("t4", 1),)))
    assert cluster.emulate == EmulateConfig()  # emulated on the CPU, nothing else set: time_scale 1


def test_real_gpus_need_no_emulation() -> None:
    cluster = remote.cluster_from_workers([entry("a:1", "hosta", "a100-80gb", "cuda:0"),
                                           entry("b:1", "hostb", "h100-80gb", "cuda:0")])
    assert cluster is not None and cluster.emulate is None
    assert [(n.name, n.gpus) for n in cluster.nodes] == [("hosta", (GpuGroup("a100-80gb"),)),
                                                          ("hostb", (GpuGroup("h100-80gb"),))]


def test_only_free_live_stage_workers_count() -> None:
    cluster = remote.cluster_from_workers([
        entry("a:1", "hosta", "t4"),
        entry("a:2", "hosta", "t4", alive=False),
        entry("a:3", "hosta", "t4", assigned="stage 0 of vw 0"),
        entry("a:4", "hosta", "t4", spent=True),
        entry("a:5", "hosta", role=Info.PS_SHARD),
        entry("c:1", "hostc"),  # generic beside typed workers: left out
    ])
    assert cluster is not None and cluster.nodes == (NodeConfig("hosta", (GpuGroup("t4", 1),)),)


def test_generic_workers_alone_give_no_cluster_section() -> None:
    assert remote.cluster_from_workers([entry("a:1", "hosta"), entry("b:1", "hostb")]) is None
    assert remote.cluster_from_workers([]) is None


def test_emulated_and_real_gpus_together_are_refused_naming_both() -> None:
    with pytest.raises(ConfigError, match=r"emulated GPUs \(t4 on hosta\) and real ones \(a100-80gb on hostb\)"):
        remote.cluster_from_workers([entry("a:1", "hosta", "t4"), entry("b:1", "hostb", "a100-80gb", "cuda:0")])


def test_the_registered_cluster_plans_on_the_registered_nodes(make_job) -> None:
    job = make_job({"parallel": {"virtual_workers": 2, "stages_per_vw": 2}})
    cluster = remote.cluster_from_workers([entry(f"{n}:{i}", n, "t4") for n in ("hosta", "hostb") for i in (1, 2)])
    plan = make_plan(dataclasses.replace(job, cluster=cluster))
    assert plan.emulated and all(s.device == "cpu" and s.gpu == "t4" for s in plan.stages)
    assert sorted(s.node for s in plan.stages) == ["hosta", "hosta", "hostb", "hostb"]


# ---- where a submitted job writes ----------------------------------------------------------------


@pytest.mark.parametrize(("given", "name"), [("runs/exp1", "exp1"), ("/home/u/out dir", "out_dir"), (".", "job"),
                                             ("..", "job"), ("a/b/../c;rm -rf", "c_rm_-rf")])
def test_a_submitted_job_writes_under_the_output_root(make_job, tmp_path: Path, given: str, name: str) -> None:
    job = remote.place_outputs(make_job({"output": {"dir": given}}), tmp_path / "root")
    assert job.output.dir == str(tmp_path / "root" / name)
    assert job.resolve(job.output.dir) == tmp_path / "root" / name


# ---- one job per process -------------------------------------------------------------------------


def test_a_process_that_served_a_job_is_never_claimed_again_but_its_fresh_successor_is() -> None:
    r = Registry()
    r.register(Info(role=Info.PS_SHARD, address="h:7001", node="n0", device="cpu", name="pid 10"))
    (w,) = r.claim(Info.PS_SHARD, [("ps shard 0", "", "")], 1)
    r.release()
    assert [e.spent for e in r.listing().workers] == [True]
    with pytest.raises(TimeoutError, match="after 0s, ps_shards needed: 1 x any; free and alive: none$"):
        r.claim(Info.PS_SHARD, [("ps shard 0", "", "")], 0.05)
    # The same process registering again (the registry forgot it) is still spent.
    r.register(Info(role=Info.PS_SHARD, address="h:7001", node="n0", device="cpu", name="pid 10"))
    assert [e.spent for e in r.listing().workers] == [True]
    # Its launcher started a fresh one on the same port: a new process, claimable.
    r.register(Info(role=Info.PS_SHARD, address="h:7001", node="n0", device="cpu", name="pid 11"))
    assert [e.spent for e in r.listing().workers] == [False]
    assert len(r.claim(Info.PS_SHARD, [("ps shard 0", "", "")], 1)) == 1


# ---- the outputs a client is handed --------------------------------------------------------------


@pytest.mark.parametrize("name", ["model.safetensors", "model-00001-of-00003.safetensors", "eval.jsonl", "summary.json",
                                  "model.safetensors.index.json"])
def test_the_files_a_run_hands_back_land_inside_output_dir(tmp_path: Path, name: str) -> None:
    path = output_path(tmp_path, name)
    assert path == tmp_path / name and path.resolve().is_relative_to(tmp_path.resolve())


@pytest.mark.parametrize("name", ["mymodel.py", "a/b.json", "_x", "x" * MAX_NAME_CHARS, "status.json",
                                  "coordinator.token", "model-1-of-2.safetensors", "ps/model.safetensors"])
def test_a_file_no_run_hands_back_is_refused(tmp_path: Path, name: str) -> None:
    """output.dir may be the job's own folder: whoever answers at the coordinator's address must
    not write the user's modules, or anything else, there."""
    with pytest.raises(ValueError, match="not one of the files a run hands back"):
        output_path(tmp_path, name)


@pytest.mark.parametrize("name", ["", "/etc/passwd", "../x", "a/../../x", "..", ".", "./x", "a//b", "a/", ".bashrc",
                                  "a\\..\\b", "x\x00y", "name with space", "-rf", "x" * (MAX_NAME_CHARS + 1), "é",
                                  "model-00001-of-00002.safetensors\n", "a\n/model.safetensors"])
def test_names_that_could_leave_output_dir_are_refused(tmp_path: Path, name: str) -> None:
    with pytest.raises(ValueError, match="file name"):
        output_path(tmp_path, name)


def test_a_symbolic_link_out_of_output_dir_is_refused(tmp_path: Path) -> None:
    (tmp_path / "out").mkdir()
    (tmp_path / "elsewhere").mkdir()
    os.symlink(tmp_path / "elsewhere" / "model.safetensors", tmp_path / "out" / "model.safetensors")
    with pytest.raises(ValueError, match="leads outside"):
        output_path(tmp_path / "out", "model.safetensors")


def _chunk(path: str, offset: int, data: bytes, last: bool) -> coordinator_pb2.OutputChunk:
    return coordinator_pb2.OutputChunk(path=path, offset=offset, data=data, last=last)


def test_the_coordinators_result_files_arrive_byte_for_byte(tmp_path: Path) -> None:
    served = tmp_path / "served"
    served.mkdir()
    files = {"model-00001-of-00002.safetensors": os.urandom(5000), "model-00002-of-00002.safetensors": b"",
             "model.safetensors.index.json": b"{}", "summary.json": b'{"steps": 3}', "eval.jsonl": b"\n" * 7}
    for name, data in files.items():
        (served / name).write_bytes(data)
    for name in ("logs", "trace"):
        (served / name).mkdir()
    (served / "coordinator.token").write_text("secret")  # not a result: stays where it is
    os.symlink(served / "summary.json", served / "model.safetensors")  # a link is not handed out
    chunks = [_chunk(*c) for c in remote.result_chunks(served, chunk_bytes=1024)]
    assert len(chunks) == 5 + 4  # the 5000-byte file in 5 pieces, each of the 4 others in one
    got = receive(lambda _: chunks, "", tmp_path / "client")
    assert sorted(got) == sorted(files)
    assert {p.name: p.read_bytes() for p in (tmp_path / "client").iterdir()} == files


@pytest.mark.parametrize(("chunks", "why"), [
    ([_chunk("summary.json", 0, b"ab", False), _chunk("summary.json", 3, b"c", True)], "a chunk at byte 3, expected 2"),
    ([_chunk("summary.json", 0, b"ab", False), _chunk("eval.jsonl", 0, b"c", True)], "summary.json: ended at byte 2"),
    ([_chunk("summary.json", 0, b"ab", False)], "the stream ended at byte 2"),
    ([_chunk("summary.json", 0, b"a", True), _chunk("summary.json", 0, b"a", True)], "summary.json: sent twice"),
    ([_chunk("../summary.json", 0, b"a", True)], "file name"),
])
def test_a_stream_out_of_order_is_refused_and_leaves_no_partial_file(tmp_path: Path, chunks: list[object],
                                                                    why: str) -> None:
    with pytest.raises(ValueError, match=why):
        receive(lambda _: chunks, "", tmp_path)  # type: ignore[arg-type,return-value]
    assert not list(tmp_path.glob("*.part")) and not (tmp_path.parent / "summary.json").exists()


def test_the_bytes_in_all_are_bounded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("launch.remote.MAX_RESULT_BYTES", 10)
    with pytest.raises(ValueError, match="more than 10 bytes in all"):
        receive(lambda _: [_chunk("summary.json", 0, b"x" * 8, True), _chunk("eval.jsonl", 0, b"x" * 8, True)], "", tmp_path)
    assert not (tmp_path / "eval.jsonl").exists() and not (tmp_path / "eval.jsonl.part").exists()


def test_a_coordinator_gone_while_its_job_runs_is_named_with_the_job_lost(monkeypatch: pytest.MonkeyPatch) -> None:
    import socket

    from hetpipe import rpc
    from launch import remote as client

    with socket.socket() as s:   # a port nobody listens on: the coordinator died
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    monkeypatch.setattr(client, "GIVE_UP_S", 0.3)
    with rpc.channel(address) as channel:
        with pytest.raises(client.CoordinatorUnreachable) as info:
            client._get_job(rpc.Stub(channel, "Coordinator"), "ab" * 16, address)
    assert str(info.value).startswith(f"coordinator {address} unreachable for 0s while job {'ab' * 16} ran: UNAVAILABLE")
    assert str(info.value).endswith("; the job is lost with it (a job does not outlive its coordinator, and its "
                                    "workers leave it)")
    assert "UNAVAILABLE: nothing listens at that address (not started yet, or stopped);" in str(info.value)


def test_a_submit_to_a_coordinator_not_listening_yet_is_tried_again(make_job, capsys: pytest.CaptureFixture[str],
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A coordinator started a moment before `hetpipe run --coordinator` (compose, a script): the
    Submit found nothing listening, so it never arrived, and is sent again until it does; one
    that never comes is CoordinatorUnreachable after GIVE_UP_S."""
    import socket
    import threading

    from hetpipe import rpc
    from launch import remote as client

    class Coordinator:
        def Submit(self, request: coordinator_pb2.SubmitRequest, context: object) -> coordinator_pb2.JobStatus:
            return coordinator_pb2.JobStatus(job_id="cd" * 16)

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    address = f"127.0.0.1:{port}"
    monkeypatch.setattr(client, "SUBMIT_RETRY_S", 0.1)
    servers: list[rpc.Server] = []

    def start() -> None:   # binding is what makes the port answer
        servers.append(rpc.Server("127.0.0.1", port))
        servers[0].add("Coordinator", Coordinator())
        servers[0].start()

    timer = threading.Timer(0.6, start)
    timer.start()
    try:
        with rpc.channel(address) as channel:
            assert client._submit(rpc.Stub(channel, "Coordinator"), make_job(), address) == "cd" * 16
    finally:
        timer.join()
        servers[0].stop(grace=0)
    assert (f"hetpipe: coordinator {address} unreachable: UNAVAILABLE: nothing listens at that address (not started "
            "yet, or stopped); trying again for 30s") in capsys.readouterr().err

    monkeypatch.setattr(client, "GIVE_UP_S", 0.3)
    with rpc.channel(address) as channel, pytest.raises(client.CoordinatorUnreachable, match="nothing listens"):
        client._submit(rpc.Stub(channel, "Coordinator"), make_job(), address)


@pytest.mark.parametrize("lost", ["gone", "restarted"])
def test_a_job_lost_with_its_coordinator_says_so_in_status_json(make_job, tmp_path: Path, lost: str,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """How the run ended, for `hetpipe status --job` (it found neither status.json nor the
    coordinator's address, and asked whether the run was still running)."""
    import grpc

    from hetpipe.outputs import read_status
    from launch import remote as client

    class Lost(grpc.RpcError):
        def code(self) -> grpc.StatusCode:
            return grpc.StatusCode.UNAVAILABLE if lost == "gone" else grpc.StatusCode.NOT_FOUND

        def details(self) -> str:
            return "no job ab"

    class Stub:
        def GetJob(self, request: coordinator_pb2.JobRef, timeout: float) -> coordinator_pb2.JobStatus:
            raise Lost()

    monkeypatch.setattr(client, "GIVE_UP_S", 0.2)
    raised = client.CoordinatorUnreachable if lost == "gone" else client.JobFailed
    with pytest.raises(raised) as info:
        client._follow_and_fetch(Stub(), make_job(), "ab" * 16, "127.0.0.1:9", tmp_path, quiet=True)  # type: ignore[arg-type]
    ending = read_status(tmp_path)
    assert ending is not None and (ending["state"], ending["reason"]) == ("FAILED", str(info.value))

"""A checkpoint cut is on disk before the older cuts are deleted (train.checkpoint_every): every
part of it, the manifest that says it is whole, and its folder's entry, so that a power cut in
between leaves one whole cut to --resume from. The shard is a real in-process one; the disk is
watched through the fsync calls the writers make, since a power cut cannot be staged here."""

from __future__ import annotations

import json
import os
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from coordinator import checkpoints
from hetpipe.config import ConfigError
from hetpipe.errors import JobFailed
from hetpipe import outputs, rpc, weight_files, wire
from hetpipe.v1 import ps_pb2_grpc, wire_pb2
from messages import messages
from ps_server.durability import Durability
from ps_server.servicer import ShardServicer
from ps_server.shard import Shard

pytestmark = pytest.mark.timeout(60)

SHAPES = {"l0.weight": (2, 3), "l0.bias": (3,)}


class Disk:
    """What has reached the disk, in order: ("fsync", path) and ("rmtree", path) events."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.events: list[tuple[str, Path]] = []
        real_fsync, real_rmtree = os.fsync, shutil.rmtree

        def fsync(fd: int) -> None:
            self.events.append(("fsync", Path(os.readlink(f"/proc/self/fd/{fd}"))))
            real_fsync(fd)

        def rmtree(path: Any, *args: Any, **kw: Any) -> None:
            self.events.append(("rmtree", Path(path)))
            real_rmtree(path, *args, **kw)

        monkeypatch.setattr(os, "fsync", fsync)
        monkeypatch.setattr(checkpoints.shutil, "rmtree", rmtree)

    def synced_before(self, path: Path, event: tuple[str, Path]) -> bool:
        """path was fsynced before event, under its name or the temporary one it was written under
        (write_atomically's, WeightsWriter's)."""
        before = self.events[:self.events.index(event)]
        names = {path, path.with_name(path.name + ".tmp"), path.with_name(f".{path.name}.partial")}
        return any(kind == "fsync" and where in names for kind, where in before)


@pytest.fixture
def stub(tmp_path: Path) -> Iterator[ps_pb2_grpc.ParameterServerStub]:
    """One real shard holding SHAPES for 1 VW, which has pushed waves 0 and 1."""
    server = rpc.Server("127.0.0.1", 0, workers=4)
    server.add("ParameterServer", ShardServicer(Shard(), Durability(str(tmp_path / "ps")), max_pull_wait_s=10.0))
    server.start()
    channel = rpc.channel(server.address)
    try:
        stub = ps_pb2_grpc.ParameterServerStub(channel)
        tensors = [(k, torch.randn(s)) for k, s in SHAPES.items()]
        stub.Init(iter(messages(wire.encode(tensors, init=wire_pb2.InitTag(virtual_workers=1)))), timeout=10)
        for clock in range(2):
            frames = messages(wire.encode(tensors, push=wire_pb2.PushTag(vw=0, clock=clock)))
            stub.Push(iter(frames), timeout=10)
        yield stub
    finally:
        channel.close()
        server.stop()


def test_a_cut_is_on_disk_before_the_older_cuts_go(tmp_path: Path, stub: ps_pb2_grpc.ParameterServerStub,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / "checkpoints"
    entries = {k: weight_files.Entry(k, torch.float32, s) for k, s in SHAPES.items()}
    cuts = checkpoints.Checkpoints(folder, [stub], {k: 0 for k in SHAPES}, entries, {"virtual_workers": 1, "stages_per_vw": 1})
    stage = {"weights": torch.ones(4)}
    weight_files.save_stage_state(folder, 1, 0, 0, stage)
    cuts.take(1, lead_vw=0, evicted=[], seconds=1.0)

    disk = Disk(monkeypatch)
    part = weight_files.save_stage_state(folder, 2, 0, 0, stage)
    # A stage on another host has its own checkpoints folder, which no driver fsyncs.
    assert ("fsync", folder) in disk.events, "the stage did not put its cut's folder on disk"
    cuts.take(2, lead_vw=0, evicted=[], seconds=2.0)

    new, old = outputs.cut_dir(folder, 2), outputs.cut_dir(folder, 1)
    assert checkpoints.latest(folder) == 2 and not old.exists()
    assert torch.equal(torch.load(part, weights_only=True)["weights"], stage["weights"])
    removed = ("rmtree", old)
    assert removed in disk.events
    for path in (part, new / "shard0" / outputs.SINGLE_FILE, new / checkpoints.MANIFEST):
        assert disk.synced_before(path, removed), f"{path.relative_to(folder)} was not on disk before cut 1 went"
    for where in (new, new / "shard0", folder):
        assert disk.synced_before(where, removed), f"folder {where.relative_to(tmp_path)}'s entries were not"
    # The manifest says the cut is whole: its parts were on disk before it was.
    manifest = ("fsync", new / (checkpoints.MANIFEST + ".tmp"))
    assert disk.synced_before(part, manifest) and disk.synced_before(new / "shard0" / outputs.SINGLE_FILE, manifest)


def test_a_cut_taken_again_after_a_kill_lists_no_temporary_of_the_killed_attempt(
        tmp_path: Path, stub: ps_pb2_grpc.ParameterServerStub) -> None:
    """A kill while the cut's manifest or a shard's part was being written leaves their
    temporaries: the cut taken again (a --resume from the cut before) listed them in its manifest,
    and the next --resume refused that whole cut as damaged, the older cuts gone by then. A run's
    start removes cuts without a manifest; a manifest lists no temporary either way."""
    folder = tmp_path / "checkpoints"
    entries = {k: weight_files.Entry(k, torch.float32, s) for k, s in SHAPES.items()}
    cuts = checkpoints.Checkpoints(folder, [stub], {k: 0 for k in SHAPES}, entries, {"virtual_workers": 1, "stages_per_vw": 1})
    weight_files.save_stage_state(folder, 1, 0, 0, {"weights": torch.ones(4)})
    cuts.take(1, lead_vw=0, evicted=[], seconds=1.0)
    killed = outputs.cut_dir(folder, 2)

    def killed_while_taking() -> None:
        (killed / "shard0").mkdir(parents=True)
        (killed / (checkpoints.MANIFEST + ".tmp")).write_text('{"wave": 2, "par')
        (killed / "shard0" / f".{outputs.SINGLE_FILE}.partial").write_bytes(b"\0" * 10)

    killed_while_taking()
    (folder / "cut000003").mkdir()   # killed before it wrote anything
    checkpoints.drop_incomplete(folder)   # as the resumed run starts
    assert sorted(p.name for p in folder.iterdir()) == ["cut000001"], "the whole cut kept, the killed ones gone"

    killed_while_taking()   # and were they there as it takes the cut again
    weight_files.save_stage_state(folder, 2, 0, 0, {"weights": torch.ones(4)})
    cuts.take(2, lead_vw=0, evicted=[], seconds=2.0)
    m = checkpoints.manifest(folder, 2)
    assert not [name for name in m["files"] if name.endswith((".tmp", ".partial"))], m["files"]
    checkpoints.check_files(folder, 2, m)


def test_a_cut_whose_stage_parts_are_not_in_the_folder_fails_naming_them(
        tmp_path: Path, stub: ps_pb2_grpc.ParameterServerStub) -> None:
    """A stage on a host that does not share the coordinator's folder saved its part on its own
    disk: a manifest written then would call a cut whole that no resume could load. The cut
    fails naming the parts, and writes no manifest; a VW that left saves none and is not asked for."""
    folder = tmp_path / "checkpoints"
    entries = {k: weight_files.Entry(k, torch.float32, s) for k, s in SHAPES.items()}
    cuts = checkpoints.Checkpoints(folder, [stub], {k: 0 for k in SHAPES}, entries,
                                   {"virtual_workers": 2, "stages_per_vw": 2})
    weight_files.save_stage_state(folder, 1, 0, 0, {"weights": torch.ones(4)})
    with pytest.raises(JobFailed, match=f"checkpoint of wave 1: vw0_stage1.pt, vw1_stage0.pt, vw1_stage1.pt not in "
                                        f"{outputs.cut_dir(folder, 1)} on the coordinator's host"):
        cuts.take(1, lead_vw=0, evicted=[], seconds=1.0)
    assert checkpoints.latest(folder) is None
    weight_files.save_stage_state(folder, 1, 0, 1, {"weights": torch.ones(4)})
    cuts.take(1, lead_vw=0, evicted=[1], seconds=1.0)
    assert checkpoints.latest(folder) == 1


def test_a_cut_of_another_optimizer_is_refused_and_one_from_before_it_was_recorded_is_not() -> None:
    """The stages' cuts hold their optimizer's state (sgd's momentum, adam's moments): resuming with
    another optimizer would start it from nothing. Cuts taken before the optimizer was recorded
    carry no name, and match."""
    shape = {"virtual_workers": 1, "steps": 8, "optimizer": "adam"}
    cut = {"virtual_workers": 1, "steps": 8, "optimizer": "sgd", "evicted": []}
    assert checkpoints.refusal(cut, 4, shape) == ("the checkpoint of wave 4 was taken for another job: "
                                                  "optimizer sgd there, adam now. A resumed run goes on with that job: "
                                                  "set them back, or start again with --fresh (model.init can start it "
                                                  "from a finished run's model.safetensors)")
    assert checkpoints.refusal({**cut, "optimizer": "adam"}, 4, shape) is None
    older = {k: v for k, v in cut.items() if k != "optimizer"}
    assert checkpoints.refusal(older, 4, shape) is None
    assert "steps 8 there, 9 now" in str(checkpoints.refusal(older, 4, {**shape, "steps": 9})), "the rest still counts"
    model = {"name": None, "factory": "net:build", "args": {"width": 8}}
    data = {"name": "npz", "path": "rows.npz", "eval_fraction": 0.1}
    later = {**cut, "optimizer": "adam", "model": model, "batch_size": 16, "shuffle": True, "seed": 0, "data": data}
    now = {**shape, "model": {**model, "args": {"width": 16}}, "batch_size": 32, "shuffle": True, "seed": 0,
           "data": {**data, "eval_fraction": 0.2}}
    assert str(checkpoints.refusal(later, 4, now)).startswith(
        "the checkpoint of wave 4 was taken for another job: model.args {'width': 8} there, "
        "{'width': 16} now, batch_size 16 there, 32 now, data.eval_fraction 0.1 there, 0.2 now. A resumed run goes on")


def test_a_damaged_cut_is_refused_naming_the_file_before_anything_reads_it(
        tmp_path: Path, stub: ps_pb2_grpc.ParameterServerStub) -> None:
    """A cut records its files and their sizes: one cut short or gone, or a manifest that is not
    what a cut writes, is refused as the launcher checks the cut (ConfigError, before a run
    clears an earlier one's results), and by the driver's restore (JobFailed), not met as a
    stage or the driver fails to load it, with a traceback."""
    folder = tmp_path / "checkpoints"
    entries = {k: weight_files.Entry(k, torch.float32, s) for k, s in SHAPES.items()}
    cuts = checkpoints.Checkpoints(folder, [stub], {k: 0 for k in SHAPES}, entries, {"virtual_workers": 1, "stages_per_vw": 1})
    part = weight_files.save_stage_state(folder, 1, 0, 0, {"weights": torch.ones(256)})
    cuts.take(1, lead_vw=0, evicted=[], seconds=1.0)
    m = checkpoints.manifest(folder, 1)
    assert m["files"] == {"vw0_stage0.pt": part.stat().st_size,
                          f"shard0/{outputs.SINGLE_FILE}": (part.parent / "shard0" / outputs.SINGLE_FILE).stat().st_size}
    checkpoints.check_files(folder, 1, m)
    whole = part.read_bytes()
    shard_part = part.parent / "shard0" / outputs.SINGLE_FILE
    for damage, needle in ((lambda: part.write_bytes(whole[:1000]), f"{part} holds 1000 bytes, where the cut wrote {len(whole)}"),
                           (part.unlink, f"{part} is missing"),
                           (shard_part.unlink, f"{shard_part} is missing")):
        saved = {p: p.read_bytes() for p in (part, shard_part) if p.exists()}
        damage()
        with pytest.raises(ConfigError, match="^the checkpoint of wave 1 is damaged: ") as err:
            checkpoints.check_files(folder, 1, m)
        assert needle in str(err.value)
        with pytest.raises(JobFailed, match="is damaged"):
            cuts.restore_shards(1)
        for p, data in saved.items():
            p.write_bytes(data)
    checkpoints.check_files(folder, 1, m)
    manifest = part.parent / checkpoints.MANIFEST
    text = manifest.read_text()
    for broken, needle in (('{"wave": 1, "clo', "cannot be read"), ("[]", "holds no JSON object"),
                           (text.replace('"evicted"', '"evictee"'), "evicted is missing"),
                           (text.replace('"clocks": [', '"clocks": [-1, '), "clocks is missing or not")):
        manifest.write_text(broken)
        with pytest.raises(ConfigError, match="^the checkpoint of wave 1 is damaged: ") as err:
            checkpoints.manifest(folder, 1)
        assert needle in str(err.value) and str(manifest) in str(err.value)
    manifest.write_text(text.replace('"files"', '"other"'))   # a cut from before files were recorded
    checkpoints.check_files(folder, 1, checkpoints.manifest(folder, 1))


def test_a_shard_part_that_cannot_be_read_fails_the_job_naming_it(
        tmp_path: Path, stub: ps_pb2_grpc.ParameterServerStub) -> None:
    """What no size shows (bytes overwritten in place) or a part without a key the job places on
    that shard: JobFailed naming the shard and the folder, not a crash with a traceback."""
    folder = tmp_path / "checkpoints"
    entries = {k: weight_files.Entry(k, torch.float32, s) for k, s in SHAPES.items()}
    cuts = checkpoints.Checkpoints(folder, [stub], {k: 0 for k in SHAPES}, entries, {"virtual_workers": 1, "stages_per_vw": 1})
    weight_files.save_stage_state(folder, 1, 0, 0, {"weights": torch.ones(4)})
    cuts.take(1, lead_vw=0, evicted=[], seconds=1.0)
    shard_part = outputs.cut_dir(folder, 1) / "shard0"
    more = checkpoints.Checkpoints(folder, [stub], {**{k: 0 for k in SHAPES}, "l1.weight": 0}, entries,
                                   {"virtual_workers": 1, "stages_per_vw": 1})
    with pytest.raises(JobFailed, match=f"ps shard 0's part of the checkpoint of wave 1 \\({shard_part}\\) holds no l1.weight"):
        more.restore_shards(1)
    # A value of another shape (a header edited, a part of another job's): the shard would take
    # it, and a stage fail mid-run in torch's words, far from the file.
    other = checkpoints.Checkpoints(folder, [stub], {k: 0 for k in SHAPES},
                                    {**entries, "l0.weight": weight_files.Entry("l0.weight", torch.float32, (3, 2))},
                                    {"virtual_workers": 1, "stages_per_vw": 1})
    with pytest.raises(JobFailed, match=f"ps shard 0's part of the checkpoint of wave 1 \\({shard_part}\\) holds "
                                        r"l0.weight as torch.float32 \[2, 3\], expected torch.float32 \[3, 2\]"):
        other.restore_shards(1)
    file = shard_part / outputs.SINGLE_FILE
    file.write_bytes(b"\xff" * file.stat().st_size)
    with pytest.raises(JobFailed, match=f"ps shard 0's part of the checkpoint of wave 1 \\({shard_part}\\) cannot be read: "):
        cuts.restore_shards(1)


def test_a_cut_is_taken_whole_through_a_shard_that_dies_and_comes_back(tmp_path: Path) -> None:
    """A shard killed while the driver reads its part of a cut is restarted at its address from
    its push log (the launcher does that); the cut's part is then read again from the start, with
    the values it had (O3), instead of the job failing on UNAVAILABLE."""
    def serve(port: int) -> tuple[rpc.Server, ShardServicer]:
        servicer = ShardServicer(Shard(), Durability(str(tmp_path / "ps")), max_pull_wait_s=10.0)
        servicer.restore()
        server = rpc.Server("127.0.0.1", port, workers=4)
        server.add("ParameterServer", servicer)
        server.start()
        return server, servicer

    server, _ = serve(0)
    port = int(server.address.rsplit(":", 1)[1])
    channel = rpc.channel(server.address)
    stub = ps_pb2_grpc.ParameterServerStub(channel)
    tensors = [(k, torch.randn(s)) for k, s in SHAPES.items()]
    stub.Init(iter(messages(wire.encode(tensors, init=wire_pb2.InitTag(virtual_workers=1)))), timeout=10)
    stub.Push(iter(messages(wire.encode(tensors, push=wire_pb2.PushTag(vw=0, clock=0)))), timeout=10)
    expected = {k: 2 * t for k, t in tensors}
    server.stop(0)   # dead: its push is in the log, not in a checkpoint
    back: list[rpc.Server] = []
    later = threading.Timer(1.5, lambda: back.append(serve(port)[0]))
    later.start()
    try:
        entries = {k: weight_files.Entry(k, torch.float32, s) for k, s in SHAPES.items()}
        cuts = checkpoints.Checkpoints(tmp_path / "checkpoints", [stub], {k: 0 for k in SHAPES}, entries,
                                       {"virtual_workers": 1, "stages_per_vw": 0})   # the shard's part alone
        cuts.take(1, lead_vw=0, evicted=[], seconds=1.0)
        got = load_file(outputs.cut_dir(tmp_path / "checkpoints", 1) / "shard0" / outputs.SINGLE_FILE)
        assert set(got) == set(expected) and all(torch.equal(got[k], expected[k]) for k in expected)
        assert checkpoints.latest(tmp_path / "checkpoints") == 1
        assert checkpoints.manifest(tmp_path / "checkpoints", 1)["seconds"] == 1.0   # a --resume counts on from it
    finally:
        later.join()
        channel.close()
        for s in back:
            s.stop(0)


def test_a_cut_records_what_decides_each_minibatchs_rows(make_job) -> None:
    """job_shape records the data's source and held-out share: a resume that changes either would
    train on other rows than the uninterrupted run, and is refused naming the field."""
    from coordinator.planner import make_plan

    job = make_job({"data": {"name": "digits", "eval_fraction": 0.1}, "eval": {"every": 10}})
    plan = make_plan(job)
    shape = checkpoints.job_shape(job, plan, 0)
    assert shape["data"] == {"name": "digits", "factory": None, "path": None, "args": {}, "eval_fraction": 0.1,
                             "eval_factory": None, "sha256": None}
    cut = {**shape, "evicted": []}
    for override, field in (({"eval_fraction": 0.2}, "data.eval_fraction 0.1 there, 0.2 now"),
                            ({"name": "synthetic", "args": {"rows": 64}}, "data.name digits there, synthetic now")):
        other = make_job({"data": {"name": "digits", "eval_fraction": 0.1, **override}, "eval": {"every": 10}},
                         name="other.yaml")
        refused = checkpoints.refusal(cut, 4, checkpoints.job_shape(other, make_plan(other), 0))
        assert refused is not None and field in refused, refused
    assert checkpoints.refusal(cut, 4, shape) is None


def test_a_cut_records_the_sync_mode_and_the_key_placement(make_job) -> None:
    """A cut is of a WSP run (checkpoints refuse the other modes) and its shards' parts follow
    its placement: a --resume under sync quorum (checkpoint_every 0) ran WSP's shards while
    reporting quorum, and one under another placement failed on a key its shard's part lacked.
    Both are refused; cuts from before either was recorded were WSP's, of any placement."""
    from coordinator.planner import make_plan

    def shape(parallel: dict[str, Any], name: str) -> dict[str, Any]:
        job = make_job({"parallel": {"virtual_workers": 2, "stages_per_vw": 1, "ps_shards": 2, **parallel},
                        "cluster": {"nodes": [{"name": "n0", "gpus": [{"type": "t4", "count": 2}]}]}}, name=name)
        return checkpoints.job_shape(job, make_plan(job), 2)

    cut = {**shape({}, "job.yaml"), "evicted": []}
    assert cut["sync"] == "wsp" and cut["placement"] == "default"
    quorum = shape({"sync": "quorum"}, "quorum.yaml")
    local = shape({"placement": "local"}, "local.yaml")
    assert "sync wsp there, quorum now" in str(checkpoints.refusal(cut, 4, quorum))
    assert "placement default there, local now" in str(checkpoints.refusal(cut, 4, local))
    older = {k: v for k, v in cut.items() if k not in ("sync", "placement")}
    assert "sync wsp there, quorum now" in str(checkpoints.refusal(older, 4, quorum))
    assert checkpoints.refusal(older, 4, local) is None and checkpoints.refusal(cut, 4, cut) is None


def test_a_data_file_rewritten_in_place_is_refused_and_a_cut_from_before_the_digest_is_not(
        make_job, tmp_path: Path) -> None:
    """data.path's content is part of the shape: the same name with other rows would resume the
    run on them. A cut recorded before the digest was has no data.sha256, and matches."""
    import numpy as np

    from coordinator.planner import make_plan

    rows = tmp_path / "rows.npz"
    x = np.arange(64 * 8, dtype=np.float32).reshape(64, 8)
    np.savez(rows, x=x, y=np.arange(64) % 10)
    job = make_job({"model": {"args": {"in_features": 8}}, "data": {"name": "npz", "path": str(rows)}})
    plan = make_plan(job)
    cut = {**checkpoints.job_shape(job, plan, 0), "evicted": []}
    assert checkpoints.refusal(cut, 2, checkpoints.job_shape(job, plan, 0)) is None
    np.savez(rows, x=x[::-1].copy(), y=np.arange(64) % 10)   # the same name, the rows in another order
    refused = checkpoints.refusal(cut, 2, checkpoints.job_shape(job, plan, 0))
    assert refused is not None and f"data.sha256 {cut['data']['sha256']} there" in refused, refused
    before_digests = {**cut, "data": {k: v for k, v in cut["data"].items() if k != "sha256"}}
    assert checkpoints.refusal(before_digests, 2, checkpoints.job_shape(job, plan, 0)) is None
    rows.unlink()
    with pytest.raises(ConfigError, match=rf"data.path: {rows} cannot be read: No such file or directory"):
        checkpoints.job_shape(job, plan, 0)
    # Only npz reads a file (data.path, which another source refuses): another source has no digest.
    digits = make_job({"data": {"name": "digits"}}, name="digits.yaml")
    assert checkpoints.job_shape(digits, make_plan(digits), 0)["data"]["sha256"] is None


def test_a_stage_answers_status_and_its_neighbours_while_it_writes_its_cut(make_job, monkeypatch) -> None:
    """A stage's part of a cut (weights and optimizer state, fsynced) may take a slow disk many
    seconds: the stage must keep answering Status, the driver's liveness check, whose deadline is 2
    s, and it must keep taking its neighbours' inputs. The write here waits until both were answered."""
    from stage_rig import middle_stage
    from hetpipe.v1 import stage_pb2

    real, writing, answered = weight_files.save_stage_state, threading.Event(), threading.Event()

    def held_save(*args: Any, **kwargs: Any) -> Path:
        writing.set()
        answered.wait(30)
        return real(*args, **kwargs)

    monkeypatch.setattr(weight_files, "save_stage_state", held_save)
    with middle_stage(make_job, checkpoint_every=1) as rig:
        for p in (1, 2):
            rig.stub.Forward(iter(rig.activation(p)), timeout=10)
        rig.wait_until("forwards_done", 2)
        for p in (1, 2):
            rig.stub.Backward(iter(rig.gradient(p)), timeout=10)
        assert writing.wait(10), "no cut was written"
        try:
            status = rig.stub.Status(stage_pb2.StatusRequest(), timeout=rpc.STATUS_DEADLINE_S)
            rig.stub.Forward(iter(rig.activation(3)), timeout=rpc.STATUS_DEADLINE_S)
        finally:
            answered.set()
        assert status.backwards_done == 2 and status.cut == 0   # the cut is not saved until it is on disk
        assert rig.wait_until("cut", 1).cut == 1


def test_a_coordinators_job_goes_on_from_an_unfinished_runs_cut_and_no_other(make_job: Any, tmp_path: Path,
                                                                             capsys: pytest.CaptureFixture[str],
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A coordinator's --job (compose's, k8s's) goes on from output.dir's latest cut where the
    run there did not finish, as `hetpipe run --resume` would; a finished run (summary.json), or
    --fresh (HETPIPE_FRESH once per value), starts over and deletes the cuts. A cut of another job (any
    setting other: a compose volume outlives the job that wrote it), one that records no job, or
    a damaged one refuses the start (exit 2), naming it and --fresh, and deletes nothing."""
    from coordinator.__main__ import main as coordinator_main, startup_job
    from coordinator.config import parse_args
    from coordinator.planner import make_plan

    job = make_job({"train": {"steps": 12, "checkpoint_every": 2}})
    job_file = str(tmp_path / "job.yaml")
    out = Path(job.resolve(job.output.dir))
    folder = out / outputs.CHECKPOINTS
    shape = checkpoints.job_shape(job, make_plan(job), job.parallel.started_shards)

    def cut(wave: int, **changed: Any) -> None:
        where = outputs.cut_dir(folder, wave)
        where.mkdir(parents=True)
        (where / checkpoints.MANIFEST).write_text(json.dumps({**shape, "job": checkpoints.job_record(job),
                                                              "clocks": [wave], "evicted": [], "files": {}, **changed}))

    def rows(*minibatches: int) -> None:
        outputs.append_evals(out, [{"id": i, "minibatches": m, "final": False} for i, m in enumerate(minibatches)])

    cut(2)
    cut(4)
    rows(3, 4, 5)
    (out / "ps").mkdir()
    (out / "ps" / "shard0").mkdir()
    start = startup_job(parse_args(["--job", job_file]))
    assert (start.resume_wave, start.plan is not None) == (4, True)
    assert [r["minibatches"] for r in outputs.evals_through(out, 99)] == [3, 4], "rows after the cut dropped"
    assert checkpoints.latest(folder) == 4 and not (out / "ps").exists()

    (out / outputs.SUMMARY_FILE).write_text("{}")   # that run finished: the next starts over
    start = startup_job(parse_args(["--job", job_file]))
    assert (start.resume_wave, start.plan) == (0, None)
    assert checkpoints.latest(folder) is None and not (out / outputs.SUMMARY_FILE).exists()
    cut(4)
    assert startup_job(parse_args(["--job", job_file, "--fresh"])).resume_wave == 0
    assert checkpoints.latest(folder) is None
    cut(4)   # the run --fresh started took a cut: --fresh, typed again, starts over again
    assert startup_job(parse_args(["--job", job_file, "--fresh"])).resume_wave == 0
    assert checkpoints.latest(folder) is None

    # HETPIPE_FRESH, compose's and k8s's way to say --fresh, stays in the container's environment:
    # it starts over once per value, and the restarts of the run it started go on from its cuts.
    def start(fresh: str | None, expected_wave: int) -> None:
        if fresh is None:
            monkeypatch.delenv("HETPIPE_FRESH", raising=False)
        else:
            monkeypatch.setenv("HETPIPE_FRESH", fresh)
        assert startup_job(parse_args(["--job", job_file])).resume_wave == expected_wave, fresh
        assert checkpoints.latest(folder) == (expected_wave or None)

    cut(4)
    start("1", 0)      # cuts it did not start: over
    cut(4)
    start("1", 4)      # a restart of the run it started
    cut(6)
    start("1", 6)
    start("2", 0)      # another value: over again
    cut(4)
    start(None, 4)     # a start without one goes on, and forgets the request
    start("2", 0)      # so that value starts over again
    cut(4)
    start("0", 4)      # 0: none
    start("false", 4)  # nor do words that read as no
    start("Off", 4)
    start("2", 0)
    cut(4)
    original = Path(job_file).read_text()
    assert "lr: 0.05" in original
    Path(job_file).write_text(original.replace("lr: 0.05", "lr: 0.06"))   # changed since the request: over
    start("2", 0)
    Path(job_file).write_text(original)
    monkeypatch.delenv("HETPIPE_FRESH")

    record = checkpoints.job_record(job)
    other = {**record, "train": {**record["train"], "optimizer": {**record["train"]["optimizer"], "lr": 0.5}}}
    for damage, needle in ((dict(job=other), f"{folder} holds the checkpoints of an unfinished run of another job: "
                                             "train.optimizer.lr 0.5 there, 0.05 now."),
                           (dict(job=None), "another job: the cut records no job to compare"),
                           (dict(clocks="x"), "the checkpoint of wave 4 is damaged")):
        cut(4, **damage)
        rows(3)
        assert coordinator_main(["--job", job_file, "--port", "0"]) == 2
        err = capsys.readouterr().err
        assert f"coordinator: error: --job {job_file}: " in err and needle in err, err
        assert "--fresh deletes them (compose: `HETPIPE_FRESH=$(date +%s) docker compose up`" in err, err
        assert "--resume" not in err, err
        assert checkpoints.latest(folder) == 4 and (out / "eval.jsonl").exists(), "a refused start deletes nothing"
        shutil.rmtree(folder)


def test_a_job_with_nm_auto_goes_on_from_its_own_cuts(make_job) -> None:
    """A cut records the job as planned (nm the planner's number); the job file says auto. That is
    no other job (the cut's shape compares the number); a fixed nm that differs is."""
    from hetpipe.config import resolve

    job = make_job({"parallel": {"nm": "auto"}, "train": {"checkpoint_every": 2}})
    record = {"job": checkpoints.job_record(resolve(job, 3))}
    assert checkpoints.changes(record, job) == []
    fixed = make_job({"parallel": {"nm": 2}, "train": {"checkpoint_every": 2}}, name="fixed.yaml")
    assert checkpoints.changes(record, fixed) == ["parallel.nm 3 there, 2 now"]


def test_only_this_starts_marks_say_a_stage_shares_the_folder(tmp_path: Path) -> None:
    """A stage proves it sees the checkpoints folder by writing its mark, named with this start's
    nonce: an earlier start's stage, still loading, that writes its mark after the marks were
    cleared neither passes for one of this start's nor hides the one this start's wrote."""
    cuts = checkpoints.Checkpoints(tmp_path / "checkpoints", [], {}, {}, {"virtual_workers": 2, "stages_per_vw": 1})
    cuts.prepare()
    earlier = cuts.mark
    cuts.prepare()   # the next start: the earlier start's stage writes its mark late
    assert cuts.mark and cuts.mark != earlier
    outputs.shared_mark_path(cuts.folder, 0, 0, cuts.mark).write_text("stage 0 of vw 0\n")
    for vw in (0, 1):   # late, after this start's stage 0 of vw 0 wrote its own
        outputs.shared_mark_path(cuts.folder, vw, 0, earlier).write_text(f"stage 0 of vw {vw}\n")
    assert cuts.unshared() == [(1, 0)]
    assert not list(cuts.folder.glob("shared_vw*"))   # cleared for the next check
    assert cuts.unshared() == [(0, 0), (1, 0)]


def test_a_cut_past_wave_999999_is_found_and_replaces_the_one_before(tmp_path: Path) -> None:
    """cut_dir pads to six digits: the cut of wave 1,000,000 has seven. The name check took six
    only, so that cut was written, the one before it removed as superseded, and --resume found
    neither (train.steps goes up to 10**9)."""
    folder = tmp_path / "checkpoints"
    cuts = checkpoints.Checkpoints(folder, [], {}, {}, {"virtual_workers": 1, "stages_per_vw": 1})
    cuts.prepare()
    for wave in (999_999, 1_000_000):
        part = outputs.stage_state_path(folder, wave, 0, 0)
        part.parent.mkdir(parents=True, exist_ok=True)
        part.write_bytes(b"state")   # the stage's part, as save_stage_state leaves it
        cuts.take(wave, 0, [], 1.0)
        assert checkpoints.latest(folder) == wave
    assert sorted(p.name for p in folder.glob("cut*")) == ["cut1000000"]
    assert outputs.cut_dir(folder, 1_000_000) in list(outputs.written(tmp_path)), "--fresh clears it"

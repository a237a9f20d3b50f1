"""What a run leaves in output.dir (hetpipe/outputs.py): strict JSON, and a folder checked before
any process starts."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import pytest

from hetpipe import outputs, weight_files
from hetpipe.config import ConfigError


def _strict(text: str) -> object:
    def refuse(constant: str) -> None:
        raise AssertionError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


def test_summary_and_evaluations_never_hold_nan_or_infinity(tmp_path: Path) -> None:
    """NaN and infinities become null at any depth: DESIGN §8's readers parse strict JSON."""
    fields = {"steps": 3, "final_loss": math.nan, "eval_loss": math.inf, "eval_accuracy": 0.5,
              "plan": [{"vw": 0, "predicted": -math.inf}], "processes": {"stage 0": {"peak": math.nan}}}
    written = outputs.write_summary(tmp_path, fields)
    summary = _strict((tmp_path / "summary.json").read_text())
    assert summary == written == {"steps": 3, "final_loss": None, "eval_loss": None, "eval_accuracy": 0.5,
                                  "plan": [{"vw": 0, "predicted": None}], "processes": {"stage 0": {"peak": None}}}
    outputs.append_evals(tmp_path, [{"id": 1, "loss": math.nan, "accuracy": 0.1}])
    assert [_strict(line) for line in (tmp_path / "eval.jsonl").read_text().splitlines()] == [
        {"id": 1, "loss": None, "accuracy": 0.1}]


def test_a_resume_keeps_the_rows_before_its_cut_in_one_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A --resume's eval.jsonl: the rows up to its cut, put in place of the old in one step. The
    start removed eval.jsonl and appended the kept rows after, so a kill in between lost the rows
    the resumed run does not evaluate again."""
    outputs.append_evals(tmp_path, [{"id": i, "minibatches": 4 * i, "final": False} for i in (1, 2, 3)])
    kept = outputs.evals_through(tmp_path, 8)
    gone = []   # the file is never without the kept rows: no unlink, one rename
    real_unlink = Path.unlink
    monkeypatch.setattr(Path, "unlink", lambda self, **kw: (gone.append(self.name), real_unlink(self, **kw)))
    outputs.start_local(tmp_path, keep_checkpoints=True, evals=kept)   # a resume's start
    assert "eval.jsonl" not in gone
    assert [row["id"] for row in outputs.evals_through(tmp_path, 99)] == [1, 2]
    outputs.start_local(tmp_path, keep_checkpoints=True, evals=[])   # one from before any evaluation
    assert not (tmp_path / "eval.jsonl").exists()


def test_a_file_a_command_is_told_to_write_replaces_no_link_and_leaves_no_temporary(tmp_path: Path) -> None:
    """`hetpipe trace -o link.json` replaced the link (and, as root, -o /dev/full the device) with a
    file; -o naming a folder left a .tmp beside it."""
    target = tmp_path / "target.json"
    (tmp_path / "link.json").symlink_to(target)
    outputs.write_named(tmp_path / "link.json", "through\n")
    assert (tmp_path / "link.json").is_symlink() and target.read_text() == "through\n"
    (tmp_path / "folder").mkdir()
    with pytest.raises(IsADirectoryError):
        outputs.write_named(tmp_path / "folder", "x")
    outputs.write_named(tmp_path / "new" / "plain.json", "first\n")
    outputs.write_named(tmp_path / "new" / "plain.json", "second\n")
    assert (tmp_path / "new" / "plain.json").read_text() == "second\n"
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["folder", "link.json", "new", "plain.json", "target.json"]
    with pytest.raises(NotADirectoryError) as err:   # mkdir said only "File exists"
        outputs.write_named(tmp_path / "target.json" / "x.json", "x")
    assert err.value.filename == str(tmp_path / "target.json") and err.value.strerror == "a file is in the way of that folder"


def test_every_trace_line_is_strict_json(tmp_path: Path) -> None:
    """A diverged stage's trace held bare NaN, which JSON.parse and other strict readers refuse;
    eval.jsonl and summary.json were strict already."""
    from ps_server.trace import ShardTrace
    from stage_worker.trace import MinibatchTrace

    stage = MinibatchTrace(str(tmp_path / "vw0_stage1.jsonl"), 0, 1)
    stage.forward(1, fwd_start=0.0)
    stage.commit(1, loss=math.nan, lr=math.inf)
    stage.close()
    shard = ShardTrace(str(tmp_path))
    shard.open(0, append=False)
    shard.record("push", 0, 1, 0.0, 1.0, norm=math.nan)
    shard.flush()
    rows = [_strict(line) for path in (tmp_path / "vw0_stage1.jsonl", tmp_path / "ps" / "shard0.jsonl")
            for line in path.read_text().splitlines()]
    assert rows[0]["loss"] is None and rows[0]["lr"] is None and rows[1]["norm"] is None, rows


def test_a_restarted_shards_trace_ends_its_first_lifes_cut_line_before_its_own(tmp_path: Path) -> None:
    """A shard killed with -9 mid-line: the restarted one's first row went onto that part-line, and
    `hetpipe trace` could read neither."""
    from hetpipe.timeline import _rows
    from ps_server.trace import ShardTrace, trace_path

    path = trace_path(tmp_path, 0)
    path.parent.mkdir()
    path.write_text('{"shard": 0, "event": "push", "vw": 0, "clock": 0, "start": 1.0, "end": 2.0}\n{"shard": 0, "ev')
    shard = ShardTrace(str(tmp_path))
    shard.open(0, append=True)
    shard.record("push", 1, 0, 3.0, 4.0)
    shard.flush()
    assert [(r["vw"], r["start"]) for r in _rows(path)] == [(0, 1.0), (1, 3.0)]
    whole = ShardTrace(str(tmp_path))   # a file that ends its last line gets no blank one
    path.write_text('{"shard": 0, "event": "push", "vw": 0, "clock": 0, "start": 1.0, "end": 2.0}\n')
    whole.open(0, append=True)
    whole.record("push", 1, 0, 3.0, 4.0)
    whole.flush()
    assert len(path.read_text().splitlines()) == 2


def test_an_output_dir_that_can_be_made_passes_and_nothing_is_left(tmp_path: Path) -> None:
    outputs.check_dir(tmp_path / "a" / "b")
    outputs.check_dir(tmp_path)
    assert list(tmp_path.iterdir()) == [], "the check creates nothing and leaves no probe"


def test_an_output_dir_under_a_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("x")
    for target in (tmp_path / "f", tmp_path / "f" / "out" / "deeper"):
        with pytest.raises(ConfigError, match=rf"^output\.dir: {target}: {tmp_path}/f is a file$"):
            outputs.check_dir(target)


def _tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) + ("/" if p.is_dir() else "") for p in root.rglob("*"))


def test_a_fresh_start_removes_what_runs_write_and_nothing_else(tmp_path: Path) -> None:
    """By name: a run's results, shard state, cuts, logs and traces; the user's files beside them
    stay, and so do the folders that hold them. Folders left empty go."""
    ours = ["model.safetensors", "model-00001-of-00002.safetensors", "summary.json", "eval.jsonl", "trace.json",
            ".model.safetensors.partial", ".model-00002-of-00003.safetensors.partial", "ps/shard0/000000000001.log", "checkpoints/cut000004/manifest.json", "checkpoints/shared_vw0_stage1.0a1b",
            "logs/stage_worker_0.log", "logs/ps_server_1.log", "logs/ddp_rank1.log", "logs/torch-pipeline_rank0.log", "trace/vw0_stage1.jsonl",
            "trace/acked_vw1_stage0.pt", "trace/sync/vw0_stage0.jsonl", "trace/ps/shard0.jsonl"]
    theirs = ["notes.md", ".notes.md.partial", ".model.bin.partial", "model.bin", "model.pt", "model-best-of-3.safetensors", "checkpoints/epoch10.pt", "checkpoints/cut_best/w.pt",
              "checkpoints/cut4/manifest.json", "logs/train.log", "logs/stage_worker.log", "trace/mine.jsonl",
              "ps/shard0.txt"]
    for name in ours + theirs:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(name)
    assert sorted(str(p.relative_to(tmp_path)) for p in outputs.written(tmp_path)) == sorted(
        ["model.safetensors", "model-00001-of-00002.safetensors", "summary.json", "eval.jsonl", "trace.json",
         ".model.safetensors.partial", ".model-00002-of-00003.safetensors.partial", "ps/shard0", "checkpoints/cut000004", "checkpoints/shared_vw0_stage1.0a1b", "logs/stage_worker_0.log", "logs/ps_server_1.log", "logs/ddp_rank1.log",
         "logs/torch-pipeline_rank0.log", "trace/vw0_stage1.jsonl",
         "trace/acked_vw1_stage0.pt", "trace/sync/vw0_stage0.jsonl", "trace/ps/shard0.jsonl"])
    outputs.start_fresh(tmp_path, keep_checkpoints=True, folders=outputs.WRITTEN)
    assert _tree(tmp_path) == sorted(["checkpoints/", "checkpoints/cut000004/", "checkpoints/cut000004/manifest.json",
                                      "checkpoints/shared_vw0_stage1.0a1b", "checkpoints/cut_best/", "checkpoints/cut_best/w.pt", "checkpoints/cut4/",
                                      "checkpoints/cut4/manifest.json", "checkpoints/epoch10.pt", "logs/",
                                      "logs/stage_worker.log", "logs/train.log", "model-best-of-3.safetensors",
                                      ".model.bin.partial", ".notes.md.partial", "model.bin", "model.pt", "notes.md", "ps/",
                                      "ps/shard0.txt", "trace/", "trace/mine.jsonl"])
    outputs.start_fresh(tmp_path, keep_checkpoints=False, folders=outputs.WRITTEN)
    assert "checkpoints/cut000004/" not in _tree(tmp_path) and "checkpoints/epoch10.pt" in _tree(tmp_path)
    assert "checkpoints/shared_vw0_stage1.0a1b" not in _tree(tmp_path)
    for name in theirs:
        (tmp_path / name).unlink()
    outputs.start_fresh(tmp_path, keep_checkpoints=False, folders=outputs.WRITTEN)
    assert _tree(tmp_path) == ["checkpoints/", "checkpoints/cut4/", "checkpoints/cut_best/"], \
        "only the folders a run writes are removed once empty"


def test_a_baseline_run_leaves_nothing_of_an_earlier_hetpipe_run_to_pass_for_its_own(tmp_path: Path) -> None:
    """A ddp run into a HetPipe run's folder: the old trace made `hetpipe trace` draw the old run,
    and its status.json made `hetpipe status --job` report the old run's end beside the new rate.
    Its checkpoints stay (only a HetPipe run's --fresh removes them)."""
    from baselines.common import prepare_out_dir
    from hetpipe.config import parse_job

    old = ["model.safetensors", "summary.json", "eval.jsonl", "status.json", "prometheus_targets.json",
           "coordinator.address", "coordinator.job", "trace/vw0_stage0.jsonl", "trace/sync/vw0_stage0.jsonl",
           "trace/ps/shard0.jsonl", "logs/stage_worker_0.log", "ps/shard0/000000000001.log",
           "checkpoints/cut000004/manifest.json", "notes.md"]
    for name in old:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(name)
    job = parse_job({"model": {"name": "mlp"}, "parallel": {"mode": "ddp", "virtual_workers": 2},
                     "output": {"dir": str(tmp_path)}})
    assert prepare_out_dir(job) == tmp_path
    assert _tree(tmp_path) == ["checkpoints/", "checkpoints/cut000004/", "checkpoints/cut000004/manifest.json", "notes.md"]


def test_a_file_the_job_reads_is_refused_where_a_fresh_start_would_remove_it(tmp_path: Path) -> None:
    for name in ["model.safetensors", "checkpoints/cut000004/shard0/model.safetensors", "init/w.safetensors"]:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(name)
    with pytest.raises(ConfigError, match=r"^model.init: \S+/model.safetensors is an earlier run's output in output.dir"):
        outputs.check_reads(tmp_path, {"model.init": tmp_path / "model.safetensors"}, folders=())
    cut = tmp_path / "checkpoints/cut000004/shard0/model.safetensors"
    with pytest.raises(ConfigError, match=r"^data.path: "):
        outputs.check_reads(tmp_path, {"data.path": cut})
    outputs.check_reads(tmp_path, {"data.path": cut}, keep_checkpoints=True)   # --resume keeps the cuts
    outputs.check_reads(tmp_path, {"model.init": tmp_path / "init/w.safetensors"})
    outputs.check_reads(tmp_path, {"model.init": tmp_path / "elsewhere.pt"})   # none yet: preflight names it


def test_one_run_at_a_time_holds_an_output_dir(tmp_path: Path) -> None:
    """A second holder is refused, naming the first's pid; the lock and its file go with their
    holder, and a killed holder's file (no lock on it) does not stand in the way."""
    out = tmp_path / "new" / "out"
    with outputs.locked(out):
        with pytest.raises(ConfigError, match=rf"output.dir {out} is in use by another hetpipe run \(pid {os.getpid()}\)"):
            with outputs.locked(out):
                pass
    assert not (out / outputs.LOCK_FILE).exists(), "a run's output.dir holds its results alone"
    (out / outputs.LOCK_FILE).write_text("12345\n")  # as a killed holder leaves it: no lock on it
    with outputs.locked(out):
        assert (out / outputs.LOCK_FILE).read_text() == f"{os.getpid()}\n"


def _open_under(folder: Path) -> list[str]:
    """What this process's descriptors hold open in folder (deleted files too): not a count of
    all of them, which threads left by earlier tests open and close meanwhile."""
    import os

    held = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:   # closed since it was listed
            continue
        if target.startswith(f"{folder}/"):
            held.append(target)
    return held


def test_a_weights_writer_whose_stream_fails_leaves_no_file_or_descriptor(tmp_path: Path) -> None:
    """A long-lived coordinator writes the weights of job after job: one whose stream broke must
    not keep a descriptor open or a full-size partial file in the folder."""

    import torch

    entries = [weight_files.Entry("a", torch.float32, (4,)), weight_files.Entry("b", torch.float32, (1000,))]
    with pytest.raises(ConnectionError):
        with weight_files.WeightsWriter(tmp_path, entries, 64) as writer:   # two files: "b" alone in one
            writer.write("a", 0, torch.ones(4).numpy().tobytes())
            raise ConnectionError("the shard went away")
    assert list(tmp_path.iterdir()) == [] and not _open_under(tmp_path)
    with pytest.raises(ValueError, match=r"the weights of \['b'\] did not all arrive"):
        with weight_files.WeightsWriter(tmp_path, entries, 64) as writer:
            writer.write("a", 0, torch.ones(4).numpy().tobytes())
            writer.close()
    assert list(tmp_path.iterdir()) == [] and not _open_under(tmp_path)
    with weight_files.WeightsWriter(tmp_path, entries, 64) as writer:
        writer.write("a", 0, torch.ones(4).numpy().tobytes())
        writer.write("b", 0, torch.zeros(1000).numpy().tobytes())
        assert [p.name for p in writer.close()] == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert torch.equal(weight_files.read_weights(tmp_path)["a"], torch.ones(4))
    assert torch.equal(weight_files.read_weights(str(tmp_path))["b"], torch.zeros(1000)), "a path as a str, too"


def test_weights_are_declared_as_the_stages_hold_them_and_checked_as_they_arrive(tmp_path: Path) -> None:
    """The stages hold every floating tensor in train.dtype whatever the factory made it
    (models.build_layers), so each entry is declared so: a float32 job's bf16 buffer is float32
    (declared bf16, as the factory made it, the run failed after training, at the write); a
    stream sending a key in another dtype or shape fails naming it; a writer that cannot open its
    files leaves none behind."""

    import torch

    from hetpipe import wire
    from hetpipe.errors import JobFailed

    model = torch.nn.Sequential(torch.nn.Linear(3, 2))
    model[0].register_buffer("scale", torch.ones(2, dtype=torch.bfloat16))
    assert weight_files.entries(model, torch.float32)["0.scale"].dtype == torch.float32
    assert weight_files.entries(model, torch.float64)["0.scale"].dtype == torch.float64
    assert weight_files.entries(model.half(), torch.float32)["0.weight"].dtype == torch.float32

    entries = list(weight_files.entries(model, torch.bfloat16).values())
    with pytest.raises(JobFailed, match=r"stage 1: sent weights '0.scale' as torch.float32 \[2\], expected "
                                        r"torch.bfloat16 \[2\]"):
        with weight_files.WeightsWriter(tmp_path, entries, 1 << 20) as writer:
            frames = wire.encode([("0.scale", torch.ones(2))])
            weight_files.stream_into(writer, lambda: iter(frames), "stage 1")
    assert list(tmp_path.iterdir()) == [] and not _open_under(tmp_path)

    unwritable = [weight_files.Entry("a", torch.float32, (4,)), weight_files.Entry("b", torch.float32, (1000,))]
    (tmp_path / ".model-00002-of-00002.safetensors.partial").mkdir()   # the second file cannot be opened
    with pytest.raises(IsADirectoryError):
        weight_files.WeightsWriter(tmp_path, unwritable, 64)
    assert [p.name for p in tmp_path.iterdir()] == [".model-00002-of-00002.safetensors.partial"]
    assert not _open_under(tmp_path)


def test_a_write_is_tried_again_while_its_shard_is_gone_and_no_longer_once_the_job_stops() -> None:
    """weight_files.through_restarts: UNAVAILABLE (a shard being restarted) is read again; any
    other code, time up, or the job's stop ends it with the failure."""
    import threading

    import grpc

    def failing(codes: list[grpc.StatusCode]) -> Any:
        calls: list[int] = []

        def write() -> str:
            calls.append(1)
            if codes:
                code = codes.pop(0)
                raise weight_files.ReadFailed(f"ps shard 0: reading weights failed: {code.name}", code)
            return "written"
        return write, calls

    write, calls = failing([grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNAVAILABLE])
    assert weight_files.through_restarts(write, "the final weights", closing=threading.Event()) == "written"
    assert len(calls) == 3
    write, calls = failing([grpc.StatusCode.DEADLINE_EXCEEDED])
    with pytest.raises(weight_files.ReadFailed, match="DEADLINE_EXCEEDED"):
        weight_files.through_restarts(write, "the final weights")
    assert len(calls) == 1, "a shard that hangs is not read again"
    stopped = threading.Event()
    stopped.set()
    write, calls = failing([grpc.StatusCode.UNAVAILABLE] * 5)
    with pytest.raises(weight_files.ReadFailed, match="UNAVAILABLE"):
        weight_files.through_restarts(write, "the final weights", closing=stopped)
    assert len(calls) == 1, "a job being stopped does not wait for its shards"
    write, calls = failing([grpc.StatusCode.UNAVAILABLE] * 5)
    with pytest.raises(weight_files.ReadFailed):
        weight_files.through_restarts(write, "the final weights", give_up_s=0.0)
    assert len(calls) == 1

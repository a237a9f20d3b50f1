"""The job file schema (hetpipe/config.py): DESIGN §8's example, error messages, JSON round trip."""

from __future__ import annotations

import copy
import datetime
import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from hetpipe.cluster import EmulateConfig, GpuGroup, NodeConfig
from hetpipe.parallelism import MAX_STAGES, MAX_VIRTUAL_WORKERS, ParallelConfig
from hetpipe.training import OptimizerConfig
from hetpipe.config import (
    ConfigError,
    JobLoader,
    DataConfig,
    JobConfig,
    OutputConfig,
    ResolvedJob,
    TrainConfig,
    load_job,
    parse_job,
    resolve,
    with_overrides,
    with_setting,
)

# DESIGN §8, verbatim: this is the public contract.
DESIGN_EXAMPLE = """\
cluster:
  nodes:                                    # one entry per host
    - {name: n0, gpus: [{type: titan-v, count: 2}]}
    - {name: n1, gpus: [{type: rtx-2060, count: 2}]}
  emulate: {time_scale: 0.05}               # omit to use real devices; present = emulated GPU types (DESIGN §5)
model:
  name: mlp                                 # zoo: mlp, a ResNet-style CNN, a GPT-style transformer, ...
  args: {in_features: 64, hidden: [256, 256, 256], num_classes: 10}
  init: null                                # optional path to a state_dict (torch.save) to start from
data:
  name: npz                                 # also: synthetic, and a dataset shipped inside a PyPI package
  path: data.npz                            # arrays x (float) and y (int64 labels or float targets)
  batch_size: 32
  shuffle: false
train:
  steps: 300                                # minibatches per virtual worker
  loss: cross_entropy                       # or mse
  optimizer: {name: sgd, lr: 0.05, momentum: 0.0}   # also adam
  dtype: float32                            # float64 allowed (the oracles use it)
  seed: 0
parallel:
  virtual_workers: 2
  stages_per_vw: 2
  policy: ED                                # NP | ED | HD | auto
  nm: 2                                     # or auto
  D: 1
  ps_shards: 2
  placement: default                        # or local
  mode: hetpipe                             # or ddp (Horovod-style allreduce baseline), torch-pipeline (torch.distributed.pipelining baseline)
  schedule: hetpipe                         # or gpipe, 1f1b, nf1b
  sync: wsp                                 # later: quorum, elastic
output:
  dir: runs/quickstart
  trace: true
"""


@pytest.fixture
def design_job(tmp_path: Path) -> JobConfig:
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "data.npz", x=rng.standard_normal((100, 64)), y=rng.integers(0, 10, 100))
    path = tmp_path / "job.yaml"
    path.write_text(DESIGN_EXAMPLE)
    return load_job(path)


def test_design_example_parses(design_job: JobConfig, tmp_path: Path) -> None:
    job = design_job
    assert job.cluster is not None
    assert job.cluster.nodes == (
        NodeConfig("n0", (GpuGroup("titan-v", 2),)),
        NodeConfig("n1", (GpuGroup("rtx-2060", 2),)),
    )
    assert job.cluster.emulate == EmulateConfig(time_scale=0.05)
    assert job.model.name == "mlp"
    assert dict(job.model.args) == {"in_features": 64, "hidden": [256, 256, 256], "num_classes": 10}
    assert job.model.init is None
    assert (job.data.name, job.data.path, job.data.batch_size, job.data.shuffle) == ("npz", "data.npz", 32, False)
    assert job.resolve("data.npz") == tmp_path / "data.npz", "relative paths resolve next to the job file"
    assert job.resolve("data.npz").exists()
    t = job.train
    assert (t.steps, t.loss, t.dtype, t.seed) == (300, "cross_entropy", "float32", 0)
    assert (t.optimizer.name, t.optimizer.lr, t.optimizer.momentum) == ("sgd", 0.05, 0.0)
    p = job.parallel
    assert (p.virtual_workers, p.stages_per_vw, p.policy, p.nm, p.D, p.ps_shards) == (2, 2, "ED", 2, 1, 2)
    assert (p.placement, p.mode, p.schedule, p.sync) == ("default", "hetpipe", "hetpipe", "wsp")
    assert (job.output.dir, job.output.trace) == ("runs/quickstart", True)


def test_omitted_cluster_and_defaults(tmp_path: Path) -> None:
    job = parse_job({"model": {"name": "mlp"}})
    assert job.cluster is None, "no cluster: this machine's own devices, not emulated"
    assert job.data.name == "synthetic" and job.train.optimizer == OptimizerConfig()
    assert job.parallel.nm == 2 and job.parallel.D == 0 and job.parallel.virtual_workers == 1
    assert parse_job({"model": {"name": "mlp"}, "parallel": {"nm": "auto"}}).parallel.nm == "auto"


def test_cluster_without_emulate_uses_real_devices() -> None:
    job = parse_job({"model": {"name": "mlp"}, "parallel": {"stages_per_vw": 1},
                     "cluster": {"nodes": [{"name": "a", "gpus": [{"type": "t4"}]}]}})
    assert job.cluster is not None and job.cluster.emulate is None
    assert job.cluster.nodes[0].gpus == (GpuGroup("t4", 1),)


def base() -> dict[str, Any]:
    return yaml.safe_load(DESIGN_EXAMPLE)


def set_key(raw: dict[str, Any], dotted: str, value: Any) -> dict[str, Any]:
    raw = copy.deepcopy(raw)
    *parents, last = dotted.split(".")
    node = raw
    for name in parents:
        node = node.setdefault(name, {})
    node[last] = value
    return raw


# (key, bad value, words of what was expected)
BAD_VALUES = [
    ("parallel.nm", -1, "integer >= 1"),
    ("parallel.nm", 0, "integer >= 1"),
    ("parallel.nm", True, "integer >= 1"),
    ("parallel.nm", 2.5, "integer >= 1"),
    ("parallel.D", -1, "integer >= 0"),
    ("parallel.virtual_workers", 0, "integer >= 1"),
    ("parallel.stages_per_vw", "two", "integer >= 1"),
    ("parallel.ps_shards", 0, "integer >= 1"),
    ("parallel.policy", "XX", "one of NP, ED, HD, auto"),
    ("parallel.placement", "remote", "one of default, local"),
    ("parallel.mode", "horovod", "one of hetpipe, ddp, torch-pipeline"),
    ("parallel.schedule", "zb-v", "one of hetpipe, gpipe, 1f1b, nf1b"),
    ("parallel.microbatches", 0, "integer >= 1"),
    ("parallel.sync", "gossip", "one of wsp, quorum, elastic"),
    ("train.optimizer.name", "rmsprop", "one of sgd, adam"),
    ("train.optimizer.lr", -0.1, "number >= 0"),
    ("train.optimizer.momentum", "high", "number >= 0"),
    ("train.optimizer.betas", [0.9], "two numbers in [0, 1)"),
    ("train.optimizer.betas", [0.9, 1.0], "two numbers in [0, 1)"),
    ("train.steps", 0, "integer >= 1"),
    ("train.seed", -1, "integer >= 0"),
    ("train.dtype", "float16", "one of float32, float64"),
    ("train.loss", "hinge", "one of cross_entropy, mse"),
    ("data.name", "imagenet", "one of synthetic, npz, digits"),
    ("data.batch_size", 0, "integer >= 1"),
    ("data.shuffle", "yes", "true or false"),
    ("data.path", None, "a non-empty string"),
    ("data.path", "", "a non-empty string"),
    ("model.name", "", "a non-empty string"),
    ("model.args", [1, 2], "a mapping"),
    ("model.init", 5, "null or a path"),
    ("model.init", "w\0.safetensors", "null or a path"),   # Path.resolve() raises on a NUL
    ("data.path", "d\0.npz", "a non-empty string without NUL bytes"),
    ("output.dir", "out\0", "a non-empty string without NUL bytes"),
    ("output.trace", 1, "true or false"),
    ("output.profile.steps", 0, "integer >= 1"),
    ("output.profile.after", -1, "integer >= 0"),
    ("output.profile.steps", 10**6, "at most train.steps - after"),   # the profiled minibatches are trained
    ("output.dir", "", "a non-empty string"),
    ("cluster.nodes", [], "a non-empty list of nodes"),
    ("cluster.nodes", None, "a non-empty list of nodes"),
    ("cluster.emulate.time_scale", 0, "a finite number >= 1e-09"),
    ("train.optimizer.lr", float("nan"), "a finite number >= 0"),
    ("train.optimizer.lr", float("inf"), "a finite number >= 0"),
    ("cluster.emulate.forward_seconds", 1e300, "<= 3600"),
    ("parallel.virtual_workers", 10**18, "<= 1024"),
    ("parallel.nm", 10**6, "<= 1024"),
    ("train.steps", 10**12, "<= 1000000000"),
    ("parallel", [1], "a mapping"),
    # The job travels as JSON: args that would not come back the same (plan passed, run crashed).
    ("model.args", {"collected": datetime.date(2024, 1, 1)}, "a mapping of JSON values"),
    ("data.args", {"x": float("nan")}, "a mapping of JSON values"),
    ("model.args", {1: 2}, "a mapping of JSON values"),
]


@pytest.mark.parametrize(("key", "value", "expected"), BAD_VALUES, ids=[f"{k}={v!r}" for k, v, _ in BAD_VALUES])
def test_bad_value_names_key_value_and_expectation(key: str, value: Any, expected: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_job(set_key(base(), key, value))
    message = str(err.value)
    assert message.startswith(f"{key}:"), message
    assert repr(value) in message, message
    assert expected in message, message


@pytest.mark.parametrize(
    ("raw_path", "value"),
    [
        ("cluster.nodes", [{"name": "a", "gpus": []}]),
        ("cluster.nodes", [{"name": "a", "gpus": [{"type": "t4", "count": 0}]}]),
        ("cluster.nodes", [{"name": "a", "gpus": [{"type": "t4"}]}, {"name": "a", "gpus": [{"type": "t4"}]}]),
    ],
)
def test_bad_nodes_name_the_node(raw_path: str, value: Any) -> None:
    with pytest.raises(ConfigError, match=r"^cluster\.nodes\["):
        parse_job(set_key(base(), raw_path, value))


@pytest.mark.parametrize(
    ("key", "value"),
    [("train.optimizer.betas", ["a", 0.5]), ("train.optimizer.betas", [None, 0.5])],
)
def test_non_numeric_list_items_are_config_errors(key: str, value: Any) -> None:
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        parse_job(set_key(base(), key, value))


@pytest.mark.parametrize(("overrides", "message"), [
    ({"parallel": {"schedule": "gpipe", "nm": 2}}, "parallel.nm: 2, but schedule gpipe flushes the pipeline"),
    ({"parallel": {"schedule": "1f1b", "nm": 4}}, "set nm 1"),
    ({"parallel": {"schedule": "gpipe", "mode": "ddp"}}, "parallel.schedule: gpipe needs a pipeline"),
    ({"parallel": {"mode": "ddp"}, "train": {"precision": "fp16"}}, "fp16 needs loss scaling"),
    ({"parallel": {"mode": "torch-pipeline"}, "train": {"precision": "fp16"}}, "parallel.mode torch-pipeline does not"),
    ({"parallel": {"schedule": "nf1b", "mode": "torch-pipeline"}}, "nf1b runs on HetPipe's own stages"),
    ({"parallel": {"schedule": "nf1b", "microbatches": 5}}, "parallel.microbatches: 5 must divide data.batch_size"),
    ({"parallel": {"schedule": "nf1b", "microbatches": 2}, "train": {"precision": "fp16"}},
     "train.precision: not with parallel.schedule nf1b yet (fp16's loss scaling is per minibatch, which gpipe and "
     "1f1b do)"),
    ({"parallel": {"schedule": "nf1b", "nm": 2, "microbatches": 2}, "train": {"checkpoint_every": 2}},
     "train.checkpoint_every: not with parallel.schedule nf1b yet (a cut of its minibatches in flight is not built)"),
    ({"parallel": {"schedule": "nf1b", "nm": 2, "microbatches": 2}, "train": {"max_grad_norm": 1.0}},
     "train.max_grad_norm: not with parallel.schedule nf1b yet (the stages agree on it per minibatch, which gpipe "
     "and 1f1b do)"),
    ({"train": {"max_grad_norm": -1.0}}, "train.max_grad_norm: expected a finite number >= 0.0, got -1.0"),
    ({"train": {"optimizer": {"name": "adam", "eps": 0}}}, "train.optimizer.eps: expected at least 1e-30 for adam"),
    ({"train": {"optimizer": {"name": "adamw", "eps": 1e-40}}}, "train.optimizer.eps: expected at least 1e-30 for adamw"),
    ({"train": {"max_grad_norm": 1e-9}}, "train.max_grad_norm: expected 0 (no clipping) or at least 1e-06, got 1e-09"),
    ({"parallel": {"microbatches": 2}}, "parallel.microbatches: 2 applies to the schedules gpipe, 1f1b and nf1b"),
    ({"parallel": {"mode": "torch-pipeline", "microbatches": 3}}, "must divide data.batch_size 32"),
    ({"parallel": {"mode": "torch-pipeline", "schedule": "1f1b", "stages_per_vw": 4, "microbatches": 2}},
     "Schedule1F1B needs at least one micro-batch per stage"),
    ({"parallel": {"virtual_workers": 3, "stages_per_vw": 2},
      "cluster": {"nodes": [{"name": "a", "gpus": [{"type": "t4", "count": 5}]}]}},
     "3 virtual workers x 2 stages need 6 GPUs, the cluster has 5"),
    ({"train": {"precision": "bf16", "dtype": "float64"}}, "train.precision: bf16 computes in 16 bits"),
    ({"eval": {"every": 10}}, "eval: evaluation needs held-out data"),
    ({"data": {"eval_fraction": 0.2}}, "data.eval_fraction: rows held out, but no eval section evaluates them"),
    ({"data": {"name": None, "path": None, "factory": "rows:train", "eval_factory": "rows:held"}},
     "data.eval_factory: held-out data, but no eval section evaluates it"),
    ({"parallel": {"mode": "torch-pipeline"}, "eval": {"every": 10}, "data": {"eval_fraction": 0.2}},
     "eval: parallel.mode torch-pipeline does not evaluate"),
    ({"parallel": {"mode": "ddp"}, "train": {"checkpoint_every": 5}},
     "train.checkpoint_every: parallel.mode ddp writes no checkpoints"),
    ({"parallel": {"mode": "torch-pipeline"}, "output": {"profile": {"after": 1, "steps": 2}}},
     "output.profile: parallel.mode torch-pipeline writes no profile"),
    ({"parallel": {"mode": "ddp"}, "output": {"profile": {}}}, "output.profile: parallel.mode ddp writes no profile"),
    ({"data": {"name": "synthetic", "path": "train.npz"}},
     "data.path: only data.name npz reads a file, and this job's data is data.name synthetic"),
    ({"data": {"name": "digits", "path": "train.npz"}}, "this job's data is data.name digits"),
    ({"data": {"name": "synthetic", "path": None, "args": {"row": 64}}},
     "data.args.row: unknown key (did you mean rows?); known keys are rows, seed, features, classes, vocab, context"),
    ({"data": {"name": "digits", "path": None, "args": {"rows": 5}}}, "data.args: data.name digits takes none, got ['rows']"),
    ({"output": {"ledger": True, "trace": False}}, "output.ledger: the ledger is written into the trace (trace/acked_vw*_stage*.pt); "
                                   "set output.trace: true too"),
])
def test_keys_that_do_not_go_together_are_refused(overrides: dict[str, Any], message: str) -> None:
    raw = base()
    for section, values in overrides.items():
        raw.setdefault(section, {}).update(values)
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_job(raw)


def test_base_dir_is_no_key_of_a_job_file() -> None:
    """Where the file lies decides it; a base_dir key in the YAML was taken and silently ignored."""
    raw = {**base(), "base_dir": "/nonexistent"}
    with pytest.raises(ConfigError, match="base_dir: unknown key"):
        parse_job(raw)
    assert JobConfig.from_json(json.dumps(raw)).base_dir == "/nonexistent"   # a job sent as JSON carries it


def test_a_data_path_alone_is_an_npz() -> None:
    raw = base()
    raw["data"] = {"path": "train.npz", "batch_size": 8}
    assert (parse_job(raw).data.name, parse_job(raw).data.path) == ("npz", "train.npz")


def test_flushed_schedules_take_nm_auto_or_left_out_as_one() -> None:
    raw = base()
    raw.setdefault("parallel", {}).update({"schedule": "1f1b", "nm": "auto", "microbatches": 4})
    assert parse_job(raw).parallel.nm == 1
    del raw["parallel"]["nm"]   # not the default 2, which the schedule would refuse as if it were given
    assert parse_job(raw).parallel.nm == 1


def test_defaults_are_the_dataclasses_defaults() -> None:
    job = parse_job({"model": {"name": "mlp"}})
    assert job.data == DataConfig() and job.train == TrainConfig() and job.parallel == ParallelConfig()
    assert job.output == OutputConfig()


def test_resolved_job_has_an_integer_nm_and_travels_as_json() -> None:
    job = parse_job({"model": {"name": "mlp"}, "parallel": {"nm": "auto"}}, base_dir="/x")
    with pytest.raises(ConfigError, match="parallel.nm: expected an integer"):
        ResolvedJob.from_json(job.to_json())
    resolved = resolve(job, 3)
    assert resolved.nm == 3 and resolved.parallel.nm == 3
    assert ResolvedJob.from_json(resolved.to_json()) == resolved
    assert "nm" not in json.loads(resolved.to_json()), "the resolved nm travels as parallel.nm only"


@pytest.mark.parametrize(
    ("section", "unknown"), [("", "trainer"), ("parallel", "n_m"), ("train.optimizer", "nesterov"),
                             ("cluster.emulate", "speed"), ("output", "path")],
)
def test_unknown_key_is_named_with_the_known_ones(section: str, unknown: str) -> None:
    raw = set_key(base(), f"{section}.{unknown}" if section else unknown, 1)
    full = f"{section}.{unknown}" if section else unknown
    with pytest.raises(ConfigError) as err:
        parse_job(raw)
    message = str(err.value)
    assert message.startswith(f"{full}: unknown key"), message
    assert "known keys are" in message


def test_load_job_errors_name_the_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError, match="nope.yaml does not exist"):
        load_job(missing)
    # A path through a file (and, for a user without root's override, a file without read access):
    # one line, not a traceback from every command that reads a job.
    with pytest.raises(ConfigError, match=r"^job file .*nope.yaml/x.yaml cannot be read \(Not a directory\)$"):
        (tmp_path / "nope.yaml").write_text("{}")
        load_job(tmp_path / "nope.yaml" / "x.yaml")
    broken = tmp_path / "broken.yaml"
    broken.write_text("model: {name: mlp\ndata:\n  name: digits\n")
    with pytest.raises(ConfigError) as err:
        load_job(broken)
    # One line: where, what and within what, not PyYAML's five naming "<unicode string>".
    assert str(err.value) == (f"job file {broken} is not valid YAML: line 2, column 5: expected ',' or '}}', but got "
                              "':' (while parsing a flow mapping at line 1)")


def test_a_job_files_mistake_is_named_with_its_line(tmp_path: Path) -> None:
    """A refused key is named as compilers name a line (in a list, the item's; a section's own
    fault, the section's), a close spelling is offered, and a --set setting's key has no line."""
    path = tmp_path / "job.yaml"
    good = ("model: {name: mlp}\n"
            "data:\n"
            "  name: digits\n"
            "  batch_size: 8\n"
            "train:\n"
            "  steps: 4\n"
            "  optimizer: {name: sgd,\n"
            "              lr: 0.1}\n"
            "cluster:\n"
            "  nodes:\n"
            "    - {name: a, gpus: [{type: titan-v}]}\n"
            "    - {name: b, gpus: [{type: rtx-2060}]}\n")
    path.write_text(good)
    load_job(path)
    for right, wrong, named in (("batch_size", "batch_sise", "4: data.batch_sise: unknown key (did you mean batch_size?); "),
                                ("lr: 0.1", "lr: -1", "8: train.optimizer.lr: expected a finite number"),
                                ("rtx-2060", "no-such-gpu", "12: cluster.nodes[1].gpus[0].type: "),
                                ("{name: mlp}", "{}", "1: model: give exactly one of")):
        path.write_text(good.replace(right, wrong))
        with pytest.raises(ConfigError) as err:
            load_job(path)
        assert str(err.value).startswith(f"{path}:{named}"), err.value
    path.write_text(good)
    for set_args, named in ((["data.shufle=true"], "data.shufle: unknown key (did you mean shuffle?)"),
                               (["data={name: digits, batch_size: 0}"], "data.batch_size: expected")):
        with pytest.raises(ConfigError) as err:
            load_job(path, set_args)
        assert str(err.value).startswith(named), err.value


@pytest.mark.parametrize(("text", "named"), [
    # A mapping's own key overrides a merged one, wherever the merge key stands.
    ("train:\n  <<: {seed: 1}\n  steps: 3\n  seed: -1\n", "4: train.seed: "),
    # A key spelt with a dot names the same path as a nested one, in either order: its own line.
    ("data:\n  batch_size: 4\ndata.batch_size: 4\n", "3: data.batch_size: unknown key"),
    ("data.batch_size: 4\ndata:\n  batch_size: 4\n", "1: data.batch_size: unknown key"),
    # A list item given as an alias: the list's line, not the anchor's.
    ("model: {name: mlp}\ncluster:\n  nodes:\n    - &n {name: a, gpus: [{type: t4}]}\n"
     "    - {name: b, gpus: [{type: t4}]}\n    - *n\n", "3: cluster.nodes[2].name: "),
])
def test_a_mistakes_line_is_the_one_that_made_it(tmp_path: Path, text: str, named: str) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_job(path)
    assert str(err.value).startswith(f"{path}:{named}"), err.value


@pytest.mark.parametrize(("text", "value"), [("1e-3", 0.001), ("1E5", 1e5), ("-2e-4", -2e-4), (".5", 0.5),
                                             ("-.5", -0.5), ("2.5e-3", 2.5e-3), ("+1.e2", 100.0),
                                             ("0.05", 0.05)])
def test_floats_are_read_the_yaml_1_2_way(tmp_path: Path, text: str, value: float) -> None:
    """PyYAML (YAML 1.1) reads 1e-3 as a string, which the validator refused as not a number."""
    path = tmp_path / "job.yaml"
    path.write_text(f"model: {{name: mlp, args: {{x: {text}}}}}\n"
                    "train: {optimizer: {name: adam, lr: 1e-3}}\n")
    job = load_job(path)
    assert job.train.optimizer.lr == 0.001 and job.model.args["x"] == value


def test_yaml_1_1_integers_and_strings_stay_as_they_were(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    path.write_text("train: {steps: 1_000, seed: 12}\n"
                    "model: {name: mlp, args: {tag: 1e, v: '1e-3', n: 09}}\n")
    job = load_job(path)
    assert (job.train.steps, job.train.seed) == (1000, 12)
    assert dict(job.model.args) == {"tag": "1e", "v": "1e-3", "n": "09"}


def test_a_key_given_twice_is_refused_with_both_lines(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    path.write_text("model: {name: mlp}\ntrain:\n  optimizer:\n    lr: 0.1\n    name: sgd\n    lr: 0.2\n")
    with pytest.raises(ConfigError, match=r"^train\.optimizer\.lr: given twice \(lines 4 and 6\)$"):
        load_job(path)
    path.write_text("model: {name: mlp}\ncluster:\n  nodes:\n  - {name: a, name: b, gpus: [{type: t4}]}\n")
    with pytest.raises(ConfigError, match=r"^cluster\.nodes\[0\]\.name: given twice \(lines 4 and 4\)$"):
        load_job(path)
    path.write_text("model: {name: mlp}\n'model': {name: gpt}\n")  # quoted or not, the same key
    with pytest.raises(ConfigError, match=r"^model: given twice \(lines 1 and 2\)$"):
        load_job(path)
    # A merge key's entries may be overridden: that is what it is for.
    path.write_text("model: {name: mlp}\ntrain: {optimizer: {<<: {name: sgd, lr: 0.1}, lr: 0.2}}\n")
    assert load_job(path).train.optimizer.lr == 0.2


def test_json_round_trip_of_design_example(design_job: JobConfig) -> None:
    again = JobConfig.from_json(design_job.to_json())
    assert again == design_job
    assert again.resolve("data.npz") == design_job.resolve("data.npz"), "base_dir travels with the job"
    assert again.to_json() == design_job.to_json()


def test_from_json_rejects_garbage() -> None:
    with pytest.raises(ConfigError, match="job_json"):
        JobConfig.from_json("{not json")
    with pytest.raises(ConfigError, match="job_json"):
        JobConfig.from_json("[1, 2]")


def test_with_overrides_replaces_only_named_fields(design_job: JobConfig) -> None:
    job = with_overrides(design_job, parallel={"nm": 4}, train={"steps": 7})
    assert job.parallel.nm == 4 and job.train.steps == 7
    assert job.parallel.D == design_job.parallel.D and job.cluster == design_job.cluster
    assert design_job.parallel.nm == 2, "the original is untouched (frozen)"


names = st.text("abcdefghij-", min_size=1, max_size=8)
valid_jobs = st.fixed_dictionaries(
    {
        "model": st.fixed_dictionaries(
            {"name": st.sampled_from(["mlp", "cnn", "gpt"]),
             "args": st.dictionaries(st.sampled_from(["hidden", "in_features", "vocab"]),
                                     st.one_of(st.integers(1, 9), st.lists(st.integers(1, 9), max_size=3)))},
            optional={"init": st.one_of(st.none(), names)},
        ),
        "data": st.one_of(   # only npz reads a path
            st.fixed_dictionaries({"name": st.just("npz"), "path": names},
                                  optional={"batch_size": st.integers(1, 512), "shuffle": st.booleans()}),
            st.fixed_dictionaries({"name": st.sampled_from(["synthetic", "digits"])},
                                  optional={"batch_size": st.integers(1, 512), "shuffle": st.booleans()}),
        ),
        "train": st.fixed_dictionaries(
            {},
            optional={
                "steps": st.integers(1, 10**6), "loss": st.sampled_from(["cross_entropy", "mse"]),
                "dtype": st.sampled_from(["float32", "float64"]), "seed": st.integers(0, 2**31),
                "optimizer": st.one_of(
                    st.fixed_dictionaries({"name": st.just("sgd")},
                                          optional={"lr": st.floats(0, 10), "momentum": st.floats(0, 1)}),
                    st.fixed_dictionaries({"name": st.sampled_from(["adam", "adamw"])},
                                          optional={"lr": st.floats(0, 10), "weight_decay": st.floats(0, 1),
                                                    "betas": st.tuples(st.floats(0, 0.99), st.floats(0, 0.99)).map(list)}),
                ),
                "lr_schedule": st.fixed_dictionaries(
                    {}, optional={"warmup_steps": st.integers(0, 1), "min_lr": st.just(0.0),
                                  "decay": st.sampled_from(["constant", "linear", "cosine"])}),
            },
        ),
        "parallel": st.fixed_dictionaries(
            {},
            optional={
                "virtual_workers": st.integers(1, 8), "stages_per_vw": st.integers(1, 8),
                "nm": st.one_of(st.integers(1, 8), st.just("auto")), "D": st.integers(0, 5),
                "policy": st.sampled_from(["NP", "ED", "HD", "auto"]), "ps_shards": st.integers(1, 4),
                "placement": st.sampled_from(["default", "local"]),
                "mode": st.sampled_from(["hetpipe", "ddp", "torch-pipeline"]),
            },
        ),
        "output": st.one_of(st.fixed_dictionaries({}, optional={"dir": names, "trace": st.just(False)}),
                            st.fixed_dictionaries({"trace": st.just(True)}, optional={"dir": names, "ledger": st.booleans()})),
    },
    optional={
        "cluster": st.fixed_dictionaries(
            {"nodes": st.lists(names, min_size=1, max_size=3, unique=True).map(
                lambda ns: [{"name": n, "gpus": [{"type": "t4", "count": 64}]} for n in ns])},
            optional={"emulate": st.fixed_dictionaries({"time_scale": st.floats(0.001, 10)})},
        ),
    },
)


@settings(max_examples=150, deadline=None)
@given(raw=valid_jobs)
def test_json_round_trip_is_identity(raw: dict[str, Any]) -> None:
    job = parse_job(raw, base_dir="/some/where")
    again = JobConfig.from_json(job.to_json())
    assert again == job
    # YAML is only a carrier: dumping and re-reading the mapping gives the same job.
    assert parse_job(yaml.safe_load(yaml.safe_dump(raw)), base_dir="/some/where") == job


# ---- parallel.sync quorum | elastic with parallel.sync_args --------------------------------------


def sync_job(sync: str, sync_args: Any = None, **parallel: Any) -> dict[str, Any]:
    raw = base()
    raw["parallel"].update({"sync": sync, "D": 0, **parallel})
    if sync_args is not None:
        raw["parallel"]["sync_args"] = sync_args
    return raw


@pytest.mark.parametrize(("raw", "message"), [
    (sync_job("quorum", mode="ddp"), "parallel.sync: quorum runs on HetPipe's virtual workers and parameter servers "
                                     "(parallel.mode hetpipe); parallel.mode ddp has only sync wsp"),
    (sync_job("elastic", mode="torch-pipeline", schedule="gpipe"), "parallel.mode torch-pipeline has only sync wsp"),
    (sync_job("quorum", virtual_workers=1), "parallel.sync: quorum needs 2 or more parallel.virtual_workers"),
    (sync_job("elastic", virtual_workers=1), "parallel.sync: elastic needs 2 or more parallel.virtual_workers"),
    (sync_job("elastic", D=1), "parallel.D: 1 has no meaning under parallel.sync elastic"),
    (sync_job("quorum", {"quorum": 3}), "parallel.sync_args.quorum: 3 is more than the 2 virtual workers"),
    (sync_job("quorum", {"quorum": 0}), "parallel.sync_args.quorum: expected majority, all, solo or an integer >= 1"),
    (sync_job("quorum", {"quorum": True}), "parallel.sync_args.quorum: expected majority, all, solo"),
    (sync_job("quorum", {"quorum": "most"}), "parallel.sync_args.quorum: expected majority, all, solo"),
    (sync_job("wsp", {"quorum": 1}), "parallel.sync_args.quorum: unknown key: parallel.sync wsp takes no sync_args; "
                                     "it is an argument of parallel.sync quorum"),
    (sync_job("quorum", {"alpha": 0.1}), "parallel.sync_args.alpha: unknown key: parallel.sync quorum takes quorum; "
                                         "it is an argument of parallel.sync elastic"),
    (sync_job("elastic", {"quorum": 1}), "parallel.sync_args.quorum: unknown key: parallel.sync elastic takes alpha, "
                                         "period; it is an argument of parallel.sync quorum"),
    (sync_job("elastic", {"beta": 1}), "parallel.sync_args.beta: unknown key: parallel.sync elastic takes alpha, period"),
    (sync_job("elastic", {"alpha": 0}), "parallel.sync_args.alpha: expected a number in (0, 0.5]"),
    (sync_job("elastic", {"alpha": 0.75}), "parallel.sync_args.alpha: expected a number in (0, 0.5]"),
    (sync_job("elastic", {"alpha": "strong"}), "parallel.sync_args.alpha: expected a number in (0, 0.5]"),
    (sync_job("elastic", {"period": 0}), "parallel.sync_args.period: expected an integer >= 1"),
    (sync_job("elastic", [1]), "parallel.sync_args: expected a mapping"),
    ({**sync_job("quorum"), "train": {**base()["train"], "checkpoint_every": 2}},
     "train.checkpoint_every: not with parallel.sync quorum yet: a checkpoint does not hold the open quorum rounds"),
    ({**sync_job("elastic"), "train": {**base()["train"], "checkpoint_every": 2}},
     "train.checkpoint_every: not with parallel.sync elastic yet"),
], ids=lambda v: v if isinstance(v, str) else "")
def test_sync_combinations_that_make_no_sense_are_refused(raw: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_job(raw)
    assert message in str(err.value), str(err.value)
    assert "\n" not in str(err.value), "one line"


def test_sync_args_are_normalised_and_survive_the_trip_to_the_stages() -> None:
    quorum = parse_job(sync_job("quorum")).parallel
    assert quorum.sync_args == {"quorum": "majority"} and quorum.sync_settings.quorum == 0
    assert parse_job(sync_job("quorum", {"quorum": "solo"})).parallel.sync_settings.quorum == 1
    assert parse_job(sync_job("quorum", {"quorum": "all"}, virtual_workers=2)).parallel.sync_settings.quorum == 2
    assert parse_job(sync_job("quorum", {"quorum": 2}, D=3)).parallel.sync_settings.quorum == 2
    el = parse_job(sync_job("elastic")).parallel
    assert el.sync_args == {"alpha": 0.1, "period": 1}, "EA-Pipe's defaults"
    el = parse_job(sync_job("elastic", {"alpha": 0.5, "period": 4}, on_vw_failure="continue")).parallel
    assert (el.sync_settings.alpha, el.sync_settings.period) == (0.5, 4)
    assert parse_job(base()).parallel.sync_args == {}, "wsp takes none"
    for raw in (sync_job("quorum", {"quorum": "all"}), sync_job("elastic", {"alpha": 0.25, "period": 2})):
        job = parse_job(raw, base_dir="/x")
        assert JobConfig.from_json(job.to_json()) == job
    # fp16 with elastic: the loss scale depends only on the VW's own verdicts, and an exchange
    # changes the weights between tasks as a WSP pull does.
    fp16 = sync_job("elastic")
    fp16["train"]["precision"] = "fp16"
    assert parse_job(fp16).train.precision == "fp16"


def test_numbers_and_files_no_setting_could_hold_are_refused_in_one_line(tmp_path: Path) -> None:
    """An integer past float's range, one of more digits than Python parses, a job file that is
    not UTF-8: ConfigError (exit 2, INVALID_ARGUMENT over gRPC), not a traceback or INTERNAL."""
    with pytest.raises(ConfigError, match=r"train.optimizer.lr: expected a finite number >= 0"):
        parse_job(set_key(base(), "train.optimizer.lr", 10**400))
    with pytest.raises(ConfigError, match="job_json: not valid JSON"):
        JobConfig.from_json('{"train": {"steps": ' + "1" * 5000 + "}}")
    files = {"digits.yaml": ("train: {steps: " + "1" * 5000 + "}\n").encode(), "latin1.yaml": b"# caf\xe9\n"}
    for name, text in files.items():
        (tmp_path / name).write_bytes(text)
        with pytest.raises(ConfigError, match=f"job file .*{name} (cannot be read|is not UTF-8 text)"):
            load_job(tmp_path / name)


def test_with_setting_changes_a_copy_and_makes_missing_sections() -> None:
    raw = {"model": {"name": "mlp", "args": {"hidden": [8]}}, "train": None}
    got = with_setting(with_setting(raw, "model.args.hidden=[16, 16]"), "train.optimizer.lr=1e-3")
    got = with_setting(got, "eval=null")
    assert got == {"model": {"name": "mlp", "args": {"hidden": [16, 16]}}, "train": {"optimizer": {"lr": 0.001}},
                   "eval": None}
    assert raw == {"model": {"name": "mlp", "args": {"hidden": [8]}}, "train": None}, "the job file's mapping is kept"
    assert parse_job(got).train.optimizer.lr == 0.001


def test_with_setting_leaves_what_an_alias_shares_elsewhere_as_it_was() -> None:
    raw = yaml.load("model: {name: mlp, args: &a {hidden: [8]}}\ncluster: {emulate: {model_args: *a}}\n",
                    Loader=JobLoader)
    got = with_setting(raw, "model.args.hidden=[64, 64]")
    assert got["model"]["args"] == {"hidden": [64, 64]}
    assert got["cluster"]["emulate"]["model_args"] == {"hidden": [8]}, "the emulated model keeps the file's"


@pytest.mark.parametrize(("raw", "setting", "names"), [
    ([1, 2], "train.steps=3", ["job file: expected a mapping"]),
    ({}, "train.seed=" + "9" * 5000, ["--set train.seed: cannot be read", "ValueError"]),
    ({}, "train=" + "[" * 5000, ["--set train: cannot be read", "RecursionError"]),
    ({}, "train={steps: 1, steps: 2}", ["--set train:", "steps: given twice"]),
    ({"train": 3}, "train.steps=1", ["--set train.steps: train: expected a mapping, got 3"]),
])
def test_a_set_that_cannot_apply_is_refused_naming_it(raw: Any, setting: str, names: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        with_setting(raw, setting)
    for name in names:
        assert name in str(info.value), str(info.value)


def _cluster_job_json(groups: int) -> str:
    return json.dumps({
        "model": {"name": "mlp", "args": {"in_features": 64, "hidden": [32, 32, 32], "num_classes": 10}},
        "data": {"name": "digits", "batch_size": 16},
        "train": {"steps": 4, "loss": "cross_entropy", "optimizer": {"name": "sgd", "lr": 0.05}, "seed": 0},
        "parallel": {"virtual_workers": 1, "stages_per_vw": 2, "nm": 1, "D": 0},
        "cluster": {"nodes": [{"name": "n0", "gpus": [{"type": "h200", "count": MAX_VIRTUAL_WORKERS * MAX_STAGES}] * groups}],
                    "emulate": {"time_scale": 1.0}},
        "output": {"dir": "out"},
    })


def test_a_cluster_past_what_any_plan_uses_is_refused() -> None:
    """Bounded in all, not only per group: a few hundred bytes of groups of 262144 GPUs each made
    the planner build a Gpu per GPU (a 10 KB Submit: about 75 million, 12 GiB)."""
    JobConfig.from_json(_cluster_job_json(1))
    with pytest.raises(ConfigError, match=r"cluster.nodes: expected at most 262144 GPUs in all.*524288 GPUs"):
        JobConfig.from_json(_cluster_job_json(2))

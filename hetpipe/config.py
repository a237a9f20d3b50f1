"""Job file schema (DESIGN §8): parsed once into frozen dataclasses and validated."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from hetpipe.network import Network


class ConfigError(ValueError):
    """A bad job file value; the message names the key, the value and what was expected."""


def _fail(key: str, value: Any, expected: str) -> ConfigError:
    return ConfigError(f"{key}: expected {expected}, got {value!r}")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class _Section:
    """Reads one mapping of the job file, tracking which keys were used."""

    def __init__(self, raw: Any, key: str) -> None:
        if raw is None:
            raw = {}
        if not isinstance(raw, Mapping):
            raise _fail(key or "job file", raw, "a mapping")
        self.raw, self.key = dict(raw), key

    def _path(self, name: str) -> str:
        return f"{self.key}.{name}" if self.key else name

    def get(self, name: str, default: Any = None) -> Any:
        return self.raw.get(name, default)

    def integer(self, name: str, default: int | None = None, *, minimum: int = 0) -> int:
        value = self.raw.get(name, default)
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise _fail(self._path(name), value, f"an integer >= {minimum}")
        return value

    def number(self, name: str, default: float | None = None, *, minimum: float = 0.0) -> float:
        value = self.raw.get(name, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < minimum:
            raise _fail(self._path(name), value, f"a number >= {minimum}")
        return float(value)

    def choice(self, name: str, default: str, choices: tuple[str, ...]) -> str:
        value = self.raw.get(name, default)
        if value not in choices:
            raise _fail(self._path(name), value, "one of " + ", ".join(choices))
        return str(value)

    def text(self, name: str, default: str | None = None) -> str:
        value = self.raw.get(name, default)
        if not isinstance(value, str) or not value:
            raise _fail(self._path(name), value, "a non-empty string")
        return value

    def flag(self, name: str, default: bool) -> bool:
        value = self.raw.get(name, default)
        if not isinstance(value, bool):
            raise _fail(self._path(name), value, "true or false")
        return value

    def mapping(self, name: str) -> dict[str, Any]:
        value = self.raw.get(name) or {}
        if not isinstance(value, Mapping):
            raise _fail(self._path(name), value, "a mapping")
        return dict(value)

    def check_known(self, known: tuple[str, ...]) -> None:
        unknown = sorted(set(self.raw) - set(known))
        if unknown:
            raise ConfigError(f"{self._path(unknown[0])}: unknown key; known keys are {', '.join(known)}")


@dataclass(frozen=True, slots=True)
class GpuGroup:
    type: str
    count: int


@dataclass(frozen=True, slots=True)
class NodeConfig:
    name: str
    gpus: tuple[GpuGroup, ...]


@dataclass(frozen=True, slots=True)
class EmulateConfig:
    time_scale: float = 1.0
    # Fixed per-task times override the catalog, e.g. for pipeline benchmarks with equal stages.
    forward_seconds: float = 0.0
    backward_seconds: float = 0.0
    # Emulated links between stages, to the shards and in the allreduce baseline; None = loopback as is.
    network: Network | None = None
    # Model args the emulated costs are taken at (times, memory, bytes moved), over model.args: a
    # small stand-in computes while every task and transfer is timed as the full-size model's.
    model_args: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    nodes: tuple[NodeConfig, ...]
    emulate: EmulateConfig | None


@dataclass(frozen=True, slots=True)
class ModelConfig:
    name: str
    args: Mapping[str, Any] = field(default_factory=dict)
    init: str | None = None


@dataclass(frozen=True, slots=True)
class DataConfig:
    name: str = "synthetic"
    path: str | None = None
    batch_size: int = 32
    shuffle: bool = False
    args: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class OptimizerConfig:
    name: str = "sgd"
    lr: float = 0.05
    momentum: float = 0.0
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8


@dataclass(frozen=True, slots=True)
class TrainConfig:
    steps: int = 100
    loss: str = "cross_entropy"
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    dtype: str = "float32"
    seed: int = 0


@dataclass(frozen=True, slots=True)
class ParallelConfig:
    virtual_workers: int = 1
    stages_per_vw: int = 2
    policy: str = "ED"
    nm: int | str = 2
    D: int = 0
    ps_shards: int = 1
    placement: str = "default"
    mode: str = "hetpipe"
    schedule: str = "hetpipe"
    sync: str = "wsp"
    microbatches: int = 1  # mode torch-pipeline: micro-batches per minibatch (GPipe, 1F1B)


@dataclass(frozen=True, slots=True)
class FaultConfig:
    """Test and debugging knobs: injected per-task delays."""

    task_delay: tuple[float, float] = (0.0, 0.0)  # uniform random extra seconds per task
    slow_vw: int = -1  # this VW's tasks are padded by slow_factor (straggler)
    slow_factor: float = 1.0
    repeat_push: float = 0.0  # probability that a stage sends an acknowledged push again (a retry)


@dataclass(frozen=True, slots=True)
class OutputConfig:
    dir: str = "runs/job"
    trace: bool = False


@dataclass(frozen=True, slots=True)
class JobConfig:
    model: ModelConfig
    data: DataConfig
    train: TrainConfig
    parallel: ParallelConfig
    output: OutputConfig
    cluster: ClusterConfig | None = None
    faults: FaultConfig = field(default_factory=FaultConfig)
    base_dir: str = "."  # the job file's folder; relative paths resolve against it

    def resolve(self, path: str) -> Path:
        p = Path(path)
        return p if p.is_absolute() else Path(self.base_dir) / p

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @staticmethod
    def from_json(text: str) -> JobConfig:
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"job_json: not valid JSON ({exc})") from None
        if not isinstance(raw, Mapping):
            raise _fail("job_json", raw, "a JSON object")
        return parse_job(raw, base_dir=str(raw.get("base_dir", ".")))

    @property
    def emulated_model_args(self) -> dict[str, Any]:
        """The model args the planner profiles at: model.args, with cluster.emulate.model_args over them."""
        emulate = self.cluster.emulate if self.cluster else None
        return {**self.model.args, **(emulate.model_args if emulate else {})}

    @property
    def nm(self) -> int:
        assert isinstance(self.parallel.nm, int), "nm must be resolved before running"
        return self.parallel.nm


MODES = ("hetpipe", "ddp", "torch-pipeline")
SCHEDULES = ("hetpipe", "gpipe", "1f1b")  # gpipe, 1f1b: with mode torch-pipeline
SYNCS = ("wsp",)
POLICIES = ("NP", "ED", "HD", "auto")
DTYPES = ("float32", "float64")
LOSSES = ("cross_entropy", "mse")
OPTIMIZERS = ("sgd", "adam")


def _parse_cluster(raw: Any) -> ClusterConfig | None:
    if raw is None:
        return None
    sec = _Section(raw, "cluster")
    sec.check_known(("nodes", "emulate"))
    nodes_raw = sec.get("nodes")
    if not isinstance(nodes_raw, list) or not nodes_raw:
        raise _fail("cluster.nodes", nodes_raw, "a non-empty list of nodes")
    nodes = []
    for i, node_raw in enumerate(nodes_raw):
        node = _Section(node_raw, f"cluster.nodes[{i}]")
        node.check_known(("name", "gpus"))
        gpus_raw = node.get("gpus")
        if not isinstance(gpus_raw, list) or not gpus_raw:
            raise _fail(f"cluster.nodes[{i}].gpus", gpus_raw, "a non-empty list of {type, count}")
        gpus = []
        for j, g_raw in enumerate(gpus_raw):
            g = _Section(g_raw, f"cluster.nodes[{i}].gpus[{j}]")
            g.check_known(("type", "count"))
            gpus.append(GpuGroup(type=g.text("type"), count=g.integer("count", 1, minimum=1)))
        nodes.append(NodeConfig(name=node.text("name", f"n{i}"), gpus=tuple(gpus)))
    names = [n.name for n in nodes]
    if len(set(names)) != len(names):
        raise _fail("cluster.nodes[].name", names, "unique node names")
    emulate = None
    if sec.get("emulate") is not None:
        em = _Section(sec.get("emulate"), "cluster.emulate")
        em.check_known(("time_scale", "forward_seconds", "backward_seconds", "network", "model_args"))
        network = None
        if em.get("network") is not None:
            net = _Section(em.get("network"), "cluster.emulate.network")
            net.check_known(("intra_node_gbs", "inter_node_gbs", "latency_s"))
            paper = Network()
            network = Network(
                intra_node_gbs=net.number("intra_node_gbs", paper.intra_node_gbs, minimum=1e-6),
                inter_node_gbs=net.number("inter_node_gbs", paper.inter_node_gbs, minimum=1e-6),
                latency_s=net.number("latency_s", paper.latency_s),
            )
        emulate = EmulateConfig(
            time_scale=em.number("time_scale", 1.0, minimum=1e-9),
            forward_seconds=em.number("forward_seconds", 0.0),
            backward_seconds=em.number("backward_seconds", 0.0),
            network=network,
            model_args=em.mapping("model_args"),
        )
    return ClusterConfig(nodes=tuple(nodes), emulate=emulate)


def parse_job(raw: Mapping[str, Any], *, base_dir: str = ".") -> JobConfig:
    """Validates a job mapping (the YAML's content) into a JobConfig."""
    top = _Section(raw, "")
    top.check_known(("cluster", "model", "data", "train", "parallel", "output", "faults", "base_dir"))

    m = _Section(top.get("model"), "model")
    m.check_known(("name", "args", "init"))
    init = m.get("init")
    if init is not None and (not isinstance(init, str) or not init):
        raise _fail("model.init", init, "null or a path to a state_dict saved with torch.save")
    model = ModelConfig(name=m.text("name"), args=m.mapping("args"), init=init)

    d = _Section(top.get("data"), "data")
    d.check_known(("name", "path", "batch_size", "shuffle", "args"))
    data_name = d.choice("name", "synthetic", ("synthetic", "npz", "digits"))
    path = d.get("path")
    if data_name == "npz":
        path = d.text("path")
    data = DataConfig(
        name=data_name, path=path, batch_size=d.integer("batch_size", 32, minimum=1),
        shuffle=d.flag("shuffle", False), args=d.mapping("args"),
    )

    t = _Section(top.get("train"), "train")
    t.check_known(("steps", "loss", "optimizer", "dtype", "seed"))
    o = _Section(t.get("optimizer"), "train.optimizer")
    o.check_known(("name", "lr", "momentum", "weight_decay", "betas", "eps"))
    betas = o.get("betas", [0.9, 0.999])
    if not (isinstance(betas, (list, tuple)) and len(betas) == 2 and all(_is_number(b) and 0 <= b < 1 for b in betas)):
        raise _fail("train.optimizer.betas", betas, "two numbers in [0, 1)")
    optimizer = OptimizerConfig(
        name=o.choice("name", "sgd", OPTIMIZERS), lr=o.number("lr", 0.05),
        momentum=o.number("momentum", 0.0), weight_decay=o.number("weight_decay", 0.0),
        betas=(float(betas[0]), float(betas[1])), eps=o.number("eps", 1e-8),
    )
    train = TrainConfig(
        steps=t.integer("steps", 100, minimum=1), loss=t.choice("loss", "cross_entropy", LOSSES),
        optimizer=optimizer, dtype=t.choice("dtype", "float32", DTYPES), seed=t.integer("seed", 0),
    )

    p = _Section(top.get("parallel"), "parallel")
    p.check_known(("virtual_workers", "stages_per_vw", "policy", "nm", "D", "ps_shards",
                   "placement", "mode", "schedule", "sync", "microbatches"))
    nm_raw = p.get("nm", 2)
    nm: int | str = "auto" if nm_raw == "auto" else p.integer("nm", 2, minimum=1)
    parallel = ParallelConfig(
        virtual_workers=p.integer("virtual_workers", 1, minimum=1),
        stages_per_vw=p.integer("stages_per_vw", 2, minimum=1),
        policy=p.choice("policy", "ED", POLICIES), nm=nm, D=p.integer("D", 0),
        ps_shards=p.integer("ps_shards", 1, minimum=1),
        placement=p.choice("placement", "default", ("default", "local")),
        mode=p.choice("mode", "hetpipe", MODES),
        schedule=p.choice("schedule", "hetpipe", SCHEDULES),
        sync=p.choice("sync", "wsp", SYNCS),
        microbatches=p.integer("microbatches", 1, minimum=1),
    )

    out = _Section(top.get("output"), "output")
    out.check_known(("dir", "trace"))
    output = OutputConfig(dir=out.text("dir", "runs/job"), trace=out.flag("trace", False))

    f = _Section(top.get("faults"), "faults")
    f.check_known(("task_delay", "slow_vw", "slow_factor", "repeat_push"))
    delay = f.get("task_delay", [0.0, 0.0])
    if not (isinstance(delay, (list, tuple)) and len(delay) == 2 and all(map(_is_number, delay))
            and 0 <= delay[0] <= delay[1]):
        raise _fail("faults.task_delay", delay, "[low, high] seconds with 0 <= low <= high")
    faults = FaultConfig(
        task_delay=(float(delay[0]), float(delay[1])), slow_vw=f.integer("slow_vw", -1, minimum=-1),
        slow_factor=f.number("slow_factor", 1.0, minimum=1.0),
        repeat_push=f.number("repeat_push", 0.0),
    )

    return JobConfig(
        model=model, data=data, train=train, parallel=parallel, output=output,
        cluster=_parse_cluster(top.get("cluster")), faults=faults, base_dir=base_dir,
    )


def load_job(path: str | Path) -> JobConfig:
    """Reads and validates a job YAML file."""
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"job file {path} does not exist") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"job file {path} is not valid YAML: {exc}") from None
    return parse_job(raw or {}, base_dir=str(path.resolve().parent))


def with_overrides(job: JobConfig, **sections: Mapping[str, Any]) -> JobConfig:
    """A copy of job with fields of named sections replaced, e.g. parallel={'nm': 4}."""
    changes = {name: dataclasses.replace(getattr(job, name), **fields) for name, fields in sections.items()}
    return dataclasses.replace(job, **changes)

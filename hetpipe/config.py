"""Job file schema (DESIGN §8): parsed once into frozen dataclasses, defaults written once, here."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from hetpipe.cluster import ClusterConfig, EmulateConfig, parse_cluster
from hetpipe.security import Security
from hetpipe.parallelism import (FLUSHED_SCHEDULES, MAX_STAGES, MAX_VIRTUAL_WORKERS, MICRO_SCHEDULES,
                                 ParallelConfig, check_sync, parse_parallel)
from hetpipe.training import MAX_STEPS, TrainConfig, parse_train
from hetpipe.validate import ConfigError, JobLoader, Section, at_line, fail

__all__ = ["ConfigError", "JobConfig", "JobLoader", "ResolvedJob", "TrainConfig", "load_job", "parse_job", "resolve",
           "with_overrides", "with_setting"]


@dataclass(frozen=True, slots=True)
class ModelConfig:
    name: str | None = None       # a zoo model; or
    factory: str | None = None    # "package.module:function" returning an nn.Sequential
    args: Mapping[str, Any] = field(default_factory=dict)   # the factory's keyword arguments
    init: str | None = None       # weights to start from: safetensors, or a state_dict

    def identity(self) -> dict[str, Any]:
        """Which model with which layers, as a checkpoint and summary.json record it (JSON as it is)."""
        return {"name": self.name, "factory": self.factory, "args": dict(self.args)}


@dataclass(frozen=True, slots=True)
class DataConfig:
    name: str | None = "synthetic"      # a built-in: synthetic, npz, digits; or (None)
    factory: str | None = None          # "package.module:function" returning a map-style Dataset
    eval_factory: str | None = None     # the held-out set, from a factory; or
    eval_fraction: float = 0.0          # this share of the rows, held out (seeded)
    path: str | None = None
    batch_size: int = 32
    shuffle: bool = False
    workers: int = 0                    # DataLoader worker processes of stage 0 and the last stage
    args: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class EvalConfig:
    every: int = 0             # minibatches per VW between evaluations (0: only at the end)
    rows: int | None = None    # held-out rows per evaluation; None: up to DEFAULT_ROWS, whole minibatches

    DEFAULT_ROWS = 1024

    @property
    def rows_read(self) -> int:
        """The held-out rows an evaluation asks for (data.eval_batches reads whole minibatches)."""
        return self.DEFAULT_ROWS if self.rows is None else self.rows


@dataclass(frozen=True, slots=True)
class ProfileConfig:
    """output.profile: torch.profiler over each stage's minibatches (after, after + steps]."""
    after: int = 10     # minibatches each stage finishes first (its warm-up: allocator, kernel choice)
    steps: int = 5


@dataclass(frozen=True, slots=True)
class OutputConfig:
    dir: str = "runs/job"
    trace: bool = False
    # O3's ledger (trace/acked_vw*_stage*.pt): each stage's sum of the updates its shards
    # acknowledged, saved at every push. A check, not a timing: on a large model it costs more
    # than the training, so a trace leaves it out unless asked.
    ledger: bool = False
    max_shard_bytes: int = 2 << 30   # model.safetensors below this, else model-0000i-of-0000N files
    profile: ProfileConfig | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class JobConfig:
    model: ModelConfig
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    eval: EvalConfig | None = None       # None: no evaluation
    cluster: ClusterConfig | None = None
    security: Security | None = None  # paths relative to the job file; None: a local run makes a per-run token
    base_dir: str = "."  # the job file's folder; relative paths resolve against it

    def resolve(self, path: str) -> Path:
        p = Path(path)
        return p if p.is_absolute() else Path(self.base_dir) / p

    def security_files(self) -> Security | None:
        """security with its paths resolved against the job file's folder."""
        if self.security is None:
            return None
        s = self.security
        return Security(**{k: str(self.resolve(getattr(s, k))) if getattr(s, k) else ""
                           for k in ("cert", "key", "ca", "token_file")})

    def to_json(self) -> str:
        raw = dataclasses.asdict(self)
        raw.pop("nm", None)  # a ResolvedJob's nm is parallel.nm
        raw.pop("security", None)  # the submitting side's files: each process has its own flags
        return json.dumps(raw, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> JobConfig:
        return parse_job(_json_object(text), base_dir=None)

    @property
    def factories(self) -> dict[str, str]:
        """The factories the job names, by key (model.factory, data.factory, data.eval_factory)."""
        named = {"model.factory": self.model.factory, "data.factory": self.data.factory,
                 "data.eval_factory": self.data.eval_factory}
        return {key: spec for key, spec in named.items() if spec}

    @property
    def read_paths(self) -> dict[str, Path]:
        """The files the job reads, resolved, by key (data.path of the npz data, model.init)."""
        named = {"data.path": self.data.path if self.data.name == "npz" else None, "model.init": self.model.init}
        return {key: self.resolve(path) for key, path in named.items() if path}

    @property
    def emulate(self) -> EmulateConfig | None:
        return self.cluster.emulate if self.cluster is not None else None

    @property
    def emulated_model_args(self) -> dict[str, Any]:
        """The model args the planner profiles at: model.args, with cluster.emulate.model_args over them."""
        return {**self.model.args, **(self.emulate.model_args if self.emulate else {})}


@dataclass(frozen=True, slots=True, kw_only=True)
class ResolvedJob(JobConfig):
    """A job whose planner choices are made, as stages and workers receive it: nm is an integer."""

    nm: int

    @classmethod
    def from_json(cls, text: str) -> ResolvedJob:
        job = parse_job(_json_object(text), base_dir=None)
        if not isinstance(job.parallel.nm, int):
            raise fail("parallel.nm", job.parallel.nm, "an integer: the planner resolves 'auto' before running")
        return resolve(job, job.parallel.nm)


def resolve(job: JobConfig, nm: int) -> ResolvedJob:
    """The job with the plan's nm filled in."""
    parallel = dataclasses.replace(job.parallel, nm=nm)
    values = {f.name: getattr(job, f.name) for f in dataclasses.fields(JobConfig)}
    return ResolvedJob(**{**values, "parallel": parallel}, nm=nm)


def _json_object(text: str) -> Mapping[str, Any]:
    try:
        raw = json.loads(text)
    except ValueError as exc:  # JSONDecodeError, or an integer of more digits than Python parses
        raise ConfigError(f"job_json: not valid JSON ({str(exc)[:200]})") from None
    except RecursionError:
        raise ConfigError("job_json: nested too deeply") from None
    if not isinstance(raw, Mapping):
        raise fail("job_json", raw, "a JSON object")
    return raw



def _parse_model(m: Section) -> ModelConfig:
    m.check_known(("name", "factory", "args", "init"))
    init = m.get("init")
    if init is not None and (not isinstance(init, str) or not init or "\0" in init):
        raise fail("model.init", init, "null or a path to weights (safetensors, or a state_dict saved with torch.save)")
    name, factory = m.optional_text("name"), m.optional_text("factory")
    if (name is None) == (factory is None):
        raise ConfigError("model: give exactly one of model.name (a zoo model: mlp, resnet, gpt, vgg19, resnet152) "
                          "and model.factory ('package.module:function')")
    return ModelConfig(name=name, factory=factory, args=m.mapping("args"), init=init)


# What each built-in data set reads from data.args (hetpipe/datasets.py).
BUILTIN_DATA_ARGS: dict[str, tuple[str, ...]] = {
    "synthetic": ("rows", "seed", "features", "classes", "vocab", "context"), "npz": (), "digits": ()}


def _parse_data(d: Section) -> DataConfig:
    d.check_known(("name", "factory", "eval_factory", "eval_fraction", "path", "batch_size", "shuffle", "workers",
                   "args"))
    default = DataConfig()
    factory = d.optional_text("factory")
    if factory is not None and d.get("name") is not None:
        raise ConfigError("data: give data.name (a built-in) or data.factory ('package.module:function'), not both")
    # A path names an npz: only npz reads one, so without a name it is npz, and beside another it is refused.
    has_path = d.get("path") is not None
    implied = "npz" if has_path else str(default.name)
    name = d.choice("name", implied, ("synthetic", "npz", "digits")) if factory is None else None
    if name != "npz" and has_path:
        raise ConfigError(f"data.path: only data.name npz reads a file, and this job's data is "
                          f"{'data.factory ' + factory if factory else 'data.name ' + str(name)}: "
                          "drop data.path, or use name: npz")
    args = d.mapping("args")
    if name is not None:   # a factory takes what its signature says (checked when it is called)
        taken = BUILTIN_DATA_ARGS[name]
        if not taken and args:
            raise ConfigError(f"data.args: data.name {name} takes none, got {sorted(args, key=str)[:5]}")
        Section(args, "data.args").check_known(taken)
    eval_factory = d.optional_text("eval_factory")
    eval_fraction = d.number("eval_fraction", default.eval_fraction, maximum=0.9)
    if eval_factory is not None and eval_fraction > 0:
        raise ConfigError("data: give data.eval_factory or data.eval_fraction for the held-out set, not both")
    return DataConfig(
        name=name, factory=factory, eval_factory=eval_factory, eval_fraction=eval_fraction,
        path=d.text("path") if name == "npz" else None,   # refused above beside any other source
        batch_size=d.integer("batch_size", default.batch_size, minimum=1, maximum=1 << 20),
        shuffle=d.flag("shuffle", default.shuffle), workers=d.integer("workers", default.workers, maximum=64),
        args=args,
    )


def _parse_profile(raw: Any, steps: int) -> ProfileConfig | None:
    if raw is None:
        return None
    p, d = Section(raw, "output.profile"), ProfileConfig()
    p.check_known(("after", "steps"))
    after = p.integer("after", d.after, maximum=MAX_STEPS)
    profiled = p.integer("steps", d.steps, minimum=1, maximum=MAX_STEPS)
    if after + profiled > steps:
        raise fail("output.profile.steps", profiled, f"at most train.steps - after ({steps} - {after}): the "
                   "profiled minibatches must be trained")
    return ProfileConfig(after=after, steps=profiled)


def _parse_eval(raw: Any) -> EvalConfig | None:
    if raw is None:
        return None
    e, d = Section(raw, "eval"), EvalConfig()
    e.check_known(("every", "rows"))
    # None (left out, or from to_json) is the default: only rows given say how many must be read.
    rows = None if e.raw.get("rows") is None else e.integer("rows", 0, minimum=1)
    return EvalConfig(every=e.integer("every", d.every, maximum=MAX_STEPS), rows=rows)


def _check_together(job: JobConfig) -> None:
    """Checks between keys: what `hetpipe plan` must refuse because `hetpipe run` would."""
    par = job.parallel
    check_sync(job.parallel, job.train.checkpoint_every)
    if job.output.ledger and not job.output.trace:
        raise ConfigError("output.ledger: the ledger is written into the trace (trace/acked_vw*_stage*.pt); "
                          "set output.trace: true too, or leave output.ledger out")
    if par.mode != "hetpipe" and job.train.precision == "fp16":
        raise ConfigError(f"train.precision: fp16 needs loss scaling, which HetPipe's stages do and parallel.mode "
                          f"{par.mode} does not; use bf16 or fp32")
    if par.mode != "hetpipe" and job.train.checkpoint_every:   # a baseline saves no cut, and resumes from none
        raise ConfigError(f"train.checkpoint_every: parallel.mode {par.mode} writes no checkpoints; leave it 0, "
                          "or run parallel.mode hetpipe")
    if par.mode != "hetpipe" and job.output.profile is not None:   # its workers ran no profiler, and said nothing
        raise ConfigError(f"output.profile: parallel.mode {par.mode} writes no profile (torch.profiler runs in "
                          "HetPipe's stages); leave it out, or run parallel.mode hetpipe")
    if par.mode == "ddp" and par.schedule != "hetpipe":
        raise ConfigError(f"parallel.schedule: {par.schedule} needs a pipeline; parallel.mode ddp has none")
    if par.mode == "torch-pipeline" and job.eval is not None:  # silently without eval_loss otherwise
        raise ConfigError("eval: parallel.mode torch-pipeline does not evaluate (its ranks each hold part of the "
                          "model); leave the eval section out, or run parallel.mode hetpipe or ddp")
    if par.mode == "torch-pipeline" and par.schedule == "nf1b":
        raise ConfigError("parallel.schedule: nf1b runs on HetPipe's own stages (parallel.mode hetpipe); "
                          "torch's pipelining has gpipe and 1f1b")
    m, b, k = par.microbatches, job.data.batch_size, par.stages_per_vw
    if par.mode == "torch-pipeline" or par.schedule in MICRO_SCHEDULES:
        if b % m:
            raise ConfigError(f"parallel.microbatches: {m} must divide data.batch_size {b} "
                              "(equal micro-batches keep the update that of the whole minibatch)")
        if par.mode == "torch-pipeline" and par.schedule == "1f1b" and m < k:
            raise ConfigError(f"parallel.microbatches: torch's Schedule1F1B needs at least one micro-batch per "
                              f"stage, got {m} for {k} stages; use {k} or more, or parallel.schedule gpipe")
    elif par.microbatches != 1:
        raise ConfigError(f"parallel.microbatches: {par.microbatches} applies to the schedules gpipe, 1f1b and nf1b "
                          f"(and parallel.mode torch-pipeline), not to schedule {par.schedule}")
    if par.mode == "hetpipe" and par.schedule in FLUSHED_SCHEDULES and par.nm != 1:
        raise ConfigError(f"parallel.nm: {par.nm}, but schedule {par.schedule} flushes the pipeline after every "
                          f"minibatch, so one is in flight (its parallel.microbatches fill the pipeline): set nm 1")
    if par.mode == "hetpipe" and par.schedule in MICRO_SCHEDULES and par.schedule not in FLUSHED_SCHEDULES:
        for key, value, why in (   # nf1b: what gpipe and 1f1b take and it does not yet
            ("train.precision", job.train.precision == "fp16",
             "fp16's loss scaling is per minibatch, which gpipe and 1f1b do"),
            ("train.max_grad_norm", job.train.max_grad_norm > 0,
             "the stages agree on it per minibatch, which gpipe and 1f1b do"),
            ("train.checkpoint_every", job.train.checkpoint_every > 0, "a cut of its minibatches in flight is not built"),
        ):
            if value:
                raise ConfigError(f"{key}: not with parallel.schedule {par.schedule} yet ({why}); "
                                  "use parallel.schedule hetpipe, gpipe or 1f1b")
    if job.train.precision != "fp32" and job.train.dtype == "float64":
        raise ConfigError(f"train.precision: {job.train.precision} computes in 16 bits; train.dtype float64 asks for "
                          "exact float64 (the oracles): use one or the other")
    if job.eval is not None and job.data.eval_factory is None and job.data.eval_fraction == 0:
        raise ConfigError("eval: evaluation needs held-out data: set data.eval_factory or data.eval_fraction")
    if job.eval is None and job.data.eval_factory is not None:
        raise ConfigError("data.eval_factory: held-out data, but no eval section evaluates it (it would be built and "
                          "checked, then never read): add eval: {every: N}, or drop data.eval_factory")
    if job.eval is None and job.data.eval_fraction > 0:
        raise ConfigError("data.eval_fraction: rows held out, but no eval section evaluates them (they would only "
                          "be withheld from training): add eval: {every: N}, or drop data.eval_fraction")
    if job.cluster is not None:
        gpus = sum(g.count for n in job.cluster.nodes for g in n.gpus)
        need = par.virtual_workers * par.stages_per_vw if par.mode == "hetpipe" else 1
        if gpus < need:
            raise ConfigError(f"parallel: {par.virtual_workers} virtual workers x {par.stages_per_vw} stages need "
                              f"{need} GPUs, the cluster has {gpus}")


def check_coordinated(job: JobConfig, runner: str, *, containers: bool = False, cuts: bool = False) -> None:
    """ConfigError for what a job that a coordinator runs, not `hetpipe run` (runner says which),
    cannot do: be a baseline (parallel.mode ddp, torch-pipeline; the coordinator would run HetPipe
    instead), or checkpoint where nothing resumes from the cuts (cuts: the runner does, as a
    coordinator's --job does after a restart). containers: every process in a container of its
    own (compose, k8s), so none shares memory with another."""
    par = job.parallel
    if par.mode != "hetpipe":
        raise ConfigError(f"parallel.mode: {par.mode} is a baseline that `hetpipe run` runs on this machine only; "
                          f"{runner} runs parallel.mode hetpipe only")
    if job.train.checkpoint_every and not cuts:
        raise ConfigError(f"train.checkpoint_every: {job.train.checkpoint_every}, but a job run by {runner} cannot "
                          "checkpoint: nothing there resumes from its cuts (a coordinator's --job, compose's and "
                          "k8s's, does); set it to 0")
    if containers and par.transport == "shm":
        raise ConfigError(f"parallel.transport: shm, but {runner} puts every process in a container of its own, "
                          "with its own /dev/shm: no two can share memory; set auto or grpc")


def _parse_security(raw: Any) -> Security | None:
    if raw is None:
        return None
    sec = Section(raw, "security")
    sec.check_known(("tls", "token_file"))
    token = sec.optional_text("token_file") or ""
    if sec.get("tls") is None:
        if not token:  # a section that secures nothing must not turn off the per-run token
            raise ConfigError("security: give token_file, tls or both (leave the section out for a local "
                              "run's per-run token)")
        return Security(token_file=token)
    tls = sec.section("tls")
    tls.check_known(("cert", "key", "ca"))
    return Security(cert=tls.text("cert"), key=tls.text("key"), ca=tls.text("ca"), token_file=token)


def parse_job(raw: Mapping[str, Any], *, base_dir: str | None = ".") -> JobConfig:
    """Validates a job mapping (the YAML's content) into a JobConfig. base_dir None: take the
    job's own base_dir key (a job that travelled as JSON)."""
    top = Section(raw, "")
    # base_dir is where a job file lies, not a key of one: only a job that travelled as JSON holds it.
    top.check_known(("cluster", "model", "data", "eval", "train", "parallel", "output", "security",
                     *(("base_dir",) if base_dir is None else ())))
    out, do = top.section("output"), OutputConfig()
    out.check_known(("dir", "trace", "ledger", "max_shard_bytes", "profile"))
    train = parse_train(top.section("train"))
    job = JobConfig(
        model=_parse_model(top.section("model")),
        data=_parse_data(top.section("data")),
        train=train,
        parallel=parse_parallel(top.section("parallel")),
        output=OutputConfig(dir=out.text("dir", do.dir), trace=out.flag("trace", do.trace),
                            ledger=out.flag("ledger", do.ledger),
                            max_shard_bytes=out.integer("max_shard_bytes", do.max_shard_bytes, minimum=1 << 10),
                            profile=_parse_profile(out.get("profile"), train.steps)),
        eval=_parse_eval(top.get("eval")),
        cluster=parse_cluster(top.get("cluster"), max_gpus=MAX_VIRTUAL_WORKERS * MAX_STAGES),
        security=_parse_security(top.get("security")),
        base_dir=top.text("base_dir", ".") if base_dir is None else base_dir,
    )
    _check_together(job)
    return job


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """PyYAML's error in one line: where, what, and within what (its own message takes several,
    each naming the text as "<unicode string>")."""
    mark, problem = getattr(exc, "problem_mark", None), getattr(exc, "problem", None)
    if mark is None or problem is None:
        return " ".join(str(exc).split())
    context, at = getattr(exc, "context", None), getattr(exc, "context_mark", None)
    within = f" ({context} at line {at.line + 1})" if context and at is not None else ""
    return f"line {mark.line + 1}, column {mark.column + 1}: {problem}{within}"


def load_job(path: str | Path, settings: Sequence[str] = ()) -> JobConfig:
    """Reads and validates a job YAML file, with `--set KEY=VALUE` settings applied in order."""
    path = Path(path)
    try:
        loader = JobLoader(path.read_text())
        try:
            raw = loader.get_single_data()
        finally:
            loader.dispose()
    except ConfigError:
        raise  # a key given twice, already named; not the ValueError below
    except FileNotFoundError:
        raise ConfigError(f"job file {path} does not exist") from None
    except IsADirectoryError:
        raise ConfigError(f"job file {path} is a directory") from None
    except OSError as exc:   # unreadable, a path through a file
        raise ConfigError(f"job file {path} cannot be read ({exc.strerror or type(exc).__name__})") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"job file {path} is not valid YAML: {_yaml_problem(exc)}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"job file {path} is not UTF-8 text (byte {exc.start})") from None
    except (ValueError, RecursionError) as exc:  # an integer of too many digits; nesting past the stack
        raise ConfigError(f"job file {path} cannot be read: {type(exc).__name__}: {str(exc)[:200]}") from None
    raw = raw or {}
    for setting in settings:
        raw = with_setting(raw, setting)
    try:
        return parse_job(raw, base_dir=str(path.resolve().parent))
    except ConfigError as exc:
        # What a --set setting gave (its key, or within its value) has no line in the file.
        named = str(exc).split(":", 1)[0]
        if any(named == g or named.startswith((g + ".", g + "[")) for g in (s.partition("=")[0].strip() for s in settings)):
            raise
        raise ConfigError(at_line(str(exc), str(path), getattr(loader, "key_lines", {}))) from None


def with_setting(raw: Any, setting: str) -> dict[str, Any]:
    """A job mapping with one `--set KEY=VALUE` in it: KEY a dotted path into the job file
    (train.optimizer.lr), VALUE read as the job file's YAML (0.001, [256, 256], null). A missing
    section is made; a key that is not one is refused later, by parse_job, by name. Only the
    mappings on KEY's path are copied: the rest, aliases included, stays as the file had it."""
    if not isinstance(raw, Mapping):
        raise fail("job file", raw, "a mapping")
    key, sep, text = setting.partition("=")
    parts = key.strip().split(".")
    if not sep or not all(parts):
        raise ConfigError(f"--set {setting[:200]!r}: expected KEY=VALUE, KEY a dotted path such as train.optimizer.lr")
    key = ".".join(parts)
    try:
        value = yaml.load(text, Loader=JobLoader)
    except ConfigError as exc:   # a key given twice inside VALUE
        raise ConfigError(f"--set {key}: {exc}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"--set {key}: {text[:200]!r} is not a YAML value ({exc})") from None
    except (ValueError, RecursionError) as exc:   # an integer of too many digits; nesting past the stack
        raise ConfigError(f"--set {key}: cannot be read: {type(exc).__name__}: {str(exc)[:200]}") from None
    out = dict(raw)
    node = out
    for depth, part in enumerate(parts[:-1], start=1):
        child = node.get(part)
        if child is None:
            child = {}
        elif not isinstance(child, Mapping):
            raise fail(f"--set {key}: {'.'.join(parts[:depth])}", child, "a mapping")
        copied = dict(child)
        node[part] = copied
        node = copied
    node[parts[-1]] = value
    return out


def with_overrides(job: JobConfig, **sections: Mapping[str, Any]) -> JobConfig:
    """A copy of job with fields of named sections replaced, e.g. parallel={'nm': 4}."""
    changes = {name: dataclasses.replace(getattr(job, name), **fields) for name, fields in sections.items()}
    return dataclasses.replace(job, **changes)

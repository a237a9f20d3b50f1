"""The job file's parallel section (DESIGN §8): how a job is split (virtual workers, stages, Nm,
D, shards), its mode, schedule and sync, and how its tensors travel between processes. Pure: no
torch."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from hetpipe.training import MAX_STEPS
from hetpipe.validate import ConfigError, Section, fail, is_number

MODES = ("hetpipe", "ddp", "torch-pipeline")
SCHEDULES = ("hetpipe", "gpipe", "1f1b", "nf1b")
MICRO_SCHEDULES = ("gpipe", "1f1b", "nf1b")  # split each minibatch into parallel.microbatches
FLUSHED_SCHEDULES = ("gpipe", "1f1b")        # one minibatch in flight: its update before the next
SYNCS = ("wsp", "quorum", "elastic")
TRANSPORTS = ("auto", "grpc", "shm")
SYNC_ARGS = {"wsp": (), "quorum": ("quorum",), "elastic": ("alpha", "period")}
# EA-Pipe's setting for its largest experiment (ImageNet): elastic force 0.1, an exchange after every
# wave. Its analysis takes 0 < alpha < 1; above 0.5 one exchange overshoots (the replica and the
# master swap sides: their difference is scaled by 1 - 2*alpha < 0), and the paper tried <= 0.5.
ELASTIC_ALPHA = 0.1
ELASTIC_PERIOD = 1
MAX_ELASTIC_ALPHA = 0.5
POLICIES = ("NP", "ED", "HD", "auto")
# Bounds that keep a job file from asking the planner or the workers for the absurd.
MAX_VIRTUAL_WORKERS = 1024
MAX_STAGES = 256
MAX_NM = 1024
MAX_SHARDS = 256


@dataclass(frozen=True, slots=True)
class ParallelConfig:
    virtual_workers: int = 1
    stages_per_vw: int = 2
    policy: str = "ED"
    nm: int | str = 2          # an integer, or "auto": the planner picks (ResolvedJob has it decided)
    D: int = 0
    ps_shards: int = 1
    placement: str = "default"
    mode: str = "hetpipe"
    schedule: str = "hetpipe"
    sync: str = "wsp"
    # parallel.sync's arguments, normalised (defaults filled in): quorum {quorum: majority | all |
    # an integer}, elastic {alpha, period}, wsp none. `sync_settings` has them typed.
    sync_args: Mapping[str, Any] = field(default_factory=dict)
    microbatches: int = 1      # schedules gpipe, 1f1b, nf1b (and mode torch-pipeline): micro-batches per minibatch
    on_vw_failure: str = "fail"  # continue: a VW whose stage fails leaves, the others train on
    transport: str = "auto"    # tensors between processes on one host: auto (shared memory), grpc, shm (required)

    @property
    def started_shards(self) -> int:
        """The parameter-server shards a job starts: none for a lone VW (its weights are w_global)
        nor for a baseline (ddp, torch-pipeline: VW 0 alone)."""
        return self.ps_shards if self.virtual_workers > 1 and self.mode == "hetpipe" else 0

    @property
    def sync_settings(self) -> SyncSettings:
        """sync_args typed, defaults filled in (quorum 0: a majority of the VWs still in the job)."""
        args = self.sync_args
        quorum = args.get("quorum", "majority")
        return SyncSettings(quorum=0 if quorum == "majority" else self.virtual_workers if quorum == "all" else int(quorum),
                            alpha=float(args.get("alpha", ELASTIC_ALPHA)), period=int(args.get("period", ELASTIC_PERIOD)))


@dataclass(frozen=True, slots=True)
class SyncSettings:
    """parallel.sync_args, typed: what the shards and stages of a quorum or elastic job are given."""

    quorum: int                 # quorum: on-time VWs that close a round; 0: a majority of the live VWs
    alpha: float                # elastic: the elastic force
    period: int                 # elastic: waves between a VW's exchanges with the master


def parse_parallel(p: Section) -> ParallelConfig:
    p.check_known(tuple(f.name for f in dataclasses.fields(ParallelConfig)))
    d = ParallelConfig()
    nm: int | str = "auto" if p.get("nm") == "auto" else p.integer("nm", int(d.nm), minimum=1, maximum=MAX_NM)
    schedule = p.choice("schedule", d.schedule, SCHEDULES)
    if schedule in FLUSHED_SCHEDULES and (nm == "auto" or p.get("nm") is None):
        nm = 1  # one minibatch in flight: there is nothing to pick (left out, not the default 2)
    return ParallelConfig(
        virtual_workers=p.integer("virtual_workers", d.virtual_workers, minimum=1, maximum=MAX_VIRTUAL_WORKERS),
        stages_per_vw=p.integer("stages_per_vw", d.stages_per_vw, minimum=1, maximum=MAX_STAGES),
        policy=p.choice("policy", d.policy, POLICIES), nm=nm, D=p.integer("D", d.D, maximum=MAX_STEPS),
        ps_shards=p.integer("ps_shards", d.ps_shards, minimum=1, maximum=MAX_SHARDS),
        placement=p.choice("placement", d.placement, ("default", "local")),
        mode=p.choice("mode", d.mode, MODES),
        schedule=schedule,
        sync=p.choice("sync", d.sync, SYNCS),
        sync_args=_parse_sync_args(p, p.choice("sync", d.sync, SYNCS)),
        microbatches=p.integer("microbatches", d.microbatches, minimum=1, maximum=1 << 20),
        on_vw_failure=p.choice("on_vw_failure", d.on_vw_failure, ("fail", "continue")),
        transport=p.choice("transport", d.transport, TRANSPORTS),
    )


def _parse_sync_args(p: Section, sync: str) -> dict[str, Any]:
    """parallel.sync_args for `sync`, normalised: every key of its mode, none of another's."""
    args = p.section("sync_args")
    known = SYNC_ARGS[sync]
    unknown = sorted(set(args.raw) - set(known), key=str)
    if unknown:
        owner = next((f"; it is an argument of parallel.sync {m}" for m, keys in SYNC_ARGS.items() if unknown[0] in keys), "")
        takes = f"takes {', '.join(known)}" if known else "takes no sync_args"
        raise ConfigError(f"parallel.sync_args.{unknown[0]}: unknown key: parallel.sync {sync} {takes}{owner}")
    if sync == "quorum":
        quorum = args.get("quorum", "majority")
        if quorum == "solo":
            quorum = 1
        if quorum not in ("majority", "all") and (isinstance(quorum, bool) or not isinstance(quorum, int) or quorum < 1):
            raise fail("parallel.sync_args.quorum", quorum, "majority, all, solo or an integer >= 1 (the on-time "
                       "virtual workers that close a round)")
        return {"quorum": quorum}
    if sync == "elastic":
        alpha = args.get("alpha", ELASTIC_ALPHA)
        if not is_number(alpha) or not 0 < alpha <= MAX_ELASTIC_ALPHA:
            raise fail("parallel.sync_args.alpha", alpha, f"a number in (0, {MAX_ELASTIC_ALPHA}] (the elastic force; "
                       "above 0.5 an exchange overshoots: the replica and the master swap sides)")
        return {"alpha": float(alpha), "period": args.integer("period", ELASTIC_PERIOD, minimum=1, maximum=MAX_STEPS)}
    return {}


def check_sync(par: ParallelConfig, checkpoint_every: int) -> None:
    """parallel.sync quorum and elastic: the combinations that make no sense, refused."""
    if par.sync == "wsp":
        return
    if par.mode != "hetpipe":
        raise ConfigError(f"parallel.sync: {par.sync} runs on HetPipe's virtual workers and parameter servers "
                          f"(parallel.mode hetpipe); parallel.mode {par.mode} has only sync wsp")
    if par.virtual_workers < 2:
        raise ConfigError(f"parallel.sync: {par.sync} needs 2 or more parallel.virtual_workers (a lone virtual worker "
                          "trains without parameter servers); use sync wsp")
    quorum = par.sync_args.get("quorum")
    if isinstance(quorum, int) and quorum > par.virtual_workers:
        raise ConfigError(f"parallel.sync_args.quorum: {quorum} is more than the {par.virtual_workers} virtual "
                          "workers: no round could ever close")
    if par.sync == "elastic" and par.D != 0:
        raise ConfigError(f"parallel.D: {par.D} has no meaning under parallel.sync elastic (elastic averaging: no "
                          "virtual worker waits for another); leave D at 0")
    if checkpoint_every:
        held = "the open quorum rounds" if par.sync == "quorum" else "the master's exchange counts and deltas"
        raise ConfigError(f"train.checkpoint_every: not with parallel.sync {par.sync} yet: a checkpoint does not "
                          f"hold {held}; use sync wsp or checkpoint_every 0")

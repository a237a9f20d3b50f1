"""What a planned stage costs in time: its emulated task times, the emulated network's transfers,
and what the same-host paths (links, pushes, pulls) add on top; and the simulator's prediction
from them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hetpipe.config import JobConfig
from hetpipe.models import trainable
from hetpipe.network import shard_node
from coordinator.planner.partition import Partition, StageCut
from coordinator.planner.placement import home_shards, place_keys
from coordinator.planner.profile import ModelProfile
from coordinator.planner.simulator import SimStage, simulate

# Minibatches the simulator runs per VW to predict steady-state throughput.
SIM_STEPS = 64
# A stage-to-stage message on one host costs about this, the receiving compute thread's wake-up
# included (bench/pipeline.py at k=4, Nm=4 over the link socket: 1.39-1.52 ms a hop, 2026-12-01;
# 4.8 ms over gRPC before it); charged per send.
LOOPBACK_SEND_S = 0.0015
# A push or pull through a shard on the same host: a fixed cost plus the bytes at what the shard
# path sustains (shared memory, the push log, the scan and the add). Fitted to the sync traces of
# 2026-12-01 on the 2-core development machine: a 2.2 MB stage's push 7 ms and its pull reply 1 ms
# (bench/prediction.py), a 12.9 MB one's 11.4 and 4 ms (bench/sync_latency.py over bench/peers.py's
# 2x1 job). On an H200's host a stage of 236 MB in float32, pushed in bf16, took about 115 ms a
# push (py-spy, 2026-11-30): the shard's widening add costs what the halved bytes save; this says 115.
LOOPBACK_PUSH_S = 0.005
LOOPBACK_PULL_S = 0.001
LOOPBACK_PUSH_BYTES_PER_S = 2 * 2**30
LOOPBACK_PULL_BYTES_PER_S = 4 * 2**30


def loopback_sync_seconds(nbytes: int) -> tuple[float, float]:
    """(push, pull reply) seconds for a stage with nbytes of parameters, shards on loopback. The
    shards are asked in parallel: one round trip, the bytes on one path."""
    return (LOOPBACK_PUSH_S + nbytes / LOOPBACK_PUSH_BYTES_PER_S,
            LOOPBACK_PULL_S + nbytes / LOOPBACK_PULL_BYTES_PER_S)


def time_scale(job: JobConfig) -> float:
    return job.emulate.time_scale if job.emulate else 1.0


@dataclass(frozen=True, slots=True)
class Transfers:
    """One stage's emulated network time per transfer (0 without an emulated network)."""

    next_send: float = 0.0
    prev_send: float = 0.0
    push: float = 0.0
    pull: float = 0.0


class StageCosts:
    """Costs of the stages of one job's plans: the emulated task times the runtime pads to, the
    emulated network's time per transfer (from link bandwidth, latency and the emulated model's
    bytes), and what the same-host paths add for the real model's bytes."""

    def __init__(self, job: JobConfig, profile: ModelProfile, model: torch.nn.Sequential,
                 emulated_model: torch.nn.Sequential) -> None:
        self.job, self.profile, self.model = job, profile, model
        self.network = job.emulate.network if job.emulate else None
        self.scale = time_scale(job)
        self.nodes = [n.name for n in job.cluster.nodes] if job.cluster else []
        itemsize = getattr(torch, job.train.dtype).itemsize
        # What a stage pushes and pulls: its trained parameters (frozen ones never leave it).
        self.real_bytes = {name: p.numel() * itemsize for name, p in trainable(model)}
        self.emulated_bytes = {name: p.numel() * itemsize for name, p in trainable(emulated_model)}
        # Parameter names per layer, once: every candidate plan asks for every stage's bytes.
        self.layer_params: list[list[str]] = [[] for _ in range(len(model))]
        for name in self.real_bytes:
            self.layer_params[int(name.split(".", 1)[0])].append(name)

    def task_seconds(self, cut: StageCut) -> tuple[float, float]:
        """(forward, backward) seconds the runtime pads this stage's tasks to; (0, 0) unemulated.
        Fixed times (cluster.emulate.forward_seconds/backward_seconds) override the catalog's."""
        emulate = self.job.emulate
        if emulate is None or cut.gpu.type in ("cpu", "cuda"):
            return 0.0, 0.0
        if emulate.fixed_times:
            return emulate.forward_seconds, emulate.backward_seconds
        return cut.forward_seconds * self.scale, cut.backward_seconds * self.scale

    def compute_seconds(self, cut: StageCut) -> tuple[float, float]:
        """(forward, backward) seconds a task of this stage is predicted to take: the padded time
        on an emulated GPU, else the profile's (measured on this machine's own device)."""
        if self.job.emulate is None or cut.gpu.type in ("cpu", "cuda"):
            return cut.forward_seconds, cut.backward_seconds
        return self.task_seconds(cut)

    def key_shard(self, parts: Sequence[Partition]) -> dict[str, int]:
        cuts = parts[0].stages
        home = home_shards([c.gpu.node for c in cuts], self.nodes)
        return place_keys(self.model, [(c.layer_begin, c.layer_end) for c in cuts],
                          self.job.parallel.ps_shards, self.job.parallel.placement, home)

    def _per_shard(self, cut: StageCut, key_shard: dict[str, int], sizes: dict[str, int]) -> dict[int, int]:
        out: dict[int, int] = {}
        for layer in range(cut.layer_begin, cut.layer_end):
            for key in self.layer_params[layer]:
                out[key_shard[key]] = out.get(key_shard[key], 0) + sizes[key]
        return out

    def transfers(self, part: Partition, key_shard: dict[str, int]) -> list[Transfers]:
        """Per stage of a VW: the emulated network's time for each kind of transfer. A stage's
        traffic to all shards shares its one network interface, so its per-shard times add up."""
        net, cuts = self.network, part.stages
        if net is None:
            return [Transfers()] * len(cuts)
        shards = [shard_node(i, self.nodes) for i in range(self.job.parallel.ps_shards)]
        layers = self.profile.layers

        def send(a: StageCut, b: StageCut, layer: int) -> float:
            return net.link(a.gpu.node, b.gpu.node, self.scale).seconds(layers[layer].output_bytes)

        out = []
        synced = self.job.parallel.virtual_workers > 1  # a lone VW runs without shards
        for q, cut in enumerate(cuts):
            nxt = send(cut, cuts[q + 1], cut.layer_end - 1) if q + 1 < len(cuts) else 0.0
            prv = send(cut, cuts[q - 1], cut.layer_begin - 1) if q > 0 else 0.0
            ps = sum(net.link(cut.gpu.node, shards[i], self.scale).seconds(n)
                     for i, n in self._per_shard(cut, key_shard, self.emulated_bytes).items()) if synced else 0.0
            out.append(Transfers(nxt, prv, ps, ps))
        return out

    def sim_stages(self, parts: Sequence[Partition]) -> list[list[SimStage]]:
        """The simulator's stages: times as the runtime pads them, transfers included."""
        key_shard = self.key_shard(parts)
        vws = []
        for part in parts:
            stages = []
            for cut, emulated in zip(part.stages, self.transfers(part, key_shard)):
                forward, backward = self.compute_seconds(cut)
                push, pull = loopback_sync_seconds(sum(self._per_shard(cut, key_shard, self.real_bytes).values()))
                stages.append(SimStage(forward, backward, LOOPBACK_SEND_S + emulated.next_send,
                                       push_seconds=push + emulated.push, pull_seconds=pull + emulated.pull))
            vws.append(stages)
        return vws

    def predict(self, parts: Sequence[Partition], nm: int) -> tuple[float, float]:
        """Predicted samples/s and total wait (seconds over all VWs) of these VW pipelines at nm."""
        steps = min(self.job.train.steps, SIM_STEPS)
        sim = simulate(self.sim_stages(parts), nm=nm, D=self.job.parallel.D, steps=steps)
        return sim.minibatches_per_second * self.job.data.batch_size, sum(sim.wait_seconds)

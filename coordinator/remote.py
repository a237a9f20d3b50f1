"""A job submitted from another host (`hetpipe run JOB --coordinator`): its cluster taken from the
registered workers, its outputs placed under the coordinator's --output-root, and those outputs
cut into chunks for the client that submitted it."""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

from hetpipe import outputs
from hetpipe.cluster import ClusterConfig, EmulateConfig, GpuGroup, NodeConfig
from hetpipe.config import ConfigError, JobConfig
from hetpipe.v1 import coordinator_pb2
from hetpipe.rpc import CHUNK_BYTES

Role = coordinator_pb2.WorkerInfo.Role
# What a client gets back: the final weights (one file or transformers' shards and index), the
# summary and the evaluations (the weights' shards: outputs.SHARD_FILE). Logs, traces and shard
# state stay on the hosts that wrote them.
RESULT_FILES = ("model.safetensors", outputs.INDEX_FILE, "summary.json", "eval.jsonl")
_NAME = re.compile(r"[^A-Za-z0-9._-]")


def free_stage_workers(entries: Iterable[coordinator_pb2.WorkerList.Entry]) -> list[coordinator_pb2.WorkerInfo]:
    """The stage workers a new job may claim: alive, not serving a job, not spent by one."""
    return [e.info for e in entries
            if e.info.role == Role.STAGE_WORKER and e.alive and not e.assigned and not e.spent]


def cluster_from_workers(entries: Iterable[coordinator_pb2.WorkerList.Entry]) -> ClusterConfig | None:
    """The cluster section of the registered stage workers (ListWorkers' entries): one node per
    --node, with each GPU type counted; cluster.emulate (time_scale 1) when they are emulated, that
    is they compute on the CPU while standing for a catalog type.

    Workers registered without a type (a CPU, or a GPU the catalog does not know) are generic:
    None when every worker is, and the planner then plans for the coordinator's own kind of
    device. Beside typed workers they are left out. ConfigError if real GPUs and emulated ones
    are mixed: a job runs either way, not both."""
    typed = [w for w in free_stage_workers(entries) if w.gpu_type]
    if not typed:
        return None
    emulated = sorted({f"{w.gpu_type} on {w.node}" for w in typed if w.device == "cpu"})
    real = sorted({f"{w.gpu_type} on {w.node}" for w in typed if w.device != "cpu"})
    if emulated and real:
        raise ConfigError(f"cluster: the registered stage workers mix emulated GPUs ({', '.join(emulated[:3])}) and "
                          f"real ones ({', '.join(real[:3])}); a job runs on one kind: stop the others, or give the "
                          "job a cluster section naming the nodes it should use")
    counts: dict[str, dict[str, int]] = {}
    for w in typed:
        per_node = counts.setdefault(w.node, {})
        per_node[w.gpu_type] = per_node.get(w.gpu_type, 0) + 1
    nodes = tuple(NodeConfig(name=node, gpus=tuple(GpuGroup(t, n) for t, n in sorted(types.items())))
                  for node, types in sorted(counts.items()))
    return ClusterConfig(nodes=nodes, emulate=EmulateConfig() if emulated else None)


def describe(cluster: ClusterConfig) -> str:
    """'2 x t4 on hosta, 1 x t4 on hostb (emulated)': a cluster section in one line."""
    gpus = ", ".join(f"{g.count} x {g.type} on {n.name}" for n in cluster.nodes for g in n.gpus)
    return gpus + (" (emulated, cluster.emulate time_scale 1)" if cluster.emulate is not None else "")


def output_name(job: JobConfig) -> str:
    """The folder a submitted job's outputs get under --output-root: its output.dir's last part,
    reduced to a plain name (the client's path means nothing on this host)."""
    name = _NAME.sub("_", Path(job.output.dir).name)
    return name if name.strip(".") else "job"


def place_outputs(job: JobConfig, output_root: str | Path) -> JobConfig:
    """job with output.dir under output_root, as an absolute path on this host."""
    out = Path(os.path.abspath(output_root)) / output_name(job)
    return dataclasses.replace(job, output=dataclasses.replace(job.output, dir=str(out)))


def result_files(out_dir: Path) -> list[Path]:
    """The files of out_dir a client gets back (RESULT_FILES and weight shards), regular files only."""
    found = []
    for path in sorted(out_dir.iterdir()) if out_dir.is_dir() else []:
        if (path.name in RESULT_FILES or outputs.SHARD_FILE.fullmatch(path.name)) and path.is_file() and not path.is_symlink():
            found.append(path)
    return found


def result_chunks(out_dir: Path, skip_files: int = 0, offset: int = 0,
                  chunk_bytes: int = CHUNK_BYTES) -> Iterator[tuple[str, int, bytes, bool]]:
    """(name, offset, data, last) for every result file after the first skip_files, in order,
    chunk_bytes at a time, the first from byte offset; an empty file is one empty last chunk.
    ValueError (before any chunk) for a point past the files or past the end of its file."""
    files = result_files(out_dir)
    if skip_files > len(files) or (skip_files == len(files) and offset):
        raise ValueError(f"skip_files {skip_files}, offset {offset}: there are {len(files)} result files")
    sizes = [path.stat().st_size for path in files[skip_files:]]
    if sizes and offset > sizes[0]:
        raise ValueError(f"offset {offset}: {files[skip_files].name} has {sizes[0]} bytes")
    for path, size in zip(files[skip_files:], sizes):
        with open(path, "rb") as f:
            f.seek(offset)
            while True:
                data = f.read(chunk_bytes)
                last = offset + len(data) >= size or not data
                yield path.name, offset, data, last
                offset += len(data)
                if last:
                    break
        offset = 0

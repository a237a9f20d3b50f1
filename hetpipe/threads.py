"""How many intra-op threads each process a launcher starts on one machine gets: torch-free, so
that a launcher (`hetpipe worker`, which runs no model) never imports torch for it."""

from __future__ import annotations

import os

from hetpipe.validate import ConfigError

THREADS_ENV = "HETPIPE_THREADS"
PS_THREADS_ENV = "HETPIPE_PS_THREADS"


def env_threads(env: str) -> int | None:
    """The thread count set in env (HETPIPE_THREADS, HETPIPE_PS_THREADS), None where unset;
    ConfigError naming it where it is not a whole number of at least 1."""
    raw = os.environ.get(env, "").strip()
    if not raw:
        return None
    if not raw.isdecimal() or int(raw) < 1:
        raise ConfigError(f"{env}={raw!r}: expected a whole number of threads, at least 1")
    return int(raw)


def threads_for(processes: int) -> str:
    """Intra-op threads of each of `processes` compute processes sharing this machine: the user's
    HETPIPE_THREADS, else the cores split evenly (oversubscribed threads only slow them all)."""
    return str(env_threads(THREADS_ENV) or max(1, (os.cpu_count() or 1) // max(1, processes)))


def thread_split(cpu_stages: int, gpu_stages: int, shards: int) -> tuple[str, str]:
    """Intra-op threads of each stage and of each shard on one machine (HETPIPE_THREADS and
    HETPIPE_PS_THREADS override them).

    Beside a stage that computes on the CPU a shard takes one core: the stages' compute is the
    machine's work. Beside GPU stages alone, the CPU's work is the shards': every push and pull is
    a few passes over the update (scan, add, copies; 0.1 s a pass for 117.8M floats on one core),
    which their threads split. Each process gets an even share of the cores, and the shards
    take the cores the stages leave as well."""
    cores = os.cpu_count() or 1
    shard_threads = env_threads(PS_THREADS_ENV)
    if cpu_stages:
        return threads_for(cpu_stages + gpu_stages), str(shard_threads or 1)
    share = max(1, cores // max(1, gpu_stages + shards))
    spare = max(1, (cores - share * gpu_stages) // max(1, shards))
    return str(env_threads(THREADS_ENV) or share), str(shard_threads or spare)

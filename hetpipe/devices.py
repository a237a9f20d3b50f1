"""This machine's compute devices: what there is, and which one a worker computes on."""

from __future__ import annotations

from dataclasses import dataclass

import psutil
import torch


@dataclass(frozen=True, slots=True)
class Device:
    name: str           # "cpu" or "cuda:N"
    label: str          # what the hardware calls itself, e.g. "NVIDIA H100 80GB HBM3"
    memory_bytes: int

    @property
    def kind(self) -> str:
        """'cuda' or 'cpu': the measured device types of the planner."""
        return "cuda" if self.name.startswith("cuda") else "cpu"


def local_devices() -> list[Device]:
    """Every CUDA device here, in index order; without CUDA, the CPU with the machine's memory."""
    if torch.cuda.is_available():
        out = []
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            out.append(Device(f"cuda:{i}", props.name, int(props.total_memory)))
        return out
    return [Device("cpu", "cpu", int(psutil.virtual_memory().total))]


def pick(requested: str) -> Device:
    """The device a worker computes on: `requested` ("cpu", "cuda:N"), or the first one here.

    Raises ValueError naming the request when this machine has no such device.
    """
    devices = local_devices()
    if not requested:
        return devices[0]
    if requested == "cpu":
        return Device("cpu", "cpu", int(psutil.virtual_memory().total))
    for d in devices:
        if d.name == requested:
            return d
    have = ", ".join(d.name for d in devices)
    raise ValueError(f"device {requested!r}: this machine has {have}")


def make_current(device: Device) -> None:
    """Makes device the calling thread's current CUDA device; nothing on the CPU. CUDA keeps the
    current device per thread, 0 until set, so on a host of several GPUs anything that says only
    "cuda" (a user's model factory, autocast, a stream asked for without a device) would reach
    cuda:0 from a stage that computes on cuda:3."""
    if device.kind == "cuda":
        torch.cuda.set_device(device.name)


def peak_rss_bytes() -> int:
    """This process's peak resident memory (Linux reports ru_maxrss in KiB)."""
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def device_peak_bytes(device: Device) -> int:
    """Peak memory torch allocated on a CUDA device; 0 elsewhere."""
    return int(torch.cuda.max_memory_allocated(device.name)) if device.kind == "cuda" else 0


THREADS_ENV = "HETPIPE_THREADS"
PS_THREADS_ENV = "HETPIPE_PS_THREADS"


def env_threads(env: str) -> int | None:
    """The thread count set in env (HETPIPE_THREADS, HETPIPE_PS_THREADS), None where unset;
    ConfigError naming it where it is not a whole number of at least 1."""
    import os

    from hetpipe.validate import ConfigError

    raw = os.environ.get(env, "").strip()
    if not raw:
        return None
    if not raw.isdecimal() or int(raw) < 1:
        raise ConfigError(f"{env}={raw!r}: expected a whole number of threads, at least 1")
    return int(raw)


def threads_for(processes: int) -> str:
    """Intra-op threads of each of `processes` compute processes sharing this machine: the user's
    HETPIPE_THREADS, else the cores split evenly (oversubscribed threads only slow them all)."""
    import os

    return str(env_threads(THREADS_ENV) or max(1, (os.cpu_count() or 1) // max(1, processes)))


def thread_split(cpu_stages: int, gpu_stages: int, shards: int) -> tuple[str, str]:
    """Intra-op threads of each stage and of each shard on one machine (HETPIPE_THREADS and
    HETPIPE_PS_THREADS override them).

    Beside a stage that computes on the CPU a shard takes one core: the stages' compute is the
    machine's work. Beside GPU stages alone, the CPU's work is the shards': every push and pull is
    a few passes over the update (scan, add, copies; 0.1 s a pass for 117.8M floats on one core),
    which their threads split. Each process gets an even share of the cores, and the shards
    take the cores the stages leave as well."""
    import os

    cores = os.cpu_count() or 1
    shard_threads = env_threads(PS_THREADS_ENV)
    if cpu_stages:
        return threads_for(cpu_stages + gpu_stages), str(shard_threads or 1)
    share = max(1, cores // max(1, gpu_stages + shards))
    spare = max(1, (cores - share * gpu_stages) // max(1, shards))
    return str(env_threads(THREADS_ENV) or share), str(shard_threads or spare)


def set_threads(env: str = THREADS_ENV) -> None:
    """In a compute process or a shard: the thread count its launcher chose in env (one if
    started by hand)."""
    torch.set_num_threads(env_threads(env) or 1)

"""This machine's compute devices: what there is, and which one a worker computes on."""

from __future__ import annotations

from dataclasses import dataclass

import psutil
import torch

from hetpipe.threads import THREADS_ENV, env_threads


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


def set_threads(env: str = THREADS_ENV) -> None:
    """In a compute process or a shard: the thread count its launcher chose in env (one if
    started by hand)."""
    torch.set_num_threads(env_threads(env) or 1)

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

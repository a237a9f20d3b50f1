"""GPU catalog for emulation and planning: the paper's Table 1 types plus common modern ones, and
the names real devices report mapped onto it."""

from __future__ import annotations

import re
from dataclasses import dataclass

from hetpipe.validate import ConfigError


@dataclass(frozen=True, slots=True)
class GpuType:
    name: str
    label: str
    tflops: float          # dense fp32 throughput
    memory_bytes: int
    bandwidth_gbs: float   # device memory bandwidth, GB/s
    year: int
    tensor_tflops: float = 0.0   # dense 16-bit matrix throughput (tensor cores); 0: as fp32

    def seconds(self, flops: float, bytes_moved: float, *, half: bool = False) -> float:
        """The one device time model (roofline): compute-bound at EFFICIENCY of peak throughput
        (16-bit matrix throughput for bf16/fp16 precision), or memory-bound at the full memory
        bandwidth, whichever takes longer."""
        peak = (self.tensor_tflops or self.tflops) if half else self.tflops
        return max(flops / (peak * 1e12 * EFFICIENCY), bytes_moved / (self.bandwidth_gbs * 1e9))


# Fraction of the peak throughput that training kernels sustain (cuDNN convolutions and GEMMs
# reach roughly 40-70% of peak at batch 32; Paleo uses the same kind of scaling-down constant).
EFFICIENCY = 0.5

GiB = 1 << 30

CATALOG: dict[str, GpuType] = {
    g.name: g
    for g in (
        # HetPipe Table 1 (V, R, G, Q).
        GpuType("titan-v", "TITAN V", 14.9, 12 * GiB, 653.0, 2017, 110.0),
        GpuType("titan-rtx", "TITAN RTX", 16.3, 24 * GiB, 672.0, 2018, 130.0),
        GpuType("rtx-2060", "GeForce RTX 2060", 6.5, 6 * GiB, 336.0, 2019, 52.0),
        GpuType("quadro-p4000", "Quadro P4000", 5.3, 8 * GiB, 243.0, 2017),
        # Modern types.
        GpuType("v100-16gb", "Tesla V100 16GB", 15.7, 16 * GiB, 900.0, 2017, 125.0),
        GpuType("v100-32gb", "Tesla V100 32GB", 15.7, 32 * GiB, 900.0, 2018, 125.0),
        GpuType("t4", "Tesla T4", 8.1, 16 * GiB, 320.0, 2018, 65.0),
        GpuType("rtx-3090", "GeForce RTX 3090", 35.6, 24 * GiB, 936.0, 2020, 71.0),
        GpuType("rtx-4090", "GeForce RTX 4090", 82.6, 24 * GiB, 1008.0, 2022, 165.0),
        GpuType("a100-40gb", "A100 40GB", 19.5, 40 * GiB, 1555.0, 2020, 312.0),
        GpuType("a100-80gb", "A100 80GB", 19.5, 80 * GiB, 2039.0, 2020, 312.0),
        GpuType("l4", "L4", 30.3, 24 * GiB, 300.0, 2023, 121.0),
        GpuType("h100-80gb", "H100 80GB SXM", 67.0, 80 * GiB, 3350.0, 2022, 989.0),
        GpuType("h200", "H200 141GB", 67.0, 141 * GiB, 4800.0, 2024, 989.0),
    )
}

# What CUDA devices call themselves (torch.cuda.get_device_properties(i).name), and the catalog
# entry for each; where a family comes in two sizes, the memory decides.
_NAMES: tuple[tuple[str, tuple[str, ...]], ...] = (
    (r"\bH200\b", ("h200",)),
    (r"\bH100\b", ("h100-80gb",)),
    (r"\bA100\b", ("a100-40gb", "a100-80gb")),
    (r"\bV100\b", ("v100-16gb", "v100-32gb")),
    (r"\bL4\b", ("l4",)),
    (r"\bT4\b", ("t4",)),
    (r"RTX 4090", ("rtx-4090",)),
    (r"RTX 3090", ("rtx-3090",)),
    (r"RTX 2060", ("rtx-2060",)),
    (r"TITAN RTX", ("titan-rtx",)),
    (r"TITAN V\b", ("titan-v",)),
    (r"Quadro P4000", ("quadro-p4000",)),
)


def match(device_name: str, memory_bytes: int) -> str | None:
    """The catalog type of a real device, from its name (and memory), or None if unknown."""
    for pattern, types in _NAMES:
        if re.search(pattern, device_name, re.IGNORECASE):
            return min(types, key=lambda t: abs(CATALOG[t].memory_bytes - memory_bytes))
    return None


def gpu_type(name: str, key: str = "cluster.nodes[].gpus[].type") -> GpuType:
    try:
        return CATALOG[name]
    except KeyError:
        raise ConfigError(f"{key}: expected one of {', '.join(CATALOG)}, got {name!r}") from None

"""GPU catalog for emulation and planning: the paper's Table 1 types plus common modern ones."""

from __future__ import annotations

from dataclasses import dataclass

from hetpipe.config import ConfigError


@dataclass(frozen=True, slots=True)
class GpuType:
    name: str
    label: str
    tflops: float          # dense fp32 throughput
    memory_bytes: int
    bandwidth_gbs: float   # device memory bandwidth, GB/s
    year: int

    def seconds(self, flops: float, bytes_moved: float) -> float:
        """The one device time model (roofline): compute-bound at EFFICIENCY of peak throughput,
        or memory-bound at the full memory bandwidth, whichever takes longer."""
        return max(flops / (self.tflops * 1e12 * EFFICIENCY), bytes_moved / (self.bandwidth_gbs * 1e9))


# Fraction of the peak fp32 throughput that training kernels sustain (cuDNN convolutions and GEMMs
# reach roughly 40-70% of peak at batch 32; Paleo uses the same kind of scaling-down constant).
EFFICIENCY = 0.5

GiB = 1 << 30

CATALOG: dict[str, GpuType] = {
    g.name: g
    for g in (
        # HetPipe Table 1 (V, R, G, Q).
        GpuType("titan-v", "TITAN V", 14.9, 12 * GiB, 653.0, 2017),
        GpuType("titan-rtx", "TITAN RTX", 16.3, 24 * GiB, 672.0, 2018),
        GpuType("rtx-2060", "GeForce RTX 2060", 6.5, 6 * GiB, 336.0, 2019),
        GpuType("quadro-p4000", "Quadro P4000", 5.3, 8 * GiB, 243.0, 2017),
        # Modern types.
        GpuType("v100-16gb", "Tesla V100 16GB", 15.7, 16 * GiB, 900.0, 2017),
        GpuType("t4", "Tesla T4", 8.1, 16 * GiB, 320.0, 2018),
        GpuType("rtx-3090", "GeForce RTX 3090", 35.6, 24 * GiB, 936.0, 2020),
        GpuType("a100-40gb", "A100 40GB", 19.5, 40 * GiB, 1555.0, 2020),
        GpuType("l4", "L4", 30.3, 24 * GiB, 300.0, 2023),
        GpuType("h100-80gb", "H100 80GB SXM", 67.0, 80 * GiB, 3350.0, 2022),
    )
}


def gpu_type(name: str, key: str = "cluster.nodes[].gpus[].type") -> GpuType:
    try:
        return CATALOG[name]
    except KeyError:
        raise ConfigError(f"{key}: expected one of {', '.join(CATALOG)}, got {name!r}") from None

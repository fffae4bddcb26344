"""GPU specs the planner sizes and times a layout by, with the efficiencies it assumes stated.

Memory is in GB (1e9 bytes) as the cards are sold; ``--gpu-memory-gb`` overrides it. Bandwidths
are nominal; the planner multiplies them by the efficiencies below, which say where they come from.
"""

from __future__ import annotations

from dataclasses import dataclass

# Decode reads every weight and the KV once a step; a well-fused step streams at close to a device
# copy's rate. On the H200 a device copy measured 4.3 of the nominal 4.8 TB/s (kiln's DESIGN.md),
# i.e. 0.9; the same share is assumed for the H100's HBM3.
MEMORY_EFFICIENCY = 0.9
# A ring all-reduce of M bytes over tp ranks sends and receives 2 (tp - 1) / tp x M bytes on each
# rank's link; NCCL reaches about 0.8 of NVLink's one-way bandwidth on large messages.
NVLINK_EFFICIENCY = 0.8


@dataclass(frozen=True)
class GpuSpec:
    name: str
    memory_gb: float
    memory_bandwidth: float      # bytes/s, nominal HBM
    nvlink_bandwidth: float      # bytes/s, one direction (NVLink 4: 900 GB/s both ways)
    collective_latency_s: float  # a small-message NCCL all-reduce within a node (order of magnitude)


GPUS: dict[str, GpuSpec] = {
    "h100": GpuSpec("H100 SXM 80GB", 80.0, 3.35e12, 450e9, 10e-6),
    "h200": GpuSpec("H200 SXM 141GB", 141.0, 4.8e12, 450e9, 10e-6),
}


def get_gpu(name: str) -> GpuSpec:
    try:
        return GPUS[name]
    except KeyError:
        raise ValueError(f"unknown GPU {name!r}; known: {', '.join(GPUS)}") from None

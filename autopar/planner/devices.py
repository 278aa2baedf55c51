"""What the planner needs to know about a device: memory, peak FLOP/s, memory and link bandwidth.

Presets are the vendors' datasheet figures for the SXM parts (dense, no sparsity); bandwidths
are per GPU and per direction: NVLink within a node, the GPU's share of the network (one
400 Gb/s NIC per H100/H200, 200 Gb/s per A100) between nodes, PCIe to the host (Gen5 x16,
Gen4 x16 on A100). ``memory_gib`` is what
``torch.cuda.get_device_properties().total_memory`` reports, not the marketing figure.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass

from autopar.config.errors import ConfigError
from autopar.planner.profile import DeviceProfile, MatmulPoint

GB = 1e9


@dataclass(frozen=True)
class DeviceSpec:
    name: str
    memory_gib: float
    bf16_flops: float
    fp8_flops: float | None  # None: no FP8 tensor cores
    hbm_bytes_per_s: float
    intra_node_bytes_per_s: float
    inter_node_bytes_per_s: float
    host_bytes_per_s: float
    profile: DeviceProfile | None = None
    """Measured figures (``python -m autopar.probe``) the time model reads instead of the
    constants above; None plans with the datasheet figures."""

    @property
    def device_type(self) -> str:
        """``cpu`` for a CPU's measured profile, else ``cuda`` (the presets, a GPU's profile)."""
        return self.profile.device_type if self.profile is not None else "cuda"


PRESETS: dict[str, DeviceSpec] = {
    "h100": DeviceSpec("h100", 79.1, 989e12, 1979e12, 3350 * GB, 450 * GB, 50 * GB, 64 * GB),
    "h200": DeviceSpec("h200", 139.8, 989e12, 1979e12, 4800 * GB, 450 * GB, 50 * GB, 64 * GB),
    "a100": DeviceSpec("a100", 79.2, 312e12, None, 2039 * GB, 300 * GB, 25 * GB, 32 * GB),
}


H100_MATMUL: tuple[MatmulPoint, ...] = (
    MatmulPoint("bfloat16", 1024, 1024, 1024, 66.7e12),
    MatmulPoint("bfloat16", 4096, 4096, 4096, 736.5e12),
    MatmulPoint("bfloat16", 8192, 2048, 2048, 667.1e12),
    MatmulPoint("bfloat16", 8192, 2048, 6144, 740.7e12),
    MatmulPoint("bfloat16", 8192, 4096, 2048, 722.6e12),
    MatmulPoint("bfloat16", 8192, 8192, 8192, 772.4e12),
    MatmulPoint("bfloat16", 8192, 12288, 2048, 762.0e12),
    MatmulPoint("float8", 1024, 1024, 1024, 44.5e12),
    MatmulPoint("float8", 4096, 4096, 4096, 1121.7e12),
    MatmulPoint("float8", 8192, 2048, 2048, 909.8e12),
    MatmulPoint("float8", 8192, 2048, 6144, 1218.6e12),
    MatmulPoint("float8", 8192, 4096, 2048, 1065.7e12),
    MatmulPoint("float8", 8192, 8192, 8192, 1289.3e12),
    MatmulPoint("float8", 8192, 12288, 2048, 1180.5e12),
)
"""The probe's bf16 and FP8 GEMM table on an H100 SXM (torch 2.11, CUDA 13): the mean of its
two runs on 2026-11-27 (``benchmarks/device_profile_h100_qwen3_1.7b*.json``), but the vocabulary
head's shape, which stays in bf16 under FP8 training and whose narrow k would stand in for the
largest blocks' GEMMs. The presets read only how FP8's gain over bf16 varies with the GEMM's
shape from it (``time.preset_fp8_speedup``): 1.4x at 8192 x 2048 x 2048, 1.65x at
8192 x 2048 x 6144, 1.7x at 8192^3."""


def device_spec(name: str, memory_gib: float | None = None) -> DeviceSpec:
    """The preset ``name``, with its memory replaced by ``memory_gib`` when given."""
    spec = PRESETS.get(name.lower())
    if spec is None:
        raise ConfigError(f"--device {name!r} is not a known device; choose one of {sorted(PRESETS)}")
    if memory_gib is not None:
        if not (math.isfinite(memory_gib) and memory_gib > 0):
            raise ConfigError(f"--gpu-memory-gib {memory_gib} must be a finite number > 0")
        spec = dataclasses.replace(spec, memory_gib=memory_gib)
    return spec


def this_machine(device_type: str, local_ranks: int) -> DeviceSpec:
    """The spec of the device this process trains on: the matching preset with the memory
    torch reports on CUDA; on CPU, this machine's RAM shared by its ``local_ranks`` (speed
    figures there only rank plans against each other)."""
    if device_type == "cuda":
        import torch

        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        name = props.name.lower()
        preset = next((p for key, p in PRESETS.items() if key in name), PRESETS["h100"])
        return dataclasses.replace(preset, name=props.name, memory_gib=props.total_memory / 2**30)
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return DeviceSpec(
        "cpu", ram / 2**30 / max(1, local_ranks), 1e12, None, 50 * GB, 10 * GB, 10 * GB, 50 * GB
    )

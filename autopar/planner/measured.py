"""The time model's terms that only a measured device profile (``python -m autopar.probe``)
prices: the dtype the GEMMs run in, the elementwise work at the measured memory bandwidth and
each op's dispatch overhead. With a preset these are 0: the MFU measured on an H100 holds them.
"""

from __future__ import annotations

import functools

import torch

from autopar.config.sections import JobConfig
from autopar.models.args import ModelArgs
from autopar.planner.block_bytes import Sizes, block_bytes_no_ac
from autopar.planner.devices import DeviceSpec
from autopar.planner.memory import meta_model
from autopar.planner.probe import count_ops, forward_backward

MEMORY_PASSES = {"compiled": 2, "eager": 4}
"""With a measured profile: how many times the bytes a block saves for backward cross memory
in its elementwise work (norms, activations, residuals, softmax): written and read in forward
and backward when eager, about half that when compiled fuses them. An assumption; the GEMMs'
own traffic is inside their measured rate."""
COMPILED_OP_SHARE = 0.25
"""With a measured profile: the share of eager's op dispatches a compiled graph still makes
(fused kernels, no Python per op). An assumption; eager is what the probe measures."""


def compute_dtype(job: JobConfig, device: DeviceSpec) -> str:
    """The dtype the job's GEMMs run in: float8 where enabled and the device has it, else the
    mixed-precision dtype (auto: bfloat16 on GPUs, float32 on CPU)."""
    if job.float8.enable and device.fp8_flops is not None:
        return "float8"
    choice = job.training.mixed_precision_param
    cpu = device.profile is not None and device.profile.device_type == "cpu"
    return {"auto": "float32" if cpu else "bfloat16"}.get(choice, choice)


@functools.lru_cache(maxsize=16)
def ops_per_micro_batch(args: ModelArgs) -> int:
    """Aten ops of one forward and backward of the whole model (counted on meta tensors; the
    count does not depend on the batch)."""
    return count_ops(forward_backward(meta_model(args), torch.device("meta")))


def overhead_seconds(args: ModelArgs, job: JobConfig, device: DeviceSpec, block_passes: float) -> float:
    """With a measured profile: this rank's ops per step (``block_passes``: its stage's blocks
    times its micro-batches, each a forward and backward) at the measured seconds per op,
    ``COMPILED_OP_SHARE`` of them when compiled; 0 with a preset, whose MFU already holds it."""
    profile = device.profile
    if profile is None or profile.op_overhead_s is None:
        return 0.0
    ops = ops_per_micro_batch(args) * block_passes / args.num_hidden_layers
    return ops * profile.op_overhead_s * (COMPILED_OP_SHARE if job.compile.enable else 1.0)


def memory_bound_seconds(
    args: ModelArgs, job: JobConfig, device: DeviceSpec, z: Sizes, block_passes: float
) -> float:
    """With a measured profile: the elementwise work beside the GEMMs, ``MEMORY_PASSES`` over
    the bytes each block saves for backward (``z``: one micro-batch's sizes; ``block_passes``
    as in ``overhead_seconds``) at the measured memory bandwidth; 0 with a preset, whose MFU
    already holds it."""
    if device.profile is None:
        return 0.0
    saved = sum(block_bytes_no_ac(z, args.layer_kind(i), args.qk_norm) for i in range(args.num_hidden_layers))
    passes = MEMORY_PASSES["compiled" if job.compile.enable else "eager"]
    return passes * saved * block_passes / args.num_hidden_layers / device.hbm_bytes_per_s

"""The time model's terms beside the GEMMs: the dtype they run in, the elementwise work and the
optimizer's traffic at the memory bandwidth, and each op's dispatch overhead. A measured
profile (``python -m autopar.probe``) gives the bandwidth and an op's seconds; a GPU preset
takes its datasheet bandwidth and ``PRESET_OP_SECONDS``, fit with ``rates.GEMM_EFFICIENCY`` to
the H100 sitting's runs (BENCHMARKS.md).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from collections.abc import Callable

import torch

from autopar.config.sections import JobConfig
from autopar.models.args import HF_LAYER_TYPES, LayerKind, ModelArgs
from autopar.planner.block_bytes import Sizes, block_bytes_no_ac
from autopar.planner.devices import DeviceSpec
from autopar.planner.params import layer_kinds, meta_model
from autopar.planner.probe import count_ops, forward_backward

MEMORY_PASSES = {"compiled": 2, "eager": 4}
"""How many times the bytes a block saves for backward cross memory
in its elementwise work (norms, activations, residuals, softmax): written and read in forward
and backward when eager, about half that when compiled fuses them. An assumption; the GEMMs'
own traffic is inside their measured rate."""
COMPILED_OP_SHARE = 0.10
"""The share of eager's op dispatches a compiled graph still makes (fused kernels, no Python
per op): fit with ``PRESET_OP_SECONDS`` and ``rates.GEMM_EFFICIENCY`` to the H100 sittings' five
compiled and three eager runs (each then within 5%); a profile measures eager, and a compiled
step where the job compiles."""
PRESET_OP_SECONDS = 12.6e-6
"""Seconds an eager aten op costs beside its kernel on a GPU without a profile: the same fit
(an H100 host, torch 2.11; the probe measured 13-15 us there)."""
OPTIMIZER_BYTES_PER_PARAM = 36
"""AdamW's float32 traffic per trained parameter a step: the parameter, its gradient and two
moments read, three written, the gradient read again for the norm and zeroed."""


def compute_dtype(job: JobConfig, device: DeviceSpec) -> str:
    """The dtype the job's GEMMs run in: float8 where enabled and the device has it, else the
    mixed-precision dtype (auto: bfloat16 on GPUs, float32 on CPU)."""
    if job.float8.enable and device.fp8_flops is not None:
        return "float8"
    choice = job.training.mixed_precision_param
    return {"auto": "float32" if device.device_type == "cpu" else "bfloat16"}.get(choice, choice)


@functools.lru_cache(maxsize=16)
def ops_per_micro_batch(args: ModelArgs) -> int:
    """Aten ops of one forward and backward of the whole model (counted on meta tensors in
    bf16, as mixed precision computes, which experts' grouped GEMMs require; the count does
    not depend on the batch), by ``layer_extrapolated``."""
    return layer_extrapolated(
        args, lambda a: count_ops(forward_backward(_bf16_meta(a), torch.device("meta")))
    )


@functools.lru_cache(maxsize=16)
def forward_op_share(args: ModelArgs) -> float:
    """The forward's share of a forward and backward's aten ops (counted on meta tensors as
    ``ops_per_micro_batch``): what a recomputed forward dispatches again."""

    def forward(a: ModelArgs) -> int:
        model = _bf16_meta(a)
        ids = torch.zeros(1, 8, dtype=torch.long, device="meta")
        with torch.no_grad():
            return count_ops(lambda: model(ids))

    return layer_extrapolated(args, forward) / ops_per_micro_batch(args)


def _bf16_meta(args: ModelArgs) -> torch.nn.Module:
    return copy.deepcopy(meta_model(args)).to(torch.bfloat16)  # the cached model stays fp32


def layer_extrapolated(args: ModelArgs, count: Callable[[ModelArgs], int]) -> int:
    """``count(args)`` from models of one block of each kind and one more of a single kind:
    every block of a kind dispatches the same ops wherever it stands, so the whole model's
    count is the first's plus each kind's extra block times its further blocks (on
    Qwen3-8B a whole meta model counts in seconds, these in a fraction;
    ``tests/test_planner.py`` holds the two equal)."""
    kinds = layer_kinds(args)
    order = list(dict.fromkeys(kinds))
    base = count(_with_layers(args, order))
    extra = {kind: count(_with_layers(args, [*order, kind])) - base for kind in order}
    return base + sum((kinds.count(kind) - 1) * extra[kind] for kind in order)


def _with_layers(args: ModelArgs, kinds: list[LayerKind]) -> ModelArgs:
    """``args`` with one block of each of ``kinds``, in order."""
    changes: dict[str, object] = {"num_hidden_layers": len(kinds)}
    if args.hybrid:
        hf_types = {mixer: hf for hf, mixer in HF_LAYER_TYPES.items()}
        changes["layer_types"] = tuple(hf_types[mixer] for mixer, _ in kinds)
    if args.moe:
        changes |= {
            "decoder_sparse_step": 1,
            "mlp_only_layers": tuple(i for i, k in enumerate(kinds) if k[1] == "mlp"),
        }
    return dataclasses.replace(args, **changes)


def checkpoint_machinery_seconds(
    args: ModelArgs, job: JobConfig, device: DeviceSpec, block_passes: float, mode: str
) -> float:
    """What checkpointing ``block_passes`` blocks in ``mode`` ("op" or "full") costs beside
    the work it reruns and that work's dispatch: the saved-tensor hooks and, per op, per-op
    AC's policy at every forward op and again in the recompute. The probe's eager forward and
    backward with every block checkpointed so, on 8 tokens, less the plain one and its
    forward's dispatch once more; none compiled (the graph holds the policy's choices) or
    unmeasured."""
    profile = device.profile
    if job.compile.enable or profile is None or profile.op_overhead_s is None:
        return 0.0
    measured = dict(profile.checkpoint_op_overhead_s).get(mode)
    if measured is None:
        return 0.0
    per_op = max(0.0, measured - profile.op_overhead_s * (1 + forward_op_share(args)))
    return ops_per_micro_batch(args) * per_op * block_passes / args.num_hidden_layers


FORWARD_PASS_SHARE = 0.5
"""The forward's share of ``MEMORY_PASSES``: the saved bytes are written and read once in the
forward and once in the backward, eager or compiled."""


def overhead_seconds(
    args: ModelArgs, job: JobConfig, device: DeviceSpec, block_passes: float, tp: int = 1, cp: int = 1
) -> float:
    """This rank's ops per step (``block_passes``: its stage's blocks times its micro-batches,
    each a forward and backward) at the measured seconds per op (under ``tp`` or ``cp`` > 1 the
    figure the probe timed for that plan; ``PRESET_OP_SECONDS`` for a preset),
    ``COMPILED_OP_SHARE`` of them when compiled."""
    profile = device.profile
    seconds = PRESET_OP_SECONDS if profile is None else profile.op_overhead(tp, cp)
    if seconds is None:
        return 0.0
    ops = ops_per_micro_batch(args) * block_passes / args.num_hidden_layers
    return ops * seconds * (COMPILED_OP_SHARE if job.compile.enable else 1.0)


def memory_bound_seconds(
    args: ModelArgs,
    job: JobConfig,
    device: DeviceSpec,
    z: Sizes,
    block_passes: float,
    bytes_per_s: float | None = None,
) -> float:
    """The elementwise work beside the GEMMs of ``block_passes`` average blocks (as in
    ``overhead_seconds``): ``block_memory_seconds`` over the model's blocks."""
    per_block = block_memory_seconds(args, job, device, z, bytes_per_s)
    return sum(per_block) * block_passes / args.num_hidden_layers


def block_memory_seconds(
    args: ModelArgs, job: JobConfig, device: DeviceSpec, z: Sizes, bytes_per_s: float | None = None
) -> list[float]:
    """Each block's elementwise work in one micro-batch's forward and backward:
    ``MEMORY_PASSES`` over the bytes it saves for backward (``z``: the micro-batch's sizes) at
    ``bytes_per_s`` (``time.elementwise_bytes_per_s``: the rate the job's own model step
    showed), else the device's memory bandwidth (measured, or the preset's datasheet figure)."""
    passes = MEMORY_PASSES["compiled" if job.compile.enable else "eager"]
    rate = bytes_per_s or device.hbm_bytes_per_s
    kinds = layer_kinds(args)
    per_kind = {kind: passes * block_bytes_no_ac(z, kind, args.qk_norm) / rate for kind in set(kinds)}
    return [per_kind[kind] for kind in kinds]


CAST_BYTES = 6
"""The mixed-precision recipe's cast of one element where it computes below float32
(``parallel.mixed_precision``): a float32 master weight read and its bf16 copy written before
a forward, or a bf16 weight gradient read and its float32 copy written after a backward."""


def cast_seconds(job: JobConfig, device: DeviceSpec, elements: float) -> float:
    """The recipe's casts of ``elements`` weights and gradients at the memory bandwidth; none in
    float32."""
    if compute_dtype(job, device) == "float32":
        return 0.0
    return CAST_BYTES * elements / device.hbm_bytes_per_s


def optimizer_seconds(device: DeviceSpec, params: float) -> float:
    """AdamW's step over the ``params`` a rank trains, at the memory bandwidth."""
    return OPTIMIZER_BYTES_PER_PARAM * params / device.hbm_bytes_per_s

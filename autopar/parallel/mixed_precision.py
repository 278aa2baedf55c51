"""The mixed-precision recipe: one, decided here, the same under every plan and on one device.

With a bf16 compute dtype (``training.mixed_precision_param``; ``auto`` is bf16 on CUDA):

- master weights, their gradients and the optimizer state are fp32;
- each transformer block's weights (and, once, those outside the blocks) are cast to bf16
  at the start of its forward: FSDP2 does it in its all-gather (``param_dtype``), every
  other plan with ``apply_compute_dtype``. Activations, the residual stream and the logits
  are therefore bf16, and a tied embedding/head weight is cast once, so its two gradients
  add up in bf16 before they become fp32, under FSDP and without it;
- RMSNorm's statistics and RoPE's tables are computed in fp32 by the model, attention's
  softmax in fp32 inside SDPA, and the cross-entropy upcasts the logits to fp32;
- a bf16 weight gradient becomes fp32 where it leaves the cast (per micro-batch), and
  data-parallel sums run in fp32 (FSDP2's ``reduce_dtype``,
  ``training.mixed_precision_reduce``); tensor-parallel activation sums
  (row-parallel outputs) run in bf16, as in Megatron-LM.

torch.autocast is not used: it keeps the residual stream fp32 and casts per matmul, which
FSDP2's bf16 gather cannot match. With an fp32 compute dtype nothing is cast.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from autopar.config.sections import JobConfig
from autopar.models.dtypes import DTYPES
from autopar.parallel.torch_internals import reparametrize_module


def compute_dtype(job: JobConfig, device: torch.device) -> torch.dtype:
    """The dtype weights are cast to for forward and backward."""
    choice = job.training.mixed_precision_param
    if choice == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[choice]


def fsdp_policy(job: JobConfig, device: torch.device) -> MixedPrecisionPolicy:
    """The recipe as FSDP2 applies it."""
    return MixedPrecisionPolicy(
        param_dtype=compute_dtype(job, device), reduce_dtype=DTYPES[job.training.mixed_precision_reduce]
    )


def _cast_forward(module: nn.Module, dtype: torch.dtype, owns: Callable[[str], bool]) -> None:
    """Run ``module``'s forward with the parameters ``owns`` accepts cast to ``dtype``.

    The cast is inside the forward, so activation checkpointing recomputes it and
    torch.compile traces it; gradients flow through the cast to the fp32 parameters.
    """
    forward = module.forward

    @functools.wraps(forward)
    def cast_then_forward(*args, **kwargs):
        casts = {name: p.to(dtype) for name, p in module.named_parameters() if owns(name)}
        with reparametrize_module(module, casts, tie_weights=True):
            return forward(*args, **kwargs)

    module.forward = cast_then_forward


def _outside_blocks(name: str) -> bool:
    return not name.startswith("layers.")


def apply_compute_dtype(model: nn.Module, dtype: torch.dtype) -> None:
    """The recipe without FSDP: each block casts its weights in its own forward, the model's
    forward the rest (embedding, final norm, head), as FSDP2's groups do.

    Apply before activation checkpointing and compile, so both see the cast as part of the
    block.
    """
    for block in model.layers.values():
        _cast_forward(block, dtype, lambda _name: True)
    _cast_forward(model, dtype, _outside_blocks)

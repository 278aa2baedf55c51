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
  (row-parallel outputs) run in bf16, as in Megatron-LM;
- frozen weights (LoRA's base by default, a DPO or RL reference copy always) are stored in
  the compute dtype: nothing updates them, so an fp32 master would only be cast to the same
  bf16 values in every forward, at twice the memory.

torch.autocast is not used: it keeps the residual stream fp32 and casts per matmul, which
FSDP2's bf16 gather cannot match. With an fp32 compute dtype nothing is cast.
"""

from __future__ import annotations

import functools
from typing import Any

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


class CastsWeights(nn.Module):
    """Put in front of a module's class by ``apply_compute_dtype`` (as FSDP2 swaps in its own
    class): the forward runs with the module's weights cast to ``compute_dtype``, those of its
    blocks too unless ``blocks_cast_their_own``.

    The cast is inside the forward, so activation checkpointing recomputes it and
    torch.compile traces it; gradients flow through the cast to the fp32 parameters.
    """

    compute_dtype: torch.dtype
    blocks_cast_their_own: bool

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        casts = {
            name: p.to(self.compute_dtype)
            for name, p in self.named_parameters()
            if not (self.blocks_cast_their_own and name.startswith("layers."))
        }
        with reparametrize_module(self, casts, tie_weights=True):
            return super().forward(*args, **kwargs)

    def extra_repr(self) -> str:
        return ", ".join(filter(None, [super().extra_repr(), f"weights cast to {self.compute_dtype}"]))


def store_frozen(model: nn.Module, dtype: torch.dtype) -> None:
    """Frozen weights (those not requiring grad) in ``dtype``, as new parameters: assigning
    ``.data`` of a DTensor would leave its local shard in the old dtype. Tied weights stay
    tied. Apply on the meta model, before FSDP, which then gathers them as they are."""
    stored: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if param.requires_grad or param.dtype == dtype:
                continue
            if id(param) not in stored:
                stored[id(param)] = nn.Parameter(param.detach().to(dtype), requires_grad=False)
            setattr(module, name, stored[id(param)])


@functools.cache
def _casting_class(cls: type[nn.Module]) -> type[nn.Module]:
    """One class per module class, so compiled blocks share their code and guards."""
    return type(f"Cast{cls.__name__}", (CastsWeights, cls), {})


def _cast_weights(module: nn.Module, dtype: torch.dtype, blocks_cast_their_own: bool) -> None:
    module.__class__ = _casting_class(type(module))
    module.compute_dtype = dtype
    module.blocks_cast_their_own = blocks_cast_their_own


def apply_compute_dtype(model: nn.Module, dtype: torch.dtype) -> None:
    """The recipe without FSDP: each block casts its weights in its own forward, the model's
    forward the rest (embedding, final norm, head), as FSDP2's groups do.

    Apply before activation checkpointing and compile, so both see the cast as part of the
    block.
    """
    for block in model.layers.values():
        _cast_weights(block, dtype, blocks_cast_their_own=False)
    _cast_weights(model, dtype, blocks_cast_their_own=True)

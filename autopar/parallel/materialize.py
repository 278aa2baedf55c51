"""Turn a parallelized meta-device model into real tensors holding the single-device values.

Every parameter is computed in full (from its seeded initializer, or read from an HF file)
and each rank keeps its own shard of it. No rank sends anything, and whatever the plan, the
weights equal those of one device: the start of every parity guarantee.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from autopar.models.args import ModelArgs
from autopar.models.family import family_of
from autopar.models.qwen import canonical_name

FullValue = Callable[[str, torch.Size], torch.Tensor]
"""(parameter name, global shape) -> the full fp32 tensor on the target device."""


def seeded_values(args: ModelArgs, seed: int, device: torch.device) -> FullValue:
    initial_value = family_of(args).model.initial_value

    def value(name: str, shape: torch.Size) -> torch.Tensor:
        return initial_value(args, name, shape, seed, device, torch.float32)

    return value


def tensor_values(tensors: Mapping[str, torch.Tensor], device: torch.device) -> FullValue:
    """Values from full tensors by name (e.g. an HF checkpoint's ``HFTensors``)."""

    def value(name: str, shape: torch.Size) -> torch.Tensor:
        return tensors[canonical_name(name)].to(device=device, dtype=torch.float32)

    return value


def _retie(module: nn.Module) -> None:
    for sub in module.modules():
        tie = getattr(sub, "tie_weights", None)
        if callable(tie):
            tie()


@torch.no_grad()
def materialize(model: nn.Module, device: torch.device, full_value: FullValue) -> None:
    """Allocate ``model`` on ``device`` and fill every parameter (its local shard, for a DTensor)."""
    model.to_empty(device=device)
    _retie(model)
    for name, param in model.named_parameters():
        if isinstance(param, DTensor):
            full = full_value(name, param.shape)
            shard = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
            param.to_local().copy_(shard.to_local())
        else:
            param.copy_(full_value(name, param.shape))

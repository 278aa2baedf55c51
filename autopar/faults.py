"""Training that goes wrong stops with a message, never with bad weights on disk.

A step whose loss or gradient norm is not finite is skipped (no optimizer update) up to
``training.max_skipped_steps`` times in a row; then training stops with ``TrainingStopped``.
Both values are global (summed or reduced over every rank before they are read), so every
rank takes the same decision without another collective.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor


class TrainingStopped(RuntimeError):
    """Training cannot go on; the message says why and what to do."""


def nonfinite(loss: float, grad_norm: float) -> list[str]:
    """Which of the step's global loss and gradient norm are not finite."""
    return [name for name, value in (("loss", loss), ("grad_norm", grad_norm)) if not math.isfinite(value)]


def skipped_too_often(step: int, bad: list[str], in_a_row: int, limit: int) -> TrainingStopped:
    first = "the loss" if "loss" in bad else "the gradients (the loss was finite)"
    return TrainingStopped(
        f"step {step}: {' and '.join(bad)} not finite, {in_a_row} step(s) in a row, more than "
        f"training.max_skipped_steps={limit}; {first} went bad first. Weights are those of the last "
        "finite step and no checkpoint was written since; lower optimizer.lr, check the data, or "
        "raise training.max_skipped_steps to ride out rare spikes"
    )


def parameters_finite(parts: list[nn.Module]) -> bool:
    """Whether every rank's parameters are finite (one all-reduce of a flag)."""
    local = [p.to_local() if isinstance(p, DTensor) else p for part in parts for p in part.parameters()]
    bad = sum(((~torch.isfinite(t)).any().to(torch.float32) for t in local), torch.zeros(()))
    if dist.is_initialized():
        dist.all_reduce(bad)
    return not bool(bad.item())

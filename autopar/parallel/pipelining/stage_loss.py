"""What the last pipeline stage calls per micro-batch (``LossSlot``), and how a stage that
returns a second head's output hands it to the schedule (``flat_head_output``).

torch's schedules take their loss function once, when they are built; a training step sets
the loss of each run (its normalizers change every step, and a reference pass runs the same
schedule forward-only with a loss of its own). The loss itself comes from the training
floor: this floor does not know the training step.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

LossFn = Callable[[object, torch.Tensor], torch.Tensor]
"""(the last stage's output, the micro-batch's target) -> the loss the schedule backpropagates."""


class LossSlot:
    """The schedule's loss function: whichever loss the current run set in ``fn``."""

    def __init__(self) -> None:
        self.fn: LossFn | None = None

    def __call__(self, output: object, target: torch.Tensor) -> torch.Tensor:
        assert self.fn is not None, "a pipeline run sets its loss first"
        return self.fn(output, target)


def flat_head_output(
    module: nn.Module, args: tuple, output: tuple[torch.Tensor | tuple[torch.Tensor, ...], torch.Tensor]
) -> tuple[torch.Tensor, ...]:
    """The last stage's (the model's output, the second head's logits) as one flat tuple of
    tensors, as torch's schedules take a stage's output: (logits, head logits) or, for a
    mixture of experts, (logits, routing, head logits)."""
    main, head_logits = output
    return (*main, head_logits) if isinstance(main, tuple) else (main, head_logits)

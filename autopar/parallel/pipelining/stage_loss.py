"""What the last pipeline stage backpropagates per micro-batch (``StageLoss``): the token
loss sum, a mixture's load-balancing loss and a second output head's loss, each weighted so
that dividing the gradients by the step's targets afterwards gives the non-pipelined step's.

Plain callables come in from the training floor (the token loss, the balance loss, the head's
loss): this floor does not know the training step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from autopar.models.qwen import split_output

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""(logits, labels) -> summed token loss."""
BalanceFn = Callable[[torch.Tensor], torch.Tensor]
"""A mixture of experts' routing statistics (B, 2, E) -> its load-balancing loss summed over
the sequences."""
HeadFn = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
"""A second output head's (logits, targets) -> (summed token loss, targets its argmax hits,
targets)."""


@dataclass(frozen=True)
class StageHead:
    """A second output head on the last stage (Qwen3.5's multi-token prediction): the stages
    run it when called with ``forward_flags``, the last one returns (the model's output, its
    logits) (flattened for the schedule, ``flat_head_output``), and the schedule's target
    carries its targets beside the labels (B, S, 2)."""

    loss_fn: HeadFn
    scale: float
    """Its loss's weight beside the main loss, each a mean over its own targets."""
    forward_flags: dict[str, str]
    """Keyword arguments of every stage's forward that turn the head on."""


class StageLoss:
    """What the last stage's schedule backpropagates per micro-batch: the token loss sum
    (a DTensor from vocab-parallel loss made plain, as the schedule's backward expects) and,
    for a mixture of experts, ``coef`` x its load-balancing loss x ``balance_weight`` (the
    step's targets over its sequences, since gradients are divided by the targets later);
    with a ``head``, its scale x its loss sum x ``head_weight`` (the step's targets over
    the head's). ``parts`` keeps each call's (token loss, balance loss, the head's (loss sum,
    accepted targets)) for the step's log."""

    def __init__(
        self,
        loss_fn: LossFn,
        balance_fn: BalanceFn | None = None,
        coef: float = 0.0,
        head: StageHead | None = None,
    ) -> None:
        self.loss_fn = loss_fn
        self.balance_fn = balance_fn
        self.coef = coef
        self.head = head
        self.balance_weight = torch.ones(())
        self.head_weight = torch.ones(())
        self.parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def __call__(self, output: torch.Tensor | tuple[torch.Tensor, ...], labels: torch.Tensor) -> torch.Tensor:
        head_logits = None
        if self.head is not None:  # (logits, head logits) or (logits, routing, head logits)
            assert isinstance(output, tuple)
            *main, head_logits = output
            output = main[0] if len(main) == 1 else tuple(main)
            labels, head_targets = labels.unbind(-1)  # (B, S) each
        logits, routing = split_output(output)  # type: ignore[arg-type]
        value = self.loss_fn(logits, labels)
        value = value.full_tensor() if isinstance(value, DTensor) else value
        balance = torch.zeros((), device=value.device)
        if routing is not None and self.balance_fn is not None:
            balance = self.balance_fn(routing)
        trained = value + self.coef * balance * self.balance_weight
        head = torch.zeros(2, device=value.device)
        if self.head is not None:
            head_sum, accepted, _ = self.head.loss_fn(head_logits, head_targets)
            trained = trained + self.head.scale * head_sum * self.head_weight
            head = torch.stack([head_sum.detach(), accepted.to(head.dtype)])
        self.parts.append((value.detach(), balance.detach(), head))
        return trained


def flat_head_output(
    module: nn.Module, args: tuple, output: tuple[torch.Tensor | tuple[torch.Tensor, ...], torch.Tensor]
) -> tuple[torch.Tensor, ...]:
    """The last stage's (the model's output, the second head's logits) as one flat tuple of
    tensors, as torch's schedules take a stage's output: (logits, head logits) or, for a
    mixture of experts, (logits, routing, head logits)."""
    main, head_logits = output
    return (*main, head_logits) if isinstance(main, tuple) else (main, head_logits)

"""The seam between the training step and what a job optimizes.

The step (``training/step.py``) runs a plan: the micro-batches in turn, context parallel's
split, a pipeline schedule, the optimizer. An objective supplies what they run:

- ``begin``: the step's normalizers (global counts, collective over the data-parallel ranks)
  and any reference pass, returned as the step's ``MicroBatchLoss``;
- ``target``: each micro-batch as the loss reads it. What the loss needs per position rides
  in the labels (B, S, ...), so a pipeline carries it to the last stage and context
  parallelism splits it with the tokens;
- ``MicroBatchLoss``: the loss of one micro-batch's output (a pipeline's last stage calls it
  per pipeline micro-batch), already the micro-batch's share of the step loss, so gradients
  need no division afterwards; each call keeps a detached record (its loss share and the
  sums behind the objective's metrics);
- ``finish``: the step's numbers from the records summed over every rank.

A mixture of experts' load-balancing loss belongs to the model, not the objective: every
``MicroBatchLoss`` adds it (mean per sequence over the step's rows) and records it last.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch.distributed.tensor import DTensor

from autopar.data.loader import Batch
from autopar.models.qwen import split_output
from autopar.training.train_context import LoadBalancing


@dataclass(frozen=True)
class StepOutcome:
    """One step's numbers as device tensors (no host sync)."""

    loss: torch.Tensor
    """The step loss, summed over every rank."""
    local_loss: torch.Tensor
    """This rank's share of it (to find where a non-finite loss came from)."""
    aux_loss: torch.Tensor
    """A mixture's load-balancing loss: mean per sequence, before its coefficient."""
    learned: torch.Tensor
    """Targets the step learns over the whole global batch (0: nothing learned)."""
    weight: torch.Tensor
    """What the loss is a mean over (targets, pairs): a held-out pass weighs steps by it."""
    metrics: torch.Tensor = field(default_factory=lambda: torch.zeros(0))
    """The objective's ``metric_names``, in order."""
    metric_weight: torch.Tensor | None = None
    """What the metrics are means over where not the loss's (a second head's own targets)."""
    tokens: torch.Tensor | None = None
    """Tokens trained over every rank, padding left out, where rows vary in what they hold
    (packed pairs); None: the loader's fixed count."""


class MicroBatchLoss(ABC):
    """A step's loss on one micro-batch's output: the objective's share of the step loss
    (``term``) plus a mixture's load-balancing term; each call's detached record (the
    objective's ``width`` numbers, then the balance loss) is kept in ``records``."""

    width: int = 1
    """How many numbers ``term`` records."""

    def __init__(
        self, balance: LoadBalancing | None, sequences: torch.Tensor | float, device: torch.device
    ) -> None:
        self.balance = balance
        self.device = device
        self.sequences = sequences
        """Rows of the whole step: the balance loss is a mean per sequence over them."""
        self.records: list[torch.Tensor] = []

    def __call__(self, output: torch.Tensor | tuple[torch.Tensor, ...], target: torch.Tensor) -> torch.Tensor:
        main, extra = self.split(output)
        logits, routing = split_output(main)  # type: ignore[arg-type]
        trained, record = self.term(logits, extra, target)
        aux = torch.zeros((), device=self.device)
        if routing is not None and self.balance is not None:
            aux = self.balance.sequence_sum(routing) / self.sequences
            trained = trained + self.balance.coef * aux
        self.records.append(torch.cat([record.float(), aux.detach().reshape(1)]))
        return trained

    def split(self, output: object) -> tuple[object, object]:
        """(the model's own output, what else the forward returned): nothing else by default."""
        return output, None

    @abstractmethod
    def term(
        self, logits: torch.Tensor, extra: object, target: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the micro-batch's share of the step loss, with its graph; its (width,) record)."""

    def summed(self, calls: int | None = None) -> torch.Tensor:
        """The last ``calls`` records summed (all of them by default; a pipeline schedule may
        first call its loss to infer shapes); zeros where none was made (a stage before the
        last)."""
        kept = self.records if calls is None else self.records[len(self.records) - calls :]
        if not kept:
            return torch.zeros(self.width + 1, device=self.device)
        return torch.stack(kept).sum(0)


def plain(value: torch.Tensor) -> torch.Tensor:
    """A loss that vocab-parallel cross-entropy returned as a DTensor, as a plain tensor of its
    own: ``full_tensor`` of a replicated value is a view of the local tensor, and a pipeline
    schedule splitting backward detaches its stage's loss in place, which a view refuses."""
    return value.full_tensor().clone() if isinstance(value, DTensor) else value


class ForwardInputs:
    """What a forward reads beside the tokens, positions and documents: nothing, by default
    (a reference model's forward); an objective with a second head adds its own."""

    @property
    def forward_flags(self) -> Mapping[str, object]:
        """Keyword arguments every forward (every pipeline stage's) takes."""
        return {}

    def per_position(self, batch: Batch) -> tuple[torch.Tensor | None, ...]:
        """(B, S) tensors the forward reads beside the tokens, built on the whole sequences of
        ``batch`` (context parallelism splits them as it splits the tokens)."""
        return ()

    def forward_kwargs(self, local: tuple[torch.Tensor | None, ...]) -> dict[str, object]:
        """The forward's keyword arguments from this rank's part of ``per_position``."""
        return dict(self.forward_flags)


class Objective(ForwardInputs, ABC):
    """What a job optimizes, as the step asks it (see the module docstring)."""

    metric_names: tuple[str, ...] = ()
    """Its numbers beside the loss in the step line and metrics.jsonl (``val_`` ones held out)."""

    @abstractmethod
    def begin(self, batches: list[Batch], calls_per_batch: int) -> tuple[MicroBatchLoss, list[Batch]]:
        """The step's loss over ``batches`` (collective: its global counts, its reference
        pass), called ``calls_per_batch`` times per micro-batch (a pipeline's micro-batches),
        and the batches as it reads them: their labels carry what it needs per position."""

    @abstractmethod
    def finish(self, sums: torch.Tensor, local: torch.Tensor, loss: MicroBatchLoss) -> StepOutcome:
        """The step's numbers from the records summed over every rank (``sums``) and over
        this rank's calls (``local``)."""

    def held_out(self, outcomes: list[StepOutcome]) -> tuple[float, int, dict[str, float]]:
        """A held-out pass's (loss, what it is a mean over, metrics) from its steps': means
        weighted by each step's ``weight``."""
        weights = torch.stack([o.weight for o in outcomes])
        loss = _weighted_mean(torch.stack([o.loss for o in outcomes]), weights)
        metrics = torch.stack([o.metrics for o in outcomes])
        if outcomes[0].metric_weight is not None:
            metrics = _weighted_mean(metrics, torch.stack([o.metric_weight for o in outcomes]))
        else:
            metrics = _weighted_mean(metrics, weights)
        return loss.item(), int(weights.sum().item()), dict(zip(self.metric_names, metrics.tolist()))


def _weighted_mean(values: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Mean over the first dimension of ``values`` weighted by ``weights`` (0 where they sum to 0)."""
    shape = (-1,) + (1,) * (values.dim() - 1)
    return (values * weights.view(shape)).sum(0) / weights.sum().clamp(min=1)

"""Language modelling (pre-training and SFT): token-summed cross-entropy over the step's
global target count, and Qwen3.5's multi-token-prediction head beside it (``[mtp]``).

Summing token losses and dividing by the targets of the whole global batch (all micro-steps,
all data- and context-parallel ranks) makes the loss and the gradients independent of how
the batch is split: accumulation 4x2 equals batch 8, and every plan gives one device's
numbers. The head's loss is a mean over its own targets, weighted by ``mtp.loss_scale``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

import torch

from autopar.data.loader import Batch
from autopar.models.qwen3_5.mtp import NextTokens
from autopar.parallel.pipelining.schedule import return_head_output
from autopar.training.loss import count_targets
from autopar.training.objectives.base import MicroBatchLoss, Objective, StepOutcome, plain
from autopar.training.objectives.mtp.checks import METRICS as HEAD_METRICS
from autopar.training.objectives.mtp.checks import global_mtp_target_count
from autopar.training.objectives.mtp.loss import MTPTraining, mtp_labels, mtp_loss_sum
from autopar.training.plan_runner import PlanRunner
from autopar.training.train_context import LoadBalancing, all_reduce_sum

TokenLoss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def global_target_count(batches: list[Batch], runner: PlanRunner) -> torch.Tensor:
    """Target tokens of the whole global batch: all micro-steps of all data-parallel ranks
    (counted before any context-parallel split, so CP ranks of one group agree)."""
    local = sum(count_targets(b.labels) for b in batches).to(torch.float32)
    return all_reduce_sum(local, runner.meshes.get("dp"))


class TokenLossSum(MicroBatchLoss):
    """A micro-batch's token loss over the step's targets; with the head, its loss over the
    head's targets times its scale (its targets ride beside the labels, (B, S, 2)). Records
    (loss share[, head's loss sum, head's accepted targets])."""

    def __init__(
        self,
        loss_fn: TokenLoss,
        learned: torch.Tensor,
        balance: LoadBalancing | None,
        sequences: float,
        device: torch.device,
        head: MTPTraining | None = None,
        head_targets: torch.Tensor | None = None,
    ) -> None:
        super().__init__(balance, sequences, device)
        self.loss_fn, self.learned = loss_fn, learned
        self.targets = learned.clamp(min=1)  # a step without targets (prompts only) has loss 0, not 0/0
        self.head, self.head_targets = head, head_targets
        self.width = 1 if head is None else 3

    def split(self, output: object) -> tuple[object, object]:
        if self.head is None:
            return output, None
        # (the model's output, head logits), or flat under a pipeline: (logits[, routing], head logits)
        *main, head_logits = output  # type: ignore[misc]
        return (main[0] if len(main) == 1 else tuple(main)), head_logits

    def term(
        self, logits: torch.Tensor, extra: object, target: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        labels = target if self.head is None else target[..., 0]
        loss = plain(self.loss_fn(logits, labels) / self.targets)
        if self.head is None:
            return loss, loss.detach().reshape(1)
        assert self.head_targets is not None and isinstance(extra, torch.Tensor)
        head_sum, accepted, _ = mtp_loss_sum(extra, target[..., 1], self.loss_fn)
        trained = loss  # scale 0: the head is measured, not trained (its weights are frozen)
        if self.head.scale:
            trained = loss + self.head.scale * head_sum / self.head_targets.clamp(min=1)
        return trained, torch.stack([loss.detach(), head_sum.detach(), accepted.to(loss.dtype)])


class LanguageModel(Objective):
    """The token loss, and the multi-token-prediction head's when the job trains it."""

    def __init__(self, runner: PlanRunner, head: MTPTraining | None = None) -> None:
        self.runner = runner
        self.head = head
        self.metric_names = HEAD_METRICS if head is not None else ()
        if head is not None and runner.pipeline is not None:
            return_head_output(runner.pipeline)

    @property
    def forward_flags(self) -> Mapping[str, object]:
        return {} if self.head is None else {"mtp": self.head.mode}

    def per_position(self, batch: Batch) -> tuple[torch.Tensor | None, ...]:
        """The head reads the token after each position, from the whole sequences."""
        if self.head is None:
            return ()
        upcoming = NextTokens.of(batch.inputs, batch.documents)
        return upcoming.ids, upcoming.keep

    def forward_kwargs(self, local: tuple[torch.Tensor | None, ...]) -> dict[str, object]:
        if self.head is None:
            return {}
        ids, keep = local
        assert ids is not None
        return {"mtp": self.head.mode, "upcoming": NextTokens(ids, keep)}

    def begin(self, batches: list[Batch], calls_per_batch: int) -> tuple[MicroBatchLoss, list[Batch]]:
        runner = self.runner
        learned = global_target_count(batches, runner)
        sequences = sum(b.inputs.shape[0] for b in batches) * runner.dims.dp
        head_targets = None
        if self.head is not None:
            head_targets = global_mtp_target_count(batches, runner.meshes.get("dp"))
            batches = [_with_head_targets(b) for b in batches]
        loss = TokenLossSum(
            runner.context.loss_fn,
            learned,
            runner.balance,
            sequences,
            runner.device,
            self.head,
            head_targets,
        )
        return loss, batches

    def finish(self, sums: torch.Tensor, local: torch.Tensor, loss: MicroBatchLoss) -> StepOutcome:
        assert isinstance(loss, TokenLossSum)
        learned = loss.learned
        metrics, weight = torch.zeros(0, device=sums.device), None
        if loss.head_targets is not None:
            weight = loss.head_targets
            metrics = sums[1:3] / weight.clamp(min=1)
        return StepOutcome(sums[0], local[0], sums[-1], learned, learned, metrics, weight)


def _with_head_targets(batch: Batch) -> Batch:
    """``batch`` whose labels carry the head's targets beside the main ones (B, S, 2)
    (``mtp_labels``, which reads the packed documents a pipeline's last stage never sees)."""
    target = torch.stack([batch.labels, mtp_labels(batch.labels, batch.documents)], dim=-1)
    return dataclasses.replace(batch, labels=target)

"""The multi-token-prediction head's loss and its teacher-forced acceptance (issue 55).

The head at position i predicts token i+2, so its target is the SFT target of position i+1
(the label mask shifted once more: a prompt token two ahead is never a target). A position
whose next token starts another packed document has no target (the head saw no token of its
own document there), nor one whose token two ahead does. Like the main loss the result is a
sum over tokens, for the caller to divide by the step's global count of head targets.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from autopar.config.sections import JobConfig
from autopar.data.loader import IGNORE_INDEX
from autopar.models.qwen3_5.mtp import MTPMode
from autopar.training.loss import token_loss_sum


def mtp_labels(labels: torch.Tensor, documents: torch.Tensor | None = None) -> torch.Tensor:
    """(B, S-1) targets of the head from the batch's next-token ``labels`` (B, S): position i
    takes ``labels[i+1]``, ignored where token i+1 or i+2 lies in another document than
    token i (the last position's token two ahead is the label's own business, as for the
    main loss)."""
    shifted = labels[:, 1:]
    if documents is None:
        return shifted
    same = documents[:, 1:] == documents[:, :-1]  # (B, S-1): token i+1 in token i's document
    two_ahead = torch.cat([same[:, 1:], torch.ones_like(same[:, :1])], dim=1)  # token i+2 in i+1's
    return shifted.masked_fill(~(same & two_ahead), IGNORE_INDEX)


def mtp_loss_sum(
    logits: torch.Tensor,
    labels: torch.Tensor,
    documents: torch.Tensor | None = None,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = token_loss_sum,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(summed fp32 cross-entropy, head's argmax equal to its target, targets) of the head's
    ``logits`` (B, S-1, V) against the batch's ``labels`` (B, S): ``mtp_loss`` is the first
    over the third and ``mtp_acceptance`` the second over the third, each summed over the
    step's micro-batches and ranks first. ``loss_fn``: the step's token-summed loss (chunked
    or compiled as the main loss is)."""
    targets = mtp_labels(labels, documents)
    valid = targets != IGNORE_INDEX
    accepted = ((logits.detach().argmax(dim=-1) == targets) & valid).sum()
    return loss_fn(logits, targets), accepted, valid.sum()


@dataclass(frozen=True)
class MTPTraining:
    """How a step trains the head: the forward's ``mtp`` mode and the loss's weight."""

    mode: MTPMode
    scale: float

    @staticmethod
    def of(job: JobConfig) -> MTPTraining | None:
        cfg = job.mtp
        if not cfg.enable:
            return None
        return MTPTraining("detached" if cfg.detach else "on", cfg.loss_scale)

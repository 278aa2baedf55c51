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
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from autopar.config.sections import JobConfig
from autopar.data.loader import IGNORE_INDEX
from autopar.models.qwen3_5.mtp import MTPMode, keep_mask
from autopar.training.loss import token_loss_sum


def mtp_labels(labels: torch.Tensor, documents: torch.Tensor | None = None) -> torch.Tensor:
    """(B, S) targets of the head from the batch's next-token ``labels`` (B, S): position i
    takes ``labels[i+1]``, ignored where token i+1 or i+2 lies in another document than
    token i (the last position's token two ahead is the label's own business, as for the
    main loss) and at the last position (the token two ahead is past the sequence)."""
    shifted = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], IGNORE_INDEX)], dim=1)
    if documents is None:
        return shifted
    next_in = keep_mask(documents)  # (B, S): token i+1 in token i's document, False at the end
    # token i+2 in token i+1's (the last two positions left to the labels and to next_in)
    two_ahead = torch.cat([next_in[:, 1:-1], torch.ones_like(next_in[:, :2])], dim=1)
    return shifted.masked_fill(~(next_in & two_ahead), IGNORE_INDEX)


def vocab_argmax(logits: torch.Tensor) -> torch.Tensor:
    """(B, S) argmax over the vocabulary of ``logits`` (B, S, V). Under loss parallel the
    logits are a vocab-sharded DTensor: each rank's best column, then the best over the ranks
    (two (B, S) all-gathers; no rank gathers the vocabulary). A tie between ranks goes to the
    lower rank, as ``argmax`` picks the first column."""
    if not isinstance(logits, DTensor):
        return logits.argmax(dim=-1)
    mesh = logits.device_mesh
    assert logits.placements == (Shard(logits.ndim - 1),), logits.placements
    width = -(-logits.shape[-1] // mesh.size())  # DTensor's Shard splits as torch.chunk does
    best, where = logits.to_local().max(dim=-1)
    where = where + mesh.get_local_rank() * width
    group = mesh.get_group()
    rows = (mesh.size() * best.shape[0], *best.shape[1:])  # the ranks' (B, S) one after another
    bests, wheres = best.new_empty(rows), where.new_empty(rows)
    dist.all_gather_into_tensor(bests, best.contiguous(), group)
    dist.all_gather_into_tensor(wheres, where.contiguous(), group)
    bests, wheres = bests.view(mesh.size(), *best.shape), wheres.view(mesh.size(), *best.shape)
    return wheres.gather(0, bests.argmax(dim=0, keepdim=True))[0]


def mtp_loss_sum(
    logits: torch.Tensor,
    targets: torch.Tensor,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = token_loss_sum,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(summed fp32 cross-entropy, head's argmax equal to its target, targets) of the head's
    ``logits`` (B, S, V) against its ``targets`` (B, S) (``mtp_labels`` of the whole
    sequences: under context parallel, this rank's part of them): ``mtp_loss`` is the first
    over the third and ``mtp_acceptance`` the second over the third, each summed over the
    step's micro-batches and ranks first. ``loss_fn``: the step's token-summed loss (chunked,
    compiled or vocab-parallel as the main loss is)."""
    valid = targets != IGNORE_INDEX
    accepted = ((vocab_argmax(logits.detach()) == targets) & valid).sum()
    loss = loss_fn(logits, targets)
    if isinstance(loss, DTensor):
        loss = loss.full_tensor()
    return loss, accepted, valid.sum()


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

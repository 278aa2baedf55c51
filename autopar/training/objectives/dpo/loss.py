"""Direct preference optimization's losses, as TRL 1.16's ``DPOTrainer`` defines them.

A micro-batch holds ``P`` pairs; sequence ``2j`` is pair j's prompt + chosen completion,
``2j + 1`` its prompt + rejected one (the document ids the packer writes, ``data.pairs``).
A sequence's log-probability is the sum of its completion tokens' log-probabilities under
the model (TRL's ``logps``); the losses read the policy's and the reference's, per pair.

Every loss is a mean over the step's pairs: each rank sums its pairs' losses and divides by
the pairs of the whole global batch, so gradient accumulation and every data-parallel plan
give the single-device mean (the ``sft`` term likewise over the step's chosen tokens).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from autopar.data.loader import IGNORE_INDEX
from autopar.training.token_logps import chunked_token_logps

METRICS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
)
"""What a preference step logs beside its loss: TRL's names, each a mean over the step's pairs."""


@dataclass(frozen=True)
class SequenceLogps:
    """Per sequence of a micro-batch (2P, chosen and rejected interleaved): the summed
    completion log-probabilities and the completion token counts."""

    logps: torch.Tensor  # (2P,) fp32
    tokens: torch.Tensor  # (2P,) fp32

    @property
    def chosen(self) -> torch.Tensor:
        return self.logps[0::2]

    @property
    def rejected(self) -> torch.Tensor:
        return self.logps[1::2]


def token_logps(logits: torch.Tensor, labels: torch.Tensor, chunk_tokens: int = 0) -> torch.Tensor:
    """Each target's log-probability (0 where there is none), fp32, (B, S) from logits (B, S, V);
    vocab-sharded logits (loss parallel, inside its context) give the whole value on every rank.
    ``chunk_tokens``: float32 values for that many positions at a time (0: all at once)."""
    if chunk_tokens:
        return chunked_token_logps(logits, labels, chunk_tokens)[0]
    logps = -F.cross_entropy(
        logits.flatten(0, 1).float(), labels.flatten(), reduction="none", ignore_index=IGNORE_INDEX
    )
    if isinstance(logps, DTensor):
        logps = logps.full_tensor()
    return logps.view(labels.shape)


def sequence_sums(values: torch.Tensor, documents: torch.Tensor, sequences: int) -> torch.Tensor:
    """``values`` (B, S) summed per sequence id of ``documents`` (B, S) into (``sequences``,);
    ids outside [0, sequences) (padding, -1) are dropped."""
    ids = documents.flatten()
    kept = (ids >= 0) & (ids < sequences)
    out = torch.zeros(sequences, dtype=values.dtype, device=values.device)
    return out.index_add(0, torch.where(kept, ids, 0), values.flatten() * kept)


def sequence_logps(
    logits: torch.Tensor, labels: torch.Tensor, documents: torch.Tensor, pairs: int, chunk_tokens: int = 0
) -> SequenceLogps:
    """The micro-batch's ``SequenceLogps`` (this rank's tokens' share under CP)."""
    targets = (labels != IGNORE_INDEX).float()
    return SequenceLogps(
        sequence_sums(token_logps(logits, labels, chunk_tokens), documents, 2 * pairs),
        sequence_sums(targets, documents, 2 * pairs),
    )


@dataclass(frozen=True)
class PairTerms:
    """What a loss type reads of a pair: the policy's and reference's chosen and rejected
    log-probabilities and the completions' token counts, and the job's beta and smoothing."""

    policy: SequenceLogps
    reference: torch.Tensor  # (2P,) the reference's logps, interleaved as policy.logps
    beta: float
    label_smoothing: float

    @property
    def chosen_ratio(self) -> torch.Tensor:
        return self.policy.chosen - self.reference[0::2]

    @property
    def rejected_ratio(self) -> torch.Tensor:
        return self.policy.rejected - self.reference[1::2]

    @property
    def delta(self) -> torch.Tensor:
        return self.chosen_ratio - self.rejected_ratio

    def per_token_delta(self) -> torch.Tensor:
        """The log-ratio difference with each completion's ratio divided by its length."""
        tokens = self.policy.tokens.clamp(min=1.0)
        return self.chosen_ratio / tokens[0::2] - self.rejected_ratio / tokens[1::2]


def _sigmoid(t: PairTerms) -> torch.Tensor:
    return -F.logsigmoid(t.beta * t.delta)


def _hinge(t: PairTerms) -> torch.Tensor:
    return torch.relu(1 - t.beta * t.delta)


def _ipo(t: PairTerms) -> torch.Tensor:
    """IPO's squared loss on the length-normalised ratios (TRL's form, agreed with IPO's authors)."""
    return (t.per_token_delta() - 1 / (2 * t.beta)) ** 2


def _robust(t: PairTerms) -> torch.Tensor:
    eps = t.label_smoothing
    clean = -(1 - eps) * F.logsigmoid(t.beta * t.delta)
    flipped = -eps * F.logsigmoid(-t.beta * t.delta)
    return (clean - flipped) / (1 - 2 * eps)


def _exo_pair(t: PairTerms) -> torch.Tensor:
    eps = t.label_smoothing
    z = t.beta * t.delta
    return torch.sigmoid(z) * (F.logsigmoid(z) - math.log1p(-eps)) + torch.sigmoid(-z) * (
        F.logsigmoid(-z) - math.log(eps)
    )


def _nca_pair(t: PairTerms) -> torch.Tensor:
    chosen, rejected = t.beta * t.chosen_ratio, t.beta * t.rejected_ratio
    return -F.logsigmoid(chosen) - 0.5 * F.logsigmoid(-chosen) - 0.5 * F.logsigmoid(-rejected)


def _bco_pair(t: PairTerms) -> torch.Tensor:
    return -F.logsigmoid(t.beta * t.chosen_ratio) - F.logsigmoid(-t.beta * t.rejected_ratio)


def _sigmoid_norm(t: PairTerms) -> torch.Tensor:
    return -F.logsigmoid(t.beta * t.per_token_delta())


PAIR_LOSSES: dict[str, Callable[[PairTerms], torch.Tensor]] = {
    "sigmoid": _sigmoid,
    "hinge": _hinge,
    "ipo": _ipo,
    "robust": _robust,
    "exo_pair": _exo_pair,
    "nca_pair": _nca_pair,
    "bco_pair": _bco_pair,
    "sigmoid_norm": _sigmoid_norm,
}
"""Per-pair losses by TRL's ``loss_type`` name; ``sft`` is the one token-level term beside them."""
LOSS_TYPES = (*PAIR_LOSSES, "sft")
SMOOTHED = ("robust", "exo_pair")
"""The loss types that read ``label_smoothing`` (TRL 1.16's sigmoid no longer does)."""


@dataclass(frozen=True)
class PairLosses:
    """The job's combination of loss types (``[dpo]``), and the step's normalizers."""

    loss_types: tuple[str, ...]
    weights: tuple[float, ...]
    beta: float
    label_smoothing: float

    def loss(
        self,
        policy: SequenceLogps,
        reference: torch.Tensor,
        global_pairs: float,
        global_chosen_tokens: torch.Tensor,
    ) -> torch.Tensor:
        """This micro-batch's share of the step loss: its pairs' losses over ``global_pairs``,
        and with ``sft`` its chosen tokens' negative log-probabilities (their sum is the chosen
        sequences') over the step's ``global_chosen_tokens``."""
        terms = PairTerms(policy, reference, self.beta, self.label_smoothing)
        total = torch.zeros((), device=policy.logps.device)
        for name, weight in zip(self.loss_types, self.weights):
            if name == "sft":
                total = total + weight * -policy.chosen.sum() / global_chosen_tokens
            else:
                total = total + weight * PAIR_LOSSES[name](terms).sum() / global_pairs
        return total

    def metric_sums(self, policy: SequenceLogps, reference: torch.Tensor) -> torch.Tensor:
        """``METRICS`` summed over this micro-batch's pairs (divide by the step's pairs)."""
        chosen = self.beta * (policy.chosen - reference[0::2]).detach()
        rejected = self.beta * (policy.rejected - reference[1::2]).detach()
        return torch.stack(
            [
                chosen.sum(),
                rejected.sum(),
                (chosen > rejected).float().sum(),
                (chosen - rejected).sum(),
                policy.chosen.detach().sum(),
                policy.rejected.detach().sum(),
            ]
        )

"""TRL 1.16's GRPO losses (``GRPOTrainer._compute_loss``) on packed completions.

A micro-batch packs completions as documents (prompt + completion each, the loss on the
completion's tokens only), so every number TRL keeps per completion row is here per token:
the labels carry, beside each token's label, its completion's id in the micro-batch, the
token's weight in the step loss, the completion's advantage, the sampler's log-probability
(pi_old) and the reference's (``Columns``). The weight folds in each loss type's
normalisation over the step (TRL's across micro-batches and ranks), so the step loss is one
weighted sum of per-token losses, whatever the split:

- dapo, cispo: 1 / the generation batch's completion tokens over every rank;
- grpo: 1 / (the completion's tokens x the step's completions);
- bnpo: 1 / (the micro-batch's completion tokens x the step's micro-batches);
- dr_grpo: 1 / (the step's completions x max_completion_length).

Under context parallelism a completion's tokens lie on several ranks: its per-sequence sums
(GSPO's mean log ratio) are summed over them, and since each rank's loss is its own tokens'
share, a token's gradient through such a sum gathers every rank's (``_SumOverRanks``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from autopar.config.sections import RL
from autopar.data.loader import IGNORE_INDEX
from autopar.training.token_logps import chunked_token_logps

CHANNELS = ("label", "completion", "weight", "advantage", "old_logp", "ref_logp", "is_weight")
"""What a packed micro-batch's labels (B, S, 7) carry per token, in order (``is_weight``: an
importance-sampling correction's factor, 1 without one)."""

METRIC_SUMS = ("entropy", "kl", "clip_low", "clip_high", "clip_region", "tokens", "clip_units", "logp_diff")
"""What each call records beside its loss share: sums over its completion tokens (the clip
ratios over completions at the sequence level), and the counts they are means over."""


class Columns(NamedTuple):
    """A packed micro-batch's per-token columns (``CHANNELS``), each (B, S)."""

    labels: torch.Tensor
    completions: torch.Tensor
    weights: torch.Tensor
    advantages: torch.Tensor
    old_logps: torch.Tensor
    ref_logps: torch.Tensor
    is_weights: torch.Tensor

    @staticmethod
    def of(target: torch.Tensor) -> Columns:
        labels, completions, *rest = target.unbind(-1)
        return Columns(labels.long(), completions.long(), *rest)

    @property
    def mask(self) -> torch.Tensor:
        return self.labels != IGNORE_INDEX


@dataclass(frozen=True)
class PolicyLoss:
    """The job's ``[rl]`` loss settings, TRL's names."""

    loss_type: str
    importance_sampling_level: str
    epsilon_low: float
    epsilon_high: float
    delta: float | None
    beta: float
    temperature: float
    bias_corrected_kl: bool = True
    chunk_tokens: int = 0
    """``training.loss_chunk_tokens``: the log-probabilities' float32 values for that many
    positions at a time (0: all at once)."""

    @staticmethod
    def of(cfg: RL, chunk_tokens: int = 0) -> PolicyLoss:
        high = cfg.epsilon_high if cfg.epsilon_high is not None else cfg.epsilon
        return PolicyLoss(
            cfg.loss_type,
            cfg.importance_sampling_level,
            cfg.epsilon,
            high,
            cfg.delta,
            cfg.beta,
            cfg.temperature,
            cfg.use_bias_correction_kl,
            chunk_tokens,
        )


ENTROPY_POSITIONS = 1024
"""Positions whose entropy is taken at once: the metric's vocabulary-wide float32 temporaries
stay this small whatever the micro-batch."""


def token_logps_and_entropy(
    logits: torch.Tensor, labels: torch.Tensor, temperature: float, chunk_tokens: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each target's log-probability at ``temperature`` (0 where there is none), with its
    graph, and each position's entropy (nats, no graph), fp32 (B, S); vocab-sharded logits are
    gathered first. One vocabulary-wide float32 tensor is kept for backward (the
    log-softmax, as cross-entropy keeps) and about one more exists beside it (the scaled
    logits, until the log-softmax is taken): the entropy is taken a slice at a time. With
    ``chunk_tokens``, ``token_logps.chunked_token_logps`` (no float32 value kept, no gather)."""
    if chunk_tokens:
        return chunked_token_logps(logits, labels, chunk_tokens, temperature, entropy=True)
    if isinstance(logits, DTensor):
        logits = logits.full_tensor()
    scaled = logits.float()
    if temperature != 1.0:  # in place on the float32 copy (a cast keeps nothing for backward)
        scaled = scaled / temperature if scaled is logits else scaled.div_(temperature)
    all_logps = scaled.log_softmax(dim=-1)
    del scaled
    learned = labels != IGNORE_INDEX
    picked = all_logps.gather(-1, torch.where(learned, labels, 0).unsqueeze(-1)).squeeze(-1)
    logps = torch.where(learned, picked, 0.0)
    with torch.no_grad():
        rows = all_logps.detach().flatten(0, -2)
        entropy = torch.cat([-(part.exp() * part).sum(-1) for part in rows.split(ENTROPY_POSITIONS)])
    return logps, entropy.view(labels.shape)


class _SumOverRanks(torch.autograd.Function):
    """All-reduce (sum) whose backward all-reduces too: each rank's loss reads the whole
    completion's sum through its own tokens, so a token's gradient gathers every rank's."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def sum_over_cp(x: torch.Tensor, cp_mesh: DeviceMesh | None) -> torch.Tensor:
    """``x`` summed over the ranks sharing each completion (identity without CP)."""
    if cp_mesh is None or cp_mesh.size() == 1:
        return x
    return _SumOverRanks.apply(x, cp_mesh.get_group())


def per_sequence_means(
    values: list[torch.Tensor], columns: Columns, sequences: int, cp_mesh: DeviceMesh | None
) -> list[torch.Tensor]:
    """Each of ``values`` (B, S) averaged over each completion's target tokens (summed over
    the CP ranks that hold them): (``sequences``,) each, 0 for a completion without any."""
    ids = columns.completions.flatten()
    kept = columns.mask.flatten() & (ids >= 0)
    index = torch.where(kept, ids, 0)
    counts = sum_over_cp(values[0].new_zeros(sequences).index_add(0, index, kept.float()), cp_mesh)
    means = []
    for value in values:
        sums = value.new_zeros(sequences).index_add(0, index, value.flatten() * kept)
        means.append(sum_over_cp(sums, cp_mesh) / counts.clamp(min=1.0))
    return means


def _present(columns: Columns, sequences: int, cp_mesh: DeviceMesh | None) -> torch.Tensor:
    """(``sequences``,) 1 for each completion the call holds a token of on any CP rank (a
    pipeline micro-batch holds some of its micro-batch's completions), else 0."""
    ids = columns.completions.flatten()
    held = (ids >= 0).float()
    found = held.new_zeros(sequences).index_add(0, torch.where(ids >= 0, ids, 0), held)
    return (sum_over_cp(found, cp_mesh) > 0).float()


def _at_tokens(per_sequence: torch.Tensor, columns: Columns) -> torch.Tensor:
    """(B, S) each token's completion's value of ``per_sequence`` (0 off any completion)."""
    ids = columns.completions
    return torch.where(ids >= 0, per_sequence[ids.clamp(min=0)], 0.0)


def policy_loss(
    settings: PolicyLoss, logits: torch.Tensor, columns: Columns, sequences: int, cp_mesh: DeviceMesh | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(this call's share of the step loss, its ``METRIC_SUMS``, the largest |pi_old - pi|
    over its tokens) of a micro-batch's ``logits`` and packed ``columns``; ``sequences``: the
    completions the call's ids number."""
    maskf = columns.mask.float()
    logps, entropy = token_logps_and_entropy(
        logits, columns.labels, settings.temperature, settings.chunk_tokens
    )
    log_ratio = logps - columns.old_logps
    advantages = columns.advantages
    if settings.importance_sampling_level == "sequence":  # GSPO: one ratio per completion
        seq_log_weights, seq_advantages = per_sequence_means(
            [log_ratio, advantages], columns, sequences, cp_mesh
        )
        coef_1 = _at_tokens(torch.exp(seq_log_weights), columns)
        clipped = _clipped(settings, torch.exp(seq_log_weights.detach()), seq_advantages)
        cp = 1 if cp_mesh is None else cp_mesh.size()  # every CP rank counts every completion
        clip_sums = [c.float().sum() / cp for c in clipped] + [
            _present(columns, sequences, cp_mesh).sum() / cp
        ]
    else:
        coef_1 = torch.exp(log_ratio)
        clipped = _clipped(settings, coef_1.detach(), advantages)
        clip_sums = [(c.float() * maskf).sum() for c in clipped] + [maskf.sum()]
    kl = torch.zeros_like(logps)
    if settings.beta != 0.0:
        delta_ref = columns.ref_logps - logps
        kl = torch.exp(delta_ref) - delta_ref - 1
        if settings.bias_corrected_kl:
            kl = kl * coef_1
    if settings.loss_type == "cispo":
        clamped = torch.clamp(coef_1, max=settings.epsilon_high).detach()
        per_token = -clamped * advantages * logps
    else:
        coef_2 = torch.clamp(coef_1, 1 - settings.epsilon_low, 1 + settings.epsilon_high)
        if settings.delta is not None:
            coef_1 = torch.clamp(coef_1, max=settings.delta)
        per_token = -torch.min(coef_1 * advantages, coef_2 * advantages)
    per_token = per_token * columns.is_weights
    if settings.beta != 0.0:
        per_token = per_token + settings.beta * kl
    loss = (per_token * columns.weights * maskf).sum()
    gap = (logps.detach() - columns.old_logps).abs() * maskf
    sums = torch.stack(
        [
            (entropy * maskf).sum(),
            (kl.detach() * maskf).sum(),
            *clip_sums[:3],
            maskf.sum(),
            clip_sums[3],
            gap.sum(),
        ]
    )
    return loss, sums, gap.max() if gap.numel() else gap.new_zeros(())


def _clipped(
    settings: PolicyLoss, coef_1: torch.Tensor, advantages: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Where the ratio is clipped below, above, and either (TRL's clip_ratio metrics; cispo's
    cap counts as above)."""
    if settings.loss_type == "cispo":
        high = (coef_1 > settings.epsilon_high) & (advantages > 0)
        return torch.zeros_like(high), high, high
    low = (coef_1 < 1 - settings.epsilon_low) & (advantages < 0)
    high = (coef_1 > 1 + settings.epsilon_high) & (advantages > 0)
    return low, high, low | high

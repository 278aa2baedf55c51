"""One preference (DPO) step's forward and backward: the policy's and the reference's
log-probabilities of each pair's completions, and TRL's losses on them.

The reference is one of three (``dpo.reference``), each a callable giving a micro-batch's
per-sequence reference log-probabilities: a frozen copy run under the same plan, the policy
itself with its LoRA adapters bypassed, or a table written by a pass before training.

Under context parallelism each rank holds a slice of every row, so a sequence's
log-probability is the sum of its ranks' partial sums (``cp_sum``); every rank then computes
the same pair losses, and each one's backward reaches its own tokens only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from autopar.config.sections import DPO
from autopar.data.loader import Batch
from autopar.data.pair_batches import chosen_targets
from autopar.models.qwen import split_output
from autopar.parallel.lora import adapters_off
from autopar.training.objectives.dpo.loss import METRICS, Objective, SequenceLogps, sequence_logps
from autopar.training.train_context import TrainContext

ReferenceLogps = Callable[[Batch], torch.Tensor]
"""A micro-batch (whole, before any CP split) -> its (2P,) reference log-probabilities."""


class _SumOverRanks(torch.autograd.Function):
    """All-reduce (sum) forward; backward passes the gradient through unchanged, since every
    rank computes the same loss from the sum and back-propagates it into its own share."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def cp_sum(x: torch.Tensor, cp_mesh: DeviceMesh | None) -> torch.Tensor:
    """``x`` summed over the ranks that share each sequence (identity without CP)."""
    if cp_mesh is None or cp_mesh.size() == 1:
        return x
    return _SumOverRanks.apply(x, cp_mesh.get_group())


@dataclass
class PreferenceContext:
    """What a preference step needs beside the SFT step's ``TrainContext``."""

    objective: Objective
    reference: ReferenceLogps
    pairs_per_micro_batch: int
    cp_mesh: DeviceMesh | None = None

    def logps(
        self, model: nn.Module, batch: Batch, context: TrainContext
    ) -> tuple[SequenceLogps, torch.Tensor | None]:
        """The policy's per-sequence log-probabilities of ``batch`` (summed over CP ranks,
        with the graph for backward) and its routing statistics (a mixture of experts)."""
        with context.sequence(batch) as (local, positions), context.loss_parallel_context():
            with context.forward_precision():
                out = model(local.inputs, positions=positions, documents=local.documents)
            logits, routing = split_output(out)
            policy = sequence_logps(
                logits, local.labels, local.documents, pair_count(batch, self.pairs_per_micro_batch)
            )
        summed = SequenceLogps(cp_sum(policy.logps, self.cp_mesh), cp_sum(policy.tokens, self.cp_mesh))
        return summed, routing


def pair_count(batch: Batch, default: int) -> int:
    """The pairs of a micro-batch: as many as it names (a validation batch may hold another
    number than training's), else ``default``."""
    return len(batch.pairs) if batch.pairs is not None else default


def objective_from(cfg: DPO) -> Objective:
    weights = tuple(cfg.loss_weights) if cfg.loss_weights is not None else (1.0,) * len(cfg.loss_type)
    return Objective(tuple(cfg.loss_type), weights, cfg.beta, cfg.label_smoothing)


def model_reference(
    model: nn.Module,
    pairs: int,
    context: TrainContext,
    cp_mesh: DeviceMesh | None,
    bypass_adapters: bool = False,
) -> ReferenceLogps:
    """The reference as a forward of ``model`` (a frozen copy, or with ``bypass_adapters``
    the policy's base) under the step's plan, without gradients."""

    @torch.no_grad()
    def reference(batch: Batch) -> torch.Tensor:
        scope = adapters_off(model) if bypass_adapters else contextlib.nullcontext()
        with scope, context.sequence(batch) as (local, positions), context.loss_parallel_context():
            with context.forward_precision():
                out = model(local.inputs, positions=positions, documents=local.documents)
            logits, _ = split_output(out)
            logps = sequence_logps(logits, local.labels, local.documents, pair_count(batch, pairs))
        return cp_sum(logps.logps, cp_mesh)

    return reference


def table_reference(table: torch.Tensor) -> ReferenceLogps:
    """The reference from precomputed log-probabilities: ``table`` (N, 2), row i pair i's
    chosen and rejected."""

    def reference(batch: Batch) -> torch.Tensor:
        assert batch.pairs is not None
        return table.to(batch.inputs.device)[batch.pairs].flatten()

    return reference


def step_chosen_tokens(batches: list[Batch], dp_mesh: DeviceMesh | None) -> torch.Tensor:
    """The step's chosen-completion targets over every data-parallel rank (the ``sft`` term's
    normalizer), at least 1."""
    local = sum(chosen_targets(b).sum() for b in batches).to(torch.float32)
    if dp_mesh is not None and dp_mesh.size() > 1:
        local = local.clone()
        dist.all_reduce(local, group=dp_mesh.get_group())
    return local.clamp(min=1)


def preference_forward_backward(
    model: nn.Module,
    batches: list[Batch],
    context: TrainContext,
    preference: PreferenceContext,
    global_pairs: int,
    global_chosen_tokens: torch.Tensor,
    load_balance: Callable[[torch.Tensor], torch.Tensor] | None = None,
    balance_coef: float = 0.0,
    backward: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every micro-batch's forward (and backward); this rank's share of the step loss, of
    ``METRICS`` (means over the step's pairs) and of a mixture's load-balancing loss (the
    first two already divided by the CP degree, so summing over the data- and
    context-parallel ranks gives the step's values; the third is per rank's own tokens, as
    the SFT step's)."""
    cp = 1 if preference.cp_mesh is None else preference.cp_mesh.size()
    total = torch.zeros((), device=global_chosen_tokens.device)
    balance = torch.zeros((), device=global_chosen_tokens.device)
    metrics = torch.zeros(len(METRICS), device=global_chosen_tokens.device)
    for batch in batches:
        reference = preference.reference(batch)
        policy, routing = preference.logps(model, batch, context)
        loss = preference.objective.loss(policy, reference, global_pairs, global_chosen_tokens)
        trained = loss
        if routing is not None and load_balance is not None:
            aux = load_balance(routing)
            trained = loss + balance_coef * aux
            balance += aux.detach()
        if backward:
            with context.loss_parallel_context():
                trained.backward()
        total += loss.detach() / cp
        metrics += preference.objective.metric_sums(policy, reference) / (global_pairs * cp)
    return total, metrics, balance

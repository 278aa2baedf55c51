"""Direct preference optimization as a training objective: the policy's and the reference's
log-probabilities of each pair's completions, and TRL's losses on them (``loss.py``).

A DPO loss is not a sum over tokens: a pair's loss needs both of its sequences' whole
log-probabilities, the policy's and the reference's. So each micro-batch's labels carry,
beside each token's label and document id, the reference log-probability of each sequence
at its first token (``with_targets``); the loss sums both per sequence. Under a pipeline
the loader lays the pairs out in ``pack_groups``' fixed layout (every pipeline micro-batch
holds whole pairs, numbered from 0), so the last stage reads whole pairs per call. Under
context parallelism each rank holds a slice of every row: a sequence's log-probability is
the sum of its ranks' partial sums (``cp_sum``), every rank then computes the same pair
losses, and each one's backward reaches its own tokens only.

The reference is one of three (``dpo.reference``), each giving a micro-batch's per-sequence
reference log-probabilities: a frozen copy run under the same plan, the policy itself with
its LoRA adapters bypassed (``ReferencePass``), or a table written by a pass before
training (``table_reference``).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from autopar.config.sections import DPO
from autopar.data.loader import Batch
from autopar.data.pair_batches import chosen_targets
from autopar.models.qwen import split_output
from autopar.parallel.pipelining.schedule import Pipeline
from autopar.training.objectives.base import ForwardInputs, MicroBatchLoss, Objective, StepOutcome
from autopar.training.objectives.dpo.loss import (
    METRICS,
    PairLosses,
    SequenceLogps,
    sequence_logps,
    sequence_sums,
)
from autopar.training.plan_runner import PlanRunner, sum_over
from autopar.training.train_context import LoadBalancing, all_reduce_sum

ReferenceLogps = Callable[[list[Batch]], list[torch.Tensor]]
"""Micro-batches (whole, before any CP split) -> each one's (2P,) reference log-probabilities."""


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


def losses_of(cfg: DPO) -> PairLosses:
    weights = tuple(cfg.loss_weights) if cfg.loss_weights is not None else (1.0,) * len(cfg.loss_type)
    return PairLosses(tuple(cfg.loss_type), weights, cfg.beta, cfg.label_smoothing)


def pair_count(batch: Batch, default: int) -> int:
    """The pairs of a micro-batch: as many as it names (a held-out batch may hold another
    number than training's), else ``default``."""
    return len(batch.pairs) if batch.pairs is not None else default


def with_targets(batch: Batch, reference: torch.Tensor, pairs_per_group: int) -> Batch:
    """``batch`` whose labels are what the pair loss reads (B, S, 3) fp32: each token's label,
    its document id, and ``reference`` (2P,) of its sequence at the sequence's first token
    (0 elsewhere). Labels and document ids are exact in fp32 (below 2^24)."""
    documents = batch.documents
    assert documents is not None
    rows_per_group = documents.shape[0] * 2 * pairs_per_group // reference.numel()
    first_pair = torch.arange(documents.shape[0], device=documents.device) // rows_per_group * pairs_per_group
    starts = documents >= 0
    starts[:, 1:] &= documents[:, 1:] != documents[:, :-1]
    index = torch.where(starts, documents + 2 * first_pair[:, None], 0)
    values = torch.where(starts, reference.to(documents.device)[index], 0.0)
    target = torch.stack([batch.labels.float(), documents.float(), values.float()], dim=-1)
    return dataclasses.replace(batch, labels=target)


def _split(target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return target[..., 0].long(), target[..., 1].long(), target[..., 2]


class PairLoss(MicroBatchLoss):
    """One call's pairs (``pairs`` whole pairs): their share of the step loss; records it
    and ``METRICS``' sums over them, each over the step's pairs (and the CP degree, as every
    CP rank computes the same)."""

    width = 1 + len(METRICS)

    def __init__(
        self,
        losses: PairLosses,
        pairs: int,
        step: tuple[float, torch.Tensor, torch.Tensor],
        cp_mesh: DeviceMesh | None,
        balance: LoadBalancing | None,
        rows: torch.Tensor,
        device: torch.device,
        chunk_tokens: int = 0,
    ) -> None:
        """``step``: the step's pairs, chosen targets and tokens (padding left out), over every
        rank; ``chunk_tokens``: ``training.loss_chunk_tokens``."""
        super().__init__(balance, rows, device)
        self.losses, self.pairs, self.cp_mesh = losses, pairs, cp_mesh
        self.global_pairs, self.global_chosen, self.tokens = step
        self.cp = 1 if cp_mesh is None else cp_mesh.size()
        self.chunk_tokens = chunk_tokens

    def term(
        self, logits: torch.Tensor, extra: object, target: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        labels, documents, reference_tokens = _split(target)
        own = sequence_logps(logits, labels, documents, self.pairs, self.chunk_tokens)
        policy = SequenceLogps(cp_sum(own.logps, self.cp_mesh), cp_sum(own.tokens, self.cp_mesh))
        reference = cp_sum(sequence_sums(reference_tokens, documents, 2 * self.pairs), self.cp_mesh)
        loss = self.losses.loss(policy, reference, self.global_pairs, self.global_chosen)
        metrics = self.losses.metric_sums(policy, reference) / (self.global_pairs * self.cp)
        return loss, torch.cat([(loss.detach() / self.cp).reshape(1), metrics])


class Preference(Objective):
    """DPO over the step's pairs with the job's reference."""

    metric_names = METRICS

    def __init__(
        self, runner: PlanRunner, losses: PairLosses, reference: ReferenceLogps, pairs_per_micro_batch: int
    ) -> None:
        self.runner, self.losses, self.reference = runner, losses, reference
        self.pairs_per_micro_batch = pairs_per_micro_batch

    def begin(self, batches: list[Batch], calls_per_batch: int) -> tuple[MicroBatchLoss, list[Batch]]:
        runner = self.runner
        dp_mesh = runner.meshes.get("dp")
        pairs = pair_count(batches[0], self.pairs_per_micro_batch)
        global_pairs = pairs * len(batches) * runner.dims.dp
        # rows and real tokens (padding left out) over every rank, kept on the device
        sizes = torch.stack(
            [
                torch.stack([b.documents.new_tensor(len(b.documents)), (b.documents >= 0).sum()])
                for b in batches
            ]
        )
        rows, tokens = all_reduce_sum(sizes.sum(0).float(), dp_mesh)
        chosen = step_chosen_tokens(batches, dp_mesh)  # every pair has some (an empty completion is refused)
        per_call = pairs // calls_per_batch
        references = self.reference(batches)
        targets = [with_targets(b, r, per_call) for b, r in zip(batches, references, strict=True)]
        loss = PairLoss(
            self.losses,
            per_call,
            (global_pairs, chosen, tokens),
            runner.meshes.get("cp"),
            runner.balance,
            rows,
            runner.device,
            runner.job.training.loss_chunk_tokens,
        )
        return loss, targets

    def finish(self, sums: torch.Tensor, local: torch.Tensor, loss: MicroBatchLoss) -> StepOutcome:
        assert isinstance(loss, PairLoss)
        pairs = torch.as_tensor(float(loss.global_pairs), device=sums.device)
        return StepOutcome(
            sums[0], local[0], sums[-1], loss.global_chosen, pairs, sums[1:-1], tokens=loss.tokens
        )


def step_chosen_tokens(batches: list[Batch], dp_mesh: DeviceMesh | None) -> torch.Tensor:
    """The step's chosen-completion targets over every data-parallel rank (the ``sft`` term's
    normalizer), at least 1."""
    local = sum(chosen_targets(b).sum() for b in batches).to(torch.float32)
    return all_reduce_sum(local, dp_mesh).clamp(min=1)


class SequenceRecord:
    """A reference pass's "loss": records each call's (2 * pairs,) sequence log-probabilities,
    summed over CP ranks, and returns zero."""

    def __init__(self, pairs: int, cp_mesh: DeviceMesh | None, chunk_tokens: int = 0) -> None:
        self.pairs, self.cp_mesh, self.chunk_tokens = pairs, cp_mesh, chunk_tokens
        self.logps: list[torch.Tensor] = []

    def __call__(self, output: object, target: torch.Tensor) -> torch.Tensor:
        logits, _ = split_output(output)  # type: ignore[arg-type]
        labels, documents, _ = _split(target)
        logps = sequence_logps(logits, labels, documents, self.pairs, self.chunk_tokens).logps
        self.logps.append(cp_sum(logps, self.cp_mesh))
        return torch.zeros((), device=logps.device)


class ReferencePass:
    """The reference as a forward-only pass under the job's plan: of a frozen copy's parts
    (or pipeline), or of the policy inside ``scope`` (its adapters bypassed); every pipeline
    rank gets the values."""

    def __init__(
        self,
        runner: PlanRunner,
        model: nn.Module | Pipeline | None,
        pairs_per_micro_batch: int,
        scope: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    ) -> None:
        self.runner, self.model, self.scope = runner, model, scope
        self.pairs_per_micro_batch = pairs_per_micro_batch

    @torch.no_grad()
    def __call__(self, batches: list[Batch]) -> list[torch.Tensor]:
        runner = self.runner
        sequences = [2 * pair_count(b, self.pairs_per_micro_batch) for b in batches]
        per_call = sequences[0] // 2 // runner.calls_per_batch
        record = SequenceRecord(per_call, runner.meshes.get("cp"), runner.job.training.loss_chunk_tokens)
        zeros = [torch.zeros(n, device=runner.device) for n in sequences]
        targets = [with_targets(b, z, per_call) for b, z in zip(batches, zeros, strict=True)]
        with self.scope():
            calls = runner.run(targets, record, ForwardInputs(), backward=False, model=self.model)
        values = torch.cat(record.logps[len(record.logps) - calls :]) if calls else torch.cat(zeros)
        return list(sum_over(values, runner, "pp").split(sequences))


def table_reference(table: torch.Tensor) -> ReferenceLogps:
    """The reference from precomputed log-probabilities: ``table`` (N, 2), row i pair i's
    chosen and rejected."""

    def reference(batches: list[Batch]) -> list[torch.Tensor]:
        out = []
        for batch in batches:
            assert batch.pairs is not None
            out.append(table.to(batch.inputs.device)[batch.pairs].flatten())
        return out

    return reference

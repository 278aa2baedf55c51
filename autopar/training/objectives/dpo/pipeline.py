"""DPO under pipeline parallelism: the pair losses on the last stage, per pipeline micro-batch.

A DPO loss is not a sum over tokens: a pair's loss needs both of its sequences' whole
log-probabilities, the policy's and the reference's. Under a pipeline the schedule cuts each
micro-step's rows into equal micro-batches and calls the loss on the last stage for each, so:

- the loader lays the pairs out in ``pack_groups``' fixed layout (every pipeline micro-batch
  holds whole pairs, numbered from 0, and the same shapes every step);
- the schedule's ``target`` carries, beside each token's label and document id, the
  reference log-probability of each sequence at its first token (``with_targets``), so the
  last stage sums it per sequence as it sums the policy's;
- a model reference (a frozen copy, or the policy with adapters off) is itself a pipelined
  forward (``pipelined_reference``), whose last stage records each micro-batch's sequence
  log-probabilities; they are summed over the pipeline ranks so that every rank holds them.

The step loss of a micro-batch is then the non-pipelined step's (``Objective.loss`` over the
step's pairs), its gradients need no later division, and each micro-step gives the same loss
as ``preference_step`` on one device.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable

import torch
from torch.distributed.device_mesh import DeviceMesh

from autopar.data.loader import Batch
from autopar.parallel.pipelining.schedule import MicroBatchContext, Pipeline, pipeline_forward_backward
from autopar.training.objectives.dpo.loss import (
    METRICS,
    Objective,
    SequenceLogps,
    sequence_logps,
    sequence_sums,
)
from autopar.training.objectives.dpo.step import ReferenceLogps, cp_sum
from autopar.training.train_context import all_reduce_sum


def with_targets(batch: Batch, reference: torch.Tensor, pairs_per_group: int) -> Batch:
    """``batch`` whose labels are the last stage's target (B, S, 3) fp32: each token's label,
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


class PreferenceStageLoss:
    """The last stage's loss of one pipeline micro-batch (``pairs`` whole pairs): its pairs'
    share of the step loss, with the step's normalizers set before each step; records each
    call's ``METRICS`` sums."""

    def __init__(self, objective: Objective, pairs: int, cp_mesh: DeviceMesh | None) -> None:
        self.objective, self.pairs, self.cp_mesh = objective, pairs, cp_mesh
        self.global_pairs = 1.0
        self.global_chosen = torch.ones(())
        self.metric_sums: list[torch.Tensor] = []

    def __call__(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        labels, documents, reference_tokens = _split(target)
        own = sequence_logps(logits, labels, documents, self.pairs)
        policy = SequenceLogps(cp_sum(own.logps, self.cp_mesh), cp_sum(own.tokens, self.cp_mesh))
        reference = cp_sum(sequence_sums(reference_tokens, documents, 2 * self.pairs), self.cp_mesh)
        self.metric_sums.append(self.objective.metric_sums(policy, reference))
        return self.objective.loss(policy, reference, self.global_pairs, self.global_chosen)


class ReferenceStageLoss:
    """The last stage's "loss" of a reference pass: records the micro-batch's (2 * pairs,)
    sequence log-probabilities, summed over CP ranks, and returns zero."""

    def __init__(self, pairs: int, cp_mesh: DeviceMesh | None) -> None:
        self.pairs, self.cp_mesh = pairs, cp_mesh
        self.logps: list[torch.Tensor] = []

    def __call__(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        labels, documents, _ = _split(target)
        logps = sequence_logps(logits, labels, documents, self.pairs).logps
        self.logps.append(cp_sum(logps, self.cp_mesh))
        return torch.zeros((), device=logps.device)


def pipelined_reference(
    pipeline: Pipeline,
    micro_batch: MicroBatchContext,
    pairs_per_group: int,
    cp_mesh: DeviceMesh | None,
    pp_mesh: DeviceMesh | None,
    scope: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
) -> ReferenceLogps:
    """The reference as a forward-only pass of ``pipeline`` (a frozen copy's, or the policy's
    inside ``scope``, e.g. with adapters off), its loss swapped for the duration; every
    pipeline rank gets the (2P,) values."""
    record = ReferenceStageLoss(pairs_per_group, cp_mesh)

    @torch.no_grad()
    def reference(batch: Batch) -> torch.Tensor:
        pairs = 2 * pairs_per_group * pipeline.n_micro
        record.logps.clear()
        own, pipeline.loss.loss_fn = pipeline.loss.loss_fn, record
        try:
            with scope():
                zeros = torch.zeros(pairs, device=batch.inputs.device)
                ones = torch.ones((), device=batch.inputs.device)
                targets = with_targets(batch, zeros, pairs_per_group)
                pipeline_forward_backward(pipeline, [targets], ones, micro_batch, backward=False)
        finally:
            pipeline.loss.loss_fn = own
        values = torch.cat(record.logps[-pipeline.n_micro :]) if pipeline.has_last else zeros
        return all_reduce_sum(values, pp_mesh)

    return reference


def preference_pipeline_forward_backward(
    pipeline: Pipeline,
    batches: list[Batch],
    micro_batch: MicroBatchContext,
    reference: ReferenceLogps,
    global_pairs: float,
    global_chosen_tokens: torch.Tensor,
    global_rows: torch.Tensor | float,
    meshes: tuple[DeviceMesh | None, DeviceMesh | None],
    backward: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``preference_forward_backward``'s results under a pipeline (``pipeline.loss.loss_fn``
    a ``PreferenceStageLoss``), each already summed over the pipeline ranks (``meshes``: the
    CP and PP meshes)."""
    cp_mesh, pp_mesh = meshes
    stage_loss = pipeline.loss.loss_fn
    assert isinstance(stage_loss, PreferenceStageLoss)
    stage_loss.global_pairs, stage_loss.global_chosen = global_pairs, global_chosen_tokens
    device = global_chosen_tokens.device
    metrics = torch.zeros(len(METRICS), device=device)
    # every micro-step's reference first (a forward-only pass each), then one schedule run over
    # them all, which divides the gradients once; the stage loss's last calls are the
    # micro-batches' own (torch may first call it to infer gradient shapes)
    targets = [with_targets(batch, reference(batch), stage_loss.pairs) for batch in batches]
    stage_loss.metric_sums.clear()
    total, balance, _ = pipeline_forward_backward(
        pipeline,
        targets,
        torch.ones((), device=device),
        micro_batch,
        backward,
        global_sequences=global_rows,
    )
    if pipeline.has_last:
        metrics += torch.stack(stage_loss.metric_sums[-pipeline.n_micro * len(batches) :]).sum(0)
    cp = 1 if cp_mesh is None else cp_mesh.size()
    return (
        all_reduce_sum(total / cp, pp_mesh),
        all_reduce_sum(metrics / (global_pairs * cp), pp_mesh),
        all_reduce_sum(balance, pp_mesh),
    )

"""Qwen3.5's multi-token-prediction head under pipeline parallelism (issue 55).

The head runs on the last stage beside ``lm_head`` (``split.BESIDE_HEAD``). It reads the
embedding of each next token, which only the first stage holds: every stage before the last
passes its hidden states and those embeddings on stacked as one (2B, S, H) tensor
(``Qwen35.forward``), so the gradient of the head's input flows back to the embedding through
the pipeline, and a detached head sends zeros back for it (exact, at one more B x S x H per
hop each way).

The last stage's loss adds the head's summed loss (``StageLoss``), weighted by the step's
targets over the head's targets, since the schedule's gradients are divided by the step's
targets afterwards: the head's share is then its loss over its own targets, as on one device.
Its targets are computed from the whole micro-step before any split and ride in the
schedule's target beside the labels (``with_head_targets``).
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from autopar.config.errors import ConfigError
from autopar.config.sections import MTP
from autopar.data.loader import Batch
from autopar.parallel.mesh import ParallelDims
from autopar.parallel.pipelining.stage_loss import LossFn, StageHead
from autopar.training.objectives.mtp.loss import MTPTraining, mtp_labels, mtp_loss_sum


def check_pipelined_head(cfg: MTP, dims: ParallelDims) -> None:
    """What the head does not run with under a pipeline yet, in one line naming the fields."""
    if dims.pp == 1:
        return
    if dims.cp > 1:
        raise ConfigError(
            f"parallelism.pipeline_parallel_degree={dims.pp} with context_parallel_degree={dims.cp} and "
            "mtp.enable=true: not supported yet (the micro-batches carry each rank's chunk of the tokens, "
            "not the head's next tokens and targets built on the whole sequences); use one of them (the "
            "head runs under either alone), or --mtp.enable false"
        )
    if cfg.only:
        raise ConfigError(
            f"mtp.only=true with parallelism.pipeline_parallel_degree={dims.pp}: the stages before the "
            "last would hold no trained weights; train the head alone with FSDP / TP (pipeline degree 1)"
        )


def stage_head(mtp: MTPTraining, loss_fn: LossFn) -> StageHead:
    """The head as the pipeline's last stage runs it: the step's token loss on its logits,
    weighted by ``mtp.scale``, switched on by the forward's ``mtp`` argument."""
    return StageHead(functools.partial(mtp_loss_sum, loss_fn=loss_fn), mtp.scale, {"mtp": mtp.mode})


def with_head_targets(batch: Batch) -> Batch:
    """``batch`` whose labels are the last stage's target (B, S, 2): each token's label and
    the head's (``mtp_labels``, which reads the packed documents the stage loss never sees)."""
    target = torch.stack([batch.labels, mtp_labels(batch.labels, batch.documents)], dim=-1)
    return dataclasses.replace(batch, labels=target)

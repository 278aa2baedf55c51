"""Pipeline schedules from ``torch.distributed.pipelining``, driven with the trainer's loss.

The last stage computes the same token-summed loss divided by the global target count as
the non-pipelined step, and ``scale_grads=False`` stops the schedule from dividing again by
the number of micro-batches; so pipelining, accumulation and data parallelism all agree.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class
from torch.distributed.tensor import DTensor

from autopar.config.errors import ConfigError
from autopar.config.job import Parallelism
from autopar.data.loader import Batch
from autopar.models.args import ModelArgs
from autopar.pipelining.split import StageStyle, check_split, even_split
from autopar.step import TrainContext

SCHEDULE_STYLES: dict[str, tuple[StageStyle, int | None]] = {
    "GPipe": ("loop", 1),
    "1F1B": ("loop", 1),
    "Interleaved1F1B": ("loop", None),
    "LoopedBFS": ("loop", None),
    "InterleavedZeroBubble": ("loop", None),
    "ZBVZeroBubble": ("v", 2),
    "DualPipeV": ("v", 2),
}
"""Schedule name -> (how stages map to ranks, stages per rank; None: any, default 2)."""


def schedule_name(cfg: Parallelism) -> str:
    """The canonical spelling of ``pipeline_parallel_schedule`` (case-insensitive)."""
    names = {n.lower(): n for n in SCHEDULE_STYLES}
    name = names.get(cfg.pipeline_parallel_schedule.lower())
    if name is None:
        raise ConfigError(
            f"parallelism.pipeline_parallel_schedule={cfg.pipeline_parallel_schedule!r} is "
            f"unknown; choose one of {list(SCHEDULE_STYLES)}"
        )
    try:
        get_schedule_class(name)
    except ValueError:
        raise ConfigError(f"pipeline schedule {name!r} is not in this torch version") from None
    return name


def num_stages(cfg: Parallelism, num_layers: int) -> int:
    """Total stages: from the explicit module lists, layers_per_stage, or the schedule."""
    if cfg.module_fqns_per_model_part:
        return len(cfg.module_fqns_per_model_part)
    if cfg.pipeline_parallel_layers_per_stage is not None:
        units = num_layers + cfg.pipeline_parallel_first_stage_less_layers + cfg.pipeline_parallel_last_stage_less_layers
        return -(-units // cfg.pipeline_parallel_layers_per_stage)
    per_rank = SCHEDULE_STYLES[schedule_name(cfg)][1] or 2
    return cfg.pipeline_parallel_degree * per_rank


def check_schedule(cfg: Parallelism, stages: int, microbatches: int) -> None:
    """The rules torch's schedules enforce at run time, checked before anything starts."""
    name = schedule_name(cfg)
    pp = cfg.pipeline_parallel_degree
    style, per_rank = SCHEDULE_STYLES[name]
    if stages % pp:
        raise ConfigError(f"{stages} pipeline stages do not divide over pipeline_parallel_degree={pp}; use a multiple of {pp}")
    if per_rank is not None and stages != pp * per_rank:
        raise ConfigError(
            f"parallelism.pipeline_parallel_schedule={name!r} runs exactly {per_rank} stage(s) per "
            f"rank, but the split gives {stages} stages for {pp} ranks; use {pp * per_rank} stages"
        )
    if name in ("1F1B", "DualPipeV") and microbatches < stages:
        raise ConfigError(
            f"{name} needs at least as many micro-batches as stages: local_batch_size / "
            f"pipeline_parallel_microbatch_size = {microbatches} < {stages}; raise local_batch_size "
            "or lower pipeline_parallel_microbatch_size"
        )
    if name == "Interleaved1F1B":
        rounds = max(1, microbatches // pp)
        if microbatches % rounds:
            raise ConfigError(f"Interleaved1F1B needs micro-batches ({microbatches}) to be a multiple of {rounds}")


def stage_modules(cfg: Parallelism, args: ModelArgs) -> list[list[str]]:
    """Module names of every stage, explicit or evenly balanced, checked."""
    if cfg.module_fqns_per_model_part:
        stages = cfg.module_fqns_per_model_part
    else:
        stages = even_split(
            args.num_hidden_layers, num_stages(cfg, args.num_hidden_layers), cfg.pipeline_parallel_first_stage_less_layers,
            cfg.pipeline_parallel_last_stage_less_layers,
        )
    check_split(stages, args.num_hidden_layers)
    return stages


def check_pipeline(cfg: Parallelism, args: ModelArgs, local_batch_size: int) -> None:
    """Every pipeline rule, before any process group exists."""
    if cfg.pipeline_parallel_degree == 1:
        return
    if args.tie_word_embeddings:
        raise ConfigError(
            "model.tie_word_embeddings=true with pipeline_parallel_degree="
            f"{cfg.pipeline_parallel_degree}: the embedding and the head would live on different "
            "stages; use --model.tie_word_embeddings false or no pipeline parallelism"
        )
    mbs = cfg.pipeline_parallel_microbatch_size
    if mbs < 1 or local_batch_size % mbs:
        raise ConfigError(
            f"parallelism.pipeline_parallel_microbatch_size={mbs} does not divide "
            f"training.local_batch_size={local_batch_size}; use a divisor of it"
        )
    check_schedule(cfg, len(stage_modules(cfg, args)), local_batch_size // mbs)


class PipelineLoss:
    """The last stage's loss: token-summed cross-entropy over the step's global target count."""

    def __init__(self, context: TrainContext) -> None:
        self.context = context
        self.global_targets = torch.ones(())

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        loss = self.context.loss_fn(logits, labels) / self.global_targets
        return loss.full_tensor() if isinstance(loss, DTensor) else loss


@dataclass
class Pipeline:
    schedule: object
    stage_ids: list[int]
    num_stages: int
    loss: PipelineLoss

    @property
    def has_first(self) -> bool:
        return 0 in self.stage_ids

    @property
    def has_last(self) -> bool:
        return self.num_stages - 1 in self.stage_ids


def build_pipeline(
    parts: list[nn.Module],
    stage_ids: list[int],
    total_stages: int,
    pp_mesh: DeviceMesh,
    cfg: Parallelism,
    local_batch_size: int,
    device: torch.device,
    context: TrainContext,
) -> Pipeline:
    stages = [
        PipelineStage(part, sid, total_stages, device, group=pp_mesh.get_group())
        for part, sid in zip(parts, stage_ids)
    ]
    loss = PipelineLoss(context)
    cls = get_schedule_class(schedule_name(cfg))
    n_micro = local_batch_size // cfg.pipeline_parallel_microbatch_size
    if issubclass(cls, PipelineScheduleSingle):
        schedule = cls(stages[0], n_microbatches=n_micro, loss_fn=loss, scale_grads=False)
    else:
        schedule = cls(stages, n_microbatches=n_micro, loss_fn=loss, scale_grads=False)
    return Pipeline(schedule, stage_ids, total_stages, loss)


def pipeline_forward_backward(
    pipeline: Pipeline, batches: list[Batch], global_targets: torch.Tensor, context: TrainContext
) -> torch.Tensor:
    """Run every micro-step through the schedule; this rank's share of the step loss (the
    last stage's losses, zero elsewhere)."""
    pipeline.loss.global_targets = global_targets
    total = torch.zeros((), device=global_targets.device)
    for full_batch in batches:
        losses: list[torch.Tensor] = []
        with context.sequence(full_batch) as (batch, positions), context.loss(), context.forward():
            args = (batch.inputs,) if pipeline.has_first else ()
            target = batch.labels if pipeline.has_last else None
            kwargs = {} if positions is None else {"positions": positions}
            pipeline.schedule.step(*args, target=target, losses=losses, **kwargs)
        if losses:
            total += torch.stack([l.detach() for l in losses]).sum()
    return total

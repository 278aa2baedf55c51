"""Pipeline schedules from ``torch.distributed.pipelining``, driven with the trainer's loss.

The last stage calls the run's loss (``stage_loss.LossSlot``), already each micro-batch's
share of the step loss, and ``scale_grads=False`` stops the schedule from dividing by the
number of micro-batches, so pipelining, accumulation and data parallelism all agree.

The loss and the per-micro-batch context (context parallel, FP8 autocast, loss parallel)
come in as plain callables: this floor does not know the training step.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import NamedTuple

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

from autopar.config.errors import ConfigError
from autopar.config.sections import Parallelism
from autopar.data.loader import Batch
from autopar.models.args import ModelArgs
from autopar.parallel.pipelining.split import StageStyle, check_split, even_split, even_split_count, stage_ids
from autopar.parallel.pipelining.stage_loss import LossFn, LossSlot, flat_head_output
from autopar.parallel.torch_internals import keep_donated_buffers

MicroBatchContext = Callable[[Batch], contextlib.AbstractContextManager[tuple[Batch, "torch.Tensor | None"]]]
"""Full micro-batch -> context giving (this rank's part of it, its RoPE positions or None)."""


StageIO = dict[str, "torch.Tensor | None"]
"""PipelineStage's static metadata: input_args, output_args, input_grads, output_grads."""


class ScheduleStyle(NamedTuple):
    placement: StageStyle
    """How stages map to ranks: ``loop`` (stage s on rank s mod pp) or ``v`` (down and back)."""
    stages_per_rank: int | None
    """Stages each rank runs; None: any number (2 by default)."""
    splits_backward: bool = False
    """Zero-bubble: each backward runs as two autograd passes, input gradients (keeping the
    graph) and later weight gradients, so a checkpointed block recomputes twice and a
    compiled backward must not donate its buffers to the first pass."""


SCHEDULE_STYLES: dict[str, ScheduleStyle] = {
    "GPipe": ScheduleStyle("loop", 1),
    "1F1B": ScheduleStyle("loop", 1),
    "Interleaved1F1B": ScheduleStyle("loop", None),
    "LoopedBFS": ScheduleStyle("loop", None),
    "InterleavedZeroBubble": ScheduleStyle("loop", None, splits_backward=True),
    "ZBVZeroBubble": ScheduleStyle("v", 2, splits_backward=True),
    "DualPipeV": ScheduleStyle("v", 2, splits_backward=True),
}


def schedule_name(cfg: Parallelism) -> str:
    """The canonical spelling of ``pipeline_parallel_schedule`` (case-insensitive)."""
    return _canonical_schedule(cfg.pipeline_parallel_schedule)


@functools.lru_cache(maxsize=64)
def _canonical_schedule(spelling: str) -> str:
    """``schedule_name`` of one spelling, checked against this torch once (the planner asks
    for every plan it prices)."""
    names = {n.lower(): n for n in SCHEDULE_STYLES}
    name = names.get(spelling.lower())
    if name is None:
        raise ConfigError(
            f"parallelism.pipeline_parallel_schedule={spelling!r} is "
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
        units = (
            num_layers
            + cfg.pipeline_parallel_first_stage_less_layers
            + cfg.pipeline_parallel_last_stage_less_layers
        )
        return -(-units // cfg.pipeline_parallel_layers_per_stage)
    per_rank = SCHEDULE_STYLES[schedule_name(cfg)].stages_per_rank or 2
    return cfg.pipeline_parallel_degree * per_rank


def check_schedule(cfg: Parallelism, stages: int, microbatches: int) -> None:
    """The rules torch's schedules enforce at run time, checked before anything starts."""
    name = schedule_name(cfg)
    pp = cfg.pipeline_parallel_degree
    per_rank = SCHEDULE_STYLES[name].stages_per_rank
    if stages % pp:
        raise ConfigError(
            f"{stages} pipeline stages do not divide over pipeline_parallel_degree={pp}; use a multiple of {pp}"
        )
    if per_rank is not None and stages != pp * per_rank:
        raise ConfigError(
            f"parallelism.pipeline_parallel_schedule={name!r} runs exactly {per_rank} stage(s) per "
            f"rank, but the split gives {stages} stages for {pp} ranks; use {pp * per_rank} stages"
        )
    mbs = cfg.pipeline_parallel_microbatch_size
    if name in ("1F1B", "DualPipeV") and microbatches < stages:
        raise ConfigError(
            f"{name} needs at least as many micro-batches as stages: local_batch_size / "
            f"pipeline_parallel_microbatch_size = {microbatches} < {stages}; use a "
            f"training.local_batch_size of at least {stages * mbs} (or a smaller microbatch size)"
        )
    if name == "Interleaved1F1B" and not interleaved_rounds_fit(microbatches, pp):
        rounds = microbatches // pp
        fits = _nearest(microbatches, lambda m: interleaved_rounds_fit(m, pp))
        raise ConfigError(
            f"Interleaved1F1B runs local_batch_size / pipeline_parallel_microbatch_size = {microbatches} "
            f"micro-batches as {rounds} equal rounds (of pipeline_parallel_degree={pp} or more), and "
            f"{rounds} does not divide {microbatches}; use training.local_batch_size "
            + " or ".join(f"{m * mbs} ({m} micro-batches)" for m in fits)
        )


def check_forward_only_schedule(cfg: Parallelism, wanted_by: str) -> None:
    """A forward-only pass (``schedule.eval``: held-out loss, a DPO reference) runs the
    schedule's own action order with backward switched off; torch's V-shaped schedules keep
    their backward actions in it and fail at the first one (torch 2.11-2.13, seen here)."""
    name = schedule_name(cfg)
    if SCHEDULE_STYLES[name].placement == "v":
        loop = [n for n, style in SCHEDULE_STYLES.items() if style.placement == "loop"]
        raise ConfigError(
            f"{wanted_by} under parallelism.pipeline_parallel_schedule={name!r}: it needs a forward-only "
            f"pass, which torch's V-shaped schedules do not run; use one of {loop}"
        )


def interleaved_rounds_fit(microbatches: int, pp: int) -> bool:
    """torch's Interleaved1F1B rule: ``max(1, microbatches // pp)`` rounds of equal size."""
    return microbatches % max(1, microbatches // pp) == 0


def _nearest(n: int, fits: Callable[[int], bool]) -> list[int]:
    """The nearest counts below and above ``n`` (> 1) that ``fits`` accepts, which must
    accept 1 and some count above ``n``."""
    below = next(m for m in range(n - 1, 0, -1) if fits(m))
    above = next(m for m in itertools.count(n + 1) if fits(m))
    return [below, above]


def stage_modules(cfg: Parallelism, args: ModelArgs) -> list[list[str]]:
    """Module names of every stage, explicit or evenly balanced, checked."""
    if cfg.module_fqns_per_model_part:
        check_split(cfg.module_fqns_per_model_part, args.num_hidden_layers)
        return cfg.module_fqns_per_model_part
    return even_split(  # valid by construction
        args.num_hidden_layers,
        num_stages(cfg, args.num_hidden_layers),
        cfg.pipeline_parallel_first_stage_less_layers,
        cfg.pipeline_parallel_last_stage_less_layers,
    )


Action = tuple[str, int, int]
"""(kind, stage, micro-batch): ``F`` forward, ``B`` full backward, ``I`` input gradient, ``W``
weight gradient (zero-bubble schedules split ``B`` into ``I`` then ``W``)."""


def _stand_in_stages(name: str, pp: int, total_stages: int, pp_rank: int) -> list[SimpleNamespace]:
    """What torch's schedule classes read of the stages of rank ``pp_rank`` (no modules):
    enough to build a schedule and read its action order."""
    placement = SCHEDULE_STYLES[name].placement
    return [
        SimpleNamespace(
            stage_index=sid,
            num_stages=total_stages,
            group_size=pp,
            group_rank=pp_rank,
            is_first=sid == 0,
            is_last=sid == total_stages - 1,
            submod=None,
        )
        for sid in stage_ids(pp_rank, pp, total_stages, placement)
    ]


def rank_actions(name: str, pp: int, total_stages: int, n_micro: int, pp_rank: int) -> tuple[Action, ...]:
    """The compute actions pipeline rank ``pp_rank`` runs in one schedule step, in order
    (``schedule_actions``)."""
    return schedule_actions(name, pp, total_stages, n_micro)[pp_rank]


@functools.lru_cache(maxsize=1024)
def schedule_actions(name: str, pp: int, total_stages: int, n_micro: int) -> tuple[tuple[Action, ...], ...]:
    """Every pipeline rank's compute actions in one schedule step, in order.

    Read off torch's schedule class itself, built once over one rank's stand-in stages (a
    schedule orders every rank's actions from the stage layout alone), so whoever models a
    step's timeline (the planner's memory and time) follows torch's order rather than a copy
    of it. The one-stage schedules run loops of their own instead (``_single_stage_actions``)."""
    cls = get_schedule_class(name)
    if issubclass(cls, PipelineScheduleSingle):
        return tuple(_single_stage_actions(name, pp, n_micro, rank) for rank in range(pp))
    order = cls(_stand_in_stages(name, pp, total_stages, 0), n_microbatches=n_micro).pipeline_order
    ranks = []
    for rank in range(pp):
        actions: list[Action] = []
        for action in order[rank]:
            if action is None:
                continue
            for step in action.sub_actions or (action,):
                kind = step.computation_type.value
                if kind in ("F", "B", "I", "W"):
                    actions.append((kind, step.stage_index, step.microbatch_index))
        ranks.append(tuple(actions))
    return tuple(ranks)


def _single_stage_actions(name: str, pp: int, n_micro: int, rank: int) -> tuple[Action, ...]:
    """The order torch's one-stage schedules run (their ``_step_microbatches``; the
    ``pipeline_order`` torch 2.13 lists for 1F1B's last rank is a micro-batch off, F1 B0 ...):
    GPipe every forward, then every backward; 1F1B min(micro-batches, pp - rank) forwards,
    then a backward and a forward in turn, then the backwards left."""
    forwards = [("F", rank, m) for m in range(n_micro)]
    backwards = [("B", rank, m) for m in range(n_micro)]
    if name == "GPipe":
        return tuple(forwards + backwards)
    warmup = min(n_micro, pp - rank)
    order = forwards[:warmup]
    for m in range(n_micro - warmup):
        order += [backwards[m], forwards[warmup + m]]
    return tuple(order + backwards[n_micro - warmup :])


@functools.lru_cache(maxsize=4096)
def rank_stage_gathers(name: str, pp: int, total_stages: int, n_micro: int, pp_rank: int) -> int:
    """How many times one schedule step gathers an FSDP-sharded stage of rank ``pp_rank``
    whole (weights kept gathered across micro-batches, as a pipeline's FSDP policy does).

    A one-stage schedule gathers its stage once. The multi-stage ones keep at most a few
    stages gathered and gather a stage again after evicting it (more than three stages per
    rank); read off torch's own lowering of the schedule (its ``UNSHARD`` actions), over
    stand-in stages as ``rank_actions`` does."""
    cls = get_schedule_class(name)
    if issubclass(cls, PipelineScheduleSingle):
        return 1
    stages = _stand_in_stages(name, pp, total_stages, pp_rank)
    lowered = cls(stages, n_microbatches=n_micro).pipeline_order_with_comms[pp_rank]
    return sum(a.computation_type.value == "UNSHARD" for a in lowered if a is not None)


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
    check_schedule(cfg, _stage_count(cfg, args), local_batch_size // mbs)


def _stage_count(cfg: Parallelism, args: ModelArgs) -> int:
    """``len(stage_modules(cfg, args))``, checked alike, without building the split."""
    if cfg.module_fqns_per_model_part:
        return len(stage_modules(cfg, args))
    return even_split_count(
        args.num_hidden_layers,
        num_stages(cfg, args.num_hidden_layers),
        cfg.pipeline_parallel_first_stage_less_layers,
        cfg.pipeline_parallel_last_stage_less_layers,
    )


@dataclass
class Pipeline:
    schedule: object
    parts: list[nn.Module]
    stage_ids: list[int]
    num_stages: int
    loss: LossSlot
    n_micro: int
    splits_backward: bool = False

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
    stage_io: list[StageIO] | None = None,
) -> Pipeline:
    """The schedule that runs this rank's ``parts`` (stages ``stage_ids``); each run sets its
    loss (``Pipeline.loss``).
    ``stage_io``: example tensors per part, for process groups that cannot exchange shapes at
    the first step (the dry run's fake group); by default torch infers them."""
    examples = stage_io or [{}] * len(parts)
    stages = [
        PipelineStage(part, sid, total_stages, device, group=pp_mesh.get_group(), **io)
        for part, sid, io in zip(parts, stage_ids, examples, strict=True)
    ]
    cls = get_schedule_class(schedule_name(cfg))
    n_micro = local_batch_size // cfg.pipeline_parallel_microbatch_size
    loss = LossSlot()
    if issubclass(cls, PipelineScheduleSingle):
        schedule = cls(stages[0], n_microbatches=n_micro, loss_fn=loss, scale_grads=False)
    else:
        schedule = cls(stages, n_microbatches=n_micro, loss_fn=loss, scale_grads=False)
    splits = SCHEDULE_STYLES[schedule_name(cfg)].splits_backward
    return Pipeline(schedule, parts, stage_ids, total_stages, loss, n_micro, splits)


def return_head_output(pipeline: Pipeline) -> None:
    """Make the last stage hand the schedule a second head's output beside the model's, as
    one flat tuple (``flat_head_output``): before the first run."""
    for part, sid in zip(pipeline.parts, pipeline.stage_ids, strict=True):
        if sid == pipeline.num_stages - 1:
            part.register_forward_hook(flat_head_output)


def _compiled_backward_context(pipeline: Pipeline) -> contextlib.AbstractContextManager:
    """Where compiled blocks are built (lazily, in the first step) for a schedule that splits
    backward: AOT autograd must keep the buffers it would donate to the backward, which the
    input-gradient pass runs with ``retain_graph`` for the weight pass after it."""
    if not pipeline.splits_backward:
        return contextlib.nullcontext()
    return keep_donated_buffers()


def pipeline_run(
    pipeline: Pipeline,
    batches: list[Batch],
    loss: LossFn,
    micro_batch_context: MicroBatchContext,
    flags: dict[str, object],
    backward: bool = True,
) -> int:
    """Run every micro-step through the schedule with ``loss`` on the last stage (forward
    only without ``backward``: a held-out loss, a reference pass) and the forward's keyword
    ``flags``; returns how many of the loss's last calls are the micro-batches' own (torch
    may first call it to infer gradient shapes): none on a rank without the last stage."""
    pipeline.loss.fn = loss
    run = pipeline.schedule.step if backward else pipeline.schedule.eval
    for full_batch in batches:
        with micro_batch_context(full_batch) as (batch, positions):
            args = (batch.inputs,) if pipeline.has_first else ()
            target = batch.labels if pipeline.has_last else None
            extra = {"positions": positions, "documents": batch.documents}
            kwargs = {name: value for name, value in extra.items() if value is not None} | flags
            # return_outputs=False: the last stage keeps no logits of finished micro-batches
            with _compiled_backward_context(pipeline):
                run(*args, target=target, losses=[], return_outputs=False, **kwargs)
    return pipeline.n_micro * len(batches) if pipeline.has_last else 0

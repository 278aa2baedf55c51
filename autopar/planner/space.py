"""The candidates a search scores: every plan of a job on a cluster that its pins leave free.

A plan is a ``PlanSettings``: the five parallel degrees (and the expert-parallel one of a
mixture of experts), the pipeline schedule and micro-batch size, the activation checkpointing
mode, the local batch and FSDP's reshard policy. Settings the job pins are held; the rest are
enumerated, tensor parallelism within a node. Whether a candidate can run at all is left to
``training.preflight.check_plan``.

The global batch is held when the job sets ``training.global_batch_size`` (the local batch and
gradient accumulation fill it); otherwise the local batch is free and the global batch is
local x data-parallel degree, as in the trainer.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass

from autopar.config.sections import JobConfig
from autopar.models.args import ModelArgs
from autopar.parallel.pipelining.schedule import SCHEDULE_STYLES
from autopar.planner.settings import PlanSettings, setting_names

SCHEDULES = ("1F1B", "Interleaved1F1B", "ZBVZeroBubble")


AC_MODES = (("none", "op"), ("selective", "op"), ("selective", "2"), ("full", "op"))


REGATHER = ("selective", "op_regather")
"""Per-op checkpointing that gathers sequence parallelism's inputs again in backward instead of
keeping them: also tried wherever a plan has sequence parallelism (TP > 1 with SP on)."""


LOCAL_BATCHES = (1, 2, 4, 8, 16)


MICRO_BATCHES = (1, 2)


STAGES_PER_RANK = (4, 8)
"""Stages per rank an interleaved schedule is also searched with, beyond its default 2."""


def _divisors(n: int) -> list[int]:
    """``n``'s divisors, ascending, found by trial up to its square root (a search asks for
    those of 16,384 tens of thousands of times)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


@dataclass(frozen=True)
class _Space:
    """What the search may vary: the job's own plan, and which of its settings are pinned."""

    own: PlanSettings
    pins: set[str]  # PlanSettings field names
    first_less: int = 1  # the job's pipeline_parallel_first_stage_less_layers
    last_less: int = 1  # and last_stage_less_layers
    sequence_parallel: bool = True  # the job's enable_sequence_parallel

    def options(self, name: str, values: list) -> list:
        """``values``, or the job's own value of a pinned setting."""
        return [getattr(self.own, name)] if name in self.pins else list(values)


def candidates(
    job: JobConfig, args: ModelArgs, world_size: int, gpus_per_node: int, pinned: set[str]
) -> Iterator[PlanSettings]:
    """Settings of every plan to try (validity not yet checked); the settings whose
    ``section.field`` is in ``pinned`` keep the job's value."""
    cfg = job.parallelism
    space = _Space(
        PlanSettings.of(job),
        setting_names(pinned),
        cfg.pipeline_parallel_first_stage_less_layers,
        cfg.pipeline_parallel_last_stage_less_layers,
        cfg.enable_sequence_parallel,
    )
    global_batch = job.training.global_batch_size
    for tp in space.options("tp", [d for d in _divisors(world_size) if d <= gpus_per_node]):
        rest = world_size // tp if world_size % tp == 0 else 0
        for cp in space.options("cp", _context_degrees(args, rest)):
            rest_cp = rest // cp if rest % cp == 0 else 0
            pps = [d for d in _divisors(rest_cp) if d <= args.num_hidden_layers] if rest_cp else []
            for pp in space.options("pp", pps):
                if not rest_cp or rest_cp % pp:
                    continue
                yield from _data_parallel(space, args, rest_cp // pp, tp, cp, pp, gpus_per_node, global_batch)


def _context_degrees(args: ModelArgs, rest: int) -> list[int]:
    """Context-parallel degrees dividing the ranks TP leaves (up to 16)."""
    if not rest:
        return []
    return [d for d in _divisors(rest) if d <= 16]


def _data_parallel(
    space: _Space, args: ModelArgs, dp: int, tp: int, cp: int, pp: int, gpus_per_node: int, global_batch: int
) -> Iterator[PlanSettings]:
    """Every plan of these model-parallel degrees: its data-parallel split, local batch,
    schedule, checkpointing, resharding and expert degree."""
    replicates = _replicate_degrees(space, dp, tp * cp, gpus_per_node)
    locals_ = _local_batches(space, dp, global_batch)
    reshards = space.options("reshard", reshard_options(pp))
    pipelines = _pipeline_choices(space, args, pp)
    for replicate, local, (schedule, micro, per_stage), (mode, option), reshard in itertools.product(
        sorted(replicates), locals_, pipelines, _ac_choices(space, tp), reshards
    ):
        if pp > 1 and local % micro:
            continue
        if pp > 1 and checkpointing_saves_nothing(schedule, mode, space.pins):
            continue
        for ep in _expert_degrees(space, args, dp // replicate * cp):
            yield PlanSettings(
                dp_replicate=replicate,
                dp_shard=dp // replicate,
                cp=cp,
                tp=tp,
                pp=pp,
                ep=ep,
                schedule=schedule,
                microbatch=micro,
                layers_per_stage=per_stage,
                reshard=reshard,
                ac_mode=mode,
                ac_option=option,
                local_batch=local,
            )


def _replicate_degrees(space: _Space, dp: int, model_parallel: int, gpus_per_node: int) -> set[int]:
    """FSDP over every data-parallel rank (1), or HSDP with each shard group filling a node."""
    replicates = {1}
    in_node = gpus_per_node // model_parallel if gpus_per_node % model_parallel == 0 else 0
    if in_node and dp % in_node == 0 and dp // in_node > 1:
        replicates.add(dp // in_node)
    replicates = set(space.options("dp_replicate", replicates))
    if "dp_shard" in space.pins and space.own.dp_shard != -1:
        replicates = {r for r in replicates if r * space.own.dp_shard == dp}
    return replicates


def _local_batches(space: _Space, dp: int, global_batch: int) -> list[int]:
    """Local batches that make the global batch (up to 64), or ``LOCAL_BATCHES`` when it is free."""
    if global_batch <= 0:
        return space.options("local_batch", LOCAL_BATCHES)
    fill = [b for b in _divisors(global_batch // dp) if b <= 64] if global_batch % dp == 0 else []
    return space.options("local_batch", fill)


def _pipeline_choices(space: _Space, args: ModelArgs, pp: int) -> list[tuple[str, int, int | None]]:
    """(schedule, micro-batch size, layers per stage): every searched one under pipelining,
    else the job's. A schedule that runs any number of stages per rank is also tried with
    ``STAGES_PER_RANK`` of them (a smaller bubble for more sends and in-flight activations)."""
    own = (space.own.schedule, space.own.microbatch, space.own.layers_per_stage)
    if pp == 1:
        return [own]
    choices = []
    for schedule, micro in itertools.product(
        space.options("schedule", SCHEDULES), space.options("microbatch", MICRO_BATCHES)
    ):
        splits: list[int | None] = [None]
        if SCHEDULE_STYLES[schedule].stages_per_rank is None:
            splits += _layers_per_stage(space, args, pp)
        for per_stage in space.options("layers_per_stage", splits):
            choices.append((schedule, micro, per_stage))
    return choices


def _layers_per_stage(space: _Space, args: ModelArgs, pp: int) -> list[int]:
    """Layers per stage that give ``pp`` ranks each ``STAGES_PER_RANK`` stages exactly, the
    embedding and head counted as the job's first- and last-stage layers."""
    units = args.num_hidden_layers + space.first_less + space.last_less
    found = []
    for per_rank in STAGES_PER_RANK:
        per_stage = -(-units // (pp * per_rank))
        if per_stage >= 1 and -(-units // per_stage) == pp * per_rank:
            found.append(per_stage)
    return found


def _ac_choices(space: _Space, tp: int) -> list[tuple[str, str]]:
    """(mode, selective option) pairs of ``AC_MODES`` (and ``REGATHER`` under sequence
    parallelism) the pins allow, or the pinned pair."""
    own, pins = space.own, space.pins
    modes = AC_MODES + ((REGATHER,) if tp > 1 and space.sequence_parallel else ())
    acs = [
        (mode, option)
        for mode, option in modes
        if own.ac_mode == mode or "ac_mode" not in pins
        if mode != "selective" or "ac_option" not in pins or own.ac_option == option
    ]
    if "ac_mode" in pins and not acs:  # a pinned every-k other than 2
        acs = [(own.ac_mode, own.ac_option)]
    return acs


def reshard_options(pp: int) -> list[str]:
    """FSDP resharding after forward: searched both ways without pipelining; a pipeline keeps
    its stages' weights gathered across micro-batches anyway."""
    return ["default", "never"] if pp == 1 else ["default"]


def checkpointing_saves_nothing(schedule: str, mode: str, pins: set[str]) -> bool:
    """Zero-bubble schedules with activation checkpointing, unless the job pins both (``pins``:
    the pinned ``PlanSettings`` fields): they train (and equal one device), but torch's split
    backward keeps every weight's output gradient from the input pass to the weight pass, which
    recomputes the blocks again, so checkpointing buys no memory and costs two recomputes (dry
    run, Qwen3-8B ZBV stage of one layer: 12.0 GiB with full AC, 9.3 GiB without)."""
    styles = {name.lower(): style for name, style in SCHEDULE_STYLES.items()}
    style = styles.get(schedule.lower())
    both_pinned = {"schedule", "ac_mode"} <= pins
    return style is not None and style.splits_backward and mode != "none" and not both_pinned


def _expert_degrees(space: _Space, args: ModelArgs, borrowable: int) -> list[int | None]:
    """Expert-parallel degrees to try: those dividing both the experts and the data x context
    ranks EP borrows from; for a dense model none (the setting stays out of its plans)."""
    if not args.moe:
        return [None]
    return space.options("ep", [d for d in _divisors(borrowable) if args.num_experts % d == 0])

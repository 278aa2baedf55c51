"""A pipeline's share of a step: its stage-to-stage sends and its bubble, the busiest rank's
idle time, played out in torch's own order of actions (``planner/pipeline_sim.py``) or, where
that order cannot finish, the schedule's closed-form idle fraction of the work.
"""

from __future__ import annotations

from autopar.config.sections import JobConfig
from autopar.models.args import ModelArgs
from autopar.parallel.pipelining.schedule import (
    SCHEDULE_STYLES,
    num_stages,
    rank_actions,
    schedule_name,
    stage_modules,
)
from autopar.parallel.pipelining.split import stage_ids
from autopar.planner.comm_time import link
from autopar.planner.pipeline_sim import play
from autopar.planner.step import Step
from autopar.planner.weight_bytes import micro_steps

ZERO_BUBBLE = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")


def bubble_fraction(schedule: str, pp: int, n_micro: int, stages_per_rank: int) -> float:
    """Idle time of a rank relative to its busy time: (pp - 1) warm-up/cool-down slots over
    the micro-batches, each slot a 1/v stage for interleaved and V schedules; zero-bubble
    schedules fill two thirds of each slot with deferred weight gradients."""
    loops = 1 if schedule in ("GPipe", "1F1B") else stages_per_rank
    fraction = (pp - 1) / (n_micro * loops)
    return fraction / 3 if schedule in ZERO_BUBBLE else fraction


def _activation_bytes(step: Step) -> float:
    """A stage's output as it sends it: under sequence parallelism each TP rank its shard."""
    return step.z.dtype_bytes * step.z.hidden * step.z.tokens / step.z.sp_shards


def _hop_seconds(step: Step) -> float:
    """One stage's output (or its gradient) sent to the next pipeline rank."""
    activation = _activation_bytes(step)
    return activation / link(step, "pp", "send_recv", 2, activation)


def pipeline_send_seconds(step: Step) -> float:
    """Seconds of a rank's stage-to-stage sends per step: each stage's output forward and its
    gradient back, per micro-batch."""
    stages_per_rank = num_stages(step.job.parallelism, step.args.num_hidden_layers) // step.dims.pp
    return 2 * step.micro_batches * stages_per_rank * _hop_seconds(step)


def pipeline_bubble(step: Step, n_micro: int, busy: float, work: list[float]) -> tuple[float, bool]:
    """(the busiest rank's idle seconds per step beyond its ``busy`` work, whether the step
    was played out): ``_played_step``, else (an order that cannot finish) the closed form
    ``bubble_fraction``."""
    args, job, dims = step.args, step.job, step.dims
    hop = _hop_seconds(step)
    accumulation = micro_steps(job, dims)
    played = _played_step(args, job, dims.pp, n_micro, busy / accumulation, work, hop)
    if played is not None:
        return max(0.0, played * accumulation - busy), True
    stages_per_rank = num_stages(job.parallelism, args.num_hidden_layers) // dims.pp
    return busy * bubble_fraction(schedule_name(job.parallelism), dims.pp, n_micro, stages_per_rank), False


def _played_step(
    args: ModelArgs,
    job: JobConfig,
    pp: int,
    n_micro: int,
    busy: float,
    work: list[float],
    hop: float,
) -> float | None:
    """Seconds of one schedule step played out (``planner.pipeline_sim``): each stage's
    actions sized by their ``work`` (``stage_work``) so that the busiest rank's add up to
    ``busy`` (its compute, recompute, elementwise work and dispatch over the step's micro-batches), a
    backward twice its forward, a zero-bubble input or weight gradient half a backward.
    None where the order cannot finish (the closed form stands in)."""
    name = schedule_name(job.parallelism)
    stages = stage_modules(job.parallelism, args)
    style = SCHEDULE_STYLES[name].placement
    owned = {r: stage_ids(r, pp, len(stages), style) for r in range(pp)}
    busiest = max(sum(work[s] for s in ids) for ids in owned.values())
    scale = busy / (busiest * n_micro) if busiest else 0.0
    seconds = {}
    for s, w in enumerate(work):
        fwd = scale * w / 3
        seconds |= {("F", s): fwd, ("B", s): 2 * fwd, ("I", s): fwd, ("W", s): fwd}
    orders = [rank_actions(name, pp, len(stages), n_micro, r) for r in range(pp)]
    stage_rank = {s: r for r, ids in owned.items() for s in ids}
    finish = play(orders, seconds, stage_rank, hop)
    return max(finish) if finish is not None else None

"""The search by bounds: the same best plans as scoring every candidate, scoring few of them.

Every candidate that passes the trainer's checks gets a bound: the most tokens/s it could
reach, from its busiest rank's own work alone (``time.step_seconds_lower_bound``: compute,
recompute, elementwise work, dispatch and AdamW, without the exposed communication, the
bubble and a host optimizer, each zero or more). Candidates are then scored (memory walk,
communication, the pipeline played out) best bound first, and the walk stops at the first
whose bound is below both the ``keep``-th best tokens/s scored so far (``keep`` plans already
rank above it) and the best's tie band (``search.TIE``: the simpler-plan tie break among the
best cannot reach it). No candidate after it can enter the first ``keep`` either.

Ranked in the exhaustive order, the scored plans are then a subsequence of every plan ranked:
the best plan is always scored, so the tie band is the same, and the rest keep their order.
Their first ``keep`` are the exhaustive search's, predicted by the same functions. Where fewer
than ``keep`` plans fit, nothing is pruned.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence

from autopar.config.sections import JobConfig
from autopar.models.args import ModelArgs
from autopar.parallel.mesh import ParallelDims
from autopar.planner.devices import DeviceSpec
from autopar.planner.time import busy_time, step_seconds_lower_bound, tokens_per_step

ROUNDING = 1e-9
"""How far above its bound a plan's tokens/s may come by floating-point rounding alone (the
bound and the plan's total add the same parts in another order): a margin, never a pruning."""


def tokens_per_s_bound(
    args: ModelArgs, job: JobConfig, dims: ParallelDims, device: DeviceSpec, gpus_per_node: int
) -> float:
    """The most tokens/s per device the plan can be predicted at (``predict_time``'s total is
    at least its ``step_seconds_lower_bound``)."""
    seconds = step_seconds_lower_bound(busy_time(args, job, dims, device, gpus_per_node))
    return tokens_per_step(job, dims) / seconds / dims.world_size * (1 + ROUNDING)


def best_first(bounds: Sequence[float], score: Callable[[int], float], keep: int, tie: float) -> list[int]:
    """The candidates scored (indices into ``bounds``, in order): best bound first, each by
    ``score(i)``, its tokens/s (0 where it does not fit), until no candidate left can rank
    among the first ``keep``."""
    kept: list[float] = []  # the keep best tokens/s so far (a min-heap; a plan that does not fit: 0)
    best = 0.0
    scored = []
    for i in sorted(range(len(bounds)), key=lambda i: -bounds[i]):
        if len(kept) == keep and bounds[i] < min(kept[0], best * (1 - tie)):
            break  # every candidate left is bounded lower still
        tokens_per_s = score(i)
        scored.append(i)
        best = max(best, tokens_per_s)
        (heapq.heappush if len(kept) < keep else heapq.heappushpop)(kept, tokens_per_s)
    return sorted(scored)

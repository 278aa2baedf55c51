"""The search by bounds: the same best plans as scoring every candidate, scoring few of them.

Every candidate that passes the trainer's checks has a bound: the most tokens/s it could
reach, from its busiest rank's own work alone (``time.step_seconds_lower_bound``: compute,
recompute, elementwise work, dispatch and AdamW, without the exposed communication, the
bubble and a host optimizer, each zero or more). Candidates are then scored (memory walk,
communication, the pipeline played out) best bound first, and the walk stops at the first
whose bound is below both the ``keep``-th best tokens/s scored so far (``keep`` plans already
rank above it) and the best's tie band (``search.TIE``: the simpler-plan tie break among the
best cannot reach it). No candidate after it can enter the first ``keep`` either.

Candidates that differ only in activation checkpointing and FSDP's resharding share one
bound first: that of their plan without checkpointing that never reshards (``search.lightest``).
Checkpointing only adds to a step's terms (recompute, and the collectives that rerun with it:
TP's, CP's, EP's), resharding only adds gathers and so casts of the gathered weights, and
neither changes another term; each term is added in the same order, so that bound is at
least each member's, floating-point rounding included. A group's members get their own
bounds only when the group's comes first; most groups never do.

Ranked in the exhaustive order, the scored plans are then a subsequence of every plan ranked:
the best plan is always scored, so the tie band is the same, and the rest keep their order.
Their first ``keep`` are the exhaustive search's, predicted by the same functions. Where fewer
than ``keep`` plans fit, nothing is pruned.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence

from autopar.planner.time import Busy, step_seconds_lower_bound, tokens_per_step

ROUNDING = 1e-9
"""How far above its bound a plan's tokens/s may come by floating-point rounding alone (the
bound and the plan's total add the same parts in another order): a margin, never a pruning."""


def tokens_per_s_bound(busy: Busy) -> float:
    """The most tokens/s per device the plan ``busy`` is of can be predicted at
    (``predict_time``'s total is at least its ``step_seconds_lower_bound``)."""
    job, dims = busy.step.job, busy.step.dims
    return tokens_per_step(job, dims) / step_seconds_lower_bound(busy) / dims.world_size * (1 + ROUNDING)


def best_first(
    groups: Sequence[tuple[float, Sequence[int]]],
    bound: Callable[[int], float],
    score: Callable[[int], float],
    keep: int,
    tie: float,
) -> list[int]:
    """The candidates scored (their indices, in order): best bound first, each by
    ``score(i)``, its tokens/s (0 where it does not fit), until no candidate left can rank
    among the first ``keep``. ``groups`` are (a bound at least each member's, the members):
    a group's members get their own ``bound`` only once the group's comes first."""
    kept: list[float] = []  # the keep best tokens/s so far (a min-heap; a plan that does not fit: 0)
    best = 0.0
    scored = []
    # (-bound, order, members of a group | a candidate's index); the order breaks ties
    heap: list[tuple[float, int, Sequence[int] | int]] = [
        (-group_bound, n, members) for n, (group_bound, members) in enumerate(groups)
    ]
    heapq.heapify(heap)
    order = len(heap)
    while heap:
        negative, _, item = heapq.heappop(heap)
        if len(kept) == keep and -negative < min(kept[0], best * (1 - tie)):
            break  # every candidate left is bounded lower still
        if not isinstance(item, int):
            for i in item:
                own = bound(i)
                assert own <= -negative, f"candidate {i}'s bound {own} is above its group's {-negative}"
                heapq.heappush(heap, (-own, order, i))
                order += 1
            continue
        tokens_per_s = score(item)
        scored.append(item)
        best = max(best, tokens_per_s)
        (heapq.heappush if len(kept) < keep else heapq.heappushpop)(kept, tokens_per_s)
    return sorted(scored)

"""A pipeline schedule step, played out: each rank runs torch's own order of its actions
(``parallel.pipelining.schedule.rank_actions``), each action waiting for the one it needs
from the neighbouring stage plus one hop when that stage is on another rank. The step ends
when the last rank finishes; what a rank spends beyond its own work is its bubble.

A closed form ((pp - 1) / (v * micro-batches) of the work) holds for a well-packed schedule
with free hops; played out, an interleaved schedule whose actions each wait on the other
rank's last one pays every hop, and stages of unequal work stall their neighbours.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

Action = tuple[str, int, int]  # (kind F/B/I/W, stage, micro-batch)


def _needs(action: Action, last_stage: int, split: bool) -> Action | None:
    """The action ``action`` waits for: a forward for the previous stage's forward, a backward
    (or input gradient) for the next stage's, the last stage's for its own forward, a weight
    gradient for its input gradient."""
    kind, stage, micro = action
    if kind == "F":
        return ("F", stage - 1, micro) if stage > 0 else None
    if kind == "W":
        return ("I", stage, micro)
    if stage == last_stage:
        return ("F", stage, micro)
    return ("I" if split else "B", stage + 1, micro)


def play(
    orders: Sequence[Sequence[Action]],
    seconds: Mapping[tuple[str, int], float],
    stage_rank: Mapping[int, int],
    hop_s: float,
) -> list[float] | None:
    """Each rank's finish time when rank r runs ``orders[r]`` in order, an action of kind k on
    stage s taking ``seconds[(k, s)]`` and a dependency from another rank arriving ``hop_s``
    after it finished; None when an order waits for an action no rank runs."""
    last_stage = max(stage_rank)
    split = any(kind == "I" for order in orders for kind, _, _ in order)
    done: dict[Action, float] = {}
    clock = [0.0] * len(orders)
    position = [0] * len(orders)
    progressed = True
    while progressed:
        progressed = False
        for rank, order in enumerate(orders):
            while position[rank] < len(order):
                action = order[position[rank]]
                need = _needs(action, last_stage, split)
                if need is not None and need not in done:
                    break
                ready = 0.0
                if need is not None:
                    ready = done[need] + (hop_s if stage_rank[need[1]] != rank else 0.0)
                clock[rank] = max(clock[rank], ready) + seconds[(action[0], action[1])]
                done[action] = clock[rank]
                position[rank] += 1
                progressed = True
    if any(p < len(order) for p, order in zip(position, orders)):
        return None
    return clock

"""A pipeline schedule step played out over torch's own action order: with equal stages and
free hops it idles exactly as the closed form says; unequal stages and slow hops cost more;
an order that waits for an action nobody runs is refused."""

from __future__ import annotations

import pytest

from autopar.parallel.pipelining.schedule import rank_actions
from autopar.planner.pipeline_sim import play

LOOP = {0: 0, 1: 1, 2: 0, 3: 1}  # Interleaved1F1B: stage s on rank s mod 2
V = {0: 0, 1: 1, 2: 1, 3: 0}  # ZBV: rank 0 holds the first and the last stage


def seconds(forward: list[float]) -> dict[tuple[str, int], float]:
    """Each stage's forward; its backward twice that, an input or weight gradient once."""
    table = {}
    for s, f in enumerate(forward):
        table |= {("F", s): f, ("B", s): 2 * f, ("I", s): f, ("W", s): f}
    return table


def step(name: str, placement: dict[int, int], forward: list[float], hop: float = 0.0) -> float:
    orders = [rank_actions(name, 2, 4, 8, rank) for rank in range(2)]
    finish = play(orders, seconds(forward), placement, hop)
    assert finish is not None
    return max(finish)


@pytest.mark.parametrize(
    "name, placement, bubble",
    [("Interleaved1F1B", LOOP, 1 / 16), ("ZBVZeroBubble", V, 1 / 48)],
)
def test_equal_stages_with_free_hops_idle_as_the_closed_form(name, placement, bubble):
    busy = 2 * 8 * 3  # two stages a rank, eight micro-batches, a forward and a backward of 3
    assert step(name, placement, [1.0] * 4) == pytest.approx(busy * (1 + bubble))


def test_a_stage_with_twice_the_blocks_stalls_the_schedule_beyond_its_ranks_work():
    # the even split's 4 layers in 4 stages: [embed, 0], [1, 2], [3], [head]: each rank
    # holds two blocks, but its stages do not take turns evenly
    balanced = step("Interleaved1F1B", LOOP, [1.0, 1.0, 1.0, 1.0])
    uneven = step("Interleaved1F1B", LOOP, [1.0, 2.0, 1.0, 0.0])
    assert uneven > 1.2 * balanced


def test_each_hop_on_the_critical_path_adds_its_time():
    assert step("Interleaved1F1B", LOOP, [1.0] * 4, hop=0.5) > step("Interleaved1F1B", LOOP, [1.0] * 4)


def test_an_order_waiting_for_an_action_nobody_runs_is_refused():
    orders = [[("F", 0, 0)], [("B", 1, 0)]]  # the last stage's backward needs its forward
    assert play(orders, seconds([1.0, 1.0]), {0: 0, 1: 1}, 0.0) is None


def test_one_stage_1f1b_with_a_light_first_stage_idles_its_last_rank_for_one_forward_and_backward():
    orders = [rank_actions("1F1B", 2, 2, 4, rank) for rank in range(2)]
    finish = play(orders, seconds([1.0, 3.0]), {0: 0, 1: 1}, 0.0)
    assert finish is not None
    heavy = 4 * (3.0 + 6.0)  # the last rank's four forwards and backwards, never waiting after the first
    assert max(finish) == pytest.approx(heavy + 1.0 + 2.0)  # (pp - 1) / n_micro of it would be 9

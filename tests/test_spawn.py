"""Ranks spawned for many checks in one process group: a rank that raises or crashes fails
the one item it was running, with its traceback or its Python stacks, and fresh ranks run the
items after it."""

from __future__ import annotations

import os

import pytest

from autopar.cli.spawn import RankFailure, run_each_on_ranks, run_on_ranks


def _item(value: int, fault: str = "") -> int:
    import torch
    import torch.distributed as dist

    total = torch.tensor([float(value)])
    dist.all_reduce(total)
    if fault == "abort" and dist.get_rank() == 1:
        os.abort()  # as a heap check in native code does: SIGABRT, no Python traceback
    if fault == "raise" and dist.get_rank() == 0:
        raise ValueError(f"item {value} refused")
    return int(total.item())


@pytest.fixture(scope="module")
def outcomes():
    items = [(1,), (2, "abort"), (3,), (4, "raise"), (5,)]
    return run_each_on_ranks(_item, 2, items, timeout_s=120)


def test_items_before_and_after_a_failure_give_every_ranks_result(outcomes):
    assert [outcomes[i] for i in (0, 2, 4)] == [[2, 2], [6, 6], [10, 10]]


def test_a_crashed_rank_fails_its_own_item_with_the_stacks_it_wrote_dying(outcomes):
    failure = outcomes[1]
    assert isinstance(failure, RankFailure) and failure.item == 1
    assert "rank 1 of 2" in failure.text and "code -6" in failure.text, failure.text
    assert "_item" in failure.text, failure.text  # faulthandler's stack names the function


def test_a_raising_rank_fails_its_own_item_with_its_traceback(outcomes):
    failure = outcomes[3]
    assert isinstance(failure, RankFailure) and "ValueError: item 4 refused" in failure.text


def _barrier_unless_killed(victim: int) -> None:
    import signal

    import torch.distributed as dist

    if dist.get_rank() == victim:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()


def test_a_rank_killed_without_a_traceback_is_named_beside_its_peers_error():
    with pytest.raises(RuntimeError) as failure:
        run_on_ranks(_barrier_unless_killed, 2, 1, timeout_s=120)
    assert "rank 1" in str(failure.value) and "code -9" in str(failure.value), str(failure.value)

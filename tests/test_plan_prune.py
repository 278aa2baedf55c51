"""The search by bounds gives the exhaustive search's answer: the same best plans, in the same
order, with the same predictions, having scored fewer of them; and the model's op count,
taken from one block of each kind, is the whole model's."""

from __future__ import annotations

import copy
import functools

import pytest
import torch

from autopar.cli.plan import main as plan_main
from autopar.planner.devices import PRESETS, device_spec
from autopar.planner.measured import forward_op_share, ops_per_micro_batch
from autopar.planner.memory import GIB, weights_floor
from autopar.planner.params import meta_model
from autopar.planner.probe import count_ops, forward_backward
from autopar.planner.prune import tokens_per_s_bound
from autopar.planner.search import lightest, runtime_reserve, search, search_counted, valid_plans
from autopar.planner.time import busy_time
from autopar.training.resolve import model_args, parse_job

H100 = PRESETS["h100"]
KEEP = 10

QUESTIONS = {
    # name: (job flags, world size, pinned fields)
    "dense, free": (["--job.config", "debug_model", "--training.seq_len", "512"], 8, set()),
    "Qwen3-8B on 16": (["--job.config", "qwen3_8b"], 16, set()),
    "mixture of experts": (["--job.config", "debug_model", "--model.flavor", "debug-moe"], 8, set()),
    "Qwen3.5 hybrid": (["--job.config", "debug_model_qwen3.5"], 8, set()),
    "LoRA DPO": (["--job.config", "qwen3_8b_dpo_lora"], 8, set()),
    "pinned TP, held global batch": (
        [
            "--job.config",
            "qwen3_8b",
            "--parallelism.tensor_parallel_degree",
            "2",
            "--training.global_batch_size",
            "64",
        ],
        16,
        {"parallelism.tensor_parallel_degree"},
    ),
    "Qwen3-32B on 16, weights that pass the device": (["--job.config", "qwen3_32b"], 16, set()),
}
FLOORED = "Qwen3-32B on 16, weights that pass the device"
"""A question where some plans' weights alone cannot fit (``memory.weights_floor``)."""


@functools.cache
def exhaustive(question: str) -> tuple:
    """(job, model args, every plan ranked) of a question, searched once for the tests here."""
    argv, world, pinned = QUESTIONS[question]
    job = parse_job(argv)
    args = model_args(job)
    return job, args, search(job, args, world, 8, H100, pinned)


def prediction(plan) -> tuple:
    """Everything a plan shows: its settings, degrees, memory parts, time parts and speed."""
    return plan.settings, plan.dims, plan.memory, plan.fits, plan.time, plan.tokens_per_s, plan.mfu


@pytest.mark.parametrize("question", QUESTIONS)
def test_the_pruned_search_returns_the_exhaustive_searchs_best_plans(question):
    _, world, pinned = QUESTIONS[question]
    job, args, every = exhaustive(question)
    pruned = search_counted(job, args, world, 8, H100, pinned, keep=KEEP)
    assert [prediction(p) for p in pruned.plans[:KEEP]] == [prediction(p) for p in every[:KEEP]]
    # the rest it scored keep the exhaustive order, and it scored fewer
    position = {p.settings: i for i, p in enumerate(every)}
    order = [position[p.settings] for p in pruned.plans]
    assert order == sorted(order) and len(every) == pruned.valid
    assert pruned.scored < pruned.valid


@pytest.mark.parametrize("question", QUESTIONS)
def test_a_plan_without_checkpointing_that_never_reshards_bounds_each_plan_it_stands_for(question):
    argv, world, pinned = QUESTIONS[question]
    job = parse_job(argv)
    args = model_args(job)
    valid, _ = valid_plans(job, args, world, 8, pinned, "cuda")
    for settings, candidate, dims in valid:
        own = tokens_per_s_bound(busy_time(args, candidate, dims, H100, 8))
        lightest_job = lightest(settings).apply(job)
        assert own <= tokens_per_s_bound(busy_time(args, lightest_job, dims, H100, 8)), settings


def over_the_device(args, job, plan) -> bool:
    """Whether ``plan``'s weights floor and runtime reserve alone pass the H100."""
    floor = weights_floor(args, plan.settings.apply(job), plan.dims)
    return floor + runtime_reserve(floor, plan.dims) > H100.memory_gib * GIB


@pytest.mark.parametrize("question", QUESTIONS)
def test_the_weights_floor_is_at_most_each_plans_predicted_peak(question):
    """The floor (weights, optimizer state, a pipeline's unsharded gradients, the runtime
    reserve) lets the search skip plans it shows cannot fit: it must never pass a prediction."""
    job, args, every = exhaustive(question)
    for plan in every:
        floor = weights_floor(args, plan.settings.apply(job), plan.dims)
        assert floor + runtime_reserve(floor, plan.dims) <= plan.memory.peak, plan.describe()


def test_the_search_sets_aside_plans_whose_weights_alone_pass_the_device():
    job, args, every = exhaustive(FLOORED)
    pruned = search_counted(job, args, 16, 8, H100, keep=3)
    assert any(over_the_device(args, job, p) for p in every)
    assert not any(over_the_device(args, job, p) for p in pruned.plans)


def test_a_question_nothing_fits_is_scored_whole_and_names_the_smallest_peak():
    job = parse_job(["--job.config", "qwen3_32b"])
    args = model_args(job)
    small = device_spec("h100", 16.0)
    pruned = search_counted(job, args, 8, 8, small, keep=3)
    assert pruned.scored == pruned.valid
    assert prediction(pruned.plans[0]) == prediction(search(job, args, 8, 8, small)[0])


@pytest.mark.parametrize(
    "flags", [["debug_model"], ["debug_model_qwen3.5"], ["debug_model", "--model.flavor", "debug-moe"]]
)
def test_op_counts_from_one_block_of_each_kind_equal_the_whole_models(flags):
    args = model_args(parse_job(["--job.config", *flags]))
    model = copy.deepcopy(meta_model(args)).to(torch.bfloat16)
    whole = count_ops(forward_backward(model, torch.device("meta")))
    ids = torch.zeros(1, 8, dtype=torch.long, device="meta")
    with torch.no_grad():
        forward = count_ops(lambda: model(ids))
    assert ops_per_micro_batch(args) == whole
    assert forward_op_share(args) == forward / whole


def test_plan_profile_search_says_how_many_plans_were_scored_and_pruned(capsys):
    assert (
        plan_main(["--job.config", "debug_model", "--world-size", "8", "--top", "2", "--profile-search"]) == 0
    )
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("search:"))
    candidates, valid, scored, pruned = (int(w) for w in line.replace(",", "").split() if w.isdigit())
    assert valid <= candidates and scored + pruned == valid and pruned > 0

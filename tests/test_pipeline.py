"""Pipeline parallelism: stage splits, every torch schedule, and composition, against one device."""

from __future__ import annotations

import copy

import pytest
import torch

from autopar.cli.parity import Case, relative_deltas, run_cases, run_plans
from autopar.config import ConfigError
from autopar.models import Qwen, build_model, get_flavor
from autopar.parallel.pipelining.schedule import SCHEDULE_STYLES, rank_actions, rank_stage_gathers
from autopar.parallel.pipelining.split import check_split, even_split, prune, stage_ids
from autopar.planner import space
from autopar.training.preflight import check_job

from jobs import ac_flags, assert_fp32_parity, assert_same_training, debug_job, tiny_job


@pytest.mark.parametrize("layers, stages", [(2, 2), (4, 2), (5, 2), (7, 4), (7, 3), (8, 8), (9, 4)])
def test_even_split_places_every_layer_once_in_order(layers, stages):
    split = even_split(layers, stages, 1, 1)
    assert len(split) == stages
    flat = [name for stage in split for name in stage]
    assert flat == ["embed_tokens"] + [f"layers.{i}" for i in range(layers)] + ["norm", "lm_head"]
    check_split(split, layers)


def test_even_split_balances_layers_with_embedding_and_head_counted_as_layers():
    layers = [len([n for n in s if n.startswith("layers")]) for s in even_split(10, 4, 1, 1)]
    assert layers == [2, 3, 3, 2]  # 12 units: embedding + 2, 3, 3, 2 + head
    units = [len([n for n in s if n.startswith("layers")]) for s in even_split(8, 4, 1, 2)]
    assert [units[0] + 1, units[1], units[2], units[3] + 2] == [3, 3, 3, 2]  # 11 units


@pytest.mark.parametrize("layers, stages", [(5, 2), (7, 4)])
def test_split_covers_every_parameter_exactly_once(layers, stages):
    args = get_flavor("qwen3", "debug", num_hidden_layers=layers, tie_word_embeddings=False)
    with torch.device("meta"):
        model = Qwen(args)
    names = [n for part in even_split(layers, stages, 1, 1) for n, _ in prune(model, part).named_parameters()]
    assert sorted(names) == sorted(n for n, _ in model.named_parameters())
    assert len(names) == len(set(names))


def test_qwen3_5s_head_goes_to_the_last_stage_with_the_output_head():
    args = get_flavor(
        "qwen3.5", "debug", num_hidden_layers=4, mtp_num_hidden_layers=1, tie_word_embeddings=False
    )
    with torch.device("meta"):
        model = build_model(args)
    parts = [prune(model, names) for names in even_split(4, 3, 1, 1)]
    heads = [{n for n, _ in part.named_parameters() if n.startswith("mtp.")} for part in parts]
    assert heads[:-1] == [set(), set()] and heads[-1] == {
        n for n, _ in model.named_parameters() if n.startswith("mtp.")
    }


def test_stage_ids_loop_and_v():
    assert stage_ids(1, 2, 4, "loop") == [1, 3]
    assert stage_ids(0, 2, 4, "v") == [0, 3]
    assert stage_ids(1, 2, 4, "v") == [1, 2]


def pp_job(*flags: str, layers: int = 4):
    return debug_job("--model.num_hidden_layers", str(layers), "--model.tie_word_embeddings", "false", *flags)


@pytest.mark.parametrize(
    "world, flags, message",
    [
        (
            2,
            [
                "--parallelism.pipeline_parallel_degree",
                "2",
                "--parallelism.pipeline_parallel_layers_per_stage",
                "1",
                "--parallelism.pipeline_parallel_schedule",
                "1F1B",
            ],
            "runs exactly 1 stage\\(s\\) per rank, but the split gives 6 stages",
        ),
        (
            2,
            [
                "--parallelism.pipeline_parallel_degree",
                "2",
                "--parallelism.pipeline_parallel_schedule",
                "Interleaved1F1B",
            ],
            None,
        ),
        (
            4,
            [
                "--parallelism.pipeline_parallel_degree",
                "4",
                "--parallelism.pipeline_parallel_schedule",
                "ZBVZeroBubble",
            ],
            "cannot split 4 layers into 8 stages",
        ),
        (
            2,
            [
                "--parallelism.pipeline_parallel_degree",
                "2",
                "--parallelism.pipeline_parallel_microbatch_size",
                "3",
            ],
            "pipeline_parallel_microbatch_size=3 does not divide training.local_batch_size=8",
        ),
        (
            2,
            [
                "--parallelism.pipeline_parallel_degree",
                "2",
                "--parallelism.pipeline_parallel_schedule",
                "ZBVZeroBubble",
                "--parallelism.pipeline_parallel_layers_per_stage",
                "1",
            ],
            "runs exactly 2 stage\\(s\\) per rank, but the split gives 6",
        ),
        (
            2,
            [
                "--parallelism.pipeline_parallel_degree",
                "2",
                "--parallelism.pipeline_parallel_microbatch_size",
                "8",
            ],
            "1F1B needs at least as many micro-batches as stages: .* = 1 < 2",
        ),
        (
            2,
            [
                "--parallelism.pipeline_parallel_degree",
                "2",
                "--parallelism.pipeline_parallel_schedule",
                "Zigzag",
            ],
            "pipeline_parallel_schedule='Zigzag' is unknown",
        ),
        (
            2,
            [
                "--parallelism.pipeline_parallel_degree",
                "2",
                "--parallelism.module_fqns_per_model_part",
                "embed_tokens,layers.0,layers.1;layers.3,norm,lm_head",
            ],
            "'layers.2' is in no stage",
        ),
        (
            2,
            [
                "--parallelism.pipeline_parallel_degree",
                "2",
                "--parallelism.module_fqns_per_model_part",
                "embed_tokens,layers.0,layers.1,layers.2;layers.2,layers.3,norm,lm_head",
            ],
            "'layers.2' is in stage 0 and stage 1",
        ),
        (
            2,
            [
                "--parallelism.pipeline_parallel_degree",
                "2",
                "--parallelism.module_fqns_per_model_part",
                "embed_tokens,layers.2,layers.3;layers.0,layers.1,norm,lm_head",
            ],
            "layers must run in order",
        ),
        (
            2,
            [
                "--parallelism.pipeline_parallel_degree",
                "2",
                "--parallelism.module_fqns_per_model_part",
                "embed_tokens,layers.0,layers.1,norm;layers.2,layers.3,lm_head",
            ],
            "norm, lm_head in the last",
        ),
        (
            2,
            ["--parallelism.pipeline_parallel_degree", "2", "--model.tie_word_embeddings", "true"],
            "tie_word_embeddings=true with pipeline_parallel_degree=2",
        ),
    ],
)
def test_impossible_pipelines_are_refused(world, flags, message):
    job = pp_job(*flags)
    if message is None:  # a valid interleaved split: 4 stages of one layer each over 2 ranks
        check_job(job, world)
        return
    with pytest.raises(ConfigError, match=message):
        check_job(job, world)


def test_more_stages_than_layers_is_refused():
    with pytest.raises(
        ConfigError, match="pipeline_parallel_degree=8 is more stages than num_hidden_layers=4"
    ):
        check_job(pp_job("--parallelism.pipeline_parallel_degree", "8"), 8)


PLANS = {
    # name: (plan, layers)
    "GPipe": ("pp=2,schedule=GPipe", 4),
    "1F1B": ("pp=2,schedule=1F1B", 4),
    "Interleaved1F1B": ("pp=2,schedule=Interleaved1F1B", 4),
    "InterleavedZeroBubble": ("pp=2,schedule=InterleavedZeroBubble", 4),
    "ZBVZeroBubble": ("pp=2,schedule=ZBVZeroBubble", 4),
    "DualPipeV": ("pp=2,schedule=DualPipeV", 4),
    "7 layers / 4 stages": ("pp=4", 7),
    "6 layers / 4 stages per rank": (  # the planner's deeper interleaving (space.STAGES_PER_RANK)
        "pp=2,schedule=Interleaved1F1B,parallelism.pipeline_parallel_layers_per_stage=1",
        6,
    ),
    "PP2 x FSDP2": ("pp=2,dp_shard=2", 4),
    "PP2 x TP2": ("pp=2,tp=2", 4),
    "ZBVZeroBubble x TP2": (
        "pp=2,tp=2,schedule=ZBVZeroBubble",
        4,
    ),  # a vocab-parallel loss, detached in place
    # (PP x FSDP x TP runs in test_plan_combinations.py, in its one eight-rank group)
    "1F1B, micro-batches of 2": ("pp=2,schedule=1F1B,parallelism.pipeline_parallel_microbatch_size=2", 4),
}

ZERO_BUBBLE = [name for name, style in SCHEDULE_STYLES.items() if style.splits_backward]


SCHEDULE_AC = {
    f"{schedule} + AC {mode}/{option}": (f"pp=2,schedule={schedule},{ac_flags(mode, option)}", 4)
    for schedule in sorted(set(space.SCHEDULES) | set(ZERO_BUBBLE))
    for mode, option in space.AC_MODES
    if mode != "none"
}
"""Every schedule the planner searches, and every zero-bubble schedule (which recompute a
checkpointed block twice per micro-batch: input, then weight gradients), with every
activation checkpointing mode it searches, read from ``planner/search.py``: a choice added
there runs here. The default run takes each mode once, with the schedules in turn (the zero-bubble
ones, which split the backward, first); the rest are heavy."""
_MODES = [m for m in space.AC_MODES if m[0] != "none"]
_IN_TURN = {
    f"{schedule} + AC {mode}/{option}"
    for schedule, (mode, option) in zip(
        sorted(set(space.SCHEDULES) | set(ZERO_BUBBLE), key=lambda s: (s not in ZERO_BUBBLE, s)), _MODES
    )
}
PLANS |= {name: plan for name, plan in SCHEDULE_AC.items() if name in _IN_TURN}
PLANS |= {
    "ZBVZeroBubble + per-op AC, compiled": (
        "pp=2,schedule=ZBVZeroBubble,compile.enable=true," + ac_flags("selective", "op"),
        4,
    ),
    "DualPipeV x CP2 + full AC": ("pp=2,cp=2,schedule=DualPipeV," + ac_flags("full", "op"), 4),
}
HEAVY_PLANS = {name: plan for name, plan in SCHEDULE_AC.items() if name not in _IN_TURN} | {
    "ZBVZeroBubble + full AC, compiled": (
        "pp=2,schedule=ZBVZeroBubble,compile.enable=true," + ac_flags("full", "op"),
        4,
    ),
    "InterleavedZeroBubble, compiled": ("pp=2,schedule=InterleavedZeroBubble,compile.enable=true", 4),
    "LoopedBFS": ("pp=2,schedule=LoopedBFS", 4),
    "5 layers / 2 stages": ("pp=2", 5),
    "7 layers / 4 interleaved stages": ("pp=2,schedule=Interleaved1F1B", 7),
    "ZBVZeroBubble x CP2 + per-op AC": ("pp=2,cp=2,schedule=ZBVZeroBubble," + ac_flags("selective", "op"), 4),
}
"""The other schedule and checkpointing pairs, more compiled zero-bubble schedules (the
split backward of a compiled graph: a minute of compilation beside the compiled per-op case
above), LoopedBFS (placed as Interleaved1F1B), the other uneven splits (7 layers over 4
stages shows one) and ZBV beside CP (DualPipeV x CP2 shows a V schedule
there); python -m pytest -m heavy."""


def run_pipelines(folder, plans: dict[str, tuple[str, int]]) -> dict:
    bases = {
        layers: tiny_job(
            folder, "--training.local_batch_size", "4", num_hidden_layers=layers, tie_word_embeddings=False
        )
        for layers in {n for _, n in plans.values()}
    }
    cases = [Case(bases[layers], plan) for plan, layers in plans.values()]
    return dict(zip(plans, run_cases(cases, steps=3)))  # step 2 shows a wrong gradient


@pytest.fixture(scope="module")
def pipeline_runs(tmp_path_factory):
    return run_pipelines(tmp_path_factory.mktemp("pp"), PLANS)


@pytest.mark.slow
@pytest.mark.parametrize("name", PLANS)
def test_pipeline_matches_single_device(pipeline_runs, name):
    assert_pipeline_matches(*pipeline_runs[name], name)


@pytest.mark.heavy
def test_the_other_schedule_pairs_and_compiled_zero_bubble_pipelines_match_single_device(tmp_path):
    for name, (reference, run) in run_pipelines(tmp_path, HEAVY_PLANS).items():
        assert_pipeline_matches(reference, run, name)


def assert_pipeline_matches(reference, run, name: str) -> None:
    if "compiled" in name:  # inductor also fuses and reorders sums: 1e-4, as every compiled plan
        assert_same_training(run, reference, loss_rtol=1e-4, norm_rtol=1e-4)
    else:
        assert_fp32_parity(run, reference)


@pytest.mark.slow
def test_checkpoint_saved_under_pp2_resumes_without_pipelining(tmp_path):
    flags = [
        "--training.steps",
        "6",
        "--training.global_batch_size",
        "4",
        "--training.local_batch_size",
        "4",
        "--checkpoint.enable",
        "true",
        "--checkpoint.interval",
        "3",
    ]
    pp2 = ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1"]
    dp2 = ["--parallelism.data_parallel_shard_degree", "2", "--training.local_batch_size", "2"]
    jobs = [
        ("pp2", tiny_job(tmp_path, *flags, *pp2, num_hidden_layers=4, tie_word_embeddings=False)),
        (
            "pp2->fsdp2",
            tiny_job(
                tmp_path,
                *flags,
                *dp2,
                "--checkpoint.load_step",
                "3",
                num_hidden_layers=4,
                tie_word_embeddings=False,
            ),
        ),
    ]
    runs = {r.plan: r for r in run_plans(copy.deepcopy(jobs), 2)}
    uninterrupted, resumed = runs["pp2"], runs["pp2->fsdp2"]
    assert len(resumed.losses) == 3
    assert max(relative_deltas(resumed.losses, uninterrupted.losses[3:])) <= 1e-5


def test_a_schedule_gathers_each_fsdp_stage_once_unless_it_holds_more_than_torch_keeps_gathered():
    assert rank_stage_gathers("1F1B", 4, 4, 16, 0) == 1
    assert rank_stage_gathers("Interleaved1F1B", 4, 8, 16, 0) == 2  # two stages, each once
    assert rank_stage_gathers("ZBVZeroBubble", 4, 8, 16, 1) == 2
    assert rank_stage_gathers("Interleaved1F1B", 4, 32, 16, 0) > 8  # eight stages, some again


def test_rank_actions_follow_torchs_schedule_order():
    one_f_one_b = rank_actions("1F1B", 2, 2, 4, 0)
    assert [f"{k}{m}" for k, _, m in one_f_one_b] == ["F0", "F1", "B0", "F2", "B1", "F3", "B2", "B3"]
    last = rank_actions("1F1B", 2, 2, 4, 1)  # the loop torch runs, not the order it lists
    assert [f"{k}{s}{m}" for k, s, m in last] == ["F10", "B10", "F11", "B11", "F12", "B12", "F13", "B13"]
    gpipe = rank_actions("GPipe", 2, 2, 2, 1)
    assert [f"{k}{m}" for k, _, m in gpipe] == ["F0", "F1", "B0", "B1"]
    zbv = rank_actions("ZBVZeroBubble", 2, 4, 2, 1)
    assert {s for _, s, _ in zbv} == {1, 2}  # the V: rank 1 holds stages 1 and 2
    assert {k for k, _, _ in zbv} == {"F", "I", "W"}

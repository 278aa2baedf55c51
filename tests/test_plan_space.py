"""The planner's search space is the tested space: combinations it can recommend train and equal
one device.

The choices are read from ``planner/search.py`` itself (``SCHEDULES``, ``AC_MODES``, its
reshard and zero-bubble rules), never copied, so a choice added there runs here. Families are
the mechanisms a plan or its job adds: TP+SP, CP, replicas, EP, FSDP resharding, CPU offload, the
chunked loss and FP8 (torchao). The full product of family x pipeline x checkpointing is 144
combinations; an all-pairs design covers every (family, pipeline) and every (family, AC mode)
pair the search can emit in about a quarter of that (every (pipeline, AC mode) pair runs in
``test_pipeline.py``). A combination the trainer's ``check_job`` refuses is one the planner can
never emit (it validates every plan), so it is left out, and said.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest

from autopar.cli.parity import Case, plan_job, plan_overrides, run_cases, world_size
from autopar.config.errors import ConfigError
from autopar.planner import space
from autopar.planner.dry_run import compare
from autopar.planner.settings import PLAN_FIELDS
from autopar.training.preflight import check_job
from autopar.training.resolve import derive_job, parse_job

from jobs import assert_fp32_parity, moe_job, tiny_job

MOE = "moe"
FAMILIES: dict[str, tuple[tuple[str, ...], str]] = {
    # name: (base-job flags, one device runs them too; plan)
    "plain": ((), ""),
    "TP+SP": ((), "tp=2"),
    "CP": ((), "cp=2"),
    "replicas (DDP)": ((), "dp_replicate=2"),
    "EP": ((MOE,), "dp_shard=2,ep=2"),
    "FSDP reshard never": ((), "dp_shard=2,parallelism.fsdp_reshard_after_forward=never"),
    "CPU offload": ((), "training.enable_cpu_offload=true"),
    "chunked loss": (("--training.loss_chunk_tokens", "16"), ""),
    "FP8 (torchao)": (("--float8.enable", "true"), ""),
}
PIPELINES = ["none", *space.SCHEDULES]
Combo = tuple[str, str, str]  # (family, pipeline, AC mode)
AC = [f"{mode}/{option}" for mode, option in (*space.AC_MODES, space.REGATHER)]
"""Every checkpointing mode the search tries (``REGATHER`` where a plan has TP + SP: ``check_job``
refuses it elsewhere)."""


def plan_text(family: str, pipeline: str, ac: str) -> str:
    mode, option = ac.split("/")
    items = [FAMILIES[family][1]] if FAMILIES[family][1] else []
    if pipeline != "none":
        items.append(f"pp=2,schedule={pipeline}")
        if "--float8.enable" in FAMILIES[family][0]:  # two micro-batches of one sequence
            items.append("training.local_batch_size=2")
    items.append(f"activation_checkpoint.mode={mode},activation_checkpoint.selective_ac_option={option}")
    return ",".join(items)


def searchable(family: str, pipeline: str, ac: str) -> bool:
    """Whether the search enumerates this combination (its own rules)."""
    pp = 1 if pipeline == "none" else 2
    if "reshard_after_forward=never" in FAMILIES[family][1] and "never" not in space.reshard_options(pp):
        return False
    return not (pp > 1 and space.checkpointing_saves_nothing(pipeline, ac.split("/")[0], set()))


STEPS = 3
"""Enough for the optimizer state and the weights both to differ from their start: a wrong
gradient shows in step 2's loss and in every gradient norm."""
BATCH = ("--training.local_batch_size", "4", "--training.global_batch_size", "8")
"""Two micro-steps of accumulation at dp 1: the 5-step trajectory whose fp32 noise stays
below 1e-5 on AVX2 and AVX-512 (at global batch 4 its fifth step amplifies it to ~1e-3)."""
FP8_BATCH = ("--training.local_batch_size", "1", "--training.global_batch_size", "8")
"""FP8 scales each tensor by its own amax per forward, so one device must see the sequences
one at a time, as a pipeline's micro-batches of one do."""


def base_job(folder, family: str):
    flags = FAMILIES[family][0]
    if MOE in flags:
        return moe_job(folder, *BATCH, "--model.num_hidden_layers=4")
    batch = FP8_BATCH if "--float8.enable" in flags else BATCH
    return tiny_job(folder, *batch, *flags, num_hidden_layers=4, tie_word_embeddings=False)


def greedy_cover(
    candidates: list[Combo], values: Callable[[Combo], set[str]], prefer=lambda c: 0
) -> list[Combo]:
    """Few candidates whose ``values`` cover all of theirs: each time the one adding the most
    (ties by ``prefer``, then the first)."""
    uncovered = set().union(*(values(c) for c in candidates))
    chosen = []
    while uncovered:
        best = max(candidates, key=lambda c: (len(values(c) & uncovered), prefer(c)))
        chosen.append(best)
        uncovered -= values(best)
    return chosen


def all_pairs(candidates: list[Combo]) -> list[Combo]:
    """Few combinations covering every (family, pipeline) and (family, AC) pair among the
    candidates."""
    return greedy_cover(candidates, lambda c: {f"{c[0]}|pp:{c[1]}", f"{c[0]}|ac:{c[2]}"})


def design(folder) -> tuple[list[Combo], dict[Combo, str]]:
    """The combinations to run, and those ``check_job`` refuses with its reason."""
    runnable, refused = [], {}
    for combo in itertools.product(FAMILIES, PIPELINES, AC):
        if not searchable(*combo):
            continue
        base = base_job(folder, combo[0])
        job = plan_job(base, plan_text(*combo), STEPS, str(folder / "probe"))
        try:
            check_job(job, world_size(job))
        except ConfigError as err:
            refused[combo] = str(err)
            continue
        runnable.append(combo)
    return all_pairs(runnable), refused


@pytest.fixture(scope="module")
def space_runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("space")
    chosen, refused = design(folder)
    cases = [Case(base_job(folder, c[0]), plan_text(*c)) for c in chosen]
    return dict(zip(chosen, run_cases(cases, steps=STEPS))), refused


def test_the_design_covers_every_family_with_every_searched_schedule_and_ac_mode(tmp_path):
    chosen, refused = design(tmp_path)
    covered = {(f, "pp:" + p) for f, p, _ in chosen} | {(f, "ac:" + a) for f, _, a in chosen}
    for family, pipeline, ac in itertools.product(FAMILIES, PIPELINES, AC):
        combo = (family, pipeline, ac)
        if searchable(*combo) and combo not in refused:
            assert (family, "pp:" + pipeline) in covered and (family, "ac:" + ac) in covered, combo
    assert len(chosen) < len(FAMILIES) * len(PIPELINES) * len(AC) / 2


@pytest.mark.heavy  # 2 minutes; each family and schedule runs in its own parity file
def test_every_combination_the_search_can_emit_trains_like_one_device(space_runs):
    runs, _ = space_runs
    failures = []
    for (family, pipeline, ac), (reference, run) in runs.items():
        # fp32 on CPU, STEPS steps: only the order of sums differs (FP8 rounds the same values,
        # scaled by the same amax, to the same grid)
        try:
            assert_fp32_parity(run, reference)
        except AssertionError as err:
            failures.append(f"{family} x {pipeline} x AC {ac}: {err}")
    assert not failures, "\n".join(failures)
    assert len(runs) >= len(FAMILIES) * len(PIPELINES) // 2


def varied_fields(plans: list[str]) -> set[str]:
    """The job fields these parity plans set away from a single device's value."""
    out = set()
    for plan in plans:
        for item in plan_overrides(plan):
            key, value = item.split("=", 1)
            if not (key.endswith("_degree") and value == "1"):
                out.add(key)
    return out


def test_every_setting_the_search_chooses_is_varied_by_a_parity_plan(tmp_path):
    """A setting added to ``PlanSettings`` fails here until a parity plan varies it."""
    from test_pipeline import PLANS as PIPELINE_PLANS

    chosen, _ = design(tmp_path)
    varied = varied_fields([plan_text(*c) for c in chosen]) | varied_fields(
        [p for p, _ in PIPELINE_PLANS.values()]
    )
    varied.add("training.local_batch_size")  # every base job sets it (4, and 1 for FP8)
    assert set(PLAN_FIELDS) <= varied, set(PLAN_FIELDS) - varied


SCALE_MODELS = {
    "dense": ("--model.name=qwen3", "--model.flavor=0.6B", "--model.tie_word_embeddings=false"),
    MOE: ("--model.name=qwen3", "--model.flavor=30B-A3B", "--model.vocab_size=2048"),
}
"""Real layer shapes: Qwen3-0.6B's (untied: a pipeline splits it), and 30B-A3B's experts for EP
(a small vocabulary, so the experts dominate)."""
SCALE_FLAGS = {
    "--training.loss_chunk_tokens": ("--training.loss_chunk_tokens=1024",),
    "--float8.enable": ("--float8.enable=true", "--float8.backend=torchao"),
}
"""A family's own flags at that scale: 1024-token loss chunks, FP8 through torchao (CPU's; the
dry run measures FP8 linears as bf16)."""


SCALE_BATCH = ("--training.local_batch_size=2", "--training.global_batch_size=4")
"""Two micro-steps at dp 1, two micro-batches in a pipeline: each fake step costs seconds per
micro-batch."""


def scale_job(family: str, pipeline: str, ac: str):
    """The combination at real layer shapes and 4096 tokens, with 2 layers (4 in a pipeline:
    two stages per rank): what the dry run builds under the fake process group and the
    planner predicts. Per-layer sizes are exact, so few layers test the same formulas."""
    flags = FAMILIES[family][0]
    model = SCALE_MODELS[MOE if MOE in flags else "dense"]
    extra = [f for flag in flags if flag in SCALE_FLAGS for f in SCALE_FLAGS[flag]]
    layers = 2 if pipeline == "none" else 4
    job = parse_job(
        [*model, f"--model.num_hidden_layers={layers}", "--training.seq_len=4096", *SCALE_BATCH, *extra]
    )
    return derive_job(job, plan_overrides(plan_text(family, pipeline, ac)))


def prediction_misses(combos: list[Combo]) -> list[str]:
    """Each combination's rank roles whose predicted peak is not within 10% of the dry run's."""
    misses = []
    for combo in combos:
        job = scale_job(*combo)
        world = world_size(job)
        for rank in compare(job, check_job(job, world, "cuda"), world):
            if rank.predicted_peak_gib != pytest.approx(rank.measured_peak_gib, rel=0.10):
                misses.append(f"{' x '.join(combo)}: {rank}")
    return misses


def cover_without_pipelines(combos: list[Combo]) -> list[Combo]:
    """Every family and AC mode of ``combos`` at least once, from those without a pipeline (one
    rank role to build; the grid in ``test_planner.py`` holds every schedule at real scale),
    checkpointed ones first: their peak comes late in backward, beside the landed gradients."""
    flat = [c for c in combos if c[1] == "none"]
    return greedy_cover(
        flat, lambda c: {"family:" + c[0], "ac:" + c[2]}, lambda c: not c[2].startswith("none")
    )


@pytest.mark.heavy  # the families at real shapes: test_planner's grid
def test_every_family_and_ac_mode_is_predicted_within_ten_percent_of_its_dry_run(tmp_path):
    """The memory model on the space it searches, at real layer shapes: each family and AC
    mode of the design at least once (every combination: the heavy test below)."""
    chosen, _ = design(tmp_path)
    cover = cover_without_pipelines(chosen)
    assert {c[0] for c in cover} == set(FAMILIES) and {c[2] for c in cover} == set(AC)
    misses = prediction_misses(cover)
    assert not misses, "\n".join(misses)


@pytest.mark.heavy
def test_every_combination_of_the_design_is_predicted_within_ten_percent_of_its_dry_run(tmp_path):
    chosen, _ = design(tmp_path)
    misses = prediction_misses(chosen)
    assert not misses, "\n".join(misses)
